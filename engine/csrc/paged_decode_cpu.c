/* Decode attention on CPU straight from the paged KV cache (fp32, bf16, fp16 or fp8 e5m2 elements).
 *
 * One query token per sequence. Each sequence is one work item: for every token of its context, the
 * K row of all KV heads is read once from its block (no gather into a contiguous copy, no padding) and
 * dotted with the `group` query heads that share each KV head; then a softmax per query head; then the
 * V rows, read once the same way. The cache is read once per step, which is what bounds decode on a
 * CPU: the old path gathered every block into a workspace (a read and a write) before SDPA read it again.
 *
 * Layout (engine/model_runner.py): cache [num_blocks, layers, 2, block_size, kv_heads, head_dim];
 * `k`/`v` point at this layer's K/V plane of block 0 and `block_stride` is the distance between
 * blocks, in elements. The body is `paged_decode_impl.h`, instantiated once per KV element type
 * (kv_types.h); queries, scores and outputs are fp32 in all of them. Built with -fopenmp but linked
 * to the libgomp torch already loaded, so it shares torch's thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_types.h"

static inline __attribute__((always_inline)) float hsum16(v16 x) {
    x += __builtin_shuffle(x, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x += __builtin_shuffle(x, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return x[0];
}

/* The lane sums of four vectors, stored to out[0..3]: three rounds of shuffles and adds for the four,
 * where one hsum16 each takes four rounds apiece. */
static inline __attribute__((always_inline)) void hsum4x16(v16 a, v16 b, v16 c, v16 d, float *out) {
    const v16 ab = __builtin_shuffle(a, b, (v16i){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
                   __builtin_shuffle(a, b, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    const v16 cd = __builtin_shuffle(c, d, (v16i){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
                   __builtin_shuffle(c, d, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    /* lanes 4i..4i+3: four partial sums of vector i (a, b, c, d) */
    v16 x = __builtin_shuffle(ab, cd, (v16i){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
            __builtin_shuffle(ab, cd, (v16i){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
    x += __builtin_shuffle(x, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    x += __builtin_shuffle(x, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    const v16 r = __builtin_shuffle(x, (v16i){0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12});
    memcpy(out, &r, 16);
}

/* The same for 8-float vectors (the kernel's unit without AVX-512): out[i] = the lane sum of the i-th. */
static inline __attribute__((always_inline)) float hsum8(v8 x) {
    x += __builtin_shuffle(x, (v8i){4, 5, 6, 7, 0, 1, 2, 3});
    x += __builtin_shuffle(x, (v8i){2, 3, 0, 1, 6, 7, 4, 5});
    x += __builtin_shuffle(x, (v8i){1, 0, 3, 2, 5, 4, 7, 6});
    return x[0];
}

#if defined(__AVX512F__)
#define hsumn hsum16
#else
#define hsumn hsum8
#endif

static inline __attribute__((always_inline)) void hsum4x8(v8 a, v8 b, v8 c, v8 d, float *out) {
    /* lanes 0-3: four partial sums of a, 4-7: of b (then c, d) */
    const v8 ab = __builtin_shuffle(a, b, (v8i){0, 1, 2, 3, 8, 9, 10, 11}) + __builtin_shuffle(a, b, (v8i){4, 5, 6, 7, 12, 13, 14, 15});
    const v8 cd = __builtin_shuffle(c, d, (v8i){0, 1, 2, 3, 8, 9, 10, 11}) + __builtin_shuffle(c, d, (v8i){4, 5, 6, 7, 12, 13, 14, 15});
    /* two partial sums each, in the order a a b b c c d d */
    v8 x = __builtin_shuffle(ab, cd, (v8i){0, 1, 4, 5, 8, 9, 12, 13}) + __builtin_shuffle(ab, cd, (v8i){2, 3, 6, 7, 10, 11, 14, 15});
    x += __builtin_shuffle(x, (v8i){1, 0, 3, 2, 5, 4, 7, 6});
    out[0] = x[0], out[1] = x[2], out[2] = x[4], out[3] = x[6];
}

/* 32 elements to fp32, as two vectors whose lanes may hold the elements in another order: PERM[j]
 * is the element in lane j of the pair (lanes 16-31: the second vector). Dot products and weighted
 * sums of rows do not care about the order, as long as the query is permuted the same way and the
 * output permuted back; narrow types then widen with one unpack per vector instead of a zero-extend,
 * an insert and a shift. */
static const int perm_identity[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                      16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};

static inline __attribute__((always_inline)) void load32_f32(const float *p, v16 *a, v16 *b) {
    *a = load16_f32(p);
    *b = load16_f32(p + 16);
}

static inline __attribute__((always_inline)) void load32_f16(const _Float16 *p, v16 *a, v16 *b) {
    *a = load16_f16(p);
    *b = load16_f16(p + 16);
}

#if defined(__AVX512BW__)
/* bf16: interleaving zero words below each bf16 word makes it the top half of an fp32; the unpack
 * works within 128-bit lanes (4 words of 8 each go to the low vector). */
static const int perm_bf16[32] = {0, 1, 2,  3,  8,  9,  10, 11, 16, 17, 18, 19, 24, 25, 26, 27,
                                  4, 5, 6,  7,  12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};

static inline __attribute__((always_inline)) void load32_bf16(const uint16_t *p, v16 *a, v16 *b) {
    const __m512i x = _mm512_loadu_si512((const void *)p), z = _mm512_setzero_si512();
    *a = (v16)_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, x));
    *b = (v16)_mm512_castsi512_ps(_mm512_unpackhi_epi16(z, x));
}

/* fp8 e5m2: a zero byte below each makes it an fp16 (8 of each 16 bytes to the low half), then one
 * vcvtph2ps per 16. */
static const int perm_e5m2[32] = {0, 1, 2,  3,  4,  5,  6,  7,  16, 17, 18, 19, 20, 21, 22, 23,
                                  8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};

static inline __attribute__((always_inline)) void load32_e5m2(const uint8_t *p, v16 *a, v16 *b) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)p), z = _mm256_setzero_si256();
    *a = (v16)_mm512_cvtph_ps(_mm256_unpacklo_epi8(z, x));
    *b = (v16)_mm512_cvtph_ps(_mm256_unpackhi_epi8(z, x));
}
#else
#define perm_bf16 perm_identity
#define perm_e5m2 perm_identity
static inline __attribute__((always_inline)) void load32_bf16(const uint16_t *p, v16 *a, v16 *b) {
    *a = load16_bf16(p);
    *b = load16_bf16(p + 16);
}
static inline __attribute__((always_inline)) void load32_e5m2(const uint8_t *p, v16 *a, v16 *b) {
    *a = load16_e5m2(p);
    *b = load16_e5m2(p + 16);
}
#endif

#define KV_T float
#define KV_NAME(x) x##_f32
#define KV_LOAD32 load32_f32
#define KV_PERM perm_identity
#define KV_LOAD1 load1_f32
#define KV_LOAD8 load8_f32
#include "paged_decode_impl.h"

#define KV_T uint16_t
#define KV_NAME(x) x##_bf16
#define KV_LOAD32 load32_bf16
#define KV_PERM perm_bf16
#define KV_LOAD1 load1_bf16
#define KV_LOAD8 load8_bf16
#include "paged_decode_impl.h"

#define KV_T uint8_t
#define KV_NAME(x) x##_e5m2
#define KV_LOAD32 load32_e5m2
#define KV_PERM perm_e5m2
#define KV_LOAD1 load1_e5m2
#define KV_LOAD8 load8_e5m2
#include "paged_decode_impl.h"

#define KV_T _Float16
#define KV_NAME(x) x##_f16
#define KV_LOAD32 load32_f16
#define KV_PERM perm_identity
#define KV_LOAD1 load1_f16
#define KV_LOAD8 load8_f16
#include "paged_decode_impl.h"
