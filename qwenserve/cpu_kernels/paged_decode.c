/* Decode attention straight from the paged KV cache, for fp32 queries on CPU over an fp32 or a bf16 cache.
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
#include "vexp.h"

/* Vectors of a head summed in registers at once in the weighted V sum: 4 x 4 accumulators fill half of AVX-512's 32
 * registers; AVX2's 16 take 2 x 4 (8-lane vectors there, vexp.h). */
#if defined(__AVX512F__)
#define PV_VECS 4
#else
#define PV_VECS 2
#endif

typedef struct {
    const float *q;            /* [batch, heads, dim] */
    const void *k_cache;       /* [blocks, block_size, kv_heads, dim] of fp32 or bf16 */
    const void *v_cache;
    const int64_t *block_table; /* [batch, table_stride] */
    int64_t table_stride;
    const int64_t *context_lens; /* [batch] */
    float *out;                /* [batch, heads, dim] */
    int64_t heads, kv_heads, dim, block_size;
    float scale;
} Job;

/* s[0..n) = exp(s - max s) in place; returns their sum. */
static float softmax_in_place(float *s, int64_t n) {
    float m = -INFINITY;
    int64_t t = 0;
    if (n >= EXP_LANES) {
        vexp mv = load_lanes(s);
        for (t = EXP_LANES; t + EXP_LANES <= n; t += EXP_LANES) {
            const vexp x = load_lanes(s + t);
            const vexpi more = (vexpi)(x > mv);
            mv = (vexp)(((vexpi)x & more) | ((vexpi)mv & ~more));
        }
        for (int l = 0; l < EXP_LANES; l++) m = mv[l] > m ? mv[l] : m;
    }
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    vexp total = {0};
    for (t = 0; t + EXP_LANES <= n; t += EXP_LANES) {
        vexp x = load_lanes(s + t) - m;
        exp_lanes(&x);
        memcpy(s + t, &x, sizeof x);
        total += x;
    }
    float sum = hsum_lanes(total);
    for (; t < n; t++) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    return sum;
}

/* Asks for n rows of `bytes` at p (`stride` bytes apart) to be brought into the cache ahead of use: the next block's,
 * whose address only the block table knows, so no hardware prefetcher runs ahead into it (1.3-1.5x the KV read
 * rate on an AMX Xeon). */
/* Rows of a coming block, into L2 (prefetcht1) and a few at a time as the current block's rows are used: a whole
 * block's worth into L1 at once filled the line-fill buffers, and the core waited on the prefetch instructions
 * themselves (40% of the bf16 kernel's samples; 32 sequences x 450 tokens: 1.16x with the prefetches spread into L2). */
static inline void prefetch_rows(const void *p, int64_t n, int64_t stride, int64_t bytes) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + t * stride + off, 0, 2);
}

typedef void (*AttendFn)(const void *job, int64_t b, int64_t h0, int64_t h1, float *scratch);

#define KV float
#define LOAD_KV_LANES(p) load_lanes(p)
#define KV_FLOAT(x) (x)
#define TYPED(name) name
#include "paged_attend.h"
#undef KV
#undef LOAD_KV_LANES
#undef KV_FLOAT
#undef TYPED

#define KV uint16_t
#define LOAD_KV_LANES(p) load_lanes_bf16(p)
#define KV_FLOAT(x) widen_bf16(x)
#define TYPED(name) name##_bf16
#include "paged_attend.h"
#undef KV
#undef LOAD_KV_LANES
#undef KV_FLOAT
#undef TYPED

#if defined(__AVX512BF16__)
#include "paged_attend_dp.h"
#endif

/* 0, or -2 when a context needs more blocks than its table row holds or a block id lies outside [0, num_blocks). */
static int check_tables(int64_t num_blocks, const int64_t *block_table, int64_t table_stride,
                        const int64_t *context_lens, int64_t batch, int64_t block_size) {
    for (int64_t b = 0; b < batch; b++) {
        const int64_t used = (context_lens[b] + block_size - 1) / block_size;
        if (context_lens[b] < 0 || used > table_stride) return -2;
        for (int64_t j = 0; j < used; j++) {
            const int64_t id = block_table[b * table_stride + j];
            if (id < 0 || id >= num_blocks) return -2;
        }
    }
    return 0;
}

/* `attend` over every (sequence, KV heads) item, each thread with scratch for every head's scores and outputs.
 * Returns 0, or -1 when a thread could not allocate its scratch (the output is then incomplete). */
static int run_items(AttendFn attend, const void *job, const int64_t *context_lens, int64_t batch, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
    /* Whole sequences are the items unless there are fewer of them than threads. */
    int64_t splits = (num_threads + batch - 1) / batch;
    if (splits > kv_heads) splits = kv_heads;
    const int64_t items = batch * splits, per_split = (kv_heads + splits - 1) / splits;
    int64_t max_context = 1;
    for (int64_t b = 0; b < batch; b++) max_context = context_lens[b] > max_context ? context_lens[b] : max_context;
    int status = 0;
#pragma omp parallel num_threads(num_threads < items ? num_threads : items) reduction(| : status)
    {
        float *scratch = malloc(sizeof(float) * (size_t)(max_context + dim) * (size_t)heads);
        if (!scratch) status = -1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int64_t b = item / splits, h0 = (item % splits) * per_split;
            const int64_t h1 = h0 + per_split < kv_heads ? h0 + per_split : kv_heads;
            if (scratch && h0 < h1) attend(job, b, h0, h1, scratch);
        }
        free(scratch);
    }
    return status;
}

/* Returns 0; -1 when a thread could not allocate its scratch (the output is then incomplete); -2 when a context
 * needs more blocks than its table row holds, or a block id lies outside [0, num_blocks) (nothing is read). */
static int run(AttendFn attend, const float *q, const void *k_cache, const void *v_cache, int64_t num_blocks,
               const int64_t *block_table, int64_t table_stride, const int64_t *context_lens, float *out, int64_t batch,
               int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int64_t num_threads) {
    if (batch <= 0) return 0;
    if (check_tables(num_blocks, block_table, table_stride, context_lens, batch, block_size)) return -2;
    const Job job = {q, k_cache, v_cache, block_table, table_stride, context_lens, out, heads, kv_heads, dim,
                     block_size, scale};
    return run_items(attend, &job, context_lens, batch, heads, kv_heads, dim, num_threads);
}

int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache, int64_t num_blocks,
                           const int64_t *block_table, int64_t table_stride, const int64_t *context_lens, float *out,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                           float scale, int64_t num_threads) {
    return run(attend, q, k_cache, v_cache, num_blocks, block_table, table_stride, context_lens, out, batch, heads,
               kv_heads, dim, block_size, scale, num_threads);
}

/* The same over a bf16 cache (bf16 bits as uint16_t): half the bytes a decode step reads from the cache. */
int paged_decode_attention_bf16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache, int64_t num_blocks,
                                const int64_t *block_table, int64_t table_stride, const int64_t *context_lens,
                                float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                int64_t block_size, float scale, int64_t num_threads) {
    return run(attend_bf16, q, k_cache, v_cache, num_blocks, block_table, table_stride, context_lens, out, batch,
               heads, kv_heads, dim, block_size, scale, num_threads);
}

/* Whether paged_decode_attention_bf16_dp serves heads of this dim in this object. */
int paged_decode_dp_supports(int64_t dim) {
#if defined(__AVX512BF16__)
    return dim % 32 == 0 && dim >= 32 && dim <= 32 * DP_MAX_CHUNKS;
#else
    (void)dim;
    return 0;
#endif
}

/* A bf16 model's decode attention, bf16 q [batch] rows of [heads, dim] (q_stride apart) over a bf16 cache into bf16
 * out (out_stride apart), with AVX512_BF16's dot product (paged_attend_dp.h) where paged_decode_dp_supports(dim);
 * statuses as run()'s, and -3 where it does not. */
int paged_decode_attention_bf16_dp(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                   const uint16_t *v_cache, int64_t num_blocks, const int64_t *block_table,
                                   int64_t table_stride, const int64_t *context_lens, uint16_t *out,
                                   int64_t out_stride, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                   int64_t block_size, float scale, int64_t num_threads) {
    if (!paged_decode_dp_supports(dim)) return -3;
    if (batch <= 0) return 0;
    if (check_tables(num_blocks, block_table, table_stride, context_lens, batch, block_size)) return -2;
#if defined(__AVX512BF16__)
    const DpJob job = {q, q_stride, k_cache, v_cache, block_table, table_stride, context_lens, out, out_stride, heads,
                       kv_heads, dim, block_size, scale};
    return run_items(attend_dp, &job, context_lens, batch, heads, kv_heads, dim, num_threads);
#else
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)out, (void)out_stride, (void)heads, (void)kv_heads;
    (void)scale, (void)num_threads;
    return -3;
#endif
}
