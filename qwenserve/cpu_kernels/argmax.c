/* Argmax of every row of fp32 logits, as torch.argmax(dim=-1) chooses: the first index of the largest value,
 * and the first NaN where a row holds one (NaN counts as larger than anything).
 *
 * Greedy decoding takes one argmax per step over a vocabulary of ~150k; PyTorch's runs at a tenth of memory
 * speed (1.3 ms for 16 rows on one core here, an eighth of a small model's decode step). This reads each row
 * twice while it sits in L2: a vectorised max that also notes NaNs, then a search for the first index holding
 * that max, block by block so that the vectorised test skips blocks without it. */
#include <stdint.h>

#define BLOCK 64

static int64_t row_argmax(const float *x, int64_t n) {
    float m = x[0];
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        nan |= x[i] != x[i];
    }
    if (nan) {
        for (int64_t i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    }
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = start; i < end; i++) hit |= x[i] == m;
        if (hit) {
            for (int64_t i = start; i < end; i++)
                if (x[i] == m) return i;
        }
    }
    return 0; /* unreachable: m is one of the values */
}

/* x [rows, cols] with rows `row_stride` floats apart; out [rows]. cols >= 1. */
void argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out, int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * cols >= (1 << 20))
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * row_stride, cols);
}
