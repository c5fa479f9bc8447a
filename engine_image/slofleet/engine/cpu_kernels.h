// Helpers the CPU kernels share: bf16 <-> fp32 as torch rounds, and AVX-512 loads and exp where the CPU has it.
#pragma once
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>

#include <initializer_list>
#endif

namespace slofleet {

inline float bf16_widen(uint16_t x) { return __builtin_bit_cast(float, uint32_t(x) << 16); }  // its top half

inline uint16_t bf16_round(float f) {  // nearest even, as torch's conversion; NaN stays NaN
    uint32_t u = __builtin_bit_cast(uint32_t, f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
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
#endif

}  // namespace slofleet
