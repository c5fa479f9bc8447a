// y = x @ W.T in fp32 from W packed in panels (cpu_kernels.py packs W at load, builds and calls this).
//
// At a decode step's few rows MKL's sgemm reached about half the FMA rate of the AVX2 machine this was written on.
// This is the usual register-blocked kernel: a tile of MR rows of x by NC columns of W.T (two vectors) accumulates
// in registers over all of K, one broadcast of x and two loads of W.T per step, so the FMA units set the pace. W
// is packed as [N / NC, K, NC] panels of W.T, so a tile reads one sequential stream (W.T itself, rows N apart, cost
// a TLB miss per step at the LM head's width); each panel comes from memory once and from L2 for the next MR rows.
// Measured there, 30 layers and the LM head of a 135M model: 1.5x MKL at 16 rows, 2.3x at 1 (at the memory's
// bandwidth), and still ahead at 2,048 (prefill). A long prompt's rows go in chunks of about 1 MiB of x, which L2
// keeps while the thread's panels pass over it (a panel's rows leave L2 sooner than a prompt's whole x would).
// Layouts: x [M, K] with rows x_row apart; panels [N / NC, K, NC] contiguous; y [M, N] contiguous.
#include <algorithm>
#include <cstdint>
#include <memory>

#include "cpu_kernels.h"
#include "forms.h"

using namespace slofleet;

namespace {

#if defined(SLOFLEET_VEC)
using T = Vec::T;
// x rows and W.T columns per tile: 16 accumulators of AVX-512's 32 registers; AVX2 has 16, where 8 rows spilled its
// 16 accumulators and the two W vectors to the stack (the embedded model's 30 layers and LM head on a 2-core AVX2
// EPYC, alternating in one process: 6 rows 1.32x faster at 16 rows, 1.6x at 64-2,048, 176 GFLOP/s there)
constexpr int MR = Vec::N == 16 ? 8 : 6, NC = 2 * Vec::N;
// A tile asks for its panel's rows this many k-steps ahead: at a decode step they come from memory, where the
// hardware's prefetch alone left the FMA units waiting (with 8-row tiles, the embedded model's 30 layers and LM head
// at 16 rows on a 2-core AVX-512 Xeon, alternating in one process: 38.4 -> 30.6 ms; 6-row tiles without it: 38.4)
constexpr int64_t AHEAD = 16, CHUNK_BYTES = 1 << 20;
constexpr int64_t AHEAD_STEPS = 4;  // a form's k-steps of 32 ahead that its unpacking asks for
// k-rows a form's panel is unpacked by, then multiplied, at up to FORM_BLOCK_ROWS rows of x: 16 KiB of fp32 rows, which
// stay in L1 for the tiles (the whole panel, 72-192 KiB, went out to L2 and back: unpacking the embedded model's
// weights took 11 ms a decode step). The embedded model's 30 layers and LM head on a 2-core AVX-512 Xeon without AMX,
// alternating in one process: 1 row 1.48x faster, 16 rows 1.17-1.22x, 64 rows 0.98-1.05x, 416-2,048 rows 0.88-0.91x
// (there each tile's stored and reloaded sums and x's shorter runs cost more than the unpacking does). Not on AVX2,
// whose panels are half as wide (36-96 KiB): on a 2-core AVX2 EPYC blocks ran 0.90-0.95x at 16-64 rows, within noise
// below.
constexpr int64_t FORM_BLOCK = 128, FORM_BLOCK_ROWS = Vec::N == 16 ? 64 : 0;

// Panels a tile takes side by side at a step of one or two rows (wide_panels), where a one-panel tile's few sums each
// wait on their own last FMA (4 cycles a k-step on AVX2, where its two FMAs would take one): G panels keep G times as
// many sums in flight, each still adding its k-steps in order.
constexpr int WIDE = 4;
constexpr int64_t wide_panels(int64_t m_len) { return m_len == 1 ? WIDE : m_len == 2 ? 2 : 1; }

// Sums over k in [0, k_len) of x's row block by the rows of G panels wt[0 .. G) (their columns side by side in y, NC
// apart), added to y's sums so far unless `first`: an fp32 sum stored and loaded back is the same sum, so a K split
// into blocks adds in the same order, with the same bits, as does every tile whatever its rows and panels.
template <int mr, int G = 1>
void tile(const float *x, int64_t x_row, const float *const *wt, int64_t n_len, int64_t k_len, float *y, bool first) {
    T acc[mr][G][2];
    for (int m = 0; m < mr; m++)
        for (int g = 0; g < G; g++)
            for (int h = 0; h < 2; h++)
                acc[m][g][h] = first ? Vec::zero() : Vec::loadu(y + m * n_len + g * NC + h * Vec::N);
    for (int64_t k = 0; k < k_len; k++) {
        T xv[G > 1 ? mr : 1];  // with several panels, x's broadcasts held across them (one or two rows: registers spare)
        if constexpr (G > 1)
            for (int m = 0; m < mr; m++) xv[m] = Vec::set1(x[m * x_row + k]);
        for (int g = 0; g < G; g++) {
            T w0 = Vec::loadu(wt[g] + k * NC), w1 = Vec::loadu(wt[g] + k * NC + Vec::N);
            // in registers: with few rows GCC otherwise folds the loads into every FMA, a load each (4 rows on AVX2:
            // 5.7 cycles a k-step against 4.6 for 5 rows)
            asm("" : "+x"(w0), "+x"(w1));
            prefetch_lines(wt[g] + (k + AHEAD) * NC, NC * sizeof(float));  // past the panel's end too: never faults
            for (int m = 0; m < mr; m++) {
                T b;
                if constexpr (G > 1)
                    b = xv[m];
                else
                    b = Vec::set1(x[m * x_row + k]);
                acc[m][g][0] = Vec::fmadd(b, w0, acc[m][g][0]);
                acc[m][g][1] = Vec::fmadd(b, w1, acc[m][g][1]);
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int g = 0; g < G; g++)
            for (int h = 0; h < 2; h++) Vec::storeu(y + m * n_len + g * NC + h * Vec::N, acc[m][g][h]);
}

#endif

}  // namespace

// Columns per panel, or 0 on a CPU without the vector types (then small_gemm is not built).
extern "C" int gemm_panel_columns() {
#if defined(SLOFLEET_VEC)
    return NC;
#else
    return 0;
#endif
}

#if defined(SLOFLEET_VEC)
namespace {

// y = x @ W.T over items of a chunk of rows by a panel (by wide_panels panels at one or two rows), chunk-major in
// chunks of equal rows, so a static schedule gives each thread as many rows, over all panels; each item in blocks of
// `block` k-steps. `source()` makes a thread's (p, k0, kb, slot) -> panel p's fp32 rows k0 .. k0 + kb, NC apart (a
// form's unpacked into the thread's buffer `slot`, of WIDE).
template <class Source>
void run(const float *x, int64_t x_row, float *y, int64_t m_len, int64_t n_len, int64_t k_len, int64_t block,
         int threads, Source source) {
    if (m_len <= 0 || n_len <= 0) return;
    int64_t panels = n_len / NC, most = std::max<int64_t>(MR, CHUNK_BYTES / std::max<int64_t>(k_len * 4, 1));
    int64_t chunks = (m_len + most - 1) / most, rows = ((m_len + chunks - 1) / chunks + MR - 1) / MR * MR;
    int64_t wide = wide_panels(m_len), groups = (panels + wide - 1) / wide;
#pragma omp parallel num_threads(threads)
    {
        auto panel = source();
#pragma omp for schedule(static)
        for (int64_t it = 0; it < groups * chunks; it++) {
            int64_t p0 = it % groups * wide, m0 = it / groups * rows, end = std::min(m_len, m0 + rows);
            for (int64_t k0 = 0; k0 < k_len; k0 += block) {
                int64_t kb = std::min(block, k_len - k0), tiles = (end - m0 + MR - 1) / MR;
                const float *xk = x + k0;
                if (wide > 1 && p0 + wide <= panels) {  // one or two rows (m0 = 0), a whole group of panels
                    const float *w[WIDE];
                    for (int g = 0; g < wide; g++) w[g] = panel(p0 + g, k0, kb, g);
                    float *yp = y + p0 * NC;
                    wide == WIDE ? tile<1, WIDE>(xk, x_row, w, n_len, kb, yp, !k0)
                                 : tile<2, 2>(xk, x_row, w, n_len, kb, yp, !k0);
                    continue;
                }
                for (int64_t p = p0; p < std::min(panels, p0 + wide); p++) {
                    const float *w = panel(p, k0, kb, 0);
                    float *yp = y + p * NC;
                    // the rows in tiles as even as they go: a short last tile costs nearly a whole one (16 rows on
                    // AVX2 as 6 + 5 + 5, not 6 + 6 + 4); each row's sums run in the same order whatever its tile
                    for (int64_t t = 0, m = m0; t < tiles; t++) {
                        int mr = int((end - m0) / tiles + (t < (end - m0) % tiles));
                        with_rows<MR>(mr, [&](auto r) {
                            tile<r>(xk + m * x_row, x_row, &w, n_len, kb, yp + m * n_len, !k0);
                        });
                        m += mr;
                    }
                }
            }
        }
    }
}

}  // namespace
#endif

// Returns 0; -1 on a CPU without the vector types, or when N is not a multiple of the panel's columns.
extern "C" int small_gemm(const float *x, int64_t x_row, const float *wt, float *y, int64_t m_len, int64_t n_len,
                          int64_t k_len, int threads) {
#if defined(SLOFLEET_VEC)
    if (n_len % NC) return -1;
    run(x, x_row, y, m_len, n_len, k_len, std::max<int64_t>(k_len, 1), threads, [&] {
        return [&](int64_t p, int64_t, int64_t, int) { return wt + p * NC * k_len; };
    });
    return 0;
#else
    return -1;
#endif
}

// y = x @ W.T from W's quantised form (forms.h), as [N / NC, K / 32, NC / 16, step bytes]: per panel of ours and
// k-step, the steps of its 16-column parts in forms.h's layout, one after the other (two on AVX-512, one on AVX2), so
// a panel's form is one sequential stream. Each thread unpacks a panel to fp32 rows once per chunk of x's rows
// (FORM_BLOCK k-rows at a time at a decode step's few rows), so a decode step reads 5 or 8.5 bits a weight from memory
// instead of 32, and computes on the very fp32 weights. Returns 0; -1 without AVX-512 or AVX2 with F16C (asked with no
// weight, it only tells), or when N is not a multiple of the panel's columns or K of 32.
extern "C" int form_gemm(const float *x, int64_t x_row, const uint8_t *wq, float *y, int64_t m_len, int64_t n_len,
                         int64_t k_len, int form, int threads) {
#if defined(SLOFLEET_VEC) && defined(SLOFLEET_FP32_FORMS)
    constexpr int H = NC / 16;  // forms.h's 16-column steps a panel holds side by side
    static_assert(NC % 16 == 0);
    if (n_len % NC || k_len % 32 || (form != Q4_1 && form != Q8_0)) return -1;
    int64_t steps = k_len / 32, bytes = step_bytes(form), block = m_len <= FORM_BLOCK_ROWS ? FORM_BLOCK : k_len;
    run(x, x_row, y, m_len, n_len, k_len, block, threads, [&] {
        // a thread's panel rows, left unfilled (unpacking writes each before a tile reads it): zeroing 36-192 KiB a
        // call was work on every GEMM of a step
        auto buffer = std::unique_ptr<float[]>(new float[wide_panels(m_len) * block * NC]);
        return [&, rows = std::move(buffer)](int64_t p, int64_t k0, int64_t kb, int slot) -> const float * {
            const uint8_t *src = wq + (p * steps + k0 / 32) * H * bytes;
            float *out = rows.get() + slot * block * NC;
            for (int64_t s = 0; s < kb / 32 * H; s++) {  // the block's step s / H, the panel's 16 columns s % H
                prefetch_lines(src + (s + H * AHEAD_STEPS) * bytes, bytes);  // past the end too: never faults
                float *dst = out + s / H * 32 * NC + 16 * (s % H);
                form == Q4_1 ? unpack_step_fp32<Q4_1>(src + s * bytes, dst, NC)
                             : unpack_step_fp32<Q8_0>(src + s * bytes, dst, NC);
            }
            return out;
        };
    });
    return 0;
#else
    return -1;
#endif
}
