/* LayerNorm for CPU over rows of [T, n], optionally of their sum with a residual, bf16 or fp32,
 * fp32 math in two passes as torch; bf16 rows are read as cpu_vec.h says. */
#include "cpu_vec.h"

/* One row's STEP values from i: x's, plus the residual's where there is one, rounded to the
 * dtype as torch's add would give them (so the norm sees what the unfused ops would). */
static inline void load_input(const char *x, const char *res, int dtype, size_t size, int i,
                              vfloat *a, vfloat *b) {
    load_step(x + i * size, dtype, a, b);
    if (res) {
        vfloat ra, rb;
        load_step(res + i * size, dtype, &ra, &rb);
        *a += ra;
        *b += rb;
        if (dtype == DTYPE_BF16) {
            *a = (vfloat)(round_bf16(*a) & 0xffff0000u);
            *b = (vfloat)(round_bf16(*b) & 0xffff0000u);
        }
    }
}

static inline float load_input_one(const char *x, const char *res, int dtype, int i) {
    float v = load_one(x, dtype, i);
    if (res) {
        v += load_one(res, dtype, i);
        if (dtype == DTYPE_BF16) v = bf16_to_f32(f32_to_bf16(v));
    }
    return v;
}

/* Rows [first, last) of x + residual (or of x, when residual is NULL) into out ([rows, n],
 * contiguous; may be x itself); row strides in elements; weight and bias [n]; one dtype. */
void tokq_layer_norm(const void *x, const void *residual, const void *weight, const void *bias,
                     void *out, int dtype, int64_t first, int64_t last, int n, int64_t x_stride,
                     int64_t r_stride, float eps) {
    const size_t size = dtype == DTYPE_BF16 ? 2 : 4;
    const int whole = n / STEP * STEP; /* whole steps, then the rest one by one */
    float row[n + STEP] __attribute__((aligned(64))); /* the row's input in fp32, read once */
    for (int64_t t = first; t < last; t++) {
        const char *src = (const char *)x + (size_t)(t * x_stride) * size;
        const char *res = residual ? (const char *)residual + (size_t)(t * r_stride) * size : NULL;
        vfloat a, b, sa = {0}, sb = {0};
        int i = 0;
        for (; i < whole; i += STEP) {
            load_input(src, res, dtype, size, i, &a, &b);
            store_vec(row + i, a);
            store_vec(row + i + LANES, b);
            sa += a;
            sb += b;
        }
        float sum = hsum(sa + sb);
        for (; i < n; i++) {
            row[i] = load_input_one(src, res, dtype, i);
            sum += row[i];
        }
        const float mean = sum / (float)n;
        vfloat qa = {0}, qb = {0};
        for (i = 0; i < whole; i += STEP) {
            a = load_vec(row + i) - mean;
            b = load_vec(row + i + LANES) - mean;
            qa += a * a;
            qb += b * b;
        }
        float var = hsum(qa + qb);
        for (; i < n; i++) var += (row[i] - mean) * (row[i] - mean);
        const float rstd = 1.0f / __builtin_sqrtf(var / (float)n + eps);
        char *dst = (char *)out + (size_t)(t * n) * size;
        for (i = 0; i < whole; i += STEP) {
            vfloat wa, wb, ba, bb;
            load_step((const char *)weight + i * size, dtype, &wa, &wb);
            load_step((const char *)bias + i * size, dtype, &ba, &bb);
            store_step(dst + i * size, dtype, (load_vec(row + i) - mean) * rstd * wa + ba,
                       (load_vec(row + i + LANES) - mean) * rstd * wb + bb);
        }
        for (; i < n; i++)
            store_one(dst, dtype, i, (row[i] - mean) * rstd * load_one(weight, dtype, i)
                                         + load_one(bias, dtype, i));
    }
}
