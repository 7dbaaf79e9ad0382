/* y = x · Wᵀ for few rows of x (decode steps of small batches), fp32 on CPU.
 *
 * With few rows a matrix product is a read of W: every weight is used once per row of x. Threads take bands
 * of W's rows and stream them once, four rows at a time, against every row of x (which stays in cache), so
 * the read runs near the memory's rate; the BLAS tuned for square products reads at about half of it here.
 */
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(v8f v) {
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += v[j];
    return s;
}

/* Rows [j, j + 4) of W against rows [m, m + rows) of x, rows <= 4. */
static inline void tile4(const float *x, const float *w, float *y, int64_t m, int64_t rows, int64_t j, int64_t k,
                         int64_t n) {
    const float *w0 = w + j * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    v8f acc[4][4] = {{{0}}};
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        const v8f a0 = load8(w0 + i), a1 = load8(w1 + i), a2 = load8(w2 + i), a3 = load8(w3 + i);
        for (int64_t r = 0; r < rows; r++) {
            const v8f b = load8(x + (m + r) * k + i);
            acc[r][0] += a0 * b;
            acc[r][1] += a1 * b;
            acc[r][2] += a2 * b;
            acc[r][3] += a3 * b;
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + (m + r) * k;
        float s0 = hsum(acc[r][0]), s1 = hsum(acc[r][1]), s2 = hsum(acc[r][2]), s3 = hsum(acc[r][3]);
        for (int64_t t = i; t < k; t++) {
            s0 += w0[t] * xr[t];
            s1 += w1[t] * xr[t];
            s2 += w2[t] * xr[t];
            s3 += w3[t] * xr[t];
        }
        float *yr = y + (m + r) * n + j;
        yr[0] = s0;
        yr[1] = s1;
        yr[2] = s2;
        yr[3] = s3;
    }
}

/* x [m, k], w [n, k], y [m, n]; all contiguous. */
void skinny_matmul(const float *x, const float *w, float *y, int64_t m, int64_t k, int64_t n, int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
    const int64_t tiles = n / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t r = 0; r < m; r += 4) tile4(x, w, y, r, m - r < 4 ? m - r : 4, t * 4, k, n);
    for (int64_t j = tiles * 4; j < n; j++) {
        const float *wj = w + j * k;
        for (int64_t r = 0; r < m; r++) {
            const float *xr = x + r * k;
            v8f acc = {0};
            int64_t i = 0;
            for (; i + 8 <= k; i += 8) acc += load8(wj + i) * load8(xr + i);
            float s = hsum(acc);
            for (; i < k; i++) s += wj[i] * xr[i];
            y[r * n + j] = s;
        }
    }
}
