// Element-wise layers of a decoder step fused into one pass each (cpu_kernels.py calls them).
//
// In torch each of these is five to eight small ops, each a pass over memory and a few microseconds of dispatch;
// at a decode step's few rows the dispatch dominates, at a prefill chunk's hundreds the passes do. SiLU-and-mul in
// bf16 is here only with AVX-512 (a plain loop's exp lost to torch's vectorised one); in fp32 it calls torch's own
// vector exp, so its bits are torch's. The roundings are torch's: bf16 operands are widened to fp32, and every
// intermediate torch would store in bf16 is rounded here too, so results differ from the torch path only where a sum's
// order or exp's last bits do.
// dtype 0 = fp32, 1 = bf16. Rows run in parallel on torch's OpenMP threads when there are enough of them.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

using namespace slofleet;

namespace {

constexpr int64_t PARALLEL_ELEMS = 1 << 15;  // below this a pass costs less than waking the other threads

// x[base..] += y[y_at..] over a row (both contiguous), rounded to the dtype.
template <bool BF16>
void add_row(void *x, int64_t base, const void *y, int64_t y_at, int64_t hidden) {
    int64_t i = 0;
#if defined(SLOFLEET_VEC)
    for (; i + Vec::N <= hidden; i += Vec::N)
        Vec::store<BF16>(x, base + i, Vec::add(Vec::load<BF16>(x, base + i), Vec::load<BF16>(y, y_at + i)));
#endif
    for (; i < hidden; i++) st<BF16>(x, base + i, ld<BF16>(x, base + i) + ld<BF16>(y, y_at + i));
}

// The row's sum of squares in sixteen running sums (one or two vectors of them, or a plain array the compiler
// vectorises for fp32 only), added up in one order: the same bits whichever way it runs.
template <bool BF16>
float sum_squares(const void *x, int64_t base, int64_t hidden) {
    float part[16] = {0};
    int64_t i = 0;
#if defined(SLOFLEET_VEC)
    constexpr int A = 16 / Vec::N;
    Vec::T acc[A];
    for (int a = 0; a < A; a++) acc[a] = Vec::zero();
    for (; i + 16 <= hidden; i += 16)
        for (int a = 0; a < A; a++) {
            Vec::T v = Vec::load<BF16>(x, base + i + a * Vec::N);
            acc[a] = Vec::add(acc[a], Vec::mul(v, v));
        }
    for (int a = 0; a < A; a++) Vec::storeu(part + a * Vec::N, acc[a]);
#else
    for (; i + 16 <= hidden; i += 16)
        for (int l = 0; l < 16; l++) part[l] += ld<BF16>(x, base + i + l) * ld<BF16>(x, base + i + l);
#endif
    float sum = 0.0f;
    for (; i < hidden; i++) sum += ld<BF16>(x, base + i) * ld<BF16>(x, base + i);
    for (int l = 0; l < 16; l++) sum += part[l];
    return sum;
}

// out = w * (x * inv), the normalised x rounded to the dtype before the weight multiplies it.
template <bool BF16>
void scale_row(const void *x, int64_t base, const void *w, void *out, float inv, int64_t hidden) {
    int64_t i = 0;
#if defined(SLOFLEET_VEC)
    for (; i + Vec::N <= hidden; i += Vec::N) {
        Vec::T n = Vec::mul(Vec::load<BF16>(x, base + i), Vec::set1(inv));
        Vec::store<BF16>(out, base + i, Vec::mul(Vec::load<BF16>(w, i), BF16 ? Vec::round_bf16(n) : n));
    }
#endif
    for (; i < hidden; i++) {
        float n = ld<BF16>(x, base + i) * inv;
        st<BF16>(out, base + i, ld<BF16>(w, i) * (BF16 ? bf16_widen(bf16_round(n)) : n));
    }
}

template <bool BF16>
void norm_rows(void *x, const void *y, int64_t y_row, int64_t y_col, const void *w, void *out, int64_t rows,
               int64_t hidden, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * hidden >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * hidden;
        if (y && y_col == 1)
            add_row<BF16>(x, base, y, r * y_row, hidden);
        else if (y)
            for (int64_t i = 0; i < hidden; i++)
                st<BF16>(x, base + i, ld<BF16>(x, base + i) + ld<BF16>(y, r * y_row + i * y_col));
        float inv = 1.0f / std::sqrt(sum_squares<BF16>(x, base, hidden) / float(hidden) + eps);
        scale_row<BF16>(x, base, w, out, inv, hidden);
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

#if defined(__AVX512F__)
void silu_rows(const uint16_t *gate_up, int64_t g_row, uint16_t *out, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * inter >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < inter; i += 16) {
            __mmask16 m = inter - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (inter - i)) - 1);
            __m512 g, u;
            if (m == 0xffff) {
                g = load16<true>(gate_up, r * g_row + i), u = load16<true>(gate_up, r * g_row + inter + i);
            } else {  // the row's tail: the same loads, masked
                alignas(64) float gt[16] = {0}, ut[16] = {0};
                for (int64_t j = 0; j < inter - i; j++)
                    gt[j] = ld<true>(gate_up, r * g_row + i + j), ut[j] = ld<true>(gate_up, r * g_row + inter + i + j);
                g = _mm512_load_ps(gt), u = _mm512_load_ps(ut);
            }
            store_bf16(out + r * inter + i, silu_mul16(g, u), m);
        }
}
#endif

#if defined(SLOFLEET_VEC)
// torch's vectorised exp for fp32 (Sleef's, at this build's vector width, which torch's CPU kernels run at too),
// handed over by cpu_kernels.py from torch's own library: with it, fp32 SiLU here is torch's arithmetic,
// g / (1 + exp(-g)), bit for bit.
Vec::T (*torch_exp)(Vec::T) = nullptr;

// Rows of silu(g) * u as torch's element-wise loops run silu: two vectors at a time, the rest one by one with the C
// library's exp (torch's scalar path); the product of the stored silu is exact either way, so it is taken at once.
void silu_rows_fp32(const float *gate_up, int64_t g_row, float *out, int64_t rows, int64_t inter, int threads) {
    constexpr int L = Vec::N;
    auto silu_mul = [](const float *g, const float *u, float *to) {
        Vec::T v = Vec::loadu(g), d = Vec::add(Vec::set1(1.0f), torch_exp(Vec::sub(Vec::zero(), v)));
        Vec::storeu(to, Vec::mul(Vec::div(v, d), Vec::loadu(u)));
    };
#pragma omp parallel for num_threads(threads) if (rows * inter >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * g_row, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + 2 * L <= inter; i += 2 * L) silu_mul(g + i, u + i, o + i), silu_mul(g + i + L, u + i + L, o + i + L);
        for (; i < inter; i++) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
}
#endif

}  // namespace

// Takes torch's vectorised fp32 exp (fn, of `lanes` floats a vector) for silu_mul_fp32. Returns -1 where this build's
// vectors are not that wide (or it has none): torch's ops run.
extern "C" int set_silu_exp(void *fn, int lanes) {
#if defined(SLOFLEET_VEC)
    if (!fn || lanes != Vec::N) return -1;
    torch_exp = reinterpret_cast<Vec::T (*)(Vec::T)>(fn);
    return 0;
#else
    return -1;
#endif
}

// fp32 gate_up [M, 2I] with contiguous rows (g_row elements apart), out [M, I] = silu(gate) * up in torch's arithmetic
// (set_silu_exp). Returns -1 before set_silu_exp took an exp (rows = 0 asks only that).
extern "C" int silu_mul_fp32(const float *gate_up, int64_t g_row, float *out, int64_t rows, int64_t inter,
                             int threads) {
#if defined(SLOFLEET_VEC)
    if (!torch_exp) return -1;
    silu_rows_fp32(gate_up, g_row, out, rows, inter, threads);
    return 0;
#else
    return -1;
#endif
}

// x [M, H] contiguous, updated in place to x + y when y is given (y: any strides, as a W @ x.T product's transposed
// view has); out [M, H] = w * (x / rms(x)). RMSNorm as the checkpoints define it: the mean of squares in fp32, the
// normalised row rounded to the dtype, then multiplied by the weight.
extern "C" void add_rms_norm(void *x, const void *y, int64_t y_row, int64_t y_col, const void *w, void *out,
                             int64_t rows, int64_t hidden, float eps, int bf16, int threads) {
    (bf16 ? norm_rows<true> : norm_rows<false>)(x, y, y_row, y_col, w, out, rows, hidden, eps, threads);
}

// bf16 gate_up [M, 2I] with contiguous rows (g_row elements apart), out [M, I] = silu(gate) * up, each rounded to
// bf16 as torch's two ops round them. Returns -1 on a CPU without AVX-512 (rows = 0 asks only that).
extern "C" int silu_mul_bf16(const uint16_t *gate_up, int64_t g_row, uint16_t *out, int64_t rows, int64_t inter,
                             int threads) {
#if defined(__AVX512F__)
    silu_rows(gate_up, g_row, out, rows, inter, threads);
    return 0;
#else
    return -1;
#endif
}

// qk [M, heads, D] (heads contiguous within a row, rows `row` elements apart: the q and k heads of a fused qkv
// projection), rotated in place by the rotate-half convention in fp32: x * cos + roll(x) * sin, with cos/sin [M, D]
// fp32 rows for each token's position (sin's first half negated, as model.Rotary stores it).
extern "C" void rope(void *qk, int64_t row, const float *cos, const float *sin, int64_t rows, int64_t heads,
                     int64_t dim, int bf16, int threads) {
    (bf16 ? rope_rows<true> : rope_rows<false>)(qk, row, cos, sin, rows, heads, dim, threads);
}

// The new tokens' K and V (rows k_row and v_row bytes apart, each row's `width` bytes contiguous: a fused qkv
// projection's K and V heads) into their slots of caches laid out [slots, width] (slot_mapping, int64): what two
// index_copy_ calls do, at a decode step's few rows in a twentieth of their time.
extern "C" void kv_store(const void *k, int64_t k_row, const void *v, int64_t v_row, void *k_cache, void *v_cache,
                         const int64_t *slots, int64_t rows, int64_t width, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * width >= 4 * PARALLEL_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        std::memcpy(static_cast<char *>(k_cache) + slots[t] * width, static_cast<const char *>(k) + t * k_row, width);
        std::memcpy(static_cast<char *>(v_cache) + slots[t] * width, static_cast<const char *>(v) + t * v_row, width);
    }
}

namespace {

// The index of row's first maximum over n values, or -1 where the row holds a NaN (torch.max's answer then depends
// on where the NaN is: the caller asks torch). Per lane, a later value replaces the lane's best only when greater,
// so among the lanes that hold the maximum the smallest index is the first.
template <bool BF16>
int64_t first_max(const void *row, int64_t n) {
    float best = -INFINITY;
    int64_t at = 0, i = 0;
    bool nan = false;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 bv = _mm512_set1_ps(-INFINITY);
        __m512i bi = _mm512_setzero_si512(), idx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 unordered = 0;
        for (; i + 16 <= n; i += 16, idx = _mm512_add_epi32(idx, step)) {
            __m512 v = load16<BF16>(row, i);
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            __mmask16 up = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ);
            bv = _mm512_mask_mov_ps(bv, up, v), bi = _mm512_mask_mov_epi32(bi, up, idx);
        }
        nan = unordered != 0;
        best = _mm512_reduce_max_ps(bv);
        at = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(bv, _mm512_set1_ps(best), _CMP_EQ_OQ), bi);
    }
#endif
    for (; i < n; i++) {
        float v = ld<BF16>(row, i);
        nan |= v != v;
        if (v > best) best = v, at = i;
    }
    return nan ? -1 : at;
}

}  // namespace

// Per row of x [rows, n] (rows x_row elements apart), the index of its first maximum into out (-1: the row holds a
// NaN): greedy sampling's argmax on the LM head's own dtype, without widening the logits to fp32 first.
extern "C" void argmax_rows(const void *x, int64_t x_row, int64_t rows, int64_t n, int bf16, int64_t *out,
                            int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++)
        out[r] = bf16 ? first_max<true>(static_cast<const uint16_t *>(x) + r * x_row, n)
                      : first_max<false>(static_cast<const float *>(x) + r * x_row, n);
}
