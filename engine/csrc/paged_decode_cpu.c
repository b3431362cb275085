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

#include "kv_types.h"

static inline __attribute__((always_inline)) float hsum16(v16 x) {
    x += __builtin_shuffle(x, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x += __builtin_shuffle(x, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return x[0];
}

#define KV_T float
#define KV_NAME(x) x##_f32
#define KV_LOAD16 load16_f32
#define KV_LOAD1 load1_f32
#include "paged_decode_impl.h"

#define KV_T uint16_t
#define KV_NAME(x) x##_bf16
#define KV_LOAD16 load16_bf16
#define KV_LOAD1 load1_bf16
#include "paged_decode_impl.h"

#define KV_T uint8_t
#define KV_NAME(x) x##_e5m2
#define KV_LOAD16 load16_e5m2
#define KV_LOAD1 load1_e5m2
#include "paged_decode_impl.h"

#define KV_T _Float16
#define KV_NAME(x) x##_f16
#define KV_LOAD16 load16_f16
#define KV_LOAD1 load1_f16
#include "paged_decode_impl.h"
