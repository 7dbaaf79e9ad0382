/* y = x · Wᵀ (a linear layer without bias) on CPU, x and y fp32, against W packed in panels of fp32 or bf16.
 *
 * PackedWeight.pack stores W [n, k] as [n / 16][k][16]: panel q holds, for every column i of x, the 16 weights of
 * output columns 16q..16q+15 side by side. A tile then keeps rows of x × panels of y in accumulators and,
 * at each i, broadcasts x[r][i] against whole panel vectors: no horizontal sums, y stored a vector at a
 * time, and both FMA pipes full at the CPU's widest vectors (bench/kernels_bench.py measures it against
 * PyTorch's BLAS).
 *
 * bf16 panels (linear_packed_bf16) halve the bytes a decode step streams; each panel vector is widened to fp32 in
 * registers (a bf16 is the high half of an fp32) and the arithmetic is the fp32 kernel's, so the result is the
 * fp32 product of the bf16 weights up to summation order. The tiles are written once, in linear_tiles.h. */

#include <stdint.h>
#include <string.h>

/* Pins a value to a register. Left alone, GCC folds the W loads into every multiply-add (memory operands),
 * and each x vector once per row of W: sixteen loads per sixteen FMAs instead of eight, load-bound. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX__) /* without AVX no register holds 32 bytes */
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) (void)0
#endif

#define PANEL 16
#if defined(__AVX512F__)
#define PLANES 16
#elif defined(__AVX__)
#define PLANES 8
#else
#define PLANES 4
#endif
typedef float vecp __attribute__((vector_size(PLANES * 4)));
#define PER_PANEL (PANEL / PLANES)
/* 24 accumulators (6 rows x 4 vectors) where 32 registers exist, 12 (6 x 2) on 16-register AVX2. */
#if (defined(__AVX512F__) || defined(__aarch64__)) && PER_PANEL <= 4
#define TILE_PANELS (4 / PER_PANEL)
#else
#define TILE_PANELS 1
#endif
#define TILE_ROWS 6
#define TILE_VECS (TILE_PANELS * PER_PANEL)

static inline vecp loadp(const float *p) {
    vecp v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* An initializer, which GCC turns into one broadcast (a loop over lanes became sixteen masked inserts). */
#define S4(s) s, s, s, s
#if PLANES == 16
#define SPLAT(s) ((vecp){S4(s), S4(s), S4(s), S4(s)})
#elif PLANES == 8
#define SPLAT(s) ((vecp){S4(s), S4(s)})
#else
#define SPLAT(s) ((vecp){S4(s)})
#endif

/* Pins a panel vector to a register, as IN_REGISTER; "v" admits all 32 AVX-512 registers. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX512F__)
#define PANEL_IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define PANEL_IN_REGISTER(v) IN_REGISTER(v)
#endif

/* A bf16 is the upper 16 bits of an fp32: widening is a zero-extension to 32 bits and a shift. On x86 the
 * intrinsics give one vpmovzxwd and one vpslld; the portable form below made GCC split a 512-bit widening in
 * halves (five instructions). */
#if defined(__AVX512F__) && PLANES == 16
#include <immintrin.h>
static inline vecp loadp_bf16(const uint16_t *p) {
    const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    return (vecp)_mm512_castsi512_ps(u);
}
#elif defined(__AVX2__) && PLANES == 8
#include <immintrin.h>
static inline vecp loadp_bf16(const uint16_t *p) {
    const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return (vecp)_mm256_castsi256_ps(u);
}
#else
typedef uint16_t vech __attribute__((vector_size(PLANES * 2)));
typedef uint32_t vecu __attribute__((vector_size(PLANES * 4)));
static inline vecp loadp_bf16(const uint16_t *p) {
    vech h;
    memcpy(&h, p, sizeof h);
    const vecu u = __builtin_convertvector(h, vecu) << 16;
    vecp v;
    memcpy(&v, &u, sizeof v);
    return v;
}
#endif

#if TILE_PANELS == 4
/* Few rows of x (m <= 16) against short panels (k <= 512, so an fp32 panel stays in L1): each panel is streamed
 * from memory once, for up to 12 rows at a time (passes over the same panel hit L1), with a software prefetch
 * 16 KiB ahead, since the 6-row tiles left the memory idle while they computed on cached panels. bf16 panels keep
 * the same k bound: at k = 1024 the 4-panel tiles read them from memory faster (0.53 against 0.62 ms for a
 * 1024x3072 layer at one row). */
#define TALL_ROWS 12
#define TALL_MAX_M 16
#define TALL_MAX_K 512
#define TALL_PREFETCH_BYTES (16 * 1024)
#else
#define TALL_MAX_M 0
#define TALL_MAX_K 0
#endif
#define GROUP_BYTES (256 * 1024) /* a thread's group of panels, sized for L2 */

#define WEIGHT float
#define LOAD_PANEL(p) loadp(p)
#define TILED(name) name
#include "linear_tiles.h"
#undef WEIGHT
#undef LOAD_PANEL
#undef TILED

#define WEIGHT uint16_t
#define LOAD_PANEL(p) loadp_bf16(p)
#define TILED(name) name##_bf16
#include "linear_tiles.h"
#undef WEIGHT
#undef LOAD_PANEL
#undef TILED
