/* One decode token of the gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) for a batch of sequences, fp32.
 *
 * Per sequence and value head, with S the [dk, dv] recurrent matrix in its state slot:
 *     S = exp(g) S;   u = beta (v - k S);   S = S + kᵀ u;   o = q S
 * PyTorch runs this as batched products over a gathered copy of every slot, then scatters the copies back: six or
 * more passes over megabytes of state per layer, with allocations. Here each matrix is read twice and written once,
 * in place (64 KiB for dk = dv = 128, so the second pass reads from L2).
 *
 * Every slot is checked against [0, num_slots) before anything is touched: a scheduler bug becomes an error.
 * Threads come from OpenMP, shared with torch's pool (see paged_decode.c).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec8.h"

/* acc[j] += a * (decay * row[j]): the prediction k S from the decayed matrix, rounded as the reference. */
static void predict_row(float *acc, float a, float decay, const float *row, int64_t n) {
    v8f va = splat8(a), vd = splat8(decay);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) store8(acc + j, load8(acc + j) + va * (vd * load8(row + j)));
    for (; j < n; j++) acc[j] += a * (decay * row[j]);
}

/* row = decay * row + a * u, then o += q_i * row. */
static void update_row(float *row, float decay, float a, const float *u, float qi, float *o, int64_t n) {
    v8f vd = splat8(decay), va = splat8(a), vq = splat8(qi);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        v8f r = vd * load8(row + j) + va * load8(u + j);
        store8(row + j, r);
        store8(o + j, load8(o + j) + vq * r);
    }
    for (; j < n; j++) {
        float r = decay * row[j] + a * u[j];
        row[j] = r;
        o[j] += qi * r;
    }
}

/* q, k [batch, heads, dk]; v [batch, heads, dv]; g, beta [batch, heads]; states [num_slots, heads, dk, dv],
 * updated in place at slots[b]; out [batch, heads, dv]. Returns 0, or -2 when a slot is out of range, or -1
 * when dv is too large for the stack scratch. */
int gated_delta_step(const float *q, const float *k, const float *v, const float *g, const float *beta,
                     float *states, int64_t num_slots, const int64_t *slots, float *out, int64_t batch,
                     int64_t heads, int64_t dk, int64_t dv, int threads) {
    for (int64_t b = 0; b < batch; b++)
        if (slots[b] < 0 || slots[b] >= num_slots) return -2;
    if (dv > 4096) return -1;
    (void)threads;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < heads; h++) {
            float u[dv];
            const int64_t bh = b * heads + h;
            float *s = states + (slots[b] * heads + h) * dk * dv;
            const float *qh = q + bh * dk, *kh = k + bh * dk, *vh = v + bh * dv;
            float *o = out + bh * dv;
            const float decay = expf(g[bh]), bt = beta[bh];
            memset(u, 0, sizeof(float) * dv);
            for (int64_t i = 0; i < dk; i++) predict_row(u, kh[i], decay, s + i * dv, dv);
            for (int64_t j = 0; j < dv; j++) u[j] = (vh[j] - u[j]) * bt;
            memset(o, 0, sizeof(float) * dv);
            for (int64_t i = 0; i < dk; i++) update_row(s + i * dv, decay, kh[i], u, qh[i], o, dv);
        }
    }
    return 0;
}
