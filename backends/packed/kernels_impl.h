// The packed engine's arithmetic, written once over a 16-lane vector: kernels.cpp includes this file twice, once
// with V (16 floats) and VI (16 int32) as one AVX-512 register each and once as two AVX2 registers. Each lane
// does the same operations in the same order either way, and hsum adds the lanes in one fixed tree, so both builds
// give the same bits.
//
// Batch invariance is the point of every loop here: an output element is one fixed sequence of operations over
// its own row's inputs, whatever the number of rows in the call, the rows' grouping into register tiles, or the
// other rows of the batch. So a token's logits are the same alone, in a verifying pass of 8, or beside 15 other
// requests, and greedy speculative decoding commits exactly what plain decoding would.

// 16 fp16 values (the KV cache's, or a tile's scales) as float32: exact, in either build.
inline V half_to_v(const uint16_t* p) { return half_to_v(reinterpret_cast<const uint8_t*>(p)); }

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
    parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
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
        prefetch_ahead(tb, Q4_TILE_BYTES);
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
        prefetch_ahead(tb, Q8_TILE_BYTES);
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
    parallel_for(0, tiles, 4, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
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

// Softmax over one head's scores at n positions (the last chunk's positions past n hold no key of this head's:
// they count as -inf, then as 0), in place; the sum of the exponentials, and in shift the largest score, which
// every exponent is taken from.
inline float softmax_weights(float* scores, int64_t n, int64_t chunks, float& shift) {
    for (int64_t j = n; j < chunks * 16; ++j) scores[j] = -INFINITY;
    V top = vload(scores);
    for (int64_t j = 16; j < n; j += 16) top = vmax(top, vload(scores + j));
    shift = hmax(top);
    const V s = vset(shift);
    for (int64_t j = 0; j < n; j += 16) vstore(scores + j, vexp(vsub(vload(scores + j), s)));
    for (int64_t j = n; j < chunks * 16; ++j) scores[j] = 0.0f;
    V sum = vzero();
    for (int64_t j = 0; j < n; j += 16) sum = vadd(sum, vload(scores + j));
    return hsum(sum);
}

// Chunks of 16 value dimensions weighed together: every accumulator stays in a register (2 G C of them).
template <int G>
constexpr int64_t VALUE_CHUNKS = G <= 2 ? 4 : 2;

// out[g] = sum_j w[g][j] v[j] * scale[g] over n positions and C chunks of 16 of the head's dimensions, even and odd
// positions in two accumulators added at the end: the same order for any chunking, so the same bits. A head whose
// own positions end before n has weight 0 past them, which adds nothing.
template <int G, int64_t C>
inline void weigh_values(float* const* w, const uint16_t* v, int64_t n, int64_t dim, const float* scale,
                         float* const* out, int64_t c0) {
    V even[G][C], odd[G][C];
    for (int g = 0; g < G; ++g) {
        for (int64_t c = 0; c < C; ++c) even[g][c] = odd[g][c] = vzero();
    }
    int64_t j = 0;
    for (; j + 1 < n; j += 2) {
        for (int64_t c = 0; c < C; ++c) {
            const V a = half_to_v(v + j * dim + (c0 + c) * 16), b = half_to_v(v + (j + 1) * dim + (c0 + c) * 16);
            for (int g = 0; g < G; ++g) {
                even[g][c] = vfma(vset(w[g][j]), a, even[g][c]);
                odd[g][c] = vfma(vset(w[g][j + 1]), b, odd[g][c]);
            }
        }
    }
    if (j < n) {
        for (int64_t c = 0; c < C; ++c) {
            const V a = half_to_v(v + j * dim + (c0 + c) * 16);
            for (int g = 0; g < G; ++g) even[g][c] = vfma(vset(w[g][j]), a, even[g][c]);
        }
    }
    for (int g = 0; g < G; ++g) {
        for (int64_t c = 0; c < C; ++c) {
            vstore(out[g] + (c0 + c) * 16, vmul(vadd(even[g][c], odd[g][c]), vset(scale[g])));
        }
    }
}

// Every value dimension of G heads: VALUE_CHUNKS<G> chunks of 16 at a time, then one.
template <int G>
inline void weigh_head_values(float* const* w, const uint16_t* v, int64_t n, int64_t dim, const float* scale,
                              float* const* out) {
    int64_t c = 0;
    for (; c + VALUE_CHUNKS<G> <= dim / 16; c += VALUE_CHUNKS<G>) {
        weigh_values<G, VALUE_CHUNKS<G>>(w, v, n, dim, scale, out, c);
    }
    for (; c < dim / 16; ++c) weigh_values<G, 1>(w, v, n, dim, scale, out, c);
}

// Scores of G query heads against one chunk of 16 keys ([dim][16]): for each head, four chains of fused
// multiply-adds over its dimensions, summed in one order, so a head's scores are the same bits in any group.
template <int G>
inline void score_chunk(const float* const* q, const uint16_t* keys, int64_t dim, V scale, float* const* out) {
    V part[G][4];
    for (int g = 0; g < G; ++g) part[g][0] = part[g][1] = part[g][2] = part[g][3] = vzero();
    for (int64_t d = 0; d < dim; d += 4) {
        for (int j = 0; j < 4; ++j) {
            const V key = half_to_v(keys + (d + j) * 16);
            for (int g = 0; g < G; ++g) part[g][j] = vfma(vset(q[g][d + j]), key, part[g][j]);
        }
    }
    for (int g = 0; g < G; ++g) {
        vstore(out[g], vmul(vadd(vadd(part[g][0], part[g][1]), vadd(part[g][2], part[g][3])), scale));
    }
}

// Query heads that share one key-value head, over one split of its cache: positions [s0, s0 + SPLIT), head i
// seeing those below n[i] (at least one of them). Where a head sees no further than this split (n[i] <= SPLIT) its
// output is normalised in place; elsewhere out[i] gets the split's unnormalised weighted values, and shift[i] and
// sum[i] its largest score and sum of exponentials, for combine_splits. The rest is a thread's scratch, reused
// from one split to the next.
struct SplitHeads {
    std::vector<const float*> q;
    std::vector<int64_t> n;
    std::vector<float*> out, shift, sum;
    std::vector<int64_t> count;
    std::vector<float*> rows, cells;
    std::vector<float> factor, scores;

    void clear() { q.clear(), n.clear(), out.clear(), shift.clear(), sum.clear(); }
};

// k and v: the split's first chunk of keys and first value.
void attend_split(SplitHeads& heads, const uint16_t* k, const uint16_t* v, int64_t s0, int64_t dim, V scale) {
    const int64_t H = static_cast<int64_t>(heads.q.size());
    auto& count = heads.count;
    count.resize(H);
    for (int64_t i = 0; i < H; ++i) count[i] = std::min(heads.n[i] - s0, SPLIT);
    const int64_t chunks = (*std::max_element(count.begin(), count.end()) + 15) / 16, width = chunks * 16;
    heads.scores.resize(H * width);
    heads.rows.resize(H);
    heads.cells.resize(H);
    heads.factor.resize(H);
    float* scores = heads.scores.data();
    float** rows = heads.rows.data();
    float** cells = heads.cells.data();
    float* factor = heads.factor.data();
    for (int64_t c = 0; c < chunks; ++c) {
        for (int64_t i = 0; i < H; ++i) cells[i] = scores + i * width + c * 16;
        const uint16_t* kc = k + c * dim * 16;
        for (int64_t i = 0; i < H; i += 4) {
            switch (std::min<int64_t>(4, H - i)) {
                case 1: score_chunk<1>(&heads.q[i], kc, dim, scale, cells + i); break;
                case 2: score_chunk<2>(&heads.q[i], kc, dim, scale, cells + i); break;
                case 3: score_chunk<3>(&heads.q[i], kc, dim, scale, cells + i); break;
                default: score_chunk<4>(&heads.q[i], kc, dim, scale, cells + i); break;
            }
        }
    }
    for (int64_t i = 0; i < H; ++i) {
        rows[i] = scores + i * width;
        float shift;
        const float sum = softmax_weights(rows[i], count[i], chunks, shift);
        if (heads.n[i] <= SPLIT) {
            factor[i] = 1.0f / sum;
        } else {
            factor[i] = 1.0f;
            *heads.shift[i] = shift;
            *heads.sum[i] = sum;
        }
    }
    const uint16_t* vs = v;
    float* const* out = heads.out.data();
    for (int64_t i = 0; i < H; i += 4) {
        const int64_t g = std::min<int64_t>(4, H - i), n = *std::max_element(&count[i], &count[i] + g);
        switch (g) {
            case 1: weigh_head_values<1>(rows + i, vs, n, dim, factor + i, out + i); break;
            case 2: weigh_head_values<2>(rows + i, vs, n, dim, factor + i, out + i); break;
            case 3: weigh_head_values<3>(rows + i, vs, n, dim, factor + i, out + i); break;
            default: weigh_head_values<4>(rows + i, vs, n, dim, factor + i, out + i); break;
        }
    }
}

// A head's splits combined in order: each split's weighted values and sum rescaled from its own largest score to
// the largest of all, then the total normalised.
inline void combine_splits(const float* parts, const float* shift, const float* sum, int64_t splits, int64_t dim,
                           float* out) {
    const float top = *std::max_element(shift, shift + splits);
    float total = 0.0f;
    for (int64_t s = 0; s < splits; ++s) total += std::exp(shift[s] - top) * sum[s];
    for (int64_t c = 0; c < dim; c += 16) {
        V acc = vzero();
        for (int64_t s = 0; s < splits; ++s) {
            acc = vfma(vset(std::exp(shift[s] - top)), vload(parts + s * dim + c), acc);
        }
        vstore(out + c, vmul(acc, vset(1.0f / total)));
    }
}

// A tree token's positions in the split from s0 (up to its own, ``last``), where ``k`` and ``v`` are one key-value
// head's cache: copied into ``keys`` (chunks of 16) and ``values`` in the order and lanes of their positions, whole
// chunks and rows at a time below the first position read off the tree's first branch, then that branch's tokens.
inline void gather_split(const TreeView& tree, int64_t t, int64_t last, int64_t s0, const uint16_t* k,
                         const uint16_t* v, int64_t dim, std::vector<uint16_t>& keys, std::vector<uint16_t>& values) {
    keys.resize(SPLIT * dim);  // lanes past ``last`` keep earlier finite values, which attention weighs at 0
    values.resize(SPLIT * dim);
    const int64_t end = std::min(s0 + SPLIT, last + 1), off = std::max(s0, std::min(tree.first_off[t], end));
    const int64_t whole = (off - s0) / 16;  // chunks entirely in place
    std::memcpy(keys.data(), k + s0 / 16 * dim * 16, whole * dim * 16 * sizeof(uint16_t));
    std::memcpy(values.data(), v + s0 * dim, (off - s0) * dim * sizeof(uint16_t));
    for (int64_t p = s0 + whole * 16; p < end; ++p) {
        const int64_t from = p < off ? p : tree.slots[t][p - tree.first_off[t]], j = p - s0;
        const uint16_t* key = k + from / 16 * dim * 16 + from % 16;
        uint16_t* to = keys.data() + j / 16 * dim * 16 + j % 16;
        for (int64_t d = 0; d < dim; ++d) to[d * 16] = key[d * 16];
        if (p >= off) std::memcpy(values.data() + j * dim, v + from * dim, dim * sizeof(uint16_t));
    }
}

// Causal attention of every new token over its own sequence's cache, positions 0..pos inclusive (the token's own
// key and value are already written); token t's query heads start at q + t * q_stride. Keys are stored in chunks
// of 16 positions, each [head_dim][16] (kernels.cpp), so one vector holds 16 positions' scores.
//
// Work is one run of a sequence's consecutive tokens (up to RUN), one key-value head and one split of SPLIT
// positions; a head that sees more than one split is combined after. Every head's arithmetic is its own (scores,
// softmax and weighted values per head, splits fixed by its position), so nothing depends on which other tokens
// share the call. Runs go in batches whose splits' partial results take at most PARTS floats. Threads take the
// items one at a time: a decoding token's last split may hold a single position, and one chunk a thread left one
// thread with twice the other's positions.
void attention(const float* q, int64_t q_stride, int64_t T, int64_t heads, int64_t kv_heads, int64_t dim,
               const int64_t* seq, const int64_t* pos, const std::vector<uint16_t*>& keys,
               const std::vector<uint16_t*>& values, const std::vector<int64_t>& caps, int64_t layer,
               const TreeView& tree, float* out) {
    constexpr int64_t PARTS = 1 << 20;
    const int64_t group = heads / kv_heads;
    const V scale = vset(1.0f / std::sqrt(static_cast<float>(dim)));
    auto splits = [&](int64_t t) { return (pos[t] + SPLIT) / SPLIT; };  // ceil((pos + 1) / SPLIT)
    std::vector<int64_t> starts;  // each run's first token, then T
    for (int64_t t = 0; t < T; ++t) {
        const bool follows = t > 0 && seq[t] == seq[t - 1] && pos[t] == pos[t - 1] + 1 && !tree.off(t, pos) &&
                             !tree.off(t - 1, pos);  // a tree token off its first branch is a run of its own
        if (!follows || t - starts.back() == RUN) starts.push_back(t);
    }
    starts.push_back(T);
    std::vector<int64_t> base(T + 1);  // token t's partial results start at base[t] * dim in parts
    std::vector<float> parts, shifts, sums;
    size_t first = 0;
    while (first + 1 < starts.size()) {
        size_t last = first;
        int64_t used = 0;
        do {
            for (int64_t t = starts[last]; t < starts[last + 1]; ++t) {
                base[t] = used;
                if (splits(t) > 1) used += heads * splits(t);
            }
            ++last;
        } while (last + 1 < starts.size() && used * dim < PARTS);
        parts.resize(used * dim);
        shifts.resize(used);
        sums.resize(used);
        struct Item { int64_t run, kv, split; };
        std::vector<Item> items;
        for (size_t r = first; r < last; ++r) {
            for (int64_t kv = 0; kv < kv_heads; ++kv) {
                const int64_t widest = splits(starts[r + 1] - 1);  // the run's last token sees the most
                for (int64_t s = 0; s < widest; ++s) items.push_back({static_cast<int64_t>(r), kv, s});
            }
        }
        parallel_each(0, static_cast<int64_t>(items.size()), [&](int64_t i0, int64_t i1) {
            SplitHeads hs;
            std::vector<uint16_t> tree_keys, tree_values;
            for (int64_t i = i0; i < i1; ++i) {
                const Item item = items[i];
                const int64_t t0 = starts[item.run], t1 = starts[item.run + 1], s0 = item.split * SPLIT;
                hs.clear();
                for (int64_t t = t0; t < t1; ++t) {
                    if (pos[t] < s0) continue;  // sees nothing of this split
                    for (int64_t h = item.kv * group; h < (item.kv + 1) * group; ++h) {
                        hs.q.push_back(q + t * q_stride + h * dim);
                        hs.n.push_back(pos[t] + 1);
                        const int64_t part = base[t] + h * splits(t) + item.split;
                        const bool whole = splits(t) == 1;
                        hs.out.push_back(whole ? out + (t * heads + h) * dim : &parts[part * dim]);
                        hs.shift.push_back(whole ? nullptr : &shifts[part]);
                        hs.sum.push_back(whole ? nullptr : &sums[part]);
                    }
                }
                const int64_t offset = (layer * kv_heads + item.kv) * caps[seq[t0]] * dim;
                const uint16_t* k = keys[seq[t0]] + offset;
                const uint16_t* v = values[seq[t0]] + offset;
                if (tree.off(t0, pos) && s0 + SPLIT > tree.first_off[t0]) {
                    gather_split(tree, t0, pos[t0], s0, k, v, dim, tree_keys, tree_values);
                    attend_split(hs, tree_keys.data(), tree_values.data(), s0, dim, scale);
                } else {
                    attend_split(hs, k + s0 / 16 * dim * 16, v + s0 * dim, s0, dim, scale);
                }
            }
        });
        const int64_t t0 = starts[first], t1 = starts[last];
        if (used > 0) {  // where every head saw one split there is nothing to combine, and no region to open
            parallel_for(0, (t1 - t0) * heads, 1, [&](int64_t i0, int64_t i1) {
                for (int64_t i = i0; i < i1; ++i) {
                    const int64_t t = t0 + i / heads, h = i % heads, n = splits(t);
                    if (n == 1) continue;
                    const int64_t part = base[t] + h * n;
                    combine_splits(&parts[part * dim], &shifts[part], &sums[part], n, dim,
                                   out + (t * heads + h) * dim);
                }
            });
        }
        first = last;
    }
}
