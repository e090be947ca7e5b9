/* What tickloom's two builds of its CPU kernels share (cpu_kernels.c for AVX512, cpu_kernels_avx2.c for AVX2):
   the weight tiles' sizes, the row tiling, the LM head's two-pass activation rounding (plain C) and the scratch
   sizes the Python side asks for. Included once by each; everything here is static or a plain definition. */

#ifndef TICKLOOM_CPU_KERNELS_COMMON_H
#define TICKLOOM_CPU_KERNELS_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define TILE_BYTES 320
#define Q5_TILE_BYTES 384 /* a 4-bit tile and the fifth bits' masks */
#define Q6_TILE_BYTES 448 /* and the sixth bits'; a second scale where the offset was */
#define TILE_BYTES_OF(bits) ((bits) == 4 ? TILE_BYTES : (bits) == 5 ? Q5_TILE_BYTES : Q6_TILE_BYTES)
#define MT 8 /* activation rows per pass over a row block's weights */

/* ROWS(mt) for each tile of MT activation rows, then once for the 1..7 left, mt a constant in every call so that
   the compiler unrolls the row loops and keeps the accumulators in registers. ROWS reads m0. */
#define FOR_ROW_TILES(m_rows, ROWS)                                                                                \
    do {                                                                                                           \
        int64_t m0 = 0;                                                                                            \
        for (; m0 + MT <= (m_rows); m0 += MT) ROWS(MT);                                                            \
        switch ((m_rows) - m0) {                                                                                   \
        case 7: ROWS(7); break;                                                                                    \
        case 6: ROWS(6); break;                                                                                    \
        case 5: ROWS(5); break;                                                                                    \
        case 4: ROWS(4); break;                                                                                    \
        case 3: ROWS(3); break;                                                                                    \
        case 2: ROWS(2); break;                                                                                    \
        case 1: ROWS(1); break;                                                                                    \
        default: break;                                                                                            \
        }                                                                                                          \
    } while (0)

#define Q8_TILE_BYTES 576

/* Two 8-bit passes per activation: x ~ dx * qx + dx2 * qx2, where qx2 quantizes the residual x - dx * qx on its
   own scale (about 15 bits in all). Why: the LM head's input has a few channels 15-20 times the row's rms, so one
   8-bit step per group leaves the other channels few bits, and the argmax moves (greedy agreement with float32
   fell by half a point); the second pass costs little, as the weights are read once for both. */
static void prepare_two_pass(const uint16_t *x, int64_t m_rows, int64_t k, int8_t *qx, float *dx) {
    const int64_t groups = k / 32;
    for (int64_t m = 0; m < m_rows; m++) {
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *in = x + m * k + 32 * g;
            float v[32], amax = 0.0f, ramax = 0.0f, r[32];
            for (int j = 0; j < 32; j++) {
                union { uint32_t u; float f; } c = {(uint32_t)in[j] << 16};
                v[j] = c.f;
                amax = fmaxf(amax, fabsf(c.f));
            }
            float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *hi = qx + m * k + 32 * g, *lo = qx + (m_rows + m) * k + 32 * g;
            for (int j = 0; j < 32; j++) {
                float q = nearbyintf(v[j] * inv);
                hi[j] = (int8_t)q;
                r[j] = v[j] - d * q;
                ramax = fmaxf(ramax, fabsf(r[j]));
            }
            float d2 = ramax / 127.0f, inv2 = ramax > 0.0f ? 127.0f / ramax : 0.0f;
            for (int j = 0; j < 32; j++) lo[j] = (int8_t)nearbyintf(r[j] * inv2);
            dx[m * groups + g] = d;
            dx[(m_rows + m) * groups + g] = d2;
        }
    }
}

/* dxs[r, g] = dx[r, g] * the sum of qx over group g of row r (prepare's dxs, for rows prepare_two_pass rounded). */
static void group_sums(const int8_t *qx, const float *dx, int64_t rows, int64_t k, float *dxs) {
    const int64_t groups = k / 32;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            int32_t sum = 0;
            for (int j = 0; j < 32; j++) sum += qx[r * k + 32 * g + j];
            dxs[r * groups + g] = dx[r * groups + g] * (float)sum;
        }
}

/* dxs16[m, 2 g + h] = dx[m, g] * the sum of qx over half h (16 values) of group g: the 6-bit tiles' offsets
   apply per half group. */
static void half_group_sums(const int8_t *qx, const float *dx, int64_t m_rows, int64_t k, float *dxs16) {
    const int64_t groups = k / 32;
    for (int64_t m = 0; m < m_rows; m++)
        for (int64_t g = 0; g < groups; g++)
            for (int h = 0; h < 2; h++) {
                int32_t sum = 0;
                for (int j = 0; j < 16; j++) sum += qx[m * k + 32 * g + 16 * h + j];
                dxs16[(m * groups + g) * 2 + h] = dx[m * groups + g] * (float)sum;
            }
}

/* Each build defines these two: `prepare` rounds the activations to int8 per group of 32 (qx, dx, and dxs = dx *
   sum qx), `q4_blocks` multiplies the tiles of 4-, 5- or 6-bit weights (`bits`; TILE_BYTES_OF) by them, in one
   pass or two (`passes`: rows [0, M) of qx and dx, then the residual's rows [M, 2M), into the same sums). */
static void prepare(const uint16_t *x, int64_t m_rows, int64_t k, int8_t *qx, float *dx, float *dxs);
static inline __attribute__((always_inline)) void q4_blocks(const uint8_t *w, const int8_t *qx, const float *dx,
                                                             const float *dxs, const float *dxs16, uint16_t *y,
                                                             float *yf, int64_t m_rows, int64_t n, int64_t k,
                                                             int bits, int passes, int threads);

/* The matmul of 4-, 5- or 6-bit tiles: bfloat16 out into y, or float32 into yf when that is given. N % 16 == 0,
   K % 32 == 0, passes 1 or 2; `scratch` holds at least int_scratch_bytes(M, K, passes). Returns 0, or 1 for what
   it does not take. The float32 form serves the projections added to the float32 residual stream.

   Two passes round the activations as the LM head's do (prepare_two_pass) and add the residual's products to the
   same sums: llama.py asks for them in the down projection, whose input (silu(gate) * up) has the widest groups of
   any projection's, a few values far above the rest, so that one 8-bit step per group leaves the others few bits.
   Measured on the accuracy bench (teacher-forced top-1 against the float32 model), one pass there cost Q4_0 a third
   of a point against float32 activations; two passes double the integer products of that one projection, which at
   batch 1 hide behind the weights' reads. */
static int q4_matmul_to(const uint16_t *x, const uint8_t *w, uint16_t *y, float *yf, int64_t m_rows, int64_t n,
                        int64_t k, void *scratch, int threads, int bits, int passes) {
    if (n % 16 || k % 32 || (bits != 4 && bits != 5 && bits != 6) || (passes != 1 && passes != 2)) return 1;
    const int64_t rows = passes * m_rows, groups = k / 32;
    int8_t *qx = (int8_t *)scratch;
    float *dx = (float *)(((uintptr_t)(qx + rows * k) + 63) & ~(uintptr_t)63);
    float *dxs = dx + rows * groups, *dxs16 = dxs + rows * groups;
    if (passes == 2) {
        prepare_two_pass(x, m_rows, k, qx, dx);
        group_sums(qx, dx, rows, k, dxs);
    } else {
        prepare(x, m_rows, k, qx, dx, dxs);
    }
    if (bits == 6) half_group_sums(qx, dx, rows, k, dxs16);
    q4_blocks(w, qx, dx, dxs, dxs16, y, yf, m_rows, n, k, bits, passes, threads);
    return 0;
}

/* y = x @ w^T for 4-, 5- or 6-bit tiles: y bfloat16, or float32 when f32 (the same sums, unrounded). */
int int_matmul(const uint16_t *x, const uint8_t *w, void *y, int64_t m_rows, int64_t n, int64_t k, void *scratch,
               int threads, int bits, int passes, int f32) {
    return q4_matmul_to(x, w, f32 ? NULL : (uint16_t *)y, f32 ? (float *)y : NULL, m_rows, n, k, scratch, threads,
                        bits, passes);
}

int64_t int_scratch_bytes(int64_t m_rows, int64_t k, int64_t passes) {
    return passes * (m_rows * k + 4 * m_rows * (k / 32) * 4) + 64;
}
int64_t q8_scratch_bytes(int64_t m_rows, int64_t k) { return 2 * m_rows * k + 2 * m_rows * (k / 32) * 4 + 64; }
int64_t attn_scratch_floats(int64_t rows, int64_t kv_heads, int64_t groups, int64_t max_len, int64_t head_dim) {
    return rows * kv_heads * groups * (max_len + 16 + head_dim);
}

#endif
