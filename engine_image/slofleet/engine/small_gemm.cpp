// y = x @ W.T in fp32 from W packed in panels (cpu_kernels.py packs W at load, builds and calls this).
//
// At a decode step's few rows MKL's sgemm reached about half the FMA rate of the AVX2 machine this was written on.
// This is the usual register-blocked kernel: a tile of MR rows of x by NC columns of W.T (two vectors) accumulates
// in registers over all of K, one broadcast of x and two loads of W.T per step, so the FMA units set the pace. W
// is packed as [N / NC, K, NC] panels of W.T, so a tile reads one sequential stream (W.T itself, rows N apart, cost
// a TLB miss per step at the LM head's width); each panel comes from memory once and from L2 for the next MR rows.
// Measured there, 30 layers and the LM head of a 135M model: 1.5x MKL at 16 rows, 2.3x at 1 (at the memory's
// bandwidth), and still ahead at 2,048 (prefill).
// Layouts: x [M, K] with rows x_row apart; panels [N / NC, K, NC] contiguous; y [M, N] contiguous.
#include <cstdint>

#include "cpu_kernels.h"

using namespace slofleet;

namespace {

#if defined(SLOFLEET_VEC)
using T = Vec::T;
constexpr int MR = 6, NC = 2 * Vec::N;  // x rows and W.T columns per tile: 12 accumulators

template <int mr>
void tile(const float *x, int64_t x_row, const float *wt, int64_t n_len, int64_t k_len, float *y) {
    T acc[mr][2];
    for (int m = 0; m < mr; m++) acc[m][0] = acc[m][1] = Vec::zero();
    for (int64_t k = 0; k < k_len; k++) {
        T w0 = Vec::loadu(wt + k * NC), w1 = Vec::loadu(wt + k * NC + Vec::N);
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
#pragma omp parallel for schedule(static) num_threads(threads) if (m_len > 0)
    for (int64_t p = 0; p < n_len / NC; p++) {
        int64_t m = 0;
        for (; m + MR <= m_len; m += MR) tile<MR>(x + m * x_row, x_row, wt + p * NC * k_len, n_len, k_len, y + m * n_len + p * NC);
        with_rows<MR - 1>(int(m_len - m), [&](auto mr) {
            tile<mr>(x + m * x_row, x_row, wt + p * NC * k_len, n_len, k_len, y + m * n_len + p * NC);
        });
    }
    return 0;
#else
    return -1;
#endif
}
