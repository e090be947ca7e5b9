/* A step's decoder layers in one call: the same kernels llama.py calls one by one (add_rms_norm, a projection,
   rope_and_store, paged attention, silu_mul), run in the same order on the same buffers, so the result is the
   layer loop's to the bit. Included last by both builds; the AVX512 one defines HAVE_BF16_MATMUL.

   Why: at batch 1 a small model's step was a third Python. Each kernel call through ctypes costs 2 us before it
   does anything, and the wrappers around it (output tensors, checks, scratch) as much again: 14 calls a layer, 30
   layers, about 2.5 ms of an 8 ms step on the bundled model. One call a step leaves that to the kernels.

   What it takes (engine/model/fused.py checks before it builds the tables): every projection on a kernel of its
   own (4-, 5-, 6- or 8-bit tiles, or 16-bit ones), biases only where the output is rounded (q/k/v: Qwen2),
   Llama's layer (one norm before each sublayer, silu, one rope table, no windows or soft-caps). Anything else runs
   the layer loop in llama.py.

   Every token of the step is a row of its own for attention, with its block table and context length: a decode
   row's, or a prompt query's (the chunk's table, its position + 1). The kernel's result for a row depends on
   nothing else (cpu_kernels_rowwise.h), which is why a prompt's queries could always go through it as rows. */

#ifndef TICKLOOM_CPU_KERNELS_LAYERS_H
#define TICKLOOM_CPU_KERNELS_LAYERS_H

#include <stdint.h>

enum { LIN_Q4 = 4, LIN_Q5 = 5, LIN_Q6 = 6, LIN_Q8 = 8, LIN_HALF_BF16 = 16, LIN_HALF_F16 = 17, LIN_BF16 = 18 };

/* One projection: its tiles, output and input sizes, kind (LIN_*) and activation passes (1 or 2: int_matmul; the
4- to 6-bit kinds alone take 2). */
typedef struct {
    const void *w;
    int64_t n, k;
    int64_t kind, passes;
} tl_linear;

/* A projection in up to PARTS parts side by side along its output (a file's q/k/v in two types: Q4_K_M keeps
   some attn_v in Q6_K), each part's output rounded, then joined; unused parts have n = 0. bias (float32, or NULL)
   is added where the layer's class adds it: to the float32 sums before they are rounded (bias_after 0: 16-bit
   layers), or to the rounded output, rounded again (bias_after 1: the integer layers, and a split projection's
   joined output). */
#define PARTS 3
typedef struct {
    tl_linear part[PARTS];
    const float *bias;
    int64_t bias_after;
} tl_proj;

/* One layer: its four projections (qkv, o, gate/up, down) and its two norms' float32 weights. */
typedef struct {
    tl_proj qkv, wo, w13, w2;
    const float *attn_norm, *mlp_norm;
} tl_layer;

/* The model's sizes. f32: a float32 model (float32 activations); else bfloat16 activations. The residual stream is
   float32 in both. */
typedef struct {
    int64_t hidden, inter, q_size, qkv_size, rope_heads, kv_heads, groups, head_dim, f32;
    float eps, scale;
} tl_model;

#define ATTN_SLICE 64 /* attention rows per kernel call: its scratch grows with rows x context */

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static int64_t linear_scratch(const tl_linear *l, int64_t rows) {
    return l->kind == LIN_Q8   ? q8_scratch_bytes(rows, l->k)
           : l->kind <= LIN_Q6 ? int_scratch_bytes(rows, l->k, l->passes)
                               : 0;
}

/* Bytes of the workspace (64-byte aligned) run_layers wants for `rows` tokens and `per_row` blocks a row. */
int64_t layers_work_bytes(const tl_model *m, const tl_layer *layers, int64_t n_layers, int64_t rows,
                          int64_t max_len) {
    const int64_t act = m->f32 ? 4 : 2;
    int64_t scratch = 0;
    for (int64_t i = 0; i < n_layers; i++) {
        const tl_proj *ps[4] = {&layers[i].qkv, &layers[i].wo, &layers[i].w13, &layers[i].w2};
        for (int j = 0; j < 4; j++)
            for (int p = 0; p < PARTS; p++) scratch = max64(scratch, linear_scratch(&ps[j]->part[p], rows));
    }
    const int64_t slice = rows < ATTN_SLICE ? rows : ATTN_SLICE;
    scratch = max64(scratch, 4 * attn_scratch_floats(slice, m->kv_heads, m->groups, max_len, m->head_dim));
    const int64_t wide = max64(m->qkv_size, 2 * m->inter);
    return 64 * 7 + act * rows * (m->hidden + m->qkv_size + m->q_size + 2 * m->inter + m->inter + wide) +
           4 * rows * wide + scratch;
}

/* out[r, :] += bias, rows x n (a multiple of 16), float32 (f32) or bfloat16 (the sum rounded to nearest even). */
static void add_bias(void *out, int64_t rows, int64_t n, const float *bias, int f32) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < n; j += 16) {
            float *of = (float *)out + r * n + j;
            uint16_t *ob = (uint16_t *)out + r * n + j;
            if (f32) v16_storeu(of, v16_add(v16_loadu(of), v16_loadu(bias + j)));
            else store_bf16(ob, v16_add(load_bf16(ob), v16_loadu(bias + j)));
        }
}

/* out = x @ l^T: float32 when out_f32 (or a float32 model), else bfloat16 (rounded once, to nearest even).
   f32tmp holds the float32 sums of kernels that give only those. */
static int project(const tl_model *m, const tl_linear *l, const void *x, int64_t rows, void *out, int out_f32,
                   float *f32tmp, void *scratch, int threads, const float *bias) {
    const int to_bf16 = !out_f32 && !m->f32;
    float *sums = to_bf16 ? f32tmp : (float *)out;
    int rc;
    switch (l->kind) {
    case LIN_Q4:
    case LIN_Q5:
    case LIN_Q6:
        if (bias) return 3; /* their bias goes on the rounded output (bias_after) */
        return q4_matmul_to((const uint16_t *)x, (const uint8_t *)l->w, to_bf16 ? (uint16_t *)out : NULL,
                            to_bf16 ? NULL : (float *)out, rows, l->n, l->k, scratch, threads, (int)l->kind,
                            (int)l->passes);
    case LIN_Q8:
        rc = q8_matmul((const uint16_t *)x, (const uint8_t *)l->w, sums, rows, l->n, l->k, scratch, threads);
        break;
    case LIN_HALF_BF16:
    case LIN_HALF_F16:
        rc = half_matmul((const float *)x, (const uint16_t *)l->w, sums, rows, l->n, l->k,
                         (int)(l->kind - LIN_HALF_BF16), threads);
        break;
#ifdef HAVE_BF16_MATMUL
    case LIN_BF16:
        rc = bf16_matmul((const uint16_t *)x, (const uint16_t *)l->w, sums, rows, l->n, l->k, threads);
        break;
#endif
    default:
        return 3;
    }
    if (rc) return rc;
    if (bias) add_bias(sums, rows, l->n, bias, 1);
    if (!to_bf16) return 0;
    const int64_t total = rows * l->n; /* n is a multiple of 16 here (fused.py checks) */
    for (int64_t i = 0; i < total; i += 16) store_bf16((uint16_t *)out + i, v16_loadu(sums + i));
    return 0;
}

/* out = x @ p^T, its parts' outputs side by side (rows x the parts' n together); a part of a row of several goes
   through `parts` first, to be copied into its columns. */
static int project_parts(const tl_model *m, const tl_proj *p, const void *x, int64_t rows, void *out, int out_f32,
                         float *f32tmp, void *parts, void *scratch, int threads) {
    const int64_t size = out_f32 || m->f32 ? 4 : 2;
    int64_t total = 0, at = 0;
    if (p->part[1].n == 0) {
        int rc = project(m, &p->part[0], x, rows, out, out_f32, f32tmp, scratch, threads,
                         p->bias_after ? NULL : p->bias);
        if (!rc && p->bias && p->bias_after) add_bias(out, rows, p->part[0].n, p->bias, size == 4);
        return rc;
    }
    for (int i = 0; i < PARTS; i++) total += p->part[i].n;
    for (int i = 0; i < PARTS && p->part[i].n; i++) {
        const int64_t n = p->part[i].n;
        int rc = project(m, &p->part[i], x, rows, rows == 1 ? (char *)out + at * size : parts, out_f32, f32tmp,
                         scratch, threads, NULL);
        if (rc) return rc;
        if (rows > 1)
            for (int64_t r = 0; r < rows; r++)
                memcpy((char *)out + (r * total + at) * size, (char *)parts + r * n * size, (size_t)(n * size));
        at += n;
    }
    if (p->bias) add_bias(out, rows, total, p->bias, size == 4);
    return 0;
}

static char *carve(char **at, int64_t bytes) {
    char *p = *at;
    *at += (bytes + 63) & ~(int64_t)63;
    return p;
}

/* All layers for `rows` tokens: x (rows x hidden float32, the embeddings) becomes the residual stream before the
   last layer's down projection, whose output goes to y (rows x hidden float32); the caller adds y to x and applies
   the final norm, as llama.py's loop does. positions, slots: each token's; tables (rows x per_row) and lengths:
   each token's blocks and context length. kv: the paged cache's layers one after another, each 2 * kv_heads x
   num_blocks x block_size x head_dim. work: layers_work_bytes(rows, per_row *
   block_size), 64-byte aligned. Returns 0, or the first kernel's nonzero code (1, 2: shapes or lengths it does not
   take; 3: a projection kind this build lacks, or a bias before rounding on integer tiles). */
int run_layers(const tl_model *m, const tl_layer *layers, int64_t n_layers, float *x, float *y, int64_t rows,
               const int64_t *positions, const int64_t *slots, const int64_t *tables, int64_t per_row,
               const int64_t *lengths, const void *cos, const void *sin_signed, void *kv, int64_t num_blocks,
               int64_t block_size, float eps, float scale, void *work, int threads) {
    const int64_t act = m->f32 ? 4 : 2, f32 = m->f32;
    char *at = (char *)work;
    void *h = carve(&at, act * rows * m->hidden), *qkv = carve(&at, act * rows * m->qkv_size);
    void *att = carve(&at, act * rows * m->q_size), *gate_up = carve(&at, act * rows * 2 * m->inter);
    void *mid = carve(&at, act * rows * m->inter);
    float *f32tmp = (float *)carve(&at, 4 * rows * max64(m->qkv_size, 2 * m->inter));
    void *parts = carve(&at, act * rows * max64(m->qkv_size, 2 * m->inter));
    void *scratch = at;
    const int64_t num_slots = num_blocks * block_size;
    const int64_t layer_bytes = 2 * m->kv_heads * num_slots * m->head_dim * act;
    int rc;
    for (int64_t n = 0; n < n_layers; n++) {
        const tl_layer *ly = &layers[n];
        void *cache = (char *)kv + n * layer_bytes;
        /* the previous layer's down projection joins the stream here, as the attention's output does below */
        if (f32) add_rms_norm_f32_out(x, n ? y : NULL, ly->attn_norm, (float *)h, rows, m->hidden, eps);
        else add_rms_norm_f32(x, n ? y : NULL, ly->attn_norm, (uint16_t *)h, rows, m->hidden, eps);
        if ((rc = project_parts(m, &ly->qkv, h, rows, qkv, 0, f32tmp, parts, scratch, threads))) return rc;
        if (f32)
            rope_and_store_f32((float *)qkv, rows, m->qkv_size, positions, (const float *)cos,
                               (const float *)sin_signed, m->rope_heads, m->kv_heads, m->head_dim, slots,
                               (float *)cache, num_slots);
        else
            rope_and_store((uint16_t *)qkv, rows, m->qkv_size, positions, (const uint16_t *)cos,
                           (const uint16_t *)sin_signed, m->rope_heads, m->kv_heads, m->head_dim, slots,
                           (uint16_t *)cache, num_slots);
        for (int64_t r0 = 0; r0 < rows; r0 += ATTN_SLICE) {
            const int64_t count = rows - r0 < ATTN_SLICE ? rows - r0 : ATTN_SLICE;
            if (f32)
                rc = paged_decode_attention_f32((const float *)qkv + r0 * m->qkv_size, m->qkv_size,
                                                (const float *)cache, num_blocks, block_size,
                                                tables + r0 * per_row, per_row, lengths + r0, count, m->kv_heads,
                                                m->groups, m->head_dim, scale, (float *)att + r0 * m->q_size,
                                                (float *)scratch, threads);
            else
                rc = paged_decode_attention((const uint16_t *)qkv + r0 * m->qkv_size, m->qkv_size,
                                            (const uint16_t *)cache, num_blocks, block_size,
                                            tables + r0 * per_row, per_row, lengths + r0, count, m->kv_heads,
                                            m->groups, m->head_dim, scale, (uint16_t *)att + r0 * m->q_size,
                                            (float *)scratch, threads);
            if (rc) return rc;
        }
        if ((rc = project_parts(m, &ly->wo, att, rows, y, 1, f32tmp, parts, scratch, threads))) return rc;
        if (f32) add_rms_norm_f32_out(x, y, ly->mlp_norm, (float *)h, rows, m->hidden, eps);
        else add_rms_norm_f32(x, y, ly->mlp_norm, (uint16_t *)h, rows, m->hidden, eps);
        if ((rc = project_parts(m, &ly->w13, h, rows, gate_up, 0, f32tmp, parts, scratch, threads))) return rc;
        if (f32) silu_mul_f32((const float *)gate_up, rows, m->inter, (float *)mid);
        else silu_mul((const uint16_t *)gate_up, rows, m->inter, (uint16_t *)mid);
        if ((rc = project_parts(m, &ly->w2, mid, rows, y, 1, f32tmp, parts, scratch, threads))) return rc;
    }
    return 0;
}

#endif
