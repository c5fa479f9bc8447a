// Scalar helpers the CPU kernels share: bf16 <-> fp32 as torch rounds.
#pragma once
#include <cstdint>

namespace slofleet {

inline float bf16_widen(uint16_t x) { return __builtin_bit_cast(float, uint32_t(x) << 16); }  // its top half

inline uint16_t bf16_round(float f) {  // nearest even, as torch's conversion; NaN stays NaN
    uint32_t u = __builtin_bit_cast(uint32_t, f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

}  // namespace slofleet
