/* Eight floats as one vector (GCC/Clang vector extensions: AVX registers where the target has them, pairs of SSE
 * registers or scalars elsewhere), shared by the kernels that stream fp32 rows. Unaligned loads and stores go
 * through memcpy, which compiles to one vector move. */
#ifndef QWENSERVE_VEC8_H
#define QWENSERVE_VEC8_H

#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

#endif
