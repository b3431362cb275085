/* Body of the paged decode kernel, for one KV element type. Included by paged_decode_cpu.c once per
 * type, with KV_T (the element), KV_NAME(x) (x with the type's suffix), KV_LOAD32 (32 elements to
 * two fp32 vectors, lanes in the order KV_PERM) and KV_LOAD1 (one element to fp32) defined; they are
 * undefined at the end. No include guard: on purpose. */

/* One sequence, every KV head, head_dim = 16 * D4 and G query heads per KV head. G and D4 are
 * constants at each call site (see ATTEND), so one KV head's queries (then its outputs) sit in vector
 * registers while the rows of a block stream past. The blocks are walked in order and each is read
 * whole, all its KV heads before the next block: a block's K (or V) plane of a layer is one contiguous
 * run of block_size rows of kv_heads * head_dim elements, which the hardware streams far better than
 * the head_dim-wide slices of every row that one KV head at a time reads (measured below). `k`/`v`
 * point at this layer's K/V plane of block 0; `row` is the distance between consecutive tokens of a
 * block. `scores` holds heads x ((len + 15) & ~15) floats, `acc` heads x head_dim.
 * NOTE: rows are prefetched two blocks ahead, into L2 (locality 1), not L1: L1 prefetches seem to
 * queue behind the demand misses of the current block. The K pass's last blocks prefetch the first V
 * blocks, the V pass's the first K blocks of the thread's next sequence (`next_table`): then no block
 * is read cold (at 274 tokens, 4 of 36 blocks were: -6% bf16, -10% fp8 from DRAM).
 * Two blocks ahead against one, interleaved (batch 128 x 274 tokens, scattered blocks, 30 layers):
 * fp32 88.2 vs 89.4 ms, bf16 47.9 vs 51.3, fp8 40.2 vs 43.3 (when this kernel still read one KV head
 * at a time); three ahead no better.
 * NOTE: the register arrays are sized for the largest G and D4 (8, 8), not [G][D4]: G and D4 are
 * function parameters, so [G][D4] arrays are variable-length, and GCC keeps those on the stack even
 * where G and D4 are constants after inlining: the V pass then loaded and stored its accumulators
 * around every FMA (1.3x slower per row, L2-resident). Fixed sizes with constant indices after
 * unrolling become registers. */
/* One K row of one KV head (`kr`, head_dim = 16 * D4) against its G queries `qv`: a[g] holds the
 * products, still to be summed across lanes. Prefetches the same row of a later block (`pf`). */
static inline __attribute__((always_inline)) void KV_NAME(dot_row)(const KV_T *kr, const KV_T *pf, v16 qv[8][8],
                                                                   v16 a[8], const int G, const int D4) {
    v16 x0, x1;
    for (int i = 0; i < 16 * D4; i += 64 / (int)sizeof(KV_T)) __builtin_prefetch(pf + i, 0, 1);
    KV_LOAD32(kr, &x0, &x1);
    for (int g = 0; g < G; g++) a[g] = qv[g][0] * x0 + qv[g][1] * x1;
    for (int i = 2; i < D4; i += 2) {
        KV_LOAD32(kr + 16 * i, &x0, &x1);
        for (int g = 0; g < G; g++) a[g] += qv[g][i] * x0 + qv[g][i + 1] * x1;
    }
}

#if !defined(__AVX512F__)
/* Without AVX-512 the unit is an 8-float vector (AVX2: 16 registers of 8). The two passes of
 * attend_seq over one block, written so their accumulators fit in those registers: the 16-float form
 * keeps G x head_dim/16 queries and 4 x G accumulators of two registers each live, which spilled on
 * every FMA (decode attention read 4.4 GB/s, slower than the one-element-at-a-time kernel). Here the
 * queries are read from L1 (a memory operand of the FMA) and the V pass takes the row in slices of CW
 * vectors, so G x CW accumulators stay in registers. */
static inline __attribute__((always_inline)) void KV_NAME(k_block8)(const KV_T *kb, const KV_T *kn, const float *qs,
                                                                    float *sc0, int ls, int cnt, int64_t row,
                                                                    int kv_heads, const int G, const int D8) {
    const int line = 64 / (int)sizeof(KV_T), hd = 8 * D8;
    for (int kh = 0; kh < kv_heads; kh++) {
        const float *q = qs + (int64_t)kh * G * hd;
        const KV_T *kr = kb + kh * hd, *pf = kn + kh * hd;
        float *sc = sc0 + (int64_t)kh * G * ls;
        int o = 0;
        if (G <= 3) /* four rows at a time, summed across lanes together: 4 x G accumulators */
            for (; o + 4 <= cnt; o += 4) {
                v8 a[4][8];
                for (int r = 0; r < 4; r++)
                    for (int i = 0; i < hd; i += line) __builtin_prefetch(pf + (o + r) * row + i, 0, 1);
                for (int r = 0; r < 4; r++) {
                    const v8 x = KV_LOAD8(kr + (o + r) * row);
                    for (int g = 0; g < G; g++) a[r][g] = *(const v8 *)(q + g * hd) * x;
                }
                for (int i = 1; i < D8; i++)
                    for (int r = 0; r < 4; r++) {
                        const v8 x = KV_LOAD8(kr + (o + r) * row + 8 * i);
                        for (int g = 0; g < G; g++) a[r][g] += *(const v8 *)(q + g * hd + 8 * i) * x;
                    }
                for (int g = 0; g < G; g++) hsum4x8(a[0][g], a[1][g], a[2][g], a[3][g], sc + g * ls + o);
            }
        for (; o < cnt; o++) {
            v8 a[8];
            for (int i = 0; i < hd; i += line) __builtin_prefetch(pf + o * row + i, 0, 1);
            const v8 x0 = KV_LOAD8(kr + o * row);
            for (int g = 0; g < G; g++) a[g] = *(const v8 *)(q + g * hd) * x0;
            for (int i = 1; i < D8; i++) {
                const v8 x = KV_LOAD8(kr + o * row + 8 * i);
                for (int g = 0; g < G; g++) a[g] += *(const v8 *)(q + g * hd + 8 * i) * x;
            }
            for (int g = 0; g < G; g++) sc[g * ls + o] = hsum8(a[g]);
        }
    }
}

static inline __attribute__((always_inline)) void KV_NAME(v_block8)(const KV_T *vb, const KV_T *vpf, float *acc,
                                                                    const float *sc0, int ls, int cnt, int64_t row,
                                                                    int kv_heads, const int G, const int D8) {
    const int line = 64 / (int)sizeof(KV_T), hd = 8 * D8;
    int CW = G == 1 ? 8 : G == 2 ? 4 : G <= 4 ? 2 : 1; /* G x CW <= 8 accumulators */
    if (D8 % CW) CW = 4; /* D8 is a multiple of 4 (head_dim of 32s) */
    for (int kh = 0; kh < kv_heads; kh++) {
        float *ah = acc + (int64_t)kh * G * hd;
        const float *sc = sc0 + (int64_t)kh * G * ls;
        const KV_T *vr = vb + kh * hd, *pf = vpf + kh * hd;
        for (int c = 0; c < D8; c += CW) {
            v8 ov[8][8];
            for (int g = 0; g < G; g++)
                for (int j = 0; j < CW; j++) ov[g][j] = *(const v8 *)(ah + g * hd + 8 * (c + j));
            for (int o = 0; o < cnt; o++) {
                if (c == 0)
                    for (int i = 0; i < hd; i += line) __builtin_prefetch(pf + o * row + i, 0, 1);
                for (int j = 0; j < CW; j++) {
                    const v8 x = KV_LOAD8(vr + o * row + 8 * (c + j));
                    for (int g = 0; g < G; g++) ov[g][j] += sc[g * ls + o] * x;
                }
            }
            for (int g = 0; g < G; g++)
                for (int j = 0; j < CW; j++) *(v8 *)(ah + g * hd + 8 * (c + j)) = ov[g][j];
        }
    }
}
#endif

static inline __attribute__((always_inline)) void KV_NAME(attend_seq)(
    const float *restrict qs, float *restrict os, const KV_T *k, const KV_T *v, int64_t block_stride,
    const int32_t *table, int len, const int32_t *next_table, int next_len, int block_size, int kv_heads,
    float scale, float *restrict scores, float *restrict acc, const int G, const int D4) {
    const int hd = 16 * D4, heads = kv_heads * G;
    const int64_t row = (int64_t)kv_heads * hd;
    const int ls = (len + 15) & ~15; /* each head's scores start on a whole vector */
    const int nb = (len + block_size - 1) / block_size, next_nb = (next_len + block_size - 1) / block_size;
    /* The queries, scaled, in the lane order of KV_LOAD32: chunk c of 32 is vectors 2c and 2c + 1. */
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < D4; i++)
            for (int j = 0; j < 16; j++)
                acc[h * hd + 16 * i + j] = qs[h * hd + 32 * (i / 2) + KV_PERM[16 * (i & 1) + j]] * scale;
    for (int b = 0, t0 = 0; t0 < len; b++, t0 += block_size) {
        const KV_T *kb = k + (int64_t)table[b] * block_stride;
        const int cnt = len - t0 < block_size ? len - t0 : block_size;
        /* the block to prefetch: two ahead, running on into the V blocks at the end */
        const KV_T *kn = b + 2 < nb ? k + (int64_t)table[b + 2] * block_stride
                         : b + 2 - nb < nb ? v + (int64_t)table[b + 2 - nb] * block_stride : kb;
#if !defined(__AVX512F__)
        KV_NAME(k_block8)(kb, kn, acc, scores + t0, ls, cnt, row, kv_heads, G, 2 * D4);
#else
        for (int kh = 0; kh < kv_heads; kh++) {
            v16 qv[8][8];
            for (int g = 0; g < G; g++)
                for (int i = 0; i < D4; i++) qv[g][i] = *(const v16 *)(acc + (kh * G + g) * hd + 16 * i);
            float *sc = scores + (int64_t)kh * G * ls + t0;
            int o = 0;
            /* Four rows at a time: their dot products are summed across lanes together (hsum4x16). */
            for (; o + 4 <= cnt; o += 4) {
                v16 a[4][8];
                for (int r = 0; r < 4; r++)
                    KV_NAME(dot_row)(kb + (o + r) * row + kh * hd, kn + (o + r) * row + kh * hd, qv, a[r], G, D4);
                for (int g = 0; g < G; g++) hsum4x16(a[0][g], a[1][g], a[2][g], a[3][g], sc + g * ls + o);
            }
            for (; o < cnt; o++) {
                v16 a[8];
                KV_NAME(dot_row)(kb + o * row + kh * hd, kn + o * row + kh * hd, qv, a, G, D4);
                for (int g = 0; g < G; g++) sc[g * ls + o] = hsum16(a[g]);
            }
        }
#endif
    }
    for (int h = 0; h < heads; h++) {
        float *sc = scores + (int64_t)h * ls;
        /* The max a vector at a time: a scalar running max is a chain of dependent compares, one per
         * score, which cost about as much as the whole V pass. (ls is a multiple of 16, so of VN.) */
        vn mv = (vn){0} - INFINITY;
        int t = 0;
        for (; t + VN <= len; t += VN) {
            const vn x = *(const vn *)(sc + t);
            const vni gt = x > mv;
            mv = (vn)(((vni)x & gt) | ((vni)mv & ~gt));
        }
        float m = -INFINITY;
        for (int j = 0; j < VN; j++) m = mv[j] > m ? mv[j] : m;
        for (; t < len; t++) m = sc[t] > m ? sc[t] : m;
        for (t = len; t < ls; t++) sc[t] = m; /* padding: exponentiated, then zeroed below */
        vn sum = {0};
        for (int t = 0; t < ls; t += VN) {
            vn e = vexpn(*(vn *)(sc + t) - m);
            if (t + VN > len) /* with VN = 8 a whole vector of padding can follow len */
                for (int j = len > t ? len - t : 0; j < VN; j++) e[j] = 0.0f;
            *(vn *)(sc + t) = e;
            sum += e;
        }
        const vn inv = (vn){0} + 1.0f / hsumn(sum);
        for (int t = 0; t < ls; t += VN) *(vn *)(sc + t) *= inv;
    }
    for (int i = 0; i < heads * hd; i++) acc[i] = 0.0f; /* the outputs, permuted like the queries */
    for (int b = 0, t0 = 0; t0 < len; b++, t0 += block_size) {
        const KV_T *vb = v + (int64_t)table[b] * block_stride;
        const int cnt = len - t0 < block_size ? len - t0 : block_size;
        /* two ahead, running on into the first K blocks of the next sequence this thread takes */
        const KV_T *vpf = b + 2 < nb ? v + (int64_t)table[b + 2] * block_stride
                          : b + 2 - nb < next_nb ? k + (int64_t)next_table[b + 2 - nb] * block_stride : vb;
#if !defined(__AVX512F__)
        KV_NAME(v_block8)(vb, vpf, acc, scores + t0, ls, cnt, row, kv_heads, G, 2 * D4);
#else
        const int line = 64 / (int)sizeof(KV_T); /* elements per cache line: one prefetch each */
        for (int kh = 0; kh < kv_heads; kh++) {
            v16 ov[8][8];
            float *ah = acc + (int64_t)kh * G * hd;
            for (int g = 0; g < G; g++)
                for (int i = 0; i < D4; i++) ov[g][i] = *(const v16 *)(ah + g * hd + 16 * i);
            const float *sc = scores + (int64_t)kh * G * ls + t0;
            for (int o = 0; o < cnt; o++) {
                const KV_T *vr = vb + o * row + kh * hd;
                for (int i = 0; i < hd; i += line) __builtin_prefetch(vpf + o * row + kh * hd + i, 0, 1);
                for (int i = 0; i < D4; i += 2) {
                    v16 x0, x1;
                    KV_LOAD32(vr + 16 * i, &x0, &x1);
                    for (int g = 0; g < G; g++) {
                        const float p = sc[g * ls + o];
                        ov[g][i] += p * x0;
                        ov[g][i + 1] += p * x1;
                    }
                }
            }
            for (int g = 0; g < G; g++)
                for (int i = 0; i < D4; i++) *(v16 *)(ah + g * hd + 16 * i) = ov[g][i];
        }
#endif
    }
    for (int h = 0; h < heads; h++) /* back to the natural order */
        for (int i = 0; i < D4; i++)
            for (int j = 0; j < 16; j++) os[h * hd + 32 * (i / 2) + KV_PERM[16 * (i & 1) + j]] = acc[h * hd + 16 * i + j];
}

#ifndef PDSERVE_ATTEND
#define PDSERVE_ATTEND(fn, G_, D4_)                                                                        \
    if (group == (G_) && head_dim == 16 * (D4_)) {                                                           \
        fn(qs, os, k, v, block_stride, table, len, next_table, next_len, block_size, kv_heads, scale, scores, \
           acc, (G_), (D4_));                                                                                \
        continue;                                                                                            \
    }
#endif

/* q, out: [n, heads, head_dim] contiguous; tables: [n, table_stride] int32 block ids; lens: [n] context
 * length of each sequence (its new token included, already written to the cache). Returns 0, or -1 when
 * scratch could not be allocated (the caller falls back). */
int KV_NAME(pdserve_paged_decode)(const float *q, float *out, const KV_T *k, const KV_T *v, int64_t block_stride,
                                  const int32_t *tables, int64_t table_stride, const int32_t *lens, int n, int heads,
                                  int kv_heads, int head_dim, int block_size, float scale, int num_threads) {
    const int group = heads / kv_heads;
    const int64_t row = (int64_t)kv_heads * head_dim; /* one token's K (or V) for all KV heads */
    int max_len = 0;
    for (int s = 0; s < n; s++) max_len = lens[s] > max_len ? lens[s] : max_len;
    int failed = 0, claimed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* scores: heads x max_len rounded up to whole vectors; acc: heads x head_dim (the register path) */
        const size_t score_floats = (size_t)heads * (size_t)((max_len + 15) & ~15);
        float *scores = (float *)aligned_alloc(64, sizeof(float) * ((score_floats + (size_t)heads * head_dim + 15) & ~(size_t)15));
        float *acc = scores ? scores + score_floats : NULL;
        (void)acc; /* only the register path uses it */
        if (scores == NULL) failed = 1;
        /* Sequences are claimed one at a time (balance: lengths differ), each one claimed while the one
         * before it is still running, so the register path can prefetch its first blocks. A thread
         * without scratch skips what it claims (the call then fails). */
        for (int s = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED), nxt; s < n; s = nxt) {
            nxt = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            if (scores == NULL) continue;
            const int len = lens[s];
            const int32_t *table = tables + (int64_t)s * table_stride;
            const int32_t *next_table = nxt < n ? tables + (int64_t)nxt * table_stride : table;
            const int next_len = nxt < n ? lens[nxt] : 0;
            (void)next_table, (void)next_len;
            const float *qs = q + (int64_t)s * heads * head_dim;
            float *os = out + (int64_t)s * heads * head_dim;
            /* The model's shape, when the library was built for it (cpu_kernels.prepare_decode: head_dim
             * a multiple of 32 up to 128, up to 8 query heads per KV head): the register path. One
             * shape per build: every shape, four KV types each, took a minute to compile. */
#if defined(PDSERVE_GROUP) && defined(PDSERVE_HEAD_DIM)
            PDSERVE_ATTEND(KV_NAME(attend_seq), PDSERVE_GROUP, PDSERVE_HEAD_DIM / 16)
#endif
            /* Any other shape, one element at a time. scores[h * len + t] = scale * q_h . k_t */
            for (int t = 0; t < len; t++) {
                const int b = t / block_size, o = t - b * block_size;
                const KV_T *kt = k + (int64_t)table[b] * block_stride + (int64_t)o * row;
                for (int kh = 0; kh < kv_heads; kh++) {
                    const KV_T *kr = kt + (int64_t)kh * head_dim;
                    for (int g = 0; g < group; g++) {
                        const int h = kh * group + g;
                        const float *qh = qs + (int64_t)h * head_dim;
                        float d = 0.0f;
#pragma omp simd reduction(+ : d)
                        for (int i = 0; i < head_dim; i++) d += qh[i] * KV_LOAD1(kr + i);
                        scores[(int64_t)h * len + t] = scale * d;
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
                const KV_T *vt = v + (int64_t)table[b] * block_stride + (int64_t)o * row;
                for (int kh = 0; kh < kv_heads; kh++) {
                    const KV_T *vr = vt + (int64_t)kh * head_dim;
                    for (int g = 0; g < group; g++) {
                        const int h = kh * group + g;
                        float *oh = os + (int64_t)h * head_dim;
                        const float p = scores[(int64_t)h * len + t];
#pragma omp simd
                        for (int i = 0; i < head_dim; i++) oh[i] += p * KV_LOAD1(vr + i);
                    }
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

#undef KV_T
#undef KV_NAME
#undef KV_LOAD32
#undef KV_PERM
#undef KV_LOAD1
#undef KV_LOAD8
