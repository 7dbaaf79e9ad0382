/* Structured output's token mask on fp32 logits: logits[rows[i], t] = -inf where bit t (least significant
 * first, 32 tokens per word) of mask row i is 0, the packing llguidance and xgrammar write.
 *
 * Unpacking the mask with PyTorch ops makes a vocabulary-sized tensor per step of the unpack; this reads each
 * word once and touches only the tokens a word forbids, so a row inside a JSON string (most tokens allowed)
 * costs almost nothing (bench/kernels_bench.py measures both). */
#include <math.h>
#include <stdint.h>

void apply_token_bitmask(float *logits, int64_t row_stride, const int32_t *mask, int64_t words,
                         const int64_t *rows, int64_t num_rows, int64_t vocab) {
    for (int64_t i = 0; i < num_rows; i++) {
        float *x = logits + rows[i] * row_stride;
        const uint32_t *m = (const uint32_t *)(mask + i * words);
        for (int64_t w = 0; w < words; w++) {
            const uint32_t bits = m[w];
            if (bits == 0xffffffffu) continue;
            const int64_t base = w * 32;
            const int64_t end = base + 32 < vocab ? base + 32 : vocab;
            if (bits == 0) { /* a whole word forbidden: a plain fill the compiler vectorises */
                for (int64_t t = base; t < end; t++) x[t] = -INFINITY;
                continue;
            }
            for (int64_t t = base; t < end; t++)
                if (!((bits >> (t - base)) & 1u)) x[t] = -INFINITY;
        }
        for (int64_t t = words * 32; t < vocab; t++) x[t] = -INFINITY; /* beyond the mask: never allowed */
    }
}
