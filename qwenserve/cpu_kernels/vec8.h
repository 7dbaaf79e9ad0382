/* Eight floats as one vector (GCC/Clang vector extensions: AVX registers where the target has them, pairs of SSE
 * registers or scalars elsewhere), shared by the kernels that stream fp32 rows. Unaligned loads and stores go
 * through memcpy, which compiles to one vector move. */
#ifndef QWENSERVE_VEC8_H
#define QWENSERVE_VEC8_H

#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* Eight bf16 values (their bits as uint16_t) widened to fp32: a bf16 is the upper half of an fp32, so widening is
 * a zero-extension and a shift (one vpmovzxwd and one vpslld with AVX2). */
#if defined(__AVX2__)
#include <immintrin.h>
static inline v8f load8_bf16(const uint16_t *p) {
    const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return (v8f)_mm256_castsi256_ps(u);
}
#else
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));
static inline v8f load8_bf16(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    const v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f v;
    memcpy(&v, &u, sizeof v);
    return v;
}
#endif

static inline float widen_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Nearest even, NaN kept a quiet NaN: PyTorch's float -> bf16 conversion. */
static inline uint16_t round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif
