/* EXP_LANES floats as one vector (GCC/Clang vector extensions) and what the kernels do with it: exp lane by lane, a
 * horizontal sum, unaligned loads of fp32 and of bf16 widened. Sixteen (one register) where AVX-512 is compiled in,
 * eight elsewhere: a 64-byte vector on AVX2 is two registers that GCC moves through the stack at every bit cast, which
 * ran decode attention over a bf16 cache at 2 GB/s on an AVX2-only EPYC. */
#ifndef QWENSERVE_VEXP_H
#define QWENSERVE_VEXP_H

#include <stdint.h>
#include <string.h>

/* exp(x) for a vector of floats: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by Cephes' degree-6 polynomial, times 2^n
 * built in the exponent bits; within about an ulp of expf over [-87.3, 88.7] (inf above, 2^-126 below). libm's expf is a
 * call per value, which made silu the costliest of these kernels at a 32-row decode step. */
#if defined(__AVX512F__)
#define EXP_LANES 16
#else
#define EXP_LANES 8
#endif
typedef float vexp __attribute__((vector_size(EXP_LANES * 4)));
typedef int32_t vexpi __attribute__((vector_size(EXP_LANES * 4)));

/* *v = exp(*v), in place (a vector argument or result would change the ABI where the vector is wider than the
 * target's registers). */
static inline __attribute__((always_inline)) void exp_lanes(vexp *v) {
    const vexp zero = {0.0f}, hi = zero + 88.3762626647949f, lo = zero - 87.3365447505531f;
    vexpi above = (vexpi)(*v > hi), below = (vexpi)(*v < lo);
    vexp x = (vexp)(((vexpi)hi & above) | ((vexpi)*v & ~above));
    x = (vexp)(((vexpi)lo & below) | ((vexpi)x & ~below));
    const vexp fx = x * 1.44269504088896341f + 0.5f;
    vexpi n = __builtin_convertvector(fx, vexpi); /* toward zero: one less where that rounded up */
    n += (vexpi)(__builtin_convertvector(n, vexp) > fx);
    const vexp fn = __builtin_convertvector(n, vexp);
    const vexp r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    vexp y = r * 1.9875691500E-4f + 1.3981999507E-3f;
    y = y * r + 8.3334519073E-3f;
    y = y * r + 4.1665795894E-2f;
    y = y * r + 1.6666665459E-1f;
    y = y * r + 5.0000001201E-1f;
    y = y * r * r + r + 1.0f;
    y *= (vexp)((n + 127) << 23);
    const vexpi overflow = (vexpi)(*v > 88.7228391f); /* past FLT_MAX: inf, as expf (silu(-100) is then -0) */
    *v = (vexp)(((vexpi)(zero + __builtin_inff()) & overflow) | ((vexpi)y & ~overflow));
}

typedef uint16_t vexph __attribute__((vector_size(EXP_LANES * 2)));
typedef uint32_t vexpu __attribute__((vector_size(EXP_LANES * 4)));

static inline __attribute__((always_inline)) vexp load_lanes(const float *p) {
    vexp v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* EXP_LANES bf16 values (their bits) widened to fp32: a zero-extension and a shift. */
static inline __attribute__((always_inline)) vexp load_lanes_bf16(const uint16_t *p) {
    vexph h;
    memcpy(&h, p, sizeof h);
    const vexpu u = __builtin_convertvector(h, vexpu) << 16;
    vexp v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* The sum of the lanes: sixteen folded to eight, then eight in pairs (the same order for both widths' last eight),
 * in registers: through memory, a wide store read back in halves stalls each call (a head's RMSNorm waited on it). */
typedef float vexp8 __attribute__((vector_size(32)));
typedef float vexp4 __attribute__((vector_size(16)));
typedef float vexp2 __attribute__((vector_size(8)));
static inline __attribute__((always_inline)) float hsum_lanes(vexp v) {
#if EXP_LANES == 16
    const vexp8 s = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
                    + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const vexp8 s = v;
#endif
    /* ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)) */
    const vexp4 b = __builtin_shufflevector(s, s, 0, 1, 2, 3) + __builtin_shufflevector(s, s, 4, 5, 6, 7);
    const vexp2 c = __builtin_shufflevector(b, b, 0, 2) + __builtin_shufflevector(b, b, 1, 3);
    return c[0] + c[1];
}

#endif
