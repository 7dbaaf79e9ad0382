/* RMSNorm, fp32 on CPU: y = x / sqrt(mean(x²) + eps) * w, row by row.
 *
 * PyTorch spends six elementwise passes on it (pow, mean, add, rsqrt, two products), each a parallel region
 * with its own barrier; this is one parallel region and two passes over each row while it sits in L1. */
#include <math.h>
#include <stdint.h>

/* x and y [rows, dim], w [dim]; all contiguous (y may be x). */
void rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps, int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= 16384)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) sum += xr[i] * xr[i];
        const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) yr[i] = w[i] * (xr[i] * scale);
    }
}
