// Element-wise layers of a decoder step fused into one pass each (cpu_kernels.py calls them).
//
// In torch each of these is five to eight small ops, each a pass over memory and a few microseconds of dispatch;
// at a decode step's few rows the dispatch dominates, at a prefill chunk's hundreds the passes do. (SiLU-and-mul is
// two ops there, and torch's vectorised exp beat a fused loop here: it stays in torch.) The roundings
// are torch's: bf16 operands are widened to fp32, and every intermediate torch would store in bf16 is rounded here
// too, so results differ from the torch path only where a sum's order or exp's last bits do.
// dtype 0 = fp32, 1 = bf16. Rows run in parallel on torch's OpenMP threads when there are enough of them.
#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"

using namespace slofleet;

namespace {

constexpr int64_t PARALLEL_ELEMS = 1 << 15;  // below this a pass costs less than waking the other threads


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

template <bool BF16>
void norm_rows(void *x, const void *y, int64_t y_row, int64_t y_col, const void *w, void *out, int64_t rows,
               int64_t hidden, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * hidden >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * hidden;
        if (y && y_col == 1)
            for (int64_t i = 0; i < hidden; i++) st<BF16>(x, base + i, ld<BF16>(x, base + i) + ld<BF16>(y, r * y_row + i));
        else if (y)
            for (int64_t i = 0; i < hidden; i++)
                st<BF16>(x, base + i, ld<BF16>(x, base + i) + ld<BF16>(y, r * y_row + i * y_col));
        float part[16] = {0};  // sixteen running sums, so the loop vectorises without reordering one sum
        int64_t i = 0;
        for (; i + 16 <= hidden; i += 16)
            for (int l = 0; l < 16; l++) part[l] += ld<BF16>(x, base + i + l) * ld<BF16>(x, base + i + l);
        float sum = 0.0f;
        for (; i < hidden; i++) sum += ld<BF16>(x, base + i) * ld<BF16>(x, base + i);
        for (int l = 0; l < 16; l++) sum += part[l];
        float inv = 1.0f / std::sqrt(sum / float(hidden) + eps);
        for (i = 0; i < hidden; i++) {
            float n = ld<BF16>(x, base + i) * inv;
            st<BF16>(out, base + i, ld<BF16>(w, i) * (BF16 ? bf16_widen(bf16_round(n)) : n));
        }
    }
}

template <bool BF16>
void rope_rows(void *qk, int64_t row, const float *cos, const float *sin, int64_t rows, int64_t heads, int64_t dim,
               int threads) {
    int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads) if (rows * heads * dim >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            float v[1024];
            int64_t base = r * row + h * dim;
            const float *c = cos + r * dim, *s = sin + r * dim;
            for (int64_t i = 0; i < dim; i++) v[i] = ld<BF16>(qk, base + i);
            for (int64_t i = 0; i < half; i++) st<BF16>(qk, base + i, v[i + half] * s[i] + v[i] * c[i]);
            for (int64_t i = half; i < dim; i++) st<BF16>(qk, base + i, v[i - half] * s[i] + v[i] * c[i]);
        }
}

}  // namespace

// x [M, H] contiguous, updated in place to x + y when y is given (y: any strides, as a W @ x.T product's transposed
// view has); out [M, H] = w * (x / rms(x)). RMSNorm as the checkpoints define it: the mean of squares in fp32, the
// normalised row rounded to the dtype, then multiplied by the weight.
extern "C" void add_rms_norm(void *x, const void *y, int64_t y_row, int64_t y_col, const void *w, void *out,
                             int64_t rows, int64_t hidden, float eps, int bf16, int threads) {
    (bf16 ? norm_rows<true> : norm_rows<false>)(x, y, y_row, y_col, w, out, rows, hidden, eps, threads);
}

// qk [M, heads, D] (heads contiguous within a row, rows `row` elements apart: the q and k heads of a fused qkv
// projection), rotated in place by the rotate-half convention in fp32: x * cos + roll(x) * sin, with cos/sin [M, D]
// fp32 rows for each token's position (sin's first half negated, as model.Rotary stores it).
extern "C" void rope(void *qk, int64_t row, const float *cos, const float *sin, int64_t rows, int64_t heads,
                     int64_t dim, int bf16, int threads) {
    (bf16 ? rope_rows<true> : rope_rows<false>)(qk, row, cos, sin, rows, heads, dim, threads);
}
