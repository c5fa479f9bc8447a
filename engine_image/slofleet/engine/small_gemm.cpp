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

#include "cpu_kernels.h"

using namespace slofleet;

namespace {

#if defined(SLOFLEET_VEC)
using T = Vec::T;
constexpr int MR = 8, NC = 2 * Vec::N;  // x rows and W.T columns per tile: 16 accumulators
// A tile asks for its panel's rows this many k-steps ahead: at a decode step they come from memory, where the
// hardware's prefetch alone left the FMA units waiting (with 8-row tiles, the embedded model's 30 layers and LM head
// at 16 rows on a 2-core AVX-512 Xeon, alternating in one process: 38.4 -> 30.6 ms; 6-row tiles without it: 38.4)
constexpr int64_t AHEAD = 16, LINE = 64 / sizeof(float), CHUNK_BYTES = 1 << 20;

template <int mr>
void tile(const float *x, int64_t x_row, const float *wt, int64_t n_len, int64_t k_len, float *y) {
    T acc[mr][2];
    for (int m = 0; m < mr; m++) acc[m][0] = acc[m][1] = Vec::zero();
    for (int64_t k = 0; k < k_len; k++) {
        T w0 = Vec::loadu(wt + k * NC), w1 = Vec::loadu(wt + k * NC + Vec::N);
        for (int64_t at = 0; at < NC; at += LINE)  // past the panel's end too: a prefetch never faults
            _mm_prefetch(reinterpret_cast<const char *>(wt + (k + AHEAD) * NC + at), _MM_HINT_T0);
        for (int m = 0; m < mr; m++) {
            T xv = Vec::set1(x[m * x_row + k]);
            acc[m][0] = Vec::fmadd(xv, w0, acc[m][0]);
            acc[m][1] = Vec::fmadd(xv, w1, acc[m][1]);
        }
    }
    for (int m = 0; m < mr; m++) Vec::storeu(y + m * n_len, acc[m][0]), Vec::storeu(y + m * n_len + Vec::N, acc[m][1]);
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

// Returns 0; -1 on a CPU without the vector types, or when N is not a multiple of the panel's columns.
extern "C" int small_gemm(const float *x, int64_t x_row, const float *wt, float *y, int64_t m_len, int64_t n_len,
                          int64_t k_len, int threads) {
#if defined(SLOFLEET_VEC)
    if (n_len % NC) return -1;
    // Items chunk-major, chunks of equal rows: a static schedule gives each thread as many rows, over all panels.
    int64_t panels = n_len / NC, most = std::max<int64_t>(MR, CHUNK_BYTES / (k_len * 4));
    int64_t chunks = (m_len + most - 1) / most, rows = ((m_len + chunks - 1) / std::max<int64_t>(chunks, 1) + MR - 1) / MR * MR;
#pragma omp parallel for schedule(static) num_threads(threads) if (m_len > 0)
    for (int64_t it = 0; it < panels * chunks; it++) {
        int64_t p = it % panels, m = it / panels * rows, end = std::min(m_len, m + rows);
        const float *w = wt + p * NC * k_len;
        for (; m + MR <= end; m += MR) tile<MR>(x + m * x_row, x_row, w, n_len, k_len, y + m * n_len + p * NC);
        with_rows<MR - 1>(int(end - m), [&](auto mr) {
            tile<mr>(x + m * x_row, x_row, w, n_len, k_len, y + m * n_len + p * NC);
        });
    }
    return 0;
#else
    return -1;
#endif
}
