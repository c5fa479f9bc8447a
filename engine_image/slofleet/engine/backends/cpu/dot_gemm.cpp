// y = x @ W.T in bf16 on the vector unit's bf16 dot product (AVX512-BF16, no AMX), from W packed as the tile kernel
// packs it (tile_gemm.cpp: [N / 16, K / 2, 16, 2], pairs of k side by side). cpu_kernels.py builds and calls this.
//
// On a CPU with avx512_bf16 but no tile unit, torch's bf16 product ran at a third of the vector unit's rate at a
// decode step's 16 rows (143 GFLOP/s on a 2-core EPYC). That layout is the one `vdpbf16ps` reads: one 64-byte load
// is 16 columns by 2 k, and one broadcast pair of x multiplies it into 16 fp32 sums. A work item is MR rows by two
// panels (32 columns; a SwiGLU's 16 gate and 16 up columns where packed paired), 2 MR sums in registers over all of
// K, rounded to bf16 once at the end as the tile kernel rounds them. Threads take panel pairs; rows go in chunks so
// a long prompt's x stays in L2 while each pair's 36 KiB of W is read from L1 for the chunk's next MR rows.
//
// W may also come in a checkpoint's quantised form (forms.h), as the tile kernel takes it: each thread takes an even
// share of the pairs and unpacks them a group at a time (GROUP_BYTES of bf16 tiles, which L2 keeps) into a buffer of
// its own, then runs every row over the group, chunk by chunk, while the next group's bytes come into L2 (Ahead). A
// decode step then reads 3x fewer bytes of weights, for the vector unit's unpacking (~3 cycles a tile row of 32
// weights). The embedded model's 30 layers and LM head, forms against bf16 tiles alternating in one process on a
// 2-core Zen 5 EPYC (AVX512-BF16, no AMX): 1 row 1.2-1.35x, 16 rows 1.2x, 64 rows 1.2-1.4x, 256 rows 1.1x, 1,024
// rows about even.
#include <cstdint>
#include <cstdlib>

#include <omp.h>

#include "cpu_kernels.h"
#include "forms.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
using namespace slofleet;

namespace {

constexpr int MR = 12, COLS = 16;  // 24 accumulators, two W vectors and a broadcast: 27 of 32 registers
// W is asked for 1 KiB ahead of each stream: the hardware's prefetch alone left a 16-32-row product of the model's
// 30 layers (weights from memory) at 25-60 ms where this runs it at 15-40.
constexpr int64_t AHEAD = 32;
constexpr int64_t CHUNK = 24;  // rows of x per chunk, a multiple of MR: x's 27 KiB at K = 576 stay in L1
// A thread's pairs of panels unpacked from a form at a time, then multiplied by every chunk of rows: L2 keeps them
constexpr int64_t GROUP_BYTES = 384 << 10;
// Bytes ahead of its unpacking that a thread asks for a form's: the products between two groups issue no loads
constexpr int64_t FORM_AHEAD = 8 << 10;

// Lines of memory an item asks for into L2, one a k-step, for a later group of a form's panels: the products issue
// no loads of their own from memory, which would otherwise idle while they run
struct Ahead {
    const char *at = nullptr;
    int64_t lines = 0;
};

template <int mr, bool SILU>
void item(const uint16_t *x, int64_t x_row, const uint16_t *w0, const uint16_t *w1, int64_t k_len, uint16_t *y,
          int64_t y_row, Ahead ahead) {
    __m512 acc[mr][2];
    for (int m = 0; m < mr; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_len; k += 2) {
        __m512i a = _mm512_loadu_si512(w0 + k * COLS), b = _mm512_loadu_si512(w1 + k * COLS);
        _mm_prefetch(reinterpret_cast<const char *>(w0 + (k + AHEAD) * COLS), _MM_HINT_T0);  // no fault past the end
        _mm_prefetch(reinterpret_cast<const char *>(w1 + (k + AHEAD) * COLS), _MM_HINT_T0);
        if (k / 2 < ahead.lines) _mm_prefetch(ahead.at + k / 2 * 64, _MM_HINT_T1);
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

// A chunk's rows in items as even as they go (16 rows as 8 + 8, not 12 + 4: a short item's few sums each wait on
// their last product, and it rereads W as a whole one does)
template <bool SILU>
void rows(const uint16_t *x, int64_t x_row, const uint16_t *w0, const uint16_t *w1, int64_t k_len, int64_t m_len,
          uint16_t *y, int64_t y_row, Ahead ahead) {
    int64_t items = (m_len + MR - 1) / MR;
    for (int64_t i = 0, m = 0; i < items; i++) {
        int take = int((m_len - m + items - i - 1) / (items - i));
        with_rows<MR>(take, [&](auto mr) {
            item<mr, SILU>(x + m * x_row, x_row, w0, w1, k_len, y + m * y_row, y_row, i ? Ahead{} : ahead);
        });
        m += take;
    }
}

// x's rows [m0, m0 + len) by the panel pair at w0 (and w0 + panel), into y's columns of that pair.
void pair_rows(const uint16_t *x, int64_t x_row, const uint16_t *w0, uint16_t *y, int64_t y_row, int64_t m0,
               int64_t len, int64_t q, int64_t k_len, int silu, Ahead ahead = {}) {
    uint16_t *yb = y + m0 * y_row + q * (silu ? COLS : 2 * COLS);
    (silu ? rows<true> : rows<false>)(x + m0 * x_row, x_row, w0, w0 + k_len * COLS, k_len, len, yb, y_row, ahead);
}

}  // namespace

// Returns 0; -1 when N is not a multiple of 32 or K of 2 (of 32 with a form), on a CPU without AVX512-BF16, or W in
// a form forms.h does not know. With silu, W is a SwiGLU's [gate; up] packed in paired order and y [M, N / 2] =
// silu(gate) * up. form: forms.h's (PLAIN: bf16 tiles, tile_gemm.cpp's tile_pack).
extern "C" int dot_gemm(const uint16_t *x, int64_t x_row, const void *wp, uint16_t *y, int64_t y_row,
                        int64_t m_len, int64_t n_len, int64_t k_len, int silu, int form, int threads) {
    if (n_len % (2 * COLS) || k_len % 2 || form < PLAIN || form > Q8_0 || (form != PLAIN && k_len % 32)) return -1;
    int64_t pairs = n_len / (2 * COLS), panel = k_len * COLS;
    if (form == PLAIN) {
        int64_t chunks = (m_len + CHUNK - 1) / CHUNK;
        auto w = static_cast<const uint16_t *>(wp);
#pragma omp parallel for schedule(static) num_threads(threads) if (m_len > 0)
        for (int64_t it = 0; it < pairs * chunks; it++) {
            int64_t q = it % pairs, m0 = (it / pairs) * CHUNK;
            pair_rows(x, x_row, w + 2 * q * panel, y, y_row, m0, std::min(CHUNK, m_len - m0), q, k_len, silu);
        }
        return 0;
    }
    int64_t steps = k_len / 32, pair = 2 * panel, form_pair = 2 * steps * step_bytes(form);
    int64_t form_lines = (form_pair + 63) / 64;
    int64_t most = std::max<int64_t>(1, GROUP_BYTES / (2 * pair));  // pairs a group
    auto src = static_cast<const uint8_t *>(wp);
#pragma omp parallel num_threads(threads) if (m_len > 0)
    {
        // a thread's share of the pairs, in groups as even as they go
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t p0 = pairs * t / nt, p1 = pairs * (t + 1) / nt, groups = (p1 - p0 + most - 1) / most;
        int64_t size = groups ? (p1 - p0 + groups - 1) / groups : 0;
        auto tiles = static_cast<uint16_t *>(std::aligned_alloc(64, std::max<int64_t>(1, size) * pair * 2));
        for (int64_t g0 = p0; g0 < p1; g0 += size) {
            int64_t g1 = std::min(p1, g0 + size);
            unpack_steps(form, src + g0 * form_pair, (g1 - g0) * 2 * steps, tiles, FORM_AHEAD);
            // while the first rows meet this group, the next group's bytes (past W's end too: no fault) come into L2
            for (int64_t m0 = 0; m0 < m_len; m0 += CHUNK)
                for (int64_t q = g0; q < g1; q++) {
                    Ahead next{reinterpret_cast<const char *>(src + (q + size) * form_pair), m0 ? 0 : form_lines};
                    pair_rows(x, x_row, tiles + (q - g0) * pair, y, y_row, m0, std::min(CHUNK, m_len - m0), q, k_len,
                              silu, next);
                }
        }
        std::free(tiles);
    }
    return 0;
}
#else
extern "C" int dot_gemm(const uint16_t *, int64_t, const void *, uint16_t *, int64_t, int64_t, int64_t, int64_t, int,
                        int, int) {
    return -1;
}
#endif
