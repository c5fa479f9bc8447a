// Helpers the CPU kernels share: bf16 <-> fp32 as torch rounds, and the vector type of the CPU in hand (AVX-512, else
// AVX2 with FMA) with the few operations the attention kernel needs, so that kernel is written once for both widths.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#include <initializer_list>
#endif

namespace slofleet {

// Zeros in place of a row past a context's end: the cache there may hold anything, and 0 x NaN is NaN.
alignas(64) inline constexpr uint16_t ZERO_ROW[256] = {};

// f(std::integral_constant<int, rows>) for rows in 1 .. MAX: a kernel whose sums live in registers needs its count of
// rows at compile time, so a call for the last few rows picks the instantiation for exactly that many.
template <int MAX, class F>
void with_rows(int rows, F &&f) {
    if constexpr (MAX > 0) {
        if (rows == MAX) return f(std::integral_constant<int, MAX>{});
        with_rows<MAX - 1>(rows, f);
    }
}

// Asks for the cache lines of [p, p + bytes), to be read soon. Inlined by force, as must be any function that only
// prefetches: GCC 12's pure-const analysis deems it free of effects and drops its calls before inlining them.
[[gnu::always_inline]] inline void prefetch_lines(const void *p, int64_t bytes) {
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(static_cast<const char *>(p) + c, 0, 3);
}

inline float bf16_widen(uint16_t x) { return __builtin_bit_cast(float, uint32_t(x) << 16); }  // its top half

inline uint16_t bf16_round(float f) {  // nearest even, as torch's conversion; NaN stays NaN
    uint32_t u = __builtin_bit_cast(uint32_t, f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

// Element i of an fp32 or bf16 buffer as fp32, and back (rounded as torch rounds).
template <bool BF16>
inline float ld(const void *p, int64_t i) {
    return BF16 ? bf16_widen(static_cast<const uint16_t *>(p)[i]) : static_cast<const float *>(p)[i];
}

template <bool BF16>
inline void st(void *p, int64_t i, float f) {
    if constexpr (BF16)
        static_cast<uint16_t *>(p)[i] = bf16_round(f);
    else
        static_cast<float *>(p)[i] = f;
}

#if defined(__AVX512F__)
template <bool BF16>
inline __m512 load16(const void *base, int64_t idx) {
    if constexpr (BF16) {  // widen, then shift into the top half
        __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(static_cast<const uint16_t *>(base) + idx));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
        return _mm512_loadu_ps(static_cast<const float *>(base) + idx);
    }
}

// e^x as 2^k * p(r), a degree-6 polynomial (relative error under 2e-7); 0 below -87 (a padded slot's -inf too),
// e^88 above 88.
inline __m512 exp16(__m512 x) {
    __m512 v = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), v);
    r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.38873944e-3f);
    for (float c : {8.33338592e-3f, 4.16666418e-2f, 0.166666672f, 0.5f, 1.0f, 1.0f})
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    __m512 e = _mm512_scalef_ps(p, k);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), e);
}

// fp32 lanes rounded to bf16 (nearest even, as torch) and kept as fp32; NaN is not expected here.
inline __m512 keep_bf16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xffff0000u))));
}

// silu(g) * u of bf16 values held as fp32, each op rounded to bf16 as torch's silu and mul_ round them.
inline __m512 silu_mul16(__m512 g, __m512 u) {
    __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    return keep_bf16(_mm512_mul_ps(keep_bf16(s), u));
}

#if defined(__AVX512BF16__)
// acc + the products of a and b's bf16 pairs (vdpbf16ps), each lane's two summed into it.
inline __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh &>(a), reinterpret_cast<__m512bh &>(b));
}

// 16 fp32 lanes rounded to bf16 (nearest even), each in the low half of a 32-bit lane.
inline __m512i bf16_lanes(__m512 f) {
    __m256bh h = _mm512_cvtneps_pbh(f);
    return _mm512_cvtepu16_epi32(reinterpret_cast<__m256i &>(h));
}

// 32 dims of two rows a and b interleaved in bf16 pairs (a's, b's), for a product with a broadcast pair of weights:
// lane j of `even` holds dim 8 (j / 4) + j % 4, of `odd` that + 4 (unpack's order, which store_pairs undoes).
inline void pair_rows(const uint16_t *a, const uint16_t *b, __m512i &even, __m512i &odd) {
    __m512i x = _mm512_loadu_si512(a), y = _mm512_loadu_si512(b);
    even = _mm512_unpacklo_epi16(x, y), odd = _mm512_unpackhi_epi16(x, y);
}

// The 32 dims of the sums of pair_rows' `even` and `odd` products, in their order, times f.
inline void store_pairs(float *out, __m512 even, __m512 odd, __m512 f) {  // 128-bit pieces e0 o0 e1 o1 | e2 o2 e3 o3
    __m512 a = _mm512_shuffle_f32x4(even, odd, _MM_SHUFFLE(1, 0, 1, 0));
    __m512 b = _mm512_shuffle_f32x4(even, odd, _MM_SHUFFLE(3, 2, 3, 2));
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(3, 1, 2, 0)), f));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_shuffle_f32x4(b, b, _MM_SHUFFLE(3, 1, 2, 0)), f));
}
#endif

// 16 fp32 lanes already rounded to bf16 (keep_bf16), stored as 16 bf16 where the mask says.
inline void store_bf16(uint16_t *p, __m512 rounded, __mmask16 keep = 0xffff) {
    _mm256_mask_storeu_epi16(p, keep, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}

// Set once this process may use the tile registers (tile_gemm.cpp's tile_enable): a kernel that can run either way
// checks it, since a tile instruction before that kills the process.
inline bool tiles_granted = false;

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
// Call between writing a buffer and loading tiles from it: GCC's tile load is an asm that declares no memory read, so
// without this the compiler may drop or sink the buffer's stores (a decode kernel's Q^T tiles came out zero).
[[gnu::always_inline]] inline void tile_fence() { asm volatile("" ::: "memory"); }

// The tile unit's configuration (_tile_loadconfig): per tile register, its rows and bytes per row.
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};
#endif

struct V512 {
    using T = __m512;
    static constexpr int N = 16;
    template <bool BF16>
    static T load(const void *base, int64_t idx) { return load16<BF16>(base, idx); }
    static T loadu(const float *p) { return _mm512_loadu_ps(p); }
    static void storeu(float *p, T v) { _mm512_storeu_ps(p, v); }
    static T zero() { return _mm512_setzero_ps(); }
    static T set1(float f) { return _mm512_set1_ps(f); }
    static T add(T a, T b) { return _mm512_add_ps(a, b); }
    static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
    static T vmax(T a, T b) { return _mm512_max_ps(a, b); }
    // s where key <= pos (the lane's row sees that key), else -inf
    static T mask_after(T s, T pos, float key) {
        return _mm512_mask_mov_ps(set1(-INFINITY), _mm512_cmp_ps_mask(set1(key), pos, _CMP_LE_OQ), s);
    }
    static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
    static T div(T a, T b) { return _mm512_div_ps(a, b); }
    static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
    static float sum(T v) { return _mm512_reduce_add_ps(v); }
    // Lane i: the sum of v[i]'s lanes, for all 16 at once (45 shuffles and adds where 16 sum()s take ~130).
    static T sums(const T *v) {
        T c[8], d[4];
        for (int i = 0; i < 8; i++)
            c[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
        for (int i = 0; i < 4; i++)  // per 128-bit lane: the lane's partial sums of v[4i] .. v[4i + 3]
            d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
        T f0 = _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 2, 3, 2)));
        T f1 = _mm512_add_ps(_mm512_shuffle_f32x4(d[2], d[3], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(d[2], d[3], _MM_SHUFFLE(3, 2, 3, 2)));
        return _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(f0, f1, _MM_SHUFFLE(3, 1, 3, 1)));
    }
    static float max(T v) { return _mm512_reduce_max_ps(v); }
    static T exp(T x) { return exp16(x); }
    static T round_bf16(T v) { return keep_bf16(v); }
    template <bool BF16>
    static void store(void *base, int64_t idx, T v) {  // bf16: rounded to nearest even, as torch stores it
        if constexpr (BF16)
            store_bf16(static_cast<uint16_t *>(base) + idx, keep_bf16(v));
        else
            _mm512_storeu_ps(static_cast<float *>(base) + idx, v);
    }
};
using Vec = V512;
#define SLOFLEET_VEC 1
#elif defined(__AVX2__) && defined(__FMA__)
struct V256 {
    using T = __m256;
    static constexpr int N = 8;
    template <bool BF16>
    static T load(const void *base, int64_t idx) {
        if constexpr (BF16) {
            __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(static_cast<const uint16_t *>(base) + idx));
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        } else {
            return loadu(static_cast<const float *>(base) + idx);
        }
    }
    static T loadu(const float *p) { return _mm256_loadu_ps(p); }
    static void storeu(float *p, T v) { _mm256_storeu_ps(p, v); }
    static T zero() { return _mm256_setzero_ps(); }
    static T set1(float f) { return _mm256_set1_ps(f); }
    static T add(T a, T b) { return _mm256_add_ps(a, b); }
    static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
    static T vmax(T a, T b) { return _mm256_max_ps(a, b); }
    static T mask_after(T s, T pos, float key) {
        return _mm256_blendv_ps(set1(-INFINITY), s, _mm256_cmp_ps(set1(key), pos, _CMP_LE_OQ));
    }
    static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
    static T div(T a, T b) { return _mm256_div_ps(a, b); }
    static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
    static float sum(T v) {
        __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
    }
    static T sums(const T *v) {  // lane i: the sum of v[i]'s lanes, for all 8 at once
        T c[4], d[2];
        for (int i = 0; i < 4; i++)
            c[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
        for (int i = 0; i < 2; i++)
            d[i] = _mm256_add_ps(_mm256_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
        return _mm256_add_ps(_mm256_permute2f128_ps(d[0], d[1], 0x20), _mm256_permute2f128_ps(d[0], d[1], 0x31));
    }
    static float max(T v) {
        __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        x = _mm_max_ps(x, _mm_movehl_ps(x, x));
        return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
    }
    // The same e^x as exp16; 2^k is built in the exponent bits, as AVX2 has no scalef (k stays within [-126, 127]).
    static T exp(T x) {
        T v = _mm256_min_ps(_mm256_max_ps(x, set1(-87.0f)), set1(88.0f));
        T k = _mm256_round_ps(_mm256_mul_ps(v, set1(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        T r = _mm256_fnmadd_ps(k, set1(0.693359375f), v);
        r = _mm256_fmadd_ps(k, set1(2.12194440e-4f), r);
        T p = set1(1.38873944e-3f);
        for (float c : {8.33338592e-3f, 4.16666418e-2f, 0.166666672f, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, set1(c));
        __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_cmp_ps(x, set1(-87.0f), _CMP_GE_OQ));
    }
    static T round_bf16(T f) {  // as keep_bf16
        __m256i u = _mm256_castps_si256(f);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
        return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(int(0xffff0000u))));
    }
    template <bool BF16>
    static void store(void *base, int64_t idx, T v) {
        if constexpr (BF16) {
            __m256i h = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
            _mm_storeu_si128(reinterpret_cast<__m128i *>(static_cast<uint16_t *>(base) + idx),
                             _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
        } else {
            _mm256_storeu_ps(static_cast<float *>(base) + idx, v);
        }
    }
};
using Vec = V256;
#define SLOFLEET_VEC 1
#endif

// A prefill-attention call (prefill_attention.cpp, tile_attention.cpp): q [T, H, D] strided (q_tok, q_head), caches
// [blocks, block_size, KVH, D], out [T, H, D] contiguous, block_tables [B, bt_stride] int32, rows the batch rows to
// attend; per batch row query_start, query_len and seq_len.
struct Prefill {
    const void *q;
    int64_t q_tok, q_head;
    const void *k, *v;
    const int32_t *tables;
    int64_t bt_stride;
    const int32_t *rows;
    int n_rows;
    const int32_t *query_start, *query_len, *seq_len;
    void *out;
    int heads, kv_heads, block_size;
    float scale;
    int threads;
};

// Calls f(b, kvh, j0, j1) for every (batch row b, KV head, block of at most `per` query tokens j0..j1) on the call's
// threads; each thread first makes a Scope (a kernel's per-thread setup, undone when it ends). Rows in order, each
// with its blocks last block first: the longest contexts start early, so the dynamic schedule ends level.
template <class Scope, class F>
void each_item(const Prefill &p, int per, F &&f) {
    int64_t items = 0;
    for (int i = 0; i < p.n_rows; i++) items += int64_t(p.kv_heads) * ((p.query_len[p.rows[i]] + per - 1) / per);
#pragma omp parallel num_threads(p.threads)
    {
        Scope scope;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            int64_t left = item;
            int i = 0, nb = 0;
            for (; i < p.n_rows; i++) {
                nb = (p.query_len[p.rows[i]] + per - 1) / per;
                if (left < int64_t(p.kv_heads) * nb) break;
                left -= int64_t(p.kv_heads) * nb;
            }
            int b = p.rows[i], blk = nb - 1 - int(left / p.kv_heads);
            f(b, int(left % p.kv_heads), blk * per, std::min(p.query_len[b], blk * per + per));
        }
    }
}

// Rows r of o [rows][D] into out, row r being query token j0 + r / g of head kvh * g + r % g.
template <int D, bool BF16>
void put_rows(const Prefill &p, int b, int kvh, int j0, int rows, const float *o) {
    const int g = p.heads / p.kv_heads;
    for (int r = 0; r < rows; r++) {
        int64_t at = ((p.query_start[b] + j0 + r / g) * int64_t(p.heads) + kvh * g + r % g) * D;
#if defined(SLOFLEET_VEC)
        for (int d = 0; d < D; d += Vec::N) Vec::template store<BF16>(p.out, at + d, Vec::loadu(o + r * D + d));
#else
        if constexpr (BF16) {
            for (int d = 0; d < D; d++) static_cast<uint16_t *>(p.out)[at + d] = bf16_round(o[r * D + d]);
        } else {
            std::memcpy(static_cast<float *>(p.out) + at, o + r * D, D * sizeof(float));
        }
#endif
    }
}

}  // namespace slofleet
