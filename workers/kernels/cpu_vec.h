/* Vectors and dtype conversions the CPU kernels (workers/kernels/cpu_*.c) share, LANES floats wide
 * to match the registers; bf16 rows are read even values, then odd ones (docs/internals.md). */
#ifndef TOKQ_CPU_VEC_H
#define TOKQ_CPU_VEC_H

#include <stdint.h>
#include <string.h>

#define DTYPE_F32 0
#define DTYPE_BF16 1

#ifndef LANES /* -DLANES=N builds another width, for tests and comparisons */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX2__)
#define LANES 8
#else
#define LANES 4
#endif
#endif
#define STEP (2 * LANES)  /* values per load_step: two vectors */

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(LANES * sizeof(uint32_t))));

static inline vfloat load_vec(const float *p) {
    vfloat x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store_vec(float *p, vfloat x) { memcpy(p, &x, sizeof x); }

static inline float hsum(vfloat x) {
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += x[l];
    return s;
}

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* to nearest even, as torch (no NaN branch: */
    uint32_t bits;                                /* it vectorizes) */
    memcpy(&bits, &f, 4);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline vuint round_bf16(vfloat x) { /* the rounded values, in each word's high half */
    vuint bits = (vuint)x;
    return bits + 0x7fffu + ((bits >> 16) & 1u);
}

/* STEP values at p as two float vectors (bf16: the even values, the odd ones) */
static inline void load_step(const void *p, int dtype, vfloat *a, vfloat *b) {
    if (dtype == DTYPE_BF16) {
        vuint words;
        memcpy(&words, p, sizeof words);
        *a = (vfloat)(words << 16);
        *b = (vfloat)(words & 0xffff0000u);
    } else {
        memcpy(a, p, sizeof *a);
        memcpy(b, (const float *)p + LANES, sizeof *b);
    }
}

static inline void store_step(void *p, int dtype, vfloat a, vfloat b) { /* load_step's inverse */
    if (dtype == DTYPE_BF16) {
        vuint words = (round_bf16(a) >> 16) | (round_bf16(b) & 0xffff0000u);
        memcpy(p, &words, sizeof words);
    } else {
        memcpy(p, &a, sizeof a);
        memcpy((float *)p + LANES, &b, sizeof b);
    }
}

static inline float load_one(const void *p, int dtype, int64_t i) {
    return dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_one(void *p, int dtype, int64_t i, float x) {
    if (dtype == DTYPE_BF16) {
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    } else {
        ((float *)p)[i] = x;
    }
}

/* LANES as built: each kernel is a library of its own, so each has its own copy of this. Tests
 * check it against the CPU's flags (a wider vector than the registers is slow, not wrong). */
int tokq_vector_lanes(void) { return LANES; }

#endif
