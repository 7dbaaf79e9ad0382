/* A dense Qwen2 / Qwen3 model's decoder layers at a decode step, all of them in one call, for a bf16 model over a
 * bf16 KV cache: per layer RMSNorm, the fused q/k/v product (+ bias), the q/k norm and rotation, the K/V stored at
 * the step's slots, paged attention, the output product and residual, RMSNorm, gate/up, silu * up, down, residual.
 *
 * Each step is the kernel the layer-by-layer path calls (bf16_layer.c, linear.c, linear_quant.c, paged_decode.c),
 * with the same roundings to bf16 between them, so the hidden states equal that path's bit for bit. What goes is
 * what lies between the kernels: a Qwen3-0.6B-shaped step made ~340 Python calls, each with its checks, its
 * tensors and its OpenMP region, ~18 ms of a 45-70 ms single-stream step on this project's Xeon. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec8.h"

/* The kernels this file strings together (defined in the other sources of the same object). */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int64_t out_stride,
                   int64_t rows, int64_t n, float eps, int zero_centered, int64_t num_threads);
void qk_norm_rope_bf16(uint16_t *q, int64_t q_stride, uint16_t *k, int64_t k_stride, const uint16_t *q_w,
                       const uint16_t *k_w, const uint16_t *cos, const uint16_t *sin, int64_t cs_stride, int64_t rows,
                       int64_t heads, int64_t kv_heads, int64_t dim, int64_t rot, float eps, int zero_centered,
                       int64_t num_threads);
void silu_mul_bf16(const uint16_t *gate_up, int64_t stride, uint16_t *out, int64_t out_stride, int64_t rows,
                   int64_t n, int64_t num_threads);
void linear_packed_bf16(const float *x, const uint16_t *wp, float *y, int64_t m, int64_t k, int64_t n,
                        int64_t num_threads);
int linear_quant(const float *x, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, float *y, int64_t m,
                 int64_t k, int64_t n, int64_t bits, int64_t group, int64_t num_threads);
int linear_quant_amx(const float *x, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, float *y,
                     int64_t m, int64_t k, int64_t n, int64_t bits, int64_t group, int64_t num_threads);
int linear_bf16_amx(const uint16_t *x, int64_t x_stride, const uint16_t *tiles, void *y, int64_t y_fp32, int64_t m,
                    int64_t k, int64_t n, int64_t num_threads);
int paged_decode_attention_bf16_io(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                   const uint16_t *v_cache, int64_t num_blocks, const int64_t *block_table,
                                   int64_t table_stride, const int64_t *context_lens, uint16_t *out,
                                   int64_t out_stride, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                   int64_t block_size, float scale, int64_t num_threads);

/* One linear weight [n, k]: bf16 panels (bits 16; `tiles`: the same weight in AMX tile order, linear_amx.c's, or
 * NULL) or 4- / 8-bit codes with fp16 scales and zero points per group (quant_weight.py's layout; `perm`: the order
 * of x's columns the codes follow, NULL for their own). */
typedef struct {
    int64_t bits;
    const void *data;
    const uint16_t *scales, *zeros;
    const int64_t *perm;
    int64_t group, n, k;
    const uint16_t *tiles;
} StackWeight;

/* One decoder layer: norm weights bf16 (q_norm / k_norm NULL: none), qkv_bias bf16 (NULL: none). */
typedef struct {
    const uint16_t *input_norm, *post_norm, *q_norm, *k_norm, *qkv_bias;
    StackWeight qkv, o, gate_up, down;
} StackLayer;

/* The model's sizes, the norms' eps, whether the q/k norms store w - 1 (the layer norms never do here), and from how
 * many rows codes and tiled bf16 weights are multiplied on AMX tiles (linear_quant_amx, linear_bf16_amx: as the
 * layer-by-layer path does; 0: never). */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, rot, intermediate, block_size, num_threads;
    float eps, scale;
    int64_t qk_zero_centered, quant_amx_rows, panel_amx_rows;
} StackShape;



/* y [m, n] bf16 = x [m, k] bf16 (row stride x_stride) times w, rounded once from the fp32 product, then + bias
 * rounded again (PyTorch's bf16 add). xf and yf: fp32 scratch of m * k and m * n. */
static int linear(const StackWeight *w, const uint16_t *x, int64_t x_stride, const uint16_t *bias, uint16_t *y,
                  int64_t m, float *xf, float *yf, const StackShape *shape) {
    const int64_t k = w->k, n = w->n, num_threads = shape->num_threads;
    /* -3: AMX cannot run here (or is not asked for), and the next way multiplies. Tiles take bf16 x as it is; codes'
     * AMX product rounds x to bf16, which it is already. */
    int status = -3;
    if (w->bits == 16 && w->tiles && shape->panel_amx_rows > 0 && m >= shape->panel_amx_rows)
        status = linear_bf16_amx(x, x_stride, w->tiles, yf, 1, m, k, n, num_threads);
    if (status == -3) {
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < k; i++) xf[r * k + i] = widen_bf16(x[r * x_stride + (w->perm ? w->perm[i] : i)]);
        if (w->bits == 16) {
            linear_packed_bf16(xf, (const uint16_t *)w->data, yf, m, k, n, num_threads);
            status = 0;
        } else {
            if (shape->quant_amx_rows > 0 && m >= shape->quant_amx_rows)
                status = linear_quant_amx(xf, (const uint8_t *)w->data, w->scales, w->zeros, yf, m, k, n, w->bits,
                                          w->group, num_threads);
            if (status == -3)
                status = linear_quant(xf, (const uint8_t *)w->data, w->scales, w->zeros, yf, m, k, n, w->bits,
                                      w->group, num_threads);
        }
    }
    if (status) return -1;
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < n; j++) {
            const uint16_t v = round_bf16(yf[r * n + j]);
            y[r * n + j] = bias ? round_bf16(widen_bf16(v) + widen_bf16(bias[j])) : v;
        }
    return 0;
}

static void add_rows(uint16_t *x, const uint16_t *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) x[i] = round_bf16(widen_bf16(x[i]) + widen_bf16(y[i]));
}

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    const int64_t ab = a > b ? a : b;
    return ab > c ? ab : c;
}

/* x [m, hidden] bf16 (contiguous), the embeddings in and the last layer's output out. cos / sin [m, rot] bf16 at
 * each row's position; slots [m]: where each row's K/V goes in a layer's cache, as block * block_size + offset;
 * kv_cache: layer l's keys at kv_cache + l * layer_stride, its values layer_stride / 2 further, each
 * [num_blocks, block_size, kv_heads, head_dim]; block_table [m, table_stride] and context_lens [m] as
 * paged_decode_attention reads them. Returns 0; -1 when scratch could not be allocated; -2 when a slot or a block
 * lies outside the cache (checked before anything is written). */
int decode_stack_bf16(uint16_t *x, int64_t m, const StackLayer *layers, int64_t num_layers, const StackShape *shape,
                      const uint16_t *cos, const uint16_t *sin, const int64_t *slots, uint16_t *kv_cache,
                      int64_t layer_stride, int64_t num_blocks, const int64_t *block_table, int64_t table_stride,
                      const int64_t *context_lens) {
    if (m <= 0 || num_layers <= 0) return 0;
    const int64_t hidden = shape->hidden, dim = shape->head_dim, threads = shape->num_threads;
    const int64_t q_size = shape->heads * dim, kv_size = shape->kv_heads * dim, qkv_out = q_size + 2 * kv_size;
    const int64_t inter = shape->intermediate, slots_total = num_blocks * shape->block_size;
    for (int64_t r = 0; r < m; r++) {
        if (slots[r] < 0 || slots[r] >= slots_total) return -2;
        const int64_t used = (context_lens[r] + shape->block_size - 1) / shape->block_size;
        if (context_lens[r] < 1 || used > table_stride) return -2;
        for (int64_t j = 0; j < used; j++)
            if (block_table[r * table_stride + j] < 0 || block_table[r * table_stride + j] >= num_blocks) return -2;
    }
    /* bf16: the normed rows, q/k/v, attention's output, gate/up, silu * up, a product's output; fp32: a product's
     * x and y. */
    const int64_t widest_in = max3(hidden, q_size, inter), widest_out = max3(qkv_out, hidden, 2 * inter);
    uint16_t *normed = malloc(sizeof(uint16_t) * (size_t)(m * (hidden + qkv_out + q_size + 2 * inter + inter +
                                                               hidden)));
    float *xf = malloc(sizeof(float) * (size_t)(m * (widest_in + widest_out)));
    if (!normed || !xf) {
        free(normed);
        free(xf);
        return -1;
    }
    uint16_t *qkv = normed + m * hidden, *attn = qkv + m * qkv_out, *gate_up = attn + m * q_size;
    uint16_t *act = gate_up + m * 2 * inter, *out = act + m * inter;
    float *yf = xf + m * widest_in;
    int status = 0;
    for (int64_t l = 0; l < num_layers && status == 0; l++) {
        const StackLayer *L = &layers[l];
        uint16_t *k_cache = kv_cache + l * layer_stride, *v_cache = k_cache + layer_stride / 2;
        rms_norm_bf16(x, hidden, L->input_norm, normed, hidden, m, hidden, shape->eps, 0, threads);
        if ((status = linear(&L->qkv, normed, hidden, L->qkv_bias, qkv, m, xf, yf, shape))) break;
        qk_norm_rope_bf16(qkv, qkv_out, qkv + q_size, qkv_out, L->q_norm, L->k_norm, cos, sin, shape->rot, m,
                          shape->heads, shape->kv_heads, dim, shape->rot, shape->eps, (int)shape->qk_zero_centered,
                          threads);
        for (int64_t r = 0; r < m; r++) {
            memcpy(k_cache + slots[r] * kv_size, qkv + r * qkv_out + q_size, sizeof(uint16_t) * (size_t)kv_size);
            memcpy(v_cache + slots[r] * kv_size, qkv + r * qkv_out + q_size + kv_size,
                   sizeof(uint16_t) * (size_t)kv_size);
        }
        if ((status = paged_decode_attention_bf16_io(qkv, qkv_out, k_cache, v_cache, num_blocks, block_table,
                                                     table_stride, context_lens, attn, q_size, m, shape->heads,
                                                     shape->kv_heads, dim, shape->block_size, shape->scale, threads)))
            break;
        if ((status = linear(&L->o, attn, q_size, NULL, out, m, xf, yf, shape))) break;
        add_rows(x, out, m * hidden);
        rms_norm_bf16(x, hidden, L->post_norm, normed, hidden, m, hidden, shape->eps, 0, threads);
        if ((status = linear(&L->gate_up, normed, hidden, NULL, gate_up, m, xf, yf, shape))) break;
        silu_mul_bf16(gate_up, 2 * inter, act, inter, m, inter, threads);
        if ((status = linear(&L->down, act, inter, NULL, out, m, xf, yf, shape))) break;
        add_rows(x, out, m * hidden);
    }
    free(normed);
    free(xf);
    return status;
}
