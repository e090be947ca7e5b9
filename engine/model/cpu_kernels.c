/* tickloom's CPU kernels for x86 with AVX512 VNNI and BF16: a 4-bit weight x bfloat16 activation matmul, and
   paged attention for decode rows.

   Built at first use by engine/model/native.py (gcc -O3, OpenMP) and called through ctypes. Plain C, no Python
   or torch headers, so it compiles in about a second.

   ---- The matmul ----

   Weights: w[n, k] = s[n, g] * q[n, k] + z[n, g] for q in 0..15, g = k / 32 (GGUF Q4_1 is exactly this with
   s = d, z = m; Q4_0 with s = d, z = -8 d). The layout is one stream of 320-byte tiles, one per (block of 16
   output rows, group of 32 inputs), in that order:
     bytes   0..255  4 chunks of 64 bytes; in chunk t, byte 4r + c of row r holds q[16b + r, 32g + 4t + c] in its
                     low nibble and q[16b + r, 32g + 16 + 4t + c] in its high one (GGUF's byte 4t + c of the row)
     bytes 256..287  s for the 16 rows, float16
     bytes 288..319  z for the 16 rows, float16
   The 5-bit form (GGUF Q5_0, Q5_1, Q5_K: q in 0..31) is the same tile with 64 bytes more, 384 in all:
     bytes 320..383  per chunk t, two 64-bit masks (little-endian): bit i of the first is the fifth bit of the
                     value in byte i's low nibble, of the second that of its high nibble
   so a chunk's bytes become q with one masked OR each (VPDPBUSD takes unsigned bytes up to 255). The 6-bit form
   (GGUF Q6_K: q in 0..63, w = d sc (q - 32) with an int8 sc per 16 and a float16 d per 256) has 416 bytes a tile
   and the rows' d once per 8 tiles (cpu_kernels_common.h): the nibbles as above, per chunk 32 bytes at 256 + 32 t
   of the two high bits (q >> 4): byte i holds those of byte i's low nibble in bits 0-1 and of its high nibble in
   bits 2-3, and byte 32 + i's in bits 4-7 likewise (shifts and masks put them in place, no mask registers), then
   at 384 the 16 rows' sc of the group's first half (its low nibbles) and at 400 of its second; each half sums
   apart and gets its own scale s = d sc (exact in float32: 11 bits times 8) and offset -32 s.

   Why: a decode step multiplies one activation row by every weight once, so it is bound by how fast weights
   become products. Activations are quantized per group of 32 to int8 (x ~ dx * qx), and VPDPBUSD multiplies 64
   unsigned nibbles by 64 signed activations a time, summing each 4 into a 32-bit lane: lane r of a chunk's low
   nibbles is row r's dot product over 4 inputs. Sixteen output rows sit in one register, so the group's scale and
   offset apply as vector FMAs once per group, with no horizontal sums:
     sum_k w x ~ dx * (s * sum q qx + z * sum qx).

   Arithmetic is the same for a row whatever the batch or the thread count (threads split output rows), so a row's
   result does not depend on what else is in the batch. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels_common.h"

/* Asks for the cache lines of [p, p + bytes) ahead of use: each row block's tiles, PREFETCH_TILES groups ahead.
   The hardware prefetcher follows one stream well, but a step switches streams every row block and runs each for a
   few kilobytes; measured on this project's AVX512 VM (2048 x 8192 matrices out of cache, one thread), asking 8
   tiles ahead made the 5-bit kernel 1.6-2.0x faster at batch 1, every integer kernel 1.4-1.6x at batch 8 and
   1.11-1.20x at batch 32; the 4- and 8-bit kernels at one row lost 4-5% with it, so they go without (mt and bits
   are constants after inlining, so the test costs nothing). A prefetch past the weights' end reads nothing. */
#define PREFETCH_TILES 8
static inline __attribute__((always_inline)) void prefetch(const uint8_t *p, int bytes) {
    for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)(p + line), _MM_HINT_T0);
}

/* Chunk t of a 4-, 5- or 6-bit tile as unsigned bytes, four inputs of one row a lane: lo the group's first 16
   inputs (the low nibbles), hi its second 16. */
static inline __attribute__((always_inline)) void unpack_chunk(const uint8_t *tile, int t, int bits, __m512i *lo,
                                                               __m512i *hi) {
    const __m512i low = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    __m512i bytes = _mm512_loadu_si512((const void *)(tile + 64 * t));
    *lo = _mm512_and_si512(bytes, low);
    *hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
    if (bits == 5) { /* each byte's fifth bit from the masks: 64 for the low nibbles, 64 for the high */
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        uint64_t m[2];
        memcpy(m, tile + TILE_BYTES + 16 * t, 16);
        *lo = _mm512_or_si512(*lo, _mm512_maskz_mov_epi8((__mmask64)m[0], bit4));
        *hi = _mm512_or_si512(*hi, _mm512_maskz_mov_epi8((__mmask64)m[1], bit4));
    } else if (bits == 6) { /* two high bits a value, four values a byte: the upper half's in bits 4-7 */
        __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(tile + Q6_HIGH_AT + 32 * t)));
        h = _mm512_srlv_epi64(h, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0));
        *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_slli_epi16(h, 4), bits45));
        *hi = _mm512_or_si512(*hi, _mm512_and_si512(_mm512_slli_epi16(h, 2), bits45));
    }
}

/* A tile's scales and offsets for 16 rows: w = s q + z; 6-bit tiles (Q6_K) have a scale per half, s and s1, each
   d sc, and the offset -32 times it (add_group). `g`: the tile's group (6 bits: where its super-block's d is). */
typedef struct {
    __m512 s, z, s1;
} tile_scales;

static inline __attribute__((always_inline)) __m512 q6_scales(__m512 d, const uint8_t *sc) {
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc))));
}

static inline __attribute__((always_inline)) void load_scales(const uint8_t *tile, int64_t g, int bits,
                                                              tile_scales *ts) {
    if (bits != 6) {
        ts->s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 256)));
        ts->z = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 288)));
        return;
    }
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)q6_d_at(tile, g)));
    ts->s = q6_scales(d, tile + Q6_SCALES_AT);
    ts->s1 = q6_scales(d, tile + Q6_SCALES_AT + 16);
}

/* acc + one group's products for one activation row (`at`: its index into dx): first and second are the integer
   sums over the group's halves (split: 6-bit tiles), else first over the whole group. */
static inline __attribute__((always_inline)) __m512 add_group(__m512 acc, const tile_scales *ts, __m512i first,
                                                              __m512i second, const float *dx, const float *dxs,
                                                              const float *dxs16, int64_t at, int split) {
    if (split) { /* per half s (dx sum q qx - 32 dx sum qx): the offset before the scale, one multiply fewer */
        __m512 dxv = _mm512_set1_ps(dx[at]);
        __m512 t0 = _mm512_fmadd_ps(dxv, _mm512_cvtepi32_ps(first), _mm512_set1_ps(-32.0f * dxs16[2 * at]));
        __m512 t1 = _mm512_fmadd_ps(dxv, _mm512_cvtepi32_ps(second), _mm512_set1_ps(-32.0f * dxs16[2 * at + 1]));
        return _mm512_fmadd_ps(ts->s1, t1, _mm512_fmadd_ps(ts->s, t0, acc));
    }
    __m512 sd = _mm512_mul_ps(ts->s, _mm512_set1_ps(dx[at]));
    acc = _mm512_fmadd_ps(sd, _mm512_cvtepi32_ps(first), acc);
    return _mm512_fmadd_ps(ts->z, _mm512_set1_ps(dxs[at]), acc);
}

/* acc + the second pass's products of one group (its tile) for activation row r (of the residual's rows). */
static inline __attribute__((always_inline)) __m512 second_pass_group(__m512 acc, const uint8_t *tile,
                                                                      const int8_t *qx, const float *dx,
                                                                      const float *dxs, const float *dxs16,
                                                                      int64_t r, int64_t g, int64_t k, int bits) {
    tile_scales ts;
    load_scales(tile, g, bits, &ts);
    __m512i two[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int t = 0; t < 4; t++) {
        __m512i lo, hi;
        unpack_chunk(tile, t, bits, &lo, &hi);
        const int8_t *xq = qx + r * k + 32 * g + 4 * t;
        two[(2 * t) % 4] = _mm512_dpbusd_epi32(two[(2 * t) % 4], lo, _mm512_set1_epi32(*(const int32_t *)xq));
        two[(2 * t + 1) % 4] =
            _mm512_dpbusd_epi32(two[(2 * t + 1) % 4], hi, _mm512_set1_epi32(*(const int32_t *)(xq + 16)));
    }
    __m512i first = _mm512_add_epi32(two[0], two[2]), second = _mm512_add_epi32(two[1], two[3]);
    const int split = bits == 6;
    if (!split) first = _mm512_add_epi32(first, second);
    return add_group(acc, &ts, first, second, dx, dxs, dxs16, r * (k / 32) + g, split);
}

/* Rows [m0, m0 + mt) of the output for row block `block`; mt <= MT, bits (4, 5 or 6) and passes constants after
   inlining. 6-bit tiles keep the two halves of a group apart: each has its own scale and offset. */
static inline __attribute__((always_inline)) void block_rows(
    const uint8_t *w, const int8_t *qx, const float *dx, const float *dxs, const float *dxs16, const int32_t *chosen,
    uint16_t *y, float *yf, int64_t m_rows, int64_t n, int64_t k, int64_t block, int64_t m0, int mt, int bits,
    int passes) {
    const int64_t groups = k / 32, tile_bytes = TILE_BYTES_OF(bits);
    const int split = bits == 6;
    /* VPDPBUSD takes several cycles to finish, so a lone row would wait on its own accumulator: few rows get
       several independent partial sums (chains), added once per group. Split tiles need an even count: the low
       nibbles (a group's first half) go to even chains, the high ones to odd chains. */
    const int chains = mt == 1 ? 4 : (mt >= 4 && !split ? 1 : 2);
    __m512 acc[MT], acc2[MT];
    for (int i = 0; i < mt; i++) acc[i] = acc2[i] = _mm512_setzero_ps();
    const int32_t *lone = chosen + m0 * (groups + 1); /* mt 1: the row's chosen groups, taken in the loop */
    int32_t next = passes == 2 && mt == 1 ? 1 : 0;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = tile_at(w, bits, groups, block, g);
        if (mt > 1 || bits != 4) prefetch(tile + PREFETCH_TILES * tile_bytes, (int)tile_bytes);
        tile_scales ts;
        load_scales(tile, g, bits, &ts);
        __m512i part[4 * MT];
        for (int i = 0; i < mt * chains; i++) part[i] = _mm512_setzero_si512();
        for (int t = 0; t < 4; t++) {
            __m512i lo, hi;
            unpack_chunk(tile, t, bits, &lo, &hi);
            for (int i = 0; i < mt; i++) {
                const int8_t *xq = qx + (m0 + i) * k + 32 * g + 4 * t;
                int c0 = i * chains + (2 * t) % chains, c1 = i * chains + (2 * t + 1) % chains;
                part[c0] = _mm512_dpbusd_epi32(part[c0], lo, _mm512_set1_epi32(*(const int32_t *)xq));
                part[c1] = _mm512_dpbusd_epi32(part[c1], hi, _mm512_set1_epi32(*(const int32_t *)(xq + 16)));
            }
        }
        for (int i = 0; i < mt; i++) {
            __m512i first = part[i * chains], second = first; /* second: the group's second half (split) */
            if (split) {
                second = part[i * chains + 1];
                for (int c = 2; c < chains; c += 2) {
                    first = _mm512_add_epi32(first, part[i * chains + c]);
                    second = _mm512_add_epi32(second, part[i * chains + c + 1]);
                }
            } else {
                for (int c = 1; c < chains; c++) first = _mm512_add_epi32(first, part[i * chains + c]);
            }
            acc[i] = add_group(acc[i], &ts, first, second, dx, dxs, dxs16, (m0 + i) * groups + g, split);
        }
        if (next && next <= lone[0] && lone[next] == g) {
            acc2[0] = second_pass_group(acc2[0], tile, qx, dx, dxs, dxs16, m_rows + m0, g, k, bits);
            next++;
        }
    }
    /* the residual's pass, row by row over the groups prepare chose for it, into sums of their own (acc2); a lone
       row takes its groups in the loop above, where the tile is in L1 and the weights' stream goes on (after the
       loop, a row block's chosen tiles came back from L2 with the memory idle: 15-25% on a cold down projection),
       more rows after it from a list each (a test per row and group was a mispredicted branch as often as a group
       was chosen). Either way the same sums in the same order, so a row's result does not depend on its batch. */
    for (int i = 0; passes == 2 && mt > 1 && i < mt; i++) {
        const int32_t *list = chosen + (m0 + i) * (groups + 1);
        for (int32_t j = 1; j <= list[0]; j++)
            acc2[i] = second_pass_group(acc2[i], tile_at(w, bits, groups, block, list[j]), qx, dx, dxs, dxs16,
                                        (m_rows + m0 + i), list[j], k, bits);
    }
    for (int i = 0; i < mt; i++) {
        int64_t at = (m0 + i) * n + 16 * block;
        if (passes == 2) acc[i] = _mm512_add_ps(acc[i], acc2[i]);
        if (yf) _mm512_storeu_ps(yf + at, acc[i]);
        else _mm256_storeu_si256((__m256i *)(y + at), (__m256i)_mm512_cvtneps_pbh(acc[i]));
    }
}

static inline __attribute__((always_inline)) void q4_blocks(const uint8_t *w, const int8_t *qx, const float *dx,
                                                             const float *dxs, const float *dxs16,
                                                             const int32_t *chosen, uint16_t *y, float *yf,
                                                             int64_t m_rows, int64_t n, int64_t k, int bits,
                                                             int passes, int threads) {
    const int64_t blocks = n / 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
#define ROWS_OF(mt, bits_, passes_)                                                                                 \
    block_rows(w, qx, dx, dxs, dxs16, chosen, y, yf, m_rows, n, k, b, m0, mt, bits_, passes_)
        FOR_ROW_TILES_OF(m_rows, ROWS_OF, bits, passes);
#undef ROWS_OF
    }
}

/* ---- The 8-bit matmul (the LM head, from GGUF Q8_0) ----

   Weights: w[n, k] = d[n, g] * q[n, k], q int8, g = k / 32 (GGUF Q8_0 exactly). Tiles of 576 bytes, one per (16
   output rows, group of 32 inputs): 8 chunks of 64 bytes (chunk t, byte 4r + c: q[16b + r, 32g + 4t + c]), then d
   for the 16 rows (float16), then sum_k q[n, k] over the group for the 16 rows (int16). VPDPBUSD wants one side
   unsigned: the activations go in as qx + 128 (bytes xor 0x80, flipped once after `prepare`, not per row and
   chunk: a broadcast from memory is a load, the xor was one vector op beside each VPDPBUSD), and 128 * sum q
   comes off once per group. The output is float32. */

static inline __attribute__((always_inline)) void q8_block_rows(
    const uint8_t *w, const int8_t *qx, const float *dx, float *y, int64_t m_rows, int64_t n, int64_t k,
    int64_t block, int64_t m0, int mt) {
    const int64_t groups = k / 32;
    const int chains = mt >= 4 ? 1 : (mt == 1 ? 4 : 2);
    __m512 acc[MT];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    const uint8_t *tile = w + block * groups * Q8_TILE_BYTES;
    for (int64_t g = 0; g < groups; g++, tile += Q8_TILE_BYTES) {
        if (mt > 1) prefetch(tile + PREFETCH_TILES * Q8_TILE_BYTES, Q8_TILE_BYTES);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 512)));
        __m512i offset = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(tile + 544))), 7);
        for (int pass = 0; pass < 2; pass++) { /* the activations' 8-bit value, then its rounding residual */
            const int8_t *xp = qx + pass * m_rows * k;
            const float *dp = dx + pass * m_rows * groups;
            __m512i part[MT];
            for (int i = 0; i < mt * chains; i++) part[i] = _mm512_setzero_si512();
            for (int t = 0; t < 8; t++) {
                __m512i wq = _mm512_loadu_si512((const void *)(tile + 64 * t));
                for (int i = 0; i < mt; i++) {
                    const int8_t *xq = xp + (m0 + i) * k + 32 * g + 4 * t;
                    int c = i * chains + t % chains;
                    part[c] = _mm512_dpbusd_epi32(part[c], _mm512_set1_epi32(*(const int32_t *)xq), wq);
                }
            }
            for (int i = 0; i < mt; i++) {
                __m512i sum = part[i * chains];
                for (int c = 1; c < chains; c++) sum = _mm512_add_epi32(sum, part[i * chains + c]);
                sum = _mm512_sub_epi32(sum, offset);
                __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dp[(m0 + i) * groups + g]));
                acc[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum), acc[i]);
            }
        }
    }
    for (int i = 0; i < mt; i++) _mm512_storeu_ps(y + (m0 + i) * n + 16 * block, acc[i]);
}


/* y (M x N float32) = x (M x K bfloat16) @ w^T for Q8 tiles; `scratch` holds q8_scratch_bytes(M, K). */
int q8_matmul(const uint16_t *x, const uint8_t *w, float *y, int64_t m_rows, int64_t n, int64_t k, void *scratch,
              int threads) {
    if (n % 16 || k % 32) return 1;
    int8_t *qx = (int8_t *)scratch;
    float *dx = (float *)(((uintptr_t)(qx + 2 * m_rows * k) + 63) & ~(uintptr_t)63);
    prepare(x, m_rows, k, 2, 0, qx, dx, NULL, NULL, NULL);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t i = 0; i < 2 * m_rows * k; i += 64) /* 2 M K bytes, a multiple of 64 (K % 32 == 0) */
        _mm512_storeu_si512((void *)(qx + i), _mm512_xor_si512(_mm512_loadu_si512((const void *)(qx + i)), flip));
    const int64_t blocks = n / 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
#define Q8_ROWS(mt, unused_a, unused_b) q8_block_rows(w, qx, dx, y, m_rows, n, k, b, m0, mt)
        FOR_ROW_TILES(m_rows, Q8_ROWS, 0, 0);
#undef Q8_ROWS
    }
    return 0;
}

/* ---- The 16-lane vector the shared kernels (cpu_kernels_rowwise.h) are written against: one __m512 ---- */

typedef __m512 v16;

static inline v16 v16_set1(float a) { return _mm512_set1_ps(a); }
static inline v16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v16_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v16_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v16_fmadd(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v16_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_storeu(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline float v16_reduce_add(v16 v) { return _mm512_reduce_add_ps(v); }

static inline __m512 load_f16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* e^x for x <= 0 (softmax inputs after subtracting the max), relative error under 2e-7; -inf gives 0. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)); /* x log2(e) */
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n); /* in [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n); /* p * 2^n */
}

static inline void store_bf16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v)); /* round to nearest even */
}

/* The softmax's last n < 16 scores, masked: lanes past n read 0 and give 0. */
static inline v16 exp_tail(float *p, int64_t n, v16 top) {
    __mmask16 m = (__mmask16)((1u << n) - 1);
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p), top));
    e = _mm512_maskz_mov_ps(m, e);
    _mm512_mask_storeu_ps(p, m, e);
    return e;
}

/* a >= 0: a / (1 + e^-a); a < 0: a e^a / (1 + e^a), with e^a = e^-|a| (the exp takes inputs <= 0 only) */
static inline v16 silu(v16 a) {
    __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(a));
    __m512 e = exp_nonpositive(_mm512_max_ps(neg, _mm512_set1_ps(-87.0f))); /* e^-|a| */
    __mmask16 positive = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GE_OQ);
    __m512 num = _mm512_mask_mov_ps(_mm512_mul_ps(a, e), positive, a);
    return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

/* 32 activations in float32: the unit the int8 rounding works on (prepare, in cpu_kernels_rowwise.h). */
typedef struct {
    __m512 v[2];
} group32;

static inline __attribute__((always_inline)) void load_group(const uint16_t *in, group32 *g) {
    g->v[0] = load_bf16(in);
    g->v[1] = load_bf16(in + 16);
}

/* One group rounded to int8: q = v / d to nearest even (|q| <= 127), d = max|v| / 127 into *d_out, and where asked
   d * sum q (*sum) and d * each half's sum (half[0], half[1]: the 6-bit tiles' offsets apply per 16). With
   `residual` v becomes v - d q (d q rounded, then the difference), for a second pass. */
static inline __attribute__((always_inline)) void round_group(group32 *g, int8_t *q, float *d_out, float *sum,
                                                              float *half, int residual) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    float amax =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, g->v[0]), _mm512_andnot_ps(sign, g->v[1])));
    float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512 scale = _mm512_set1_ps(inv);
    /* round to nearest even, as nearbyintf would */
    const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(g->v[0], scale), nearest);
    __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(g->v[1], scale), nearest);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(q1));
    *d_out = d;
    if (sum) *sum = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    if (half) {
        half[0] = d * (float)_mm512_reduce_add_epi32(q0);
        half[1] = d * (float)_mm512_reduce_add_epi32(q1);
    }
    if (residual) {
        g->v[0] = _mm512_sub_ps(g->v[0], _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(q0)));
        g->v[1] = _mm512_sub_ps(g->v[1], _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(q1)));
    }
}

#include "cpu_kernels_rowwise.h"
#include "cpu_kernels_half.h"

/* ---- bfloat16 weights times bfloat16 activations (a bfloat16 model's projections): VDPBF16PS ----

   The same tiles as half_matmul (HN = 4 rows; chunk c of row j at HN c + 16 j), so one 64-byte load holds one
   chunk of two rows: lanes 0-7 of a VDPBF16PS against the activations' chunk (its 16 values in both halves of the
   register) sum row j's pairs, lanes 8-15 row j + 1's. The products of two bfloat16 values are exact in float32, as
   in half_matmul, which widens both sides first; this reads the weights without widening them and does a pair of
   products per lane, half the instructions (the AVX2 build has no such instruction: native.py widens the
   activations there and calls half_matmul). Each lane's pairs go in k order and each row's lanes are reduced in a
   fixed order at its end, whatever the batch or thread count: a row's result does not depend on its batch. */

#define BM 8 /* activation rows per pass */

static inline __attribute__((always_inline)) void bf16_rows(const uint16_t *x, const uint16_t *tile, float *y,
                                                            int64_t n, int64_t k, int64_t n0, int64_t m0, int mt) {
    __m512 acc[BM][2];
    for (int i = 0; i < mt; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 16) {
        __m512bh w01 = (__m512bh)_mm512_loadu_si512((const void *)(tile + HN * c));
        __m512bh w23 = (__m512bh)_mm512_loadu_si512((const void *)(tile + HN * c + 32));
        for (int i = 0; i < mt; i++) {
            __m512bh xv = (__m512bh)_mm512_broadcast_i32x8(_mm256_loadu_si256((const __m256i *)(x + (m0 + i) * k + c)));
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w01);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w23);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < HN && n0 + j < n; j++)
            y[(m0 + i) * n + n0 + j] = _mm512_mask_reduce_add_ps((__mmask16)(j % 2 ? 0xFF00 : 0x00FF), acc[i][j / 2]);
}

/* y (M x N float32) = x (M x K bfloat16) @ w^T, w bfloat16 in half_matmul's tiles. Returns 0, or 1 for what it
   does not take (K % 16). */
int bf16_matmul(const uint16_t *x, const uint16_t *w, float *y, int64_t m_rows, int64_t n, int64_t k, int threads) {
    if (k % 16) return 1;
    const int64_t tiles = (n + HN - 1) / HN;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < tiles; b++) {
        const uint16_t *tile = w + b * HN * k;
        int64_t m0 = 0;
        for (; m0 + BM <= m_rows; m0 += BM) bf16_rows(x, tile, y, n, k, b * HN, m0, BM);
        switch (m_rows - m0) {
        case 7: bf16_rows(x, tile, y, n, k, b * HN, m0, 7); break;
        case 6: bf16_rows(x, tile, y, n, k, b * HN, m0, 6); break;
        case 5: bf16_rows(x, tile, y, n, k, b * HN, m0, 5); break;
        case 4: bf16_rows(x, tile, y, n, k, b * HN, m0, 4); break;
        case 3: bf16_rows(x, tile, y, n, k, b * HN, m0, 3); break;
        case 2: bf16_rows(x, tile, y, n, k, b * HN, m0, 2); break;
        case 1: bf16_rows(x, tile, y, n, k, b * HN, m0, 1); break;
        default: break;
        }
    }
    return 0;
}

#define HAVE_BF16_MATMUL
#include "cpu_kernels_layers.h"

#include "cpu_kernels_pack.h"
