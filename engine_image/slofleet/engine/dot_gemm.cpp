// y = x @ W.T in bf16 on the vector unit's bf16 dot product (AVX512-BF16, no AMX), from W packed as the tile kernel
// packs it (tile_gemm.cpp: [N / 16, K / 2, 16, 2], pairs of k side by side). cpu_kernels.py builds and calls this.
//
// On a CPU with avx512_bf16 but no tile unit, torch's bf16 product ran at a third of the vector unit's rate at a
// decode step's 16 rows (143 GFLOP/s on a 2-core EPYC). That layout is the one `vdpbf16ps` reads: one 64-byte load
// is 16 columns by 2 k, and one broadcast pair of x multiplies it into 16 fp32 sums. A work item is MR rows by two
// panels (32 columns; a SwiGLU's 16 gate and 16 up columns where packed paired), 2 MR sums in registers over all of
// K, rounded to bf16 once at the end as the tile kernel rounds them. Threads take panel pairs; rows go in chunks so
// a long prompt's x stays in L2 while each pair's 36 KiB of W is read from L1 for the chunk's next MR rows.
#include <cstdint>

#include "cpu_kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
using namespace slofleet;

namespace {

constexpr int MR = 12, COLS = 16;  // 24 accumulators, two W vectors and a broadcast: 27 of 32 registers
// W is asked for 1 KiB ahead of each stream: the hardware's prefetch alone left a 16-32-row product of the model's
// 30 layers (weights from memory) at 25-60 ms where this runs it at 15-40.
constexpr int64_t AHEAD = 32;
constexpr int64_t CHUNK = 24;  // rows of x per chunk, a multiple of MR: x's 27 KiB at K = 576 stay in L1

template <int mr, bool SILU>
void item(const uint16_t *x, int64_t x_row, const uint16_t *w0, const uint16_t *w1, int64_t k_len, uint16_t *y,
          int64_t y_row) {
    __m512 acc[mr][2];
    for (int m = 0; m < mr; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_len; k += 2) {
        __m512i a = _mm512_loadu_si512(w0 + k * COLS), b = _mm512_loadu_si512(w1 + k * COLS);
        _mm_prefetch(reinterpret_cast<const char *>(w0 + (k + AHEAD) * COLS), _MM_HINT_T0);  // no fault past the end
        _mm_prefetch(reinterpret_cast<const char *>(w1 + (k + AHEAD) * COLS), _MM_HINT_T0);
        for (int m = 0; m < mr; m++) {
            int32_t pair;
            std::memcpy(&pair, x + m * x_row + k, 4);
            __m512i xv = _mm512_set1_epi32(pair);
            acc[m][0] = dot_bf16(acc[m][0], xv, a);
            acc[m][1] = dot_bf16(acc[m][1], xv, b);
        }
    }
    for (int m = 0; m < mr; m++) {
        if constexpr (SILU) {
            store_bf16(y + m * y_row, silu_mul16(keep_bf16(acc[m][0]), keep_bf16(acc[m][1])));
        } else {
            store_bf16(y + m * y_row, keep_bf16(acc[m][0]));
            store_bf16(y + m * y_row + COLS, keep_bf16(acc[m][1]));
        }
    }
}

template <bool SILU>
void rows(const uint16_t *x, int64_t x_row, const uint16_t *w0, const uint16_t *w1, int64_t k_len, int64_t m_len,
          uint16_t *y, int64_t y_row) {
    int64_t m = 0;
    for (; m + MR <= m_len; m += MR) item<MR, SILU>(x + m * x_row, x_row, w0, w1, k_len, y + m * y_row, y_row);
    // the chunk's last rows, fewer than MR
    with_rows<MR - 1>(int(m_len - m), [&](auto mr) {
        item<mr, SILU>(x + m * x_row, x_row, w0, w1, k_len, y + m * y_row, y_row);
    });
}

}  // namespace

// Returns 0; -1 when N is not a multiple of 32 or K of 2, or on a CPU without AVX512-BF16. With silu, W is a
// SwiGLU's [gate; up] packed in paired order and y [M, N / 2] = silu(gate) * up.
extern "C" int dot_gemm(const uint16_t *x, int64_t x_row, const uint16_t *wp, uint16_t *y, int64_t y_row,
                        int64_t m_len, int64_t n_len, int64_t k_len, int silu, int threads) {
    if (n_len % (2 * COLS) || k_len % 2) return -1;
    int64_t pairs = n_len / (2 * COLS), chunks = (m_len + CHUNK - 1) / CHUNK, panel = k_len * COLS;
#pragma omp parallel for schedule(static) num_threads(threads) if (m_len > 0)
    for (int64_t it = 0; it < pairs * chunks; it++) {
        int64_t q = it % pairs, m0 = (it / pairs) * CHUNK, len = m_len - m0 < CHUNK ? m_len - m0 : CHUNK;
        const uint16_t *w0 = wp + 2 * q * panel;
        uint16_t *yb = y + m0 * y_row + q * (silu ? COLS : 2 * COLS);
        (silu ? rows<true> : rows<false>)(x + m0 * x_row, x_row, w0, w0 + panel, k_len, len, yb, y_row);
    }
    return 0;
}
#else
extern "C" int dot_gemm(const uint16_t *, int64_t, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t, int64_t,
                        int, int) {
    return -1;
}
#endif
