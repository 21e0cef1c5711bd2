// The packed engine: a Llama-family decoder run straight from a GGUF's quantised blocks (Q4_1, Q8_0, F32), read
// once per forward for every token in it, with activations rounded to int8 per block of 32 as llama.cpp does
// (exact integer dot products, one float32 scaling per block), every output batch-invariant (kernels_impl.h). One
// call runs the whole forward: embedding, every layer, final norm and LM head, with the GIL released, so Python
// pays one dispatch per forward, not one per operation.
//
// Each sequence owns its KV cache, in fp16: values [layers, kv_heads, capacity, head_dim], keys [layers, kv_heads,
// capacity / 16, head_dim, 16] (16 positions side by side, for attention's scores); a token is written at its position
// and attends to positions 0..pos of its own sequence. So a ragged batch needs no padding and no mask, and a
// rejected draft is forgotten by moving the sequence's length back: the next forward overwrites its slots.
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "compute_pool.h"

namespace {

constexpr int64_t QK = 32;
constexpr int FMT_F32 = 0;
constexpr int FMT_Q4_1 = 3;  // GGML type ids
constexpr int FMT_Q8_0 = 8;
constexpr int64_t ROW_TILE = 64;
// Positions one piece of a head's attention covers (flash-decoding): a head that sees more is weighed piece by
// piece and the pieces combined, so a decoding token's few key-value heads still make work for every core. Fixed,
// so how a head's positions are split depends on its own position alone.
constexpr int64_t SPLIT = 128;
// A sequence's consecutive tokens taken together (a verifying pass's, or a prompt's 16 at a time): each chunk of
// keys and values is read from memory once for all their query heads, and from cache for each group of four.
constexpr int64_t RUN = 16;

// Where the tokens of a verified token tree read their keys and values. A tree's first branch is written at its
// positions, as any draft is; a token off it is written at a slot past the tree's first branch, since its position is
// already another token's. Token t reads positions below first_off[t] in place and position p from first_off[t] on
// at slots[t][p - first_off[t]] (its own ancestors off the first branch, then itself); attention copies those into
// the order and lanes of their positions, so the token is weighed exactly as plain decoding would weigh it.
// Empty where the forward has no tree.
struct TreeView {
    std::vector<int64_t> first_off;
    std::vector<std::vector<int64_t>> slots;

    bool off(int64_t t, const int64_t* pos) const { return !first_off.empty() && first_off[t] <= pos[t]; }
};

// How far ahead of a block of weights the matrix kernels ask for memory, by CPU vendor. A thread's tiles are one
// contiguous stream, which the hardware prefetcher follows; on the Intel Xeon (Ice Lake) asking 4 KB ahead as well
// made a step 6% faster and a pass of 8 tokens 9% (interleaved A/B, 5 runs each), where on the Zen 4 EPYC asking
// for tiles ahead measured 10-20% slower (1 to 8 tokens). Either way the same bytes are read and the same bits come
// out.
const int64_t PREFETCH_BYTES = [] {
    __builtin_cpu_init();  // a static initializer may run before libgcc's own
    return __builtin_cpu_is("intel") ? 4096 : 0;
}();

inline void prefetch_ahead(const uint8_t* block, int64_t bytes) {
    if (PREFETCH_BYTES == 0) return;
    for (int64_t line = 0; line < bytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(block + PREFETCH_BYTES + line), _MM_HINT_T0);
    }
}

constexpr int64_t block_bytes(int fmt) { return fmt == FMT_Q4_1 ? 20 : fmt == FMT_Q8_0 ? 34 : 128; }

// Quantised matrices are multiplied from tiles (weights.py, tiled()): 16 weight rows interleaved, so each vector
// lane is one output row and no horizontal sum is needed. Per tile and block of 32 columns, Q4_1 holds four
// 64-byte groups (group g, lane j: bytes 4g..4g+3 of row j's 16 nibble bytes, so low nibbles are columns
// 4g..4g+3 and high nibbles 16 + 4g..), then 16 fp16 d and 16 fp16 m; Q8_0 holds eight 64-byte groups
// (group g, lane j: row j's columns 4g..4g+3), 16 fp16 d and each row's sum of q as int16.
constexpr int64_t TILE = 16;
constexpr int64_t Q4_TILE_BYTES = 320, Q4_SCALES = 256, Q4_MINS = 288;
constexpr int64_t Q8_TILE_BYTES = 576, Q8_SCALES = 512, Q8_SUMS = 544;

// x [T, K] rounded to int8 per block of 32 as llama.cpp's Q8_1 does (x ~ d q, |q| <= 127, and s = d sum(q)), so
// a product with 4-bit or 8-bit weights is exact integer arithmetic followed by one scaling per block. Each row's
// rounding depends on that row alone. u is q + 128 as unsigned bytes, for VNNI's products with signed Q8_0 weights.
struct QuantizedRows {
    std::vector<int8_t> q;
    std::vector<uint8_t> u;
    std::vector<float> d, s;
};

// One block of 32: the largest magnitude, d = amax / 127, q = x / d rounded to nearest even (what std::nearbyint
// does in the default rounding mode, as _mm256_cvtps_epi32 does), packed to int8 in order, and q + 128 as
// unsigned bytes; returns the sum of q.
inline int32_t quantize_block(const float* xb, int8_t* q, uint8_t* u, float& d) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], top = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
        v[k] = _mm256_loadu_ps(xb + 8 * k);
        top = _mm256_max_ps(top, _mm256_and_ps(v[k], magnitude));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    d = _mm_cvtss_f32(m) / 127.0f;
    const __m256 inverse = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i iq[4];
    for (int k = 0; k < 4; ++k) iq[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inverse));
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(iq[0], iq[1]), _mm256_packs_epi32(iq[2], iq[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), packed);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), _mm256_xor_si256(packed, _mm256_set1_epi8(-128)));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(iq[0], iq[1]), _mm256_add_epi32(iq[2], iq[3]));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    return _mm_cvtsi128_si32(h);
}

void quantize_rows(const float* x, int64_t T, int64_t K, QuantizedRows& out) {
    const int64_t blocks = K / QK;
    out.q.resize(T * K);
    out.u.resize(T * K);
    out.d.resize(T * blocks);
    out.s.resize(T * blocks);
    parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
        for (int64_t i = t0 * blocks; i < t1 * blocks; ++i) {
            float d;
            const int32_t sum = quantize_block(x + i * QK, &out.q[i * QK], &out.u[i * QK], d);
            out.d[i] = d;
            out.s[i] = d * static_cast<float>(sum);
        }
    });
}

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
inline V vsub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V vdiv(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V vmin(V a, V b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V vround(V a) {
    constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
inline __m256 pow2_8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V vpow2(V n) { return {pow2_8(n.lo), pow2_8(n.hi)}; }
inline V half_to_v(const uint8_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}

// 16 int32 lanes, and 64 bytes as 16 lanes of 4 (lanes 0-7 in lo, 8-15 in hi).
struct VI {
    __m256i lo, hi;
};
using VB = VI;
inline VI vi_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline VI vi_add(VI a, VI b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline V vi_to_v(VI a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline VB bload(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline VB nib_lo(VB b) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(b.lo, m), _mm256_and_si256(b.hi, m)};
}
inline VB nib_hi(VB b) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(_mm256_srli_epi16(b.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(b.hi, 4), m)};
}
inline __m256i madd4(__m256i u, __m256i s) {
    // u8 x s8 pairs summed to int16 (at most 2 * 255 * 127, or 2 * 128 * 127 here: no saturation), then to int32.
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
// acc + the sum of each lane's 4 unsigned bytes times x's 4 signed bytes.
inline VI dot_u8s8(VI acc, VB u, int32_t x4) {
    const __m256i x = _mm256_set1_epi32(x4);
    return {_mm256_add_epi32(acc.lo, madd4(u.lo, x)), _mm256_add_epi32(acc.hi, madd4(u.hi, x))};
}
// Q8_0: both signed, so |w| times x with w's sign (llama.cpp's trick for CPUs without VNNI).
struct Q8Block {
    VB w[8];
};
inline Q8Block load_q8(const uint8_t* tile) {
    Q8Block b;
    for (int g = 0; g < 8; ++g) b.w[g] = bload(tile + 64 * g);
    return b;
}
inline VI dot_q8(const Q8Block& b, const int32_t* x, const int32_t*) {
    VI acc = vi_zero();
    for (int g = 0; g < 8; ++g) {
        const __m256i xg = _mm256_set1_epi32(x[g]);
        acc = {_mm256_add_epi32(acc.lo, madd4(_mm256_abs_epi8(b.w[g].lo), _mm256_sign_epi8(xg, b.w[g].lo))),
               _mm256_add_epi32(acc.hi, madd4(_mm256_abs_epi8(b.w[g].hi), _mm256_sign_epi8(xg, b.w[g].hi)))};
    }
    return acc;
}
constexpr int ROWS = 2;
constexpr int QROWS = 4;
#include "kernels_impl.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
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
inline V vsub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V vdiv(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V vmin(V a, V b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V vmax(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V vround(V a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V vpow2(V n) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
inline V half_to_v(const uint8_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}

struct VI {
    __m512i v;
};
using VB = VI;
inline VI vi_zero() { return {_mm512_setzero_si512()}; }
inline VI vi_add(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline V vi_to_v(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline VB bload(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline VB nib_lo(VB b) { return {_mm512_and_si512(b.v, _mm512_set1_epi8(0x0F))}; }
inline VB nib_hi(VB b) { return {_mm512_and_si512(_mm512_srli_epi16(b.v, 4), _mm512_set1_epi8(0x0F))}; }
inline VI dot_u8s8(VI acc, VB u, int32_t x4) { return {_mm512_dpbusd_epi32(acc.v, u.v, _mm512_set1_epi32(x4))}; }
// Q8_0 with VNNI: (x + 128) is unsigned, so sum (x + 128) w = sum x w + 128 sum w, and 128 sum w is stored.
struct Q8Block {
    VB w[8];
    VI corr;
};
inline Q8Block load_q8(const uint8_t* tile) {
    Q8Block b;
    for (int g = 0; g < 8; ++g) b.w[g] = bload(tile + 64 * g);
    const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + Q8_SUMS));
    b.corr = {_mm512_slli_epi32(_mm512_cvtepi16_epi32(sums), 7)};
    return b;
}
inline VI dot_q8(const Q8Block& b, const int32_t*, const int32_t* xu) {
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int g = 0; g < 8; g += 2) {
        even = _mm512_dpbusd_epi32(even, _mm512_set1_epi32(xu[g]), b.w[g].v);
        odd = _mm512_dpbusd_epi32(odd, _mm512_set1_epi32(xu[g + 1]), b.w[g + 1].v);
    }
    return {_mm512_sub_epi32(_mm512_add_epi32(even, odd), b.corr.v)};
}
constexpr int ROWS = 8;
constexpr int QROWS = 8;
#include "kernels_impl.h"
}  // namespace avx512
#pragma GCC pop_options

struct Kernels {
    std::string name;
    void (*gemm_f32)(const float*, int64_t, int64_t, const float*, int64_t, float*);
    void (*qgemm)(const QuantizedRows&, int64_t, int64_t, const uint8_t*, int64_t, int, float*, int64_t);
    void (*dequant_row)(const uint8_t*, int64_t, int, float*);
    void (*rms_norm)(const float*, int64_t, int64_t, const float*, float, float*);
    void (*silu_mul)(const float*, int64_t, int64_t, float*);
    void (*attention)(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t*, const int64_t*,
                      const std::vector<uint16_t*>&, const std::vector<uint16_t*>&, const std::vector<int64_t>&,
                      int64_t, const TreeView&, float*);
};

// DSPARK_KERNELS=avx2 runs the AVX2 build on any CPU; =avx512 is honoured only where the CPU has AVX-512 (else its
// first instruction would kill the process), so the override can pick a build, never an instruction set.
Kernels pick_kernels() {
    const char* forced = std::getenv("DSPARK_KERNELS");
    const bool runs_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    const bool avx512 = runs_avx512 && !(forced && std::string(forced) == "avx2");
    if (avx512) {
        return {"avx512", avx512::gemm_f32, avx512::qgemm, avx512::dequant_row, avx512::rms_norm, avx512::silu_mul,
                avx512::attention};
    }
    return {"avx2", avx2::gemm_f32, avx2::qgemm, avx2::dequant_row, avx2::rms_norm, avx2::silu_mul, avx2::attention};
}

const uint8_t* bytes_of(const at::Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }

}  // namespace

struct Matrix {
    at::Tensor data;  // uint8: Q4_1 and Q8_0 as tiles [tiles, tile bytes], F32 as its raw rows; the embedding as
                      // GGUF stores it, one row a token
    int fmt;
    int64_t rows, cols;
};

// y[T, rows] = x[T, cols] @ W^T: float32 matrices as they are, quantised ones from their tiles after x is rounded
// to int8 (a last tile's padding rows are computed into a scratch row and dropped).
void multiply(const Kernels& kernels, const Matrix& m, const float* x, int64_t T, float* y, QuantizedRows& scratch) {
    if (m.fmt == FMT_F32) {
        kernels.gemm_f32(x, T, m.cols, reinterpret_cast<const float*>(m.data.data_ptr()), m.rows, y);
        return;
    }
    quantize_rows(x, T, m.cols, scratch);
    const int64_t tiles = m.data.size(0);
    if (tiles * TILE == m.rows) {
        kernels.qgemm(scratch, T, m.cols, bytes_of(m.data), tiles, m.fmt, y, m.rows);
        return;
    }
    std::vector<float> padded(T * tiles * TILE);
    kernels.qgemm(scratch, T, m.cols, bytes_of(m.data), tiles, m.fmt, padded.data(), tiles * TILE);
    for (int64_t t = 0; t < T; ++t) std::memcpy(y + t * m.rows, padded.data() + t * tiles * TILE, m.rows * 4);
}

// A weight matrix as the kernels take it: Q4_1 and Q8_0 in tiles (weights.py), F32 as its raw rows, or (tiled
// false: the embedding, only looked up) as GGUF stores it.
Matrix checked_matrix(at::Tensor data, int fmt, int64_t rows, int64_t cols, bool tiled, const std::string& name) {
    TORCH_CHECK(fmt == FMT_F32 || fmt == FMT_Q4_1 || fmt == FMT_Q8_0, "unsupported block format ", fmt);
    tiled = tiled && fmt != FMT_F32;
    const int64_t height = tiled ? (rows + TILE - 1) / TILE : rows;
    const int64_t width =
        tiled ? cols / QK * (fmt == FMT_Q4_1 ? Q4_TILE_BYTES : Q8_TILE_BYTES) : cols / QK * block_bytes(fmt);
    TORCH_CHECK(cols % QK == 0 && data.dtype() == at::kByte && data.is_contiguous() && data.dim() == 2 &&
                    data.size(0) == height && data.size(1) == width,
                name, " is not ", rows, " rows of ", cols, " columns of format ", fmt);
    return {data, fmt, rows, cols};
}

std::shared_ptr<ComputePool> checked_pool(std::shared_ptr<ComputePool> pool) {
    TORCH_CHECK(pool, "a compute pool is required (compute_pool(threads))");
    return pool;
}

at::Tensor matmul_of(const Kernels& kernels, ComputePool& pool, const Matrix& m, at::Tensor x) {
    TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == m.cols,
                "x must be contiguous float32 [T, ", m.cols, "]");
    at::Tensor y = at::empty({x.size(0), m.rows}, x.options());
    pybind11::gil_scoped_release no_gil;
    ComputePool::Session session(pool);
    QuantizedRows scratch;
    multiply(kernels, m, x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), scratch);
    return y;
}

// x += y: a layer's residual connection.
void add_into(float* x, const float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

// A forward's row-wise work (norms, SiLU, residuals) split over the pool's threads where it has enough rows to pay
// for a loop (a prompt's); a row's result never depends on the split. Decoding steps of a few rows run it inline.
constexpr int64_t ROW_GRAIN = 16;

void rms_norm_rows(const Kernels& k, const float* x, int64_t T, int64_t K, const float* weight, float eps, float* y) {
    parallel_for(0, T, ROW_GRAIN, [&](int64_t t0, int64_t t1) { k.rms_norm(x + t0 * K, t1 - t0, K, weight, eps, y + t0 * K); });
}

void silu_mul_rows(const Kernels& k, const float* gate_up, int64_t T, int64_t ffn, float* out) {
    parallel_for(0, T, ROW_GRAIN, [&](int64_t t0, int64_t t1) { k.silu_mul(gate_up + t0 * 2 * ffn, t1 - t0, ffn, out + t0 * ffn); });
}

void add_rows(float* x, const float* y, int64_t T, int64_t K) {
    parallel_for(0, T, ROW_GRAIN, [&](int64_t t0, int64_t t1) { add_into(x + t0 * K, y + t0 * K, (t1 - t0) * K); });
}

// The index of the first largest of x[0, n) (torch.argmax's choice on ties), its maximum taken 8 lanes at a time: a
// scalar running maximum is one dependent compare an element, some 40 us over a 16,384-token draft vocabulary.
// A maximum does not depend on the order it is taken in, so the lanes give the scalar loop's answer (NaN logits,
// which have no maximum, give 0).
inline int64_t first_argmax(const float* x, int64_t n) {
    __m256 lanes = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(x + i));
    float top[8];
    _mm256_storeu_ps(top, lanes);
    float best = *std::max_element(top, top + 8);
    for (; i < n; ++i) best = std::max(best, x[i]);
    const int64_t at = std::find(x, x + n, best) - x;
    return at < n ? at : 0;
}

// One matrix on its own (a drafter's rows of the LM head): its product with float32 activations.
class PackedMatrix {
   public:
    PackedMatrix(at::Tensor data, int64_t fmt, int64_t rows, int64_t cols, std::shared_ptr<ComputePool> pool)
        : m_(checked_matrix(data, static_cast<int>(fmt), rows, cols, true, "the matrix")), kernels_(pick_kernels()),
          pool_(checked_pool(pool)) {}

    at::Tensor matmul(at::Tensor x) const { return matmul_of(kernels_, *pool_, m_, x); }

    // The greedy chain of a low-rank Markov head whose transition matrix W2 [rows, cols] this is, with W1 the
    // float32 table [vocab, cols]: from token `previous`, step k's token is the argmax of base[k] + W2 W1[previous]
    // (the first on ties, as torch.argmax), mapped through ids (a draft vocabulary's target ids; empty where the
    // draft vocabulary is the whole one), and it is the next step's previous token. One call for a round's steps,
    // which torch ran as some five operations a step.
    std::vector<int64_t> greedy_chain(at::Tensor base, at::Tensor table, at::Tensor ids, int64_t previous) const {
        TORCH_CHECK(base.dtype() == at::kFloat && base.is_contiguous() && base.dim() == 2 && base.size(1) == m_.rows,
                    "base must be contiguous float32 [n, ", m_.rows, "]");
        TORCH_CHECK(table.dtype() == at::kFloat && table.is_contiguous() && table.dim() == 2 &&
                        table.size(1) == m_.cols,
                    "table must be contiguous float32 [vocab, ", m_.cols, "]");
        TORCH_CHECK(ids.dtype() == at::kLong && ids.is_contiguous() && (ids.numel() == 0 || ids.numel() == m_.rows),
                    "ids must be contiguous int64, empty or ", m_.rows);
        const int64_t n = base.size(0), vocab = table.size(0);
        const float* rows = base.data_ptr<float>();
        const float* w1 = table.data_ptr<float>();
        const int64_t* targets = ids.numel() ? ids.data_ptr<int64_t>() : nullptr;
        std::vector<int64_t> tokens;
        std::vector<float> transition(m_.rows);
        pybind11::gil_scoped_release no_gil;
        ComputePool::Session session(*pool_);
        QuantizedRows scratch;
        for (int64_t k = 0; k < n; ++k) {
            TORCH_CHECK(previous >= 0 && previous < vocab, "token ", previous, " is outside the table");
            multiply(kernels_, m_, w1 + previous * m_.cols, 1, transition.data(), scratch);
            const float* row = rows + k * m_.rows;
            for (int64_t i = 0; i < m_.rows; ++i) transition[i] += row[i];
            const int64_t best = first_argmax(transition.data(), m_.rows);
            previous = targets ? targets[best] : best;
            tokens.push_back(previous);
        }
        return tokens;
    }

   private:
    Matrix m_;
    Kernels kernels_;
    std::shared_ptr<ComputePool> pool_;
};

class PackedModel {
   public:
    PackedModel(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t ffn, double eps,
                std::vector<at::Tensor> matrices, std::vector<int64_t> formats, std::vector<int64_t> rows,
                std::vector<at::Tensor> norms, at::Tensor cos, at::Tensor sin, std::shared_ptr<ComputePool> pool)
        : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), dim_(head_dim), ffn_(ffn), eps_(eps), cos_(cos),
          sin_(sin), kernels_(pick_kernels()), pool_(checked_pool(pool)) {
        // matrices: embedding, LM head, then per layer qkv (rows q, k, v), output, gate_up (rows gate, up), down;
        // rows: each one's output rows. norms: final norm, then per layer attention and feed-forward norms.
        TORCH_CHECK(matrices.size() == formats.size() && matrices.size() == rows.size() &&
                        (matrices.size() - 2) % 4 == 0,
                    "4 matrices a layer");
        TORCH_CHECK(head_dim % 16 == 0 && hidden % QK == 0 && ffn % QK == 0,
                    "head_dim must be a multiple of 16, hidden and ffn multiples of 32");
        const int64_t cols[4] = {hidden, heads * head_dim, hidden, ffn};
        for (size_t i = 0; i < matrices.size(); ++i) {
            const int64_t k = i < 2 ? hidden : cols[(i - 2) % 4];
            matrices_.push_back(checked_matrix(matrices[i], static_cast<int>(formats[i]), rows[i], k, i > 0,
                                               "matrix " + std::to_string(i)));
        }
        layers_ = (static_cast<int64_t>(matrices.size()) - 2) / 4;
        norms_ = norms;
    }

    std::string kernels() const { return kernels_.name; }

    // tokens, seq, pos: [T] int64; keys/values: one cache per sequence. Returns the final normed hidden states
    // [T, hidden], the logits [T, vocab] (or of the tokens logit_rows names: a prefill needs only each prompt's
    // last) and every layer's input plus the normed output [layers + 1, T, hidden] (when asked), in HF's
    // hidden_states order. A token tree (tree_view) gives each token the slot its key and value are written at and
    // its parent among the tokens (-1: the sequence's cache before it).
    std::vector<at::Tensor> forward(at::Tensor tokens, at::Tensor seq, at::Tensor pos, std::vector<at::Tensor> keys,
                                    std::vector<at::Tensor> values, bool want_states,
                                    std::optional<at::Tensor> logit_rows, std::optional<at::Tensor> slots,
                                    std::optional<at::Tensor> parents) {
        TORCH_CHECK(tokens.dtype() == at::kLong && seq.dtype() == at::kLong && pos.dtype() == at::kLong);
        const int64_t T = tokens.size(0), qkv_width = (heads_ + 2 * kv_heads_) * dim_;
        const auto f32 = at::TensorOptions().dtype(at::kFloat);
        at::Tensor x = at::empty({T, hidden_}, f32), h = at::empty({T, hidden_}, f32);
        at::Tensor qkv = at::empty({T, qkv_width}, f32), att = at::empty({T, heads_ * dim_}, f32);
        at::Tensor proj = at::empty({T, hidden_}, f32), gate_up = at::empty({T, 2 * ffn_}, f32);
        at::Tensor act = at::empty({T, ffn_}, f32);
        at::Tensor states = want_states ? at::empty({layers_ + 1, T, hidden_}, f32) : at::Tensor();
        const int64_t* picked = logit_rows ? logit_rows->data_ptr<int64_t>() : nullptr;
        const int64_t L = logit_rows ? logit_rows->size(0) : T;
        if (picked) {
            TORCH_CHECK(logit_rows->dtype() == at::kLong && logit_rows->is_contiguous());
            for (int64_t i = 0; i < L; ++i) TORCH_CHECK(picked[i] >= 0 && picked[i] < T, "logit row out of range");
        }
        at::Tensor logits = at::empty({L, matrices_[1].rows}, f32);
        std::vector<uint16_t*> key_ptrs, value_ptrs;
        std::vector<int64_t> caps;
        for (size_t s = 0; s < keys.size(); ++s) {
            const int64_t cap = values[s].size(2);
            TORCH_CHECK(keys[s].is_contiguous() && values[s].is_contiguous() && cap % 16 == 0 &&
                            keys[s].dtype() == at::kHalf && values[s].dtype() == at::kHalf &&
                            keys[s].numel() == values[s].numel() && values[s].size(0) == layers_,
                        "sequence ", s, "'s cache is not one of new_cache's");
            key_ptrs.push_back(reinterpret_cast<uint16_t*>(keys[s].data_ptr<at::Half>()));
            value_ptrs.push_back(reinterpret_cast<uint16_t*>(values[s].data_ptr<at::Half>()));
            caps.push_back(cap);
        }
        const int64_t* tok = tokens.data_ptr<int64_t>();
        const int64_t* sq = seq.data_ptr<int64_t>();
        const int64_t* ps = pos.data_ptr<int64_t>();
        TORCH_CHECK(slots.has_value() == parents.has_value(), "a tree gives both slots and parents");
        const TreeView tree = slots ? tree_view(*slots, *parents, sq, ps) : TreeView{};
        const int64_t* at_slot = slots ? slots->data_ptr<int64_t>() : ps;
        for (int64_t t = 0; t < T; ++t) {
            TORCH_CHECK(sq[t] >= 0 && sq[t] < static_cast<int64_t>(keys.size()) && ps[t] >= 0 && ps[t] < caps[sq[t]] &&
                            at_slot[t] < caps[sq[t]],
                        "token ", t, " has no room in its sequence's cache");
            TORCH_CHECK(tok[t] >= 0 && tok[t] < matrices_[0].rows, "token id ", tok[t], " out of range");
        }
        {
            pybind11::gil_scoped_release no_gil;
            ComputePool::Session session(*pool_);
            const Kernels& k = kernels_;
            QuantizedRows scratch;
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
                rms_norm_rows(k, xp, T, hidden_, norms_[1 + 2 * l].data_ptr<float>(), eps_, hp);
                multiply(k, m[0], hp, T, qp, scratch);
                rope_and_store(qp, T, sq, ps, at_slot, l, key_ptrs, value_ptrs, caps);
                k.attention(qp, qkv_width, T, heads_, kv_heads_, dim_, sq, ps, key_ptrs, value_ptrs, caps, l, tree,
                            att.data_ptr<float>());
                multiply(k, m[1], att.data_ptr<float>(), T, proj.data_ptr<float>(), scratch);
                add_rows(xp, proj.data_ptr<float>(), T, hidden_);
                rms_norm_rows(k, xp, T, hidden_, norms_[2 + 2 * l].data_ptr<float>(), eps_, hp);
                multiply(k, m[2], hp, T, gate_up.data_ptr<float>(), scratch);
                silu_mul_rows(k, gate_up.data_ptr<float>(), T, ffn_, act.data_ptr<float>());
                multiply(k, m[3], act.data_ptr<float>(), T, proj.data_ptr<float>(), scratch);
                add_rows(xp, proj.data_ptr<float>(), T, hidden_);
            }
            rms_norm_rows(k, xp, T, hidden_, norms_[0].data_ptr<float>(), eps_, hp);
            if (want_states) std::memcpy(states[layers_].data_ptr<float>(), hp, T * hidden_ * sizeof(float));
            const float* head_in = hp;
            std::vector<float> rows;
            if (picked) {
                rows.resize(L * hidden_);
                for (int64_t i = 0; i < L; ++i) std::memcpy(&rows[i * hidden_], hp + picked[i] * hidden_, hidden_ * 4);
                head_in = rows.data();
            }
            multiply(k, matrices_[1], head_in, L, logits.data_ptr<float>(), scratch);
        }
        return {h, logits, want_states ? states : at::Tensor()};
    }

    // A weight matrix's product with x [T, cols] (tests and the weight-read benchmark); the embedding (index 0)
    // is only looked up.
    at::Tensor matmul(int64_t index, at::Tensor x) {
        TORCH_CHECK(index > 0, "the embedding is looked up, not multiplied");
        return matmul_of(kernels_, *pool_, matrices_.at(index), x);
    }

   private:
    // Each tree token's view (TreeView), checked: a token is written at its position or past it, at a slot of its
    // own; its parent comes before it in its sequence, one position back; and a token written at its position has
    // every ancestor at theirs, the one before it (the tree's first branch, read in place as any draft is).
    static TreeView tree_view(const at::Tensor& slots, const at::Tensor& parents, const int64_t* seq,
                              const int64_t* pos) {
        const int64_t T = slots.size(0);
        TORCH_CHECK(slots.dtype() == at::kLong && parents.dtype() == at::kLong && slots.is_contiguous() &&
                        parents.is_contiguous() && parents.size(0) == T,
                    "slots and parents must be contiguous int64, one per token");
        const int64_t* slot = slots.data_ptr<int64_t>();
        const int64_t* parent = parents.data_ptr<int64_t>();
        TreeView tree{std::vector<int64_t>(T), std::vector<std::vector<int64_t>>(T)};
        for (int64_t t = 0; t < T; ++t) {
            const int64_t up = parent[t];
            TORCH_CHECK(slot[t] >= pos[t], "token ", t, " is written before its position");
            TORCH_CHECK(up < t && (up < 0 || (seq[up] == seq[t] && pos[up] + 1 == pos[t])),
                        "token ", t, "'s parent is not the token one position before it in its sequence");
            if (slot[t] == pos[t]) {
                TORCH_CHECK(up < 0 || (up == t - 1 && slot[up] == pos[up]),
                            "token ", t, " is written at its position, but its parent is not at theirs");
                tree.first_off[t] = pos[t] + 1;
                continue;
            }
            std::vector<int64_t>& path = tree.slots[t];
            int64_t a = t;
            for (; a >= 0 && slot[a] != pos[a]; a = parent[a]) path.push_back(slot[a]);
            std::reverse(path.begin(), path.end());
            tree.first_off[t] = pos[t] + 1 - static_cast<int64_t>(path.size());
        }
        return tree;
    }

    // RoPE on q and k in GGUF's row order (each head's pairs interleaved: element 2i with 2i + 1, frequency i),
    // then k and v into the token's slot of its sequence's cache (its position, unless a tree puts it past it).
    void rope_and_store(float* qkv, int64_t T, const int64_t* seq, const int64_t* pos, const int64_t* slot,
                        int64_t layer,
                        const std::vector<uint16_t*>& keys, const std::vector<uint16_t*>& values,
                        const std::vector<int64_t>& caps) const {
        const int64_t width = (heads_ + 2 * kv_heads_) * dim_, half = dim_ / 2;
        parallel_for(0, T, ROW_GRAIN, [&](int64_t t0, int64_t t1) { for (int64_t t = t0; t < t1; ++t) {
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
                const int64_t head = (layer * kv_heads_ + h) * caps[seq[t]] * dim_;
                uint16_t* key = keys[seq[t]] + head + slot[t] / 16 * dim_ * 16 + slot[t] % 16;
                uint16_t* value = values[seq[t]] + head + slot[t] * dim_;
                const float* k = row + (heads_ + h) * dim_;
                const float* v = row + (heads_ + kv_heads_ + h) * dim_;
                for (int64_t d = 0; d < dim_; ++d) {
                    key[d * 16] = _cvtss_sh(k[d], _MM_FROUND_TO_NEAREST_INT);
                    value[d] = _cvtss_sh(v[d], _MM_FROUND_TO_NEAREST_INT);
                }
            }
        } });
    }

    int64_t hidden_, heads_, kv_heads_, dim_, ffn_, layers_ = 0;
    float eps_;
    at::Tensor cos_, sin_;
    std::vector<Matrix> matrices_;
    std::vector<at::Tensor> norms_;
    Kernels kernels_;
    std::shared_ptr<ComputePool> pool_;
};

#include "drafter_block.h"

// From now on, torch ops on the calling thread run serially (at::parallel_for reads the calling thread's OpenMP
// thread count, once torch has set it up for that thread). For the thread that drives the engine: its own torch ops
// are small (a token's logits, a drafter's heads), and an OpenMP team of its own would leave a helper spinning on a
// core the pool's workers need after every one of them (DSpark decoding 175 tokens/s against 235 without).
void serial_torch_on_this_thread() {
    at::get_num_threads();
    omp_set_num_threads(1);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.attr("ATTENTION_SPLIT") = SPLIT;
    pybind11::class_<ComputePool, std::shared_ptr<ComputePool>>(m, "ComputePool")
        .def_property_readonly("threads", &ComputePool::threads)
        .def("worker_ids", &ComputePool::worker_ids)
        .def("last_call_ids", &ComputePool::last_call_ids, pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("compute_pool", &ComputePool::shared, pybind11::arg("threads"),
          "The process's pool of `threads` threads (one per count, made on first use, shared).");
    m.def("serial_torch_on_this_thread", &serial_torch_on_this_thread);
    pybind11::class_<PackedMatrix>(m, "PackedMatrix")
        .def(pybind11::init<at::Tensor, int64_t, int64_t, int64_t, std::shared_ptr<ComputePool>>())
        .def("matmul", &PackedMatrix::matmul)
        .def("greedy_chain", &PackedMatrix::greedy_chain);
    pybind11::class_<PackedModel>(m, "PackedModel")
        .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, std::vector<at::Tensor>,
                            std::vector<int64_t>, std::vector<int64_t>, std::vector<at::Tensor>, at::Tensor,
                            at::Tensor, std::shared_ptr<ComputePool>>())
        .def("forward", &PackedModel::forward, pybind11::arg("tokens"), pybind11::arg("seq"), pybind11::arg("pos"),
             pybind11::arg("keys"), pybind11::arg("values"), pybind11::arg("want_states"),
             pybind11::arg("logit_rows") = std::nullopt, pybind11::arg("slots") = std::nullopt,
             pybind11::arg("parents") = std::nullopt)
        .def("matmul", &PackedModel::matmul)
        .def_property_readonly("kernels", &PackedModel::kernels);
    pybind11::class_<PackedDrafter>(m, "PackedDrafter")
        .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, std::vector<at::Tensor>,
                            std::vector<at::Tensor>, at::Tensor, at::Tensor, std::shared_ptr<ComputePool>>())
        .def("extend", &PackedDrafter::extend)
        .def("block", &PackedDrafter::block);
}
