// Decode attention's scores on the AMX tile unit (paged_attention.cpp's attend_dot<.., true>), where a slice is
// always 16 keys of one block (the block size a multiple of 16): S^T [16 keys, 16 heads] = K [16 keys, D] x Q^T, K's
// tile rows loaded from the cache as they lie, so no dot product is summed across a vector's lanes (that sum and the
// products took half of a decode layer on the vector unit). Registers: 0 and 5 S^T of a slice and the next, 1 .. D / 32
// Q^T's pieces (kept for the whole row), 6 and 7 K's pieces in turn. A slice's keys past the context are still in its
// block, whatever they hold: each reaches only its own row of S^T, which the caller scores -inf.
#pragma once
#include <cstdint>

#include "cpu_kernels.h"

namespace slofleet {

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define SLOFLEET_TILE_DECODE 1
struct DecodeTiles {  // a thread's tile registers while it runs decode items
    bool on;
    explicit DecodeTiles(bool use) : on(use) {
        if (!on) return;
        TileConfig cfg;
        for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
        _tile_loadconfig(&cfg);
    }
    ~DecodeTiles() {
        if (on) _tile_release();
    }
};

// Q^T's pieces into tiles 1 .. D / 32: row kk of piece c holds the pair of dims 32c + 2kk, + 1 of each head (column).
template <int D, int G>
void load_queries(const __m512i (&q)[G][D / 32]) {
    alignas(64) uint32_t lanes[16], qt[D / 32][16][16] = {};
    for (int c = 0; c < D / 32; c++)
        for (int h = 0; h < G; h++) {
            _mm512_store_si512(lanes, q[h][c]);
            for (int kk = 0; kk < 16; kk++) qt[c][kk][h] = lanes[kk];
        }
    tile_fence();
    _tile_loadd(1, qt[0], 64);
    _tile_loadd(2, qt[1], 64);
    if constexpr (D == 128) {
        _tile_loadd(3, qt[2], 64);
        _tile_loadd(4, qt[3], 64);
    }
}

// S^T of the 16 keys at k0 (rows `stride` elements apart) into tile 5 when `odd`, else 0: issued one slice ahead of
// its use, so the tile unit multiplies while the vector unit runs the previous slice's softmax and P x V. (A tile's
// number is part of the instruction: literals only.)
#define SLOFLEET_SCORES(S)                        \
    _tile_zero(S);                                \
    _tile_loadd(6, k0, stride * 2);               \
    _tile_dpbf16ps(S, 6, 1);                      \
    _tile_loadd(7, k0 + 32, stride * 2);          \
    _tile_dpbf16ps(S, 7, 2);                      \
    if constexpr (D == 128) {                     \
        _tile_loadd(6, k0 + 64, stride * 2);      \
        _tile_dpbf16ps(S, 6, 3);                  \
        _tile_loadd(7, k0 + 96, stride * 2);      \
        _tile_dpbf16ps(S, 7, 4);                  \
    }
template <int D>
void issue_scores(const uint16_t *k0, int64_t stride, bool odd) {
    if (odd) {
        SLOFLEET_SCORES(5)
    } else {
        SLOFLEET_SCORES(0)
    }
}
#undef SLOFLEET_SCORES

// Each head's dot products with the 16 keys, from the tile issue_scores filled.
template <int G>
void tile_dots(bool odd, __m512 (&dots)[G]) {
    alignas(64) float st[16][16];
    if (odd)
        _tile_stored(5, st, 64);
    else
        _tile_stored(0, st, 64);
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    for (int h = 0; h < G; h++) dots[h] = _mm512_i32gather_ps(column, &st[0][h], 4);
}
#endif

}  // namespace slofleet
