// Prefill attention over the paged KV cache (cpu_kernels.py builds and calls it): a chunk of many query tokens per
// sequence, causal over its cached context and itself, read where the cache holds it.
//
// torch's CPU SDPA reached 28-50 GFLOP/s at prompt lengths of 100-300 (bf16 and fp32, 2 cores), and the decode kernel
// (one query token at a time, a horizontal sum per key) about 65. Here a work item is one sequence's KV head and a
// block of its query tokens: its R = query tokens x group heads rows are transposed once, so every score of a key
// tile is a vertical FMA over rows (no horizontal sums), the online softmax runs down whole vectors of rows, and
// P x V adds one broadcast probability times a V row into a register-blocked group of output rows.
//
// Layouts and dtypes as in paged_attention.cpp: q [T, H, D] strided (q_tok, q_head), caches [blocks, block_size,
// KVH, D], out [T, H, D] contiguous, block_tables [B, bt_stride] int32; dtype 0 = fp32, 1 = bf16 (fp32 inside).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

using namespace slofleet;

#if defined(SLOFLEET_VEC)
namespace {

using V = Vec;
using T = V::T;
constexpr int RV = 3, R = RV * V::N;  // rows of a work item, in vectors: 48 on AVX-512, 24 on AVX2
constexpr int KT = 16;                 // keys of a tile, scored and softmaxed together
constexpr int KB = V::N == 16 ? 4 : 2;  // keys scored at once: KB x RV accumulators in registers

struct Item {
    const void *k, *v;
    const int32_t *table;
    int block_size;
    int64_t stride, head;  // elements from one cached token to the next, and to this KV head
    int keys;              // context the item's last row sees
    float pos[R];          // each row's position (a padded row repeats the last one)
};

// Keys [start, start + n) of K and V as fp32 rows; rows past n are zero, so a masked key adds 0 x 0 to the output.
template <int D, bool BF16>
void load_tile(const Item &it, int start, int n, float *kf, float *vf) {
    for (int t = 0; t < KT; t++) {
        if (t >= n) {
            std::memset(kf + t * D, 0, D * sizeof(float));
            std::memset(vf + t * D, 0, D * sizeof(float));
            continue;
        }
        int p = start + t;
        int64_t at = (int64_t(it.table[p / it.block_size]) * it.block_size + p % it.block_size) * it.stride + it.head;
        for (int c = 0; c < D; c += V::N) {
            V::storeu(kf + t * D + c, V::template load<BF16>(it.k, at + c));
            V::storeu(vf + t * D + c, V::template load<BF16>(it.v, at + c));
        }
    }
}

// s[t][rv] = scaled q . k_t for every row, from qt [D][R] (the rows transposed) and kf [KT][D].
template <int D>
void score(const float *qt, const float *kf, T s[KT][RV]) {
    for (int t0 = 0; t0 < KT; t0 += KB) {
        T acc[KB][RV];
        for (int b = 0; b < KB; b++)
            for (int r = 0; r < RV; r++) acc[b][r] = V::zero();
        for (int d = 0; d < D; d++) {
            T q[RV];
            for (int r = 0; r < RV; r++) q[r] = V::loadu(qt + d * R + r * V::N);
            for (int b = 0; b < KB; b++) {
                T k = V::set1(kf[(t0 + b) * D + d]);
                for (int r = 0; r < RV; r++) acc[b][r] = V::fmadd(q[r], k, acc[b][r]);
            }
        }
        for (int b = 0; b < KB; b++)
            for (int r = 0; r < RV; r++) s[t0 + b][r] = acc[b][r];
    }
}

// out[rows] = out[rows] * corr + p^T v over the tile, RG rows at a time with their D / N vectors in registers.
template <int D>
void accumulate(const float *p, const float *corr, const float *vf, float *o) {
    constexpr int C = D / V::N, RG = std::max(1, (V::N == 16 ? 24 : 12) / C);
    static_assert(R % RG == 0);
    for (int r0 = 0; r0 < R; r0 += RG) {
        T acc[RG][C];
        for (int i = 0; i < RG; i++) {
            T c = V::set1(corr[r0 + i]);
            for (int j = 0; j < C; j++) acc[i][j] = V::mul(V::loadu(o + (r0 + i) * D + j * V::N), c);
        }
        for (int t = 0; t < KT; t++) {
            T vv[C];
            for (int j = 0; j < C; j++) vv[j] = V::loadu(vf + t * D + j * V::N);
            for (int i = 0; i < RG; i++) {
                T w = V::set1(p[t * R + r0 + i]);
                for (int j = 0; j < C; j++) acc[i][j] = V::fmadd(w, vv[j], acc[i][j]);
            }
        }
        for (int i = 0; i < RG; i++)
            for (int j = 0; j < C; j++) V::storeu(o + (r0 + i) * D + j * V::N, acc[i][j]);
    }
}

// Online softmax over the item's context, a tile of KT keys at a time; o [R][D] ends as the normalised output.
template <int D, bool BF16>
void attend(const Item &it, const float *qt, float *o) {
    alignas(64) float kf[KT * D], vf[KT * D], p[KT * R], corr[R];
    T m[RV], l[RV], pos[RV];
    for (int r = 0; r < RV; r++) m[r] = V::set1(-INFINITY), l[r] = V::zero(), pos[r] = V::loadu(it.pos + r * V::N);
    std::memset(o, 0, sizeof(float) * R * D);
    float first_row = it.pos[0];
    for (int start = 0; start < it.keys; start += KT) {
        int n = std::min(KT, it.keys - start);
        load_tile<D, BF16>(it, start, n, kf, vf);
        T s[KT][RV];
        score<D>(qt, kf, s);
        bool masked = start + KT - 1 > first_row;  // some row sees only part of this tile (or none of its tail)
        for (int r = 0; r < RV; r++) {
            T mx = m[r];
            for (int t = 0; t < KT; t++) {
                if (masked) s[t][r] = V::mask_after(s[t][r], pos[r], float(start + t));
                mx = V::vmax(mx, s[t][r]);
            }
            T c = V::exp(V::sub(m[r], mx)), sum = V::zero();  // m = -inf on the first tile: e^-inf = 0
            for (int t = 0; t < KT; t++) {
                T e = V::exp(V::sub(s[t][r], mx));
                sum = V::add(sum, e);
                V::storeu(p + t * R + r * V::N, e);
            }
            l[r] = V::fmadd(l[r], c, sum);
            m[r] = mx;
            V::storeu(corr + r * V::N, c);
        }
        accumulate<D>(p, corr, vf, o);
    }
    alignas(64) float inv[R];
    for (int r = 0; r < RV; r++) V::storeu(inv + r * V::N, l[r]);
    for (int r = 0; r < R; r++) {
        float f = inv[r] > 0.0f ? 1.0f / inv[r] : 0.0f;
        for (int d = 0; d < D; d++) o[r * D + d] *= f;
    }
}

struct NoScope {};

template <int D, bool BF16>
void run(const Prefill &p) {
    const int g = p.heads / p.kv_heads, per_item = R / g;  // query tokens of an item
    each_item<NoScope>(p, per_item, [&](int b, int kvh, int j0, int j1) {
        int ctx = p.seq_len[b] - p.query_len[b];
        Item it{p.k, p.v, p.tables + int64_t(b) * p.bt_stride, p.block_size, int64_t(p.kv_heads) * D,
                int64_t(kvh) * D, ctx + j1, {}};
        alignas(64) float qt[D * R], o[R * D];
        for (int r = 0; r < R; r++) {
            int j = j0 + r / g, h = kvh * g + r % g;
            bool real = j < j1;
            it.pos[r] = float(ctx + (real ? j : j1 - 1));
            int64_t at = (p.query_start[b] + std::min(j, j1 - 1)) * p.q_tok + int64_t(h) * p.q_head;
            for (int d = 0; d < D; d++) qt[d * R + r] = real ? ld<BF16>(p.q, at + d) * p.scale : 0.0f;
        }
        attend<D, BF16>(it, qt, o);
        put_rows<D, BF16>(p, b, kvh, j0, (j1 - j0) * g, o);
    });
}

}  // namespace
#endif

// rows: the batch rows to attend (prefill chunks); the rest as paged_decode. Returns 0, or -1 where this build or
// these shapes are not covered (head size other than 64 or 128, a group over the item's rows, no vector unit):
// cpu_kernels.prefill_usable asks first, with n_rows = 0.
extern "C" int paged_prefill(const void *q, int64_t q_tok, int64_t q_head, const void *k_cache, const void *v_cache,
                             const int32_t *block_tables, int64_t bt_stride, const int32_t *rows, int n_rows,
                             const int32_t *query_start, const int32_t *query_len, const int32_t *seq_len, void *out,
                             int heads, int kv_heads, int d, int block_size, float scale, int bf16, int threads) {
    Prefill p{q, q_tok, q_head, k_cache, v_cache, block_tables, bt_stride, rows, n_rows, query_start, query_len,
              seq_len, out, heads, kv_heads, block_size, scale, threads};
#if defined(SLOFLEET_VEC)
    if (kv_heads <= 0 || heads % kv_heads || heads / kv_heads > R || (d != 64 && d != 128)) return -1;
    if (n_rows == 0) return 0;
    if (d == 64) bf16 ? run<64, true>(p) : run<64, false>(p);
    else bf16 ? run<128, true>(p) : run<128, false>(p);
    return 0;
#else
    return -1;
#endif
}
