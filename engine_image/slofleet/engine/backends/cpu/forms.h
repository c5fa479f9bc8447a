// A checkpoint's quantised forms of a weight (quant.py), unpacked to the bf16 tiles tile_gemm.cpp reads, bit for bit
// those tile_pack makes of the dequantised weight rounded to bf16, or to the fp32 panels small_gemm.cpp reads.
//
// A form holds W [N, K] as [N / 16, K / 32, step bytes]: per panel of 16 columns (tile_pack's order) and k-step of 32,
// one tile's 16 rows (k pairs) of q, then the columns' fp16 scales d (and minimums m). Lane 2j + e of tile row kk is
// column j at k = 2 kk + e; of a row's 32 lanes, those of columns 0-7 come from its first q bytes (or low nibbles),
// those of columns 8-15 from the next (or high nibbles). Forms: Q4_1, w = d * q + m with q in 0..15; Q8_0, w = d * q
// with q in -127..127, each in fp32 as gguf dequantises it, then rounded to bf16. Both products are exact in fp32
// (11-bit d by 4 or 8 bits), so Q4_1's fused multiply-add rounds as gguf's product then sum do; no result can be
// subnormal (d and m are fp16), which the bf16 conversion would flush.
#pragma once
#include <cstdint>

#include "cpu_kernels.h"

namespace slofleet {

enum Form { PLAIN = 0, Q4_1 = 1, Q8_0 = 2 };
constexpr int64_t step_bytes(int form) { return form == Q4_1 ? 16 * 16 + 2 * 32 : form == Q8_0 ? 16 * 32 + 32 : 0; }

#if defined(__AVX512F__)
// Tile row kk of a step's q as 32-bit lanes in the row's order: columns 0-7 in a, 8-15 in b (lane 2j + e: k 2 kk + e).
template <int FORM>
[[gnu::always_inline]] inline void q_lanes(const uint8_t *src, int kk, __m512i &a, __m512i &b) {
    if constexpr (FORM == Q4_1) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src + 16 * kk)));
        a = _mm512_and_si512(v, _mm512_set1_epi32(15)), b = _mm512_srli_epi32(v, 4);
    } else {
        const __m128i *q = reinterpret_cast<const __m128i *>(src + 32 * kk);
        a = _mm512_cvtepi8_epi32(_mm_loadu_si128(q)), b = _mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1));
    }
}

#define SLOFLEET_FP32_FORMS 1
// One step of a form into fp32 rows: k-row kk of the step's 32 at dst + kk * row, the panel's 16 columns in order, each
// weight d * q (+ m) as gguf computes it (the fp32 weight quant.recover found the form of), for small_gemm.cpp.
template <int FORM>
[[gnu::always_inline]] inline void unpack_step_fp32(const uint8_t *src, float *dst, int64_t row) {
    // lane 2j + e of a tile row is column j at k = 2 kk + e: both halves' even lanes make k's row, their odd k + 1's
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const uint8_t *scales = src + (FORM == Q4_1 ? 256 : 512);
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(scales))), m;
    if constexpr (FORM == Q4_1) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(scales + 32)));
    for (int kk = 0; kk < 16; kk++) {
        __m512i a, b;
        q_lanes<FORM>(src, kk, a, b);
        __m512 q0 = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(a, even, b));
        __m512 q1 = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(a, odd, b));
        if constexpr (FORM == Q4_1) {  // d * q is exact, so the fused add rounds as gguf's separate one
            _mm512_storeu_ps(dst + 2 * kk * row, _mm512_fmadd_ps(q0, d, m));
            _mm512_storeu_ps(dst + (2 * kk + 1) * row, _mm512_fmadd_ps(q1, d, m));
        } else {
            _mm512_storeu_ps(dst + 2 * kk * row, _mm512_mul_ps(q0, d));
            _mm512_storeu_ps(dst + (2 * kk + 1) * row, _mm512_mul_ps(q1, d));
        }
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define SLOFLEET_FP32_FORMS 1
// unpack_step_fp32 with AVX2's 8 lanes: tile row kk's bytes gathered even lanes first (k = 2 kk), then odd (k + 1),
// so each k-row's 8 columns of a half come out of one widening; the same d * q (+ m) in fp32.
template <int FORM>
[[gnu::always_inline]] inline void unpack_step_fp32(const uint8_t *src, float *dst, int64_t row) {
    const __m128i parity = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const uint8_t *scales = src + (FORM == Q4_1 ? 256 : 512);
    auto fp16x8 = [](const uint8_t *at) {  // 8 columns' fp16 scales (or minimums)
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(at)));
    };
    __m256 d[2] = {fp16x8(scales), fp16x8(scales + 16)}, m[2];
    if constexpr (FORM == Q4_1) m[0] = fp16x8(scales + 32), m[1] = fp16x8(scales + 48);
    for (int kk = 0; kk < 16; kk++) {
        __m128i half[2];  // columns 0-7 and 8-15 of k-rows 2 kk (bytes 0-7) and 2 kk + 1 (bytes 8-15)
        if constexpr (FORM == Q4_1) {
            __m128i v = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src + 16 * kk)), parity);
            const __m128i low = _mm_set1_epi8(15);
            half[0] = _mm_and_si128(v, low), half[1] = _mm_and_si128(_mm_srli_epi16(v, 4), low);
        } else {
            const __m128i *q = reinterpret_cast<const __m128i *>(src + 32 * kk);
            half[0] = _mm_shuffle_epi8(_mm_loadu_si128(q), parity);
            half[1] = _mm_shuffle_epi8(_mm_loadu_si128(q + 1), parity);
        }
        for (int e = 0; e < 2; e++)
            for (int h = 0; h < 2; h++) {
                __m128i bytes = e ? _mm_srli_si128(half[h], 8) : half[h];
                __m256i ints = FORM == Q4_1 ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes);
                __m256 q = _mm256_cvtepi32_ps(ints);
                float *out = dst + (2 * kk + e) * row + 8 * h;
                if constexpr (FORM == Q4_1)  // d * q is exact, so the fused add rounds as gguf's separate one
                    _mm256_storeu_ps(out, _mm256_fmadd_ps(q, d[h], m[h]));
                else
                    _mm256_storeu_ps(out, _mm256_mul_ps(q, d[h]));
            }
    }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define SLOFLEET_FORMS 1

// Lanes 2j + e <- column j (first 8) and 8 + j (second 8) of one of the step's fp16 vectors of 16 columns.
inline void spread(const uint8_t *at, __m512 &first, __m512 &second) {
    const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(at)));
    first = _mm512_permutexvar_ps(lo, v), second = _mm512_permutexvar_ps(_mm512_add_epi32(lo, _mm512_set1_epi32(8)), v);
}

inline void store_row(uint16_t *dst, __m512 first, __m512 second) {
    __m512bh pairs = _mm512_cvtne2ps_pbh(second, first);  // first's lanes first
    _mm512_store_si512(dst, reinterpret_cast<__m512i &>(pairs));
}

// One step of a form into a bf16 tile (1 KiB, 64-byte aligned).
template <int FORM>
[[gnu::always_inline]] inline void unpack_step(const uint8_t *src, uint16_t *dst) {
    __m512 d0, d1, m0, m1;
    spread(src + (FORM == Q4_1 ? 256 : 512), d0, d1);
    if constexpr (FORM == Q4_1) spread(src + 288, m0, m1);
    for (int kk = 0; kk < 16; kk++) {
        __m512i a, b;
        q_lanes<FORM>(src, kk, a, b);
        __m512 lo = _mm512_cvtepi32_ps(a), hi = _mm512_cvtepi32_ps(b);
        if constexpr (FORM == Q4_1)
            store_row(dst + 32 * kk, _mm512_fmadd_ps(lo, d0, m0), _mm512_fmadd_ps(hi, d1, m1));
        else
            store_row(dst + 32 * kk, _mm512_mul_ps(lo, d0), _mm512_mul_ps(hi, d1));
    }
}

// `steps` consecutive steps of a form into as many tiles; with `ahead`, asking for the bytes that far on (past W's
// end too: a prefetch never faults), so a kernel's products between two calls issue no loads of their own.
inline void unpack_steps(int form, const uint8_t *src, int64_t steps, uint16_t *dst, int64_t ahead = 0) {
    int64_t bytes = step_bytes(form);
    for (int64_t s = 0; s < steps; s++) {
        if (ahead) prefetch_lines(src + s * bytes + ahead, bytes);
        if (form == Q4_1)
            unpack_step<Q4_1>(src + s * bytes, dst + s * 512);
        else
            unpack_step<Q8_0>(src + s * bytes, dst + s * 512);
    }
}
#endif

}  // namespace slofleet
