/* y = x · Wᵀ for bf16 x and W on AMX tiles (TDPBF16PS), fp32 sums rounded once to bf16 or kept in fp32: the
 * product of a step's many rows (prefill chunks, decode batches of 16 and more) where PyTorch's (oneDNN's) bf16
 * product is the alternative the start-up probe weighs it against (linear_probe.py).
 *
 * Layout (amx_weight.py packs it once at load): W [n, k] as strips of 32 output columns, each strip every k-block
 * of 32 inputs in turn, each k-block two B tiles (columns 0-15 and 16-31 of the strip) of 16 rows, row p holding
 * inputs 2p and 2p + 1 of the tile's 16 columns side by side (the pairs TDPBF16PS reads):
 *   tiles [n32 / 32][k / 32][2][16][16][2], n32 = n rounded up to 32 with zero columns; k a multiple of 32.
 * A strip's k-blocks are contiguous, so a few rows' product streams each strip once from memory in order (the
 * hardware prefetcher follows it, helped by software prefetches).
 *
 * Work: blocks of rows (X_BLOCK_BYTES of x, held in L2) x STRIPS_PER_ITEM strips, spread over the threads. Within
 * one, each strip meets every 32 rows of the block while it is in L2, with 2 x 2 C tiles (32 rows x 32 columns)
 * accumulated over all of k: 4 tile loads per 4 tile products. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__GNUC__) && __GNUC__ >= 11
#include "amx_tiles.h"
/* The bytes of x a work item covers: its rows stay in L2 (2 MiB on the AMX Xeon) while each strip streams past them
 * once, so the more rows, the fewer times the weight is read. 0.6B's linears at 2,048 rows, in one process against
 * 512 KiB: 0.84-0.94x the time over three runs (1.5, 2 and 4 MiB slower than 1); the same at 32 to 512 rows. */
#define X_BLOCK_BYTES (1 << 20)
#define STRIPS_PER_ITEM 4   /* strips a work item covers */

/* x's rows in tile order: one buffer per calling thread (the OpenMP team reads it). */
static __thread struct amx_scratch rows_scratch;

/* Rows [0, rows) of a 32 x 32 fp32 block to y as bf16, each row one whole, aligned line, stored around the caches
 * (non-temporal): a plain store first reads the line it overwrites (a 2,048-row gate/up product's 25 MB output, read
 * to be replaced), and rows n x 2 bytes apart fell into a few of L1's sets. 0.6B's 2,000-token prefill, alternating
 * processes: 0.84-0.90x the time (the products alone: 0.76-0.82x at qkv and gate/up). */
AMX_BF16_TARGET static inline void stream_block_bf16(const float *c, uint16_t *y, int64_t ystride, int rows) {
    for (int r = 0; r < rows; r++)
        _mm512_stream_si512((__m512i *)(y + r * ystride),
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(c + r * STRIP + 16), _mm512_load_ps(c + r * STRIP)));
}

/* y [m, n] (row stride n; bf16, or fp32 where `y_fp32`) = x [m, k] (bf16, row stride x_stride) times the tiles.
 * x is first copied into tile order (blocks of 32 rows, zero rows past m), so an A tile loads 1 KiB in one piece:
 * straight from rows 2 KiB apart, the 32 rows of two A tiles fell into two of L1's sets and evicted each other.
 * Returns 0; -1 when scratch cannot be allocated; -3 when this cannot run here (k not a multiple of 32, or the
 * kernel refuses the tile state): the caller multiplies another way. */
AMX_BF16_TARGET int linear_bf16_amx(const uint16_t *x, int64_t x_stride, const uint16_t *tiles, void *y,
                                    int64_t y_fp32, int64_t m, int64_t k, int64_t n, int64_t num_threads) {
    if (k % AMX_K != 0 || k == 0 || !amx_permitted()) return -3;
    if (num_threads < 1) num_threads = 1;
    const int64_t strips = (n + STRIP - 1) / STRIP, kblocks = k / AMX_K, row_blocks = (m + BLOCK_ROWS - 1) / BLOCK_ROWS;
    /* rows a work item covers: a multiple of 32, at least 32 */
    const int64_t fit = X_BLOCK_BYTES / (2 * k) / BLOCK_ROWS * BLOCK_ROWS, mblock = fit > 0 ? fit : BLOCK_ROWS;
    const int64_t row_items = (m + mblock - 1) / mblock, strip_items = (strips + STRIPS_PER_ITEM - 1) / STRIPS_PER_ITEM;
    const size_t elem = y_fp32 ? 4 : 2;
    uint16_t *xt = amx_scratch_get(&rows_scratch, (size_t)(row_blocks * BLOCK_ROWS * k) * 2);
    if (xt == NULL) return -1;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t rb = 0; rb < row_blocks; rb++)
            for (int r = 0; r < BLOCK_ROWS; r++) {
                uint16_t *to = xt + rb * BLOCK_ROWS * k + (r / AMX_ROWS) * TILE_ELEMS + (r % AMX_ROWS) * AMX_K;
                const int64_t row = rb * BLOCK_ROWS + r;
                for (int64_t kb = 0; kb < kblocks; kb++, to += 2 * TILE_ELEMS) {
                    if (row < m)
                        _mm512_store_si512((__m512i *)to, _mm512_loadu_si512(x + row * x_stride + kb * AMX_K));
                    else
                        _mm512_store_si512((__m512i *)to, _mm512_setzero_si512());
                }
            }
        amx_configure();
        float c[BLOCK_ROWS * STRIP] __attribute__((aligned(64)));
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t ri = 0; ri < row_items; ri++)
            for (int64_t si = 0; si < strip_items; si++) {
                const int64_t row_end = (ri + 1) * mblock < m ? (ri + 1) * mblock : m;
                const int64_t strip_end = (si + 1) * STRIPS_PER_ITEM < strips ? (si + 1) * STRIPS_PER_ITEM : strips;
                for (int64_t s = si * STRIPS_PER_ITEM; s < strip_end; s++) {
                    const uint16_t *b = tiles + s * kblocks * 2 * TILE_ELEMS;
                    const int width = n - s * STRIP < STRIP ? (int)(n - s * STRIP) : STRIP;
                    for (int64_t r0 = ri * mblock; r0 < row_end; r0 += BLOCK_ROWS) {
                        const int rows = row_end - r0 < BLOCK_ROWS ? (int)(row_end - r0) : BLOCK_ROWS;
                        amx_strip_block(xt + r0 * k, b, kblocks, c);
                        char *out = (char *)y + (size_t)(r0 * n + s * STRIP) * elem;
                        if (!y_fp32 && width == STRIP && ((uintptr_t)out & 63) == 0 && (n * 2) % 64 == 0)
                            stream_block_bf16(c, (uint16_t *)out, n, rows);
                        else
                            amx_store_block(c, out, n, (int)y_fp32, rows, width);
                    }
                }
            }
        _tile_release();
        _mm_sfence(); /* the streamed lines are written before the caller reads y */
    }
    return 0;
}
#else
int linear_bf16_amx(const uint16_t *x, int64_t x_stride, const uint16_t *tiles, void *y, int64_t y_fp32, int64_t m,
                    int64_t k, int64_t n, int64_t num_threads) {
    (void)x, (void)x_stride, (void)tiles, (void)y, (void)y_fp32, (void)m, (void)k, (void)n, (void)num_threads;
    return -3; /* built without AVX-512 or a compiler that knows AMX */
}
#endif
