/* y = x · Wᵀ (a linear layer without bias) on CPU, x and y fp32, W held as 4- or 8-bit integer codes with a scale
 * and a zero point per output column and group of input columns (W4A16 / W8A16 checkpoints: AWQ, GPTQ,
 * compressed-tensors), never dequantized in memory: W[o][i] = (c[o][i] - z[o][g]) * s[o][g], g = i / group.
 *
 * Layout (quant_weight.py's QuantWeight.pack), output columns in panels of 16 as in linear.c:
 *   4 bits  uint32 [n/16][k8/8][16] (k8: k rounded up to 8): word j of octet o holds column j's codes for inputs
 *           8o .. 8o + 7, input 8o + i in the nibble at bit 16 (i % 2) + 4 (i / 2): even inputs in the low half,
 *           odd ones in the high half, so that nibble f of both halves is an input pair (what the bf16 dot products
 *           below multiply), and every lane of a vector of words is one column (no byte shuffles);
 *   8 bits  uint8 [n/16][k][16];
 *   scales, zeros  fp16 [n/16][groups][16] (a checkpoint's 16-bit scales and integer zero points exactly: 12.5% of a
 *                  4-bit weight's bytes, against 25% in fp32), widened to fp32 once per group and column.
 * A group's scale and zero point are constant over its inputs, so they leave its sum:
 *   y[r][o] = sum_g s[o][g] * (sum_{i in g} c[o][i] x[r][i] - z[o][g] * xsum[r][g]),  xsum[r][g] = sum_{i in g} x[r][i]
 * The codes stay exact integers in fp32; what differs from the product of the dequantized weights is the rounding
 * order (the tests bound it).
 *
 * Decode (a few rows) streams the codes from memory once: a quarter (4-bit) or half (8-bit) of bf16 panels' bytes.
 * Each thread takes runs of strips of STRIP panels over all k and runs every row tile of x over a strip while it is
 * in L1/L2; the codes are prefetched PREFETCH_BYTES ahead. */

#include <math.h>
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
 * registers: with AVX-512's 32, 4 rows x 4 panels where m <= 4 (16 accumulators) and 8 rows x 2 panels above; with
 * AVX2's 16, 4 rows x 1 panel (2 vectors); without AVX, 2 x 1. */
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
#define OCTET 8              /* 4-bit inputs a word */

/* Where input i of an octet lies in its word, and the power of two its masked-in-place code carries. The top
 * nibble (input 7, bits 28-31) is shifted down instead: bit 31 would make the int32 negative. */
static inline int nibble_shift(int i) { return 16 * (i & 1) + 4 * (i >> 1); }

/* QPLANES 8-bit codes widened to int32: one vpmovzxbd from memory with AVX2 or AVX-512 (GCC turns the portable form
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

/* QPLANES fp16 values widened to fp32, exactly: the magnitude's bits moved to fp32's places are the value times
 * 2^-112 (normal and subnormal alike), so one multiply by 2^112 restores it; then the sign. Inf and NaN are never
 * stored (quant_weight.py refuses them). */
typedef uint16_t vech __attribute__((vector_size(QPLANES * 2)));
static inline vecf loadh(const uint16_t *p) {
    vech h;
    memcpy(&h, p, sizeof h);
    const vecu u = __builtin_convertvector(h, vecu);
    vecf magnitude;
    const vecu bits = (u & 0x7FFF) << 13;
    memcpy(&magnitude, &bits, sizeof magnitude);
    magnitude *= 0x1p112f;
    vecu out;
    memcpy(&out, &magnitude, sizeof out);
    out |= (u & 0x8000) << 16;
    vecf v;
    memcpy(&v, &out, sizeof v);
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

/* x[0] + ... + x[count - 1] in fp32, QPLANES partial sums (one running sum waited on each add: 5 us of a 3,072-input
 * row's preparation, more than the rest of it). */
static float sum_of(const float *x, int64_t count) {
    vecf acc = SPLATF(0.0f);
    int64_t i = 0;
    for (; i + QPLANES <= count; i += QPLANES) acc += loadf(x + i);
    float s = 0.0f;
    for (int l = 0; l < QPLANES; l++) s += acc[l];
    for (; i < count; i++) s += x[i];
    return s;
}

/* Rows [0, rows) of x against panels [q, q + panels), over all k, into tot[r][16 * p + j] (column 16 (q + p) + j of
 * row r; x, xsum and tot already offset to the tile's first row and panel). At 4 bits x is `xt`, k8 wide, input i
 * of each octet divided by the power of two its nibble carries in place (exact), so a nibble costs one and, one
 * conversion and one FMA per row; at 8 bits x as given and one widening of 16 codes per input. Constant rows,
 * panels and bits (inlined into a switch) keep the accumulators in registers. */
static inline __attribute__((always_inline)) void quant_tile(const float *x, const float *xsum, const uint8_t *codes,
                                                             const uint16_t *scales, const uint16_t *zeros, float *tot,
                                                             int64_t k, int64_t group, int64_t groups, int64_t q,
                                                             const int rows, const int panels, const int bits) {
    const int vecs = panels * QPER_PANEL;
    const int64_t k8 = (k + OCTET - 1) / OCTET * OCTET;
    const int64_t stride = bits == 4 ? k8 : k; /* x's (or xt's) row length */
    const int64_t panel_bytes = bits == 4 ? k8 / 2 * QPANEL : k * QPANEL;
    const uint8_t *cq = codes + q * panel_bytes;
    const uint16_t *sq = scales + q * groups * QPANEL, *zq = zeros + q * groups * QPANEL;
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) memset(tot + r * TOT_STRIDE + v * QPLANES, 0, sizeof(vecf));
    /* At 4 bits a word's eight codes go to one accumulator in turn: with one or two rows, too few chains of FMAs to
     * hide their latency (AVX2, one row: 0.91x the earlier layout's one-row kernel), so inputs alternate between
     * `split` accumulators. */
    enum { SPLIT_MAX = 4 };
    const int split = bits != 4 || rows > 2 ? 1 : rows == 1 ? 4 : 2;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t i1 = (g + 1) * group < k ? (g + 1) * group : k;
        vecf acc[SPLIT_MAX][MAX_ROWS][STRIP_VECS];
        for (int h = 0; h < split; h++)
            for (int r = 0; r < rows; r++)
                for (int v = 0; v < vecs; v++) acc[h][r][v] = SPLATF(0.0f);
        if (bits == 4) {
            /* Octets: a group's start is one (groups are multiples of 8 inputs, or one group), its end rounded up. */
            for (int64_t o = g * group / OCTET; o < (i1 + OCTET - 1) / OCTET; o++) {
                veci words[STRIP_VECS];
                for (int v = 0; v < vecs; v++) {
                    const uint8_t *p = cq + (v / QPER_PANEL) * panel_bytes + o * 4 * QPANEL + (v % QPER_PANEL) * 4 * QPLANES;
                    __builtin_prefetch(p + PREFETCH_BYTES);
                    memcpy(&words[v], p, sizeof(veci));
                }
                for (int i = 0; i < OCTET; i++) {
                    vecf field[STRIP_VECS];
                    for (int v = 0; v < vecs; v++)
                        field[v] = __builtin_convertvector(
                            i == OCTET - 1 ? (veci)((vecu)words[v] >> 28) : words[v] & SPLATI(15 << nibble_shift(i)),
                            vecf);
                    for (int r = 0; r < rows; r++) {
                        const vecf a = SPLATF(x[r * stride + o * OCTET + i]);
                        for (int v = 0; v < vecs; v++) acc[i % split][r][v] += field[v] * a;
                    }
                }
            }
            for (int h = 1; h < split; h++)
                for (int r = 0; r < rows; r++)
                    for (int v = 0; v < vecs; v++) acc[0][r][v] += acc[h][r][v];
        } else {
            for (int64_t i = g * group; i < i1; i++) {
                vecf all[STRIP_VECS];
                for (int v = 0; v < vecs; v++) {
                    const uint8_t *p = cq + (v / QPER_PANEL) * panel_bytes + i * QPANEL + (v % QPER_PANEL) * QPLANES;
                    __builtin_prefetch(p + PREFETCH_BYTES);
                    all[v] = __builtin_convertvector(load_codes(p), vecf);
                }
                for (int r = 0; r < rows; r++) {
                    const vecf a = SPLATF(x[r * stride + i]);
                    for (int v = 0; v < vecs; v++) acc[0][r][v] += all[v] * a;
                }
            }
        }
        for (int v = 0; v < vecs; v++) {
            const int64_t at = (v / QPER_PANEL) * groups * QPANEL + g * QPANEL + (v % QPER_PANEL) * QPLANES;
            const vecf s = loadh(sq + at), z = loadh(zq + at);
            for (int r = 0; r < rows; r++) {
                float *t = tot + r * TOT_STRIDE + v * QPLANES;
                const vecf sum = loadf(t) + s * (acc[0][r][v] - z * SPLATF(xsum[r * groups + g]));
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
static void any_quant_tile(const float *x, const float *xsum, const uint8_t *codes, const uint16_t *scales,
                           const uint16_t *zeros, float *tot, int64_t k, int64_t group, int64_t groups, int64_t q,
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

/* A few rows of x that are bf16 values (a bf16 model's activations, widened) against 4-bit codes, with AVX-512's
 * 16-bit integer dot products: x is written as 16-bit integers in blocks of up to FIX_OCTETS octets (32 inputs,
 * never across a group), each block scaled by the power of two that brings its largest |x| into [2^14, 2^15); a
 * word's nibble f, in both halves, is an input pair, and once shifted down and masked, one vpdpwssd (AVX512_VNNI;
 * vpmaddwd and an add without it) multiplies it by x's pair for 16 columns into int32, exactly. Per 32 weights a
 * shift, a mask and a dot product that issues every cycle, where the bf16 dot product (vdpbf16ps) this replaced
 * issued every ~2.2 cycles on this project's Xeon and bounded the batch-1 product at ~15 GB/s of codes a core.
 * A bf16 value has 8 significant bits, so a block's values within 2^7 of its largest are exact; smaller ones are
 * rounded to 2^-15 of the largest (what the tests bound). Each block's int32 sums go to fp32 times the block's
 * power of two; the zero point leaves with the group's exact fp32 sum of x: s * (sum - z * xsum). Two accumulators
 * per tile cell where rows <= 2, so the chains of dot products overlap. */
#if (defined(__AVX512BW__) && QPLANES == 16) || (defined(__AVX2__) && QPLANES == 8)
#define FIX_DOT 1
#define FIX_OCTETS 4
/* Rows a dot tile holds in registers: with AVX2's 16, two (a panel is two vectors there). */
#define DOT_ROWS (QPLANES == 16 ? FEW_ROWS : 2)

/* acc + the pairwise products of codes' and x's 16-bit halves, summed per 32-bit lane. */
static inline veci pair_dot(veci acc, veci codes, veci x) {
#if QPLANES == 16 && defined(__AVX512VNNI__)
    return (veci)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)codes, (__m512i)x);
#elif QPLANES == 16
    return acc + (veci)_mm512_madd_epi16((__m512i)codes, (__m512i)x);
#else
    return acc + (veci)_mm256_madd_epi16((__m256i)codes, (__m256i)x);
#endif
}

/* With AVX512_VNNI, one or two rows multiply bytes instead (vpdpbusd: four u8 x s8 products a lane, where vpdpwssd
 * takes two s16 x s16): a word masked with 0x0F0F0F0F holds inputs 0, 4, 1, 5 of its octet in its four bytes, and
 * shifted down by 4 first inputs 2, 6, 3, 7, so a word costs one shift, two ands and four dot products where the
 * pairs above cost three shifts, four ands and four dot products. x's 16-bit integers are split into their bytes,
 * x = 256 hi + lo with hi signed and lo unsigned; hi multiplies the codes as their unsigned operand and lo as their
 * signed one (codes are at most 15), and 256 (sum hi) + (sum lo) is the very integer the pairs sum. Each row's x is
 * stored per octet as four words of bytes: hi of inputs 0 4 1 5, hi of 2 6 3 7, lo of 0 4 1 5, lo of 2 6 3 7.
 * Why: at one row the pairs ran at 37-39 GB/s of codes on this project's Xeon's two cores with the weight in L2,
 * barely above what its memory delivers in a fast hour (30 GB/s), so the product did not keep up with the stream;
 * the bytes run at 43-49 GB/s (two rows: 24 -> 32). */
#if QPLANES == 16 && defined(__AVX512VNNI__)
#define BYTE_DOT 1
#define BYTE_ROWS 2
static inline veci byte_dot(veci acc, veci u8, veci s8) {
    return (veci)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u8, (__m512i)s8);
}

/* A row's 16-bit pairs (k8 / 2 words, input 2i low) rearranged in place, octet by octet, into the bytes above. */
static void pairs_to_bytes(uint32_t *row, int64_t k8) {
    const __m512i order = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 9, 3, 11, 5, 13, 7, 15, 0, 8, 2, 10, 4, 12, 6, 14));
    const int64_t words = k8 / 2;
    for (int64_t i = 0; i < words; i += 16) {
        const __mmask16 live = (__mmask16)(words - i >= 16 ? 0xFFFF : (1u << (words - i)) - 1);
        _mm512_mask_storeu_epi32(row + i, live, _mm512_shuffle_epi8(_mm512_maskz_loadu_epi32(live, row + i), order));
    }
}
#endif

static inline __attribute__((always_inline)) void dot_tile(const uint32_t *xp, const float *unit, const float *xsum,
                                                           const uint32_t *codes, const uint16_t *scales,
                                                           const uint16_t *zeros, float *tot, int64_t k8, int64_t k,
                                                           int64_t group, int64_t groups, int64_t q, const int rows,
                                                           const int panels, const int bytes) {
    enum { SPLIT_MAX = 2 };
    /* bytes: acc[0] sums the hi bytes' products, acc[1] the lo bytes'. */
    const int split = bytes || rows <= DOT_ROWS / 2 ? 2 : 1;
    const int vecs = panels * QPER_PANEL;
    const int64_t panel_words = k8 / OCTET * QPANEL, pairs = k8 / 2, octets = k8 / OCTET;
    const uint32_t *cq = codes + q * panel_words;
    const uint16_t *sq = scales + q * groups * QPANEL, *zq = zeros + q * groups * QPANEL;
    vecf out[DOT_ROWS][STRIP_VECS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) out[r][v] = SPLATF(0.0f);
    for (int64_t g = 0; g < groups; g++) {
        const int64_t i1 = (g + 1) * group < k ? (g + 1) * group : k;
        const int64_t o_end = (i1 + OCTET - 1) / OCTET;
        vecf sum[DOT_ROWS][STRIP_VECS];
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < vecs; v++) sum[r][v] = SPLATF(0.0f);
        for (int64_t b = g * group / OCTET; b < o_end; b += FIX_OCTETS) {
            const int64_t b_end = b + FIX_OCTETS < o_end ? b + FIX_OCTETS : o_end;
            veci acc[SPLIT_MAX][DOT_ROWS][STRIP_VECS];
            for (int h = 0; h < split; h++)
                for (int r = 0; r < rows; r++)
                    for (int v = 0; v < vecs; v++) acc[h][r][v] = SPLATI(0);
            for (int64_t o = b; o < b_end; o++) {
                vecu words[STRIP_VECS];
                for (int v = 0; v < vecs; v++) {
                    const uint32_t *w = cq + (v / QPER_PANEL) * panel_words + o * QPANEL + (v % QPER_PANEL) * QPLANES;
                    __builtin_prefetch((const uint8_t *)w + PREFETCH_BYTES);
                    memcpy(&words[v], w, sizeof(vecu));
                }
#if defined(BYTE_DOT)
                if (bytes) {
                    for (int v = 0; v < vecs; v++) {
                        const veci low = (veci)(words[v] & (vecu)SPLATI(0x0F0F0F0F));
                        const veci high = (veci)((words[v] >> 4) & (vecu)SPLATI(0x0F0F0F0F));
                        for (int r = 0; r < rows; r++) {
                            const uint32_t *xb = xp + r * pairs + o * 4;
                            acc[0][r][v] = byte_dot(acc[0][r][v], low, SPLATI((int32_t)xb[0]));
                            acc[0][r][v] = byte_dot(acc[0][r][v], high, SPLATI((int32_t)xb[1]));
                            acc[1][r][v] = byte_dot(acc[1][r][v], SPLATI((int32_t)xb[2]), low);
                            acc[1][r][v] = byte_dot(acc[1][r][v], SPLATI((int32_t)xb[3]), high);
                        }
                    }
                    continue;
                }
#endif
                for (int f = 0; f < 4; f++) {
                    veci field[STRIP_VECS];
                    for (int v = 0; v < vecs; v++)
                        field[v] = (veci)((words[v] >> (4 * f)) & (vecu)SPLATI(0x000F000F));
                    for (int r = 0; r < rows; r++) {
                        const veci xv = SPLATI((int32_t)xp[r * pairs + o * 4 + f]);
                        for (int v = 0; v < vecs; v++) acc[f % split][r][v] = pair_dot(acc[f % split][r][v], field[v], xv);
                    }
                }
            }
            for (int r = 0; r < rows; r++) {
                const vecf u = SPLATF(unit[r * octets + b]);
                for (int v = 0; v < vecs; v++) {
                    const veci total = bytes ? (acc[0][r][v] << 8) + acc[1][r][v]
                                       : split == 2 ? acc[0][r][v] + acc[1][r][v] : acc[0][r][v];
                    sum[r][v] += __builtin_convertvector(total, vecf) * u;
                }
            }
        }
        for (int v = 0; v < vecs; v++) {
            const int64_t at = (v / QPER_PANEL) * groups * QPANEL + g * QPANEL + (v % QPER_PANEL) * QPLANES;
            const vecf sc = loadh(sq + at), z = loadh(zq + at);
            for (int r = 0; r < rows; r++) out[r][v] += sc * (sum[r][v] - z * SPLATF(xsum[r * groups + g]));
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) memcpy(tot + r * TOT_STRIDE + v * QPLANES, &out[r][v], sizeof(vecf));
}

#define DOT_TILE(r, p, b) \
    dot_tile(xp, unit, xsum, (const uint32_t *)codes, scales, zeros, tot, k8, k, group, groups, q, r, p, b)
#if DOT_ROWS == 4 && defined(BYTE_DOT)
#define DOT_ROWS_OF(p) switch (rows) { case 4: DOT_TILE(4, p, 0); break; case 3: DOT_TILE(3, p, 0); break; \
    case 2: if (bytes) DOT_TILE(2, p, 1); else DOT_TILE(2, p, 0); break; \
    default: if (bytes) DOT_TILE(1, p, 1); else DOT_TILE(1, p, 0); break; }
#elif DOT_ROWS == 4
#define DOT_ROWS_OF(p) switch (rows) { case 4: DOT_TILE(4, p, 0); break; case 3: DOT_TILE(3, p, 0); break; \
    case 2: DOT_TILE(2, p, 0); break; default: DOT_TILE(1, p, 0); break; }
#else
#define DOT_ROWS_OF(p) switch (rows) { case 2: DOT_TILE(2, p, 0); break; default: DOT_TILE(1, p, 0); break; }
#endif

static void any_dot_tile(const uint32_t *xp, const float *unit, const float *xsum, const uint8_t *codes,
                         const uint16_t *scales, const uint16_t *zeros, float *tot, int64_t k8, int64_t k, int64_t group,
                         int64_t groups, int64_t q, int rows, int panels, int bytes) {
    (void)bytes;
#if STRIP == 4
    if (panels >= 4) { DOT_ROWS_OF(4) } else if (panels == 3) { DOT_ROWS_OF(3) }
    else if (panels == 2) { DOT_ROWS_OF(2) } else { DOT_ROWS_OF(1) }
#else
    (void)panels;
    DOT_ROWS_OF(1)
#endif
}

#undef DOT_TILE
#undef DOT_ROWS_OF

/* Whether every value of x is a bf16 (its low 16 bits zero): a bf16 model's activations are, and then the 16-bit
 * integer blocks above hold them exactly but for a block's smallest values. */
static int all_bf16(const float *x, int64_t count) {
    vecu lanes = (vecu)SPLATI(0);
    int64_t i = 0;
    for (; i + QPLANES <= count; i += QPLANES) {
        vecu v;
        memcpy(&v, x + i, sizeof v);
        lanes |= v;
    }
    uint32_t low = 0;
    for (int l = 0; l < QPLANES; l++) low |= lanes[l];
    for (; i < count; i++) {
        uint32_t v;
        memcpy(&v, x + i, sizeof v);
        low |= v;
    }
    return (low & 0xFFFFu) == 0;
}

/* The power of two p in [-126, 127] (its exponent bits: ldexpf is a libm call, and this runs per 32 inputs). */
static inline float pow2f(int p) {
    const uint32_t bits = (uint32_t)(p + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A block whose largest |x| lies below 2^(MIN_BLOCK_EXPONENT - 1) is scaled as if it were that large: its scale
 * 2^(15 - e) stays a finite float (frexpf's e of a smaller value overflowed it) and its values are held to 2^-126. */
#define MIN_BLOCK_EXPONENT (-111)

/* e with `largest` (> 0) in [2^(e-1), 2^e), as frexpf, from its exponent bits; at least MIN_BLOCK_EXPONENT (a
 * subnormal reads as -126). */
static inline int block_exponent(float largest) {
    uint32_t bits;
    memcpy(&bits, &largest, sizeof bits);
    const int e = (int)((bits >> 23) & 0xFF) - 126;
    return e < MIN_BLOCK_EXPONENT ? MIN_BLOCK_EXPONENT : e;
}

/* Row r's inputs as 16-bit integer pairs `pairs` (k8 / 2 words, input 2i low, 2i + 1 high) in blocks of FIX_OCTETS
 * octets within each group, and `unit` per octet (read at a block's first): the power of two that turns a block's
 * integers back into x. An all-zero block gets unit 0. */
static void fix_row(const float *xr, int64_t k, int64_t k8, int64_t group, uint32_t *pairs, float *unit) {
    const int64_t groups = (k + group - 1) / group;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t i1 = (g + 1) * group < k ? (g + 1) * group : k;
        const int64_t o_end = (i1 + OCTET - 1) / OCTET;
        for (int64_t b = g * group / OCTET; b < o_end; b += FIX_OCTETS) {
            const int64_t b_end = b + FIX_OCTETS < o_end ? b + FIX_OCTETS : o_end;
            const int64_t lo = b * OCTET, hi = b_end * OCTET < i1 ? b_end * OCTET : i1;
#if QPLANES == 16
            /* At most 32 inputs: two vectors, masked past the block's end (zeros fill its last octet). */
            const int64_t n0 = hi - lo < 16 ? hi - lo : 16, n1 = hi - lo - n0;
            const __m512 v0 = _mm512_maskz_loadu_ps((__mmask16)((1u << n0) - 1), xr + lo);
            const __m512 v1 = _mm512_maskz_loadu_ps((__mmask16)((1u << n1) - 1), xr + lo + 16);
            const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const int e = largest > 0.0f ? block_exponent(largest) : 0; /* largest in [2^(e-1), 2^e) */
            /* x * 2^(15 - e) lies in (-2^15, 2^15); a bf16 |x| tops out at (255/128) 2^(e-1), 32640 here. Rounded
             * to nearest even (the default MXCSR). */
            const __m512 scale = _mm512_set1_ps(largest > 0.0f ? pow2f(15 - e) : 0.0f);
            for (int64_t o = b; o < b_end; o++) unit[o] = largest > 0.0f ? pow2f(e - 15) : 0.0f;
            const int64_t words = (b_end - b) * OCTET / 2; /* 4 per octet */
            const __m256i h0 = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v0, scale)));
            const __m256i h1 = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v1, scale)));
            _mm256_mask_storeu_epi32(pairs + lo / 2, (__mmask8)((1u << (words < 8 ? words : 8)) - 1), h0);
            if (words > 8) _mm256_mask_storeu_epi32(pairs + lo / 2 + 8, (__mmask8)((1u << (words - 8)) - 1), h1);
#else
            float largest = 0.0f;
            for (int64_t i = lo; i < hi; i++) largest = fabsf(xr[i]) > largest ? fabsf(xr[i]) : largest;
            const int e = largest > 0.0f ? block_exponent(largest) : 0;
            const float scale = largest > 0.0f ? pow2f(15 - e) : 0.0f;
            for (int64_t o = b; o < b_end; o++) unit[o] = largest > 0.0f ? pow2f(e - 15) : 0.0f;
            int16_t *halves = (int16_t *)(pairs + lo / 2);
            for (int64_t i = lo; i < b_end * OCTET; i++) halves[i - lo] = i < hi ? (int16_t)rintf(xr[i] * scale) : 0;
#endif
        }
    }
}
#endif

/* x [m, k] fp32, y [m, n] fp32, the weight as described above with `bits` 4 or 8 and groups of `group` inputs
 * (the last one may be shorter; at 4 bits every group but the last is a multiple of 8 inputs, so no octet
 * straddles two groups). Returns 0, or -1 when the scratch for the groups' sums of x could not be allocated. */
int linear_quant(const float *x, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, float *y, int64_t m,
                 int64_t k, int64_t n, int64_t bits, int64_t group, int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
    const int64_t groups = (k + group - 1) / group, panels = (n + QPANEL - 1) / QPANEL;
    const int64_t strips = (panels + STRIP - 1) / STRIP, k8 = (k + OCTET - 1) / OCTET * OCTET;
    const int64_t stride = bits == 4 ? k8 : k;
#if defined(FIX_DOT)
    const int dot = bits == 4 && all_bf16(x, m * k);
#else
    const int dot = 0;
#endif
#if defined(BYTE_DOT)
    const int bytes = dot && m <= BYTE_ROWS; /* every tile then has at most BYTE_ROWS rows */
#else
    const int bytes = 0;
    (void)bytes;
#endif
    /* xsum, then for the dot products each row's unit per octet. */
    const int64_t sum_floats = m * groups + (dot ? m * k8 / OCTET : 0);
    float *xsum = malloc((size_t)(sum_floats > 0 ? sum_floats : 1) * sizeof(float));
    float *unit = xsum + m * groups;
    /* xt: x scaled for the 4-bit tiles, or its 16-bit integer pairs for the dot products (k8 / 2 words a row). */
    const int64_t xt_floats = bits != 4 ? 0 : dot ? m * k8 / 2 : m * k8;
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
            xsum[r * groups + g] = sum_of(xr + g * group, i1 - g * group);
        }
        if (bits == 4 && dot) {
#if defined(FIX_DOT)
            fix_row(xr, k, k8, group, (uint32_t *)xt + r * k8 / 2, unit + r * k8 / OCTET);
#endif
#if defined(BYTE_DOT)
            if (bytes) pairs_to_bytes((uint32_t *)xt + r * k8 / 2, k8);
#endif
        } else if (bits == 4) {
            for (int64_t i = 0; i < k8; i++) {
                const int at = (int)(i % OCTET);
                const float unit = at == OCTET - 1 ? 1.0f : 1.0f / (float)(1u << nibble_shift(at));
                xt[r * k8 + i] = i < k ? xr[i] * unit : 0.0f;
            }
        }
    }
    const float *xs = bits == 4 ? xt : x;
#if defined(FIX_DOT)
    const int rows_per_tile = dot ? DOT_ROWS : m <= FEW_ROWS ? FEW_ROWS : MANY_ROWS;
#else
    const int rows_per_tile = m <= FEW_ROWS ? FEW_ROWS : MANY_ROWS;
#endif
    const int tile_panels = !dot && m > FEW_ROWS ? MANY_PANELS : STRIP;
    /* Runs of strips, about four a thread: a thread's codes then stream from one place for a while. One strip at a
     * time (32 KiB at 1,024 inputs) the threads took turns along the weight and read it 8-9% slower at one row (all
     * of a step's 4-bit weights in one process, alternating); a static split is no faster than these runs. */
    const int64_t chunk = (strips + 4 * num_threads - 1) / (4 * num_threads);
#pragma omp parallel for schedule(dynamic, chunk) num_threads(num_threads)
    for (int64_t strip = 0; strip < strips; strip++) {
        const int64_t q0 = strip * STRIP;
        const int strip_panels = panels - q0 >= STRIP ? STRIP : (int)(panels - q0);
        const int64_t col = q0 * QPANEL, width = n - col < TOT_STRIDE ? n - col : TOT_STRIDE;
        float tot[MAX_ROWS * TOT_STRIDE];
        for (int64_t m0 = 0; m0 < m; m0 += rows_per_tile) {
            const int rows = m - m0 >= rows_per_tile ? rows_per_tile : (int)(m - m0);
#if defined(FIX_DOT)
            if (dot) {
                any_dot_tile((const uint32_t *)xt + m0 * k8 / 2, unit + m0 * k8 / OCTET, xsum + m0 * groups, codes,
                             scales, zeros, tot, k8, k, group, groups, q0, rows, strip_panels, bytes);
            } else
#endif
                for (int p = 0; p < strip_panels; p += tile_panels)
                    any_quant_tile(xs + m0 * stride, xsum + m0 * groups, codes, scales, zeros, tot + p * QPANEL, k,
                                   group, groups, q0 + p, rows,
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
 * A B tile's row is one input pair of 16 columns, two bf16 per column (the layout TDPBF16PS reads); 4-bit codes
 * become the bf16 of 128 + code (amx_widen), and the 128 comes out with the zero point: s * (sum - (z + 128) *
 * xsum), xsum over the rounded x. Groups must be multiples of 32 inputs (a tile's K), which 32/64/128 are. */
#if defined(__x86_64__) && defined(__AVX512F__) && defined(__GNUC__) && __GNUC__ >= 11
#undef STRIP /* the decode tiles' strips end here; amx_tiles.h names its own */
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

/* One panel's 4-bit codes (`octets` words of 16 columns) as B-tile rows of bf16 pairs, padded to `padded` pairs
 * with 128s (multiplied by the zeros x is padded with). Nibble f of a word's two halves is input pair 4o + f
 * (the layout above): shifted down, masked and given the exponent of 128, each half is the bf16 of 128 + code,
 * exact: 2 vector operations per 32 weights, done once per strip for all of x's rows. A missing panel (codes NULL)
 * is all padding. */
AMX_TARGET static void amx_widen(const uint32_t *cp, uint32_t *b, int64_t o0, int64_t octets, int64_t padded) {
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F), exponent = _mm512_set1_epi32(0x43004300);
    int64_t s = 4 * o0; /* words [o0, octets) make pairs [4 o0, 4 octets), padding up to `padded` */
    if (cp != NULL)
        for (int64_t o = o0; o < octets; o++) {
            const __m512i w = _mm512_loadu_si512(cp + o * QPANEL);
            for (int f = 0; f < 4; f++, s++)
                _mm512_store_si512((__m512i *)(b + s * QPANEL),
                                   _mm512_ternarylogic_epi32(f ? _mm512_srli_epi32(w, 4 * f) : w, nibbles, exponent,
                                                             0xEA)); /* (a & b) | c */
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

/* A strip's two panels of 4-bit words (c1 NULL: no second panel), widened a group at a time just before its tile
 * products: with one block of rows, a group's B tiles (8 KiB) are then read from L1, not the whole strip's from L2. */
typedef struct {
    const uint32_t *c0, *c1;
    int64_t octets;
} Widen;

/* Rows [r0, r0 + 32) of xb against the strip's two panels of B tiles, every group, into tot [32][32]; `widen` (NULL:
 * b0 and b1 hold the whole strip already) widens each group's codes into them first. */
AMX_TARGET static void amx_block(const uint16_t *xb, const float *xsum, uint32_t *b0, uint32_t *b1,
                                 const uint16_t *s0, const uint16_t *z0, const uint16_t *s1, const uint16_t *z1, float *tot,
                                 float *cbuf, int64_t kp, int64_t groups, int64_t group, float offset,
                                 const Widen *widen) {
    const int64_t xstride = kp * 2, bsteps = AMX_K / 2 * QPANEL; /* bytes per row of x; dwords per B tile */
    memset(tot, 0, AMX_BLOCK_ROWS * AMX_STRIP * QPANEL * sizeof(float));
    for (int64_t g = 0; g < groups; g++) {
        const int64_t kb0 = g * group / AMX_K, kb1 = ((g + 1) * group < kp ? (g + 1) * group : kp) / AMX_K;
        if (widen != NULL) {
            const int64_t o1 = kb1 * AMX_K / OCTET < widen->octets ? kb1 * AMX_K / OCTET : widen->octets;
            amx_widen(widen->c0, b0, kb0 * AMX_K / OCTET, o1, kb1 * AMX_K / 2);
            amx_widen(widen->c1, b1, kb0 * AMX_K / OCTET, o1, kb1 * AMX_K / 2);
        }
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
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((p ? s1 : s0) + g * QPANEL)));
            const __m512 z = _mm512_add_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((p ? z1 : z0) + g * QPANEL))),
                                           _mm512_set1_ps(offset));
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
AMX_TARGET int linear_quant_amx(const float *x, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                                float *y, int64_t m, int64_t k, int64_t n, int64_t bits, int64_t group,
                                int64_t num_threads) {
    if ((bits != 4 && bits != 8) || group % AMX_K != 0 || !amx_permitted()) return -3;
    if (num_threads < 1) num_threads = 1;
    const int64_t kp = (k + AMX_K - 1) / AMX_K * AMX_K, mp = (m + AMX_BLOCK_ROWS - 1) / AMX_BLOCK_ROWS * AMX_BLOCK_ROWS;
    const int64_t groups = (k + group - 1) / group, panels = (n + QPANEL - 1) / QPANEL;
    const int64_t strips = (panels + AMX_STRIP - 1) / AMX_STRIP, octets = (k + OCTET - 1) / OCTET;
    const int64_t panel_bytes = (bits == 4 ? octets * 4 : k) * QPANEL;
    const float offset = bits == 4 ? 128.0f : 0.0f; /* what the widening adds to every code */
    uint16_t *xb = aligned_alloc(64, (size_t)(mp * kp) * sizeof(uint16_t));
    float *xsum = malloc((size_t)(mp * groups) * sizeof(float));
    if (xb == NULL || xsum == NULL) {
        free(xb);
        free(xsum);
        return -1;
    }
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* x rounded to bf16 (zero rows and inputs past m and k) and its groups' sums, rows shared among the threads:
         * done by one thread, this was 6% of a W4A16 decode step at 32 rows, the other core idle meanwhile. */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < mp; r++) {
            uint16_t *xr = xb + r * kp;
            float *sr = xsum + r * groups;
            const int64_t kr = r < m ? k : 0;
            for (int64_t i = 0; i < kr; i++) xr[i] = bf16_rne(x[r * k + i]);
            memset(xr + kr, 0, (size_t)(kp - kr) * sizeof(uint16_t));
            for (int64_t g = 0; g < groups; g++) {
                const int64_t i1 = (g + 1) * group < kr ? (g + 1) * group : kr;
                float sum = 0.0f;
                for (int64_t i = g * group; i < i1; i++) sum += bf16_widen(xr[i]);
                sr[g] = sum;
            }
        }
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
                /* One block of rows at 4 bits: each group widened as it is used (Widen); more blocks share the
                 * whole strip widened once. */
                const Widen fused = {(const uint32_t *)c0, (const uint32_t *)c1, octets};
                const Widen *widen = bits == 4 && m <= AMX_BLOCK_ROWS ? &fused : NULL;
                if (bits == 4 && widen == NULL) {
                    amx_widen((const uint32_t *)c0, b, 0, octets, kp / 2);
                    amx_widen((const uint32_t *)c1, b1, 0, octets, kp / 2);
                } else if (bits == 8) {
                    amx_widen8(c0, b, k, kp / 2);
                    amx_widen8(c1, b1, k, kp / 2);
                }
                const uint16_t *s0 = scales + q * groups * QPANEL, *z0 = zeros + q * groups * QPANEL;
                const uint16_t *s1 = has_second ? s0 + groups * QPANEL : s0, *z1 = has_second ? z0 + groups * QPANEL : z0;
                const int64_t col = q * QPANEL, width = n - col < AMX_STRIP * QPANEL ? n - col : AMX_STRIP * QPANEL;
                for (int64_t r0 = 0; r0 < m; r0 += AMX_BLOCK_ROWS) {
                    amx_block(xb + r0 * kp, xsum + r0 * groups, b, b1, s0, z0, s1, z1, tot, cbuf, kp, groups, group,
                              offset, widen);
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
int linear_quant_amx(const float *x, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, float *y,
                     int64_t m, int64_t k, int64_t n, int64_t bits, int64_t group, int64_t num_threads) {
    (void)x, (void)codes, (void)scales, (void)zeros, (void)y, (void)m, (void)k, (void)n, (void)bits, (void)group;
    (void)num_threads;
    return -3; /* built without AVX-512 or a compiler that knows AMX */
}
#endif
