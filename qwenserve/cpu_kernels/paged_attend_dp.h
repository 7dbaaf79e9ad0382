/* Decode attention of a bf16 model (bf16 queries and output over a bf16 cache) with AVX512_BF16's dot product,
 * included by paged_decode.c where the compiler targets that extension (the x86-64-v4-bf16 object).
 *
 * The fp32 kernel (paged_attend.h) reaches ~30 GB/s on cache-resident K/V on an AMX Xeon and 13 GB/s from memory,
 * where a plain sum reads 24-28 GB/s: its arithmetic (a widening shuffle per 16 keys' values, two FMAs per head
 * pair, a horizontal sum per score) and the memory's latency add up instead of overlapping. Here:
 *   - scores: vdpbf16ps multiplies 32 bf16 pairs of q and K per instruction, straight from the loaded K (no
 *     widening); q is bf16 already, so its products are exact in fp32 as before. The 16 accumulators of a tile
 *     (8 tokens x 2 heads, or 16 x 1) are reduced together: 30 shuffles for 16 sums, where one at a time took 64;
 *   - weighted V: each 32 bf16 values widen with a shift (the even elements) and a mask (the odd ones), two
 *     single-cycle ops, and the fp32 probabilities multiply them as in the fp32 kernel; the output is kept
 *     split into even and odd elements until it is rounded to bf16.
 * Heads of dim 32 x NC, NC 1..8 (dims 32..256); other dims take the fp32 kernel. */
#include <immintrin.h>

#define DP_MAX_CHUNKS 8
#define DP_PREFETCH_BLOCKS 1 /* how many blocks ahead the rows are prefetched (2 and 3 measured no better) */
#define DP_PREFETCH_LOCALITY 2 /* into L2 (prefetcht1): 1.16x against into L1 all at once, 1.06x into L1 spread */

typedef struct {
    const uint16_t *q; /* [batch] rows of [heads, dim] bf16, q_stride apart */
    int64_t q_stride;
    const uint16_t *k_cache, *v_cache; /* [blocks, block_size, kv_heads, dim] bf16 */
    const int64_t *block_table;
    int64_t table_stride;
    const int64_t *context_lens;
    uint16_t *out; /* [batch] rows of [heads, dim] bf16, out_stride apart */
    int64_t out_stride;
    int64_t heads, kv_heads, dim, block_size;
    float scale;
} DpJob;

/* Lane i of the result is the sum of v[i]'s lanes. The pairwise folds leave input 4L + m's total in lane 4m + L,
 * so the inputs are taken transposed. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 v[16]) {
    __m512 c[8], e[4], f[2];
    for (int i = 0; i < 8; i++) {
        const int s0 = 2 * i, s1 = 2 * i + 1;
        const __m512 a = v[4 * (s0 % 4) + s0 / 4], b = v[4 * (s1 % 4) + s1 / 4];
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int i = 0; i < 4; i++)
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        f[i] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(f[0], f[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Prefetches of the next block's rows go out one row per row used (pf: that row's head slice, pf_n rows of it; NULL:
 * none), into L2, not all at once into L1 before a block: a burst of 64 filled the line-fill buffers and the core
 * waited on the prefetches themselves (40% of this kernel's samples went to those instructions). Decode attention
 * of 32 sequences x 450 tokens x 28 layers of KV in memory, on the AMX Xeon: 110.6 -> 95.5 ms. */
static inline __attribute__((always_inline)) void prefetch_row(const uint16_t *pf, int64_t pf_n, int64_t t, int64_t row,
                                                               const int NC) {
    if (pf != NULL && t < pf_n)
        for (int c = 0; c < NC; c++) __builtin_prefetch((const char *)(pf + t * row) + 64 * c, 0, DP_PREFETCH_LOCALITY);
}

/* Scores of HC query heads q [HC, 32 * NC] against the n (<= 16 / HC) keys at k (rows `row` apart), scaled,
 * into scores[g * stride + t]; the rows of the next block at pf prefetched as these are read. */
static inline __attribute__((always_inline)) void dp_scores(const uint16_t *q, const uint16_t *k, int64_t row,
                                                            int64_t n, float *scores, int64_t stride, float scale,
                                                            const uint16_t *pf, int64_t pf_n, const int HC,
                                                            const int NC) {
    const int TOK = 16 / HC;
    __m512bh qv[DP_MAX_CHUNKS]; /* HC * NC <= 8 */
    for (int g = 0; g < HC; g++)
        for (int c = 0; c < NC; c++) qv[g * NC + c] = (__m512bh)_mm512_loadu_si512(q + g * 32 * NC + 32 * c);
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int t = 0; t < TOK; t++) {
        prefetch_row(pf, pf_n, t, row, NC);
        const uint16_t *kt = k + (t < n ? t : 0) * row; /* past n: a real row, its score dropped */
        for (int c = 0; c < NC; c++) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + 32 * c);
            for (int g = 0; g < HC; g++) acc[g * TOK + t] = _mm512_dpbf16_ps(acc[g * TOK + t], qv[g * NC + c], kv);
        }
    }
    const __m512 s = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
    if (HC == 1) {
        _mm512_mask_storeu_ps(scores, (__mmask16)((1u << n) - 1u), s);
    } else {
        const __mmask8 valid = (__mmask8)((1u << n) - 1u);
        _mm256_mask_storeu_ps(scores, valid, _mm512_castps512_ps256(s));
        _mm256_mask_storeu_ps(scores + stride, valid, _mm512_extractf32x8_ps(s, 1));
    }
}

/* acc [HC][NC][even, odd][16] += sum over n tokens t of p[g * stride + t] * v[t * row ..]: element 2j of a 32-value
 * chunk goes to its even half, 2j + 1 to its odd half. */
static inline __attribute__((always_inline)) void dp_weigh(float *acc, const float *p, int64_t stride,
                                                           const uint16_t *v, int64_t row, int64_t n,
                                                           const uint16_t *pf, int64_t pf_n, const int HC,
                                                           const int NC) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 sum[2 * DP_MAX_CHUNKS];
    for (int i = 0; i < HC * NC * 2; i++) sum[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        __m512 pt[2];
        for (int g = 0; g < HC; g++) pt[g] = _mm512_set1_ps(p[g * stride + t]);
        const uint16_t *vt = v + t * row;
        prefetch_row(pf, pf_n, t, row, NC);
        for (int c = 0; c < NC; c++) {
            const __m512i x = _mm512_loadu_si512(vt + 32 * c);
            const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(x, high));
            for (int g = 0; g < HC; g++) {
                sum[(g * NC + c) * 2] = _mm512_fmadd_ps(pt[g], even, sum[(g * NC + c) * 2]);
                sum[(g * NC + c) * 2 + 1] = _mm512_fmadd_ps(pt[g], odd, sum[(g * NC + c) * 2 + 1]);
            }
        }
    }
    for (int i = 0; i < HC * NC * 2; i++) _mm512_storeu_ps(acc + 16 * i, _mm512_add_ps(_mm512_loadu_ps(acc + 16 * i),
                                                                                       sum[i]));
}

/* The query heads of KV head h in tiles of HC (2 while they fit the registers, then 1). */
#define DP_TILES(HC_MAX, body)                                                                                      \
    do {                                                                                                            \
        int64_t g = 0;                                                                                              \
        if (HC_MAX == 2)                                                                                            \
            for (; g + 2 <= group; g += 2) body(2);                                                                 \
        for (; g < group; g++) body(1);                                                                             \
    } while (0)

static inline __attribute__((always_inline)) void attend_dp_nc(const DpJob *job, int64_t b, int64_t h0, int64_t h1,
                                                               float *scores, float *acc, const int NC) {
    const int HC_MAX = NC <= 4 ? 2 : 1; /* q and 16 accumulators of two heads fill the registers up to dim 128 */
    const int64_t group = job->heads / job->kv_heads, dim = job->dim, bs = job->block_size;
    const int64_t ctx = job->context_lens[b], row = job->kv_heads * dim, nq = (h1 - h0) * group;
    const int64_t *table = job->block_table + b * job->table_stride;
    const uint16_t *q = job->q + b * job->q_stride + h0 * group * dim;
    for (int64_t start = 0, j = 0; start < ctx; start += bs, j++) {
        const uint16_t *k = job->k_cache + table[j] * bs * row;
        const int64_t n = ctx - start < bs ? ctx - start : bs, ahead = ctx - start - DP_PREFETCH_BLOCKS * bs;
        const int64_t after = ahead < bs ? ahead : bs; /* rows of the block prefetched */
        const uint16_t *next = after > 0 ? job->k_cache + table[j + DP_PREFETCH_BLOCKS] * bs * row : NULL;
        for (int64_t h = h0; h < h1; h++) {
            const uint16_t *qh = q + (h - h0) * group * dim, *pf = next ? next + h * dim : NULL;
            float *sh = scores + (h - h0) * group * ctx + start;
            /* The first tile of query heads prefetches the rows of the block DP_PREFETCH_BLOCKS ahead. */
#define DP_SCORE_TILE(HC)                                                                                           \
    for (int64_t t = 0; t < n; t += 16 / (HC))                                                                      \
        dp_scores(qh + g * dim, k + t * row + h * dim, row, n - t < 16 / (HC) ? n - t : 16 / (HC), sh + g * ctx + t, \
                  ctx, job->scale, g == 0 && pf ? pf + t * row : NULL, after - t, HC, NC)
            DP_TILES(HC_MAX, DP_SCORE_TILE);
#undef DP_SCORE_TILE
        }
    }
    float sums[nq];
    for (int64_t i = 0; i < nq; i++) sums[i] = softmax_in_place(scores + i * ctx, ctx);
    memset(acc, 0, sizeof(float) * (size_t)(nq * dim));
    for (int64_t start = 0, j = 0; start < ctx; start += bs, j++) {
        const uint16_t *v = job->v_cache + table[j] * bs * row;
        const int64_t n = ctx - start < bs ? ctx - start : bs, ahead = ctx - start - DP_PREFETCH_BLOCKS * bs;
        const int64_t after = ahead < bs ? ahead : bs; /* rows of the block prefetched */
        const uint16_t *next = after > 0 ? job->v_cache + table[j + DP_PREFETCH_BLOCKS] * bs * row : NULL;
        for (int64_t h = h0; h < h1; h++) {
            const uint16_t *pf = next ? next + h * dim : NULL;
            float *ah = acc + (h - h0) * group * dim;
            const float *ph = scores + (h - h0) * group * ctx + start;
#define DP_WEIGH_TILE(HC) dp_weigh(ah + g * dim, ph + g * ctx, ctx, v + h * dim, row, n, g == 0 ? pf : NULL, after, HC, NC)
            DP_TILES(HC_MAX, DP_WEIGH_TILE);
#undef DP_WEIGH_TILE
        }
    }
    uint16_t *out = job->out + b * job->out_stride + h0 * group * dim;
    for (int64_t i = 0; i < nq; i++) {
        const float inv = sums[i] > 0.0f ? 1.0f / sums[i] : 0.0f;
        const float *a = acc + i * dim;
        for (int64_t c = 0; c < dim / 32; c++)
            for (int l = 0; l < 16; l++) {
                out[i * dim + 32 * c + 2 * l] = round_bf16(a[32 * c + l] * inv);
                out[i * dim + 32 * c + 2 * l + 1] = round_bf16(a[32 * c + 16 + l] * inv);
            }
    }
}

/* One item (KV heads [h0, h1) of sequence b), its dim's copy of the kernel; scratch: run()'s. */
static void attend_dp(const void *item_job, int64_t b, int64_t h0, int64_t h1, float *scratch) {
    const DpJob *job = item_job;
    float *acc = scratch, *scores = scratch + job->heads * job->dim;
    switch (job->dim / 32) {
    case 1: attend_dp_nc(job, b, h0, h1, scores, acc, 1); break;
    case 2: attend_dp_nc(job, b, h0, h1, scores, acc, 2); break;
    case 3: attend_dp_nc(job, b, h0, h1, scores, acc, 3); break;
    case 4: attend_dp_nc(job, b, h0, h1, scores, acc, 4); break;
    case 5: attend_dp_nc(job, b, h0, h1, scores, acc, 5); break;
    case 6: attend_dp_nc(job, b, h0, h1, scores, acc, 6); break;
    case 7: attend_dp_nc(job, b, h0, h1, scores, acc, 7); break;
    default: attend_dp_nc(job, b, h0, h1, scores, acc, 8); break;
    }
}
