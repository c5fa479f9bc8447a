// y = x @ W.T in bf16 on the CPU's AMX tiles, from W packed once at load (cpu_kernels.py builds and calls this).
//
// A decode step multiplies a few rows by every weight once, so it runs at the speed the weights stream from memory.
// torch's bf16 product (oneDNN) streamed them at about half the bandwidth on the Sapphire Rapids it was measured on;
// here a 16-row tile of x meets 16-column tiles of W.T held in the layout the tile unit reads (pairs of k side by
// side, "VNNI"), one sequential 1 KiB load per tile, and the sums stay in fp32 tiles over all of K.
// W is packed as [N / 16, K / 2, 16, 2]: panel p holds columns 16p..16p+15, row kk of a panel holds k = 2kk, 2kk+1
// of each column. A work item is two panels (32 columns) by two 16-row blocks of x: four accumulator tiles, two of x,
// two of W (the eight tile registers). Layouts: x [M, K] bf16 with rows x_row apart; y [M, N] bf16 with rows y_row
// apart; N a multiple of 32 and K of 32 (cpu_kernels.pack checks). A SwiGLU's gate/up product can end in its
// activation (store_silu), so its [M, 2I] result never reaches memory.
//
// W may also come in its 4-bit form (quant.py: a Q4_1 checkpoint's q, scale d and minimum m, w = d * q + m in fp32,
// as gguf dequantises it): Q4_STEP bytes per panel and k-step of 32, unpacked to the bf16 tile the packed form holds,
// bit for bit. A decode step's few rows then unpack each tile on the way to the tile unit, reading 5 bits a weight
// from memory instead of 16; a prefill unpacks the whole W once (q4_unpack) and runs on that.
#include <cstdint>

#include "cpu_kernels.h"

// A Q4 step: 16 rows (k pairs) of 16 bytes, byte i of row kk holding in its low nibble q of column i / 2 at k = 2 kk +
// i % 2 and in its high nibble that of column 8 + i / 2; then the 16 columns' d, then their m, in fp16.
constexpr int64_t Q4_STEP = 16 * 16 + 2 * 16 * 2;

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define SLOFLEET_Q4 1
namespace {

// One bf16 tile of W (16 rows of 16 pairs, tile_pack's order) from its Q4 step: lane 2j + e of row kk is column j's
// weight at k = 2 kk + e, d * q + m rounded to bf16. d * q (11 by 4 bits) is exact in fp32, so one fused multiply-add
// rounds as gguf's product then sum do; no result can be subnormal (d and m are fp16), which the bf16 conversion
// would flush.
[[gnu::always_inline]] inline void unpack_q4_tile(const uint8_t *src, uint16_t *dst) {
    const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + 256)));
    __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + 288)));
    __m512 d0 = _mm512_permutexvar_ps(first, d), d1 = _mm512_permutexvar_ps(second, d);
    __m512 m0 = _mm512_permutexvar_ps(first, m), m1 = _mm512_permutexvar_ps(second, m);
    for (int kk = 0; kk < 16; kk++) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src + 16 * kk)));
        __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), d0, m0);
        __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d1, m1);
        __m512bh pairs = _mm512_cvtne2ps_pbh(hi, lo);  // lo's lanes first
        _mm512_store_si512(dst + 32 * kk, reinterpret_cast<__m512i &>(pairs));
    }
}

}  // namespace

// W's Q4 form [N / 16, K / 32, Q4_STEP] into the bf16 tiles tile_pack makes ([N / 16, K / 2, 16, 2]). Returns 0, or
// -1 on a CPU without AVX512-BF16 (cpu_kernels.pack then keeps bf16 tiles).
extern "C" int q4_unpack(const uint8_t *wq, int64_t n_len, int64_t k_len, uint16_t *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < n_len / 16 * (k_len / 32); t++) unpack_q4_tile(wq + t * Q4_STEP, out + t * 512);
    return 0;
}
#else
extern "C" int q4_unpack(const uint8_t *, int64_t, int64_t, uint16_t *, int) { return -1; }
#endif

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>

using namespace slofleet;

namespace {

constexpr int ROWS = 16, COLS = 16, KSTEP = 32;  // a tile: 16 rows of 64 bytes (16 fp32, or 32 bf16 = 16 pairs)
constexpr int64_t CHUNK = 8;  // work items of 32 rows per chunk: 256 rows of x, 288 KiB at K = 576

// Tiles 0-3: sums (rows of block r, columns of panel c: tile 2r + c); 4, 5: x's two row blocks; 6, 7: W's panels.
void configure(int rows0, int rows1) {
    TileConfig cfg;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = uint8_t(rows0);
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = uint8_t(rows1 ? rows1 : 1);
    cfg.rows[6] = cfg.rows[7] = KSTEP / 2;
    _tile_loadconfig(&cfg);
}

void store(const float (&sums)[ROWS][COLS], int rows, uint16_t *y, int64_t y_row) {
    for (int m = 0; m < rows; m++) store_bf16(y + m * y_row, keep_bf16(_mm512_load_ps(sums[m])));
}

// The SwiGLU epilogue: the two panels are 16 columns of gate and the same 16 of up (tile_pack's paired order); each
// rounded to bf16 as the product would be, then silu(gate) * up as torch's two ops round it.
void store_silu(const float (&g)[ROWS][COLS], const float (&u)[ROWS][COLS], int rows, uint16_t *y, int64_t y_row) {
    for (int m = 0; m < rows; m++)
        store_bf16(y + m * y_row, silu_mul16(keep_bf16(_mm512_load_ps(g[m])), keep_bf16(_mm512_load_ps(u[m]))));
}

// One work item: rows [m0, m0 + rows0 + rows1) of x by the panels 2q and 2q + 1 (bf16 tiles, or Q4 steps unpacked
// here into two tiles of a double buffer); rows1 may be 0 (one block).
template <bool TWO, bool SILU, bool Q4>
void item(const uint16_t *x, int64_t x_row, const void *w0, const void *w1, int64_t k_len, int rows0, int rows1,
          uint16_t *y, int64_t y_row) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (TWO) {
        _tile_zero(2);
        _tile_zero(3);
    }
    alignas(64) uint16_t unpacked[2][2][KSTEP * COLS];
    for (int64_t k = 0; k < k_len; k += KSTEP) {
        if constexpr (Q4) {
#if defined(SLOFLEET_Q4)
            int64_t step = k / KSTEP;
            uint16_t(&tiles)[2][KSTEP * COLS] = unpacked[step & 1];
            unpack_q4_tile(static_cast<const uint8_t *>(w0) + step * Q4_STEP, tiles[0]);
            unpack_q4_tile(static_cast<const uint8_t *>(w1) + step * Q4_STEP, tiles[1]);
            _tile_loadd(6, tiles[0], 64);
            _tile_loadd(7, tiles[1], 64);
#endif
        } else {
            _tile_loadd(6, static_cast<const uint16_t *>(w0) + k * COLS, 64);  // KSTEP / 2 rows of 16 pairs
            _tile_loadd(7, static_cast<const uint16_t *>(w1) + k * COLS, 64);
        }
        _tile_loadd(4, x + k, x_row * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if constexpr (TWO) {
            _tile_loadd(5, x + ROWS * x_row + k, x_row * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    if constexpr (SILU) {  // tile numbers are part of the instruction: literals only
        alignas(64) float g[ROWS][COLS], u[ROWS][COLS];
        _tile_stored(0, g, 64);
        _tile_stored(1, u, 64);
        store_silu(g, u, rows0, y, y_row);
        if constexpr (TWO) {
            _tile_stored(2, g, 64);
            _tile_stored(3, u, 64);
            store_silu(g, u, rows1, y + ROWS * y_row, y_row);
        }
        return;
    }
    alignas(64) float sums[ROWS][COLS];
    _tile_stored(0, sums, 64);
    store(sums, rows0, y, y_row);
    _tile_stored(1, sums, 64);
    store(sums, rows0, y + COLS, y_row);
    if constexpr (TWO) {
        _tile_stored(2, sums, 64);
        store(sums, rows1, y + ROWS * y_row, y_row);
        _tile_stored(3, sums, 64);
        store(sums, rows1, y + ROWS * y_row + COLS, y_row);
    }
}

}  // namespace

// 0 when this process may use the tile registers (Linux asks each process to request them), else -1.
extern "C" int tile_enable() {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

using Item = void (*)(const uint16_t *, int64_t, const void *, const void *, int64_t, int, int, uint16_t *, int64_t);

template <bool Q4>
Item pick(bool two, bool silu) {
    if (two) return silu ? item<true, true, Q4> : item<true, false, Q4>;
    return silu ? item<false, true, Q4> : item<false, false, Q4>;
}

// Returns 0; -1 when N or K is not a multiple of 32. With silu, W is a SwiGLU's [gate; up] packed in paired order
// and y [M, N / 2] = silu(gate) * up. With q4, wp is W's Q4 form (every item unpacks its panels: for few rows).
extern "C" int tile_gemm(const uint16_t *x, int64_t x_row, const void *wp, uint16_t *y, int64_t y_row, int64_t m_len,
                         int64_t n_len, int64_t k_len, int silu, int q4, int threads) {
    if (n_len % (2 * COLS) || k_len % KSTEP) return -1;
#if !defined(SLOFLEET_Q4)
    if (q4) return -1;  // an AMX build without AVX512-BF16 (a test's): cpu_kernels.pack keeps bf16 tiles there
#endif
    int64_t pairs = n_len / (2 * COLS), blocks = (m_len + 2 * ROWS - 1) / (2 * ROWS);
    int64_t panel = q4 ? k_len / KSTEP * Q4_STEP : k_len * COLS * 2;  // bytes
    int tail = int(m_len - (blocks - 1) * 2 * ROWS);  // rows in the last item's blocks: 1 .. 32
#pragma omp parallel num_threads(threads)
    {
        int configured = -1;  // the tail's shape needs its own configuration
#pragma omp for schedule(static)
        for (int64_t it = 0; it < pairs * blocks; it++) {
            // rows go in chunks of CHUNK blocks, each over every panel, so a long prompt's x stays in L2
            int64_t chunk = it / (pairs * CHUNK), in_chunk = it % (pairs * CHUNK);
            int64_t width = blocks - chunk * CHUNK < CHUNK ? blocks - chunk * CHUNK : CHUNK;
            int64_t q = in_chunk / width, b = chunk * CHUNK + in_chunk % width;
            int rows = b == blocks - 1 ? tail : 2 * ROWS, rows0 = rows < ROWS ? rows : ROWS, rows1 = rows - rows0;
            if (configured != rows) configure(rows0, rows1), configured = rows;
            const char *w0 = static_cast<const char *>(wp) + 2 * q * panel;
            const uint16_t *xb = x + b * 2 * ROWS * x_row;
            uint16_t *yb = y + b * 2 * ROWS * y_row + q * (silu ? COLS : 2 * COLS);
            (q4 ? pick<true>(rows1, silu) : pick<false>(rows1, silu))(xb, x_row, w0, w0 + panel, k_len, rows0, rows1, yb,
                                                                     y_row);
        }
        if (configured != -1) _tile_release();
    }
    return 0;
}
#else
extern "C" int tile_enable() { return -1; }
extern "C" int tile_gemm(const uint16_t *, int64_t, const void *, uint16_t *, int64_t, int64_t, int64_t, int64_t, int,
                         int, int) {
    return -1;
}
#endif

// W [N, K] into [N / 16, K / 2, 16, 2], for this kernel or dot_gemm.cpp's (plain C++: built on every CPU). Paired (a
// SwiGLU's [gate; up]): panel 2q holds gate's columns 16q.. and panel 2q + 1 up's same columns, so one work item has
// both halves of 16 outputs.
extern "C" void tile_pack(const uint16_t *w, int64_t n_len, int64_t k_len, int paired, uint16_t *out) {
    constexpr int64_t cols = 16;
    int64_t half = n_len / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < n_len / cols; p++) {
        int64_t first = paired ? (p % 2) * half + (p / 2) * cols : p * cols;  // W's row behind the panel's column 0
        for (int64_t kk = 0; kk < k_len / 2; kk++)
            for (int64_t j = 0; j < cols; j++)
                for (int e = 0; e < 2; e++)
                    out[((p * (k_len / 2) + kk) * cols + j) * 2 + e] = w[(first + j) * k_len + 2 * kk + e];
    }
}
