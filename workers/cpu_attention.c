/* Varlen attention for CPU: every sequence of a packed batch attends to itself, read in place
 * from q/k/v of [T, H, D] (any row strides, D contiguous), bf16 or fp32 in, fp32 math, written
 * to a contiguous [T, Hq, D] out of the same dtype. Built by workers/cpu_build.py with the
 * machine's own compiler flags (-O3 -march=native) on first use; torch has no CPU varlen kernel.
 * Vectors are written out (workers/cpu_vec.h) because auto-vectorizing these short loops chose
 * the wrong loop to vectorize (scalar gathers across K^T's rows).
 *
 * Why it is faster than batched matmuls over padded rows (workers/matmul_attention.py): a
 * short-query batch's attention is ~20 MFLOP per layer, so the cost there is gathers, empty
 * slots and per-op overhead, none of which this has. Per (sequence, head): K transposed and V
 * converted to fp32 once, then per group of ROWS query rows: scores for all keys (a vector over
 * keys, D multiply-adds), softmax, and the weighted sum of V rows (a vector over D).
 */
#include <stdlib.h>

#include "cpu_vec.h"

#define KEYS LANES /* keys per block: one vector of floats */
#define ROWS 8 /* query rows per pass through K and V (bf16, 1,034 tokens: 1.45x one row, 1.15x 4) */

typedef uint16_t v16h __attribute__((vector_size(LANES * sizeof(uint16_t))));

static inline void load_row(const void *base, int dtype, int64_t offset, int d, float *dst) {
    if (dtype != DTYPE_BF16) {
        memcpy(dst, (const float *)base + offset, (size_t)d * sizeof(float));
        return;
    }
    const uint16_t *src = (const uint16_t *)base + offset;
    int i = 0;
    for (; i + KEYS <= d; i += KEYS) { /* whole vectors, then the rest one by one */
        v16h half;
        memcpy(&half, src + i, sizeof half);
        v16u bits = __builtin_convertvector(half, v16u) << 16;
        memcpy(dst + i, &bits, sizeof bits);
    }
    for (; i < d; i++) dst[i] = bf16_to_f32(src[i]);
}

static void *alloc_floats(size_t n) { /* 64-byte aligned, size a multiple of 64 (C11) */
    return aligned_alloc(64, (n * sizeof(float) + 63) & ~(size_t)63);
}

/* e^x for x <= 0 (scores minus their max), ~1 ulp: x = n ln2 + r, |r| <= ln2/2, e^r by
 * Cephes' degree-6 polynomial, times 2^n through the exponent bits. libm's expf is scalar
 * here and was ~15% of the kernel's time. */
static inline v16 exp16_nonpositive(v16 x) {
    const v16 lo = x - x - 87.0f; /* below this e^x is under float's normal range: 0 */
    v16i under = x < lo;
    x = (v16)(((v16i)x & ~under) | ((v16i)lo & under));
    v16i n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, v16i); /* round, x <= 0 */
    v16 nf = __builtin_convertvector(n, v16);
    v16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v16 p = r * 0.0f + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v16 scale = (v16)((n + 127) << 23);
    return (v16)((v16i)(p * scale) & ~under);
}

/* One (sequence, kv head group): ``d`` is a compile-time constant where inlined below.
 * Query rows go ROWS at a time: each K^T vector and V row loaded is used by ROWS FMAs, and the
 * ROWS sums are independent chains, so neither the loads nor the FMA latency set the pace. */
static inline void attend_one(const void *q, const void *k, const void *v, void *out, int dtype,
                              int64_t start, int len, int hk, int group, int num_q_heads,
                              const int d, int64_t q_stride_t, int64_t q_stride_h,
                              int64_t k_stride_t, int64_t k_stride_h, int64_t v_stride_t,
                              int64_t v_stride_h, int causal, float scale, float *kt, float *vf,
                              float *scores, float *qrows, float *acc) {
    const int width = (len + KEYS - 1) / KEYS * KEYS;
    /* K^T [d, width] (zero past len) and V [len, d], in fp32 */
    for (int j = 0; j < len; j++) {
        load_row(k, dtype, (start + j) * k_stride_t + hk * k_stride_h, d, qrows);
        for (int i = 0; i < d; i++) kt[(size_t)i * width + j] = qrows[i];
        load_row(v, dtype, (start + j) * v_stride_t + hk * v_stride_h, d, vf + (size_t)j * d);
    }
    for (int i = 0; i < d; i++)
        for (int j = len; j < width; j++) kt[(size_t)i * width + j] = 0.0f;
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int g = 0; g < group; g++) {
        const int h = hk * group + g;
        for (int t0 = 0; t0 < len; t0 += ROWS) {
            const int rows = len - t0 < ROWS ? len - t0 : ROWS;
            /* rows past the sequence's end stay zero: computed, never stored */
            for (int r = 0; r < ROWS; r++) {
                float *qr = qrows + (size_t)r * d;
                if (r < rows) {
                    load_row(q, dtype, (start + t0 + r) * q_stride_t + h * q_stride_h, d, qr);
                    for (int i = 0; i < d; i++) qr[i] *= scale;
                } else {
                    for (int i = 0; i < d; i++) qr[i] = 0.0f;
                }
            }
            const int keys = causal ? t0 + rows : len; /* the most any of these rows sees */
            const int blocks = (keys + KEYS - 1) / KEYS;
            for (int b = 0; b < blocks; b++) {
                v16 s[ROWS] = {{0}};
                const float *kb = kt + b * KEYS;
                for (int i = 0; i < d; i++) {
                    const v16 kv = load16(kb + (size_t)i * width);
                    for (int r = 0; r < ROWS; r++) s[r] += qrows[(size_t)r * d + i] * kv;
                }
                for (int r = 0; r < ROWS; r++) store16(scores + (size_t)r * width + b * KEYS, s[r]);
            }
            float inv[ROWS];
            for (int r = 0; r < ROWS; r++) {
                float *sr = scores + (size_t)r * width;
                const int own = causal ? t0 + r + 1 : len; /* keys this row may see */
                float m = sr[0]; /* built with -ffast-math: no infinities */
                for (int j = 1; j < own; j++) m = sr[j] > m ? sr[j] : m;
                /* exp over whole blocks (vectorized, no scalar tail); keys past the row's last
                 * (padding, or ahead of a causal query) weigh nothing */
                v16 total = {0};
                for (int b = 0; b < blocks; b++) {
                    v16 e = exp16_nonpositive(load16(sr + b * KEYS) - m);
                    e = (v16)((v16i)e & (lane < own - b * KEYS));
                    store16(sr + b * KEYS, e);
                    total += e;
                }
                inv[r] = 1.0f / hsum(total);
            }
            int c = 0;
            for (; c + KEYS <= d; c += KEYS) { /* whole vectors of d, then the rest */
                v16 a[ROWS] = {{0}};
                const float *vc = vf + c;
                for (int j = 0; j < keys; j++) {
                    const v16 vv = load16(vc + (size_t)j * d);
                    for (int r = 0; r < ROWS; r++) a[r] += scores[(size_t)r * width + j] * vv;
                }
                for (int r = 0; r < ROWS; r++) store16(acc + (size_t)r * d + c, a[r] * inv[r]);
            }
            for (; c < d; c++) {
                for (int r = 0; r < ROWS; r++) {
                    float a = 0.0f;
                    for (int j = 0; j < keys; j++) a += scores[(size_t)r * width + j] * vf[(size_t)j * d + c];
                    acc[(size_t)r * d + c] = a * inv[r];
                }
            }
            for (int r = 0; r < rows; r++) {
                const float *ar = acc + (size_t)r * d;
                const int64_t o = ((start + t0 + r) * num_q_heads + h) * (int64_t)d;
                if (dtype == DTYPE_BF16) {
                    uint16_t *dst = (uint16_t *)out + o;
                    int i = 0;
                    for (; i + KEYS <= d; i += KEYS) { /* whole vectors, then the rest */
                        v16h half = __builtin_convertvector(round_bf16(load16(ar + i)) >> 16, v16h);
                        memcpy(dst + i, &half, sizeof half);
                    }
                    for (; i < d; i++) dst[i] = f32_to_bf16(ar[i]);
                } else {
                    memcpy((float *)out + o, ar, (size_t)d * sizeof(float));
                }
            }
        }
    }
}

/* Sequences [first_seq, last_seq) of the batch, kv heads [first_kv_head, last_kv_head) (and the
 * query heads that share them). Returns 0, or -1 when scratch memory could not be had. Strides
 * are in elements. */
int tokq_varlen_attention(const void *q, const void *k, const void *v, void *out, int dtype,
                          const int64_t *cu_seqlens, int first_seq, int last_seq,
                          int first_kv_head, int last_kv_head, int num_q_heads,
                          int num_kv_heads, int head_dim, int64_t q_stride_t, int64_t q_stride_h,
                          int64_t k_stride_t, int64_t k_stride_h, int64_t v_stride_t,
                          int64_t v_stride_h, int causal, float scale) {
    int max_len = 0;
    for (int b = first_seq; b < last_seq; b++) {
        int len = (int)(cu_seqlens[b + 1] - cu_seqlens[b]);
        if (len > max_len) max_len = len;
    }
    /* at least one block: aligned_alloc may return NULL for 0 bytes (a range of empty ones) */
    const int padded = (max_len > 0 ? max_len + KEYS - 1 : KEYS) / KEYS * KEYS;
    const int d = head_dim;
    const int group = num_q_heads / num_kv_heads;
    float *kt = alloc_floats((size_t)d * padded);
    float *vf = alloc_floats((size_t)padded * d);
    float *scores = alloc_floats((size_t)ROWS * padded);
    float *qrow = alloc_floats((size_t)ROWS * d);
    float *acc = alloc_floats((size_t)ROWS * d);
    if (!kt || !vf || !scores || !qrow || !acc) {
        free(kt); free(vf); free(scores); free(qrow); free(acc);
        return -1;
    }
    for (int b = first_seq; b < last_seq; b++) {
        const int64_t start = cu_seqlens[b];
        const int len = (int)(cu_seqlens[b + 1] - start);
        if (len == 0) continue;
        for (int hk = first_kv_head; hk < last_kv_head; hk++) {
#define ATTEND(D) attend_one(q, k, v, out, dtype, start, len, hk, group, num_q_heads, D, \
                             q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, \
                             v_stride_h, causal, scale, kt, vf, scores, qrow, acc)
            /* the common head sizes get loops of a known trip count */
            switch (d) {
                case 32: ATTEND(32); break;
                case 64: ATTEND(64); break;
                case 128: ATTEND(128); break;
                default: ATTEND(d);
            }
#undef ATTEND
        }
    }
    free(kt); free(vf); free(scores); free(qrow); free(acc);
    return 0;
}
