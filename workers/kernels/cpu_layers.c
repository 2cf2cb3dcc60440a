/* A BERT encoder's layers in one call, for batches of few tokens on one thread: the kernels of the
 * layer-by-layer path (cpu_linear.c, cpu_attention.c, cpu_norm.c), with no return to Python
 * between them. Each step computes what that path computes, in the same order. */
#include "cpu_linear.c"
#include "cpu_attention.c"
#include "cpu_norm.c"

/* Each layer's 12 pointers, in this order: weights in the C linear's panels, the rest [n] */
enum { QKV_W, QKV_B, OUT_W, OUT_B, LN1_W, LN1_B, UP_W, UP_B, DOWN_W, DOWN_B, LN2_W, LN2_B, PER_LAYER };

static void linear_rows(int dtype, const void *x, int64_t m, int64_t k, const void *w, int64_t n,
                        const void *bias, void *y) {
    const int64_t panels = (n + NR - 1) / NR;
    if (dtype == DTYPE_BF16)
        tokq_linear_bf16(x, k, m, k, w, n, bias, NULL, 0, y, 0, panels);
    else
        tokq_linear(x, k, m, k, w, n, bias, NULL, 0, y, 0, panels);
}

/* torch's GELU (erf form), x/2 (1 + erf(x / sqrt 2)), with erf as torch's vectorized CPU kernel
 * takes it: Abramowitz and Stegun 7.1.26 (error under 1.5e-7) */
static inline vfloat gelu_vec(vfloat x) {
    const vfloat z = x * 0.70710678118654752f;
    const vuint sign = (vuint)z & 0x80000000u;
    const vfloat az = (vfloat)((vuint)z & 0x7fffffffu);
    const vfloat t = 1.0f / (az * 0.3275911f + 1.0f);
    const vfloat r = (((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t
                     + 0.254829592f;
    const vfloat erf_abs = 1.0f - r * t * exp_nonpositive(-(az * az));
    return 0.5f * x * (1.0f + (vfloat)((vuint)erf_abs | sign));
}

static void gelu_inplace(void *y, int dtype, int64_t n) {
    const size_t size = dtype == DTYPE_BF16 ? 2 : 4;
    int64_t i = 0;
    for (; i + STEP <= n; i += STEP) {
        vfloat a, b;
        load_step((char *)y + i * size, dtype, &a, &b);
        store_step((char *)y + i * size, dtype, gelu_vec(a), gelu_vec(b));
    }
    for (; i < n; i++) {
        vfloat one = {0};
        one[0] = load_one(y, dtype, i);
        store_one(y, dtype, i, gelu_vec(one)[0]);
    }
}

/* Layers [0, num_layers) over x [t, hidden] (contiguous; the result lands there); cu_seqlens
 * [num_seqs + 1]; weights: num_layers * PER_LAYER pointers; 1: GELU between the MLP's linears.
 * Returns 0, or -1 when scratch memory could not be had. */
int tokq_bert_layers(void *x, int dtype, int64_t t, const int64_t *cu_seqlens, int num_seqs,
                     int num_layers, const void *const *weights, int hidden, int num_heads,
                     int intermediate, float eps, float scale) {
    const size_t size = dtype == DTYPE_BF16 ? 2 : 4;
    const int head_dim = hidden / num_heads;
    char *qkv = malloc((size_t)t * 3 * hidden * size);
    char *attn = malloc((size_t)t * hidden * size);
    char *y = malloc((size_t)t * hidden * size);
    char *h = malloc((size_t)t * intermediate * size);
    if (!qkv || !attn || !y || !h) {
        free(qkv); free(attn); free(y); free(h);
        return -1;
    }
    char *cur = x; /* the layer's input; each LayerNorm's output becomes the next input */
    int failed = 0;
    for (int l = 0; l < num_layers && !failed; l++) {
        const void *const *w = weights + (size_t)l * PER_LAYER;
        linear_rows(dtype, cur, t, hidden, w[QKV_W], 3 * hidden, w[QKV_B], qkv);
        const int64_t st = 3 * hidden;
        failed = tokq_varlen_attention(qkv, qkv + hidden * size, qkv + 2 * hidden * size, attn, dtype,
                                       cu_seqlens, 0, num_seqs, 0, num_heads, num_heads, num_heads,
                                       head_dim, st, head_dim, st, head_dim, st, head_dim, 0, scale);
        linear_rows(dtype, attn, t, hidden, w[OUT_W], hidden, w[OUT_B], y);
        tokq_layer_norm(y, cur, w[LN1_W], w[LN1_B], y, dtype, 0, t, hidden, hidden, hidden, eps);
        char *swap = cur;
        cur = y;
        y = swap;
        linear_rows(dtype, cur, t, hidden, w[UP_W], intermediate, w[UP_B], h);
        gelu_inplace(h, dtype, t * intermediate);
        linear_rows(dtype, h, t, intermediate, w[DOWN_W], hidden, w[DOWN_B], y);
        tokq_layer_norm(y, cur, w[LN2_W], w[LN2_B], y, dtype, 0, t, hidden, hidden, hidden, eps);
        swap = cur;
        cur = y;
        y = swap;
    }
    if (cur != (char *)x) { /* the result sits in the scratch row buffer: move it, free x's */
        memcpy(x, cur, (size_t)t * hidden * size);
        y = cur;
    }
    free(qkv); free(attn); free(y); free(h);
    return failed ? -1 : 0;
}
