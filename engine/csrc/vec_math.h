/* Vector math shared by the CPU kernels (included by each source). */
#ifndef PDSERVE_VEC_MATH_H
#define PDSERVE_VEC_MATH_H

typedef float v16 __attribute__((vector_size(64), aligned(4))); /* 16 floats, any 4-byte alignment */
typedef int v16i __attribute__((vector_size(64)));

/* e^x for 16 lanes. Range reduction x = n ln2 + r, |r| <= ln2/2, then a degree-7 Taylor polynomial
 * (truncation < 1e-8 relative) and 2^n from the exponent bits. Inputs are clamped to [-87.3, 88]:
 * below gives e^-87.3 (~1e-38, nothing next to 1), above stays finite. libm's expf once per element
 * cost more than reading the whole KV cache in decode attention. */
static inline __attribute__((always_inline)) v16 vexp(v16 x) {
    v16i lo = x < -87.3f, hi = x > 88.0f;
    x = (v16)(((v16i)x & ~lo) | ((v16i)((v16){0} - 87.3f) & lo));
    x = (v16)(((v16i)x & ~hi) | ((v16i)((v16){0} + 88.0f) & hi));
    const v16 magic = (v16){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    v16 n = (x * 1.44269504088896341f + magic) - magic;
    v16 r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    v16 p = (v16){0} + (1.0f / 5040.0f);
    p = p * r + (1.0f / 720.0f);
    p = p * r + (1.0f / 120.0f);
    p = p * r + (1.0f / 24.0f);
    p = p * r + (1.0f / 6.0f);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    return p * (v16)bits;
}

#endif
