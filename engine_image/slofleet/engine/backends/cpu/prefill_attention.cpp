// Prefill attention over the paged KV cache (cpu_kernels.py builds and calls it): a chunk of many query tokens per
// sequence, causal over its cached context and itself, read where the cache holds it.
//
// torch's CPU SDPA reached 28-50 GFLOP/s at prompt lengths of 100-300 (bf16 and fp32, 2 cores), and the decode kernel
// (one query token at a time, a horizontal sum per key) about 65. Here a work item is one sequence's KV head and a
// block of its query tokens: its R = query tokens x group heads rows are transposed once, so every score of a key
// tile is a vertical FMA over rows (no horizontal sums), the online softmax runs down whole vectors of rows, and
// P x V adds one broadcast probability times a V row into a register-blocked group of output rows. The products are
// fp32 FMAs on widened rows (Widen), or on AVX512-BF16 with a bf16 cache the bf16 dot product (Dot).
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
    int64_t at(int p) const {  // where key p's row of this KV head starts
        return (int64_t(table[p / block_size]) * block_size + p % block_size) * stride + head;
    }
};

// The widening path (any vector unit, either dtype): the rows' queries transposed and scaled, qt [D][R], and a tile's
// keys and values as fp32 rows, so every product is a vertical fp32 FMA.
template <int D, bool BF16>
struct Widen {
    alignas(64) float qt[D * R], kf[KT * D], vf[KT * D];

    void set_q(int r, const void *q, int64_t at, bool real, float scale) {
        for (int d = 0; d < D; d++) qt[d * R + r] = real ? ld<BF16>(q, at + d) * scale : 0.0f;
    }

    // Keys [start, start + n) as fp32 rows; rows past n are zero, so a masked key adds 0 x 0 to the output.
    void load(const Item &it, int start, int n) {
        for (int t = 0; t < KT; t++) {
            if (t >= n) {
                std::memset(kf + t * D, 0, D * sizeof(float));
                std::memset(vf + t * D, 0, D * sizeof(float));
                continue;
            }
            int64_t at = it.at(start + t);
            for (int c = 0; c < D; c += V::N) {
                V::storeu(kf + t * D + c, V::template load<BF16>(it.k, at + c));
                V::storeu(vf + t * D + c, V::template load<BF16>(it.v, at + c));
            }
        }
    }

    // s[t][rv] = scaled q . k_t for every row.
    void score(T s[KT][RV]) const {
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

    // o[rows] = o[rows] * corr + p^T v over the tile, RG rows at a time with their D / N vectors in registers.
    void accumulate(const float *p, const float *corr, float *o) const {
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

    // o's rows [R][D] (in the dims' order already) times each row's f.
    void finish(float *o, const float *f) const {
        for (int r = 0; r < R; r++)
            for (int d = 0; d < D; d++) o[r * D + d] *= f[r];
    }
};

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// A bf16 cache on AVX512-BF16's dot product (vdpbf16ps), half the instructions of the widening path: each lane of a
// score sums two dims (the rows' queries as bf16 pairs, qp [D/2][R], one key's pair broadcast), and P x V takes two
// keys at a time (V's rows interleaved in pairs, each probability rounded to bf16 as paged_attention.cpp's attend_dot
// and torch's CPU flash attention round it). Scores, the softmax and o stay fp32; o's rows hold each 32-dim piece in
// unpack's order (store_pairs) until finish puts them back, scaled.
template <int D>
struct Dot {
    static constexpr int C = D / 32;  // 32-dim pieces of a row
    alignas(64) uint32_t qp[D / 2 * R], pp[KT / 2 * R];
    alignas(64) __m512i vp[KT / 2][C][2];
    const uint16_t *kp[KT];
    float scale;

    void set_q(int r, const void *q, int64_t at, bool real, float s) {
        const uint16_t *x = static_cast<const uint16_t *>(q) + at;
        for (int i = 0; i < D / 2; i++) qp[i * R + r] = real ? x[2 * i] | uint32_t(x[2 * i + 1]) << 16 : 0u;
        scale = s;
    }

    void load(const Item &it, int start, int n) {
        const uint16_t *k = static_cast<const uint16_t *>(it.k), *v = static_cast<const uint16_t *>(it.v);
        const uint16_t *vr[KT];
        for (int t = 0; t < KT; t++) {
            int64_t at = t < n ? it.at(start + t) : -1;
            kp[t] = at < 0 ? ZERO_ROW : k + at;  // keys past n
            vr[t] = at < 0 ? ZERO_ROW : v + at;
        }
        for (int t = 0; t < KT; t += 2)
            for (int c = 0; c < C; c++) pair_rows(vr[t] + 32 * c, vr[t + 1] + 32 * c, vp[t / 2][c][0], vp[t / 2][c][1]);
    }

    void score(__m512 s[KT][RV]) const {
        for (int t0 = 0; t0 < KT; t0 += KB) {
            __m512 acc[KB][RV];
            for (int b = 0; b < KB; b++)
                for (int r = 0; r < RV; r++) acc[b][r] = _mm512_setzero_ps();
            for (int i = 0; i < D / 2; i++) {
                __m512i q[RV];
                for (int r = 0; r < RV; r++) q[r] = _mm512_load_si512(qp + i * R + r * 16);
                for (int b = 0; b < KB; b++) {
                    int32_t pair;
                    std::memcpy(&pair, kp[t0 + b] + 2 * i, 4);
                    __m512i k = _mm512_set1_epi32(pair);
                    for (int r = 0; r < RV; r++) acc[b][r] = dot_bf16(acc[b][r], q[r], k);
                }
            }
            for (int b = 0; b < KB; b++)
                for (int r = 0; r < RV; r++) s[t0 + b][r] = _mm512_mul_ps(acc[b][r], _mm512_set1_ps(scale));
        }
    }

    void accumulate(const float *p, const float *corr, float *o) {
        for (int t = 0; t < KT; t += 2)  // each row's probabilities of keys t and t + 1, as one bf16 pair
            for (int r = 0; r < R; r += 16) {
                __m512i a = bf16_lanes(_mm512_load_ps(p + t * R + r));
                __m512i b = bf16_lanes(_mm512_load_ps(p + (t + 1) * R + r));
                _mm512_store_si512(pp + t / 2 * R + r, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
            }
        constexpr int RG = 12 / C;
        static_assert(R % RG == 0);
        for (int r0 = 0; r0 < R; r0 += RG) {
            __m512 acc[RG][C][2];
            for (int i = 0; i < RG; i++) {
                __m512 c = _mm512_set1_ps(corr[r0 + i]);
                for (int j = 0; j < C; j++)
                    for (int h = 0; h < 2; h++)
                        acc[i][j][h] = _mm512_mul_ps(_mm512_loadu_ps(o + (r0 + i) * D + 32 * j + 16 * h), c);
            }
            for (int t = 0; t < KT / 2; t++)
                for (int i = 0; i < RG; i++) {
                    __m512i w = _mm512_set1_epi32(int32_t(pp[t * R + r0 + i]));
                    for (int j = 0; j < C; j++)
                        for (int h = 0; h < 2; h++) acc[i][j][h] = dot_bf16(acc[i][j][h], vp[t][j][h], w);
                }
            for (int i = 0; i < RG; i++)
                for (int j = 0; j < C; j++)
                    for (int h = 0; h < 2; h++) _mm512_storeu_ps(o + (r0 + i) * D + 32 * j + 16 * h, acc[i][j][h]);
        }
    }

    void finish(float *o, const float *f) const {
        for (int r = 0; r < R; r++)
            for (int j = 0; j < C; j++) {
                float *at = o + r * D + 32 * j;
                store_pairs(at, _mm512_loadu_ps(at), _mm512_loadu_ps(at + 16), _mm512_set1_ps(f[r]));
            }
    }
};
#endif

// Online softmax over the item's context, a tile of KT keys at a time; o [R][D] ends as the normalised output.
template <int D, class Tile>
void attend(const Item &it, Tile &tile, float *o) {
    alignas(64) float p[KT * R], corr[R];
    T m[RV], l[RV], pos[RV];
    for (int r = 0; r < RV; r++) m[r] = V::set1(-INFINITY), l[r] = V::zero(), pos[r] = V::loadu(it.pos + r * V::N);
    std::memset(o, 0, sizeof(float) * R * D);
    float first_row = it.pos[0];
    for (int start = 0; start < it.keys; start += KT) {
        int n = std::min(KT, it.keys - start);
        tile.load(it, start, n);
        T s[KT][RV];
        tile.score(s);
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
        tile.accumulate(p, corr, o);
    }
    alignas(64) float inv[R];
    for (int r = 0; r < RV; r++) V::storeu(inv + r * V::N, l[r]);
    for (int r = 0; r < R; r++) inv[r] = inv[r] > 0.0f ? 1.0f / inv[r] : 0.0f;
    tile.finish(o, inv);
}

struct NoScope {};

template <int D, class Tile, bool BF16>
void run(const Prefill &p) {
    const int g = p.heads / p.kv_heads, per_item = R / g;  // query tokens of an item
    each_item<NoScope>(p, per_item, [&](int b, int kvh, int j0, int j1) {
        int ctx = p.seq_len[b] - p.query_len[b];
        Item it{p.k, p.v, p.tables + int64_t(b) * p.bt_stride, p.block_size, int64_t(p.kv_heads) * D,
                int64_t(kvh) * D, ctx + j1, {}};
        Tile tile;
        alignas(64) float o[R * D];
        auto q_at = [&](int r) {  // row r's query: token j0 + r / g (a padded row repeats the last), head kvh g + r % g
            return (p.query_start[b] + std::min(j0 + r / g, j1 - 1)) * p.q_tok + int64_t(kvh * g + r % g) * p.q_head;
        };
        // Every row's query asked for at once: set_q's transposing stores otherwise wait on one row's lines at a time
        // (the prompt's q, a few MB, is in L3 at best). 1.04-1.10x the kernel at 16 prompts of 65-345 tokens on a
        // 2-core EPYC; unchanged (6.5 ms) on a 2-core Xeon with AMX, whose engine takes the tiles instead.
        constexpr int ES = BF16 ? 2 : 4;
        for (int r = 0; r < R; r++) prefetch_lines(static_cast<const char *>(p.q) + q_at(r) * ES, D * ES);
        for (int r = 0; r < R; r++) {
            int j = j0 + r / g;
            bool real = j < j1;
            it.pos[r] = float(ctx + (real ? j : j1 - 1));
            tile.set_q(r, p.q, q_at(r), real, p.scale);
        }
        attend<D>(it, tile, o);
        put_rows<D, BF16>(p, b, kvh, j0, (j1 - j0) * g, o);
    });
}

template <int D>
void run(const Prefill &p, int bf16) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    if (bf16) return run<D, Dot<D>, true>(p);
#endif
    bf16 ? run<D, Widen<D, true>, true>(p) : run<D, Widen<D, false>, false>(p);
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
    d == 64 ? run<64>(p, bf16) : run<128>(p, bf16);
    return 0;
#else
    return -1;
#endif
}
