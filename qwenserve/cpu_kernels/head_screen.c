/* The screened LM head's candidates (models/screened_head.py, where the bound is derived): for each of m rows of x
 * [m, k] and its logits from the head's 8-bit codes, approx [m, n], the bound of column j
 *     b_j = a reach_j + c span_j,   a = |x|_1 (1 + 2^-10) 1.01,   c = k 2^-14 max|x| 1.01,
 * the best lower bound L = max_j (approx_j - b_j) - d with d = 2^-20 max_j |approx_j|, and every panel (PANEL
 * columns) holding a column whose upper bound approx_j + b_j + d reaches L in any row: their indices, ascending, in
 * `panels`. `out` [m, n], where not NULL, is filled with -inf, for the caller to write the candidates' exact logits
 * into. One C call instead of PyTorch's ten vocabulary-sized passes and temporaries (~0.9 ms of a batch-1 step). */
#include <math.h>
#include <stdint.h>

#define PANEL 16

/* Returns how many panels were written, or -1 where a value of x or of the bound is not finite (the caller then
 * computes the whole head). */
int64_t head_screen(const float *x, int64_t m, int64_t k, const float *approx, int64_t n, const float *reach,
                    const float *span, float *out, uint8_t *marks, int64_t *panels, int64_t num_threads) {
    const int64_t num_panels = n / PANEL;
    for (int64_t p = 0; p < num_panels; p++) marks[p] = 0;
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k, *ar = approx + r * n;
        float l1 = 0.0f, largest = 0.0f;
        for (int64_t i = 0; i < k; i++) {
            const float v = fabsf(xr[i]);
            l1 += v;
            largest = v > largest ? v : largest;
        }
        const float a = l1 * (1.0f + 0x1p-10f) * 1.01f, c = (float)k * 0x1p-14f * largest * 1.01f;
        if (!isfinite(a) || !isfinite(c)) return -1;
        float lower = -INFINITY, top = 0.0f;
#pragma omp parallel for simd reduction(max : lower, top) num_threads(num_threads > 0 ? num_threads : 1)
        for (int64_t j = 0; j < n; j++) {
            const float below = ar[j] - (a * reach[j] + c * span[j]);
            lower = below > lower ? below : lower;
            const float size = fabsf(ar[j]);
            top = size > top ? size : top;
        }
        if (!isfinite(lower) || !isfinite(top)) return -1;
        const float reached = lower - 2.0f * 0x1p-20f * top;
        float *outr = out ? out + r * n : 0;
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1)
        for (int64_t p = 0; p < num_panels; p++) {
            int hit = 0;
            for (int64_t j = p * PANEL; j < (p + 1) * PANEL; j++) {
                hit |= ar[j] + (a * reach[j] + c * span[j]) >= reached;
                if (outr) outr[j] = -INFINITY;
            }
            marks[p] |= (uint8_t)hit;
        }
    }
    int64_t count = 0;
    for (int64_t p = 0; p < num_panels; p++)
        if (marks[p]) panels[count++] = p;
    return count;
}
