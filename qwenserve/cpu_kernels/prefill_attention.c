/* Causal attention of a prompt's chunk for bf16 q, k, v on AMX tiles, fp32 scores and softmax, bf16 out: the chunk's
 * qlen queries are the last of the t keys (query i at position t - qlen + i sees keys 0..t - qlen + i), so a first
 * chunk (qlen = t) is what PyTorch's bf16 flash attention computes with is_causal, at about twice its speed on the AMX
 * Xeon (see the README), and a later chunk attends its cached prefix too, the keys read where the paged cache holds
 * them (`slots`: key j's row), without gathering them first.
 *
 * Two products per (query head, block of QBLOCK queries), both the linear product's step (amx_tiles.h):
 *   scores S = Q · Kᵀ, the keys laid out as a weight [keys, head_dim] in tile order (strips of 32 keys);
 *   out = P · V, V laid out as a weight [head_dim, keys] in tile order (strips of 32 dimensions, k-blocks of 32
 *   keys), P the softmax of the block's scores written in tile order as bf16.
 * A block's scores over all the keys it sees fit in L2 (QBLOCK x 2,048 keys x 4 bytes = 512 KiB), so the softmax is
 * exact (each row's maximum kept as its scores are stored, then one pass of exp and sum) instead of flash attention's
 * running rescale; the sum divides the output once. K and V are laid out once per call for all heads (8 MiB at 2,000 tokens x 8 KV heads).
 * Work: (head, query block) pairs, the longest blocks first, spread over the threads. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__GNUC__) && __GNUC__ >= 11
#include "amx_tiles.h"
#define QBLOCK 64 /* queries per work item: two passes of 32 rows */

/* The calling thread's K and V tiles; each OpenMP thread's scores, probabilities and query tiles. */
static __thread struct amx_scratch kv_scratch, score_scratch, prob_scratch, query_scratch;

/* Key j's row: slots[j] in a paged cache, j in a chunk's own keys (slots NULL). */
static inline int64_t key_row(const int64_t *slots, int64_t j) { return slots != NULL ? slots[j] : j; }

/* Keys [t, head_dim] (row stride ks, key j at row key_row(slots, j)) of one KV head as a weight in tile order:
 * strip `strip` of 32 keys (keys past t zero). */
AMX_BF16_TARGET static void lay_out_keys(const uint16_t *k, int64_t ks, const int64_t *slots, int64_t t, int64_t dim,
                                         uint16_t *to, int64_t strip) {
    const int64_t kblocks = dim / AMX_K;
    for (int64_t kb = 0; kb < kblocks; kb++)
        for (int p = 0; p < 2; p++) {
            uint32_t *tile = (uint32_t *)(to + (strip * kblocks + kb) * 2 * TILE_ELEMS + p * TILE_ELEMS);
            for (int c = 0; c < 16; c++) {
                const int64_t key = strip * STRIP + p * 16 + c;
                uint32_t pairs[16];
                if (key < t)
                    memcpy(pairs, k + key_row(slots, key) * ks + kb * AMX_K, sizeof pairs);
                else
                    memset(pairs, 0, sizeof pairs);
                for (int r = 0; r < 16; r++) tile[r * 16 + c] = pairs[r];
            }
        }
}

/* Values [t, head_dim] (row stride vs, key j at row key_row(slots, j)) of one KV head as a weight [head_dim, keys] in
 * tile order: strip `strip` of 32 dimensions, every k-block of 32 keys (keys past t zero). */
AMX_BF16_TARGET static void lay_out_values(const uint16_t *v, int64_t vs, const int64_t *slots, int64_t t, int64_t tp,
                                           uint16_t *to, int64_t strip) {
    const int64_t kblocks = tp / AMX_K;
    for (int64_t kb = 0; kb < kblocks; kb++)
        for (int p = 0; p < 2; p++) {
            uint32_t *tile = (uint32_t *)(to + (strip * kblocks + kb) * 2 * TILE_ELEMS + p * TILE_ELEMS);
            const int64_t dim = strip * STRIP + p * 16;
            for (int r = 0; r < 16; r++) {
                const int64_t key = kb * AMX_K + 2 * r;
                const __m256i zero = _mm256_setzero_si256();
                const __m256i even =
                    key < t ? _mm256_loadu_si256((const __m256i *)(v + key_row(slots, key) * vs + dim)) : zero;
                const __m256i odd =
                    key + 1 < t ? _mm256_loadu_si256((const __m256i *)(v + key_row(slots, key + 1) * vs + dim)) : zero;
                /* dword c: (value of key 2r, value of key 2r + 1) at dimension c */
                const __m512i pairs = _mm512_or_si512(_mm512_cvtepu16_epi32(even),
                                                      _mm512_slli_epi32(_mm512_cvtepu16_epi32(odd), 16));
                _mm512_store_si512((__m512i *)(tile + r * 16), pairs);
            }
        }
}

/* exp(x) for x <= 0 (scores less their maximum): 2^(x log2 e) as 2^n 2^f, n the nearest integer, |f| <= 1/2, 2^f by
 * its Taylor polynomial of degree 5 (relative error below 2e-7: far inside the bf16 the probabilities become); 8
 * vector operations, a third of vexp.h's general exp, which took a third of the kernel's time. -inf and x below
 * -126 ln 2 give 0 (scalef). */
AMX_BF16_TARGET static inline __m512 exp_nonpositive(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.3333558146e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Softmax of one query's scores (`row`, keys 0..last, their maximum `top`) times `scale`, as bf16 probabilities into
 * its row of P in tile order (k-blocks of 32 keys, `prow` the row's first element, blocks `pblock` elements apart),
 * zeros from last + 1 to `keys`; returns the sum the output is divided by. */
AMX_BF16_TARGET static float softmax_row(const float *row, int64_t last, float top, int64_t keys, float scale,
                                         uint16_t *prow, int64_t pblock) {
    const int64_t valid = last + 1;
    const __m512 shift = _mm512_set1_ps(top * scale), scaled = _mm512_set1_ps(scale);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j += 16) {
        const __mmask16 m = j >= valid ? 0 : valid - j >= 16 ? 0xFFFF : (__mmask16)((1u << (valid - j)) - 1);
        const __m512 x = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, row + j),
                                                                                scaled, shift)));
        total = _mm512_add_ps(total, x);
        _mm256_storeu_si256((__m256i *)(prow + (j / AMX_K) * pblock + j % AMX_K), (__m256i)_mm512_cvtneps_pbh(x));
    }
    return _mm512_reduce_add_ps(total);
}

/* Row i of a 32 x 32 block of scores (keys first..first + 31) into the query's scores, its maximum over the keys
 * it sees (up to `last`) folded into the 16 lanes at `top` (reduced once, when the row is done). */
AMX_BF16_TARGET static inline void keep_scores(const float *c, float *row, int64_t first, int64_t last, float *top) {
    const __m512 a = _mm512_load_ps(c), b = _mm512_load_ps(c + 16);
    _mm512_storeu_ps(row + first, a);
    _mm512_storeu_ps(row + first + 16, b);
    const int64_t seen = last - first + 1; /* keys of the block this query sees */
    __m512 best = _mm512_load_ps(top);
    if (seen >= 32) {
        best = _mm512_max_ps(best, _mm512_max_ps(a, b));
    } else if (seen > 0) {
        const __mmask16 ma = seen >= 16 ? 0xFFFF : (__mmask16)((1u << seen) - 1);
        const __mmask16 mb = seen <= 16 ? 0 : (__mmask16)((1u << (seen - 16)) - 1);
        best = _mm512_mask_max_ps(best, ma, best, a);
        best = _mm512_mask_max_ps(best, mb, best, b);
    }
    _mm512_store_ps(top, best);
}

/* out [qlen, heads * head_dim] (row stride os) = causal attention of q [qlen, heads * head_dim], the last qlen of t
 * positions, over the t keys and values of k, v [kv_rows, kv_heads * head_dim] (row strides qs, ks, vs; key j at row
 * slots[j], or row j when slots is NULL), query head h reading KV head h / (heads / kv_heads).
 * Returns 0; -1 when scratch cannot be allocated; -2 when qlen is not in 1..t or a key's row is not in 0..kv_rows - 1;
 * -3 when this cannot run here (head_dim not a multiple of 32, heads not a multiple of kv_heads, or no tile state):
 * the caller attends another way. */
AMX_BF16_TARGET int prefill_attention_amx(const uint16_t *q, int64_t qs, const uint16_t *k, int64_t ks,
                                          const uint16_t *v, int64_t vs, uint16_t *out, int64_t os, int64_t qlen,
                                          int64_t t, const int64_t *slots, int64_t kv_rows, int64_t heads,
                                          int64_t kv_heads, int64_t dim, float scale, int64_t num_threads) {
    if (dim % AMX_K != 0 || dim == 0 || kv_heads < 1 || heads % kv_heads != 0 || !amx_permitted()) return -3;
    if (qlen == 0) return 0;
    if (qlen < 0 || qlen > t || (slots == NULL && t > kv_rows)) return -2;
    for (int64_t j = 0; slots != NULL && j < t; j++)
        if (slots[j] < 0 || slots[j] >= kv_rows) return -2;
    if (num_threads < 1) num_threads = 1;
    const int64_t first = t - qlen; /* the position of query 0 */
    const int64_t tp = (t + STRIP - 1) / STRIP * STRIP, dim_blocks = dim / AMX_K, group = heads / kv_heads;
    const int64_t head_elems = tp * dim; /* per KV head, for K and for V */
    uint16_t *kt = amx_scratch_get(&kv_scratch, (size_t)(2 * kv_heads * head_elems) * 2);
    if (kt == NULL) return -1;
    uint16_t *vt = kt + kv_heads * head_elems;
    const int64_t qblocks = (qlen + QBLOCK - 1) / QBLOCK;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for collapse(2) schedule(static)
        for (int64_t g = 0; g < kv_heads; g++)
            for (int64_t strip = 0; strip < (tp > dim ? tp : dim) / STRIP; strip++) {
                if (strip < tp / STRIP) lay_out_keys(k + g * dim, ks, slots, t, dim, kt + g * head_elems, strip);
                if (strip < dim / STRIP) lay_out_values(v + g * dim, vs, slots, t, tp, vt + g * head_elems, strip);
            }
        float *scores = amx_scratch_get(&score_scratch, (size_t)(QBLOCK * tp) * sizeof(float));
        uint16_t *probs = amx_scratch_get(&prob_scratch, (size_t)(QBLOCK * tp) * 2);
        uint16_t *qt = amx_scratch_get(&query_scratch, (size_t)(QBLOCK * dim) * 2);
        float c[BLOCK_ROWS * STRIP] __attribute__((aligned(64))), inverse[QBLOCK];
        float top[QBLOCK * 16] __attribute__((aligned(64))); /* each query's running maximum, 16 lanes */
        const int scratch = scores != NULL && probs != NULL && qt != NULL;
        amx_configure();
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < heads * qblocks; item++) {
            if (!scratch) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t qb = qblocks - 1 - item / heads, h = item % heads, g = h / group; /* longest blocks first */
            const int64_t r0 = qb * QBLOCK, rows = qlen - r0 < QBLOCK ? qlen - r0 : QBLOCK;
            const int64_t p0 = first + r0; /* the block's first position */
            const int64_t keys = (p0 + rows + STRIP - 1) / STRIP * STRIP; /* the block's keys, whole strips */
            const uint16_t *kg = kt + g * head_elems, *vg = vt + g * head_elems;
            for (int64_t i = 0; i < QBLOCK; i++) /* the queries in tile order, zero rows past t */
                for (int64_t kb = 0; kb < dim_blocks; kb++) {
                    uint16_t *to = qt + (i / BLOCK_ROWS) * BLOCK_ROWS * dim + kb * 2 * TILE_ELEMS + (i % BLOCK_ROWS) * AMX_K;
                    if (i < rows)
                        memcpy(to, q + (r0 + i) * qs + h * dim + kb * AMX_K, AMX_K * 2);
                    else
                        memset(to, 0, AMX_K * 2);
                }
            for (int64_t i = 0; i < QBLOCK; i++) _mm512_store_ps(top + i * 16, _mm512_set1_ps(-__builtin_inff()));
            for (int64_t rb = 0; rb * BLOCK_ROWS < rows; rb++) {
                const int64_t seen = (p0 + rb * BLOCK_ROWS + BLOCK_ROWS + STRIP - 1) / STRIP; /* strips with a key seen */
                for (int64_t s = 0; s < seen && s * STRIP < keys; s++) {
                    amx_strip_block(qt + rb * BLOCK_ROWS * dim, kg + s * dim_blocks * 2 * TILE_ELEMS, dim_blocks, c);
                    for (int i = 0; i < BLOCK_ROWS; i++) {
                        const int64_t row = rb * BLOCK_ROWS + i;
                        keep_scores(c + i * STRIP, scores + row * tp, s * STRIP, p0 + row, top + row * 16);
                    }
                }
            }
            for (int64_t i = 0; i < QBLOCK; i++) {
                uint16_t *prow = probs + (i / BLOCK_ROWS) * BLOCK_ROWS * keys + (i % BLOCK_ROWS) * AMX_K;
                if (i < rows) {
                    inverse[i] = 1.0f / softmax_row(scores + i * tp, p0 + i, _mm512_reduce_max_ps(_mm512_load_ps(top + i * 16)),
                                                    keys, scale, prow, 2 * TILE_ELEMS);
                } else {
                    for (int64_t kb = 0; kb < keys / AMX_K; kb++) memset(prow + kb * 2 * TILE_ELEMS, 0, AMX_K * 2);
                }
            }
            for (int64_t rb = 0; rb * BLOCK_ROWS < rows; rb++) {
                const int n = rows - rb * BLOCK_ROWS < BLOCK_ROWS ? (int)(rows - rb * BLOCK_ROWS) : BLOCK_ROWS;
                for (int64_t s = 0; s < dim / STRIP; s++) {
                    amx_strip_block(probs + rb * BLOCK_ROWS * keys, vg + s * (tp / AMX_K) * 2 * TILE_ELEMS,
                                    keys / AMX_K, c);
                    for (int i = 0; i < n; i++) {
                        const __m512 w = _mm512_set1_ps(inverse[rb * BLOCK_ROWS + i]);
                        const __m512 a = _mm512_mul_ps(_mm512_load_ps(c + i * STRIP), w);
                        const __m512 b = _mm512_mul_ps(_mm512_load_ps(c + i * STRIP + 16), w);
                        _mm512_storeu_si512((__m512i *)(out + (r0 + rb * BLOCK_ROWS + i) * os + h * dim + s * STRIP),
                                            (__m512i)_mm512_cvtne2ps_pbh(b, a));
                    }
                }
            }
        }
        _tile_release();
    }
    return failed ? -1 : 0;
}
#else
int prefill_attention_amx(const uint16_t *q, int64_t qs, const uint16_t *k, int64_t ks, const uint16_t *v, int64_t vs,
                          uint16_t *out, int64_t os, int64_t qlen, int64_t t, const int64_t *slots, int64_t kv_rows,
                          int64_t heads, int64_t kv_heads, int64_t dim, float scale, int64_t num_threads) {
    (void)q, (void)qs, (void)k, (void)ks, (void)v, (void)vs, (void)out, (void)os, (void)qlen, (void)t, (void)slots;
    (void)kv_rows, (void)heads;
    (void)kv_heads, (void)dim, (void)scale, (void)num_threads;
    return -3; /* built without AVX-512 or a compiler that knows AMX */
}
#endif
