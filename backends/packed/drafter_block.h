// The published drafter's backbone on 8-bit blocks: the same computation as DSparkDrafter's torch layers
// (backends/dspark/drafter.py), one call for a round's block and one for the context a round committed. In torch
// a round ran some 60 operations on a handful of tokens, each 10-15 us of dispatch on 2 cores: the backbone took
// 0.9-1.0 ms where its weights take about 0.2 ms to read. Included by kernels.cpp, after Matrix, multiply and
// add_into.
//
// The context's keys and values live in the caller's buffers, [layers, kv_heads, capacity, head_dim] each
// (ContextCache), written at the positions they were committed at. The block's own keys and values exist only for
// the call: the block attends to the whole context and to itself, both ways, as the drafter was trained.

// Rotate-half RoPE (transformers' order, which the drafter was trained in) of one head at one position.
inline void rope_half(float* v, int64_t dim, const float* c, const float* s) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i] + a * s[i];
    }
}

// q . k over dim (a multiple of 16) in AVX2, two accumulators: a scalar loop cannot be vectorised without
// reassociating its sum, which the build forbids (-ffp-contract=off, no fast-math).
inline float dot_product(const float* q, const float* k, int64_t dim) {
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
        a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d)));
        b = _mm256_add_ps(b, _mm256_mul_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(a, b));
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

class PackedDrafter {
   public:
    // matrices (Q8_0 tiles): fc [hidden, context_width], then per layer q [heads * dim, hidden], kv (rows k then v)
    // [2 * kv_heads * dim, hidden], o [hidden, heads * dim], gate_up (rows gate then up) [2 * ffn, hidden], down
    // [hidden, ffn]. norms: hidden_norm, the final norm, then per layer input, post-attention, q_norm and k_norm.
    // cos, sin: [positions, dim / 2].
    PackedDrafter(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t ffn,
                  int64_t context_width, double eps, std::vector<at::Tensor> matrices, std::vector<at::Tensor> norms,
                  at::Tensor cos, at::Tensor sin, std::shared_ptr<ComputePool> pool)
        : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), dim_(head_dim), ffn_(ffn), eps_(eps), cos_(cos),
          sin_(sin), norms_(norms), kernels_(pick_kernels()), pool_(checked_pool(pool)) {
        TORCH_CHECK((matrices.size() - 1) % 5 == 0 && norms.size() == 2 + 4 * (matrices.size() - 1) / 5,
                    "5 matrices and 4 norms a layer");
        TORCH_CHECK(head_dim % 16 == 0 && hidden % QK == 0 && ffn % QK == 0 && heads % kv_heads == 0,
                    "head_dim must be a multiple of 16, hidden and ffn multiples of 32");
        TORCH_CHECK(cos.dim() == 2 && cos.size(1) == head_dim / 2 && sin.sizes() == cos.sizes());
        layers_ = (static_cast<int64_t>(matrices.size()) - 1) / 5;
        matrices_.push_back(checked_matrix(matrices[0], FMT_Q8_0, hidden, context_width, true, "fc"));
        const int64_t shapes[5][2] = {
            {heads * head_dim, hidden}, {2 * kv_heads * head_dim, hidden}, {hidden, heads * head_dim},
            {2 * ffn, hidden},          {hidden, ffn}};
        for (size_t i = 1; i < matrices.size(); ++i) {
            const int64_t* shape = shapes[(i - 1) % 5];
            matrices_.push_back(
                checked_matrix(matrices[i], FMT_Q8_0, shape[0], shape[1], true, "matrix " + std::to_string(i)));
        }
    }

    // The keys and values of committed target features [T, context_width] at positions start..start + T - 1, into
    // those slots of keys and values.
    void extend(at::Tensor features, at::Tensor keys, at::Tensor values, int64_t start) {
        const Matrix& fc = matrices_[0];
        TORCH_CHECK(features.dtype() == at::kFloat && features.is_contiguous() && features.dim() == 2 &&
                        features.size(1) == fc.cols,
                    "features must be contiguous float32 [T, ", fc.cols, "]");
        const int64_t T = features.size(0);
        check_cache(keys, values, start + T);
        const int64_t kv_width = 2 * kv_heads_ * dim_, cap = keys.size(2);
        std::vector<float> context(T * hidden_), normed(T * hidden_), kv(T * kv_width);
        pybind11::gil_scoped_release no_gil;
        ComputePool::Session session(*pool_);
        QuantizedRows scratch;
        multiply(kernels_, fc, features.data_ptr<float>(), T, context.data(), scratch);
        kernels_.rms_norm(context.data(), T, hidden_, norms_[0].data_ptr<float>(), eps_, normed.data());
        for (int64_t l = 0; l < layers_; ++l) {
            multiply(kernels_, matrices_[2 + 5 * l], normed.data(), T, kv.data(), scratch);
            for (int64_t t = 0; t < T; ++t) {
                float* row = kv.data() + t * kv_width;
                keys_of(row, start + t, l);
                for (int64_t g = 0; g < kv_heads_; ++g) {
                    const int64_t slot = ((l * kv_heads_ + g) * cap + start + t) * dim_;
                    std::memcpy(keys.data_ptr<float>() + slot, row + g * dim_, dim_ * sizeof(float));
                    std::memcpy(values.data_ptr<float>() + slot, row + (kv_heads_ + g) * dim_, dim_ * sizeof(float));
                }
            }
        }
    }

    // Normed hidden states [L, hidden] of the block's embedded inputs x [L, hidden] at positions start..start + L
    // - 1, attending to the context's first start slots and to the block.
    at::Tensor block(at::Tensor x, at::Tensor keys, at::Tensor values, int64_t start) {
        TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == hidden_, "x must be float32 [L, ",
                    hidden_, "]");
        const int64_t L = x.size(0), kv_width = 2 * kv_heads_ * dim_, q_width = heads_ * dim_;
        check_cache(keys, values, start);
        TORCH_CHECK(start + L <= cos_.size(0), "the block runs past the drafter's last position");
        at::Tensor residual = x.contiguous().clone(), out = at::empty({L, hidden_}, x.options());
        std::vector<float> h(L * hidden_), q(L * q_width), kv(L * kv_width), att(L * q_width), proj(L * hidden_);
        std::vector<float> gate_up(L * 2 * ffn_), act(L * ffn_);
        pybind11::gil_scoped_release no_gil;
        ComputePool::Session session(*pool_);
        QuantizedRows scratch;
        float* xp = residual.data_ptr<float>();
        for (int64_t l = 0; l < layers_; ++l) {
            const Matrix* m = &matrices_[1 + 5 * l];
            const at::Tensor* norm = &norms_[2 + 4 * l];
            kernels_.rms_norm(xp, L, hidden_, norm[0].data_ptr<float>(), eps_, h.data());
            multiply(kernels_, m[0], h.data(), L, q.data(), scratch);
            multiply(kernels_, m[1], h.data(), L, kv.data(), scratch);
            for (int64_t t = 0; t < L; ++t) {
                float* qt = q.data() + t * q_width;
                kernels_.rms_norm(qt, heads_, dim_, norm[2].data_ptr<float>(), eps_, qt);
                for (int64_t head = 0; head < heads_; ++head) rope_at(qt + head * dim_, start + t);
                keys_of(kv.data() + t * kv_width, start + t, l);
            }
            attend(q.data(), kv.data(), L, keys, values, start, l, att.data());
            multiply(kernels_, m[2], att.data(), L, proj.data(), scratch);
            add_into(xp, proj.data(), L * hidden_);
            kernels_.rms_norm(xp, L, hidden_, norm[1].data_ptr<float>(), eps_, h.data());
            multiply(kernels_, m[3], h.data(), L, gate_up.data(), scratch);
            kernels_.silu_mul(gate_up.data(), L, ffn_, act.data());
            multiply(kernels_, m[4], act.data(), L, proj.data(), scratch);
            add_into(xp, proj.data(), L * hidden_);
        }
        kernels_.rms_norm(xp, L, hidden_, norms_[1].data_ptr<float>(), eps_, out.data_ptr<float>());
        return out;
    }

   private:
    void check_cache(const at::Tensor& keys, const at::Tensor& values, int64_t needed) const {
        TORCH_CHECK(keys.dtype() == at::kFloat && keys.is_contiguous() && keys.dim() == 4 &&
                        keys.size(0) == layers_ && keys.size(1) == kv_heads_ && keys.size(3) == dim_ &&
                        keys.sizes() == values.sizes() && values.is_contiguous() && values.dtype() == at::kFloat,
                    "keys and values must be contiguous float32 [", layers_, ", ", kv_heads_, ", capacity, ", dim_,
                    "]");
        TORCH_CHECK(needed <= keys.size(2) && needed <= cos_.size(0), "the context cache has no room for ", needed,
                    " positions");
    }

    void rope_at(float* head, int64_t pos) const {
        const int64_t half = dim_ / 2;
        rope_half(head, dim_, cos_.data_ptr<float>() + pos * half, sin_.data_ptr<float>() + pos * half);
    }

    // k_norm and RoPE on the keys at the front of a kv row (its values follow, untouched).
    void keys_of(float* row, int64_t pos, int64_t layer) const {
        kernels_.rms_norm(row, kv_heads_, dim_, norms_[2 + 4 * layer + 3].data_ptr<float>(), eps_, row);
        for (int64_t g = 0; g < kv_heads_; ++g) rope_at(row + g * dim_, pos);
    }

    // Each query head over the context's first start keys of its group and the block's L keys: softmax(q k /
    // sqrt(dim)) v.
    void attend(const float* q, const float* block_kv, int64_t L, const at::Tensor& keys, const at::Tensor& values,
                int64_t start, int64_t layer, float* out) const {
        const int64_t cap = keys.size(2), group = heads_ / kv_heads_, kv_width = 2 * kv_heads_ * dim_;
        const int64_t q_width = heads_ * dim_, n = start + L;
        const float scale = 1.0f / std::sqrt(static_cast<float>(dim_));
        const float* key_base = keys.data_ptr<float>();
        const float* value_base = values.data_ptr<float>();
        parallel_for(0, heads_ * L, 1, [&](int64_t begin, int64_t end) {
            std::vector<float> scores(n);
            for (int64_t item = begin; item < end; ++item) {
                const int64_t head = item / L, t = item % L, g = head / group;
                const float* qv = q + t * q_width + head * dim_;
                const float* context_keys = key_base + (layer * kv_heads_ + g) * cap * dim_;
                const float* context_values = value_base + (layer * kv_heads_ + g) * cap * dim_;
                auto key = [&](int64_t j) {
                    return j < start ? context_keys + j * dim_ : block_kv + (j - start) * kv_width + g * dim_;
                };
                auto value = [&](int64_t j) {
                    return j < start ? context_values + j * dim_
                                     : block_kv + (j - start) * kv_width + (kv_heads_ + g) * dim_;
                };
                float top = -INFINITY;
                for (int64_t j = 0; j < n; ++j) {
                    scores[j] = dot_product(qv, key(j), dim_) * scale;
                    top = std::max(top, scores[j]);
                }
                float total = 0.0f;
                for (int64_t j = 0; j < n; ++j) {
                    scores[j] = std::exp(scores[j] - top);
                    total += scores[j];
                }
                float* o = out + t * q_width + head * dim_;
                std::fill(o, o + dim_, 0.0f);
                for (int64_t j = 0; j < n; ++j) {
                    const float* v = value(j);
                    const float w = scores[j] / total;
                    for (int64_t d = 0; d < dim_; ++d) o[d] += w * v[d];
                }
            }
        });
    }

    int64_t hidden_, heads_, kv_heads_, dim_, ffn_, layers_ = 0;
    float eps_;
    at::Tensor cos_, sin_;
    std::vector<Matrix> matrices_;
    std::vector<at::Tensor> norms_;
    Kernels kernels_;
    std::shared_ptr<ComputePool> pool_;
};
