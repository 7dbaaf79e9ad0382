/* What every AMX kernel here shares: the tile-state permission Linux asks for, the configuration of eight 16-row x
 * 64-byte tiles, and the bf16 products' common step. Included only where the compiler knows AMX (x86-64, AVX-512, GCC 11+). */
#ifndef QWENSERVE_AMX_TILES_H
#define QWENSERVE_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16 /* a tile's rows: of x (A) and of results (C) */
#define AMX_K 32    /* bf16 inputs per tile product: a tile row's 64 bytes */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct amx_tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Linux hands AMX's tile state to a process that asks (once: the permission is process-wide). */
static inline int amx_permitted(void) {
    static int state; /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

/* Tiles 0-7 as 16 rows of 64 bytes, the calling thread's configuration until _tile_release. */
__attribute__((target("amx-tile"))) static inline void amx_configure(void) {
    struct amx_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = AMX_ROWS;
        config.colsb[t] = 64;
    }
    /* GCC does not see ldtilecfg read the struct: inlined into some callers it dropped the stores above (the rows
     * and widths) and the instruction faulted. The barrier makes them happen first. */
    __asm__ volatile("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}


#define AMX_BF16_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
#define STRIP 32            /* output columns per strip: two B tiles */
#define BLOCK_ROWS 32       /* rows per pass: two A tiles */
#define TILE_ELEMS (AMX_ROWS * AMX_K) /* bf16 values per B tile */
/* B's k-blocks prefetched this far ahead: TILELOADD waits on each line it misses, and a few rows' product is all
 * misses (the weights streamed from memory). 32 rows x 6144 x 1024 on the AMX Xeon: 0.89 -> 0.66 ms (oneDNN 1.25). */
#define PREFETCH_KBLOCKS 2

/* Rows [0, rows) of a 32 x 32 fp32 block to y, rounded to bf16 (nearest even) or kept fp32; `width` columns. */
AMX_BF16_TARGET static inline void amx_store_block(const float *c, void *y, int64_t ystride, int fp32, int rows, int width) {
    const __mmask16 lo = width >= 16 ? 0xFFFF : (__mmask16)((1u << width) - 1);
    const __mmask16 hi = width >= 32 ? 0xFFFF : width <= 16 ? 0 : (__mmask16)((1u << (width - 16)) - 1);
    for (int r = 0; r < rows; r++) {
        const __m512 a = _mm512_load_ps(c + r * STRIP), b = _mm512_load_ps(c + r * STRIP + 16);
        if (fp32) {
            float *out = (float *)y + r * ystride;
            _mm512_mask_storeu_ps(out, lo, a);
            _mm512_mask_storeu_ps(out + 16, hi, b);
        } else {
            uint16_t *out = (uint16_t *)y + r * ystride;
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);
            _mm512_mask_storeu_epi16(out, ((__mmask32)hi << 16) | lo, both);
        }
    }
}

/* The products' common step. B: a weight [n, k] in tile order (amx_weight.py): strips of 32 output columns, each
 * strip's k-blocks of 32 inputs in turn, each k-block two B tiles of 16 input pairs x 16 columns. A: 32 rows in
 * tile order, k-blocks of two 16 x 32 tiles (1 KiB each).
 * 32 rows of x in tile order (xt: k-blocks of two 16 x 32 A tiles, 1 KiB each) against one strip's k-blocks, into
 * c [32][32] fp32. */
AMX_BF16_TARGET static inline void amx_strip_block(const uint16_t *xt, const uint16_t *b, int64_t kblocks, float *c) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kblocks; kb++) {
        /* The k-block PREFETCH_KBLOCKS ahead (past the strip's end: the next strip's start, or nothing: a prefetch
         * never faults). */
        const char *ahead = (const char *)(b + (kb + PREFETCH_KBLOCKS) * 2 * TILE_ELEMS);
        for (int line = 0; line < 2 * TILE_ELEMS * 2 / 64; line++) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
        _tile_loadd(4, xt + kb * 2 * TILE_ELEMS, 64);
        _tile_loadd(5, xt + kb * 2 * TILE_ELEMS + TILE_ELEMS, 64);
        _tile_loadd(6, b + kb * 2 * TILE_ELEMS, 64);
        _tile_loadd(7, b + kb * 2 * TILE_ELEMS + TILE_ELEMS, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, STRIP * 4);
    _tile_stored(1, c + 16, STRIP * 4);
    _tile_stored(2, c + AMX_ROWS * STRIP, STRIP * 4);
    _tile_stored(3, c + AMX_ROWS * STRIP + 16, STRIP * 4);
}

/* A buffer grown as needed and kept (thread-local where declared so): scratch a kernel reuses call after call,
 * instead of fresh pages faulted in at every call. */
struct amx_scratch {
    void *data;
    size_t bytes;
};

static inline void *amx_scratch_get(struct amx_scratch *s, size_t bytes) {
    if (bytes > s->bytes) {
        free(s->data);
        s->data = aligned_alloc(64, (bytes + 63) / 64 * 64);
        s->bytes = s->data != NULL ? bytes : 0;
    }
    return s->data;
}

#endif
