/* ---- Repacking GGUF blocks into the kernels' tiles at load ----

   pack_gguf_tiles turns a GGUF tensor's raw blocks (rows x row bytes, as the file stores them) into the tiles the
   integer kernels read, in one pass over the file's bytes: Q4_0, Q4_1 and Q4_K into the 4-bit tiles (TILE_BYTES),
   Q5_0, Q5_1 and Q5_K into the 5-bit ones (Q5_TILE_BYTES), Q8_0 into the 8-bit ones (Q8_TILE_BYTES); the layouts
   are cpu_kernels.c's. The bytes are exactly those of packing.py's numpy packers fed by gguf_quants.py, which stay
   the reference (and the path where the kernels do not run); tests/test_model_fast_pack.py holds the two equal.
   Why in C: numpy's packers widened every nibble, transposed through copies and converted the scales in several
   passes, several seconds for a 1B model where llama.cpp takes under one.

   Scales: a float16 that the file has (d, and Q4_1/Q5_1's m) is copied as it is, which is what numpy's float16 ->
   float32 -> float16 round trip gives for every value but NaN. A computed one is computed in float32 as numpy does
   (Q4_0's z = -8 d, Q5_0's -16 d, the K-quants' s = d * sc and z = -(dmin * m), each one rounding) and rounded to
   float16 by F16C to nearest even (numpy's astype rounds so too; both builds have -mf16c). No FMA can contract
   these: each is one multiply.

   Plain C besides the conversion; threads split the row blocks (each writes its own tiles). */

#ifndef TICKLOOM_CPU_KERNELS_PACK_H
#define TICKLOOM_CPU_KERNELS_PACK_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* GGML's type ids, as gguf_quants.GGML_TYPES has them. */
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13,
       GGML_Q6_K = 14 };

/* One row's share of a unit (a block of 32 weights, or a K-quant's super-block of 8 groups of 32), as the 4- and
   5-bit tiles take it: per group, the 16 nibble bytes in Q4_0's order (byte j: element j low, j + 16 high), the
   fifth bits (bit e: element e's) and s, z as float16 bits. */
typedef struct {
    uint8_t nib[8][16];
    uint32_t fifth[8];
    uint16_t s[8], z[8];
} pack_unit;

static inline uint16_t pack_half(float x) { return (uint16_t)_cvtss_sh(x, 0); }
static inline float pack_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
static inline uint16_t pack_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Q4_K/Q5_K's 12 bytes at sc: group j's 6-bit scale and min (gguf_quants._k_scales_mins). */
static inline void pack_k_scale_min(const uint8_t *sc, int j, uint8_t *scale, uint8_t *min) {
    if (j < 4) {
        *scale = sc[j] & 63;
        *min = sc[j + 4] & 63;
    } else {
        *scale = (uint8_t)((sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4));
        *min = (uint8_t)((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
    }
}

/* A K-quant super-block's nibbles: its 128 bytes are four runs of 32, run c holding group 2c in its low nibbles and
   2c + 1 in its high ones, element l of a group at byte l of the run; a tile wants elements j and j + 16 in one
   byte (gguf_quants.int4_fields). Also its scales and offsets. */
static inline void pack_k_unit(const uint8_t *blk, const uint8_t *qs, pack_unit *u) {
    const float d = pack_float(blk), dmin = pack_float(blk + 2);
    for (int c = 0; c < 4; c++) {
        const uint8_t *first = qs + 32 * c, *second = first + 16;
        for (int j = 0; j < 16; j++) {
            u->nib[2 * c][j] = (uint8_t)((first[j] & 0x0F) | (second[j] << 4));
            u->nib[2 * c + 1][j] = (uint8_t)((first[j] >> 4) | (second[j] & 0xF0));
        }
    }
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        pack_k_scale_min(blk + 4, j, &sc, &m);
        u->s[j] = pack_half(d * (float)sc);
        u->z[j] = pack_half(-(dmin * (float)m));
    }
}

/* Row r's unit `at` (its blocks from byte at * block bytes) of a 4- or 5-bit type; returns the groups it holds. */
static inline int pack_decode(int type, const uint8_t *row, int64_t at, pack_unit *u) {
    const uint8_t *b;
    switch (type) {
    case GGML_Q4_0:
        b = row + at * 18;
        memcpy(u->nib[0], b + 2, 16);
        u->s[0] = pack_u16(b);
        u->z[0] = pack_half(-8.0f * pack_float(b));
        return 1;
    case GGML_Q4_1:
        b = row + at * 20;
        memcpy(u->nib[0], b + 4, 16);
        u->s[0] = pack_u16(b);
        u->z[0] = pack_u16(b + 2);
        return 1;
    case GGML_Q5_0:
        b = row + at * 22;
        memcpy(u->nib[0], b + 6, 16);
        memcpy(&u->fifth[0], b + 2, 4); /* little-endian: bit e is element e's fifth bit */
        u->s[0] = pack_u16(b);
        u->z[0] = pack_half(-16.0f * pack_float(b));
        return 1;
    case GGML_Q5_1:
        b = row + at * 24;
        memcpy(u->nib[0], b + 8, 16);
        memcpy(&u->fifth[0], b + 4, 4);
        u->s[0] = pack_u16(b);
        u->z[0] = pack_u16(b + 2);
        return 1;
    case GGML_Q4_K:
        b = row + at * 144;
        pack_k_unit(b, b + 16, u);
        return 8;
    default: /* GGML_Q5_K: bit j of high byte l is element l of group j */
        b = row + at * 176;
        pack_k_unit(b, b + 48, u);
        for (int j = 0; j < 8; j++) {
            uint32_t bits = 0;
            for (int l = 0; l < 32; l++) bits |= (uint32_t)((b[16 + l] >> j) & 1) << l;
            u->fifth[j] = bits;
        }
        return 8;
    }
}

/* Group gi of the 16 rows' units as one 4- or 5-bit tile. */
static inline void pack_write_tile(const pack_unit *u, int gi, int five, uint8_t *tile) {
    for (int t = 0; t < 4; t++)
        for (int r = 0; r < 16; r++) memcpy(tile + 64 * t + 4 * r, u[r].nib[gi] + 4 * t, 4);
    for (int r = 0; r < 16; r++) {
        memcpy(tile + 256 + 2 * r, &u[r].s[gi], 2);
        memcpy(tile + 288 + 2 * r, &u[r].z[gi], 2);
    }
    if (!five) return;
    /* per chunk t, a 64-bit mask per nibble h: bit 4r + c is the fifth bit of row r's element 16h + 4t + c */
    for (int t = 0; t < 4; t++)
        for (int h = 0; h < 2; h++) {
            uint64_t mask = 0;
            for (int r = 0; r < 16; r++) mask |= (uint64_t)((u[r].fifth[gi] >> (16 * h + 4 * t)) & 0x0F) << (4 * r);
            memcpy(tile + TILE_BYTES + 16 * t + 8 * h, &mask, 8);
        }
}

/* Row block `blk` of a Q8_0 tensor: per group, the 32 int8 of each row in 8 chunks (byte 64u + 4r + c: row r's
   element 4u + c), the rows' d (float16, the file's), then each row's sum of its 32 integers as int16. */
static void pack_q8_block(const uint8_t *src, int64_t row_stride, int64_t blk, int64_t groups, uint8_t *out) {
    for (int64_t g = 0; g < groups; g++) {
        uint8_t *tile = out + (blk * groups + g) * Q8_TILE_BYTES;
        for (int r = 0; r < 16; r++) {
            const uint8_t *b = src + (16 * blk + r) * row_stride + g * 34;
            const int8_t *q = (const int8_t *)(b + 2);
            for (int u = 0; u < 8; u++) memcpy(tile + 64 * u + 4 * r, q + 4 * u, 4);
            memcpy(tile + 512 + 2 * r, b, 2);
            int sum = 0;
            for (int e = 0; e < 32; e++) sum += q[e];
            const int16_t s16 = (int16_t)sum; /* |sum| <= 32 * 128 */
            memcpy(tile + 544 + 2 * r, &s16, 2);
        }
    }
}

/* Row block `blk`'s super-block `at` of a Q6_K tensor (cpu_kernels_common.h): the 16 rows' d as the file has them,
   then 8 tiles: the nibbles as a 4-bit tile's, per chunk 32 bytes of the two high bits, the int8 scales of the
   rows' first halves, then of their second halves. A Q6_K block is 128 bytes of low nibbles (element e at byte 64
   (e / 128) + e % 64, the high nibble when (e / 64) is odd), 64 of two-bit highs (element e at byte 32 (e / 128) + e
   % 32, bits 2 ((e / 32) % 4)), 16 int8 scales and the float16 d (gguf_quants.q6_fields). */
static void pack_q6_super(const uint8_t *src, int64_t row_stride, int64_t blk, int64_t at, uint8_t *out) {
    uint8_t q[16][256];
    const uint8_t *b[16];
    for (int r = 0; r < 16; r++) {
        b[r] = src + (16 * blk + r) * row_stride + at * 210;
        const uint8_t *ql = b[r], *qh = b[r] + 128;
        for (int h = 0; h < 2; h++) /* e = 128 h + 32 j + l: runs of 32 the compiler vectorizes */
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++)
                    q[r][128 * h + 32 * j + l] = (uint8_t)(((ql[64 * h + 32 * (j & 1) + l] >> (4 * (j >> 1))) & 0x0F) |
                                                           ((qh[32 * h + l] >> (2 * j)) & 3) << 4);
        memcpy(out + 2 * r, b[r] + 208, 2);
    }
    for (int gi = 0; gi < 8; gi++) {
        uint8_t *tile = out + 32 + gi * Q6_TILE_BYTES;
        for (int r = 0; r < 16; r++) {
            const uint8_t *v = q[r] + 32 * gi;
            for (int t = 0; t < 4; t++)
                for (int c = 0; c < 4; c++) {
                    const int e = 4 * t + c;
                    tile[64 * t + 4 * r + c] = (uint8_t)((v[e] & 0x0F) | (v[16 + e] & 0x0F) << 4);
                }
            tile[Q6_SCALES_AT + r] = b[r][192 + 2 * gi];
            tile[Q6_SCALES_AT + 16 + r] = b[r][192 + 2 * gi + 1];
        }
        /* chunk t, byte i < 32: rows i / 4 and 8 + i / 4, element 4t + i % 4 of each half: bits 0-1 the first row's
           first half, 2-3 its second half, 4-5 and 6-7 the second row's */
        for (int t = 0; t < 4; t++)
            for (int i = 0; i < 32; i++) {
                const uint8_t *lo = q[i / 4] + 32 * gi, *hi = q[8 + i / 4] + 32 * gi;
                const int e = 4 * t + i % 4;
                tile[Q6_HIGH_AT + 32 * t + i] =
                    (uint8_t)(lo[e] >> 4 | (lo[16 + e] >> 4) << 2 | (hi[e] >> 4) << 4 | (hi[16 + e] >> 4) << 6);
            }
    }
}

/* A GGUF tensor of GGML type `type`, `rows` rows of `k` weights (row r's blocks at src + r * row_stride), into its
   tiles at out: rows / 16 row blocks of k / 32 tiles each (TILE_BYTES for Q4_0, Q4_1, Q4_K; Q5_TILE_BYTES for Q5_0,
   Q5_1, Q5_K; Q8_TILE_BYTES for Q8_0; Q6_K's super-blocks of Q6_SUPER_BYTES). A joined weight's parts go one call
   each, out at their first row block.
   Returns 0, 1 for a type it does not take, or 2 for a shape (rows % 16, k % the block's weights). */
int pack_gguf_tiles(const uint8_t *src, int64_t row_stride, int64_t rows, int64_t k, int type, uint8_t *out,
                    int threads) {
    const int kquant = type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K;
    if (type != GGML_Q4_0 && type != GGML_Q4_1 && type != GGML_Q5_0 && type != GGML_Q5_1 && type != GGML_Q8_0 &&
        !kquant)
        return 1;
    if (rows % 16 || k <= 0 || k % (kquant ? 256 : 32)) return 2;
    const int64_t blocks = rows / 16, groups = k / 32, units = kquant ? k / 256 : groups;
    if (type == GGML_Q6_K) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t blk = 0; blk < blocks; blk++)
            for (int64_t at = 0; at < units; at++)
                pack_q6_super(src, row_stride, blk, at, out + (blk * units + at) * Q6_SUPER_BYTES);
        return 0;
    }
    if (type == GGML_Q8_0) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t blk = 0; blk < blocks; blk++) pack_q8_block(src, row_stride, blk, groups, out);
        return 0;
    }
    const int five = type == GGML_Q5_0 || type == GGML_Q5_1 || type == GGML_Q5_K;
    const int64_t tile_bytes = five ? Q5_TILE_BYTES : TILE_BYTES;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t blk = 0; blk < blocks; blk++) {
        pack_unit u[16];
        for (int64_t at = 0; at < units; at++) {
            int per = 1;
            for (int r = 0; r < 16; r++) per = pack_decode(type, src + (16 * blk + r) * row_stride, at, &u[r]);
            for (int gi = 0; gi < per; gi++)
                pack_write_tile(u, gi, five, out + (blk * groups + at * per + gi) * tile_bytes);
        }
    }
    return 0;
}

/* Float32 rows into the 8-bit tiles, each group of 32 rounded to int8 on its own step: the LM head's form for a head
   of any other type (head.Q8Linear.from_weight, which dequantizes the file's blocks to float32 a chunk of rows at a
   time). The arithmetic is the numpy/torch reference's, so the bytes are too: s = max|w| / 127 in float32, q = w /
   max(s, 1e-30) rounded to nearest even and clamped to +-127, the tile's d s rounded to float16 to nearest even,
   and each row's sum of q. Rows in sixteens, K a multiple of 32; returns 0, or 2 for a shape. */
int pack_q8_from_float(const float *w, int64_t rows, int64_t k, uint8_t *out, int threads) {
    if (rows % 16 || k <= 0 || k % 32) return 2;
    const int64_t blocks = rows / 16, groups = k / 32;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t blk = 0; blk < blocks; blk++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *tile = out + (blk * groups + g) * Q8_TILE_BYTES;
            for (int r = 0; r < 16; r++) {
                const float *v = w + (16 * blk + r) * k + 32 * g;
                float amax = 0.0f;
                for (int e = 0; e < 32; e++) amax = fmaxf(amax, fabsf(v[e]));
                const float s = amax / 127.0f, div = s < 1e-30f ? 1e-30f : s;
                int8_t q[32];
                int sum = 0;
                for (int e = 0; e < 32; e++) {
                    float x = nearbyintf(v[e] / div);
                    x = x > 127.0f ? 127.0f : (x < -127.0f ? -127.0f : x);
                    q[e] = (int8_t)x;
                    sum += q[e];
                }
                for (int u = 0; u < 8; u++) memcpy(tile + 64 * u + 4 * r, q + 4 * u, 4);
                const uint16_t d = pack_half(s);
                const int16_t s16 = (int16_t)sum;
                memcpy(tile + 512 + 2 * r, &d, 2);
                memcpy(tile + 544 + 2 * r, &s16, 2);
            }
        }
    return 0;
}

#endif
