/* The small per-token ops of a Llama-family layer, fused, for CPU fp32.
 *
 * Between its matmuls, a layer runs a dozen tensor ops per token: rotary embedding (two multiplies,
 * a negation, a concatenation and an add, each for q and k), the KV-cache write (an indexed store),
 * residual adds and RMSNorms (five ops each), SiLU and a multiply. Each op is a pass over memory and
 * a dispatch through torch; together they cost 10-15% of a batch-64 decode step on 2 cores. Here
 * each group is one pass.
 *
 * Rounding: compiled with -ffp-contract=off, so no multiply-add is fused and the rotary embedding
 * and the residual adds round exactly as torch's elementwise ops do (bit-identical). RMSNorm sums
 * its squares in a different order than torch's reduction, and SiLU uses its own exp: both can
 * differ from torch in the last bit.
 */
#include <math.h>
#include <stdint.h>

#include "kv_types.h"

/* Rotary embedding of one head (HF's `x * cos + rotate_half(x) * sin`, rotate_half(x) = cat(-x2, x1)),
 * from `x` into `y` (may alias). */
static inline void rope_head(const float *x, float *y, const float *cos, const float *sin, int d) {
    const int h = d / 2;
    float tmp[512];
    for (int i = 0; i < h; i++) {
        tmp[i] = x[i] * cos[i] - x[i + h] * sin[i];
        tmp[i + h] = x[i + h] * cos[i + h] + x[i] * sin[i + h];
    }
    for (int i = 0; i < d; i++) y[i] = tmp[i];
}

/* qkv: [T, (heads + 2 kv_heads) * head_dim], the fused projection's output. For every token: its q
 * heads rotated into q_out [T, heads, head_dim]; its k heads rotated in place; then k and v stored
 * in the cache at (slot_blocks[t], slot_offsets[t]), as the cache's element type `kv_kind`
 * (kv_types.h). k_cache/v_cache point at this layer's K/V plane of block 0; block_stride is the
 * distance between blocks, in elements; a block's rows are
 * kv_heads * head_dim apart. cos, sin: [T, head_dim]. head_dim <= 512. */
void pdserve_rope_store(float *qkv, float *q_out, const float *cos, const float *sin, void *k_cache,
                        void *v_cache, int64_t block_stride, const int64_t *slot_blocks,
                        const int64_t *slot_offsets, int T, int heads, int kv_heads, int head_dim, int kv_kind,
                        int num_threads) {
    const int64_t width = (int64_t)(heads + 2 * kv_heads) * head_dim, row = (int64_t)kv_heads * head_dim;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T >= 16)
    for (int t = 0; t < T; t++) {
        float *x = qkv + t * width;
        const float *c = cos + (int64_t)t * head_dim, *s = sin + (int64_t)t * head_dim;
        for (int h = 0; h < heads; h++)
            rope_head(x + (int64_t)h * head_dim, q_out + ((int64_t)t * heads + h) * head_dim, c, s, head_dim);
        float *k = x + (int64_t)heads * head_dim, *v = k + row;
        for (int h = 0; h < kv_heads; h++) rope_head(k + (int64_t)h * head_dim, k + (int64_t)h * head_dim, c, s, head_dim);
        const int64_t at = slot_blocks[t] * block_stride + slot_offsets[t] * row;
        if (kv_kind == KV_BF16) {
            for (int64_t i = 0; i < row; i++) {
                ((uint16_t *)k_cache)[at + i] = bf16_from_f32(k[i]);
                ((uint16_t *)v_cache)[at + i] = bf16_from_f32(v[i]);
            }
        } else if (kv_kind == KV_E5M2) {
            for (int64_t i = 0; i < row; i++) {
                ((uint8_t *)k_cache)[at + i] = e5m2_from_f32(k[i]);
                ((uint8_t *)v_cache)[at + i] = e5m2_from_f32(v[i]);
            }
        } else if (kv_kind == KV_F16) { /* C's conversion rounds to nearest even, as torch's does */
            for (int64_t i = 0; i < row; i++) {
                ((_Float16 *)k_cache)[at + i] = (_Float16)k[i];
                ((_Float16 *)v_cache)[at + i] = (_Float16)v[i];
            }
        } else {
            for (int64_t i = 0; i < row; i++) {
                ((float *)k_cache)[at + i] = k[i];
                ((float *)v_cache)[at + i] = v[i];
            }
        }
    }
}

/* HF's RMSNorm of each of T rows of n floats: y = w * (x * rsqrt(mean(x^2) + eps)), rounded in that
 * order. With `delta`, first x += delta (the residual add, in place). With `y_bf16`, y is bf16 (the
 * input of a bf16 matmul), each value the fp32 result rounded to nearest even, as torch's `.to` does. */
void pdserve_add_rmsnorm(float *x, const float *delta, const float *w, float eps, void *y, int T, int n,
                         int y_bf16, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T >= 16)
    for (int t = 0; t < T; t++) {
        float *xr = x + (int64_t)t * n;
        if (delta) {
            const float *dr = delta + (int64_t)t * n;
            for (int i = 0; i < n; i++) xr[i] = xr[i] + dr[i];
        }
        float sum = 0.0f;
        if (n % VN == 0) {
            vn acc = {0};
            for (int i = 0; i < n; i += VN) {
                const vn a = *(const vn *)(xr + i);
                acc += a * a;
            }
            for (int i = 0; i < VN; i++) sum += acc[i];
        } else {
            for (int i = 0; i < n; i++) sum += xr[i] * xr[i];
        }
        const float r = 1.0f / sqrtf(sum / (float)n + eps);
        if (y_bf16) {
            uint16_t *yr = (uint16_t *)y + (int64_t)t * n;
            for (int i = 0; i < n; i++) yr[i] = bf16_from_f32(w[i] * (xr[i] * r));
        } else {
            float *yr = (float *)y + (int64_t)t * n;
            for (int i = 0; i < n; i++) yr[i] = w[i] * (xr[i] * r);
        }
    }
}

/* gate_up: [T, 2n] (gate, then up); y: [T, n] = silu(gate) * up, silu(g) = g / (1 + e^-g). */
void pdserve_silu_mul(const float *gate_up, float *y, int T, int n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T >= 4)
    for (int t = 0; t < T; t++) {
        const float *g = gate_up + (int64_t)t * 2 * n, *u = g + n;
        float *yr = y + (int64_t)t * n;
        int i = 0;
        for (; i + VN <= n; i += VN) {
            const vn gv = *(const vn *)(g + i);
            *(vn *)(yr + i) = gv / (1.0f + vexpn(-gv)) * *(const vn *)(u + i);
        }
        for (; i < n; i++) yr[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* The same for bf16 gate_up and y (the CPU's bf16 matmul path, whose products come out in bf16):
 * fp32 math, y rounded to nearest even, bit for bit the fp32 kernel above followed by torch's
 * `.to(torch.bfloat16)`, without the fp32 [T, 2n] copy between them (at a 1024-token prefill chunk of
 * SmolLM2, 12 MB written and read back per layer). */
typedef uint32_t vnu __attribute__((vector_size(VN * 4)));
typedef uint16_t vnh __attribute__((vector_size(VN * 2), aligned(2)));

void pdserve_silu_mul_bf16(const uint16_t *gate_up, uint16_t *y, int T, int n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T >= 4)
    for (int t = 0; t < T; t++) {
        const uint16_t *g = gate_up + (int64_t)t * 2 * n, *u = g + n;
        uint16_t *yr = y + (int64_t)t * n;
        int i = 0;
        for (; i + VN <= n; i += VN) {
            const vn gv = (vn)(__builtin_convertvector(*(const vnh *)(g + i), vnu) << 16);
            const vn uv = (vn)(__builtin_convertvector(*(const vnh *)(u + i), vnu) << 16);
            const vn r = gv / (1.0f + vexpn(-gv)) * uv;
            const vnu bits = (vnu)r, nan = (vnu)(r != r);
            const vnu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
            *(vnh *)(yr + i) = __builtin_convertvector((rounded & ~nan) | (0x7FC0u & nan), vnh);
        }
        for (; i < n; i++) {
            const float gi = load1_bf16(g + i);
            yr[i] = bf16_from_f32(gi / (1.0f + expf(-gi)) * load1_bf16(u + i));
        }
    }
}

/* out[r] = the index of the largest of the n floats of row r of x ([rows, n]), the first one where
 * several are equal, and the first NaN where there is one: what torch's argmax returns. Greedy
 * sampling over a 49k-token vocabulary: torch's argmax ran at ~5 GB/s here, a plain max at ~70. */
void pdserve_argmax_rows(const float *x, int64_t *out, int rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 4)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * n;
        /* Pass 1, a vector at a time: the maximum, and whether any element is NaN (x != x). */
        vn mv = (vn){0} - INFINITY;
        vni nan = {0};
        int64_t i = 0;
        for (; i + VN <= n; i += VN) {
            const vn v = *(const vn *)(xr + i);
            const vni gt = v > mv;
            mv = (vn)(((vni)v & gt) | ((vni)mv & ~gt));
            nan |= v != v;
        }
        float m = -INFINITY;
        int has_nan = 0;
        for (int j = 0; j < VN; j++) {
            m = mv[j] > m ? mv[j] : m;
            has_nan |= nan[j] != 0;
        }
        for (; i < n; i++) {
            m = xr[i] > m ? xr[i] : m;
            has_nan |= xr[i] != xr[i];
        }
        /* Pass 2: the first element equal to it (or the first NaN). A row of -inf gives 0. */
        int64_t at = 0;
        for (i = 0; i < n; i++)
            if (has_nan ? xr[i] != xr[i] : xr[i] == m) {
                at = i;
                break;
            }
        out[r] = at;
    }
}
