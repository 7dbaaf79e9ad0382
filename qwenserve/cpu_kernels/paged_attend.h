/* One sequence's decode attention for one K/V element type, included by paged_decode.c once per type (fp32 and
 * bf16 caches), so both walk the blocks the same way. The includer defines:
 *   KV              the cache element type (float, or uint16_t holding bf16 bits);
 *   LOAD_KV_LANES(p) one vexp of fp32 from EXP_LANES consecutive KVs at p;
 *   KV_FLOAT(x)     one KV as a float;
 *   TYPED(name)     the name of this type's copy of a function (name, name##_bf16).
 * q, the scores and the output are fp32 for both: a bf16 K/V vector is widened in registers and the arithmetic
 * is the fp32 kernel's.
 *
 * At a 32-sequence step the cache is read as much as the weights (~1.3 GB at 350 tokens of context for Qwen3-0.6B),
 * so the arithmetic must keep up with memory: each K or V vector is widened once for every query head of its group
 * (G heads at a time, G a constant so their accumulators stay in registers), a dot product is reduced once, the
 * softmax's exp runs EXP_LANES at a time, and each block's weighted V sum is kept in registers before it is added to
 * the output. Per head walks of 8-wide vectors, a scalar reduction per dot and libm's expf per score ran at half
 * the memory's rate. */

/* Scores of G query heads q [G, dim] against one key k [dim], scaled, into scores[g * stride]. */
static inline __attribute__((always_inline)) void TYPED(score_group)(const float *q, const KV *k, int64_t dim,
                                                                     float *scores, int64_t stride, float scale,
                                                                     const int G) {
    vexp acc[4] = {{0}};
    int64_t i = 0;
    for (; i + EXP_LANES <= dim; i += EXP_LANES) {
        const vexp kv = LOAD_KV_LANES(k + i);
        for (int g = 0; g < G; g++) acc[g] += load_lanes(q + g * dim + i) * kv;
    }
    for (int g = 0; g < G; g++) {
        float s = hsum_lanes(acc[g]);
        for (int64_t r = i; r < dim; r++) s += q[g * dim + r] * KV_FLOAT(k[r]);
        scores[g * stride] = s * scale;
    }
}

/* out [G, dim] += sum over n tokens t of p[g * stride + t] * v[t * row .. + dim]: PV_VECS vectors of the head at a
 * time, summed over the block's tokens in registers. */
static inline __attribute__((always_inline)) void TYPED(weigh_group)(float *out, const float *p, int64_t stride,
                                                                     const KV *v, int64_t row, int64_t n,
                                                                     int64_t dim, const int G) {
    int64_t i = 0;
    for (; i + PV_VECS * EXP_LANES <= dim; i += PV_VECS * EXP_LANES) {
        vexp acc[4][PV_VECS] = {{{0}}};
        for (int64_t t = 0; t < n; t++) {
            const KV *vt = v + t * row + i;
            for (int c = 0; c < PV_VECS; c++) {
                const vexp vv = LOAD_KV_LANES(vt + c * EXP_LANES);
                for (int g = 0; g < G; g++) acc[g][c] += p[g * stride + t] * vv;
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < PV_VECS; c++) {
                float *o = out + g * dim + i + c * EXP_LANES;
                const vexp sum = load_lanes(o) + acc[g][c];
                memcpy(o, &sum, sizeof sum);
            }
    }
    for (; i + EXP_LANES <= dim; i += EXP_LANES) {
        vexp acc[4] = {{0}};
        for (int64_t t = 0; t < n; t++) {
            const vexp vv = LOAD_KV_LANES(v + t * row + i);
            for (int g = 0; g < G; g++) acc[g] += p[g * stride + t] * vv;
        }
        for (int g = 0; g < G; g++) {
            const vexp sum = load_lanes(out + g * dim + i) + acc[g];
            memcpy(out + g * dim + i, &sum, sizeof sum);
        }
    }
    for (; i < dim; i++)
        for (int g = 0; g < G; g++) {
            float s = 0.0f;
            for (int64_t t = 0; t < n; t++) s += p[g * stride + t] * KV_FLOAT(v[t * row + i]);
            out[g * dim + i] += s;
        }
}

/* One item: KV heads [h0, h1) of sequence b. Tokens are walked in order and every head of a token is read
 * together, so the reads are one stream per block: a token's heads sit in one contiguous row of the cache,
 * and a walk per head (a 4 KiB stride) would start a new page at each token, where prefetchers stop. */
static void TYPED(attend)(const void *item_job, int64_t b, int64_t h0, int64_t h1, float *scores) {
    const Job *job = item_job;
    const int64_t group = job->heads / job->kv_heads, dim = job->dim, bs = job->block_size;
    const int64_t ctx = job->context_lens[b], row = job->kv_heads * dim, nq = (h1 - h0) * group;
    const int64_t *table = job->block_table + b * job->table_stride;
    const float *q = job->q + (b * job->heads + h0 * group) * dim;
    float *out = job->out + (b * job->heads + h0 * group) * dim;
    for (int64_t start = 0, j = 0; start < ctx; start += bs, j++) {
        const KV *k = (const KV *)job->k_cache + table[j] * bs * row + h0 * dim;
        const int64_t n = ctx - start < bs ? ctx - start : bs, after = ctx - start - n < bs ? ctx - start - n : bs;
        const KV *next = after > 0 ? (const KV *)job->k_cache + table[j + 1] * bs * row + h0 * dim : NULL;
        for (int64_t t = 0; t < n; t++, k += row) {
            /* The next block's row t, as this block's row t is used (prefetch_rows says why). */
            if (t < after) prefetch_rows(next + t * row, 1, 0, (h1 - h0) * dim * (int64_t)sizeof(KV));
            for (int64_t h = 0; h < h1 - h0; h++) {
                const float *qh = q + h * group * dim;
                float *s = scores + h * group * ctx + start + t;
                int64_t g = 0;
                for (; g + 4 <= group; g += 4) TYPED(score_group)(qh + g * dim, k + h * dim, dim, s + g * ctx, ctx,
                                                                  job->scale, 4);
                for (; g + 2 <= group; g += 2) TYPED(score_group)(qh + g * dim, k + h * dim, dim, s + g * ctx, ctx,
                                                                  job->scale, 2);
                for (; g < group; g++) TYPED(score_group)(qh + g * dim, k + h * dim, dim, s + g * ctx, ctx,
                                                          job->scale, 1);
            }
        }
    }
    float sums[nq];
    for (int64_t i = 0; i < nq; i++) {
        sums[i] = softmax_in_place(scores + i * ctx, ctx);
        memset(out + i * dim, 0, sizeof(float) * (size_t)dim);
    }
    for (int64_t start = 0, j = 0; start < ctx; start += bs, j++) {
        const KV *v = (const KV *)job->v_cache + table[j] * bs * row + h0 * dim;
        const int64_t n = ctx - start < bs ? ctx - start : bs, after = ctx - start - n < bs ? ctx - start - n : bs;
        const KV *next = after > 0 ? (const KV *)job->v_cache + table[j + 1] * bs * row + h0 * dim : NULL;
        for (int64_t h = 0; h < h1 - h0; h++) {
            if (next) prefetch_rows(next + h * dim, after, row * (int64_t)sizeof(KV), dim * (int64_t)sizeof(KV));
            float *oh = out + h * group * dim;
            const float *p = scores + h * group * ctx + start;
            int64_t g = 0;
            for (; g + 4 <= group; g += 4) TYPED(weigh_group)(oh + g * dim, p + g * ctx, ctx, v + h * dim, row, n, dim, 4);
            for (; g + 2 <= group; g += 2) TYPED(weigh_group)(oh + g * dim, p + g * ctx, ctx, v + h * dim, row, n, dim, 2);
            for (; g < group; g++) TYPED(weigh_group)(oh + g * dim, p + g * ctx, ctx, v + h * dim, row, n, dim, 1);
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        const float inv = sums[i] > 0.0f ? 1.0f / sums[i] : 0.0f;
        for (int64_t d = 0; d < dim; d++) out[i * dim + d] *= inv;
    }
}
