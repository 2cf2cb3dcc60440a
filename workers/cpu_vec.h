/* Vectors and dtype conversions the CPU kernels (workers/cpu_*.c) share. GCC/clang vector
 * extensions: the compiler picks the machine's instructions (one AVX-512 register, two AVX2
 * ones, ...) for -march=native.
 *
 * bf16 rows are read a STEP (32 values) at a time as 16 32-bit words: the words' low halves are
 * the even values, their high halves the odd ones, so one load and one shift or mask gives each
 * as a float vector, with no shuffle. Sums over a row, and sums of rows, do not care in which
 * order a row's values come, as long as everything they meet comes in the same order and
 * store_step puts them back. fp32 rows come in order. */
#ifndef TOKQ_CPU_VEC_H
#define TOKQ_CPU_VEC_H

#include <stdint.h>
#include <string.h>

#define DTYPE_F32 0
#define DTYPE_BF16 1

#define LANES 16          /* floats per vector */
#define STEP (2 * LANES)  /* values per load_step: two vectors */

typedef float v16 __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t v16i __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t v16u __attribute__((vector_size(LANES * sizeof(uint32_t))));

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

static inline v16u round_bf16(v16 x) { /* the rounded values, in each word's high half */
    v16u bits = (v16u)x;
    return bits + 0x7fffu + ((bits >> 16) & 1u);
}

/* STEP values at p as two float vectors (bf16: the even values, the odd ones) */
static inline void load_step(const void *p, int dtype, v16 *a, v16 *b) {
    if (dtype == DTYPE_BF16) {
        v16u words;
        memcpy(&words, p, sizeof words);
        *a = (v16)(words << 16);
        *b = (v16)(words & 0xffff0000u);
    } else {
        memcpy(a, p, sizeof *a);
        memcpy(b, (const float *)p + LANES, sizeof *b);
    }
}

static inline void store_step(void *p, int dtype, v16 a, v16 b) { /* load_step's inverse */
    if (dtype == DTYPE_BF16) {
        v16u words = (round_bf16(a) >> 16) | (round_bf16(b) & 0xffff0000u);
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

#endif
