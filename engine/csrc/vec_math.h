/* Vector math shared by the CPU kernels (included by each source). */
#ifndef PDSERVE_VEC_MATH_H
#define PDSERVE_VEC_MATH_H

typedef float v16 __attribute__((vector_size(64), aligned(4))); /* 16 floats, any 4-byte alignment */
typedef int v16i __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32), aligned(4))); /* 8 floats: one AVX2 register */
typedef int v8i __attribute__((vector_size(32)));

/* e^x lane by lane, for 16 lanes (vexp) and for 8 (vexp8). Range reduction x = n ln2 + r,
 * |r| <= ln2/2, then a degree-7 Taylor polynomial (truncation < 1e-8 relative) and 2^n from the
 * exponent bits. Inputs are clamped to [-87.3, 88]: below gives e^-87.3 (~1e-38, nothing next to 1),
 * above stays finite. libm's expf once per element cost more than reading the whole KV cache in
 * decode attention. */
#define PDSERVE_VEXP(name, V, VI)                                                  \
    static inline __attribute__((always_inline)) V name(V x) {                     \
        VI lo = x < -87.3f, hi = x > 88.0f;                                        \
        x = (V)(((VI)x & ~lo) | ((VI)((V){0} - 87.3f) & lo));                      \
        x = (V)(((VI)x & ~hi) | ((VI)((V){0} + 88.0f) & hi));                      \
        const V magic = (V){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds */ \
        V n = (x * 1.44269504088896341f + magic) - magic;                          \
        V r = x - n * 0.693359375f;                                                \
        r = r + n * 2.12194440e-4f;                                                \
        V p = (V){0} + (1.0f / 5040.0f);                                           \
        p = p * r + (1.0f / 720.0f);                                               \
        p = p * r + (1.0f / 120.0f);                                               \
        p = p * r + (1.0f / 24.0f);                                                \
        p = p * r + (1.0f / 6.0f);                                                 \
        p = p * r + 0.5f;                                                          \
        p = p * r + 1.0f;                                                          \
        p = p * r + 1.0f;                                                          \
        VI bits = (__builtin_convertvector(n, VI) + 127) << 23;                    \
        return p * (V)bits;                                                        \
    }
PDSERVE_VEXP(vexp, v16, v16i)
PDSERVE_VEXP(vexp8, v8, v8i)

/* The machine's own vector: 16 floats with AVX-512, else 8 (AVX2 has 16 registers of 8 floats; code
 * on 16-float vectors there lowered compares and blends to scalar code with branches). */
#if defined(__AVX512F__)
typedef v16 vn;
typedef v16i vni;
#define VN 16
#define vexpn vexp
#else
typedef v8 vn;
typedef v8i vni;
#define VN 8
#define vexpn vexp8
#endif

#endif
