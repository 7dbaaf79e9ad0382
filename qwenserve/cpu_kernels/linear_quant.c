/* y = x · Wᵀ (a linear layer without bias) on CPU, x and y fp32, W held as 4- or 8-bit integer codes with a scale
 * and a zero point per output column and group of input columns (W4A16 / W8A16 checkpoints: AWQ, GPTQ,
 * compressed-tensors), never dequantized in memory: W[o][i] = (c[o][i] - z[o][g]) * s[o][g], g = i / group.
 *
 * Layout (quant_weight.py's QuantWeight.pack), output columns in panels of 16 as in linear.c:
 *   codes  uint8 [n/16][k/2][16] at 4 bits: byte j of pair p holds column j's codes for inputs 2p (low nibble) and
 *          2p + 1 (high nibble), a half of the bytes of a panel per input pair; uint8 [n/16][k][16] at 8 bits;
 *   scales, zeros  fp32 [n/16][groups][16].
 * A group's scale and zero point are constant over its inputs, so they leave its sum:
 *   y[r][o] = sum_g s[o][g] * (sum_{i in g} c[o][i] x[r][i] - z[o][g] * xsum[r][g]),  xsum[r][g] = sum_{i in g} x[r][i]
 * and the inner loop is one widening of 16 codes to fp32 (zero-extend, convert) and one FMA per row of x, the x
 * value broadcast from memory. The codes stay exact integers in fp32; what differs from the product of the
 * dequantized weights is the rounding order (the tests bound it).
 *
 * Decode (a few rows) streams the codes from memory once: a quarter (4-bit) or half (8-bit) of bf16 panels' bytes.
 * Each thread takes strips of STRIP panels over all k and runs every row tile of x over a strip while it is in
 * L1/L2; the codes are prefetched PREFETCH_BYTES ahead. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QPANEL 16
#if defined(__AVX512F__)
#define QPLANES 16
#elif defined(__AVX__)
#define QPLANES 8
#else
#define QPLANES 4
#endif
#define QPER_PANEL (QPANEL / QPLANES)
typedef float vecf __attribute__((vector_size(QPLANES * 4)));
typedef int32_t veci __attribute__((vector_size(QPLANES * 4)));
typedef uint32_t vecu __attribute__((vector_size(QPLANES * 4)));
typedef uint8_t vecb __attribute__((vector_size(QPLANES)));

/* A strip of STRIP panels is a thread's unit of work. Tiles of x's rows x panels keep their accumulators in
 * registers: with AVX-512's 32, 4 rows x 4 panels where m <= 4 (16 accumulators, 8 widened code vectors) and 8 rows
 * x 2 panels above (16 and 4: the codes' widening then spreads over twice the rows); with AVX2's 16, 4 rows x 1
 * panel (2 vectors); without AVX, 2 x 1. */
#if QPLANES == 16
#define STRIP 4
#define FEW_ROWS 4
#define MANY_ROWS 8
#define MANY_PANELS 2
#elif QPLANES == 8
#define STRIP 1
#define FEW_ROWS 4
#define MANY_ROWS 4
#define MANY_PANELS 1
#else
#define STRIP 1
#define FEW_ROWS 2
#define MANY_ROWS 2
#define MANY_PANELS 1
#endif
#define MAX_ROWS (MANY_ROWS > FEW_ROWS ? MANY_ROWS : FEW_ROWS)
#define STRIP_VECS (STRIP * QPER_PANEL)
#define TOT_STRIDE (STRIP * QPANEL) /* floats per row of a strip's results */
#define PREFETCH_BYTES 1024 /* per panel stream, a few cache lines ahead */

/* QPLANES codes widened to int32: one vpmovzxbd from memory with AVX2 or AVX-512 (GCC turns the portable form
 * below into byte-by-byte inserts there). */
#if defined(__AVX512F__) && QPLANES == 16
#include <immintrin.h>
static inline veci load_codes(const uint8_t *p) {
    return (veci)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
#elif defined(__AVX2__) && QPLANES == 8
#include <immintrin.h>
static inline veci load_codes(const uint8_t *p) {
    return (veci)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
#else
static inline veci load_codes(const uint8_t *p) {
    vecb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, veci);
}
#endif

static inline vecf loadf(const float *p) {
    vecf v;
    memcpy(&v, p, sizeof v);
    return v;
}

#define S4(s) s, s, s, s
#if QPLANES == 16
#define SPLATF(s) ((vecf){S4(s), S4(s), S4(s), S4(s)})
#define SPLATI(s) ((veci){S4(s), S4(s), S4(s), S4(s)})
#elif QPLANES == 8
#define SPLATF(s) ((vecf){S4(s), S4(s)})
#define SPLATI(s) ((veci){S4(s), S4(s)})
#else
#define SPLATF(s) ((vecf){S4(s)})
#define SPLATI(s) ((veci){S4(s)})
#endif

/* Rows [0, rows) of x against panels [q, q + panels), over all k, into tot[r][16 * p + j] (column 16 (q + p) + j of
 * row r; x, xsum and tot already offset to the tile's first row and panel). At 4 bits x is `xt`, transformed so that
 * a pair of inputs needs two conversions: with b = lo + 16 hi the pair's byte, lo * x0 + hi * x1 =
 * lo * (x0 - x1 / 16) + b * (x1 / 16), so xt[2p] = x[2p] - x[2p + 1] / 16 and xt[2p + 1] = x[2p + 1] / 16 (the
 * shift of the high nibble saved; a missing last input is 0). Constant rows, panels and bits (inlined into a
 * switch) keep the accumulators in registers. */
static inline __attribute__((always_inline)) void quant_tile(const float *x, const float *xsum, const uint8_t *codes,
                                                             const float *scales, const float *zeros, float *tot,
                                                             int64_t k, int64_t group, int64_t groups, int64_t q,
                                                             const int rows, const int panels, const int bits) {
    const int vecs = panels * QPER_PANEL;
    const int64_t steps = bits == 4 ? (k + 1) / 2 : k; /* a panel's k steps: pairs of inputs, or inputs */
    const int64_t stride = bits == 4 ? 2 * steps : k;  /* x's (or xt's) row length */
    const int64_t panel_bytes = steps * QPANEL;
    const uint8_t *cq = codes + q * panel_bytes;
    const float *sq = scales + q * groups * QPANEL, *zq = zeros + q * groups * QPANEL;
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) memset(tot + r * TOT_STRIDE + v * QPLANES, 0, sizeof(vecf));
    for (int64_t g = 0; g < groups; g++) {
        const int64_t i1 = (g + 1) * group < k ? (g + 1) * group : k;
        /* At 4 bits, steps are pairs: a group's (even) start, and its end rounded up to take an odd last input. */
        const int64_t s0 = bits == 4 ? g * group / 2 : g * group, s1 = bits == 4 ? (i1 + 1) / 2 : i1;
        vecf acc[MAX_ROWS][STRIP_VECS];
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < vecs; v++) acc[r][v] = SPLATF(0.0f);
        for (int64_t i = s0; i < s1; i++) {
            vecf lo[STRIP_VECS], all[STRIP_VECS];
            for (int v = 0; v < vecs; v++) {
                const uint8_t *p = cq + (v / QPER_PANEL) * panel_bytes + i * QPANEL + (v % QPER_PANEL) * QPLANES;
                __builtin_prefetch(p + PREFETCH_BYTES);
                const veci c = load_codes(p);
                all[v] = __builtin_convertvector(c, vecf);
                if (bits == 4) lo[v] = __builtin_convertvector(c & SPLATI(15), vecf);
            }
            for (int r = 0; r < rows; r++) {
                if (bits == 4) {
                    const vecf a = SPLATF(x[r * stride + 2 * i]), b = SPLATF(x[r * stride + 2 * i + 1]);
                    for (int v = 0; v < vecs; v++) acc[r][v] += lo[v] * a + all[v] * b;
                } else {
                    const vecf a = SPLATF(x[r * stride + i]);
                    for (int v = 0; v < vecs; v++) acc[r][v] += all[v] * a;
                }
            }
        }
        for (int v = 0; v < vecs; v++) {
            const int64_t at = (v / QPER_PANEL) * groups * QPANEL + g * QPANEL + (v % QPER_PANEL) * QPLANES;
            const vecf s = loadf(sq + at), z = loadf(zq + at);
            for (int r = 0; r < rows; r++) {
                float *t = tot + r * TOT_STRIDE + v * QPLANES;
                const vecf sum = loadf(t) + s * (acc[r][v] - z * SPLATF(xsum[r * groups + g]));
                memcpy(t, &sum, sizeof sum);
            }
        }
    }
}

#define QUANT_TILE(r, p, b) quant_tile(x, xsum, codes, scales, zeros, tot, k, group, groups, q, r, p, b)
#define ROWS_2(p, b) case 2: QUANT_TILE(2, p, b); break; default: QUANT_TILE(1, p, b); break;
#define ROWS_4(p, b) case 4: QUANT_TILE(4, p, b); break; case 3: QUANT_TILE(3, p, b); break; ROWS_2(p, b)
#define ROWS_8(p, b) case 8: QUANT_TILE(8, p, b); break; case 7: QUANT_TILE(7, p, b); break;                 \
    case 6: QUANT_TILE(6, p, b); break; case 5: QUANT_TILE(5, p, b); break; ROWS_4(p, b)
#define ROWS_OF(n) ROWS_##n
#define TILE_OF(n, p, b) switch (rows) { ROWS_OF(n)(p, b) }

/* A tile of `rows` x `panels`: at most FEW_ROWS x STRIP, or MANY_ROWS x MANY_PANELS. */
static void any_quant_tile(const float *x, const float *xsum, const uint8_t *codes, const float *scales,
                           const float *zeros, float *tot, int64_t k, int64_t group, int64_t groups, int64_t q,
                           int rows, int panels, int bits) {
#if STRIP == 4
    if (rows > FEW_ROWS) {
        if (panels >= MANY_PANELS) {
            if (bits == 4) { TILE_OF(8, 2, 4) } else { TILE_OF(8, 2, 8) }
        } else {
            if (bits == 4) { TILE_OF(8, 1, 4) } else { TILE_OF(8, 1, 8) }
        }
    } else if (panels >= 4) {
        if (bits == 4) { TILE_OF(4, 4, 4) } else { TILE_OF(4, 4, 8) }
    } else if (panels == 3) {
        if (bits == 4) { TILE_OF(4, 3, 4) } else { TILE_OF(4, 3, 8) }
    } else if (panels == 2) {
        if (bits == 4) { TILE_OF(4, 2, 4) } else { TILE_OF(4, 2, 8) }
    } else {
        if (bits == 4) { TILE_OF(4, 1, 4) } else { TILE_OF(4, 1, 8) }
    }
#elif FEW_ROWS == 4
    (void)panels;
    if (bits == 4) { TILE_OF(4, 1, 4) } else { TILE_OF(4, 1, 8) }
#else
    (void)panels;
    if (bits == 4) { TILE_OF(2, 1, 4) } else { TILE_OF(2, 1, 8) }
#endif
}

#undef QUANT_TILE
#undef TILE_OF

/* One row of x (a single stream's decode step) on AVX2 and narrower: the tiles above widen 8 codes per vpmovzxbd, a
 * lane-crossing shuffle that Zen 3 and most cores run on one or two ports, and with one row that shuffle, not the
 * multiply-adds or the memory, set the pace (4-bit codes read at ~5 GB/s a core). Here a vector of QPLANES 32-bit
 * lanes is loaded as it lies: each lane holds 4 bytes of one step (bytes 4j'..4j'+3: columns 4j'+b, b = 0..3), and
 * lane j belongs to step j / 4 of the QPLANES / 4 steps the vector covers. A field of a lane (a 4-bit nibble f = 2b +
 * h, or an 8-bit byte f = b) is masked in place, not shifted: converted, it is code * 2^(width * f), exact, and that
 * power of two leaves the sum exactly at the group's end; the top field is shifted down instead (its bit 31 would
 * make it negative). Each field has its own accumulator, and the broadcast x is a vector whose lanes follow their
 * steps (xv, laid out once per call). So each field costs one and, one conversion and one FMA, all on any of the
 * vector ports. Used where groups and k are whole vectors of steps. */
#if QPLANES <= 8
#define ROW_STEPS (QPLANES / 4) /* steps a vector of codes covers */
#define ROW_FIELDS_MAX 8

static inline __attribute__((always_inline)) void row_panel(const float *xv, const float *xsum, const uint8_t *cq,
                                                            const float *sq, const float *zq, float *tot, int64_t k,
                                                            int64_t group, int64_t groups, const int bits) {
    const int fields = 32 / bits, halves = bits == 4 ? 2 : 1;
    const int64_t chunk_inputs = (int64_t)ROW_STEPS * halves; /* inputs a vector of codes covers */
    for (int j = 0; j < QPANEL; j++) tot[j] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t c0 = g * group / chunk_inputs, c1 = ((g + 1) * group < k ? (g + 1) * group : k) / chunk_inputs;
        vecf acc[ROW_FIELDS_MAX];
        for (int f = 0; f < fields; f++) acc[f] = SPLATF(0.0f);
        for (int64_t c = c0; c < c1; c++) {
            const uint8_t *p = cq + c * ROW_STEPS * QPANEL;
            __builtin_prefetch(p + PREFETCH_BYTES);
            veci v;
            memcpy(&v, p, sizeof v);
            const float *xc = xv + c * halves * QPLANES;
            for (int f = 0; f < fields; f++) {
                const vecf xf = loadf(xc + (f % halves) * QPLANES);
                const veci field = f == fields - 1 ? (veci)((vecu)v >> (32 - bits))
                                                   : v & SPLATI((int32_t)(((1u << bits) - 1) << (bits * f)));
                acc[f] += __builtin_convertvector(field, vecf) * xf;
            }
        }
        /* Column 4j' + b: the fields of byte b in lane j' of every step, each scaled back by its power of two. */
#if QPLANES == 8 && defined(__AVX2__)
        __m128 cols[4];
        for (int b = 0; b < 4; b++) {
            cols[b] = _mm_setzero_ps();
            for (int h = 0; h < halves; h++) {
                const int f = b * halves + h;
                const __m256 a = (__m256)acc[f];
                const __m128 steps = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
                const float unit = f == fields - 1 ? 1.0f : 1.0f / (float)(1u << (bits * f));
                cols[b] = _mm_fmadd_ps(steps, _mm_set1_ps(unit), cols[b]);
            }
        }
        _MM_TRANSPOSE4_PS(cols[0], cols[1], cols[2], cols[3]); /* cols[j']: columns 4j' .. 4j' + 3 */
        const __m128 xs = _mm_set1_ps(xsum[g]);
        for (int j = 0; j < 4; j++) {
            const __m128 sc = _mm_loadu_ps(sq + g * QPANEL + 4 * j), z = _mm_loadu_ps(zq + g * QPANEL + 4 * j);
            _mm_storeu_ps(tot + 4 * j, _mm_fmadd_ps(sc, _mm_fnmadd_ps(z, xs, cols[j]), _mm_loadu_ps(tot + 4 * j)));
        }
#else
        float lanes[ROW_FIELDS_MAX][QPLANES];
        for (int f = 0; f < fields; f++) memcpy(lanes[f], &acc[f], sizeof(vecf));
        for (int col = 0; col < QPANEL; col++) {
            const int b = col % 4, lane = col / 4;
            float sum = 0.0f;
            for (int h = 0; h < halves; h++) {
                const int f = b * halves + h;
                const float unit = f == fields - 1 ? 1.0f : 1.0f / (float)(1u << (bits * f));
                float part = 0.0f;
                for (int st = 0; st < ROW_STEPS; st++) part += lanes[f][4 * st + lane];
                sum += part * unit;
            }
            tot[col] += sq[g * QPANEL + col] * (sum - zq[g * QPANEL + col] * xsum[g]);
        }
#endif
    }
}

/* Whether one row can take row_panel: every group (and k) whole vectors of steps. */
static int row_path_fits(int64_t m, int64_t k, int64_t bits, int64_t group) {
    const int64_t chunk_inputs = (int64_t)ROW_STEPS * (bits == 4 ? 2 : 1);
    return m == 1 && k % chunk_inputs == 0 && group % chunk_inputs == 0;
}

/* xv: for each vector of steps c and half h, QPLANES floats, lane j = x[input of step c * ROW_STEPS + j / 4, half h]. */
static void row_layout(const float *x, float *xv, int64_t k, int64_t bits) {
    const int64_t halves = bits == 4 ? 2 : 1, chunks = k / (ROW_STEPS * halves);
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t h = 0; h < halves; h++)
            for (int j = 0; j < QPLANES; j++) xv[(c * halves + h) * QPLANES + j] = x[(c * ROW_STEPS + j / 4) * halves + h];
}

static void row_product(const float *x, const float *xsum, const uint8_t *codes, const float *scales,
                        const float *zeros, float *y, int64_t k, int64_t n, int64_t bits, int64_t group,
                        int64_t num_threads) {
    const int64_t groups = (k + group - 1) / group, panels = (n + QPANEL - 1) / QPANEL;
    const int64_t panel_bytes = (bits == 4 ? k / 2 : k) * QPANEL;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t q = 0; q < panels; q++) {
        float tot[QPANEL];
        const uint8_t *cq = codes + q * panel_bytes;
        const float *sq = scales + q * groups * QPANEL, *zq = zeros + q * groups * QPANEL;
        if (bits == 4)
            row_panel(x, xsum, cq, sq, zq, tot, k, group, groups, 4);
        else
            row_panel(x, xsum, cq, sq, zq, tot, k, group, groups, 8);
        const int64_t col = q * QPANEL, width = n - col < QPANEL ? n - col : QPANEL;
        memcpy(y + col, tot, (size_t)width * sizeof(float));
    }
}
#endif

/* x [m, k] fp32, y [m, n] fp32, the weight as described above with `bits` 4 or 8 and groups of `group` inputs
 * (the last one may be shorter; at 4 bits every group but the last has an even length, so no input pair
 * straddles two groups). Returns 0, or -1 when the scratch for the groups' sums of x could not be allocated. */
int linear_quant(const float *x, const uint8_t *codes, const float *scales, const float *zeros, float *y, int64_t m,
                 int64_t k, int64_t n, int64_t bits, int64_t group, int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
    const int64_t groups = (k + group - 1) / group, panels = (n + QPANEL - 1) / QPANEL;
    const int64_t strips = (panels + STRIP - 1) / STRIP, stride = bits == 4 ? 2 * ((k + 1) / 2) : k;
    float *xsum = malloc((size_t)(m * groups > 0 ? m * groups : 1) * sizeof(float));
#if QPLANES <= 8
    const int one_row = row_path_fits(m, k, bits, group);
#else
    const int one_row = 0;
#endif
    /* xt: x transformed for the tiles (4 bits), or laid out for row_product (4 * k floats). */
    const int64_t xt_floats = one_row ? 4 * k : bits == 4 ? m * stride : 0;
    float *xt = xt_floats ? malloc((size_t)xt_floats * sizeof(float)) : NULL;
    if (xsum == NULL || (xt_floats && xt == NULL)) {
        free(xsum);
        free(xt);
        return -1;
    }
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t i1 = (g + 1) * group < k ? (g + 1) * group : k;
            float s = 0.0f;
            for (int64_t i = g * group; i < i1; i++) s += xr[i];
            xsum[r * groups + g] = s;
        }
        if (bits == 4 && !one_row)
            for (int64_t i = 0; i < stride; i += 2) {
                const float x1 = i + 1 < k ? xr[i + 1] : 0.0f;
                xt[r * stride + i] = xr[i] - x1 * 0.0625f;
                xt[r * stride + i + 1] = x1 * 0.0625f;
            }
    }
#if QPLANES <= 8
    if (one_row) {
        row_layout(x, xt, k, bits);
        row_product(xt, xsum, codes, scales, zeros, y, k, n, bits, group, num_threads);
        free(xsum);
        free(xt);
        return 0;
    }
#endif
    const float *xs = bits == 4 ? xt : x;
    const int rows_per_tile = m > FEW_ROWS ? MANY_ROWS : FEW_ROWS;
    const int tile_panels = m > FEW_ROWS ? MANY_PANELS : STRIP;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t strip = 0; strip < strips; strip++) {
        const int64_t q0 = strip * STRIP;
        const int strip_panels = panels - q0 >= STRIP ? STRIP : (int)(panels - q0);
        const int64_t col = q0 * QPANEL, width = n - col < TOT_STRIDE ? n - col : TOT_STRIDE;
        float tot[MAX_ROWS * TOT_STRIDE];
        for (int64_t m0 = 0; m0 < m; m0 += rows_per_tile) {
            const int rows = m - m0 >= rows_per_tile ? rows_per_tile : (int)(m - m0);
            for (int p = 0; p < strip_panels; p += tile_panels)
                any_quant_tile(xs + m0 * stride, xsum + m0 * groups, codes, scales, zeros, tot + p * QPANEL, k, group,
                               groups, q0 + p, rows,
                               strip_panels - p < tile_panels ? strip_panels - p : tile_panels, (int)bits);
            /* The padded columns of a last, partial panel are computed and dropped here. */
            for (int r = 0; r < rows; r++)
                memcpy(y + (m0 + r) * n + col, tot + r * TOT_STRIDE, (size_t)width * sizeof(float));
        }
    }
    free(xsum);
    free(xt);
    return 0;
}

/* Many rows (a prefill chunk, a large decode batch) on a CPU with AMX: x rounded to bf16 (as PyTorch's
 * bf16 product rounds it, where the engine's precision allows that), the codes widened to bf16 tiles and multiplied
 * by TDPBF16PS, 16 x 16 fp32 results from 16 rows x 32 inputs a tile.
 *
 * A B tile's row is one input pair of 16 columns, two bf16 per column (the layout TDPBF16PS reads): our packed pair
 * byte (low nibble input 2p, high nibble 2p + 1) widened to a 32-bit lane is spread to bits 0-3 and 16-19 and given
 * the exponent of 128, so each half is the bf16 of 128 + code, exact: 3 vector operations per 32 weights, done once
 * per strip for all of x's rows. The 128 comes out with the zero point: s * (sum - (z + 128) * xsum), xsum over the
 * rounded x. Groups must be multiples of 32 inputs (a tile's K), which 32/64/128 are. */
#if defined(__x86_64__) && defined(__AVX512F__) && defined(__GNUC__) && __GNUC__ >= 11
#include "amx_tiles.h"
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))
#define AMX_BLOCK_ROWS (2 * AMX_ROWS) /* rows of x per pass: two A tiles */
#define AMX_STRIP 2                 /* panels per pass: two B tiles; 2 x 2 C tiles, 8 tile registers in all */

static inline uint16_t bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One panel's codes (`steps` input pairs of 16 bytes) as B-tile rows of bf16 pairs, padded to `padded` pairs
 * with 128s (multiplied by the zeros x is padded with). A missing panel (codes NULL) is all padding. */
AMX_TARGET static void amx_widen(const uint8_t *cp, uint32_t *b, int64_t steps, int64_t padded) {
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F), exponent = _mm512_set1_epi32(0x43004300);
    int64_t s = 0;
    if (cp != NULL)
        for (; s < steps; s++) {
            const __m512i t = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(cp + s * QPANEL)));
            /* 0xA8: (t | t << 12) & nibbles, the low nibble at bits 0-3 and the high one at 16-19. */
            const __m512i spread = _mm512_ternarylogic_epi32(t, _mm512_slli_epi32(t, 12), nibbles, 0xA8);
            _mm512_store_si512((__m512i *)(b + s * QPANEL), _mm512_or_si512(spread, exponent));
        }
    for (; s < padded; s++) _mm512_store_si512((__m512i *)(b + s * QPANEL), exponent);
}

/* The same for 8-bit codes (a panel's `k` inputs of 16 bytes): a B-tile row's dword j holds the bf16 of column j's
 * codes for inputs 2s and 2s + 1, exact (integers below 256 are bf16s): the high half of each code's fp32. A missing
 * odd last input, padding and a missing panel are 0. */
AMX_TARGET static void amx_widen8(const uint8_t *cp, uint32_t *b, int64_t k, int64_t padded) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m128i none = _mm_setzero_si128();
    int64_t s = 0;
    if (cp != NULL)
        for (; 2 * s < k; s++) {
            const __m128i c0 = _mm_loadu_si128((const __m128i *)(cp + 2 * s * QPANEL));
            const __m128i c1 = 2 * s + 1 < k ? _mm_loadu_si128((const __m128i *)(cp + (2 * s + 1) * QPANEL)) : none;
            const __m512i f0 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c0)));
            const __m512i f1 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c1)));
            /* 0xEA: (f1 & high) | (f0 >> 16) */
            _mm512_store_si512((__m512i *)(b + s * QPANEL),
                               _mm512_ternarylogic_epi32(f1, high, _mm512_srli_epi32(f0, 16), 0xEA));
        }
    for (; s < padded; s++) _mm512_store_si512((__m512i *)(b + s * QPANEL), _mm512_setzero_si512());
}

/* Rows [r0, r0 + 32) of xb against the strip's two panels of B tiles, every group, into tot [32][32]. */
AMX_TARGET static void amx_block(const uint16_t *xb, const float *xsum, const uint32_t *b0, const uint32_t *b1,
                                 const float *s0, const float *z0, const float *s1, const float *z1, float *tot,
                                 float *cbuf, int64_t kp, int64_t groups, int64_t group, float offset) {
    const int64_t xstride = kp * 2, bsteps = AMX_K / 2 * QPANEL; /* bytes per row of x; dwords per B tile */
    memset(tot, 0, AMX_BLOCK_ROWS * AMX_STRIP * QPANEL * sizeof(float));
    for (int64_t g = 0; g < groups; g++) {
        const int64_t kb0 = g * group / AMX_K, kb1 = ((g + 1) * group < kp ? (g + 1) * group : kp) / AMX_K;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = kb0; kb < kb1; kb++) {
            _tile_loadd(4, xb + kb * AMX_K, xstride);
            _tile_loadd(5, xb + AMX_ROWS * kp + kb * AMX_K, xstride);
            _tile_loadd(6, b0 + kb * bsteps, QPANEL * 4);
            _tile_loadd(7, b1 + kb * bsteps, QPANEL * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        const int64_t cstride = AMX_STRIP * QPANEL * 4;
        _tile_stored(0, cbuf, cstride);
        _tile_stored(1, cbuf + QPANEL, cstride);
        _tile_stored(2, cbuf + AMX_ROWS * AMX_STRIP * QPANEL, cstride);
        _tile_stored(3, cbuf + AMX_ROWS * AMX_STRIP * QPANEL + QPANEL, cstride);
        for (int p = 0; p < AMX_STRIP; p++) {
            const __m512 s = _mm512_loadu_ps((p ? s1 : s0) + g * QPANEL);
            const __m512 z = _mm512_add_ps(_mm512_loadu_ps((p ? z1 : z0) + g * QPANEL), _mm512_set1_ps(offset));
            for (int r = 0; r < AMX_BLOCK_ROWS; r++) {
                float *t = tot + r * AMX_STRIP * QPANEL + p * QPANEL;
                const __m512 acc = _mm512_loadu_ps(cbuf + r * AMX_STRIP * QPANEL + p * QPANEL);
                const __m512 sum = _mm512_fnmadd_ps(z, _mm512_set1_ps(xsum[r * groups + g]), acc);
                _mm512_storeu_ps(t, _mm512_fmadd_ps(s, sum, _mm512_loadu_ps(t)));
            }
        }
    }
}

/* y [m, n] = x [m, k] (fp32, rounded to bf16 here) times the 4- or 8-bit weight, codes/scales/zeros as
 * linear_quant's.
 * Returns 0; -1 when scratch cannot be allocated; -3 when this cannot run here (groups not a multiple of 32
 * inputs, or the kernel refuses the tile state), and the caller runs linear_quant instead. */
AMX_TARGET int linear_quant_amx(const float *x, const uint8_t *codes, const float *scales, const float *zeros,
                                float *y, int64_t m, int64_t k, int64_t n, int64_t bits, int64_t group,
                                int64_t num_threads) {
    if ((bits != 4 && bits != 8) || group % AMX_K != 0 || !amx_permitted()) return -3;
    if (num_threads < 1) num_threads = 1;
    const int64_t kp = (k + AMX_K - 1) / AMX_K * AMX_K, mp = (m + AMX_BLOCK_ROWS - 1) / AMX_BLOCK_ROWS * AMX_BLOCK_ROWS;
    const int64_t groups = (k + group - 1) / group, panels = (n + QPANEL - 1) / QPANEL;
    const int64_t strips = (panels + AMX_STRIP - 1) / AMX_STRIP, steps = (k + 1) / 2;
    const int64_t panel_bytes = (bits == 4 ? steps : k) * QPANEL;
    const float offset = bits == 4 ? 128.0f : 0.0f; /* what the widening adds to every code */
    uint16_t *xb = aligned_alloc(64, (size_t)(mp * kp) * sizeof(uint16_t));
    float *xsum = malloc((size_t)(mp * groups) * sizeof(float));
    if (xb == NULL || xsum == NULL) {
        free(xb);
        free(xsum);
        return -1;
    }
    memset(xb, 0, (size_t)(mp * kp) * sizeof(uint16_t));
    memset(xsum, 0, (size_t)(mp * groups) * sizeof(float));
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++) {
            xb[r * kp + i] = bf16_rne(x[r * k + i]);
            xsum[r * groups + i / group] += bf16_widen(xb[r * kp + i]);
        }
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        amx_configure();
        uint32_t *b = aligned_alloc(64, (size_t)(AMX_STRIP * kp / 2 * QPANEL) * sizeof(uint32_t));
        float *tot = aligned_alloc(64, AMX_BLOCK_ROWS * AMX_STRIP * QPANEL * sizeof(float));
        float *cbuf = aligned_alloc(64, AMX_BLOCK_ROWS * AMX_STRIP * QPANEL * sizeof(float));
        const int scratch = b != NULL && tot != NULL && cbuf != NULL;
        if (!scratch) {
#pragma omp atomic write
            status = -1;
        }
        /* Every thread takes part in the loop (OpenMP's rule), a thread without scratch taking no strip. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t strip = 0; strip < strips; strip++) {
            if (scratch) {
                const int64_t q = strip * AMX_STRIP;
                const int has_second = q + 1 < panels;
                uint32_t *b1 = b + kp / 2 * QPANEL;
                const uint8_t *c0 = codes + q * panel_bytes, *c1 = has_second ? c0 + panel_bytes : NULL;
                if (bits == 4) {
                    amx_widen(c0, b, steps, kp / 2);
                    amx_widen(c1, b1, steps, kp / 2);
                } else {
                    amx_widen8(c0, b, k, kp / 2);
                    amx_widen8(c1, b1, k, kp / 2);
                }
                const float *s0 = scales + q * groups * QPANEL, *z0 = zeros + q * groups * QPANEL;
                const float *s1 = has_second ? s0 + groups * QPANEL : s0, *z1 = has_second ? z0 + groups * QPANEL : z0;
                const int64_t col = q * QPANEL, width = n - col < AMX_STRIP * QPANEL ? n - col : AMX_STRIP * QPANEL;
                for (int64_t r0 = 0; r0 < m; r0 += AMX_BLOCK_ROWS) {
                    amx_block(xb + r0 * kp, xsum + r0 * groups, b, b1, s0, z0, s1, z1, tot, cbuf, kp, groups, group,
                              offset);
                    const int64_t rows = m - r0 < AMX_BLOCK_ROWS ? m - r0 : AMX_BLOCK_ROWS;
                    for (int64_t r = 0; r < rows; r++)
                        memcpy(y + (r0 + r) * n + col, tot + r * AMX_STRIP * QPANEL, (size_t)width * sizeof(float));
                }
            }
        }
        _tile_release();
        free(b);
        free(tot);
        free(cbuf);
    }
    free(xb);
    free(xsum);
    return status;
}
#else
int linear_quant_amx(const float *x, const uint8_t *codes, const float *scales, const float *zeros, float *y,
                     int64_t m, int64_t k, int64_t n, int64_t bits, int64_t group, int64_t num_threads) {
    (void)x, (void)codes, (void)scales, (void)zeros, (void)y, (void)m, (void)k, (void)n, (void)bits, (void)group;
    (void)num_threads;
    return -3; /* built without AVX-512 or a compiler that knows AMX */
}
#endif
