/* What every AMX kernel here shares: the tile-state permission Linux asks for, and the configuration of eight
 * 16-row x 64-byte tiles both products use. Included only where the compiler knows AMX (x86-64, AVX-512, GCC 11+). */
#ifndef QWENSERVE_AMX_TILES_H
#define QWENSERVE_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
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
    _tile_loadconfig(&config);
}

#endif
