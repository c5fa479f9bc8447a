// A step's decoder layers in one call: the kernels the Python layer calls one by one (fused_ops.cpp, tile_gemm.cpp,
// dot_gemm.cpp, small_gemm.cpp, paged_attention.cpp, prefill_attention.cpp, tile_attention.cpp), in the same order on
// the same buffers, so the same bits. At a decode step's few rows, the Python between those calls (argument checks,
// views, ctypes marshalling, tensor allocations) cost about as much as a kernel, nine times a layer (layer_stack.py).
#include <cstdint>

extern "C" {
void add_rms_norm(void *x, const void *y, int64_t y_row, int64_t y_col, const void *w, void *out, int64_t rows,
                  int64_t hidden, float eps, int bf16, int threads);
void rope(void *qk, int64_t row, const float *cos, const float *sin, int64_t rows, int64_t heads, int64_t dim, int bf16,
          int threads);
void kv_store(const void *k, int64_t k_row, const void *v, int64_t v_row, void *k_cache, void *v_cache,
              const int64_t *slots, int64_t rows, int64_t width, int threads);
int tile_gemm(const uint16_t *x, int64_t x_row, const void *wp, uint16_t *y, int64_t y_row, int64_t m_len,
              int64_t n_len, int64_t k_len, int silu, int form, int threads);
int dot_gemm(const uint16_t *x, int64_t x_row, const void *wp, uint16_t *y, int64_t y_row, int64_t m_len,
             int64_t n_len, int64_t k_len, int silu, int form, int threads);
int small_gemm(const float *x, int64_t x_row, const float *wt, float *y, int64_t m_len, int64_t n_len, int64_t k_len,
               int threads);
int form_gemm(const float *x, int64_t x_row, const uint8_t *wq, float *y, int64_t m_len, int64_t n_len, int64_t k_len,
              int form, int threads);
int silu_mul_fp32(const float *gate_up, int64_t g_row, float *out, int64_t rows, int64_t inter, int threads);
// paged_attention.cpp's paged_decode, prefill_attention.cpp's paged_prefill and tile_attention.cpp's tile_prefill
using Attention = int(const void *, int64_t, int64_t, const void *, const void *, const int32_t *, int64_t,
                      const int32_t *, int, const int32_t *, const int32_t *, const int32_t *, void *, int, int, int, int,
                      float, int, int);
Attention paged_decode, paged_prefill, tile_prefill;
}

// The model's shapes and kernels, fixed at load. gemm: 1 tile_gemm, 2 dot_gemm (bf16 weights, gate/up paired), 3
// small_gemm (fp32 weights; form_gemm for those in a GGUF form; gate/up's product, then silu_mul_fp32).
struct StackShape {
    int64_t hidden, heads, kv_heads, head_dim, inter, block_size, gemm, prefill, threads;  // prefill: 0 paged, 1 tile
    float eps, scale;
};

// One layer's packed weights (and their forms.h forms), norms and KV cache.
struct StackLayer {
    const void *in_norm, *post_norm, *qkv, *o, *gate_up, *down;
    void *k_cache, *v_cache;
    int64_t qkv_form, o_form, gate_up_form, down_form;
};

// One step: x [T, hidden] (the residual stream, in and out), delta [T, hidden] (out: the last layer's), scratch h
// [T, hidden], qkv [T, (heads + 2 kv_heads) head_dim], attn [T, heads head_dim], act [T, inter], gate_up [T, 2 inter]
// (fp32 only: bf16 tiles end in the activation); cos/sin [T,
// head_dim]; the attention kernels' int32 rows and per-row tables, starts, query and context lengths.
struct StackStep {
    void *x, *delta, *h, *qkv, *attn, *act, *gate_up;
    const float *cos, *sin;
    const int64_t *slots;
    const int32_t *tables, *decodes, *prefills, *starts, *qlens, *lens;
    int64_t tokens, table_stride, n_decodes, n_prefills;
};

namespace {

constexpr int64_t SMALL_GEMM = 3;

// y [m, n] (rows y_row elements apart; fp32's are n) = x @ W.T; with silu (bf16 only), silu(gate) * up [m, n / 2].
int gemm(const StackShape &s, const void *x, int64_t x_row, const void *w, int64_t form, void *y, int64_t y_row,
         int64_t n, int64_t k, int silu, int64_t m) {
    if (s.gemm == SMALL_GEMM) {
        auto xf = static_cast<const float *>(x);
        auto yf = static_cast<float *>(y);
        if (form) return form_gemm(xf, x_row, static_cast<const uint8_t *>(w), yf, m, n, k, int(form), int(s.threads));
        return small_gemm(xf, x_row, static_cast<const float *>(w), yf, m, n, k, int(s.threads));
    }
    auto xs = static_cast<const uint16_t *>(x);
    auto ys = static_cast<uint16_t *>(y);
    if (s.gemm == 1) return tile_gemm(xs, x_row, w, ys, y_row, m, n, k, silu, int(form), int(s.threads));
    return dot_gemm(xs, x_row, w, ys, y_row, m, n, k, silu, int(form), int(s.threads));
}

int attend(const StackShape &s, const StackStep &t, const StackLayer &l, int64_t qkv_row, Attention *kernel,
           const int32_t *rows, int64_t n_rows) {
    if (!n_rows) return 0;
    return kernel(t.qkv, qkv_row, s.head_dim, l.k_cache, l.v_cache, t.tables, t.table_stride, rows, int(n_rows),
                  t.starts, t.qlens, t.lens, t.attn, int(s.heads), int(s.kv_heads), int(s.head_dim),
                  int(s.block_size), s.scale, s.gemm != SMALL_GEMM, int(s.threads));
}

}  // namespace

// Runs layers [0, n_layers) over the step; the first adds no delta before its norm. Returns 0, or -1 when a kernel
// refused its shapes (layer_stack.py checks them at load: a guard only), with x and delta then undefined.
extern "C" int layer_stack(const StackShape *shape, const StackLayer *layers, int64_t n_layers, const StackStep *step) {
    const StackShape &s = *shape;
    const StackStep &t = *step;
    int64_t hd = s.head_dim, nq = s.heads * hd, nkv = s.kv_heads * hd, qkv_row = nq + 2 * nkv, m = t.tokens;
    int th = int(s.threads), bf16 = s.gemm != SMALL_GEMM, size = bf16 ? 2 : 4;
    Attention *prefill = s.prefill ? tile_prefill : paged_prefill;
    auto k = static_cast<char *>(t.qkv) + nq * size;
    for (int64_t i = 0; i < n_layers; i++) {
        const StackLayer &l = layers[i];
        add_rms_norm(t.x, i ? t.delta : nullptr, s.hidden, 1, l.in_norm, t.h, m, s.hidden, s.eps, bf16, th);
        int rc = gemm(s, t.h, s.hidden, l.qkv, l.qkv_form, t.qkv, qkv_row, qkv_row, s.hidden, 0, m);
        rope(t.qkv, qkv_row, t.cos, t.sin, m, s.heads + s.kv_heads, hd, bf16, th);
        kv_store(k, qkv_row * size, k + nkv * size, qkv_row * size, l.k_cache, l.v_cache, t.slots, m, nkv * size, th);
        rc |= attend(s, t, l, qkv_row, paged_decode, t.decodes, t.n_decodes);
        rc |= attend(s, t, l, qkv_row, prefill, t.prefills, t.n_prefills);
        rc |= gemm(s, t.attn, nq, l.o, l.o_form, t.delta, s.hidden, s.hidden, nq, 0, m);
        add_rms_norm(t.x, t.delta, s.hidden, 1, l.post_norm, t.h, m, s.hidden, s.eps, bf16, th);
        if (bf16) {
            rc |= gemm(s, t.h, s.hidden, l.gate_up, l.gate_up_form, t.act, s.inter, 2 * s.inter, s.hidden, 1, m);
        } else {
            int64_t gu = 2 * s.inter;
            rc |= gemm(s, t.h, s.hidden, l.gate_up, l.gate_up_form, t.gate_up, gu, gu, s.hidden, 0, m);
            rc |= silu_mul_fp32(static_cast<const float *>(t.gate_up), gu, static_cast<float *>(t.act), m, s.inter, th);
        }
        rc |= gemm(s, t.act, s.inter, l.down, l.down_form, t.delta, s.hidden, s.hidden, s.inter, 0, m);
        if (rc) return -1;
    }
    return 0;
}
