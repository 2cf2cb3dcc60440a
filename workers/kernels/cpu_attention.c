/* Varlen attention for CPU: each sequence of a packed [T, H, D] batch attends to itself, read in
 * place, bf16 or fp32 in, fp32 math; no gathers or padding (docs/internals.md, workers/kernels/). */
#include <stdlib.h>

#include "cpu_vec.h"

#define KEYS LANES /* keys per block: one vector of floats */
#define ROWS 8 /* query rows per pass through K and V */

typedef uint16_t vbf16 __attribute__((vector_size(LANES * sizeof(uint16_t))));

static inline void load_row(const void *base, int dtype, int64_t offset, int d, float *dst) {
    if (dtype != DTYPE_BF16) {
        memcpy(dst, (const float *)base + offset, (size_t)d * sizeof(float));
        return;
    }
    const uint16_t *src = (const uint16_t *)base + offset;
    int i = 0;
    for (; i + KEYS <= d; i += KEYS) { /* whole vectors, then the rest one by one */
        vbf16 half;
        memcpy(&half, src + i, sizeof half);
        vuint bits = __builtin_convertvector(half, vuint) << 16;
        memcpy(dst + i, &bits, sizeof bits);
    }
    for (; i < d; i++) dst[i] = bf16_to_f32(src[i]);
}

static inline void store_row_bf16(const float *src, uint16_t *dst, int d) { /* rounded */
    int i = 0;
    for (; i + KEYS <= d; i += KEYS) { /* whole vectors, then the rest */
        vbf16 half = __builtin_convertvector(round_bf16(load_vec(src + i)) >> 16, vbf16);
        memcpy(dst + i, &half, sizeof half);
    }
    for (; i < d; i++) dst[i] = f32_to_bf16(src[i]);
}

static void *alloc_floats(size_t n) { /* 64-byte aligned, size a multiple of 64 (C11) */
    return aligned_alloc(64, (n * sizeof(float) + 63) & ~(size_t)63);
}

/* e^x for x <= 0 (scores minus their max), ~1 ulp, in vectors (libm's expf is scalar):
 * x = n ln2 + r, e^r by Cephes' degree-6 polynomial, times 2^n through the exponent bits. */
static inline vfloat exp_nonpositive(vfloat x) {
    const vfloat lo = x - x - 87.0f; /* below this e^x is under float's normal range: 0 */
    vint under = x < lo;
    x = (vfloat)(((vint)x & ~under) | ((vint)lo & under));
    vint n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vint); /* round, x <= 0 */
    vfloat nf = __builtin_convertvector(n, vfloat);
    vfloat r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    vfloat p = r * 0.0f + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vfloat scale = (vfloat)((n + 127) << 23);
    return (vfloat)((vint)(p * scale) & ~under);
}

/* One (sequence, kv head group), ROWS query rows at a time so each K^T vector and V row loaded
 * serves ROWS independent FMA chains; ``d`` is a compile-time constant where inlined below. */
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
    vint lane; /* 0, 1, ..., LANES - 1 */
    for (int l = 0; l < LANES; l++) lane[l] = l;
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
                vfloat s[ROWS] = {{0}};
                const float *kb = kt + b * KEYS;
                for (int i = 0; i < d; i++) {
                    const vfloat kv = load_vec(kb + (size_t)i * width);
                    for (int r = 0; r < ROWS; r++) s[r] += qrows[(size_t)r * d + i] * kv;
                }
                for (int r = 0; r < ROWS; r++) store_vec(scores + (size_t)r * width + b * KEYS, s[r]);
            }
            float inv[ROWS];
            for (int r = 0; r < ROWS; r++) {
                float *sr = scores + (size_t)r * width;
                const int own = causal ? t0 + r + 1 : len; /* keys this row may see */
                float m = sr[0]; /* built with -ffast-math: no infinities */
                for (int j = 1; j < own; j++) m = sr[j] > m ? sr[j] : m;
                /* exp over whole blocks (vectorized, no scalar tail); keys past the row's last
                 * (padding, or ahead of a causal query) weigh nothing */
                vfloat total = {0};
                for (int b = 0; b < blocks; b++) {
                    vfloat e = exp_nonpositive(load_vec(sr + b * KEYS) - m);
                    e = (vfloat)((vint)e & (lane < own - b * KEYS));
                    store_vec(sr + b * KEYS, e);
                    total += e;
                }
                inv[r] = 1.0f / hsum(total);
            }
            int c = 0;
            for (; c + KEYS <= d; c += KEYS) { /* whole vectors of d, then the rest */
                vfloat a[ROWS] = {{0}};
                const float *vc = vf + c;
                for (int j = 0; j < keys; j++) {
                    const vfloat vv = load_vec(vc + (size_t)j * d);
                    for (int r = 0; r < ROWS; r++) a[r] += scores[(size_t)r * width + j] * vv;
                }
                for (int r = 0; r < ROWS; r++) store_vec(acc + (size_t)r * d + c, a[r] * inv[r]);
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
                    store_row_bf16(ar, (uint16_t *)out + o, d);
                } else {
                    memcpy((float *)out + o, ar, (size_t)d * sizeof(float));
                }
            }
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && LANES == 16 /* one __m512 a vector */
#include <immintrin.h>
#define HAVE_DPBF16 1

/* e^x for x <= 0 to 6e-5 relative error, ample for weights rounded to bf16: 2^f by a degree-4
 * Taylor polynomial times 2^n by vscalefps; subnormals flush to zero in the bf16 rounding. */
static inline __m512 exp_for_bf16(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.6181291e-3f); /* ln(2)^k / k!, k = 4..0 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* attend_one for bf16 where the CPU has AVX512-BF16, d a multiple of 32: vdpbf16ps on words of
 * bf16 pairs, K and V never converted to fp32 (operand layouts: docs/internals.md). */
static inline void attend_one_dp(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                 uint16_t *out, int64_t start, int len, int hk, int group,
                                 int num_q_heads, const int d, int64_t q_stride_t,
                                 int64_t q_stride_h, int64_t k_stride_t, int64_t k_stride_h,
                                 int64_t v_stride_t, int64_t v_stride_h, int causal, float scale,
                                 uint32_t *kt, uint32_t *vw, float *scores, uint16_t *weights,
                                 uint32_t *qw, float *acc) {
    const int width = (len + KEYS - 1) / KEYS * KEYS;
    const int half = d / 2;
    for (int j = 0; j < len; j++) {
        const uint16_t *kr = k + (start + j) * k_stride_t + hk * k_stride_h;
        for (int p = 0; p < half; p++) memcpy(kt + (size_t)p * width + j, kr + 2 * p, 4);
    }
    for (int p = 0; p < half; p++)
        for (int j = len; j < width; j++) kt[(size_t)p * width + j] = 0;
    /* V's words, 32 values of d at a time: a word per (even row, odd row) pair of values; a row
     * past len is zero (its weight is zero too, but garbage times zero can be NaN) */
    /* permutex2var picks a's value i by index i, b's by 32 + i; listed from the last element:
     * element 2i = a[i], 2i + 1 = b[i], for values 0-15 (lo_words) and 16-31 (hi_words) */
    const __m512i lo_words = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                              40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                              32, 0);
    const __m512i hi_words = _mm512_add_epi16(lo_words, _mm512_set1_epi16(16));
    for (int j = 0; j < len; j += 2) {
        const uint16_t *even = v + (start + j) * v_stride_t + hk * v_stride_h;
        for (int c = 0; c < d; c += STEP) {
            const __m512i a = _mm512_loadu_si512(even + c);
            const __m512i b = j + 1 < len ? _mm512_loadu_si512(even + v_stride_t + c)
                                          : _mm512_setzero_si512();
            uint32_t *dst = vw + (size_t)(j / 2) * d + c;
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo_words, b));
            _mm512_storeu_si512(dst + KEYS, _mm512_permutex2var_epi16(a, hi_words, b));
        }
    }
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int g = 0; g < group; g++) {
        const int h = hk * group + g;
        for (int t0 = 0; t0 < len; t0 += ROWS) {
            const int rows = len - t0 < ROWS ? len - t0 : ROWS;
            for (int r = 0; r < ROWS; r++) { /* rows past the end: zero, computed, never stored */
                if (r < rows)
                    memcpy(qw + (size_t)r * half, q + (start + t0 + r) * q_stride_t + h * q_stride_h,
                           (size_t)d * sizeof(uint16_t));
                else
                    memset(qw + (size_t)r * half, 0, (size_t)d * sizeof(uint16_t));
            }
            const int keys = causal ? t0 + rows : len;
            const int blocks = (keys + KEYS - 1) / KEYS;
            for (int b = 0; b < blocks; b++) {
                __m512 s[ROWS];
                for (int r = 0; r < ROWS; r++) s[r] = _mm512_setzero_ps();
                const uint32_t *kb = kt + b * KEYS;
                for (int p = 0; p < half; p++) {
                    const __m512bh kv = (__m512bh)_mm512_loadu_si512(kb + (size_t)p * width);
                    for (int r = 0; r < ROWS; r++)
                        s[r] = _mm512_dpbf16_ps(s[r], kv, (__m512bh)_mm512_set1_epi32(
                                                              (int)qw[(size_t)r * half + p]));
                }
                for (int r = 0; r < ROWS; r++)
                    _mm512_storeu_ps(scores + (size_t)r * width + b * KEYS,
                                     _mm512_mul_ps(s[r], _mm512_set1_ps(scale)));
            }
            const int pairs = (keys + 1) / 2;
            float inv[ROWS] = {0}; /* rows past the end: their weights are whatever the scratch
                                    * holds; their sums are never stored */
            for (int r = 0; r < rows; r++) {
                const float *sr = scores + (size_t)r * width;
                uint16_t *wr = weights + (size_t)r * width;
                const int own = causal ? t0 + r + 1 : len; /* keys this row may see */
                float m = sr[0];
                for (int j = 1; j < own; j++) m = sr[j] > m ? sr[j] : m;
                __m512 total = _mm512_setzero_ps();
                for (int b = 0; b < blocks; b++) { /* keys past the row's last weigh nothing */
                    const __mmask16 seen = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(own - b * KEYS));
                    const __m512 e = exp_for_bf16(_mm512_sub_ps(_mm512_loadu_ps(sr + b * KEYS),
                                                                _mm512_set1_ps(m)));
                    const __m256bh eb = _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(seen, e));
                    _mm256_storeu_si256((__m256i *)(wr + b * KEYS), (__m256i)eb);
                    /* widened by a shift: GCC 11 has no _mm512_cvtpbh_ps */
                    total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(
                                                     _mm512_cvtepu16_epi32((__m256i)eb), 16)));
                }
                inv[r] = 1.0f / _mm512_reduce_add_ps(total);
            }
            for (int c = 0; c < d; c += STEP) { /* 32 values of d: two vectors per row of words */
                __m512 a0[ROWS], a1[ROWS];
                for (int r = 0; r < ROWS; r++) a0[r] = a1[r] = _mm512_setzero_ps();
                const uint32_t *vc = vw + c;
                for (int m = 0; m < pairs; m++) {
                    const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vc + (size_t)m * d);
                    const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vc + (size_t)m * d + KEYS);
                    for (int r = 0; r < ROWS; r++) {
                        uint32_t w;
                        memcpy(&w, weights + (size_t)r * width + 2 * m, 4);
                        const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)w);
                        a0[r] = _mm512_dpbf16_ps(a0[r], v0, pw);
                        a1[r] = _mm512_dpbf16_ps(a1[r], v1, pw);
                    }
                }
                for (int r = 0; r < ROWS; r++) {
                    _mm512_storeu_ps(acc + (size_t)r * d + c, _mm512_mul_ps(a0[r], _mm512_set1_ps(inv[r])));
                    _mm512_storeu_ps(acc + (size_t)r * d + c + KEYS,
                                     _mm512_mul_ps(a1[r], _mm512_set1_ps(inv[r])));
                }
            }
            for (int r = 0; r < rows; r++)
                store_row_bf16(acc + (size_t)r * d, out + ((start + t0 + r) * num_q_heads + h) * (int64_t)d, d);
        }
    }
}
#endif

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
    float *weights = alloc_floats((size_t)ROWS * padded / 2); /* bf16 (the dot-product path) */
    if (!kt || !vf || !scores || !qrow || !acc || !weights) {
        free(kt); free(vf); free(scores); free(qrow); free(acc); free(weights);
        return -1;
    }
    for (int b = first_seq; b < last_seq; b++) {
        const int64_t start = cu_seqlens[b];
        const int len = (int)(cu_seqlens[b + 1] - start);
        if (len == 0) continue;
        for (int hk = first_kv_head; hk < last_kv_head; hk++) {
#ifdef HAVE_DPBF16
            if (dtype == DTYPE_BF16 && d % STEP == 0) {
#define ATTEND_DP(D) attend_one_dp(q, k, v, out, start, len, hk, group, num_q_heads, D, \
                                   q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, \
                                   v_stride_h, causal, scale, (uint32_t *)kt, (uint32_t *)vf, \
                                   scores, (uint16_t *)weights, (uint32_t *)qrow, acc)
                switch (d) {
                    case 32: ATTEND_DP(32); break;
                    case 64: ATTEND_DP(64); break;
                    case 128: ATTEND_DP(128); break;
                    default: ATTEND_DP(d);
                }
#undef ATTEND_DP
                continue;
            }
#endif
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
    free(kt); free(vf); free(scores); free(qrow); free(acc); free(weights);
    return 0;
}

/* 1 when bf16 with head size d takes the AVX512-BF16 dot-product path (attend_one_dp), else 0:
 * what this build was compiled for, so tests and reports can tell which path ran. */
int tokq_varlen_bf16_dot_products(int head_dim) {
#ifdef HAVE_DPBF16
    return head_dim > 0 && head_dim % STEP == 0;
#else
    (void)head_dim;
    return 0;
#endif
}
