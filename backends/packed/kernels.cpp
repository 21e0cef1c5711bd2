// The packed engine: a Llama-family decoder run straight from a GGUF's quantised blocks (Q4_1, Q8_0, F32), read
// once per forward for every token in it, in float32 arithmetic whose every output is batch-invariant
// (kernels_impl.h). One call runs the whole forward: embedding, every layer, final norm and LM head, with the GIL
// released, so Python pays one dispatch per forward, not one per operation.
//
// Each sequence owns its KV cache, [layers, kv_heads, capacity, head_dim]; a token is written at its position
// and attends to positions 0..pos of its own sequence. So a ragged batch needs no padding and no mask, and a
// rejected draft is forgotten by moving the sequence's length back: the next forward overwrites its slots.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t QK = 32;
constexpr int FMT_F32 = 0;
constexpr int FMT_Q4_1 = 3;  // GGML type ids
constexpr int FMT_Q8_0 = 8;
constexpr int64_t ROW_TILE = 64;
constexpr int64_t PREFETCH_ROWS = 4;
constexpr int64_t MAX_HEAD_DIM = 256;

constexpr int64_t block_bytes(int fmt) { return fmt == FMT_Q4_1 ? 20 : fmt == FMT_Q8_0 ? 34 : 128; }

inline float hsum8(__m256 s) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

namespace avx2 {
struct V {
    __m256 lo, hi;
};
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V vadd(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V u8_to_v(__m128i b) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
}
inline V i8_to_v(__m128i b) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline float hsum(V a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
constexpr int ROWS = 2;
#include "kernels_impl.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
struct V {
    __m512 v;
};
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vset(float f) { return {_mm512_set1_ps(f)}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V u8_to_v(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))}; }
inline V i8_to_v(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))}; }
inline float hsum(V a) {
    const __m256 lo = _mm512_castps512_ps256(a.v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
    return hsum8(_mm256_add_ps(lo, hi));
}
constexpr int ROWS = 8;
#include "kernels_impl.h"
}  // namespace avx512
#pragma GCC pop_options

struct Kernels {
    std::string name;
    void (*gemm)(const float*, int64_t, int64_t, const uint8_t*, int64_t, int, float*);
    void (*dequant_row)(const uint8_t*, int64_t, int, float*);
    void (*rms_norm)(const float*, int64_t, int64_t, const float*, float, float*);
    void (*attention)(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t*, const int64_t*,
                      const std::vector<float*>&, const std::vector<float*>&, const std::vector<int64_t>&, int64_t,
                      float*);
};

Kernels pick_kernels() {
    const char* forced = std::getenv("DSPARK_KERNELS");
    const bool avx512 = forced ? std::string(forced) == "avx512" : __builtin_cpu_supports("avx512f");
    if (avx512) {
        return {"avx512", avx512::gemm, avx512::dequant_row, avx512::rms_norm, avx512::attention};
    }
    return {"avx2", avx2::gemm, avx2::dequant_row, avx2::rms_norm, avx2::attention};
}

const uint8_t* bytes_of(const at::Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }

}  // namespace

struct Matrix {
    at::Tensor data;  // uint8 [rows, row bytes] as GGUF stores it (F32 as its raw bytes)
    int fmt;
    int64_t rows, cols;
};

class PackedModel {
   public:
    PackedModel(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t ffn, double eps,
                std::vector<at::Tensor> matrices, std::vector<int64_t> formats, std::vector<at::Tensor> norms,
                at::Tensor cos, at::Tensor sin)
        : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), dim_(head_dim), ffn_(ffn), eps_(eps), cos_(cos),
          sin_(sin), kernels_(pick_kernels()) {
        // matrices: embedding, LM head, then per layer qkv (rows q, k, v), output, gate_up (rows gate, up), down.
        // norms: final norm, then per layer attention and feed-forward norms.
        TORCH_CHECK(matrices.size() == formats.size() && (matrices.size() - 2) % 4 == 0, "4 matrices a layer");
        TORCH_CHECK(head_dim % 16 == 0 && head_dim <= MAX_HEAD_DIM && hidden % QK == 0 && ffn % QK == 0,
                    "head_dim must be a multiple of 16 up to 256, hidden and ffn multiples of 32");
        const int64_t cols[4] = {hidden, heads * head_dim, hidden, ffn};
        for (size_t i = 0; i < matrices.size(); ++i) {
            const int fmt = static_cast<int>(formats[i]);
            TORCH_CHECK(fmt == FMT_F32 || fmt == FMT_Q4_1 || fmt == FMT_Q8_0, "unsupported block format ", fmt);
            const int64_t k = i < 2 ? hidden : cols[(i - 2) % 4];
            TORCH_CHECK(matrices[i].dtype() == at::kByte && matrices[i].is_contiguous() &&
                            matrices[i].size(1) == k / QK * block_bytes(fmt),
                        "matrix ", i, " is not ", k, " columns of format ", fmt);
            matrices_.push_back({matrices[i], fmt, matrices[i].size(0), k});
        }
        layers_ = (static_cast<int64_t>(matrices.size()) - 2) / 4;
        norms_ = norms;
    }

    std::string kernels() const { return kernels_.name; }

    // tokens, seq, pos: [T] int64; keys/values: one cache per sequence. Returns the final normed hidden states
    // [T, hidden], the logits [T, vocab] and every layer's input plus the normed output
    // [layers + 1, T, hidden] (when asked), in HF's hidden_states order.
    std::vector<at::Tensor> forward(at::Tensor tokens, at::Tensor seq, at::Tensor pos, std::vector<at::Tensor> keys,
                                    std::vector<at::Tensor> values, bool want_states) {
        TORCH_CHECK(tokens.dtype() == at::kLong && seq.dtype() == at::kLong && pos.dtype() == at::kLong);
        const int64_t T = tokens.size(0), qkv_width = (heads_ + 2 * kv_heads_) * dim_;
        const auto f32 = at::TensorOptions().dtype(at::kFloat);
        at::Tensor x = at::empty({T, hidden_}, f32), h = at::empty({T, hidden_}, f32);
        at::Tensor qkv = at::empty({T, qkv_width}, f32), att = at::empty({T, heads_ * dim_}, f32);
        at::Tensor proj = at::empty({T, hidden_}, f32), gate_up = at::empty({T, 2 * ffn_}, f32);
        at::Tensor act = at::empty({T, ffn_}, f32);
        at::Tensor states = want_states ? at::empty({layers_ + 1, T, hidden_}, f32) : at::Tensor();
        at::Tensor logits = at::empty({T, matrices_[1].rows}, f32);
        std::vector<float*> key_ptrs, value_ptrs;
        std::vector<int64_t> caps;
        for (size_t s = 0; s < keys.size(); ++s) {
            TORCH_CHECK(keys[s].is_contiguous() && values[s].is_contiguous() && keys[s].size(0) == layers_);
            key_ptrs.push_back(keys[s].data_ptr<float>());
            value_ptrs.push_back(values[s].data_ptr<float>());
            caps.push_back(keys[s].size(2));
        }
        const int64_t* tok = tokens.data_ptr<int64_t>();
        const int64_t* sq = seq.data_ptr<int64_t>();
        const int64_t* ps = pos.data_ptr<int64_t>();
        for (int64_t t = 0; t < T; ++t) {
            TORCH_CHECK(sq[t] >= 0 && sq[t] < static_cast<int64_t>(keys.size()) && ps[t] >= 0 && ps[t] < caps[sq[t]],
                        "token ", t, " has no room in its sequence's cache");
            TORCH_CHECK(tok[t] >= 0 && tok[t] < matrices_[0].rows, "token id ", tok[t], " out of range");
        }
        {
            pybind11::gil_scoped_release no_gil;
            const Kernels& k = kernels_;
            float* xp = x.data_ptr<float>();
            float* hp = h.data_ptr<float>();
            float* qp = qkv.data_ptr<float>();
            const Matrix& embed = matrices_[0];
            for (int64_t t = 0; t < T; ++t) {
                k.dequant_row(bytes_of(embed.data) + tok[t] * embed.data.size(1), hidden_, embed.fmt, xp + t * hidden_);
            }
            for (int64_t l = 0; l < layers_; ++l) {
                const Matrix* m = &matrices_[2 + 4 * l];
                if (want_states) std::memcpy(states[l].data_ptr<float>(), xp, T * hidden_ * sizeof(float));
                k.rms_norm(xp, T, hidden_, norms_[1 + 2 * l].data_ptr<float>(), eps_, hp);
                k.gemm(hp, T, hidden_, bytes_of(m[0].data), m[0].rows, m[0].fmt, qp);
                rope_and_store(qp, T, sq, ps, l, key_ptrs, value_ptrs, caps);
                k.attention(qp, qkv_width, T, heads_, kv_heads_, dim_, sq, ps, key_ptrs, value_ptrs, caps, l,
                            att.data_ptr<float>());
                k.gemm(att.data_ptr<float>(), T, heads_ * dim_, bytes_of(m[1].data), m[1].rows, m[1].fmt,
                       proj.data_ptr<float>());
                add_into(xp, proj.data_ptr<float>(), T * hidden_);
                k.rms_norm(xp, T, hidden_, norms_[2 + 2 * l].data_ptr<float>(), eps_, hp);
                k.gemm(hp, T, hidden_, bytes_of(m[2].data), m[2].rows, m[2].fmt, gate_up.data_ptr<float>());
                silu_mul(gate_up.data_ptr<float>(), T, act.data_ptr<float>());
                k.gemm(act.data_ptr<float>(), T, ffn_, bytes_of(m[3].data), m[3].rows, m[3].fmt,
                       proj.data_ptr<float>());
                add_into(xp, proj.data_ptr<float>(), T * hidden_);
            }
            k.rms_norm(xp, T, hidden_, norms_[0].data_ptr<float>(), eps_, hp);
            if (want_states) std::memcpy(states[layers_].data_ptr<float>(), hp, T * hidden_ * sizeof(float));
            const Matrix& head = matrices_[1];
            k.gemm(hp, T, hidden_, bytes_of(head.data), head.rows, head.fmt, logits.data_ptr<float>());
        }
        return {h, logits, want_states ? states : at::Tensor()};
    }

    // Every weight matrix's product with x [T, cols] (tests and the weight-read benchmark).
    at::Tensor matmul(int64_t index, at::Tensor x) {
        const Matrix& m = matrices_.at(index);
        TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == m.cols);
        at::Tensor y = at::empty({x.size(0), m.rows}, x.options());
        pybind11::gil_scoped_release no_gil;
        kernels_.gemm(x.data_ptr<float>(), x.size(0), m.cols, bytes_of(m.data), m.rows, m.fmt, y.data_ptr<float>());
        return y;
    }

   private:
    // RoPE on q and k in GGUF's row order (each head's pairs interleaved: element 2i with 2i + 1, frequency i),
    // then k and v into the token's slot of its sequence's cache.
    void rope_and_store(float* qkv, int64_t T, const int64_t* seq, const int64_t* pos, int64_t layer,
                        const std::vector<float*>& keys, const std::vector<float*>& values,
                        const std::vector<int64_t>& caps) const {
        const int64_t width = (heads_ + 2 * kv_heads_) * dim_, half = dim_ / 2;
        for (int64_t t = 0; t < T; ++t) {
            float* row = qkv + t * width;
            const float* c = cos_.data_ptr<float>() + pos[t] * half;
            const float* s = sin_.data_ptr<float>() + pos[t] * half;
            for (int64_t h = 0; h < heads_ + kv_heads_; ++h) {
                float* v = row + h * dim_;
                for (int64_t i = 0; i < half; ++i) {
                    const float a = v[2 * i], b = v[2 * i + 1];
                    v[2 * i] = a * c[i] - b * s[i];
                    v[2 * i + 1] = a * s[i] + b * c[i];
                }
            }
            for (int64_t h = 0; h < kv_heads_; ++h) {
                const int64_t slot = ((layer * kv_heads_ + h) * caps[seq[t]] + pos[t]) * dim_;
                std::memcpy(keys[seq[t]] + slot, row + (heads_ + h) * dim_, dim_ * sizeof(float));
                std::memcpy(values[seq[t]] + slot, row + (heads_ + kv_heads_ + h) * dim_, dim_ * sizeof(float));
            }
        }
    }

    void silu_mul(const float* gate_up, int64_t T, float* out) const {
        for (int64_t t = 0; t < T; ++t) {
            const float* g = gate_up + t * 2 * ffn_;
            const float* u = g + ffn_;
            for (int64_t i = 0; i < ffn_; ++i) out[t * ffn_ + i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
        }
    }

    static void add_into(float* x, const float* y, int64_t n) {
        for (int64_t i = 0; i < n; ++i) x[i] += y[i];
    }

    int64_t hidden_, heads_, kv_heads_, dim_, ffn_, layers_ = 0;
    float eps_;
    at::Tensor cos_, sin_;
    std::vector<Matrix> matrices_;
    std::vector<at::Tensor> norms_;
    Kernels kernels_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    pybind11::class_<PackedModel>(m, "PackedModel")
        .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, std::vector<at::Tensor>,
                            std::vector<int64_t>, std::vector<at::Tensor>, at::Tensor, at::Tensor>())
        .def("forward", &PackedModel::forward)
        .def("matmul", &PackedModel::matmul)
        .def_property_readonly("kernels", &PackedModel::kernels);
}
