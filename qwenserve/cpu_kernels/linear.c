/* y = x · Wᵀ (a linear layer without bias), fp32 on CPU, against W packed in panels.
 *
 * PackedWeight.pack stores W [n, k] as [n / 16][k][16]: panel q holds, for every column i of x, the 16 weights of
 * output columns 16q..16q+15 side by side. A tile then keeps rows of x × panels of y in accumulators and,
 * at each i, broadcasts x[r][i] against whole panel vectors: no horizontal sums, y stored a vector at a
 * time, and both FMA pipes full at the CPU's widest vectors (bench/kernels_bench.py measures it against
 * PyTorch's BLAS). */

#include <stdint.h>
#include <string.h>

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

/* Rows [m0, m0 + rows) of x against panels [q, q + panels) of wp, over all k; constant rows and panels
 * (always inlined into a switch) let the accumulators live in registers. */
static inline __attribute__((always_inline)) void panel_tile(const float *x, const float *wp, float *y, int64_t k,
                                                             int64_t n, int64_t m0, int64_t q, const int rows,
                                                             const int panels) {
    const int vecs = panels * PER_PANEL;
    vecp acc[TILE_ROWS][TILE_VECS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) acc[r][v] = SPLAT(0.0f);
    const float *xr = x + m0 * k, *wq = wp + q * k * PANEL;
    for (int64_t i = 0; i < k; i++) {
        vecp b[TILE_VECS];
        for (int v = 0; v < vecs; v++) {
            b[v] = loadp(wq + (v / PER_PANEL) * k * PANEL + i * PANEL + (v % PER_PANEL) * PLANES);
            PANEL_IN_REGISTER(b[v]);
        }
        for (int r = 0; r < rows; r++) {
            const float s = xr[r * k + i];
            const vecp a = SPLAT(s);
            for (int v = 0; v < vecs; v++) acc[r][v] += a * b[v];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) memcpy(y + (m0 + r) * n + q * PANEL + v * PLANES, &acc[r][v], sizeof(vecp));
}

#define PANEL_TILE(r, p) panel_tile(x, wp, y, k, n, m0, q, r, p)
#define TILE_OF_ROWS(p)                                                                                     \
    switch (rows) {                                                                                         \
    case 6: PANEL_TILE(6, p); break;                                                                        \
    case 5: PANEL_TILE(5, p); break;                                                                        \
    case 4: PANEL_TILE(4, p); break;                                                                        \
    case 3: PANEL_TILE(3, p); break;                                                                        \
    case 2: PANEL_TILE(2, p); break;                                                                        \
    default: PANEL_TILE(1, p); break;                                                                       \
    }

static void any_panel_tile(const float *x, const float *wp, float *y, int64_t k, int64_t n, int64_t m0, int64_t q,
                           int rows, int panels) {
#if TILE_PANELS == 4
    if (panels >= 4) { TILE_OF_ROWS(4) }
    else if (panels == 3) { TILE_OF_ROWS(3) }
    else if (panels == 2) { TILE_OF_ROWS(2) }
    else { TILE_OF_ROWS(1) }
#else
    (void)panels;
    TILE_OF_ROWS(1)
#endif
}

#if TILE_PANELS == 4
/* Few rows of x (m <= 16) against short panels (k <= 512, so a panel stays in L1): each panel is streamed from
 * memory once, for up to 12 rows at a time (passes over the same panel hit L1), with a software prefetch 16 KiB
 * ahead, since the 6-row tiles left the memory idle while they computed on cached panels. */
#define TALL_ROWS 12
#define TALL_MAX_M 16
#define TALL_MAX_K 512
#define TALL_PREFETCH_STEPS 256

static inline __attribute__((always_inline)) void tall_tile(const float *x, const float *wp, float *y, int64_t k,
                                                            int64_t n, int64_t q, const int rows) {
    vecp acc[TALL_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = SPLAT(0.0f);
    const float *wq = wp + q * k * PANEL;
    for (int64_t i = 0; i < k; i++) {
        __builtin_prefetch(wq + (i + TALL_PREFETCH_STEPS) * PANEL);
        vecp b = loadp(wq + i * PANEL);
        PANEL_IN_REGISTER(b);
        for (int r = 0; r < rows; r++) {
            const float s = x[r * k + i];
            acc[r] += SPLAT(s) * b;
        }
    }
    for (int r = 0; r < rows; r++) memcpy(y + r * n + q * PANEL, &acc[r], sizeof(vecp));
}

#define TALL(r) case r: tall_tile(x, wp, y, k, n, q, r); break
static void any_tall_tile(const float *x, const float *wp, float *y, int64_t k, int64_t n, int64_t q, int rows) {
    switch (rows) {
    TALL(12); TALL(11); TALL(10); TALL(9); TALL(8); TALL(7); TALL(6); TALL(5); TALL(4); TALL(3); TALL(2); default: TALL(1);
    }
}

/* Panels [q_lo, q_hi) for all m rows, in passes of at most TALL_ROWS rows of equal size. */
static void tall_panels(const float *x, const float *wp, float *y, int64_t m, int64_t k, int64_t n, int64_t q_lo,
                        int64_t q_hi) {
    const int64_t passes = (m + TALL_ROWS - 1) / TALL_ROWS, per = (m + passes - 1) / passes;
    for (int64_t q = q_lo; q < q_hi; q++)
        for (int64_t m0 = 0; m0 < m; m0 += per)
            any_tall_tile(x + m0 * k, wp, y + m0 * n, k, n, q, (int)(m - m0 < per ? m - m0 : per));
}
#else
#define TALL_MAX_M 0
#define TALL_MAX_K 0
static void tall_panels(const float *x, const float *wp, float *y, int64_t m, int64_t k, int64_t n, int64_t q_lo,
                        int64_t q_hi) {
    (void)x, (void)wp, (void)y, (void)m, (void)k, (void)n, (void)q_lo, (void)q_hi;
}
#endif

/* x [m, k], wp [n / 16][k][16] (n a multiple of 16), y [m, n]; all contiguous. Threads take groups of panels
 * small enough to stay in L2 while every tile of x's rows passes over them. */
void linear_packed(const float *x, const float *wp, float *y, int64_t m, int64_t k, int64_t n,
                   int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
    const int64_t panels = n / PANEL;
    int64_t group = (256 * 1024) / (k * PANEL * (int64_t)sizeof(float));
    group = group < TILE_PANELS ? TILE_PANELS : group - group % TILE_PANELS;
    const int64_t groups = (panels + group - 1) / group;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t q_lo = g * group, q_hi = q_lo + group < panels ? q_lo + group : panels;
        if (m <= TALL_MAX_M && k <= TALL_MAX_K) {
            tall_panels(x, wp, y, m, k, n, q_lo, q_hi);
            continue;
        }
        for (int64_t m0 = 0; m0 < m; m0 += TILE_ROWS) {
            const int rows = m - m0 >= TILE_ROWS ? TILE_ROWS : (int)(m - m0);
            for (int64_t q = q_lo; q < q_hi; q += TILE_PANELS)
                any_panel_tile(x, wp, y, k, n, m0, q, rows, q_hi - q >= TILE_PANELS ? TILE_PANELS : (int)(q_hi - q));
        }
    }
}
