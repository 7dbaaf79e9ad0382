/* The screened LM head's candidates (models/screened_head.py, where the bound is derived): for each of m rows of x
 * [m, k] and its logits from the head's 8-bit codes, approx [m, n], the bound of column j
 *     b_j = a reach_j + c span_j,   a = |x|_1 (1 + 2^-10) 1.01,   c = k 2^-14 max|x| 1.01,
 * the `largest`-th largest lower bound L = (approx_j - b_j, the largest-th of all j) - d with d = 2^-20 max_j
 * |approx_j|, and every panel (PANEL columns) holding a column whose upper bound approx_j + b_j + d reaches L in any
 * row: their indices, ascending, in `panels`. At least `largest` columns lie at or above L in truth, so every column
 * that can be among a row's `largest` highest logits (or tie with the last of them) is in those panels. `out` [m, n],
 * where not NULL, is filled with -inf, for the caller to write the candidates' exact logits into. One C call instead
 * of PyTorch's ten vocabulary-sized passes and temporaries (~0.9 ms of a batch-1 step). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PANEL 16

static int descending(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* Into `mine` (ascending, `size` entries): `value` where it is above the smallest, which drops out. */
static void keep_if_larger(float *mine, int64_t size, float value) {
    if (!(value > mine[0])) return;
    int64_t i = 1;
    for (; i < size && mine[i] < value; i++) mine[i - 1] = mine[i];
    mine[i - 1] = value;
}

/* Row r's `largest`-th largest lower bound and largest |approx_j| (in *top): each thread keeps its `largest` highest
 * in `best` (threads x largest), then they are merged. */
static float lower_bound(const float *ar, int64_t n, const float *reach, const float *span, float a, float c,
                         int64_t largest, float *best, int threads, float *top) {
    float peak = 0.0f;
    for (int64_t i = 0; i < (int64_t)threads * largest; i++) best[i] = -INFINITY;
#pragma omp parallel num_threads(threads) reduction(max : peak)
    {
#ifdef _OPENMP
        float *mine = best + largest * (int64_t)omp_get_thread_num();
#else
        float *mine = best;
#endif
#pragma omp for
        for (int64_t j = 0; j < n; j++) {
            keep_if_larger(mine, largest, ar[j] - (a * reach[j] + c * span[j]));
            const float size = fabsf(ar[j]);
            peak = size > peak ? size : peak;
        }
    }
    qsort(best, (size_t)threads * (size_t)largest, sizeof(float), descending);
    *top = peak;
    return best[largest - 1];
}

/* Returns how many panels were written, or -1 where a value of x or of the bound is not finite or `largest` is not
 * in [1, n] (the caller then computes the whole head), -2 where scratch could not be had. */
int64_t head_screen(const float *x, int64_t m, int64_t k, const float *approx, int64_t n, const float *reach,
                    const float *span, float *out, uint8_t *marks, int64_t *panels, int64_t largest,
                    int64_t num_threads) {
    const int64_t num_panels = n / PANEL;
    const int threads = num_threads > 0 ? (int)num_threads : 1;
    if (largest < 1 || largest > n) return -1;
    float *best = 0;
    if (largest > 1 && !(best = malloc(sizeof(float) * (size_t)threads * (size_t)largest))) return -2;
    for (int64_t p = 0; p < num_panels; p++) marks[p] = 0;
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k, *ar = approx + r * n;
        float l1 = 0.0f, largest_x = 0.0f;
        for (int64_t i = 0; i < k; i++) {
            const float v = fabsf(xr[i]);
            l1 += v;
            largest_x = v > largest_x ? v : largest_x;
        }
        const float a = l1 * (1.0f + 0x1p-10f) * 1.01f, c = (float)k * 0x1p-14f * largest_x * 1.01f;
        float lower = -INFINITY, top = 0.0f;
        if (isfinite(a) && isfinite(c)) {
            if (best) {
                lower = lower_bound(ar, n, reach, span, a, c, largest, best, threads, &top);
            } else {
#pragma omp parallel for simd reduction(max : lower, top) num_threads(threads)
                for (int64_t j = 0; j < n; j++) {
                    const float below = ar[j] - (a * reach[j] + c * span[j]);
                    lower = below > lower ? below : lower;
                    const float size = fabsf(ar[j]);
                    top = size > top ? size : top;
                }
            }
        }
        if (!isfinite(a) || !isfinite(c) || !isfinite(lower) || !isfinite(top)) {
            free(best);
            return -1;
        }
        const float reached = lower - 2.0f * 0x1p-20f * top;
        float *outr = out ? out + r * n : 0;
#pragma omp parallel for num_threads(threads)
        for (int64_t p = 0; p < num_panels; p++) {
            int hit = 0;
            for (int64_t j = p * PANEL; j < (p + 1) * PANEL; j++) {
                hit |= ar[j] + (a * reach[j] + c * span[j]) >= reached;
                if (outr) outr[j] = -INFINITY;
            }
            marks[p] |= (uint8_t)hit;
        }
    }
    free(best);
    int64_t count = 0;
    for (int64_t p = 0; p < num_panels; p++)
        if (marks[p]) panels[count++] = p;
    return count;
}
