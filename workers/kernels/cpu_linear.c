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
