/* A bf16 model's elementwise work around its products, one call each instead of five to fifteen PyTorch ops:
 * RMSNorm, the per-head q/k RMSNorm with the rotary embedding, and SwiGLU's silu(gate) * up.
 *
 * At a decode step these are a few thousand values, where PyTorch's per-op cost (~5-10 us an op on these CPUs)
 * outweighs the arithmetic: a Qwen3 layer ran ~60 such ops, a third of a 28-layer model's step outside its
 * products. At a prefill chunk they are one pass over memory instead of one per op.
 *
 * Every value is widened to fp32, and rounded back to bf16 (nearest even) wherever transformers' bf16 forward
 * rounds: after the normalisation and again after the weight, after each half of the rotation and their sum,
 * after silu and after the product. The results equal PyTorch's bf16 ops up to the fp32 summation order of a
 * row's mean square and the last bit of expf/sqrtf. Rows run in parallel (OpenMP) only where there are enough. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec8.h"
#include "vexp.h"

#define PARALLEL_VALUES 65536 /* below this, one thread: a parallel region costs more than the work */



/* EXP_LANES fp32 values rounded to bf16 as round_bf16 does, kept as fp32 (the rounded value's bits, low half zero). */
static inline __attribute__((always_inline)) vexp rounded_lanes(vexp v) {
    vexpu u;
    memcpy(&u, &v, sizeof u);
    const vexpu nan = (vexpu)((u & 0x7fffffffu) > 0x7f800000u);
    u = (nan & (u | 0x400000u)) | (~nan & (u + 0x7fffu + ((u >> 16) & 1u)));
    u &= 0xffff0000u;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* EXP_LANES fp32 values stored at p as bf16 (rounded as round_bf16). */
static inline __attribute__((always_inline)) void store_lanes_bf16(uint16_t *p, vexp v) {
    v = rounded_lanes(v);
    vexpu u;
    memcpy(&u, &v, sizeof u);
    const vexph h = __builtin_convertvector(u >> 16, vexph);
    memcpy(p, &h, sizeof h);
}

/* out = w * bf16(x * rsqrt(mean(x^2) + eps)) over n values; `zero_centered`: the weight is stored as w - 1.
 * EXP_LANES at a time: the sum of squares in lanes (another order than PyTorch's, see the top). */
static void norm_row(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t n, float eps, int zero_centered) {
    vexp acc = {0.0f};
    int64_t i = 0;
    for (; i + EXP_LANES <= n; i += EXP_LANES) {
        const vexp v = load_lanes_bf16(x + i);
        acc += v * v;
    }
    float sum = hsum_lanes(acc);
    for (; i < n; i++) {
        const float v = widen_bf16(x[i]);
        sum += v * v;
    }
    const float r = 1.0f / sqrtf(sum / (float)n + eps);
    for (i = 0; i + EXP_LANES <= n; i += EXP_LANES) {
        const vexp v = load_lanes_bf16(x + i), wv = load_lanes_bf16(w + i);
        /* Qwen3-Next: (x * r) * (1 + w) in fp32, rounded once */
        store_lanes_bf16(out + i, zero_centered ? v * r * (1.0f + wv) : wv * rounded_lanes(v * r));
    }
    for (; i < n; i++) {
        if (zero_centered)
            out[i] = round_bf16(widen_bf16(x[i]) * r * (1.0f + widen_bf16(w[i])));
        else
            out[i] = round_bf16(widen_bf16(w[i]) * widen_bf16(round_bf16(widen_bf16(x[i]) * r)));
    }
}

/* RMSNorm of `rows` rows of n values (row strides in elements), out may be x. */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int64_t out_stride,
                   int64_t rows, int64_t n, float eps, int zero_centered, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows > 1 && rows * n >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * x_stride, w, out + r * out_stride, n, eps, zero_centered);
}

/* One head of `dim` values in place: RMSNorm with w (none if NULL), then the half-split rotation of its first
 * `rot` values by cos/sin (rot/2 pairs i, i + rot/2). */
static void norm_rope_head(uint16_t *h, const uint16_t *w, const uint16_t *cos, const uint16_t *sin, int64_t dim,
                           int64_t rot, float eps, int zero_centered) {
    if (w) norm_row(h, w, h, dim, eps, zero_centered);
    const int64_t half = rot / 2;
    int64_t i = 0;
    for (; i + EXP_LANES <= half; i += EXP_LANES) {
        const vexp a = load_lanes_bf16(h + i), b = load_lanes_bf16(h + i + half);
        const vexp lo = rounded_lanes(a * load_lanes_bf16(cos + i)) + rounded_lanes(-b * load_lanes_bf16(sin + i));
        const vexp hi = rounded_lanes(b * load_lanes_bf16(cos + i + half))
                        + rounded_lanes(a * load_lanes_bf16(sin + i + half));
        store_lanes_bf16(h + i, lo);
        store_lanes_bf16(h + i + half, hi);
    }
    for (; i < half; i++) {
        const float a = widen_bf16(h[i]), b = widen_bf16(h[i + half]);
        /* x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1), each product and the sum rounded */
        const float lo = widen_bf16(round_bf16(a * widen_bf16(cos[i]))) + widen_bf16(round_bf16(-b * widen_bf16(sin[i])));
        const float hi = widen_bf16(round_bf16(b * widen_bf16(cos[i + half]))) + widen_bf16(round_bf16(a * widen_bf16(sin[i + half])));
        h[i] = round_bf16(lo);
        h[i + half] = round_bf16(hi);
    }
}

/* Per token r: q heads [r * q_stride, + heads * dim) and k heads [r * k_stride, + kv_heads * dim) normalised (when
 * q_w / k_w are given) and rotated by row r of cos / sin (rot values each, the token's position), in place. */
void qk_norm_rope_bf16(uint16_t *q, int64_t q_stride, uint16_t *k, int64_t k_stride, const uint16_t *q_w,
                       const uint16_t *k_w, const uint16_t *cos, const uint16_t *sin, int64_t cs_stride, int64_t rows,
                       int64_t heads, int64_t kv_heads, int64_t dim, int64_t rot, float eps, int zero_centered,
                       int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows > 1 && rows * (heads + kv_heads) * dim >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = cos + r * cs_stride, *s = sin + r * cs_stride;
        for (int64_t h = 0; h < heads; h++) norm_rope_head(q + r * q_stride + h * dim, q_w, c, s, dim, rot, eps,
                                                           zero_centered);
        for (int64_t h = 0; h < kv_heads; h++) norm_rope_head(k + r * k_stride + h * dim, k_w, c, s, dim, rot, eps,
                                                              zero_centered);
    }
}

/* One row's bf16(bf16(silu(g)) * u) for n values, EXP_LANES at a time. */
static void silu_mul_row(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t n) {
    int64_t i = 0;
    for (; i + EXP_LANES <= n; i += EXP_LANES) {
        const vexp x = load_lanes_bf16(g + i);
        vexp e = -x;
        exp_lanes(&e);
        store_lanes_bf16(o + i, rounded_lanes(x / (1.0f + e)) * load_lanes_bf16(u + i));
    }
    for (; i < n; i++) {
        const float x = widen_bf16(g[i]);
        o[i] = round_bf16(widen_bf16(round_bf16(x / (1.0f + expf(-x)))) * widen_bf16(u[i]));
    }
}

/* out[r] = bf16(bf16(silu(gate)) * up) where row r of gate_up holds the n gate values, then the n up values. */
void silu_mul_bf16(const uint16_t *gate_up, int64_t stride, uint16_t *out, int64_t out_stride, int64_t rows,
                   int64_t n, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows > 1 && rows * n >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) silu_mul_row(gate_up + r * stride, gate_up + r * stride + n,
                                                    out + r * out_stride, n);
}

/* The attention a bf16 model's few decode rows run in the fp32-row kernel, with its bf16 rows in and out: widened
 * into scratch, the fp32 kernel, the result rounded back. Two PyTorch conversions per call at a decode step cost more
 * than the conversions themselves. (The products' bf16 rows in and out are linear.c's linear_packed_bf16_io.) */
int paged_decode_attention_bf16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache, int64_t num_blocks,
                                const int64_t *block_table, int64_t table_stride, const int64_t *context_lens,
                                float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                int64_t block_size, float scale, int64_t num_threads);

int paged_decode_dp_supports(int64_t dim);
int paged_decode_attention_bf16_dp(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                   const uint16_t *v_cache, int64_t num_blocks, const int64_t *block_table,
                                   int64_t table_stride, const int64_t *context_lens, uint16_t *out,
                                   int64_t out_stride, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                   int64_t block_size, float scale, int64_t num_threads);

/* Decode attention of bf16 queries q [batch, heads, dim] (row stride q_stride; each row's heads contiguous) over a
 * bf16 cache into out [batch, heads, dim] bf16 (row stride out_stride). Returns the fp32 kernel's status, or -1
 * when scratch could not be allocated. */
int paged_decode_attention_bf16_io(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                   const uint16_t *v_cache, int64_t num_blocks, const int64_t *block_table,
                                   int64_t table_stride, const int64_t *context_lens, uint16_t *out,
                                   int64_t out_stride, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                   int64_t block_size, float scale, int64_t num_threads) {
    const int64_t row = heads * dim;
    if (batch <= 0) return 0;
    if (paged_decode_dp_supports(dim))
        return paged_decode_attention_bf16_dp(q, q_stride, k_cache, v_cache, num_blocks, block_table, table_stride,
                                              context_lens, out, out_stride, batch, heads, kv_heads, dim, block_size,
                                              scale, num_threads);
    float *qf = malloc(sizeof(float) * (size_t)(2 * batch * row));
    if (!qf) return -1;
    float *of = qf + batch * row;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t i = 0; i < row; i++) qf[b * row + i] = widen_bf16(q[b * q_stride + i]);
    const int status = paged_decode_attention_bf16(qf, k_cache, v_cache, num_blocks, block_table, table_stride,
                                                   context_lens, of, batch, heads, kv_heads, dim, block_size, scale,
                                                   num_threads);
    if (status == 0)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t i = 0; i < row; i++) out[b * out_stride + i] = round_bf16(of[b * row + i]);
    free(qf);
    return status;
}
