/* The element types a KV cache can hold, and their conversions to and from fp32.
 *
 * fp32: the model's own precision (the default). bf16: the top half of an fp32, and fp16: IEEE
 * half precision, both half the bytes. fp8 e5m2: the top byte of an fp16, a quarter of the bytes.
 * Decode attention is bound by reading the cache, so fewer bytes per element is a faster step; the
 * math stays fp32.
 * Stores round to nearest even exactly as torch's `.to(dtype)` does (tests compare bit for bit).
 */
#ifndef PDSERVE_KV_TYPES_H
#define PDSERVE_KV_TYPES_H

#if defined(__AVX512F__) || defined(__F16C__) /* x86 intrinsics; other CPUs take the portable code */
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

typedef uint16_t v16u16 __attribute__((vector_size(32), aligned(2)));
typedef uint8_t v16u8 __attribute__((vector_size(16), aligned(1)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef _Float16 v16f16 __attribute__((vector_size(32)));

enum { KV_F32 = 0, KV_BF16 = 1, KV_E5M2 = 2, KV_F16 = 3 };

static inline __attribute__((always_inline)) uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline __attribute__((always_inline)) float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* 16 elements to fp32. */
static inline __attribute__((always_inline)) v16 load16_f32(const float *p) { return *(const v16 *)p; }

static inline __attribute__((always_inline)) v16 load16_bf16(const uint16_t *p) {
    return (v16)(__builtin_convertvector(*(const v16u16 *)p, v16u32) << 16);
}

/* 16 fp16 (as their bits) to fp32. NOTE: GCC's __builtin_convertvector from _Float16 converts one
 * lane at a time (measured: decode attention on an fp8 cache read 2.8 GB/s); the vcvtph2ps intrinsics
 * do 16 (AVX-512) or 8 (F16C) at once. */
static inline __attribute__((always_inline)) v16 f16_bits_to_f32(v16u16 h) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtph_ps((__m256i)h);
#elif defined(__F16C__)
    const __m256i x = (__m256i)h;
    const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(x)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(x, 1));
    v16 r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
#else
    return __builtin_convertvector((v16f16)h, v16);
#endif
}

static inline __attribute__((always_inline)) v16 load16_f16(const _Float16 *p) {
    v16u16 h;
    memcpy(&h, p, 32);
    return f16_bits_to_f32(h);
}

static inline __attribute__((always_inline)) v16 load16_e5m2(const uint8_t *p) {
    return f16_bits_to_f32(__builtin_convertvector(*(const v16u8 *)p, v16u16) << 8); /* the fp16 it is the top of */
}

/* 8 elements to fp32, in order: the unit of the decode kernel where vector registers hold 8 floats
 * (AVX2 has 16 of them; 16-float vectors there take two each, and the kernel's accumulators spilled). */
typedef uint16_t v8u16 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef uint8_t v8u8 __attribute__((vector_size(8), aligned(1)));
typedef _Float16 v8f16 __attribute__((vector_size(16)));

static inline __attribute__((always_inline)) v8 load8_f32(const float *p) { return *(const v8 *)p; }

static inline __attribute__((always_inline)) v8 load8_bf16(const uint16_t *p) {
    return (v8)(__builtin_convertvector(*(const v8u16 *)p, v8u32) << 16);
}

static inline __attribute__((always_inline)) v8 f16x8_bits_to_f32(v8u16 h) {
#if defined(__F16C__)
    const __m256 r = _mm256_cvtph_ps((__m128i)h);
    v8 x;
    memcpy(&x, &r, 32);
    return x;
#else
    return __builtin_convertvector((v8f16)h, v8);
#endif
}

static inline __attribute__((always_inline)) v8 load8_f16(const _Float16 *p) {
    v8u16 h;
    memcpy(&h, p, 16);
    return f16x8_bits_to_f32(h);
}

static inline __attribute__((always_inline)) v8 load8_e5m2(const uint8_t *p) {
    return f16x8_bits_to_f32(__builtin_convertvector(*(const v8u8 *)p, v8u16) << 8);
}

/* One element to fp32. */
static inline __attribute__((always_inline)) float load1_f32(const float *p) { return *p; }
static inline __attribute__((always_inline)) float load1_bf16(const uint16_t *p) { return f32_from_bits((uint32_t)*p << 16); }
static inline __attribute__((always_inline)) float load1_f16(const _Float16 *p) { return (float)*p; }
static inline __attribute__((always_inline)) float load1_e5m2(const uint8_t *p) {
    const uint16_t h = (uint16_t)((uint16_t)*p << 8);
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

/* fp32 to bf16, round to nearest even; NaN stays a (quiet) NaN. */
static inline uint16_t bf16_from_f32(float f) {
    if (f != f) return 0x7FC0;
    const uint32_t u = f32_bits(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* fp32 to fp8 e5m2 (5 exponent bits, bias 15, 2 mantissa bits, with inf and NaN), round to nearest
 * even, straight from fp32 (not through fp16, which would round twice); past the largest finite
 * value (57344) it rounds to inf, as torch does. */
static inline uint8_t e5m2_from_f32(float f) {
    uint32_t u = f32_bits(f);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t r;
    if (u >= (143u << 23)) { /* |f| >= 65536 (rounds past the max), inf or NaN */
        r = u > (255u << 23) ? 0x7F : 0x7C;
    } else if (u < (113u << 23)) { /* below the smallest normal (2^-14): the subnormals, by float addition */
        const uint32_t denorm = 134u << 23; /* 2^7: adding it leaves the subnormal bits at the bottom */
        r = (uint8_t)(f32_bits(f32_from_bits(u) + f32_from_bits(denorm)) - denorm);
    } else {
        u += ((uint32_t)(15 - 127) << 23) + 0xFFFFFu + ((u >> 21) & 1u); /* rebias, round to nearest even */
        r = (uint8_t)(u >> 21);
    }
    return (uint8_t)(r | (sign >> 24));
}

#endif
