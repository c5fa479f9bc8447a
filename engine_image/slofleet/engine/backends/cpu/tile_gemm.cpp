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
// activation (Pending), so its [M, 2I] result never reaches memory.
//
// W may also come in a checkpoint's quantised form (forms.h: 5 bits a weight for Q4_1, 8.5 for Q8_0): a thread's first
// item on a pair of panels unpacks each k-step's two tiles as it goes, into a buffer its later items on the pair read
// as bf16 tiles, so a decode step reads 3x fewer bytes of weights and the unpacking overlaps the tile unit's work
// (unpacking the pair first, then multiplying, ran 30 layers at 16 rows in 8.5 ms against 5.5); each chunk of rows
// unpacks it again, so past cpu_kernels.DIRECT_ROWS the caller unpacks the whole W once (form_unpack) instead.
#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "cpu_kernels.h"
#include "forms.h"

// W's form [N / 16, K / 32, step bytes] into the bf16 tiles tile_pack makes ([N / 16, K / 2, 16, 2]). Returns 0, or
// -1 where this build has no unpacking (no AVX512-BF16: cpu_kernels.pack then keeps bf16 tiles).
extern "C" int form_unpack(const uint8_t *w, int64_t n_len, int64_t k_len, int form, uint16_t *out, int threads) {
#if defined(SLOFLEET_FORMS)
    int64_t steps = k_len / 32, bytes = slofleet::step_bytes(form);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < n_len / 16; p++)
        slofleet::unpack_steps(form, w + p * steps * bytes, steps, out + p * k_len * 16);
    return 0;
#else
    return -1;
#endif
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>

using namespace slofleet;

namespace {

constexpr int ROWS = 16, COLS = 16, KSTEP = 32;  // a tile: 16 rows of 64 bytes (16 fp32, or 32 bf16 = 16 pairs)
// Work items of 32 rows per chunk: 512 rows of x, 576 KiB at K = 576, which L2 (2 MiB a core) keeps over the chunk's
// panels, while each pair of panels is read from L1 by all the chunk's items; half as many unpackings of a form as
// chunks of 256 rows (the embedded model's products at 2,048 rows, alternating on a 2-core AMX Xeon: 1.06x faster;
// chunks of 1,024 rows, 0.91x).
constexpr int64_t CHUNK = 16;
// k-steps ahead that an unpacking item asks for its form's bytes: at a decode step they come from memory, and the
// unpacking would otherwise wait on each line (the embedded model's decode products at 16 rows, alternating on a
// 2-core AMX Xeon: 3-6% faster at 2-24 steps ahead, the same at any distance in that range)
constexpr int64_t AHEAD = 6;

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

// A SwiGLU item's sums waiting for their epilogue, which the thread's next item finishes a few rows at a time between
// its products, so the vector unit activates one item's outputs while the tile unit multiplies the next's (at once,
// they took 20-30% of a prefill's gate/up product: 2.0-2.3 against 2.7-2.9 TFLOP/s at 512-1,536 rows; a plain
// product's rounding, spread so, lost 15-20%). The two panels are 16 columns of gate and the same 16 of up
// (tile_pack's paired order); each is rounded to bf16 as the product would be, then silu(gate) * up as torch's two
// ops round it.
struct Pending {
    alignas(64) float sums[4][ROWS][COLS];  // tile 2b + c: rows of block b, columns of panel c
    uint16_t *y = nullptr;
    int64_t y_row = 0;
    int rows0 = 0, done = 0, total = 0;  // block 0's rows; output rows finished, and in all

    void finish(int upto) {
        for (; done < upto; done++) {
            int b = done < rows0 ? 0 : 1, m = done - b * rows0;
            __m512 g = keep_bf16(_mm512_load_ps(sums[2 * b][m])), u = keep_bf16(_mm512_load_ps(sums[2 * b + 1][m]));
            store_bf16(y + (b * ROWS + m) * y_row, silu_mul16(g, u));
        }
    }
};

// One work item: rows [m0, m0 + rows0 + rows1) of x by the panels 2q and 2q + 1 (rows1 may be 0: one block), into y;
// a SwiGLU's sums are left in `next` after it finished `prev`'s outputs. With a FORM, the panels' tiles are first
// unpacked from src into fill (= w0, with w1 = w0 + k_len * COLS).
template <bool TWO, bool SILU, int FORM>
void item(const uint16_t *x, int64_t x_row, const uint16_t *w0, const uint16_t *w1, int64_t k_len, int rows0,
          int rows1, uint16_t *y, int64_t y_row, const uint8_t *src, uint16_t *fill, Pending &prev, Pending &next) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (TWO) {
        _tile_zero(2);
        _tile_zero(3);
    }
    int share = SILU ? (prev.total - prev.done + int(k_len / KSTEP) - 1) / int(k_len / KSTEP) : 0;  // rows a step
    for (int64_t k = 0; k < k_len; k += KSTEP) {
#if defined(SLOFLEET_FORMS)
        if constexpr (FORM != PLAIN) {
            constexpr int64_t bytes = step_bytes(FORM);
            const uint8_t *s0 = src + k / KSTEP * bytes, *s1 = src + (k_len + k) / KSTEP * bytes;  // the two panels
            prefetch_lines(s0 + AHEAD * bytes, bytes);  // past W's end too: a prefetch never faults
            prefetch_lines(s1 + AHEAD * bytes, bytes);
            unpack_step<FORM>(s0, fill + k * COLS);
            unpack_step<FORM>(s1, fill + (k_len + k) * COLS);
            tile_fence();
        }
#endif
        _tile_loadd(6, w0 + k * COLS, 64);  // KSTEP / 2 rows of 16 pairs: k * COLS elements in
        _tile_loadd(7, w1 + k * COLS, 64);
        // A prefill's rows are read once per pair of panels, from L2: loaded without a place in L1, they leave it to
        // the panels, which every item of the chunk reads again (1.04-1.06x at 512-2,048 rows, same measure).
        if constexpr (TWO)
            _tile_stream_loadd(4, x + k, x_row * 2);
        else
            _tile_loadd(4, x + k, x_row * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if constexpr (TWO) {
            _tile_stream_loadd(5, x + ROWS * x_row + k, x_row * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        if constexpr (SILU)
            if (prev.done < prev.total) prev.finish(std::min(prev.total, prev.done + share));
    }
    if constexpr (SILU) {  // tile numbers are part of the instruction: literals only
        prev.finish(prev.total);
        _tile_stored(0, next.sums[0], 64);
        _tile_stored(1, next.sums[1], 64);
        if constexpr (TWO) {
            _tile_stored(2, next.sums[2], 64);
            _tile_stored(3, next.sums[3], 64);
        }
        next.y = y, next.y_row = y_row, next.rows0 = rows0, next.done = 0, next.total = rows0 + rows1;
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
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return -1;
    tiles_granted = true;
    return 0;
}

namespace {

using Item = void (*)(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, int64_t, int, int, uint16_t *,
                      int64_t, const uint8_t *, uint16_t *, Pending &, Pending &);

template <int FORM>
Item pick(bool two, bool silu) {
    if (two) return silu ? item<true, true, FORM> : item<true, false, FORM>;
    return silu ? item<false, true, FORM> : item<false, false, FORM>;
}

Item pick(int form, bool two, bool silu) {
    return form == Q4_1 ? pick<Q4_1>(two, silu) : form == Q8_0 ? pick<Q8_0>(two, silu) : pick<PLAIN>(two, silu);
}

}  // namespace

// Returns 0; -1 when N or K is not a multiple of 32, or W is a form this build cannot unpack. With silu, W is a
// SwiGLU's [gate; up] packed in paired order and y [M, N / 2] = silu(gate) * up. form: forms.h's (PLAIN: bf16 tiles).
extern "C" int tile_gemm(const uint16_t *x, int64_t x_row, const void *wp, uint16_t *y, int64_t y_row, int64_t m_len,
                         int64_t n_len, int64_t k_len, int silu, int form, int threads) {
    if (n_len % (2 * COLS) || k_len % KSTEP) return -1;
#if !defined(SLOFLEET_FORMS)
    if (form != PLAIN) return -1;  // an AMX build without AVX512-BF16 (a test's)
#endif
    int64_t pairs = n_len / (2 * COLS), blocks = (m_len + 2 * ROWS - 1) / (2 * ROWS), panel = k_len * COLS;
    int tail = int(m_len - (blocks - 1) * 2 * ROWS);  // rows in the last item's blocks: 1 .. 32
#pragma omp parallel num_threads(threads)
    {
        int configured = -1;  // the tail's shape needs its own configuration
        int64_t unpacked = -1;  // the panel pair in `tiles`
        uint16_t *tiles = form ? static_cast<uint16_t *>(std::aligned_alloc(64, 2 * panel * 2)) : nullptr;
        Pending pending[2];
        int turn = 0;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < pairs * blocks; it++) {
            // rows go in chunks of CHUNK blocks, each over every panel, so a long prompt's x stays in L2
            int64_t chunk = it / (pairs * CHUNK), in_chunk = it % (pairs * CHUNK);
            int64_t width = blocks - chunk * CHUNK < CHUNK ? blocks - chunk * CHUNK : CHUNK;
            int64_t q = in_chunk / width, b = chunk * CHUNK + in_chunk % width;
            int rows = b == blocks - 1 ? tail : 2 * ROWS, rows0 = rows < ROWS ? rows : ROWS, rows1 = rows - rows0;
            if (configured != rows) configure(rows0, rows1), configured = rows;
            const uint16_t *xb = x + b * 2 * ROWS * x_row, *w0 = static_cast<const uint16_t *>(wp) + 2 * q * panel;
            const uint8_t *src = nullptr;
            uint16_t *fill = nullptr;
            if (form != PLAIN) {
                if (q != unpacked)
                    src = static_cast<const uint8_t *>(wp) + 2 * q * (k_len / KSTEP) * step_bytes(form), fill = tiles;
                w0 = tiles, unpacked = q;
            }
            uint16_t *yb = y + b * 2 * ROWS * y_row + q * (silu ? COLS : 2 * COLS);
            Item run = pick(fill ? form : PLAIN, rows1, silu);
            run(xb, x_row, w0, w0 + panel, k_len, rows0, rows1, yb, y_row, src, fill, pending[turn], pending[turn ^ 1]);
            turn ^= silu;  // a SwiGLU item's sums wait in the other buffer
        }
        pending[turn].finish(pending[turn].total);
        if (configured != -1) _tile_release();
        std::free(tiles);
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
