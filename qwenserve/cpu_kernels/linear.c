/* y = x · Wᵀ (a linear layer without bias) on CPU, x and y fp32, against W packed in panels of fp32 or bf16.
 *
 * PackedWeight.pack stores W [n, k] as [n / 16][k][16]: panel q holds, for every column i of x, the 16 weights of
 * output columns 16q..16q+15 side by side. A tile then keeps rows of x × panels of y in accumulators and,
 * at each i, broadcasts x[r][i] against whole panel vectors: no horizontal sums, y stored a vector at a
 * time, and both FMA pipes full at the CPU's widest vectors (bench/kernels_bench.py measures it against
 * PyTorch's BLAS).
 *
 * bf16 panels (linear_packed_bf16) halve the bytes a decode step streams; each panel vector is widened to fp32 in
 * registers (a bf16 is the high half of an fp32) and the arithmetic is the fp32 kernel's, so the result is the
 * fp32 product of the bf16 weights up to summation order. Many rows (a prompt's chunk, a large batch) widen each
 * thread's group of panels once and multiply the rest in fp32 (widened_product). The tiles are written once, in
 * linear_tiles.h. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec8.h"

/* Pins a value to a register. Left alone, GCC folds the W loads into every multiply-add (memory operands),
 * and each x vector once per row of W: sixteen loads per sixteen FMAs instead of eight, load-bound. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX__) /* without AVX no register holds 32 bytes */
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) (void)0
#endif

#define PANEL 16
#if defined(__AVX512F__)
#define PLANES 16
#elif defined(__AVX__)
#define PLANES 8
#else
#define PLANES 4
#endif
typedef float vecp __attribute__((vector_size(PLANES * 4)));
#define PER_PANEL (PANEL / PLANES)
/* 24 accumulators (6 rows x 4 vectors) where 32 registers exist, 12 (6 x 2) on 16-register AVX2. */
#if (defined(__AVX512F__) || defined(__aarch64__)) && PER_PANEL <= 4
#define TILE_PANELS (4 / PER_PANEL)
#else
#define TILE_PANELS 1
#endif
#define TILE_ROWS 6
#define TILE_VECS (TILE_PANELS * PER_PANEL)

static inline vecp loadp(const float *p) {
    vecp v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* An initializer, which GCC turns into one broadcast (a loop over lanes became sixteen masked inserts). */
#define S4(s) s, s, s, s
#if PLANES == 16
#define SPLAT(s) ((vecp){S4(s), S4(s), S4(s), S4(s)})
#elif PLANES == 8
#define SPLAT(s) ((vecp){S4(s), S4(s)})
#else
#define SPLAT(s) ((vecp){S4(s)})
#endif

/* Pins a panel vector to a register, as IN_REGISTER; "v" admits all 32 AVX-512 registers. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX512F__)
#define PANEL_IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define PANEL_IN_REGISTER(v) IN_REGISTER(v)
#endif

/* A bf16 is the upper 16 bits of an fp32: widening is a zero-extension to 32 bits and a shift. On x86 the
 * intrinsics give one vpmovzxwd and one vpslld; the portable form below made GCC split a 512-bit widening in
 * halves (five instructions). */
#if defined(__AVX512F__) && PLANES == 16
#include <immintrin.h>
static inline vecp loadp_bf16(const uint16_t *p) {
    const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    return (vecp)_mm512_castsi512_ps(u);
}
#elif defined(__AVX2__) && PLANES == 8
#include <immintrin.h>
static inline vecp loadp_bf16(const uint16_t *p) {
    const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return (vecp)_mm256_castsi256_ps(u);
}
#else
typedef uint16_t vech __attribute__((vector_size(PLANES * 2)));
typedef uint32_t vecu __attribute__((vector_size(PLANES * 4)));
static inline vecp loadp_bf16(const uint16_t *p) {
    vech h;
    memcpy(&h, p, sizeof h);
    const vecu u = __builtin_convertvector(h, vecu) << 16;
    vecp v;
    memcpy(&v, &u, sizeof v);
    return v;
}
#endif

#if TILE_PANELS == 4
/* Few rows of x (m <= 16) against short panels (k <= 512, so an fp32 panel stays in L1): each panel is streamed
 * from memory once, for up to 12 rows at a time (passes over the same panel hit L1), with a software prefetch
 * 16 KiB ahead, since the 6-row tiles left the memory idle while they computed on cached panels. bf16 panels keep
 * the same k bound: at k = 1024 the 4-panel tiles read them from memory faster (0.53 against 0.62 ms for a
 * 1024x3072 layer at one row). */
#define TALL_ROWS 12
#define TALL_MAX_M 16
#define TALL_MAX_K 512
#define TALL_PREFETCH_BYTES (16 * 1024)
#else
#define TALL_MAX_M 0
#define TALL_MAX_K 0
#endif
#define GROUP_BYTES (256 * 1024) /* a thread's group of panels, sized for L2 */
#if TILE_PANELS == 4
/* 7 to 15 rows (a decode step's middling batch) in one pass of up to 12 rows over 2 panels, or two of 7-8 rows,
 * instead of passes of 6 rows over 4 panels: each panel vector is read and widened once for 12 rows instead of 6, and
 * the weights come from memory once. */
#define DEEP_ROWS 12
#define DEEP_PANELS 2
#define DEEP_MIN_M 7
#define ACC_ROWS DEEP_ROWS
#else
#define DEEP_ROWS 0
#define ACC_ROWS TILE_ROWS
#endif

#define WEIGHT float
#define LOAD_PANEL(p) loadp(p)
#define TILED(name) name
#include "linear_tiles.h"
#undef WEIGHT
#undef LOAD_PANEL
#undef TILED

#define WEIGHT uint16_t
#define LOAD_PANEL(p) loadp_bf16(p)
#define TILED(name) name##_bf16
#include "linear_tiles.h"
#undef WEIGHT
#undef LOAD_PANEL
#undef TILED

/* y [m, n] = x [m, k] times fp32 panels; x, y contiguous. */
void linear_packed(const float *x, const float *wp, float *y, int64_t m, int64_t k, int64_t n, int64_t num_threads) {
    panels_product(x, wp, y, m, k, n, num_threads);
}

/* From this many rows up, a thread widens its group of bf16 panels into fp32 once, during its first tile of rows,
 * and runs the fp32 tiles over the rest: the bf16 tiles widen each panel vector at every pass of six rows, two
 * shuffle/shift instructions per four FMAs on the FMA ports, which held prefill products at ~75% of the fp32
 * kernel's rate on an AVX-512 Xeon without AMX. Measured there (alternating in one process): the 0.6B shape's four
 * layer products 0.75-0.8x the bf16 tiles' time at 512-1280 rows; its 112 products read from memory 0.97x at 16
 * rows, 0.88x at 20, 1.09x at 12 (two passes), so fewer rows keep the bf16 tiles. */
#define WIDEN_GROUP_MIN_ROWS 16

typedef uint32_t vecpu __attribute__((vector_size(PLANES * 4)));
typedef uint16_t vecph __attribute__((vector_size(PLANES * 2)));

/* PLANES fp32 values stored at p as bf16: nearest even, NaN kept a quiet NaN (PyTorch's conversion). */
static inline void store_bf16(uint16_t *p, vecp v) {
    vecpu u;
    memcpy(&u, &v, sizeof u);
    const vecpu nan = (vecpu)((u & 0x7fffffffu) > 0x7f800000u);
    u = (nan & (u | 0x400000u)) | (~nan & (u + 0x7fffu + ((u >> 16) & 1u)));
    const vecph h = __builtin_convertvector(u >> 16, vecph);
    memcpy(p, &h, sizeof h);
}

/* Panels [q_lo, q_hi) of bf16 wp for all m rows of xf, through `wide` (the group widened to fp32, each tile's panels
 * interleaved):
 * into fp32 y (rows n apart) or, when yb is set, through `stage` (TILE_ROWS rows of the group's columns) rounded
 * into bf16 yb (rows n apart). */
static void widened_group(const float *xf, const uint16_t *wp, float *wide, float *stage, float *y, uint16_t *yb,
                          int64_t m, int64_t k, int64_t n, int64_t q_lo, int64_t q_hi) {
    const int64_t cols = (q_hi - q_lo) * PANEL;
    for (int64_t m0 = 0; m0 < m; m0 += TILE_ROWS) {
        const int rows = m - m0 >= TILE_ROWS ? TILE_ROWS : (int)(m - m0);
        float *out = yb ? stage : y + m0 * n + q_lo * PANEL;
        const int64_t out_stride = yb ? cols : n;
        for (int64_t q = q_lo; q < q_hi; q += TILE_PANELS) {
            const int panels = q_hi - q >= TILE_PANELS ? TILE_PANELS : (int)(q_hi - q);
            float *kept = wide + (q - q_lo) * k * PANEL;
            /* The first rows read the bf16 panels from memory (the tile's prefetch hides it) and keep them widened,
             * the tile's panels interleaved. */
            if (m0 == 0)
                any_panel_tile_bf16(xf, wp + q * k * PANEL, k * PANEL, PANEL, out + (q - q_lo) * PANEL, k, out_stride,
                                    rows, panels, kept);
            else
                any_panel_tile(xf + m0 * k, kept, PANEL, panels * PANEL, out + (q - q_lo) * PANEL, k, out_stride, rows,
                               panels, NULL);
        }
        if (yb)
            for (int r = 0; r < rows; r++)
                for (int64_t c = 0; c < cols; c += PLANES)
                    store_bf16(yb + (m0 + r) * n + q_lo * PANEL + c, loadp(stage + r * cols + c));
    }
}

/* The many-row product against bf16 panels: x fp32 (xf, contiguous) or bf16 (xb, rows xb_stride apart, widened
 * here in parallel), y fp32 or bf16 (yb). Threads take groups of panels as panels_product does. Returns -1 when
 * scratch could not be allocated (y untouched). */
static int widened_product(const float *xf, const uint16_t *xb, int64_t xb_stride, const uint16_t *wp, float *y,
                           uint16_t *yb, int64_t m, int64_t k, int64_t n, int64_t num_threads) {
    const int64_t panels = n / PANEL;
    int64_t group = GROUP_BYTES / (k * PANEL * (int64_t)sizeof(uint16_t));
    group = group < TILE_PANELS ? TILE_PANELS : group - group % TILE_PANELS;
    const int64_t groups = (panels + group - 1) / group;
    if (num_threads > groups) num_threads = groups;
    const size_t per_thread = (size_t)(group * k * PANEL + TILE_ROWS * group * PANEL);
    float *x_wide = xb ? malloc(sizeof(float) * (size_t)(m * k)) : NULL;
    float *scratch = malloc(sizeof(float) * per_thread * (size_t)num_threads);
    if (!scratch || (xb && !x_wide)) {
        free(x_wide);
        free(scratch);
        return -1;
    }
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
        float *mine = scratch + per_thread * (size_t)omp_get_thread_num();
#else
        float *mine = scratch;
#endif
        if (xb) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++)
                for (int64_t i = 0; i < k; i++) x_wide[r * k + i] = widen_bf16(xb[r * xb_stride + i]);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t q_lo = g * group, q_hi = q_lo + group < panels ? q_lo + group : panels;
            widened_group(xb ? x_wide : xf, wp, mine, mine + group * k * PANEL, y, yb, m, k, n, q_lo, q_hi);
        }
    }
    free(x_wide);
    free(scratch);
    return 0;
}

/* y [m, n] = x [m, k] times bf16 panels, x and y fp32 and contiguous: the fp32 product of the bf16 weights. */
void linear_packed_bf16(const float *x, const uint16_t *wp, float *y, int64_t m, int64_t k, int64_t n,
                        int64_t num_threads) {
    if (m < WIDEN_GROUP_MIN_ROWS || widened_product(x, NULL, 0, wp, y, NULL, m, k, n, num_threads) != 0)
        panels_product_bf16(x, wp, y, m, k, n, num_threads);
}

/* y [m, n] bf16 = x [m, k] bf16 (row stride x_stride) times the bf16 panels, rounded once. Few rows are widened
 * into scratch for the fp32-row product and rounded back (a decode step's few values); many rows go through
 * widened_product, which widens and rounds in its threads. Returns -1 when scratch could not be allocated (y
 * untouched). */
int linear_packed_bf16_io(const uint16_t *x, int64_t x_stride, const uint16_t *wp, uint16_t *y, int64_t m,
                          int64_t k, int64_t n, int64_t num_threads) {
    if (m <= 0) return 0;
    if (num_threads < 1) num_threads = 1;
    if (m >= WIDEN_GROUP_MIN_ROWS) return widened_product(NULL, x, x_stride, wp, NULL, y, m, k, n, num_threads);
    float *xf = malloc(sizeof(float) * (size_t)(m * k + m * n));
    if (!xf) return -1;
    float *yf = xf + m * k;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++) xf[r * k + i] = widen_bf16(x[r * x_stride + i]);
    panels_product_bf16(xf, wp, yf, m, k, n, num_threads);
    for (int64_t i = 0; i < m * n; i++) y[i] = round_bf16(yf[i]);
    free(xf);
    return 0;
}
