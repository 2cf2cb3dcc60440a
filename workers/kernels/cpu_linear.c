/* fp32 linear layer for CPU: y[m, n] = x[m, k] @ W^T + bias (+ residual), W torch's [n, k],
 * packed once into cache-resident panels of NR output columns (docs/internals.md). */
#include "cpu_vec.h"

#define NR (2 * LANES) /* output columns per panel */
#define MR 6           /* rows per block */

#pragma GCC optimize("fp-contract=fast") /* a * w + c as one FMA (-std=c11 turns it off) */

static inline int64_t panel_width(int64_t n, int64_t p) { return n - p * NR < NR ? n - p * NR : NR; }

/* W [n, k] row-major into panels (above); packed holds n * k floats. Returns 0. */
int tokq_pack_weight(const float *w, float *packed, int64_t n, int64_t k) {
    for (int64_t p = 0; p * NR < n; p++) {
        const int64_t width = panel_width(n, p);
        float *panel = packed + p * NR * k;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < width; j++) panel[kk * width + j] = w[(p * NR + j) * k + kk];
    }
    return 0;
}

/* MR rows' (mr of them) outputs in one panel's columns: width of them, stored at y. */
static inline __attribute__((always_inline)) void block(
    const int mr, const float *x, int64_t ldx, const float *panel, int64_t width, int64_t k,
    const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy) {
    float start[NR] __attribute__((aligned(64))) = {0};
    for (int64_t j = 0; j < width; j++) start[j] = bias ? bias[j] : 0.0f;
    vfloat c0[MR], c1[MR];
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        c0[r] = load_vec(start);
        c1[r] = load_vec(start + LANES);
    }
    if (width == NR) {
        for (int64_t kk = 0; kk < k; kk++) {
            const vfloat w0 = load_vec(panel + kk * NR), w1 = load_vec(panel + kk * NR + LANES);
#pragma GCC unroll 6
            for (int r = 0; r < mr; r++) {
                const float a = x[r * ldx + kk];
                c0[r] += a * w0;
                c1[r] += a * w1;
            }
        }
    } else { /* the narrow last panel: its weights through a zero-padded copy */
        float wide[NR] __attribute__((aligned(64))) = {0};
        for (int64_t kk = 0; kk < k; kk++) {
            memcpy(wide, panel + kk * width, width * sizeof(float));
            const vfloat w0 = load_vec(wide), w1 = load_vec(wide + LANES);
#pragma GCC unroll 6
            for (int r = 0; r < mr; r++) {
                const float a = x[r * ldx + kk];
                c0[r] += a * w0;
                c1[r] += a * w1;
            }
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        if (width == NR) {
            if (res) {
                c0[r] += load_vec(res + r * ldr);
                c1[r] += load_vec(res + r * ldr + LANES);
            }
            store_vec(y + r * ldy, c0[r]);
            store_vec(y + r * ldy + LANES, c1[r]);
            continue;
        }
        float out[NR] __attribute__((aligned(64)));
        store_vec(out, c0[r]);
        store_vec(out + LANES, c1[r]);
        for (int64_t j = 0; j < width; j++) y[r * ldy + j] = out[j] + (res ? res[r * ldr + j] : 0.0f);
    }
}

/* Panels [first, last) of y [m, n] (contiguous) from x [m, k] (row stride ldx), the packed W,
 * bias [n] or NULL, residual [m, n] (row stride ldr) or NULL. Parts with disjoint panels may
 * run at once. */
int tokq_linear(const float *x, int64_t ldx, int64_t m, int64_t k, const float *packed, int64_t n,
                const float *bias, const float *res, int64_t ldr, float *y, int64_t first,
                int64_t last) {
    for (int64_t p = first; p < last; p++) {
        const float *panel = packed + p * NR * k;
        const int64_t col = p * NR, width = panel_width(n, p);
        const float *b = bias ? bias + col : NULL;
        int64_t r = 0;
#define BLOCK(rows) block(rows, x + r * ldx, ldx, panel, width, k, b, res ? res + r * ldr + col : NULL, \
                          ldr, y + r * n + col, n)
        for (; r + MR <= m; r += MR) BLOCK(MR);
        switch (m - r) { /* the rest, with the row count a constant: its loops unrolled */
        case 5: BLOCK(5); break;
        case 4: BLOCK(4); break;
        case 3: BLOCK(3); break;
        case 2: BLOCK(2); break;
        case 1: BLOCK(1); break;
        default: break;
        }
#undef BLOCK
    }
    return 0;
}

/* bf16: W packed into panels of NR columns (zero-padded), each step of k a pair of k values: word
 * j of pair q holds column j's values 2q (low half) and 2q+1 (high half), as vdpbf16ps reads
 * them. fp32 sums, one rounding to bf16 at the end (bias and residual added before it). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && LANES == 16
#include <immintrin.h>
#define HAVE_DPBF16 1
#endif

typedef uint16_t vhalf __attribute__((vector_size(LANES * sizeof(uint16_t))));

static inline vfloat load_bf16_vec(const uint16_t *p) { /* LANES bf16 values, in order */
    vhalf h;
    memcpy(&h, p, sizeof h);
    return (vfloat)(__builtin_convertvector(h, vuint) << 16);
}

static inline void store_bf16_vec(uint16_t *p, vfloat x) {
    const vhalf h = __builtin_convertvector(round_bf16(x) >> 16, vhalf);
    memcpy(p, &h, sizeof h);
}

static inline int64_t pairs_of(int64_t k) { return (k + 1) / 2; }

/* W [n, k] into panels; packed holds ceil(n / NR) * NR * 2 * pairs_of(k) values. Returns 0. */
int tokq_pack_weight_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    const int64_t pairs = pairs_of(k);
    for (int64_t p = 0; p * NR < n; p++)
        for (int64_t q = 0; q < pairs; q++)
            for (int64_t j = 0; j < NR; j++)
                for (int64_t h = 0; h < 2; h++) {
                    const int64_t col = p * NR + j, kk = 2 * q + h;
                    packed[((p * pairs + q) * NR + j) * 2 + h] = col < n && kk < k ? w[col * k + kk] : 0;
                }
    return 0;
}

/* x row r's values 2q and 2q+1 as one word (the second 0 past k) */
static inline uint32_t x_pair(const uint16_t *x, int64_t k, int64_t q) {
    if (2 * q + 1 < k) {
        uint32_t word;
        memcpy(&word, x + 2 * q, 4);
        return word;
    }
    return x[2 * q];
}

/* MR rows' (mr of them) outputs in one panel's columns (width of them), rounded to bf16 at y. */
static inline __attribute__((always_inline)) void block_bf16(
    const int mr, const uint16_t *x, int64_t ldx, const uint16_t *panel, int64_t width, int64_t k,
    const uint16_t *bias, const uint16_t *res, int64_t ldr, uint16_t *y, int64_t ldy) {
    const int64_t pairs = pairs_of(k);
    vfloat c0[MR], c1[MR], d0[MR], d1[MR]; /* d: odd pairs, a second chain of sums */
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) c0[r] = c1[r] = d0[r] = d1[r] = (vfloat){0};
    int64_t q = 0;
#ifdef HAVE_DPBF16
    for (; q + 2 <= pairs; q += 2) {
        const uint16_t *wq = panel + q * 2 * NR;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wq), w1 = (__m512bh)_mm512_loadu_si512(wq + 2 * LANES);
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(wq + 2 * NR);
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512(wq + 2 * NR + 2 * LANES);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)x_pair(x + r * ldx, k, q));
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)x_pair(x + r * ldx, k, q + 1));
            c0[r] = (vfloat)_mm512_dpbf16_ps((__m512)c0[r], a, w0);
            c1[r] = (vfloat)_mm512_dpbf16_ps((__m512)c1[r], a, w1);
            d0[r] = (vfloat)_mm512_dpbf16_ps((__m512)d0[r], b, v0);
            d1[r] = (vfloat)_mm512_dpbf16_ps((__m512)d1[r], b, v1);
        }
    }
#endif
    for (; q < pairs; q++) { /* without vdpbf16ps: each pair's two products as fp32 FMAs */
        const uint16_t *wq = panel + q * 2 * NR;
        vuint w0, w1;
        memcpy(&w0, wq, sizeof w0);
        memcpy(&w1, wq + 2 * LANES, sizeof w1);
        const vfloat e0 = (vfloat)(w0 << 16), o0 = (vfloat)(w0 & 0xffff0000u);
        const vfloat e1 = (vfloat)(w1 << 16), o1 = (vfloat)(w1 & 0xffff0000u);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            const uint32_t word = x_pair(x + r * ldx, k, q);
            const float a = bf16_to_f32((uint16_t)word), b = bf16_to_f32((uint16_t)(word >> 16));
            c0[r] += a * e0;
            c1[r] += a * e1;
            d0[r] += b * o0;
            d1[r] += b * o1;
        }
    }
    float start[NR] __attribute__((aligned(64))) = {0};
    for (int64_t j = 0; j < width && bias; j++) start[j] = bf16_to_f32(bias[j]);
    const vfloat b0 = load_vec(start), b1 = load_vec(start + LANES);
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        vfloat s0 = c0[r] + d0[r] + b0, s1 = c1[r] + d1[r] + b1;
        if (width == NR) {
            if (res) {
                s0 += load_bf16_vec(res + r * ldr);
                s1 += load_bf16_vec(res + r * ldr + LANES);
            }
            store_bf16_vec(y + r * ldy, s0);
            store_bf16_vec(y + r * ldy + LANES, s1);
            continue;
        }
        float out[NR] __attribute__((aligned(64)));
        store_vec(out, s0);
        store_vec(out + LANES, s1);
        for (int64_t j = 0; j < width; j++)
            y[r * ldy + j] = f32_to_bf16(out[j] + (res ? bf16_to_f32(res[r * ldr + j]) : 0.0f));
    }
}

/* tokq_linear in bf16: panels [first, last) of y [m, n] (contiguous) from x [m, k] (row stride
 * ldx), W packed by tokq_pack_weight_bf16, bias [n] or NULL, residual [m, n] or NULL. */
int tokq_linear_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *packed,
                     int64_t n, const uint16_t *bias, const uint16_t *res, int64_t ldr, uint16_t *y,
                     int64_t first, int64_t last) {
    const int64_t pairs = pairs_of(k);
    for (int64_t p = first; p < last; p++) {
        const uint16_t *panel = packed + p * NR * 2 * pairs;
        const int64_t col = p * NR, width = panel_width(n, p);
        const uint16_t *b = bias ? bias + col : NULL;
        int64_t r = 0;
#define BLOCK(rows) block_bf16(rows, x + r * ldx, ldx, panel, width, k, b, \
                               res ? res + r * ldr + col : NULL, ldr, y + r * n + col, n)
        for (; r + MR <= m; r += MR) BLOCK(MR);
        switch (m - r) {
        case 5: BLOCK(5); break;
        case 4: BLOCK(4); break;
        case 3: BLOCK(3); break;
        case 2: BLOCK(2); break;
        case 1: BLOCK(1); break;
        default: break;
        }
#undef BLOCK
    }
    return 0;
}

/* 1 when tokq_linear_bf16 runs on vdpbf16ps (AVX512-BF16), else 0 (fp32 FMAs on converted pairs) */
int tokq_linear_bf16_dot_products(void) {
#ifdef HAVE_DPBF16
    return 1;
#else
    return 0;
#endif
}
