/* Decode attention on CPU straight from the paged KV cache (fp32).
 *
 * One query token per sequence. Each sequence is one work item: for every token of its context, the
 * K row of all KV heads is read once from its block (no gather into a contiguous copy, no padding) and
 * dotted with the `group` query heads that share each KV head; then a softmax per query head; then the
 * V rows, read once the same way. The cache is read once per step, which is what bounds decode on a
 * CPU: the old path gathered every block into a workspace (a read and a write) before SDPA read it again.
 *
 * Layout (engine/model_runner.py): cache [num_blocks, layers, 2, block_size, kv_heads, head_dim];
 * `k`/`v` point at this layer's K/V plane of block 0 and `block_stride` is the distance between
 * blocks, in floats. Built with -fopenmp but linked to the libgomp torch already loaded, so it shares
 * torch's thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec_math.h"

static inline __attribute__((always_inline)) float hsum16(v16 x) {
    x += __builtin_shuffle(x, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x += __builtin_shuffle(x, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return x[0];
}

static inline __attribute__((always_inline)) float dot(const float *restrict a, const float *restrict b, int n) {
    if ((n & 15) == 0) { /* whole vectors: one horizontal sum per dot */
        v16 acc = {0};
        for (int i = 0; i < n; i += 16) acc += *(const v16 *)(a + i) * *(const v16 *)(b + i);
        return hsum16(acc);
    }
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline __attribute__((always_inline)) void axpy(float *restrict y, float a, const float *restrict x, int n) {
    if ((n & 15) == 0) {
        for (int i = 0; i < n; i += 16) *(v16 *)(y + i) += a * *(const v16 *)(x + i);
        return;
    }
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* One sequence, one KV head and the `G` query heads that share it, head_dim = 16 * D4. G and D4 are
 * constants at each call site (see DISPATCH), so the queries and the output stay in vector registers
 * while the sequence's K rows, then its V rows, stream past once. `k`/`v` point at this KV head's
 * slice of block 0; `row` is the distance between consecutive tokens of a block.
 * NOTE: the next block is prefetched into L2 (locality 1), not L1: measured at batch 64 x 274 tokens,
 * 30 layers replayed from DRAM, 1.14 vs 1.58 ms a layer; L1 prefetches seem to queue behind the demand
 * misses of the current block. A whole-row prefetch (every KV head) or two blocks ahead gained nothing. */
static inline __attribute__((always_inline)) void attend_group(
    const float *restrict qs, float *restrict os, const float *k, const float *v, int64_t block_stride,
    const int32_t *table, int len, int block_size, int64_t row, float scale, float *restrict scores, const int G,
    const int D4) {
    v16 qv[G][D4];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < D4; i++) qv[g][i] = *(const v16 *)(qs + g * 16 * D4 + 16 * i) * scale;
    for (int b = 0, t = 0; t < len; b++) {
        const float *kb = k + (int64_t)table[b] * block_stride;
        const int cnt = len - t < block_size ? len - t : block_size;
        const float *kn = t + block_size < len ? k + (int64_t)table[b + 1] * block_stride : kb;
        for (int o = 0; o < cnt; o++, t++) {
            const float *kr = kb + o * row;
            for (int i = 0; i < D4; i++) __builtin_prefetch(kn + o * row + 16 * i, 0, 1);
            v16 acc[G];
            const v16 k0 = *(const v16 *)kr;
            for (int g = 0; g < G; g++) acc[g] = qv[g][0] * k0;
            for (int i = 1; i < D4; i++) {
                const v16 ki = *(const v16 *)(kr + 16 * i);
                for (int g = 0; g < G; g++) acc[g] += qv[g][i] * ki;
            }
            for (int g = 0; g < G; g++) scores[g * ((len + 15) & ~15) + t] = hsum16(acc[g]);
        }
    }
    const int ls = (len + 15) & ~15; /* each head's scores start on a whole vector */
    for (int g = 0; g < G; g++) {
        float *sc = scores + g * ls;
        float m = -INFINITY;
        for (int t = 0; t < len; t++) m = sc[t] > m ? sc[t] : m;
        for (int t = len; t < ls; t++) sc[t] = m; /* padding: exponentiated, then zeroed below */
        v16 sum = {0};
        for (int t = 0; t < ls; t += 16) {
            v16 e = vexp(*(v16 *)(sc + t) - m);
            if (t + 16 > len)
                for (int j = len - t; j < 16; j++) e[j] = 0.0f;
            *(v16 *)(sc + t) = e;
            sum += e;
        }
        const float inv = 1.0f / hsum16(sum);
        for (int t = 0; t < len; t++) sc[t] *= inv;
    }
    v16 ov[G][D4];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < D4; i++) ov[g][i] = (v16){0};
    for (int b = 0, t = 0; t < len; b++) {
        const float *vb = v + (int64_t)table[b] * block_stride;
        const int cnt = len - t < block_size ? len - t : block_size;
        const float *vn = t + block_size < len ? v + (int64_t)table[b + 1] * block_stride : vb;
        for (int o = 0; o < cnt; o++, t++) {
            const float *vr = vb + o * row;
            for (int i = 0; i < D4; i++) __builtin_prefetch(vn + o * row + 16 * i, 0, 1);
            for (int i = 0; i < D4; i++) {
                const v16 vi = *(const v16 *)(vr + 16 * i);
                for (int g = 0; g < G; g++) ov[g][i] += scores[g * ls + t] * vi;
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < D4; i++) *(v16 *)(os + g * 16 * D4 + 16 * i) = ov[g][i];
}

#define ATTEND(G_, D4_)                                                                                     \
    if (group == (G_) && head_dim == 16 * (D4_)) {                                                          \
        for (int kh = 0; kh < kv_heads; kh++)                                                               \
            attend_group(qs + (int64_t)kh * (G_) * head_dim, os + (int64_t)kh * (G_) * head_dim,            \
                         k + (int64_t)kh * head_dim, v + (int64_t)kh * head_dim, block_stride, table, len,  \
                         block_size, row, scale, scores, (G_), (D4_));                                      \
        continue;                                                                                           \
    }
#define ATTEND_D(G_) ATTEND(G_, 2) ATTEND(G_, 4) ATTEND(G_, 8)

/* q, out: [n, heads, head_dim] contiguous; tables: [n, table_stride] int32 block ids; lens: [n] context
 * length of each sequence (its new token included, already written to the cache). Returns 0, or -1 when
 * scratch could not be allocated (the caller falls back). */
int pdserve_paged_decode(const float *q, float *out, const float *k, const float *v, int64_t block_stride,
                         const int32_t *tables, int64_t table_stride, const int32_t *lens, int n, int heads,
                         int kv_heads, int head_dim, int block_size, float scale, int num_threads) {
    const int group = heads / kv_heads;
    const int64_t row = (int64_t)kv_heads * head_dim; /* one token's K (or V) for all KV heads */
    int max_len = 0;
    for (int s = 0; s < n; s++) max_len = lens[s] > max_len ? lens[s] : max_len;
    int failed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)heads * (size_t)((max_len + 15) & ~15) + 64);
        if (scores == NULL) failed = 1;
        /* Every thread must reach the worksharing loop; one without scratch skips its share. */
#pragma omp for schedule(dynamic, 1)
            for (int s = 0; s < n; s++) {
                if (scores == NULL) continue;
                const int len = lens[s];
                const int32_t *table = tables + (int64_t)s * table_stride;
                const float *qs = q + (int64_t)s * heads * head_dim;
                float *os = out + (int64_t)s * heads * head_dim;
                /* Common shapes (head_dim 32/64/128, up to 8 query heads per KV head): the register path. */
                ATTEND_D(1) ATTEND_D(2) ATTEND_D(3) ATTEND_D(4) ATTEND_D(5) ATTEND_D(6) ATTEND_D(7) ATTEND_D(8)
                /* scores[h * len + t] = scale * q_h . k_t */
                for (int t = 0; t < len; t++) {
                    const int b = t / block_size, o = t - b * block_size;
                    const float *kt = k + (int64_t)table[b] * block_stride + (int64_t)o * row;
                    for (int kh = 0; kh < kv_heads; kh++) {
                        const float *kr = kt + (int64_t)kh * head_dim;
                        for (int g = 0; g < group; g++) {
                            const int h = kh * group + g;
                            scores[(int64_t)h * len + t] = scale * dot(qs + (int64_t)h * head_dim, kr, head_dim);
                        }
                    }
                }
                for (int h = 0; h < heads; h++) {
                    float *sc = scores + (int64_t)h * len;
                    float m = -INFINITY;
                    for (int t = 0; t < len; t++) m = sc[t] > m ? sc[t] : m;
                    float sum = 0.0f;
                    for (int t = 0; t < len; t++) {
                        sc[t] = expf(sc[t] - m);
                        sum += sc[t];
                    }
                    const float inv = 1.0f / sum;
                    for (int t = 0; t < len; t++) sc[t] *= inv;
                    float *oh = os + (int64_t)h * head_dim;
                    for (int d = 0; d < head_dim; d++) oh[d] = 0.0f;
                }
                for (int t = 0; t < len; t++) {
                    const int b = t / block_size, o = t - b * block_size;
                    const float *vt = v + (int64_t)table[b] * block_stride + (int64_t)o * row;
                    for (int kh = 0; kh < kv_heads; kh++) {
                        const float *vr = vt + (int64_t)kh * head_dim;
                        for (int g = 0; g < group; g++) {
                            const int h = kh * group + g;
                            axpy(os + (int64_t)h * head_dim, scores[(int64_t)h * len + t], vr, head_dim);
                        }
                    }
                }
            }
        free(scores);
    }
    return failed ? -1 : 0;
}
