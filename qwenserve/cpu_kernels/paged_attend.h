/* One sequence's decode attention for one K/V element type, included by paged_decode.c once per type (fp32 and
 * bf16 caches), so both walk the blocks the same way. The includer defines:
 *   KV              the cache element type (float, or uint16_t holding bf16 bits);
 *   LOAD_KV8(p)     one v8f of fp32 from 8 consecutive KVs at p;
 *   KV_FLOAT(x)     one KV as a float;
 *   TYPED(name)     the name of this type's copy of a function (name, name##_bf16).
 * q, the scores and the output are fp32 for both: a bf16 K/V vector is widened in registers and the arithmetic
 * is the fp32 kernel's. */

static inline float TYPED(dot)(const float *a, const KV *b, int64_t n) {
    v8f acc0 = {0}, acc1 = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 += load8(a + i) * LOAD_KV8(b + i);
        acc1 += load8(a + i + 8) * LOAD_KV8(b + i + 8);
    }
    for (; i + 8 <= n; i += 8) acc0 += load8(a + i) * LOAD_KV8(b + i);
    acc0 += acc1;
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += acc0[j];
    for (; i < n; i++) s += a[i] * KV_FLOAT(b[i]);
    return s;
}

static inline void TYPED(axpy)(float *y, float alpha, const KV *x, int64_t n) {
    int64_t i = 0;
    const v8f va = splat8(alpha);
    for (; i + 8 <= n; i += 8) store8(y + i, load8(y + i) + va * LOAD_KV8(x + i));
    for (; i < n; i++) y[i] += alpha * KV_FLOAT(x[i]);
}

/* One item: KV heads [h0, h1) of sequence b. Tokens are walked in order and every head of a token is read
 * together, so the reads are one stream per block: a token's heads sit in one contiguous row of the cache,
 * and a walk per head (a 4 KiB stride) would start a new page at each token, where prefetchers stop. */
static void TYPED(attend)(const Job *job, int64_t b, int64_t h0, int64_t h1, float *scores) {
    const int64_t group = job->heads / job->kv_heads, dim = job->dim, bs = job->block_size;
    const int64_t ctx = job->context_lens[b], row = job->kv_heads * dim, nq = (h1 - h0) * group;
    const int64_t *table = job->block_table + b * job->table_stride;
    const float *q = job->q + (b * job->heads + h0 * group) * dim;
    float *out = job->out + (b * job->heads + h0 * group) * dim;
    for (int64_t start = 0, j = 0; start < ctx; start += bs, j++) {
        const KV *k = (const KV *)job->k_cache + table[j] * bs * row + h0 * dim;
        const int64_t n = ctx - start < bs ? ctx - start : bs;
        for (int64_t t = 0; t < n; t++, k += row)
            for (int64_t i = 0; i < nq; i++)
                scores[i * ctx + start + t] = TYPED(dot)(q + i * dim, k + (i / group) * dim, dim);
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
        const KV *v = (const KV *)job->v_cache + table[j] * bs * row + h0 * dim;
        const int64_t n = ctx - start < bs ? ctx - start : bs;
        for (int64_t t = 0; t < n; t++, v += row)
            for (int64_t i = 0; i < nq; i++)
                TYPED(axpy)(out + i * dim, scores[i * ctx + start + t], v + (i / group) * dim, dim);
    }
    for (int64_t i = 0; i < nq; i++) {
        const float inv = sums[i] > 0.0f ? 1.0f / sums[i] : 0.0f;
        for (int64_t d = 0; d < dim; d++) out[i * dim + d] *= inv;
    }
}
