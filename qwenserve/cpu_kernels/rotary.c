/* Rotary position embedding, fp32 on CPU, in the half-split convention of Qwen checkpoints:
 * y[:h] = x[:h]·cos[:h] - x[h:]·sin[:h],  y[h:] = x[h:]·cos[h:] + x[:h]·sin[h:]  (h = dim / 2).
 *
 * PyTorch spends five passes on it (slice, negate, concatenate, two products and a sum); this is one. Products
 * and sums are rounded separately, as PyTorch rounds them (no fused multiply-add), so results are equal. */
#include <stdint.h>

/* x [tokens, heads, dim] with strides (token_stride, head_stride, 1); cos and sin [tokens, dim] contiguous;
 * y [tokens, heads, dim] contiguous. */
__attribute__((optimize("fp-contract=off"))) void rotary(const float *x, const float *cos, const float *sin,
                                                           float *y, int64_t tokens, int64_t heads, int64_t dim,
                                                           int64_t token_stride, int64_t head_stride,
                                                           int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * dim >= 32768)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + t * token_stride + h * head_stride;
            float *yr = y + (t * heads + h) * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = xr[i] * c[i], b = xr[i + half] * s[i];
                yr[i] = a - b;
            }
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = xr[i + half] * c[i + half], b = xr[i] * s[i + half];
                yr[i + half] = a + b;
            }
        }
    }
}
