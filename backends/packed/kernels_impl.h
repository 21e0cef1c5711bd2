// The packed engine's arithmetic, written once over a 16-lane vector: kernels.cpp includes this file twice, once
// with V (16 floats) and VI (16 int32) as one AVX-512 register each and once as two AVX2 registers. Each lane
// does the same operations in the same order either way, and hsum adds the lanes in one fixed tree, so both builds
// give the same bits.
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

// R rows of x against one float32 weight row.
template <int R>
inline void dot_rows(const float* x, int64_t ldx, const float* w, int64_t blocks, float* y, int64_t ldy) {
    V a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = vzero();
    for (int64_t b = 0; b < blocks; ++b) {
        const V w0 = vload(w + b * QK), w1 = vload(w + b * QK + 16);
        const float* xb = x + b * QK;
        for (int r = 0; r < R; ++r) {
            a0[r] = vfma(w0, vload(xb + r * ldx), a0[r]);
            a1[r] = vfma(w1, vload(xb + r * ldx + 16), a1[r]);
        }
    }
    for (int r = 0; r < R; ++r) y[r * ldy] = hsum(vadd(a0[r], a1[r]));
}

// y[T, N] = x[T, K] @ W[N, K]^T for float32 W (matrices a GGUF keeps unquantised), in float32 throughout.
void gemm_f32(const float* x, int64_t T, int64_t K, const float* w, int64_t N, float* y) {
    const int64_t blocks = K / QK;
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
            int64_t t = 0;
            for (; t + ROWS <= T; t += ROWS) dot_rows<ROWS>(x + t * K, K, w + n * K, blocks, y + t * N + n, N);
            for (; t < T; ++t) dot_rows<1>(x + t * K, K, w + n * K, blocks, y + t * N + n, N);
        }
    });
}

// R quantised rows of x against one tile of 16 Q4_1 weight rows, a vector lane each. Per block of 32: the exact
// integer dot product of x's int8 and the 4-bit q (low nibbles meet x[0..15], high nibbles x[16..31], two
// dependency chains), then, as w = d q + m, d dx sum(q xq) + m (dx sum(xq)): two fused multiply-adds a lane.
template <int R>
inline void q4_rows(const int32_t* xq, const float* dx, const float* sx, int64_t blocks, const uint8_t* tile,
                    float* y, int64_t ldy) {
    V acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vzero();
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* tb = tile + b * Q4_TILE_BYTES;
        VB lo[4], hi[4];
        for (int g = 0; g < 4; ++g) {
            const VB nibbles = bload(tb + 64 * g);
            lo[g] = nib_lo(nibbles);
            hi[g] = nib_hi(nibbles);
        }
        const V d = half_to_v(tb + Q4_SCALES), m = half_to_v(tb + Q4_MINS);
#pragma GCC unroll 8  // each row's accumulator in a register, not the stack: 2-5% at 4 to 8 rows
        for (int r = 0; r < R; ++r) {
            const int32_t* x = xq + r * blocks * 8 + b * 8;
            VI low = vi_zero(), high = vi_zero();
            for (int g = 0; g < 4; ++g) {
                low = dot_u8s8(low, lo[g], x[g]);
                high = dot_u8s8(high, hi[g], x[4 + g]);
            }
            acc[r] = vfma(vi_to_v(vi_add(low, high)), vmul(d, vset(dx[r * blocks + b])), acc[r]);
            acc[r] = vfma(m, vset(sx[r * blocks + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) vstore(y + r * ldy, acc[r]);
}

// The same for Q8_0 (w = d q): one fused multiply-add a lane per block.
template <int R>
inline void q8_rows(const int32_t* xq, const int32_t* xu, const float* dx, int64_t blocks, const uint8_t* tile,
                    float* y, int64_t ldy) {
    V acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vzero();
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* tb = tile + b * Q8_TILE_BYTES;
        const Q8Block w = load_q8(tb);
        const V d = half_to_v(tb + Q8_SCALES);
        for (int r = 0; r < R; ++r) {
            const VI dot = dot_q8(w, xq + r * blocks * 8 + b * 8, xu + r * blocks * 8 + b * 8);
            acc[r] = vfma(vi_to_v(dot), vmul(d, vset(dx[r * blocks + b])), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) vstore(y + r * ldy, acc[r]);
}

template <bool Q4, int R>
inline void tile_rows(const QuantizedRows& x, int64_t t, int64_t blocks, const uint8_t* tile, float* y, int64_t ldy) {
    const int32_t* xq = reinterpret_cast<const int32_t*>(x.q.data()) + t * blocks * 8;
    const float* dx = x.d.data() + t * blocks;
    if constexpr (Q4) {
        q4_rows<R>(xq, dx, x.s.data() + t * blocks, blocks, tile, y, ldy);
    } else {
        q8_rows<R>(xq, reinterpret_cast<const int32_t*>(x.u.data()) + t * blocks * 8, dx, blocks, tile, y, ldy);
    }
}

// The last rows, fewer than QROWS, in one pass over the tile as well.
template <bool Q4>
inline void tile_rest(int64_t rows, const QuantizedRows& x, int64_t t, int64_t blocks, const uint8_t* tile, float* y,
                      int64_t ldy) {
    switch (rows) {
        case 1: return tile_rows<Q4, 1>(x, t, blocks, tile, y, ldy);
        case 2: return tile_rows<Q4, 2>(x, t, blocks, tile, y, ldy);
        case 3: return tile_rows<Q4, 3>(x, t, blocks, tile, y, ldy);
        case 4: return tile_rows<Q4, 4>(x, t, blocks, tile, y, ldy);
        case 5: return tile_rows<Q4, 5>(x, t, blocks, tile, y, ldy);
        case 6: return tile_rows<Q4, 6>(x, t, blocks, tile, y, ldy);
        default: return tile_rows<Q4, 7>(x, t, blocks, tile, y, ldy);
    }
}

// y[T, tiles * 16] (row stride ldy) = x @ W^T for a tiled Q4_1 or Q8_0 matrix (weights.py's tiles), x quantised.
// Threads split the tiles; each tile is read from memory once, and from cache again for every QROWS rows of x.
template <bool Q4>
void qgemm_fmt(const QuantizedRows& x, int64_t T, int64_t K, const uint8_t* w, int64_t tiles, float* y,
               int64_t ldy) {
    const int64_t blocks = K / QK, tile_bytes = blocks * (Q4 ? Q4_TILE_BYTES : Q8_TILE_BYTES);
    at::parallel_for(0, tiles, 4, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
            // No software prefetch: a thread's tiles are one contiguous stream, which the hardware prefetcher
            // follows; asking for tiles ahead measured 10-20% slower on the Zen 4 EPYC (1 to 8 tokens).
            const uint8_t* tile = w + n * tile_bytes;
            int64_t t = 0;
            for (; t + QROWS <= T; t += QROWS) tile_rows<Q4, QROWS>(x, t, blocks, tile, y + t * ldy + n * TILE, ldy);
            if (t < T) tile_rest<Q4>(T - t, x, t, blocks, tile, y + t * ldy + n * TILE, ldy);
        }
    });
}

void qgemm(const QuantizedRows& x, int64_t T, int64_t K, const uint8_t* w, int64_t tiles, int fmt, float* y,
           int64_t ldy) {
    if (fmt == FMT_Q4_1) {
        qgemm_fmt<true>(x, T, K, w, tiles, y, ldy);
    } else {
        qgemm_fmt<false>(x, T, K, w, tiles, y, ldy);
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

// exp(x) = 2^n p(r), x = n ln 2 + r: Cephes' expf (range reduction in two parts, a degree-5 polynomial), about
// one ulp, in vector operations both builds run alike, so a token's softmax and SiLU are the same bits everywhere.
inline V vexp(V x) {
    x = vmin(vmax(x, vset(-87.3f)), vset(88.3f));
    const V n = vround(vmul(x, vset(1.44269504088896341f)));
    V r = vfma(n, vset(-0.693359375f), x);
    r = vfma(n, vset(2.12194440e-4f), r);
    V p = vset(1.9875691500e-4f);
    p = vfma(p, r, vset(1.3981999507e-3f));
    p = vfma(p, r, vset(8.3334519073e-3f));
    p = vfma(p, r, vset(4.1665795894e-2f));
    p = vfma(p, r, vset(1.6666665459e-1f));
    p = vfma(p, r, vset(5.0000001201e-1f));
    const V y = vadd(vfma(p, vmul(r, r), r), vset(1.0f));
    return vmul(y, vpow2(n));
}

inline float hmax(V a) {
    float lanes[16];
    vstore(lanes, a);
    return *std::max_element(lanes, lanes + 16);
}

// out = silu(gate) * up, gate and up side by side in each row of gate_up [T, 2 ffn].
void silu_mul(const float* gate_up, int64_t T, int64_t ffn, float* out) {
    const V one = vset(1.0f);
    for (int64_t t = 0; t < T; ++t) {
        const float* g = gate_up + t * 2 * ffn;
        for (int64_t i = 0; i < ffn; i += 16) {
            const V gate = vload(g + i);
            const V silu = vdiv(gate, vadd(one, vexp(vsub(vzero(), gate))));
            vstore(out + t * ffn + i, vmul(silu, vload(g + ffn + i)));
        }
    }
}

// Softmax over one head's scores at positions 0..n-1 (the last chunk's positions past n hold no key of this
// token's: they count as -inf, then as 0), in place; the sum of the exponentials.
inline float softmax_weights(float* scores, int64_t n, int64_t chunks) {
    for (int64_t j = n; j < chunks * 16; ++j) scores[j] = -INFINITY;
    V top = vload(scores);
    for (int64_t j = 16; j < n; j += 16) top = vmax(top, vload(scores + j));
    const V shift = vset(hmax(top));
    for (int64_t j = 0; j < n; j += 16) vstore(scores + j, vexp(vsub(vload(scores + j), shift)));
    for (int64_t j = n; j < chunks * 16; ++j) scores[j] = 0.0f;
    V sum = vzero();
    for (int64_t j = 0; j < n; j += 16) sum = vadd(sum, vload(scores + j));
    return hsum(sum);
}

// Chunks of 16 value dimensions weighed together: every accumulator stays in a register (2 G C of them).
template <int G>
constexpr int64_t VALUE_CHUNKS = G <= 2 ? 4 : 2;

// out[g] = sum_j scores[g][j] v[j] * inverse[g] over C chunks of 16 of the head's dimensions, even and odd
// positions in two accumulators added at the end: the same order for any chunking, so the same bits.
template <int G, int64_t C>
inline void weigh_values(const float* scores, int64_t width, const float* v, int64_t n, int64_t dim,
                         const float* inverse, float* out) {
    V even[G][C], odd[G][C];
    for (int g = 0; g < G; ++g) {
        for (int64_t c = 0; c < C; ++c) even[g][c] = odd[g][c] = vzero();
    }
    int64_t j = 0;
    for (; j + 1 < n; j += 2) {
        for (int64_t c = 0; c < C; ++c) {
            const V a = vload(v + j * dim + c * 16), b = vload(v + (j + 1) * dim + c * 16);
            for (int g = 0; g < G; ++g) {
                even[g][c] = vfma(vset(scores[g * width + j]), a, even[g][c]);
                odd[g][c] = vfma(vset(scores[g * width + j + 1]), b, odd[g][c]);
            }
        }
    }
    if (j < n) {
        for (int64_t c = 0; c < C; ++c) {
            const V a = vload(v + j * dim + c * 16);
            for (int g = 0; g < G; ++g) even[g][c] = vfma(vset(scores[g * width + j]), a, even[g][c]);
        }
    }
    for (int g = 0; g < G; ++g) {
        for (int64_t c = 0; c < C; ++c) {
            vstore(out + g * dim + c * 16, vmul(vadd(even[g][c], odd[g][c]), vset(inverse[g])));
        }
    }
}

// G query heads of one token that share a key-value head, side by side so each key and value is loaded once for
// all of them; every head's own arithmetic is what it would be alone. Scores: for each chunk of 16 positions,
// four chains of fused multiply-adds over the head's dimensions, summed in one order. Values: weigh_values.
template <int G>
void attend_group(const float* q, const float* k, const float* v, int64_t n, int64_t dim, V scale,
                  std::vector<float>& scores, float* out) {
    const int64_t chunks = (n + 15) / 16, width = chunks * 16;
    scores.resize(G * width);
    for (int64_t c = 0; c < chunks; ++c) {
        const float* kc = k + c * dim * 16;
        V part[G][4];
        for (int g = 0; g < G; ++g) part[g][0] = part[g][1] = part[g][2] = part[g][3] = vzero();
        for (int64_t d = 0; d < dim; d += 4) {
            for (int j = 0; j < 4; ++j) {
                const V key = vload(kc + (d + j) * 16);
                for (int g = 0; g < G; ++g) part[g][j] = vfma(vset(q[g * dim + d + j]), key, part[g][j]);
            }
        }
        for (int g = 0; g < G; ++g) {
            const V score = vadd(vadd(part[g][0], part[g][1]), vadd(part[g][2], part[g][3]));
            vstore(&scores[g * width + c * 16], vmul(score, scale));
        }
    }
    float inverse[G];
    for (int g = 0; g < G; ++g) inverse[g] = 1.0f / softmax_weights(&scores[g * width], n, chunks);
    int64_t c = 0;
    for (; c + VALUE_CHUNKS<G> <= dim / 16; c += VALUE_CHUNKS<G>) {
        weigh_values<G, VALUE_CHUNKS<G>>(&scores[0], width, v + c * 16, n, dim, inverse, out + c * 16);
    }
    for (; c < dim / 16; ++c) weigh_values<G, 1>(&scores[0], width, v + c * 16, n, dim, inverse, out + c * 16);
}

// Causal attention of every new token over its own sequence's cache, positions 0..pos inclusive (the token's own
// key and value are already written); token t's query heads start at q + t * q_stride. Keys are stored in chunks
// of 16 positions, each [head_dim][16] (kernels.cpp), so one vector holds 16 positions' scores. One token and
// key-value head at a time, its query heads up to four together (attend_group), so nothing depends on which other
// tokens share the call.
void attention(const float* q, int64_t q_stride, int64_t T, int64_t heads, int64_t kv_heads, int64_t dim,
               const int64_t* seq, const int64_t* pos, const std::vector<float*>& keys, const std::vector<float*>& values,
               const std::vector<int64_t>& caps, int64_t layer, float* out) {
    const int64_t group = heads / kv_heads;
    const V scale = vset(1.0f / std::sqrt(static_cast<float>(dim)));
    at::parallel_for(0, T * kv_heads, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> scores;
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t t = i / kv_heads, kv = i % kv_heads, n = pos[t] + 1;
            const int64_t offset = (layer * kv_heads + kv) * caps[seq[t]] * dim;
            const float* k = keys[seq[t]] + offset;
            const float* v = values[seq[t]] + offset;
            for (int64_t h = kv * group; h < (kv + 1) * group; h += 4) {
                const float* qh = q + t * q_stride + h * dim;
                float* o = out + (t * heads + h) * dim;
                switch (std::min<int64_t>(4, (kv + 1) * group - h)) {
                    case 1: attend_group<1>(qh, k, v, n, dim, scale, scores, o); break;
                    case 2: attend_group<2>(qh, k, v, n, dim, scale, scores, o); break;
                    case 3: attend_group<3>(qh, k, v, n, dim, scale, scores, o); break;
                    default: attend_group<4>(qh, k, v, n, dim, scale, scores, o); break;
                }
            }
        }
    });
}
