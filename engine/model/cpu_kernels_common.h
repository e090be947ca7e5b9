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
#define TILE_BYTES_OF(bits) ((bits) == 4 ? TILE_BYTES : (bits) == 5 ? Q5_TILE_BYTES : Q6_TILE_BYTES)

/* The 6-bit form (GGUF Q6_K) keeps the file's scales: an int8 per 16 values and a float16 d per row and 256, so
   that its weights take the file's 210 bytes per 256 (0.82 bytes a weight; float16 scales per 16, as the 4- and
   5-bit tiles have per 32, took 0.875, and at batch 1 the bytes are the time). A row block's stream is super-blocks
   of 8 groups: the 16 rows' d (32 bytes of float16), then 8 tiles of 416 bytes (the nibbles as a 4-bit tile's,
   the two high bits per chunk, the int8 scales of the 16 rows' first halves, then of their second halves). K %
   256 == 0, as in every Q6_K tensor. Against the 448-byte tiles with float16 scales (old and new kernels
   alternating, 8 matrices of 2048 x 8192 out of cache): one row 3-7% faster, 32 rows within 3%, though half the
   416-byte tiles now straddle cache lines; the kernel makes each scale d sc per group, exact in float32. */
#define Q6_TILE_BYTES 416
#define Q6_HIGH_AT 256   /* per chunk t, 32 bytes at Q6_HIGH_AT + 32 t */
#define Q6_SCALES_AT 384 /* 16 int8 scales (rows 0-15) of the first halves, then 16 of the second */
#define Q6_SUPER_BYTES (32 + 8 * Q6_TILE_BYTES)

/* Group g's tile of row block `block` (groups = K / 32). */
static inline __attribute__((always_inline)) const uint8_t *tile_at(const uint8_t *w, int bits, int64_t groups,
                                                                    int64_t block, int64_t g) {
    if (bits != 6) return w + (block * groups + g) * TILE_BYTES_OF(bits);
    return w + (block * (groups / 8) + g / 8) * Q6_SUPER_BYTES + 32 + (g % 8) * Q6_TILE_BYTES;
}

/* The 16 rows' float16 d of a 6-bit tile's super-block (g: the tile's group). */
static inline __attribute__((always_inline)) const uint8_t *q6_d_at(const uint8_t *tile, int64_t g) {
    return tile - 32 - (g % 8) * Q6_TILE_BYTES;
}

#define MT 8 /* activation rows per pass over a row block's weights */

/* ROWS(mt, a, b) for each tile of MT activation rows, then once for the 1..7 left, mt a constant in every call so
   that the compiler unrolls the row loops and keeps the accumulators in registers. ROWS reads m0. */
#define FOR_ROW_TILES(m_rows, ROWS, a, b)                                                                          \
    do {                                                                                                           \
        int64_t m0 = 0;                                                                                            \
        for (; m0 + MT <= (m_rows); m0 += MT) ROWS(MT, a, b);                                                      \
        switch ((m_rows) - m0) {                                                                                   \
        case 7: ROWS(7, a, b); break;                                                                              \
        case 6: ROWS(6, a, b); break;                                                                              \
        case 5: ROWS(5, a, b); break;                                                                              \
        case 4: ROWS(4, a, b); break;                                                                              \
        case 3: ROWS(3, a, b); break;                                                                              \
        case 2: ROWS(2, a, b); break;                                                                              \
        case 1: ROWS(1, a, b); break;                                                                              \
        default: break;                                                                                            \
        }                                                                                                          \
    } while (0)

/* FOR_ROW_TILES with ROWS(mt, bits, passes), bits (4, 5, 6) and passes (1, 2) literals in each call: OpenMP
   outlines a parallel loop's body into a function of its own, where a variable would reach the row kernel unknown
   and its loops would not unroll (three times slower at batch 8). */
#define FOR_ROW_TILES_OF(m_rows, ROWS, bits, passes)                                                               \
    do {                                                                                                           \
        if ((passes) == 2) {                                                                                       \
            if ((bits) == 6) FOR_ROW_TILES(m_rows, ROWS, 6, 2);                                                    \
            else if ((bits) == 5) FOR_ROW_TILES(m_rows, ROWS, 5, 2);                                               \
            else FOR_ROW_TILES(m_rows, ROWS, 4, 2);                                                                \
        } else if ((bits) == 6) FOR_ROW_TILES(m_rows, ROWS, 6, 1);                                                 \
        else if ((bits) == 5) FOR_ROW_TILES(m_rows, ROWS, 5, 1);                                                   \
        else FOR_ROW_TILES(m_rows, ROWS, 4, 1);                                                                    \
    } while (0)

#define Q8_TILE_BYTES 576

/* Each build defines these two. `prepare` rounds the activations to int8 per group of 32, in one pass or two:
     qx     rows x K int8: row m's value for pass 1 at row m, its residual's for pass 2 at row M + m
     dx     rows x K/32: each group's step (max|x| / 127)
     dxs    rows x K/32: dx * the group's sum of qx (NULL: not wanted)
     dxs16  rows x K/16: dx * each half group's sum (NULL: not wanted; the 6-bit tiles' offsets apply per 16)
     chosen M x (K/32 + 1) int32: per row, how many groups have a second pass, then those groups in order
   Two passes: x ~ dx * qx + dx2 * qx2, where qx2 rounds the residual x - dx * qx on its own step (about 15 bits in
   all), in every group (`select` 0: the LM head's 8-bit kernel, chosen NULL) or in the groups whose step is
   above second_pass_limit (1: the 4- to 6-bit kernels, which read the others' second-pass rows nowhere).
   `q4_blocks` multiplies the tiles of 4-, 5- or 6-bit weights (`bits`; TILE_BYTES_OF) by them, summing the passes'
   products into the same sums. */
static void prepare(const uint16_t *x, int64_t m_rows, int64_t k, int passes, int select, int8_t *qx, float *dx,
                    float *dxs, float *dxs16, int32_t *chosen);
static inline __attribute__((always_inline)) void q4_blocks(const uint8_t *w, const int8_t *qx, const float *dx,
                                                             const float *dxs, const float *dxs16,
                                                             const int32_t *chosen, uint16_t *y, float *yf,
                                                             int64_t m_rows, int64_t n, int64_t k, int bits,
                                                             int passes, int threads);

/* The groups of a row that get a second pass in the 4- to 6-bit kernels: those whose step is above
   SECOND_PASS_ABOVE times the root mean square of the row's steps (d: the row's K/32 steps). Why not every group:
   a second pass doubles the integer products, which at batch 32 are the time; the rounding error a group leaves
   grows with its step, and in a projection's input a few groups have most of it (the channels a norm's weight
   makes wide, and silu(gate) * up's outliers): on the bundled model 8-16% of each projection's groups are above
   1.5 times the rms, and in the down projection they hold 96% of the squared steps. Measured on the bundled Q4_0
   file with the accuracy bench's measure (40 prompts, top-1 agreement and mean KL against the float32 model), a
   second pass in every projection: in none 0.9667 (KL 0.00297); in the down projection alone 0.9698 (0.00266);
   above 1.5 rms 0.9844 (0.00097); above 1 rms 0.9870 (0.00068); above 0.5 rms 0.9911 (0.00036); every group
   0.9901 (0.00023). A step of 32 rows on the 1B model (Q4_0): above 1.5 rms in every projection about 5% more
   time than in the down projection alone, above 1 rms 50% more, every group 2.3 times. The sum runs in group
   order, the same in both builds, and depends on the row alone, so a row's result does not depend on its batch. */
#define SECOND_PASS_ABOVE 1.5f
static float second_pass_limit(const float *d, int64_t groups) {
    float sum = 0.0f;
    for (int64_t g = 0; g < groups; g++) sum += d[g] * d[g];
    return SECOND_PASS_ABOVE * sqrtf(sum / (float)groups);
}

/* The matmul of 4-, 5- or 6-bit tiles: bfloat16 out into y, or float32 into yf when that is given. N % 16 == 0,
   K % 32 == 0 (256 for 6 bits), passes 1 or 2; `scratch` holds at least int_scratch_bytes(M, K, passes). Returns 0, or 1 for what
   it does not take. The float32 form serves the projections added to the float32 residual stream.

   Two passes (prepare, above) add the residual's products to the same sums, in the groups second_pass_limit picks:
   llama.py asks for them in every projection. They cost those groups' integer products once more: a lone row's in
   the group loop, more rows' row by row after the first pass over the row block (where a tile of rows shares one
   unpacking of the weights), from a list of them per row. A test of each group's step in the group loop was a
   branch mispredicted about as often as a group was chosen; taking, in the loop, the block's rows that chose a
   group with one unpacking of its tile (the rows' lists merged) was no faster than the lists after the loop. */
static int q4_matmul_to(const uint16_t *x, const uint8_t *w, uint16_t *y, float *yf, int64_t m_rows, int64_t n,
                        int64_t k, void *scratch, int threads, int bits, int passes) {
    if (n % 16 || k % 32 || (bits != 4 && bits != 5 && bits != 6) || (passes != 1 && passes != 2) ||
        (bits == 6 && k % 256))
        return 1;
    const int64_t rows = passes * m_rows, groups = k / 32;
    int8_t *qx = (int8_t *)scratch;
    float *dx = (float *)(((uintptr_t)(qx + rows * k) + 63) & ~(uintptr_t)63);
    float *dxs = dx + rows * groups, *dxs16 = dxs + rows * groups;
    int32_t *chosen = (int32_t *)(dxs16 + 2 * rows * groups);
    prepare(x, m_rows, k, passes, 1, qx, dx, bits == 6 ? NULL : dxs, bits == 6 ? dxs16 : NULL, chosen);
    q4_blocks(w, qx, dx, dxs, dxs16, chosen, y, yf, m_rows, n, k, bits, passes, threads);
    return 0;
}

/* y = x @ w^T for 4-, 5- or 6-bit tiles: y bfloat16, or float32 when f32 (the same sums, unrounded). */
int int_matmul(const uint16_t *x, const uint8_t *w, void *y, int64_t m_rows, int64_t n, int64_t k, void *scratch,
               int threads, int bits, int passes, int f32) {
    return q4_matmul_to(x, w, f32 ? NULL : (uint16_t *)y, f32 ? (float *)y : NULL, m_rows, n, k, scratch, threads,
                        bits, passes);
}

int64_t int_scratch_bytes(int64_t m_rows, int64_t k, int64_t passes) {
    return passes * (m_rows * k + 4 * m_rows * (k / 32) * 4) + (passes - 1) * m_rows * (k / 32 + 1) * 4 + 64;
}
int64_t q8_scratch_bytes(int64_t m_rows, int64_t k) { return 2 * m_rows * k + 2 * m_rows * (k / 32) * 4 + 64; }
int64_t attn_scratch_floats(int64_t rows, int64_t kv_heads, int64_t groups, int64_t max_len, int64_t head_dim) {
    return rows * kv_heads * groups * (max_len + 16 + head_dim);
}

#endif
