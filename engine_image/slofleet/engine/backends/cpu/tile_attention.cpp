// Prefill attention in bf16 on the AMX tile unit (cpu_kernels.py calls it where tiles() holds), over the paged cache.
//
// The vector kernel (prefill_attention.cpp) spends about eight FMAs per query row and key on the vector unit, scores
// and P x V alike; here both products run on the tiles, and the vector unit keeps only the online softmax.
// Everything is transposed so that nothing needs transposing per key tile: a work item is 16 query rows (tokens x
// the KV head's group), and per tile of 32 keys
//   S^T [keys, rows] = K [keys, D] x Q^T          (K's rows as the cache holds them; Q^T packed once per item)
//   softmax down S^T's columns: one vector holds one key's score for all 16 rows, as in the vector kernel
//   O^T [D, rows] += V^T [D, keys] x P^T          (P^T's pairs of keys are two score vectors interleaved)
// V^T and a contiguous copy of K are packed once per (sequence, KV head) before the items run, zero past the
// context, so every item of a long prompt shares them and a key tile never reads past the cache's blocks.
// P is rounded to bf16 for its product, as GPU flash attention does; sums, max and O stay fp32.
#include <vector>

#include "cpu_kernels.h"

using namespace slofleet;

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
namespace {

constexpr int ROWS = 16, KEYS = 64, PAIRS = 16;  // query rows of an item; keys of a tile; key pairs a V^T tile holds
constexpr float SLACK = 8.0f;        // see the softmax below

struct Tiles {  // every tile register 16 rows of 64 bytes, for one thread's items
    Tiles() {
        TileConfig cfg;
        for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = ROWS;
        _tile_loadconfig(&cfg);
    }
    ~Tiles() { _tile_release(); }
};

inline uint32_t pair(uint16_t lo, uint16_t hi) { return uint32_t(lo) | uint32_t(hi) << 16; }

// Per (batch row, KV head): K [keys, D] and V^T as [key tiles][D][16 pairs of keys], zero past `keys`.
template <int D>
void pack_kv(const Prefill &p, int b, int kvh, int keys, uint16_t *kc, uint32_t *vt) {
    const int32_t *table = p.tables + int64_t(b) * p.bt_stride;
    const int padded = (keys + KEYS - 1) / KEYS * KEYS;
    auto row = [&](const void *cache, int pos) {
        return static_cast<const uint16_t *>(cache) +
               ((int64_t(table[pos / p.block_size]) * p.block_size + pos % p.block_size) * p.kv_heads + kvh) * D;
    };
    for (int t = 0; t < padded; t++) {
        if (t < keys) std::memcpy(kc + int64_t(t) * D, row(p.k, t), D * 2);
        else std::memset(kc + int64_t(t) * D, 0, D * 2);
    }
    static const uint16_t zero[D] = {};
    for (int t0 = 0; t0 < padded; t0 += 2) {
        const uint16_t *a = t0 < keys ? row(p.v, t0) : zero, *c = t0 + 1 < keys ? row(p.v, t0 + 1) : zero;
        uint32_t *tile = vt + int64_t(t0 / (2 * PAIRS)) * D * PAIRS;
        for (int d = 0; d < D; d++) tile[d * PAIRS + t0 % (2 * PAIRS) / 2] = pair(a[d], c[d]);
    }
}

// 16 pairs (a[r], b[r]) of two vectors, each rounded to bf16 (nearest even): a row of P^T's tile.
inline __m512i pair16(__m512 a, __m512 b) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, _mm512_castph_si512(__m512h(_mm512_cvtne2ps_pbh(b, a))));
}

// 2^x to about 4e-5 relative, enough for what is rounded to bf16 next; 0 below -125 (-inf too), so that no
// denormal (a slow path on the vector unit) is ever made.
inline __m512 exp2_fast(__m512 x) {
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
    __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), r = _mm512_sub_ps(x, k);
    __m512 p = _mm512_set1_ps(9.618129e-3f);
    for (float c : {5.550411e-2f, 0.2402265f, 0.6931472f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    return _mm512_maskz_scalef_ps(live, p, k);
}

// r[i] becomes column i of the 16 x 16 matrix whose rows r held.
inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

// One item: query tokens j0..j1 of batch row b with KV head kvh's group, over keys 0 .. ctx + j1 of kc / vt.
template <int D>
void item(const Prefill &p, int b, int kvh, int j0, int j1, const uint16_t *kc, const uint32_t *vt) {
    const int g = p.heads / p.kv_heads, rows = (j1 - j0) * g, ctx = p.seq_len[b] - p.query_len[b];
    const int keys = ctx + j1;
    alignas(64) uint32_t qt[D / 32][16][ROWS];  // Q^T: [half of D][pair of d][row]
    alignas(64) float pos[ROWS], st[KEYS][ROWS], ot[D][ROWS], pv[4][16][ROWS];
    alignas(64) uint32_t pt[KEYS / 2][ROWS];  // P^T: [pair of keys][row]
    __m512 x[D / 32][16];  // Q's rows as pairs of d, a half of D at a time; Q^T's tiles once transposed
    for (int r = 0; r < ROWS; r++) {
        int j = std::min(j0 + r / g, j1 - 1);  // a padded row repeats the last one's position, with a zero query
        pos[r] = float(ctx + j);
        const uint16_t *q = static_cast<const uint16_t *>(p.q) + (p.query_start[b] + j) * p.q_tok +
                            int64_t(kvh * g + r % g) * p.q_head;
        for (int h = 0; h < D / 32; h++) x[h][r] = r < rows ? _mm512_loadu_ps(q + h * 32) : _mm512_setzero_ps();
    }
    for (int h = 0; h < D / 32; h++) {
        transpose16(x[h]);
        for (int dp = 0; dp < 16; dp++) _mm512_store_ps(qt[h][dp], x[h][dp]);
    }
    tile_fence();
    std::memset(ot, 0, sizeof ot);
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps(), at = _mm512_load_ps(pos);
    const __m512 base2 = _mm512_set1_ps(p.scale * 1.44269504f), slack = _mm512_set1_ps(SLACK / p.scale);
    for (int start = 0; start < keys; start += KEYS) {
        // S^T: four accumulators of 16 keys; K's tiles alternate between two registers so loads need not wait
        const uint16_t *k = kc + int64_t(start) * D;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int h = 0; h < D / 32; h++) {
            _tile_loadd(5, qt[h], 64);
            _tile_loadd(4, k + h * 32, D * 2);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, k + 16 * D + h * 32, D * 2);
            _tile_dpbf16ps(1, 6, 5);
            _tile_loadd(4, k + 32 * D + h * 32, D * 2);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, k + 48 * D + h * 32, D * 2);
            _tile_dpbf16ps(3, 6, 5);
        }
        _tile_stored(0, st[0], 64);
        _tile_stored(1, st[16], 64);
        _tile_stored(2, st[32], 64);
        _tile_stored(3, st[48], 64);
        // Scores stay unscaled; the softmax runs in base 2, with the scale folded into one FMA per vector.
        __m512 mx = m;
        if (start + KEYS - 1 > pos[0]) {  // some row sees only part of this tile: -inf past its position
            for (int t = 0; t < KEYS; t++)
                _mm512_store_ps(st[t], V512::mask_after(_mm512_load_ps(st[t]), at, float(start + t)));
        }
        for (int t = 0; t < KEYS; t++) mx = _mm512_max_ps(mx, _mm512_load_ps(st[t]));
        // The running max moves only when a score passes it by more than SLACK: e^(s - m) stays under e^SLACK, and
        // most tiles then need no rescaling of O (m = -inf at first: always moved, and O and l are 0 then).
        bool moved = _mm512_cmp_ps_mask(mx, _mm512_add_ps(m, slack), _CMP_GT_OQ);
        __m512 corr = _mm512_set1_ps(1.0f), sum = _mm512_setzero_ps();
        if (moved) corr = exp2_fast(_mm512_mul_ps(_mm512_sub_ps(m, mx), base2)), m = mx;
        const __m512 mb = _mm512_mul_ps(m, base2);
        for (int t = 0; t < KEYS; t += 2) {
            __m512 e0 = exp2_fast(_mm512_fmsub_ps(_mm512_load_ps(st[t]), base2, mb));
            __m512 e1 = exp2_fast(_mm512_fmsub_ps(_mm512_load_ps(st[t + 1]), base2, mb));
            sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
            _mm512_store_si512(pt[t / 2], pair16(e0, e1));
        }
        tile_fence();
        l = _mm512_fmadd_ps(l, corr, sum);
        // O^T's next sums: 16 rows of D a tile, over both halves of the keys (P^T's two tiles)
        const uint32_t *v = vt + int64_t(start / (2 * PAIRS)) * D * PAIRS;
        for (int c = 0; c < D / 16; c += 4) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int half = 0; half < 2; half++) {
                const uint32_t *vh = v + half * D * PAIRS + c * 16 * PAIRS;
                _tile_loadd(5, pt[half * PAIRS], 64);
                _tile_loadd(4, vh, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, vh + 256, 64);
                _tile_dpbf16ps(1, 6, 5);
                _tile_loadd(4, vh + 512, 64);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(6, vh + 768, 64);
                _tile_dpbf16ps(3, 6, 5);
            }
            _tile_stored(0, pv[0], 64);
            _tile_stored(1, pv[1], 64);
            _tile_stored(2, pv[2], 64);
            _tile_stored(3, pv[3], 64);
            for (int i = 0; i < 4; i++)
                for (int d = 0; d < 16; d++) {
                    float *o = ot[(c + i) * 16 + d];
                    __m512 add = _mm512_load_ps(pv[i][d]);
                    _mm512_store_ps(o, moved ? _mm512_fmadd_ps(_mm512_load_ps(o), corr, add)
                                             : _mm512_add_ps(_mm512_load_ps(o), add));
                }
        }
    }
    alignas(64) float inv[ROWS];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    for (int c = 0; c < D / 16; c++) {  // O^T's 16 x 16 blocks back into rows of O, normalised
        __m512 o[16];
        for (int i = 0; i < 16; i++) o[i] = _mm512_load_ps(ot[c * 16 + i]);
        transpose16(o);
        for (int r = 0; r < rows; r++) {
            int64_t at = ((p.query_start[b] + j0 + r / g) * int64_t(p.heads) + kvh * g + r % g) * D + c * 16;
            V512::store<true>(p.out, at, _mm512_mul_ps(o[r], _mm512_set1_ps(inv[r])));
        }
    }
}

template <int D>
void run(const Prefill &p) {
    // K and V^T of every (row, KV head), packed on the call's threads; the buffer stays for the next call
    static thread_local std::vector<uint16_t> kbuf;
    static thread_local std::vector<uint32_t> vbuf;
    std::vector<int64_t> at(p.n_rows + 1, 0);  // each row's offset, in keys, per KV head
    for (int i = 0; i < p.n_rows; i++) at[i + 1] = at[i] + (p.seq_len[p.rows[i]] + KEYS - 1) / KEYS * KEYS;
    int64_t per_head = at[p.n_rows];
    if (int64_t(kbuf.size()) < per_head * p.kv_heads * D) {
        kbuf.resize(per_head * p.kv_heads * D);
        vbuf.resize(per_head * p.kv_heads * D / 2);
    }
    uint16_t *kc = kbuf.data();
    uint32_t *vt = vbuf.data();
#pragma omp parallel for schedule(dynamic, 1) num_threads(p.threads)
    for (int64_t w = 0; w < int64_t(p.n_rows) * p.kv_heads; w++) {
        int i = int(w / p.kv_heads), kvh = int(w % p.kv_heads);
        int64_t off = (kvh * per_head + at[i]) * D;
        pack_kv<D>(p, p.rows[i], kvh, p.seq_len[p.rows[i]], kc + off, vt + off / 2);
    }
    std::vector<int> index(*std::max_element(p.rows, p.rows + p.n_rows) + 1);
    for (int i = 0; i < p.n_rows; i++) index[p.rows[i]] = i;
    each_item<Tiles>(p, ROWS / (p.heads / p.kv_heads), [&](int b, int kvh, int j0, int j1) {
        int64_t off = (kvh * per_head + at[index[b]]) * D;
        item<D>(p, b, kvh, j0, j1, kc + off, vt + off / 2);
    });
}

}  // namespace
#endif

// Arguments as paged_prefill, bf16 only; 0, or -1 where this build, CPU or shape is not covered (no AMX, head size
// other than 64 or 128, a group over 16 heads): cpu_kernels asks first with n_rows = 0. The caller has had this
// process granted the tile registers (tile_enable).
extern "C" int tile_prefill(const void *q, int64_t q_tok, int64_t q_head, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *rows, int n_rows,
                            const int32_t *query_start, const int32_t *query_len, const int32_t *seq_len, void *out,
                            int heads, int kv_heads, int d, int block_size, float scale, int bf16, int threads) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
    if (!bf16 || kv_heads <= 0 || heads % kv_heads || heads / kv_heads > ROWS || (d != 64 && d != 128)) return -1;
    if (n_rows == 0) return 0;
    Prefill p{q, q_tok, q_head, k_cache, v_cache, block_tables, bt_stride, rows, n_rows, query_start, query_len,
              seq_len, out, heads, kv_heads, block_size, scale, threads};
    d == 64 ? run<64>(p) : run<128>(p);
    return 0;
#else
    return -1;
#endif
}
