/* LayerNorm for CPU over rows of [T, n] (any row stride, n contiguous), optionally of their sum
 * with a residual, bf16 or fp32 in and out, fp32 math: mean, then variance about it (two
 * passes, as torch), then x-hat * w + b.
 * Built by workers/cpu_build.py with the machine's own compiler flags on first use.
 *
 * Why: torch 2.13's CPU LayerNorm takes ~0.6 ns per bf16 element (~0.25 ms per norm of a
 * 1,024-token MiniLM batch, 13 norms per forward); this takes under half that. The bf16 loads
 * need no shuffles: 32 values read as 16 words give the even ones (low halves) and the odd
 * ones (high halves) as two float vectors, and a row's sums and its scaling do not care which
 * order the values come in, as long as w and b come in the same one.
 */
#include <stdint.h>
#include <string.h>

#define DTYPE_F32 0
#define DTYPE_BF16 1

#define LANES 16 /* floats per vector: one 512-bit register, or two AVX2 ones */
#define STEP (2 * LANES) /* values per load: two vectors */

typedef float v16 __attribute__((vector_size(LANES * sizeof(float))));
typedef uint32_t v16u __attribute__((vector_size(LANES * sizeof(uint32_t))));

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline v16u round_bf16(v16 x) { /* to nearest even, as torch; in the high halves */
    v16u bits = (v16u)x;
    return bits + 0x7fffu + ((bits >> 16) & 1u);
}

/* STEP values from p as two float vectors, in an order that depends only on the dtype */
static inline void load_step(const void *p, int dtype, v16 *a, v16 *b) {
    if (dtype == DTYPE_BF16) {
        v16u words;
        memcpy(&words, p, sizeof words);
        *a = (v16)(words << 16);          /* the even elements */
        *b = (v16)(words & 0xffff0000u);  /* the odd ones */
    } else {
        memcpy(a, p, sizeof *a);
        memcpy(b, (const float *)p + LANES, sizeof *b);
    }
}

static inline void store_step(void *p, int dtype, v16 a, v16 b) { /* the inverse of load_step */
    if (dtype == DTYPE_BF16) {
        v16u words = (round_bf16(a) >> 16) | (round_bf16(b) & 0xffff0000u);
        memcpy(p, &words, sizeof words);
    } else {
        memcpy(p, &a, sizeof a);
        memcpy((float *)p + LANES, &b, sizeof b);
    }
}

static inline float load_one(const void *p, int dtype, int i) {
    return dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_one(void *p, int dtype, int i, float x) {
    if (dtype == DTYPE_BF16) {
        uint32_t bits;
        memcpy(&bits, &x, 4);
        bits += 0x7fffu + ((bits >> 16) & 1u);
        ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
    } else {
        ((float *)p)[i] = x;
    }
}

static inline v16 load16(const float *p) {
    v16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store16(float *p, v16 x) { memcpy(p, &x, sizeof x); }

static inline float hsum(v16 x) {
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += x[l];
    return s;
}

/* One row's STEP values from i: x's, plus the residual's where there is one, rounded to the
 * dtype as torch's add would give them (so the norm sees what the unfused ops would). */
static inline void load_input(const char *x, const char *res, int dtype, size_t size, int i,
                              v16 *a, v16 *b) {
    load_step(x + i * size, dtype, a, b);
    if (res) {
        v16 ra, rb;
        load_step(res + i * size, dtype, &ra, &rb);
        *a += ra;
        *b += rb;
        if (dtype == DTYPE_BF16) {
            *a = (v16)(round_bf16(*a) & 0xffff0000u);
            *b = (v16)(round_bf16(*b) & 0xffff0000u);
        }
    }
}

static inline float load_input_one(const char *x, const char *res, int dtype, int i) {
    float v = load_one(x, dtype, i);
    if (res) {
        v += load_one(res, dtype, i);
        if (dtype == DTYPE_BF16) {
            uint32_t bits;
            memcpy(&bits, &v, 4);
            bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
            memcpy(&v, &bits, 4);
        }
    }
    return v;
}

/* Rows [first, last) of x + residual (or of x, when residual is NULL) into out ([rows, n],
 * contiguous; may be x itself): x [rows, n] and residual with row strides x_stride and r_stride
 * elements; weight and bias [n]; all of one dtype. Why the add is here: it saves the pass over
 * the rows that adding them in the linear before costs. */
void tokq_layer_norm(const void *x, const void *residual, const void *weight, const void *bias,
                     void *out, int dtype, int64_t first, int64_t last, int n, int64_t x_stride,
                     int64_t r_stride, float eps) {
    const size_t size = dtype == DTYPE_BF16 ? 2 : 4;
    const int whole = n / STEP * STEP; /* whole steps, then the rest one by one */
    float row[n + STEP] __attribute__((aligned(64))); /* the row's input in fp32, read once */
    for (int64_t t = first; t < last; t++) {
        const char *src = (const char *)x + (size_t)(t * x_stride) * size;
        const char *res = residual ? (const char *)residual + (size_t)(t * r_stride) * size : NULL;
        v16 a, b, sa = {0}, sb = {0};
        int i = 0;
        for (; i < whole; i += STEP) {
            load_input(src, res, dtype, size, i, &a, &b);
            store16(row + i, a);
            store16(row + i + LANES, b);
            sa += a;
            sb += b;
        }
        float sum = hsum(sa + sb);
        for (; i < n; i++) {
            row[i] = load_input_one(src, res, dtype, i);
            sum += row[i];
        }
        const float mean = sum / (float)n;
        v16 qa = {0}, qb = {0};
        for (i = 0; i < whole; i += STEP) {
            a = load16(row + i) - mean;
            b = load16(row + i + LANES) - mean;
            qa += a * a;
            qb += b * b;
        }
        float var = hsum(qa + qb);
        for (; i < n; i++) var += (row[i] - mean) * (row[i] - mean);
        const float rstd = 1.0f / __builtin_sqrtf(var / (float)n + eps);
        char *dst = (char *)out + (size_t)(t * n) * size;
        for (i = 0; i < whole; i += STEP) {
            v16 wa, wb, ba, bb;
            load_step((const char *)weight + i * size, dtype, &wa, &wb);
            load_step((const char *)bias + i * size, dtype, &ba, &bb);
            store_step(dst + i * size, dtype, (load16(row + i) - mean) * rstd * wa + ba,
                       (load16(row + i + LANES) - mean) * rstd * wb + bb);
        }
        for (; i < n; i++)
            store_one(dst, dtype, i, (row[i] - mean) * rstd * load_one(weight, dtype, i)
                                         + load_one(bias, dtype, i));
    }
}
