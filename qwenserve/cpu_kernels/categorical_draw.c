/* The sampler's draw over a whole vocabulary at a temperature (engine/sampler.py's path without top-k / top-p): per
 * row, weights w_i = exp((x_i - max) / T) (0 below min_p: the best token's weight is 1), and the index whose
 * cumulative weight first exceeds u x the row's total, as engine/categorical.py's draw: fp32 sums of blocks of
 * DRAW_BLOCK entries, their running total in fp64, then an fp64 running total inside the one block chosen.
 *
 * PyTorch's form makes four vocabulary-sized passes and two row-sized tensors per row (6.6 ms for 32 rows of 152k
 * on the AMX Xeon, single-threaded in parts); here a row is read twice (its maximum, then its block sums) and one
 * block a third time, rows spread over the threads. The weights are recomputed where the block is searched, by the
 * same code, so both levels see the same values. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vexp.h"

#define DRAW_BLOCK 128
#define EXP_FLOOR (-87.3365447505531f) /* below this exp_lanes clamps; the weight is taken as 0 there */

/* Weights of EXP_LANES logits at `x` (`valid` of them; the rest weigh 0); inv_t: 1 / the temperature. */
static inline vexp tempered(const float *x, int64_t valid, float top, float inv_t, float min_p) {
    vexp v;
    if (valid >= EXP_LANES) {
        memcpy(&v, x, sizeof v);
    } else {
        for (int i = 0; i < EXP_LANES; i++) v[i] = i < valid ? x[i] : -INFINITY;
    }
    v = (v - top) * inv_t; /* a multiply: a division of 16 lanes takes as long as the rest together */
    const vexpi gone = (vexpi)(v < EXP_FLOOR);
    exp_lanes(&v);
    const vexpi kept = ~gone & (vexpi)(v >= min_p);
    return (vexp)((vexpi)v & kept);
}

/* The fp32 sum of the weights of entries [start, end) (at most DRAW_BLOCK of them). */
static inline float block_sum(const float *x, int64_t start, int64_t end, float top, float inv_t, float min_p) {
    vexp acc = {0.0f};
    for (int64_t j = start; j < end; j += EXP_LANES) acc += tempered(x + j, end - j, top, inv_t, min_p);
    float s = 0.0f;
    for (int i = 0; i < EXP_LANES; i++) s += acc[i];
    return s;
}

/* One row: the chosen index, or -1 when no entry has weight (no finite logit). `ends`: scratch of blocks doubles. */
static int64_t draw_row(const float *x, int64_t n, float t, float min_p, double u, double *ends) {
    const float inv_t = 1.0f / t;
    float top = -INFINITY;
    {
        vexp best = {0.0f};
        best -= INFINITY;
        int64_t j = 0;
        for (; j + EXP_LANES <= n; j += EXP_LANES) {
            vexp v;
            memcpy(&v, x + j, sizeof v);
            best = (vexp)(((vexpi)best & (vexpi)(best >= v)) | ((vexpi)v & ~(vexpi)(best >= v)));
        }
        for (int i = 0; i < EXP_LANES; i++) top = best[i] > top ? best[i] : top;
        for (; j < n; j++) top = x[j] > top ? x[j] : top;
    }
    if (!(top > -INFINITY) || isnan(top)) return -1;
    const int64_t blocks = (n + DRAW_BLOCK - 1) / DRAW_BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * DRAW_BLOCK < n ? (b + 1) * DRAW_BLOCK : n;
        total += (double)block_sum(x, b * DRAW_BLOCK, end, top, inv_t, min_p);
        ends[b] = total;
    }
    const double target = u * total;
    int64_t lo = 0, hi = blocks - 1; /* the first block whose running end exceeds the target (the last if none) */
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (ends[mid] > target) hi = mid; else lo = mid + 1;
    }
    const double before = lo > 0 ? ends[lo - 1] : 0.0;
    const int64_t start = lo * DRAW_BLOCK, end = start + DRAW_BLOCK < n ? start + DRAW_BLOCK : n;
    float w[DRAW_BLOCK] __attribute__((aligned(64))) = {0.0f};
    for (int64_t j = start; j < end; j += EXP_LANES) {
        const vexp v = tempered(x + j, end - j, top, inv_t, min_p);
        memcpy(w + (j - start), &v, sizeof v);
    }
    double running = before;
    int64_t chosen = end - 1;
    for (int64_t j = start; j < end; j++) {
        running += (double)w[j - start];
        if (running > target) {
            chosen = j;
            break;
        }
    }
    if (w[chosen - start] > 0.0f) return chosen;
    /* The two levels' sums of one block differ in their last bits: a target past the block's own total lands on
     * its last entry, which may weigh nothing. The nearest entry below with weight instead (rare), else the first. */
    for (int64_t j = chosen; j >= start; j--)
        if (w[j - start] > 0.0f) return j;
    for (int64_t b = lo - 1; b >= 0; b--) {
        const int64_t bend = (b + 1) * DRAW_BLOCK;
        for (int64_t j = bend - 1; j >= b * DRAW_BLOCK; j--) {
            const vexp v = tempered(x + j, 1, top, inv_t, min_p);
            if (v[0] > 0.0f) return j;
        }
    }
    for (int64_t j = end; j < n; j++) {
        const vexp v = tempered(x + j, 1, top, inv_t, min_p);
        if (v[0] > 0.0f) return j;
    }
    return -1;
}

/* chosen[r] for each of `rows` rows of logits (fp32, row r at logits + r * stride, n entries) at temps[r] > 0 with
 * min_p[r] and the uniform number uniforms[r] in [0, 1); -1 for a row without a finite logit. Returns 0, or -1 when
 * scratch cannot be allocated. */
int draw_tempered(const float *logits, int64_t stride, int64_t rows, int64_t n, const float *temps,
                  const float *min_p, const double *uniforms, int64_t *chosen, int64_t num_threads) {
    const int64_t blocks = (n + DRAW_BLOCK - 1) / DRAW_BLOCK;
    int failed = 0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) if (rows > 1)
    {
        double *ends = malloc((size_t)(blocks > 0 ? blocks : 1) * sizeof(double));
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            if (ends == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            chosen[r] = draw_row(logits + r * stride, n, temps[r], min_p[r], uniforms[r], ends);
        }
        free(ends);
    }
    return failed ? -1 : 0;
}

/* The index of the first largest entry of a row, as torch.argmax (a NaN counts as the largest: the first NaN), in one
 * pass: each lane keeps its largest value and where it first saw it, then the lanes holding the row's largest give
 * the smallest index. A greedy row's token: PyTorch's two-level form took ~0.24 ms on a 152k row fresh from the LM
 * head in a batch-1 decode step on the AMX Xeon (~1% of a W4A16 step). */
static int64_t argmax_row(const float *x, int64_t n) {
    vexp best = {0.0f};
    best -= INFINITY;
    vexpi at, idx, nan = {0};
    for (int i = 0; i < EXP_LANES; i++) at[i] = idx[i] = i;
    int64_t j = 0;
    for (; j + EXP_LANES <= n; j += EXP_LANES) {
        vexp v;
        memcpy(&v, x + j, sizeof v);
        nan |= (vexpi)(v != v);
        const vexpi above = (vexpi)(v > best);
        best = (vexp)(((vexpi)v & above) | ((vexpi)best & ~above));
        at = (idx & above) | (at & ~above);
        idx += EXP_LANES;
    }
    int found = 0;
    for (int i = 0; i < EXP_LANES; i++) found |= nan[i];
    for (int64_t t = j; t < n; t++) found |= x[t] != x[t];
    if (found) {
        for (int64_t t = 0; t < n; t++)
            if (x[t] != x[t]) return t;
    }
    float top = -INFINITY;
    int64_t chosen = 0;
    if (j > 0) {
        for (int i = 0; i < EXP_LANES; i++) top = best[i] > top ? best[i] : top;
        chosen = j;
        for (int i = 0; i < EXP_LANES; i++)
            if (best[i] == top && at[i] < chosen) chosen = at[i];
    }
    for (; j < n; j++)
        if (x[j] > top || (j == 0 && n > 0)) top = x[j], chosen = j;
    return chosen;
}

/* chosen[r] = argmax_row of each of `rows` rows of logits (fp32, row r at logits + r * stride, n > 0 entries). */
void argmax_rows(const float *logits, int64_t stride, int64_t rows, int64_t n, int64_t *chosen, int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) chosen[r] = argmax_row(logits + r * stride, n);
}
