/* The packed product's tiles and entry point for one panel element type, included by linear.c once per type
 * (fp32 and bf16 panels), so both run the same tiling. The includer defines:
 *   WEIGHT          the panel element type (float, or uint16_t holding bf16 bits);
 *   LOAD_PANEL(p)   one vecp of fp32 from PLANES consecutive WEIGHTs at p;
 *   TILED(name)     the name of this type's copy of a function (name, name##_bf16).
 * The group of panels (sized for L2) and the prefetch distance are kept in bytes, so for bf16 they cover twice
 * the k of fp32. */

#define PANEL_BYTES ((int64_t)(PANEL * sizeof(WEIGHT))) /* one k step of a panel */
/* A few rows' product reads its panels from memory. A line of each panel 4 KiB ahead: the 0.6B shape's bf16
 * products of a decode step (28 layers and the LM head, 1.2 GB) 1.15x faster at one row, 1.20x at four, alternating
 * with the unprefetched kernel in one process on the AMX Xeon (1, 2 and 8 KiB ahead: within 4% of 4). */
#define PANEL_PREFETCH_BYTES 4096

/* `rows` rows of x (xr, k apart) against `panels` panels from wq, over all k, into y (rows y_stride apart); a
 * panel's vector at step i lies at wq + panel * pstride + i * kstride (packed panels: k * PANEL and PANEL). Constant
 * rows and panels (always inlined into a switch) let the accumulators live in registers. `keep`, when not NULL,
 * receives the panels as the fp32 vectors the tile multiplied, interleaved (pstride PANEL, kstride panels * PANEL:
 * one stream of consecutive lines for the tiles that read them again). */
static inline __attribute__((always_inline)) void TILED(panel_tile)(const float *xr, const WEIGHT *wq, int64_t pstride,
                                                                    int64_t kstride, float *y, int64_t k,
                                                                    int64_t y_stride, const int rows, const int panels,
                                                                    float *keep) {
    const int vecs = panels * PER_PANEL;
    vecp acc[ACC_ROWS][TILE_VECS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) acc[r][v] = SPLAT(0.0f);
    for (int64_t i = 0; i < k; i++) {
        /* Each panel is its own stream: a line of each, PANEL_PREFETCH_BYTES ahead (the hardware's streamers stop
         * at every 4 KiB page). */
        if ((i * PANEL_BYTES) % 64 == 0)
            for (int p = 0; p < panels; p++)
                __builtin_prefetch(wq + p * pstride + i * kstride + PANEL_PREFETCH_BYTES / (int64_t)sizeof(WEIGHT));
        vecp b[TILE_VECS];
        for (int v = 0; v < vecs; v++) {
            b[v] = LOAD_PANEL(wq + (v / PER_PANEL) * pstride + i * kstride + (v % PER_PANEL) * PLANES);
            PANEL_IN_REGISTER(b[v]);
            if (keep) memcpy(keep + i * panels * PANEL + v * PLANES, &b[v], sizeof(vecp));
        }
        for (int r = 0; r < rows; r++) {
            const float s = xr[r * k + i];
            const vecp a = SPLAT(s);
            for (int v = 0; v < vecs; v++) acc[r][v] += a * b[v];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) memcpy(y + r * y_stride + v * PLANES, &acc[r][v], sizeof(vecp));
}

#define PANEL_TILE(r, p) TILED(panel_tile)(xr, wq, pstride, kstride, y, k, y_stride, r, p, keep)
/* The cases of one to six rows, shared by the 6-row and the 12-row tiles' switches. */
#define UP_TO_SIX_ROWS(p)                                                                                   \
    case 6: PANEL_TILE(6, p); break;                                                                        \
    case 5: PANEL_TILE(5, p); break;                                                                        \
    case 4: PANEL_TILE(4, p); break;                                                                        \
    case 3: PANEL_TILE(3, p); break;                                                                        \
    case 2: PANEL_TILE(2, p); break;                                                                        \
    default: PANEL_TILE(1, p); break;
#define TILE_OF_ROWS(p) switch (rows) { UP_TO_SIX_ROWS(p) }

static void TILED(any_panel_tile)(const float *xr, const WEIGHT *wq, int64_t pstride, int64_t kstride, float *y,
                                  int64_t k, int64_t y_stride, int rows, int panels, float *keep) {
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

#undef TILE_OF_ROWS

#if DEEP_ROWS
#define DEEP_OF_ROWS(p)                                                                                     \
    switch (rows) {                                                                                         \
    case 12: PANEL_TILE(12, p); break;                                                                      \
    case 11: PANEL_TILE(11, p); break;                                                                      \
    case 10: PANEL_TILE(10, p); break;                                                                      \
    case 9: PANEL_TILE(9, p); break;                                                                        \
    case 8: PANEL_TILE(8, p); break;                                                                        \
    case 7: PANEL_TILE(7, p); break;                                                                        \
    UP_TO_SIX_ROWS(p)                                                                                       \
    }

/* Up to DEEP_ROWS rows against up to DEEP_PANELS panels (24 accumulators, as the 6 x 4 tiles). */
static void TILED(any_deep_tile)(const float *xr, const WEIGHT *wq, int64_t pstride, int64_t kstride, float *y,
                                 int64_t k, int64_t y_stride, int rows, int panels) {
    float *keep = NULL;
    if (panels >= 2) { DEEP_OF_ROWS(2) }
    else { DEEP_OF_ROWS(1) }
}
#undef DEEP_OF_ROWS
#endif
#undef UP_TO_SIX_ROWS

#undef PANEL_TILE

#if TILE_PANELS == 4
static inline __attribute__((always_inline)) void TILED(tall_tile)(const float *x, const WEIGHT *wp, float *y,
                                                                   int64_t k, int64_t n, int64_t q, const int rows) {
    vecp acc[TALL_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = SPLAT(0.0f);
    const WEIGHT *wq = wp + q * k * PANEL;
    for (int64_t i = 0; i < k; i++) {
        __builtin_prefetch(wq + (i + TALL_PREFETCH_BYTES / PANEL_BYTES) * PANEL);
        vecp b = LOAD_PANEL(wq + i * PANEL);
        PANEL_IN_REGISTER(b);
        for (int r = 0; r < rows; r++) {
            const float s = x[r * k + i];
            acc[r] += SPLAT(s) * b;
        }
    }
    for (int r = 0; r < rows; r++) memcpy(y + r * n + q * PANEL, &acc[r], sizeof(vecp));
}

#define TALL(r) case r: TILED(tall_tile)(x, wp, y, k, n, q, r); break
static void TILED(any_tall_tile)(const float *x, const WEIGHT *wp, float *y, int64_t k, int64_t n, int64_t q,
                                 int rows) {
    switch (rows) {
    TALL(12); TALL(11); TALL(10); TALL(9); TALL(8); TALL(7); TALL(6); TALL(5); TALL(4); TALL(3); TALL(2); default: TALL(1);
    }
}
#undef TALL

/* Panels [q_lo, q_hi) for all m rows, in passes of at most TALL_ROWS rows of equal size. */
static void TILED(tall_panels)(const float *x, const WEIGHT *wp, float *y, int64_t m, int64_t k, int64_t n,
                               int64_t q_lo, int64_t q_hi) {
    const int64_t passes = (m + TALL_ROWS - 1) / TALL_ROWS, per = (m + passes - 1) / passes;
    for (int64_t q = q_lo; q < q_hi; q++)
        for (int64_t m0 = 0; m0 < m; m0 += per)
            TILED(any_tall_tile)(x + m0 * k, wp, y + m0 * n, k, n, q, (int)(m - m0 < per ? m - m0 : per));
}
#else
static void TILED(tall_panels)(const float *x, const WEIGHT *wp, float *y, int64_t m, int64_t k, int64_t n,
                               int64_t q_lo, int64_t q_hi) {
    (void)x, (void)wp, (void)y, (void)m, (void)k, (void)n, (void)q_lo, (void)q_hi;
}
#endif

/* x [m, k], wp [n / 16][k][16] (n a multiple of 16), y [m, n]; all contiguous. Threads take groups of panels
 * small enough to stay in L2 while every tile of x's rows passes over them. */
static void TILED(panels_product)(const float *x, const WEIGHT *wp, float *y, int64_t m, int64_t k, int64_t n,
                                  int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
    const int64_t panels = n / PANEL;
    int64_t group = GROUP_BYTES / (k * PANEL_BYTES);
    group = group < TILE_PANELS ? TILE_PANELS : group - group % TILE_PANELS;
    const int64_t groups = (panels + group - 1) / group;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t q_lo = g * group, q_hi = q_lo + group < panels ? q_lo + group : panels;
        if (m <= TALL_MAX_M && k <= TALL_MAX_K) {
            TILED(tall_panels)(x, wp, y, m, k, n, q_lo, q_hi);
            continue;
        }
#if DEEP_ROWS
        if (m >= DEEP_MIN_M && m < 2 * DEEP_ROWS) {
            const int64_t per = m <= DEEP_ROWS ? m : (m + 1) / 2;
            for (int64_t m0 = 0; m0 < m; m0 += per)
                for (int64_t q = q_lo; q < q_hi; q += DEEP_PANELS)
                    TILED(any_deep_tile)(x + m0 * k, wp + q * k * PANEL, k * PANEL, PANEL, y + m0 * n + q * PANEL, k,
                                         n, (int)(m - m0 < per ? m - m0 : per),
                                         q_hi - q >= DEEP_PANELS ? DEEP_PANELS : (int)(q_hi - q));
            continue;
        }
#endif
        for (int64_t m0 = 0; m0 < m; m0 += TILE_ROWS) {
            const int rows = m - m0 >= TILE_ROWS ? TILE_ROWS : (int)(m - m0);
            for (int64_t q = q_lo; q < q_hi; q += TILE_PANELS)
                TILED(any_panel_tile)(x + m0 * k, wp + q * k * PANEL, k * PANEL, PANEL, y + m0 * n + q * PANEL, k, n,
                                      rows, q_hi - q >= TILE_PANELS ? TILE_PANELS : (int)(q_hi - q), NULL);
        }
    }
}

#undef PANEL_BYTES
#undef PANEL_PREFETCH_BYTES
