/* y = x · Wᵀ (a linear layer without bias), fp32 on CPU.
 *
 * Threads take bands of W's rows and stream them once, four rows at a time, against every row of x (which
 * stays in cache), accumulating a register tile of x rows × W rows. With few rows (decode) the product is a
 * read of W, and this reads at the memory's rate where the BLAS read at half of it; with many (prefill) the
 * tile keeps both FMA pipes busy. Measured here against PyTorch's BLAS on the Qwen3-0.6B layer shapes:
 * 1.4-2.2x at 1-28 rows, 1.1-1.3x at 64-512.
 */
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Pins a value to a register. Left alone, GCC folds the W loads into every multiply-add (memory operands),
 * and each x vector once per row of W: sixteen loads per sixteen FMAs instead of eight, load-bound. */
#if defined(__x86_64__) || defined(__i386__)
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) (void)0
#endif

static inline float hsum(v8f v) {
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += v[j];
    return s;
}

/* Rows [j, j + 4) of W against rows [m, m + 4) of x: sixteen accumulators, named so they stay in registers. */
static void tile_4x4(const float *x, const float *w, float *y, int64_t m, int64_t j, int64_t k, int64_t n) {
    const float *w0 = w + j * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    const float *x0 = x + m * k, *x1 = x0 + k, *x2 = x1 + k, *x3 = x2 + k;
    v8f c00 = {0}, c01 = {0}, c02 = {0}, c03 = {0}, c10 = {0}, c11 = {0}, c12 = {0}, c13 = {0};
    v8f c20 = {0}, c21 = {0}, c22 = {0}, c23 = {0}, c30 = {0}, c31 = {0}, c32 = {0}, c33 = {0};
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        v8f a0 = load8(w0 + i), a1 = load8(w1 + i), a2 = load8(w2 + i), a3 = load8(w3 + i);
        IN_REGISTER(a0);
        IN_REGISTER(a1);
        IN_REGISTER(a2);
        IN_REGISTER(a3);
        v8f b = load8(x0 + i);
        IN_REGISTER(b);
        c00 += a0 * b, c01 += a1 * b, c02 += a2 * b, c03 += a3 * b;
        b = load8(x1 + i);
        IN_REGISTER(b);
        c10 += a0 * b, c11 += a1 * b, c12 += a2 * b, c13 += a3 * b;
        b = load8(x2 + i);
        IN_REGISTER(b);
        c20 += a0 * b, c21 += a1 * b, c22 += a2 * b, c23 += a3 * b;
        b = load8(x3 + i);
        IN_REGISTER(b);
        c30 += a0 * b, c31 += a1 * b, c32 += a2 * b, c33 += a3 * b;
    }
    const v8f acc[4][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23}, {c30, c31, c32, c33}};
    const float *xs[4] = {x0, x1, x2, x3}, *ws[4] = {w0, w1, w2, w3};
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) {
            float sum = hsum(acc[r][c]);
            for (int64_t t = i; t < k; t++) sum += ws[c][t] * xs[r][t];
            y[(m + r) * n + j + c] = sum;
        }
}

/* Rows [j, j + 4) of W against rows [m, m + 6) of x: 24 accumulators, for CPUs with 32 vector registers. */
static void tile_4x6(const float *x, const float *w, float *y, int64_t m, int64_t j, int64_t k, int64_t n) {
    const float *w0 = w + j * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    const float *x0 = x + m * k, *x1 = x0 + k, *x2 = x1 + k, *x3 = x2 + k, *x4 = x3 + k, *x5 = x4 + k;
    v8f c00 = {0}, c01 = {0}, c02 = {0}, c03 = {0}, c10 = {0}, c11 = {0}, c12 = {0}, c13 = {0};
    v8f c20 = {0}, c21 = {0}, c22 = {0}, c23 = {0}, c30 = {0}, c31 = {0}, c32 = {0}, c33 = {0};
    v8f c40 = {0}, c41 = {0}, c42 = {0}, c43 = {0}, c50 = {0}, c51 = {0}, c52 = {0}, c53 = {0};
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        v8f a0 = load8(w0 + i), a1 = load8(w1 + i), a2 = load8(w2 + i), a3 = load8(w3 + i);
        IN_REGISTER(a0);
        IN_REGISTER(a1);
        IN_REGISTER(a2);
        IN_REGISTER(a3);
        v8f b = load8(x0 + i);
        IN_REGISTER(b);
        c00 += a0 * b, c01 += a1 * b, c02 += a2 * b, c03 += a3 * b;
        b = load8(x1 + i);
        IN_REGISTER(b);
        c10 += a0 * b, c11 += a1 * b, c12 += a2 * b, c13 += a3 * b;
        b = load8(x2 + i);
        IN_REGISTER(b);
        c20 += a0 * b, c21 += a1 * b, c22 += a2 * b, c23 += a3 * b;
        b = load8(x3 + i);
        IN_REGISTER(b);
        c30 += a0 * b, c31 += a1 * b, c32 += a2 * b, c33 += a3 * b;
        b = load8(x4 + i);
        IN_REGISTER(b);
        c40 += a0 * b, c41 += a1 * b, c42 += a2 * b, c43 += a3 * b;
        b = load8(x5 + i);
        IN_REGISTER(b);
        c50 += a0 * b, c51 += a1 * b, c52 += a2 * b, c53 += a3 * b;
    }
    const v8f acc[6][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23},
                           {c30, c31, c32, c33}, {c40, c41, c42, c43}, {c50, c51, c52, c53}};
    const float *xs[6] = {x0, x1, x2, x3, x4, x5}, *ws[4] = {w0, w1, w2, w3};
    for (int r = 0; r < 6; r++)
        for (int c = 0; c < 4; c++) {
            float sum = hsum(acc[r][c]);
            for (int64_t t = i; t < k; t++) sum += ws[c][t] * xs[r][t];
            y[(m + r) * n + j + c] = sum;
        }
}

/* Rows [j, j + 4) of W against rows [m, m + 2) of x: the tile for CPUs with 16 vector registers. */
static void tile_4x2(const float *x, const float *w, float *y, int64_t m, int64_t j, int64_t k, int64_t n) {
    const float *w0 = w + j * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    const float *x0 = x + m * k, *x1 = x0 + k;
    v8f c00 = {0}, c01 = {0}, c02 = {0}, c03 = {0}, c10 = {0}, c11 = {0}, c12 = {0}, c13 = {0};
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        v8f a0 = load8(w0 + i), a1 = load8(w1 + i), a2 = load8(w2 + i), a3 = load8(w3 + i);
        IN_REGISTER(a0);
        IN_REGISTER(a1);
        IN_REGISTER(a2);
        IN_REGISTER(a3);
        v8f b = load8(x0 + i);
        IN_REGISTER(b);
        c00 += a0 * b, c01 += a1 * b, c02 += a2 * b, c03 += a3 * b;
        b = load8(x1 + i);
        IN_REGISTER(b);
        c10 += a0 * b, c11 += a1 * b, c12 += a2 * b, c13 += a3 * b;
    }
    const v8f acc[2][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}};
    const float *xs[2] = {x0, x1}, *ws[4] = {w0, w1, w2, w3};
    for (int r = 0; r < 2; r++)
        for (int c = 0; c < 4; c++) {
            float sum = hsum(acc[r][c]);
            for (int64_t t = i; t < k; t++) sum += ws[c][t] * xs[r][t];
            y[(m + r) * n + j + c] = sum;
        }
}

/* Rows [j, j + 4) of W against row m of x. */
static void tile_4x1(const float *x, const float *w, float *y, int64_t m, int64_t j, int64_t k, int64_t n) {
    const float *w0 = w + j * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k, *x0 = x + m * k;
    v8f c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        const v8f b = load8(x0 + i);
        c0 += load8(w0 + i) * b, c1 += load8(w1 + i) * b, c2 += load8(w2 + i) * b, c3 += load8(w3 + i) * b;
    }
    const v8f acc[4] = {c0, c1, c2, c3};
    const float *ws[4] = {w0, w1, w2, w3};
    for (int c = 0; c < 4; c++) {
        float sum = hsum(acc[c]);
        for (int64_t t = i; t < k; t++) sum += ws[c][t] * x0[t];
        y[m * n + j + c] = sum;
    }
}

/* x [m, k], w [n, k], y [m, n]; all contiguous. */
void linear_nt(const float *x, const float *w, float *y, int64_t m, int64_t k, int64_t n, int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
    const int64_t tiles = n / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++)
    {
        int64_t r = 0;
#if defined(__AVX512VL__) || defined(__aarch64__)
        /* 32 vector registers: room for 24 accumulators with the W and x vectors beside them. */
        for (; r + 6 <= m; r += 6) tile_4x6(x, w, y, r, t * 4, k, n);
        for (; r + 4 <= m; r += 4) tile_4x4(x, w, y, r, t * 4, k, n);
#else
        for (; r + 2 <= m; r += 2) tile_4x2(x, w, y, r, t * 4, k, n);
#endif
        for (; r < m; r++) tile_4x1(x, w, y, r, t * 4, k, n);
    }
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
