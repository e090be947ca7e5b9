/* The kernels that are the same in both builds, written once against a 16-lane float vector `v16` that each
   build defines before including this file (cpu_kernels.c: one __m512; cpu_kernels_avx2.c: two __m256), with
   v16_set1, v16_zero, v16_add, v16_sub, v16_mul, v16_fmadd, v16_loadu, v16_storeu, v16_reduce_add, load_bf16,
   store_bf16, exp_nonpositive, and two that must differ by instruction set:
     exp_tail(p, n, top): e^(p[i] - top) for the n < 16 scores left, stored back, lanes past n zero;
     silu(a): a / (1 + e^-a), computed without overflow for either sign.
   The integer matmuls' activation rounding (prepare) is here too, written against the build's `group32` (32 float32
   values), load_group and round_group.

   ---- Paged attention (one query per row) ----

   kv: one layer of the paged cache, 2 * kv_heads x num_blocks x block_size x head_dim bfloat16 (K's heads, then
   V's). Row b attends to its first lengths[b] positions; position t lives in block block_index[b * per_row + t /
   block_size], slot t % block_size. q: row b's query heads at q + b * q_stride, heads x head_dim bfloat16, query
   head h reading kv head h / groups. out: rows x heads x head_dim bfloat16.

   Why: at batch 1 the torch path gathered every block of the context into a new tensor and ran a flash attention
   made for long queries, 40 us a layer for a few thousand multiply-adds. Here each (row, kv head) reads its blocks
   in place, in float32, with the query heads that share the kv head together (one read of each key and value). A
   prompt's queries come here too, each as a row of its own (engine/model/llama.py says why). */

#ifndef TICKLOOM_CPU_KERNELS_ROWWISE_H
#define TICKLOOM_CPU_KERNELS_ROWWISE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* x: M x K bfloat16 -> per row and group of 32, as cpu_kernels_common.h lays it out: qx, dx, and where not NULL
   dxs and dxs16; passes 2 rounds each group's residual into rows M..2M-1, in every group (`select` 0) or in those
   whose step is above second_pass_limit (1), listed in `chosen`. */
static void prepare(const uint16_t *x, int64_t m_rows, int64_t k, int passes, int select, int8_t *qx, float *dx,
                    float *dxs, float *dxs16, int32_t *chosen) {
    const int64_t groups = k / 32;
    const int all = passes == 2 && !select;
    for (int64_t m = 0; m < m_rows; m++) {
        for (int64_t g = 0; g < groups; g++) {
            group32 v;
            load_group(x + m * k + 32 * g, &v);
            for (int p = 0; p < (all ? 2 : 1); p++) {
                const int64_t at = (p * m_rows + m) * groups + g;
                round_group(&v, qx + (p * m_rows + m) * k + 32 * g, dx + at, dxs ? dxs + at : NULL,
                            dxs16 ? dxs16 + 2 * at : NULL, p == 0 && all);
            }
        }
        if (passes == 1 || all) continue;
        const float limit = second_pass_limit(dx + m * groups, groups);
        int32_t *list = chosen + m * (groups + 1);
        list[0] = 0;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at2 = (m_rows + m) * groups + g;
            if (!(dx[m * groups + g] > limit)) continue;
            list[++list[0]] = (int32_t)g;
            group32 v;
            int8_t again[32];
            float d;
            load_group(x + m * k + 32 * g, &v);
            round_group(&v, again, &d, NULL, NULL, 1); /* the first pass once more, for its residual */
            round_group(&v, qx + (m_rows + m) * k + 32 * g, dx + at2, dxs ? dxs + at2 : NULL,
                        dxs16 ? dxs16 + 2 * at2 : NULL, 0);
        }
    }
}

/* An element run of a row of bfloat16 (f32 = 0) or float32 (f32 = 1) values; f32 is a constant after inlining. */
static inline __attribute__((always_inline)) v16 load_row(const void *p, int64_t i, int f32) {
    return f32 ? v16_loadu((const float *)p + i) : load_bf16((const uint16_t *)p + i);
}
static inline __attribute__((always_inline)) void store_row(void *p, int64_t i, v16 v, int f32) {
    if (f32) v16_storeu((float *)p + i, v);
    else store_bf16((uint16_t *)p + i, v);
}

static inline __attribute__((always_inline)) int attention_rows(
    const void *q, int64_t q_stride, const void *kv, int64_t num_blocks, int64_t block_size, const int64_t *block_index,
    int64_t per_row, const int64_t *lengths, int64_t rows, int64_t kv_heads, int64_t groups, int64_t head_dim,
    float scale, void *out, float *scratch, int threads, int f32) {
    if (head_dim % 16 || head_dim > 256) return 1;
    const int64_t max_len = per_row * block_size, chunks = head_dim / 16, heads = kv_heads * groups;
    const int64_t head_stride = num_blocks * block_size * head_dim;
    for (int64_t b = 0; b < rows; b++)
        if (lengths[b] < 1 || lengths[b] > max_len) return 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t item = 0; item < rows * kv_heads; item++) {
        const int64_t b = item / kv_heads, h = item % kv_heads, len = lengths[b];
        const int64_t *table = block_index + b * per_row;
        const int64_t kbase = h * head_stride, vbase = (kv_heads + h) * head_stride;
        float *mine = scratch + item * groups * (max_len + 16 + head_dim);
        for (int64_t j = 0; j < groups; j++) {
            float *scores = mine + j * (max_len + 16 + head_dim), *acc = scores + max_len + 16;
            const int64_t qh = b * q_stride + (h * groups + j) * head_dim;
            v16 qv[16];
            for (int64_t c = 0; c < chunks; c++) qv[c] = v16_mul(load_row(q, qh + 16 * c, f32), v16_set1(scale));
            float best = -INFINITY;
            for (int64_t t = 0; t < len; t++) {
                const int64_t key = kbase + (table[t / block_size] * block_size + t % block_size) * head_dim;
                v16 dot = v16_mul(qv[0], load_row(kv, key, f32));
                for (int64_t c = 1; c < chunks; c++) dot = v16_fmadd(qv[c], load_row(kv, key + 16 * c, f32), dot);
                float s = v16_reduce_add(dot);
                scores[t] = s;
                best = s > best ? s : best;
            }
            v16 total = v16_zero(), top = v16_set1(best);
            int64_t t = 0;
            for (; t + 16 <= len; t += 16) {
                v16 e = exp_nonpositive(v16_sub(v16_loadu(scores + t), top));
                v16_storeu(scores + t, e);
                total = v16_add(total, e);
            }
            if (t < len) total = v16_add(total, exp_tail(scores + t, len - t, top));
            const float inv = 1.0f / v16_reduce_add(total);
            for (int64_t c = 0; c < chunks; c++) v16_storeu(acc + 16 * c, v16_zero());
            for (int64_t t2 = 0; t2 < len; t2++) {
                const int64_t val = vbase + (table[t2 / block_size] * block_size + t2 % block_size) * head_dim;
                v16 p = v16_set1(scores[t2]);
                for (int64_t c = 0; c < chunks; c++)
                    v16_storeu(acc + 16 * c, v16_fmadd(p, load_row(kv, val + 16 * c, f32), v16_loadu(acc + 16 * c)));
            }
            const int64_t o = (b * heads + h * groups + j) * head_dim;
            for (int64_t c = 0; c < chunks; c++)
                store_row(out, o + 16 * c, v16_mul(v16_loadu(acc + 16 * c), v16_set1(inv)), f32);
        }
    }
    return 0;
}

int paged_decode_attention(const uint16_t *q, int64_t q_stride, const uint16_t *kv, int64_t num_blocks,
                           int64_t block_size, const int64_t *block_index, int64_t per_row, const int64_t *lengths,
                           int64_t rows, int64_t kv_heads, int64_t groups, int64_t head_dim, float scale,
                           uint16_t *out, float *scratch, int threads) {
    return attention_rows(q, q_stride, kv, num_blocks, block_size, block_index, per_row, lengths, rows, kv_heads,
                          groups, head_dim, scale, out, scratch, threads, 0);
}
int paged_decode_attention_f32(const float *q, int64_t q_stride, const float *kv, int64_t num_blocks,
                               int64_t block_size, const int64_t *block_index, int64_t per_row, const int64_t *lengths,
                               int64_t rows, int64_t kv_heads, int64_t groups, int64_t head_dim, float scale,
                               float *out, float *scratch, int threads) {
    return attention_rows(q, q_stride, kv, num_blocks, block_size, block_index, per_row, lengths, rows, kv_heads,
                          groups, head_dim, scale, out, scratch, threads, 1);
}

/* ---- Row-wise ops of a decoder layer, fused so that a layer is a few calls rather than twenty torch ops ----

   At batch 1 a small model's step was mostly per-op overhead: each torch op costs a few microseconds before it
   touches data, and a layer had about twenty of them. All three below compute in float32 and round once to
   bfloat16 (add_rms_norm_f32 keeps its float32 stream unrounded). */

/* For each of `rows` rows of width h (a multiple of 16): if `add` is given, x += add (in x's type: rounded to
   bfloat16 on a bfloat16 stream, exact on a float32 one); then out = x / sqrt(mean(x^2) + eps) * w, bfloat16 or
   (out_f32, a float32 model's) float32. */
static inline __attribute__((always_inline)) void add_rms_norm_rows(void *x, const void *add, const float *w,
                                                                    void *out, int64_t rows, int64_t h,
                                                                    float eps, int f32, int out_f32) {
    for (int64_t r = 0; r < rows; r++) {
        v16 ss = v16_zero();
        for (int64_t i = r * h; i < (r + 1) * h; i += 16) {
            v16 v = load_row(x, i, f32);
            if (add) {
                store_row(x, i, v16_add(v, load_row(add, i, f32)), f32);
                v = load_row(x, i, f32);
            }
            ss = v16_fmadd(v, v, ss);
        }
        const v16 inv = v16_set1(1.0f / sqrtf(v16_reduce_add(ss) / (float)h + eps));
        for (int64_t i = 0; i < h; i += 16)
            store_row(out, r * h + i, v16_mul(v16_mul(load_row(x, r * h + i, f32), inv), v16_loadu(w + i)), out_f32);
    }
}

/* The bfloat16 residual stream (models on torch's layout) and the float32 one (tickloom's kernels: a bfloat16
   stream rounds every sublayer's contribution to 8 bits of mantissa, which costs about a point of agreement with
   float32 activations). */
void add_rms_norm(uint16_t *x, const uint16_t *add, const float *w, uint16_t *out, int64_t rows, int64_t h,
                  float eps) {
    add_rms_norm_rows(x, add, w, out, rows, h, eps, 0, 0);
}
void add_rms_norm_f32(float *x, const float *add, const float *w, uint16_t *out, int64_t rows, int64_t h,
                      float eps) {
    add_rms_norm_rows(x, add, w, out, rows, h, eps, 1, 0);
}
/* A float32 model's: float32 in and out. */
void add_rms_norm_f32_out(float *x, const float *add, const float *w, float *out, int64_t rows, int64_t h,
                          float eps) {
    add_rms_norm_rows(x, add, w, out, rows, h, eps, 1, 1);
}

/* Rotary embedding on the first `rope_heads` heads of each qkv row (q's, then k's), in place, then K and V (the
   next 2 * kv_heads heads) stored at flat cache slot slots[r] of `kv` (2 * kv_heads x num_slots x head_dim).
   cos and sin_signed are tables of head_dim columns per position (the angles twice; sin with its first half
   negated): x' = x * cos + roll(x, head_dim / 2) * sin_signed. head_dim is a multiple of 32. All bfloat16, or
   (f32) all float32. */
static inline __attribute__((always_inline)) void rope_rows(void *qkv, int64_t rows, int64_t stride,
                                                            const int64_t *positions, const void *cos,
                                                            const void *sin_signed, int64_t rope_heads,
                                                            int64_t kv_heads, int64_t head_dim, const int64_t *slots,
                                                            void *kv, int64_t num_slots, int f32) {
    const int64_t half = head_dim / 2, size = f32 ? 4 : 2;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t c = positions[r] * head_dim, s = c;
        for (int64_t hd = 0; hd < rope_heads; hd++) {
            const int64_t x = r * stride + hd * head_dim;
            for (int64_t i = 0; i < half; i += 16) {
                v16 lo = load_row(qkv, x + i, f32), hi = load_row(qkv, x + half + i, f32);
                v16 new_lo = v16_fmadd(hi, load_row(sin_signed, s + i, f32), v16_mul(lo, load_row(cos, c + i, f32)));
                v16 new_hi = v16_fmadd(lo, load_row(sin_signed, s + half + i, f32),
                                       v16_mul(hi, load_row(cos, c + half + i, f32)));
                store_row(qkv, x + i, new_lo, f32);
                store_row(qkv, x + half + i, new_hi, f32);
            }
        }
        const char *k_and_v = (const char *)qkv + (r * stride + (rope_heads - kv_heads) * head_dim) * size;
        for (int64_t hd = 0; hd < 2 * kv_heads; hd++)
            memcpy((char *)kv + (hd * num_slots + slots[r]) * head_dim * size, k_and_v + hd * head_dim * size,
                   (size_t)(size * head_dim));
    }
}
void rope_and_store(uint16_t *qkv, int64_t rows, int64_t stride, const int64_t *positions, const uint16_t *cos,
                    const uint16_t *sin_signed, int64_t rope_heads, int64_t kv_heads, int64_t head_dim,
                    const int64_t *slots, uint16_t *kv, int64_t num_slots) {
    rope_rows(qkv, rows, stride, positions, cos, sin_signed, rope_heads, kv_heads, head_dim, slots, kv, num_slots, 0);
}
void rope_and_store_f32(float *qkv, int64_t rows, int64_t stride, const int64_t *positions, const float *cos,
                        const float *sin_signed, int64_t rope_heads, int64_t kv_heads, int64_t head_dim,
                        const int64_t *slots, float *kv, int64_t num_slots) {
    rope_rows(qkv, rows, stride, positions, cos, sin_signed, rope_heads, kv_heads, head_dim, slots, kv, num_slots, 1);
}

/* out (rows x inter) = silu(gate) * up, where each row of gate_up is [gate (inter), up (inter)]; inter is a
   multiple of 16. silu(a) = a / (1 + e^-a). bfloat16, or (f32) float32. */
static inline __attribute__((always_inline)) void silu_rows(const void *gate_up, int64_t rows, int64_t inter,
                                                            void *out, int f32) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < inter; i += 16) {
            const int64_t g = r * 2 * inter + i;
            store_row(out, r * inter + i, v16_mul(silu(load_row(gate_up, g, f32)), load_row(gate_up, g + inter, f32)),
                      f32);
        }
}
void silu_mul(const uint16_t *gate_up, int64_t rows, int64_t inter, uint16_t *out) {
    silu_rows(gate_up, rows, inter, out, 0);
}
void silu_mul_f32(const float *gate_up, int64_t rows, int64_t inter, float *out) {
    silu_rows(gate_up, rows, inter, out, 1);
}

#endif
