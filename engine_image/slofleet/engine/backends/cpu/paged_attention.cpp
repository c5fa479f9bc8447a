// Decode attention over the paged KV cache, read in place (cpu_kernels.py builds and calls it).
//
// The torch path copies every row's context blocks into new tensors before SDPA reads them; here each (row, KV
// head) pair walks its block table and reads K and V where they lie, once, with an online softmax in fp32. A row
// has a few query tokens (a decode, or a decode and its drafts): query j of q sees the context up to L - q + j.
//
// Layouts: q [T, H, D] with strides (q_tok, q_head) in elements; caches [blocks, block_size, KVH, D] contiguous;
// out [T, H, D] contiguous; block_tables [B, bt_stride] int32. Query head h reads KV head h / (H / KVH), as the
// checkpoints' repeat_kv does. dtype 0 = fp32, 1 = bf16 (widened to fp32 on load, rounded to nearest even on store).
// With AVX-512 or AVX2 and the common head sizes, a template keeps a KV head's queries and accumulators in vector
// registers (AVX2's sixteen spill some to L1); other shapes and CPUs take the plain loops, whose dot products stay
// scalar (no FMA contraction or reordering is allowed). A bf16 cache on a CPU with AVX512-BF16 takes attend_dot: 1.5x
// the widening template at 16 rows of 260 tokens (9 heads over 3, head size 64, 2-core EPYC). With AMX too (and blocks
// of a multiple of 16 tokens), its scores come from the tile unit, a slice ahead of the vector unit's softmax and
// P x V: 30 layers at 16 rows of 210-270 tokens, blocks in random order in a 1 GiB pool, on a 2-core AMX Xeon, 5.0 ->
// 4.2 ms from memory and 3.1 -> 2.3 ms from cache (2.7 with the tile unit's scores taken as soon as they were asked).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "decode_tiles.h"

using namespace slofleet;

namespace {

constexpr int MAX_D = 256, MAX_G = 16, SLICE = 16;  // SLICE: tokens scored together before the softmax update
// Tokens ahead of the slice being scored whose K and V lines are asked for (Row::prefetch). With the bf16 cache from
// memory on a 2-core Xeon with AMX, a decode layer at 16 rows of 100-380 tokens: 0.29 ms with none, 0.19 one slice
// ahead, 0.17-0.18 two, 0.21 four.
constexpr int AHEAD = 2 * SLICE;

inline void load_row(const void *base, int64_t idx, int bf16, int d, float *dst) {
    if (!bf16) {
        std::memcpy(dst, static_cast<const float *>(base) + idx, size_t(d) * sizeof(float));
        return;
    }
    const uint16_t *src = static_cast<const uint16_t *>(base) + idx;
    for (int i = 0; i < d; i++) dst[i] = bf16_widen(src[i]);
}

struct Row {  // one query token's view of its context
    const void *k, *v;
    const int32_t *table;
    int visible, block_size;
    int64_t stride, head;  // elements from one token to the next, and to this KV head
    int64_t first(int start) const {
        return (int64_t(table[start / block_size]) * block_size + start % block_size) * stride + head;
    }
    int span(int start) const {
        int left = block_size - start % block_size, n = visible - start;
        return std::min(std::min(left, n), SLICE);
    }
#if defined(SLOFLEET_VEC)
    // The K and V lines of the slice at `start` (rows of D elements of ES bytes), asked for AHEAD tokens early: it
    // sits in another block, which the hardware prefetcher cannot guess, and a decode step's caches come from memory.
    // Only prefetches, so inlined by force (see prefetch_lines): as a plain member, GCC 12 emitted none of them.
    template <int D, int ES>
    [[gnu::always_inline]] inline void prefetch(int start) const {
        if (start >= visible) return;
        const char *k0 = static_cast<const char *>(k) + first(start) * ES;
        const char *v0 = static_cast<const char *>(v) + first(start) * ES;
        for (int t = 0, n = span(start); t < n; t++) {
            prefetch_lines(k0 + t * stride * ES, D * ES);
            prefetch_lines(v0 + t * stride * ES, D * ES);
        }
    }
#endif
};

// Plain loops: any head size and group, any x86 or other CPU.
void attend_plain(const float *qv, int g, int d, const Row &r, float scale, int bf16, float *acc) {
    float m[MAX_G], l[MAX_G], s[MAX_G][SLICE], row[MAX_D];
    for (int h = 0; h < g; h++) m[h] = -INFINITY, l[h] = 0.0f;
    std::memset(acc, 0, size_t(g) * d * sizeof(float));
    for (int start = 0; start < r.visible;) {
        int n = r.span(start);
        int64_t first = r.first(start);
        for (int t = 0; t < n; t++) {
            load_row(r.k, first + t * r.stride, bf16, d, row);
            for (int h = 0; h < g; h++) {
                float dot = 0.0f;
                for (int i = 0; i < d; i++) dot += qv[h * d + i] * row[i];
                s[h][t] = dot * scale;
            }
        }
        for (int h = 0; h < g; h++) {
            float mx = m[h];
            for (int t = 0; t < n; t++) mx = std::max(mx, s[h][t]);
            float corr = m[h] == -INFINITY ? 0.0f : std::exp(m[h] - mx);
            l[h] *= corr;
            for (int i = 0; i < d; i++) acc[h * d + i] *= corr;
            for (int t = 0; t < n; t++) s[h][t] = std::exp(s[h][t] - mx), l[h] += s[h][t];
            m[h] = mx;
        }
        for (int t = 0; t < n; t++) {
            load_row(r.v, first + t * r.stride, bf16, d, row);
            for (int h = 0; h < g; h++)
                for (int i = 0; i < d; i++) acc[h * d + i] += s[h][t] * row[i];
        }
        start += n;
    }
    for (int h = 0; h < g; h++)
        for (int i = 0; i < d; i++) acc[h * d + i] *= l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
}

#if defined(SLOFLEET_VEC)
// A slice's scaled scores into s [SLICE] from its keys' dot-product vectors (dots[t] for t < n; each vector's lanes
// sum to that key's q . k): all sums come out of one shuffle tree per vector of keys, and keys past n score -inf.
alignas(64) constexpr float MINUS_KEY[SLICE] = {0, -1, -2, -3, -4, -5, -6, -7, -8, -9, -10, -11, -12, -13, -14, -15};

// Keys j .. j + V::N of a slice of n: their dot products times scale into s, -inf past n.
template <class V>
void put_scores(typename V::T dots, int j, int n, float scale, float *s) {
    V::storeu(s + j, V::mask_after(V::mul(dots, V::set1(scale)), V::loadu(MINUS_KEY + j), 1.0f - n));
}

template <class V>
void slice_scores(typename V::T *dots, int n, float scale, float *s) {
    for (int t = n; t < SLICE; t++) dots[t] = V::zero();
    for (int j = 0; j < SLICE; j += V::N) put_scores<V>(V::sums(dots + j), j, n, scale, s);
}

template <int D, int G, bool BF16>
void attend_vec(const float *qv, const Row &r, float scale, float *out) {
    using V = Vec;
    using T = typename V::T;
    constexpr int C = D / V::N, S = SLICE / V::N;
    T q[G][C], acc[G][C];
    float m[G], l[G];
    alignas(64) float s[G][SLICE];
    T dots[G][SLICE];
    for (int h = 0; h < G; h++) {
        m[h] = -INFINITY, l[h] = 0.0f;
        for (int c = 0; c < C; c++) q[h][c] = V::loadu(qv + h * D + c * V::N), acc[h][c] = V::zero();
    }
    for (int start = 0; start < r.visible;) {
        int n = r.span(start);
        int64_t first = r.first(start);
        r.prefetch<D, BF16 ? 2 : 4>(start + AHEAD);
        for (int t = 0; t < n; t++) {  // per head, SLICE vectors of products; their sums come out in one vector
            T kv[C];
            for (int c = 0; c < C; c++) kv[c] = V::template load<BF16>(r.k, first + t * r.stride + c * V::N);
            for (int h = 0; h < G; h++) {
                T dot = V::mul(q[h][0], kv[0]);
                for (int c = 1; c < C; c++) dot = V::fmadd(q[h][c], kv[c], dot);
                dots[h][t] = dot;
            }
        }
        for (int h = 0; h < G; h++) slice_scores<V>(dots[h], n, scale, s[h]);
        for (int h = 0; h < G; h++) {
            float mx = m[h], sum = 0.0f;
            for (int j = 0; j < S; j++) mx = std::max(mx, V::max(V::loadu(s[h] + j * V::N)));
            for (int j = 0; j < S; j++) {
                T e = V::exp(V::sub(V::loadu(s[h] + j * V::N), V::set1(mx)));
                sum += V::sum(e);
                V::storeu(s[h] + j * V::N, e);
            }
            if (mx != m[h]) {  // as attend_dot: x 1 skipped
                float corr = m[h] == -INFINITY ? 0.0f : std::exp(m[h] - mx);
                l[h] *= corr;
                for (int c = 0; c < C; c++) acc[h][c] = V::mul(acc[h][c], V::set1(corr));
                m[h] = mx;
            }
            l[h] += sum;
        }
        for (int t = 0; t < n; t++) {
            T vv[C];
            for (int c = 0; c < C; c++) vv[c] = V::template load<BF16>(r.v, first + t * r.stride + c * V::N);
            for (int h = 0; h < G; h++) {
                T p = V::set1(s[h][t]);
                for (int c = 0; c < C; c++) acc[h][c] = V::fmadd(p, vv[c], acc[h][c]);
            }
        }
        start += n;
    }
    for (int h = 0; h < G; h++) {
        T inv = V::set1(l[h] > 0.0f ? 1.0f / l[h] : 0.0f);
        for (int c = 0; c < C; c++) V::storeu(out + h * D + c * V::N, V::mul(acc[h][c], inv));
    }
}


#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The bf16 cache on the vector unit's bf16 dot product: q . k from the raw bf16 rows (two products a lane), and P x V
// two keys at a time, V's rows interleaved in pairs and each probability rounded to bf16 (as torch's CPU flash
// attention rounds P before its second product); sums, the softmax and the output stay fp32. Accumulator lane j of
// the two halves (lo, hi) of V's 32-element piece c holds dims 8 (j / 4) + j % 4 and that + 4 (unpack's order).
template <int D, int G, bool TILE>
void attend_dot(const float *qv, const Row &r, float scale, float *out) {
    constexpr int C = D / 32;  // 32-element pieces of a row
    __m512i q[G][C];
    __m512 lo[G][C], hi[G][C];
    float m[G], l[G];
    alignas(64) float scores[G][SLICE];
    alignas(64) uint16_t p[G][SLICE];
    const uint16_t *k = static_cast<const uint16_t *>(r.k), *v = static_cast<const uint16_t *>(r.v);
    for (int h = 0; h < G; h++) {
        m[h] = -INFINITY, l[h] = 0.0f;
        for (int c = 0; c < C; c++) {
            const float *at = qv + h * D + 32 * c;
            __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(at + 16), _mm512_loadu_ps(at));  // exact: q is bf16
            q[h][c] = reinterpret_cast<__m512i &>(pairs);
            lo[h][c] = hi[h][c] = _mm512_setzero_ps();
        }
    }
    bool odd = false;  // the tile the slice's scores are in: 5, else 0
#if defined(SLOFLEET_TILE_DECODE)  // (TILE is only instantiated where it is defined)
    if constexpr (TILE) {
        load_queries<D, G>(q);
        issue_scores<D>(k + r.first(0), r.stride, false);
    }
#endif
    for (int start = 0; start < r.visible;) {
        int n = r.span(start);
        const uint16_t *k0 = k + r.first(start), *v0 = v + r.first(start);
        r.prefetch<D, 2>(start + AHEAD);
#if defined(SLOFLEET_TILE_DECODE)
        if constexpr (TILE) {
            __m512 dots[G];
            tile_dots<G>(odd, dots);
            for (int h = 0; h < G; h++) put_scores<V512>(dots[h], 0, n, scale, scores[h]);
            odd = !odd;
            if (start + n < r.visible) issue_scores<D>(k + r.first(start + n), r.stride, odd);
        } else
#endif
        {
            __m512 dots[G][SLICE];
            for (int t = 0; t < n; t++) {
                __m512i kr[C];
                for (int c = 0; c < C; c++) kr[c] = _mm512_loadu_si512(k0 + t * r.stride + 32 * c);
                for (int h = 0; h < G; h++) {
                    __m512 dot = _mm512_setzero_ps();
                    for (int c = 0; c < C; c++) dot = dot_bf16(dot, kr[c], q[h][c]);
                    dots[h][t] = dot;
                }
            }
            for (int h = 0; h < G; h++) slice_scores<V512>(dots[h], n, scale, scores[h]);
        }
        for (int h = 0; h < G; h++) {
            __m512 s = _mm512_load_ps(scores[h]);
            float mx = std::max(m[h], _mm512_reduce_max_ps(s));
            __m512 e = exp16(_mm512_sub_ps(s, _mm512_set1_ps(mx)));
            if (mx != m[h]) {  // rescale what came before (x 1 where the max stays: the same bits, skipped)
                __m512 corr = _mm512_set1_ps(m[h] == -INFINITY ? 0.0f : std::exp(m[h] - mx));
                l[h] *= _mm512_cvtss_f32(corr);
                for (int c = 0; c < C; c++)
                    lo[h][c] = _mm512_mul_ps(lo[h][c], corr), hi[h][c] = _mm512_mul_ps(hi[h][c], corr);
                m[h] = mx;
            }
            l[h] += _mm512_reduce_add_ps(e);
            __m256bh rounded = _mm512_cvtneps_pbh(e);
            std::memcpy(p[h], &rounded, sizeof(rounded));
        }
        for (int t = 0; t < n; t += 2) {
            const uint16_t *b = t + 1 < n ? v0 + (t + 1) * r.stride : ZERO_ROW;
            for (int c = 0; c < C; c++) {
                __m512i even, odd;
                pair_rows(v0 + t * r.stride + 32 * c, b + 32 * c, even, odd);
                for (int h = 0; h < G; h++) {
                    int32_t pair;
                    std::memcpy(&pair, p[h] + t, 4);
                    __m512i w = _mm512_set1_epi32(pair);
                    lo[h][c] = dot_bf16(lo[h][c], even, w);
                    hi[h][c] = dot_bf16(hi[h][c], odd, w);
                }
            }
        }
        start += n;
    }
    for (int h = 0; h < G; h++) {
        __m512 inv = _mm512_set1_ps(l[h] > 0.0f ? 1.0f / l[h] : 0.0f);
        for (int c = 0; c < C; c++) store_pairs(out + h * D + 32 * c, lo[h][c], hi[h][c], inv);
    }
}
#endif

template <int D, int G>
bool dispatch_g(const float *qv, int g, const Row &r, float scale, int bf16, bool tile, float *out) {
    if constexpr (G > 8) {
        return false;
    } else {
        if (g != G) return dispatch_g<D, G + 1>(qv, g, r, scale, bf16, tile, out);
#if defined(SLOFLEET_TILE_DECODE)
        if (bf16 && tile && (D == 64 || D == 128)) return attend_dot<D, G, true>(qv, r, scale, out), true;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
        if (bf16) return attend_dot<D, G, false>(qv, r, scale, out), true;
#endif
        bf16 ? attend_vec<D, G, true>(qv, r, scale, out) : attend_vec<D, G, false>(qv, r, scale, out);
        return true;
    }
}
#endif

void attend(const float *qv, int g, int d, const Row &r, float scale, int bf16, bool tile, float *out) {
#if defined(SLOFLEET_VEC)
    if (d == 64 && dispatch_g<64, 1>(qv, g, r, scale, bf16, tile, out)) return;
    if (d == 128 && dispatch_g<128, 1>(qv, g, r, scale, bf16, tile, out)) return;
#endif
    attend_plain(qv, g, d, r, scale, bf16, out);
}

}  // namespace

// rows: which batch rows to attend (the decodes); query_start, query_len, seq_len: per batch row. Returns 0, or
// -1 when the shapes exceed the stack buffers (cpu_kernels.attention_usable checks first: a guard only).
extern "C" int paged_decode(const void *q, int64_t q_tok, int64_t q_head, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *rows, int n_rows,
                            const int32_t *query_start, const int32_t *query_len, const int32_t *seq_len, void *out,
                            int heads, int kv_heads, int d, int block_size, float scale, int bf16, int threads) {
    int g = heads / kv_heads;
    if (d > MAX_D || g > MAX_G || heads % kv_heads) return -1;
    // A work item is a row with all its KV heads when there are rows enough to share: the heads of a token lie
    // side by side, so the first head's pass brings the others' lines into the cache as one sequential stream.
    // With few rows (a lone long decode), each (row, head) is an item, so every thread has work.
    int per_item = n_rows >= 2 * threads ? kv_heads : 1;
    // Rows longest context first, so the dynamic schedule ends with short items and the threads finish together
    std::vector<int> order(rows, rows + n_rows);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return seq_len[a] > seq_len[b]; });
    // The scores on the tile unit where this process may use it and every slice is 16 keys of one block
#if defined(SLOFLEET_TILE_DECODE)
    const bool tile = bf16 && tiles_granted && block_size % SLICE == 0;
#else
    const bool tile = false;
#endif
#pragma omp parallel num_threads(threads)
    {
#if defined(SLOFLEET_TILE_DECODE)
    DecodeTiles scope(tile);
#endif
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < n_rows * kv_heads / per_item; item++) {
        float qv[MAX_G * MAX_D], acc[MAX_G * MAX_D];
        for (int part = 0; part < per_item; part++) {
            int b = order[(item * per_item + part) / kv_heads], kvh = (item * per_item + part) % kv_heads;
            int q_n = query_len[b];
            for (int j = 0; j < q_n; j++) {
                int64_t tok = query_start[b] + j;
                for (int h = 0; h < g; h++)
                    load_row(q, tok * q_tok + int64_t(kvh * g + h) * q_head, bf16, d, qv + h * d);
                Row r{k_cache, v_cache, block_tables + int64_t(b) * bt_stride, seq_len[b] - q_n + j + 1, block_size,
                      int64_t(kv_heads) * d, int64_t(kvh) * d};
                attend(qv, g, d, r, scale, bf16, tile, acc);
                int64_t o = (tok * heads + int64_t(kvh) * g) * d;
                if (!bf16) {
                    std::memcpy(static_cast<float *>(out) + o, acc, size_t(g) * d * sizeof(float));
                } else {
                    uint16_t *dst = static_cast<uint16_t *>(out) + o;
                    for (int i = 0; i < g * d; i++) dst[i] = bf16_round(acc[i]);
                }
            }
        }
    }
    }
    return 0;
}
