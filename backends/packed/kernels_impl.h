// The packed engine's arithmetic, written once over a 16-lane float vector V: kernels.cpp includes this file twice,
// once with V as one AVX-512 register and once as two AVX2 registers. Each lane does the same fused multiply-adds
// in the same order either way, and hsum adds the lanes in one fixed tree, so both builds give the same bits.
//
// Batch invariance is the point of every loop here: an output element is one fixed sequence of operations over
// its own row's inputs, whatever the number of rows in the call, the rows' grouping into register tiles, or the
// other rows of the batch. So a token's logits are the same alone, in a verifying pass of 8, or beside 15 other
// requests, and greedy speculative decoding commits exactly what plain decoding would.

inline void dequant_q4_1(const uint8_t* block, V& w0, V& w1) {
    // w = d * q + m, q in [0, 15]: element j's nibble is the low half of byte j, element j + 16's the high half.
    const V d = vset(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(block)));
    const V m = vset(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(block + 2)));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    w0 = vfma(u8_to_v(low), d, m);
    w1 = vfma(u8_to_v(high), d, m);
}

inline void dequant_q8_0(const uint8_t* block, V& w0, V& w1) {
    // w = d * q, q in [-128, 127]: exact in float32.
    const V d = vset(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(block)));
    w0 = vmul(i8_to_v(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2))), d);
    w1 = vmul(i8_to_v(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18))), d);
}

inline void dequant_f32(const uint8_t* block, V& w0, V& w1) {
    const float* values = reinterpret_cast<const float*>(block);
    w0 = vload(values);
    w1 = vload(values + 16);
}

template <int FMT>
inline void dequant(const uint8_t* block, V& w0, V& w1) {
    if constexpr (FMT == FMT_Q4_1) {
        dequant_q4_1(block, w0, w1);
    } else if constexpr (FMT == FMT_Q8_0) {
        dequant_q8_0(block, w0, w1);
    } else {
        dequant_f32(block, w0, w1);
    }
}

// R rows of x against one weight row: each block of 32 weights is dequantised once and used by all R rows.
template <int R, int FMT>
inline void dot_rows(const float* x, int64_t ldx, const uint8_t* w, int64_t blocks, float* y, int64_t ldy) {
    V a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = vzero();
    for (int64_t b = 0; b < blocks; ++b) {
        V w0, w1;
        dequant<FMT>(w + b * block_bytes(FMT), w0, w1);
        const float* xb = x + b * QK;
        for (int r = 0; r < R; ++r) {
            a0[r] = vfma(w0, vload(xb + r * ldx), a0[r]);
            a1[r] = vfma(w1, vload(xb + r * ldx + 16), a1[r]);
        }
    }
    for (int r = 0; r < R; ++r) y[r * ldy] = hsum(vadd(a0[r], a1[r]));
}

// The last rows of a tile, fewer than ROWS, in one pass over the weight row as well.
template <int FMT>
inline void dot_rest(int64_t rows, const float* x, int64_t ldx, const uint8_t* w, int64_t blocks, float* y,
                     int64_t ldy) {
    switch (rows) {
        case 1: return dot_rows<1, FMT>(x, ldx, w, blocks, y, ldy);
        case 2: return dot_rows<2, FMT>(x, ldx, w, blocks, y, ldy);
        case 3: return dot_rows<3, FMT>(x, ldx, w, blocks, y, ldy);
        case 4: return dot_rows<4, FMT>(x, ldx, w, blocks, y, ldy);
        case 5: return dot_rows<5, FMT>(x, ldx, w, blocks, y, ldy);
        case 6: return dot_rows<6, FMT>(x, ldx, w, blocks, y, ldy);
        default: return dot_rows<7, FMT>(x, ldx, w, blocks, y, ldy);
    }
}

// y[T, N] = x[T, K] @ W[N, K]^T, W in GGUF blocks. Threads split the weight rows, so each reads its share of the
// weights once per tile of rows; rows go ROWS at a time (what the registers hold), the rest in one more pass.
template <int FMT>
void gemm_fmt(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N, float* y) {
    const int64_t blocks = K / QK, row_bytes = blocks * block_bytes(FMT);
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        for (int64_t t0 = 0; t0 < T; t0 += ROW_TILE) {
            const int64_t t1 = std::min(T, t0 + ROW_TILE);
            for (int64_t n = n0; n < n1; ++n) {
                const uint8_t* wn = w + n * row_bytes;
                if (n + PREFETCH_ROWS < n1) {
                    // The hardware prefetcher stops at every 4 KB page; a row a few rows ahead is asked for now.
                    for (int64_t c = 0; c < row_bytes; c += 64) {
                        _mm_prefetch(reinterpret_cast<const char*>(wn + PREFETCH_ROWS * row_bytes + c), _MM_HINT_T0);
                    }
                }
                int64_t t = t0;
                for (; t + ROWS <= t1; t += ROWS) dot_rows<ROWS, FMT>(x + t * K, K, wn, blocks, y + t * N + n, N);
                if (t < t1) dot_rest<FMT>(t1 - t, x + t * K, K, wn, blocks, y + t * N + n, N);
            }
        }
    });
}

void gemm(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N, int fmt, float* y) {
    if (fmt == FMT_Q4_1) {
        gemm_fmt<FMT_Q4_1>(x, T, K, w, N, y);
    } else if (fmt == FMT_Q8_0) {
        gemm_fmt<FMT_Q8_0>(x, T, K, w, N, y);
    } else {
        gemm_fmt<FMT_F32>(x, T, K, w, N, y);
    }
}

// One row of a weight matrix, dequantised (the embedding lookup).
void dequant_row(const uint8_t* w, int64_t K, int fmt, float* out) {
    for (int64_t b = 0; b < K / QK; ++b) {
        V w0, w1;
        if (fmt == FMT_Q4_1) {
            dequant_q4_1(w + b * block_bytes(fmt), w0, w1);
        } else if (fmt == FMT_Q8_0) {
            dequant_q8_0(w + b * block_bytes(fmt), w0, w1);
        } else {
            dequant_f32(w + b * block_bytes(fmt), w0, w1);
        }
        vstore(out + b * QK, w0);
        vstore(out + b * QK + 16, w1);
    }
}

// y = x / sqrt(mean(x^2) + eps) * weight, row by row (K a multiple of 16).
void rms_norm(const float* x, int64_t T, int64_t K, const float* weight, float eps, float* y) {
    for (int64_t t = 0; t < T; ++t) {
        const float* row = x + t * K;
        V acc = vzero();
        for (int64_t k = 0; k < K; k += 16) acc = vfma(vload(row + k), vload(row + k), acc);
        const float scale = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(K) + eps);
        const V s = vset(scale);
        for (int64_t k = 0; k < K; k += 16) vstore(y + t * K + k, vmul(vload(weight + k), vmul(vload(row + k), s)));
    }
}

inline float dot_head(const float* a, const float* b, int64_t dim) {
    V acc = vmul(vload(a), vload(b));
    for (int64_t k = 16; k < dim; k += 16) acc = vfma(vload(a + k), vload(b + k), acc);
    return hsum(acc);
}

// Causal attention of every new token over its own sequence's cache, positions 0..pos inclusive (the token's own
// key and value are already written); token t's query heads start at q + t * q_stride. One (token, head) at a
// time: scores, softmax and the weighted sum of values, each in position order, so nothing depends on which other
// tokens share the call.
void attention(const float* q, int64_t q_stride, int64_t T, int64_t heads, int64_t kv_heads, int64_t dim,
               const int64_t* seq, const int64_t* pos, const std::vector<float*>& keys, const std::vector<float*>& values,
               const std::vector<int64_t>& caps, int64_t layer, float* out) {
    const int64_t group = heads / kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
    at::parallel_for(0, T * heads, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> scores;
        V acc[MAX_HEAD_DIM / 16];
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t t = i / heads, h = i % heads, n = pos[t] + 1;
            const float* qh = q + t * q_stride + h * dim;
            const int64_t offset = (layer * kv_heads + h / group) * caps[seq[t]] * dim;
            const float* k = keys[seq[t]] + offset;
            const float* v = values[seq[t]] + offset;
            scores.resize(n);
            float top = -INFINITY;
            for (int64_t j = 0; j < n; ++j) {
                scores[j] = dot_head(qh, k + j * dim, dim) * scale;
                top = std::max(top, scores[j]);
            }
            float total = 0.0f;
            for (int64_t j = 0; j < n; ++j) {
                scores[j] = std::exp(scores[j] - top);
                total += scores[j];
            }
            for (int64_t c = 0; c < dim / 16; ++c) acc[c] = vzero();
            for (int64_t j = 0; j < n; ++j) {
                const V p = vset(scores[j]);
                for (int64_t c = 0; c < dim / 16; ++c) acc[c] = vfma(p, vload(v + j * dim + c * 16), acc[c]);
            }
            const V inv = vset(1.0f / total);
            float* o = out + (t * heads + h) * dim;
            for (int64_t c = 0; c < dim / 16; ++c) vstore(o + c * 16, vmul(acc[c], inv));
        }
    });
}
