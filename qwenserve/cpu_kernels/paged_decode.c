/* Decode attention straight from the paged KV cache, for fp32 on CPU.
 *
 * One query token per sequence. Each sequence's keys are read once to score its query heads and its values
 * once to accumulate the output, straight from the cache's blocks. The portable path instead gathers every
 * block into a dense buffer first and then runs SDPA over it, which moves each KV byte three times.
 *
 * Every block id a sequence's context needs is checked against [0, num_blocks) before anything is read: a
 * scheduler bug then becomes an error, not a read outside the cache.
 *
 * Loaded through ctypes by qwenserve/cpu_kernels (no Python or torch headers), so it has no ABI to keep.
 * Threads come from OpenMP: built with -fopenmp and loaded after torch, the library binds to torch's own
 * libgomp and so shares its thread pool (a second pool would spin against torch's between calls). Without
 * OpenMP it runs on the calling thread.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec8.h"

static inline float dot(const float *a, const float *b, int64_t n) {
    v8f acc0 = {0}, acc1 = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 += load8(a + i) * load8(b + i);
        acc1 += load8(a + i + 8) * load8(b + i + 8);
    }
    for (; i + 8 <= n; i += 8) acc0 += load8(a + i) * load8(b + i);
    acc0 += acc1;
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += acc0[j];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float alpha, const float *x, int64_t n) {
    int64_t i = 0;
    v8f va = {alpha, alpha, alpha, alpha, alpha, alpha, alpha, alpha};
    for (; i + 8 <= n; i += 8) store8(y + i, load8(y + i) + va * load8(x + i));
    for (; i < n; i++) y[i] += alpha * x[i];
}

typedef struct {
    const float *q;            /* [batch, heads, dim] */
    const float *k_cache;      /* [blocks, block_size, kv_heads, dim] */
    const float *v_cache;
    const int64_t *block_table; /* [batch, table_stride] */
    int64_t table_stride;
    const int64_t *context_lens; /* [batch] */
    float *out;                /* [batch, heads, dim] */
    int64_t heads, kv_heads, dim, block_size;
    float scale;
} Job;

/* One item: KV heads [h0, h1) of sequence b. Tokens are walked in order and every head of a token is read
 * together, so the reads are one stream per block: a token's heads sit in one contiguous row of the cache,
 * and a walk per head (a 4 KiB stride) would start a new page at each token, where prefetchers stop. */
static void attend(const Job *job, int64_t b, int64_t h0, int64_t h1, float *scores) {
    const int64_t group = job->heads / job->kv_heads, dim = job->dim, bs = job->block_size;
    const int64_t ctx = job->context_lens[b], row = job->kv_heads * dim, nq = (h1 - h0) * group;
    const int64_t *table = job->block_table + b * job->table_stride;
    const float *q = job->q + (b * job->heads + h0 * group) * dim;
    float *out = job->out + (b * job->heads + h0 * group) * dim;
    for (int64_t start = 0, j = 0; start < ctx; start += bs, j++) {
        const float *k = job->k_cache + table[j] * bs * row + h0 * dim;
        const int64_t n = ctx - start < bs ? ctx - start : bs;
        for (int64_t t = 0; t < n; t++, k += row)
            for (int64_t i = 0; i < nq; i++) scores[i * ctx + start + t] = dot(q + i * dim, k + (i / group) * dim, dim);
    }
    float sums[nq];
    for (int64_t i = 0; i < nq; i++) {
        float *s = scores + i * ctx, m = -INFINITY, total = 0.0f;
        for (int64_t t = 0; t < ctx; t++) {
            s[t] *= job->scale;
            m = s[t] > m ? s[t] : m;
        }
        for (int64_t t = 0; t < ctx; t++) {
            s[t] = expf(s[t] - m);
            total += s[t];
        }
        sums[i] = total;
        memset(out + i * dim, 0, sizeof(float) * (size_t)dim);
    }
    for (int64_t start = 0, j = 0; start < ctx; start += bs, j++) {
        const float *v = job->v_cache + table[j] * bs * row + h0 * dim;
        const int64_t n = ctx - start < bs ? ctx - start : bs;
        for (int64_t t = 0; t < n; t++, v += row)
            for (int64_t i = 0; i < nq; i++) axpy(out + i * dim, scores[i * ctx + start + t], v + (i / group) * dim, dim);
    }
    for (int64_t i = 0; i < nq; i++) {
        const float inv = sums[i] > 0.0f ? 1.0f / sums[i] : 0.0f;
        for (int64_t d = 0; d < dim; d++) out[i * dim + d] *= inv;
    }
}

/* Returns 0; -1 when a thread could not allocate its scratch (the output is then incomplete); -2 when a context
 * needs more blocks than its table row holds, or a block id lies outside [0, num_blocks) (nothing is read). */
int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, int64_t num_blocks,
                           const int64_t *block_table, int64_t table_stride, const int64_t *context_lens, float *out,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                           float scale, int64_t num_threads) {
    if (batch <= 0) return 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t used = (context_lens[b] + block_size - 1) / block_size;
        if (context_lens[b] < 0 || used > table_stride) return -2;
        for (int64_t j = 0; j < used; j++) {
            const int64_t id = block_table[b * table_stride + j];
            if (id < 0 || id >= num_blocks) return -2;
        }
    }
    if (num_threads < 1) num_threads = 1;
    /* Whole sequences are the items unless there are fewer of them than threads. */
    int64_t splits = (num_threads + batch - 1) / batch;
    if (splits > kv_heads) splits = kv_heads;
    const int64_t items = batch * splits, per_split = (kv_heads + splits - 1) / splits;
    int64_t max_context = 1;
    for (int64_t b = 0; b < batch; b++) max_context = context_lens[b] > max_context ? context_lens[b] : max_context;
    const Job job = {q, k_cache, v_cache, block_table, table_stride, context_lens, out, heads, kv_heads, dim,
                     block_size, scale};
    int status = 0;
#pragma omp parallel num_threads(num_threads < items ? num_threads : items) reduction(| : status)
    {
        float *scores = malloc(sizeof(float) * (size_t)max_context * (size_t)heads);
        if (!scores) status = -1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int64_t b = item / splits, h0 = (item % splits) * per_split;
            const int64_t h1 = h0 + per_split < kv_heads ? h0 + per_split : kv_heads;
            if (scores && h0 < h1) attend(&job, b, h0, h1, scores);
        }
        free(scores);
    }
    return status;
}
