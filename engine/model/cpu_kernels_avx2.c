/* tickloom's CPU kernels for x86 with AVX2, FMA and F16C (no AVX512): the same functions, weight layouts and
   arithmetic as cpu_kernels.c, for the CPUs that lack AVX512 (AMD before Zen 4, Intel's desktop parts since Alder
   Lake, most laptops). cpu_kernels.c explains the layouts and why the kernels exist; this file says only where
   AVX2 must go another way.

   Sixteen float lanes are a pair of 256-bit registers (v16: lanes 0..7, 8..15), so every lane-wise operation is
   the AVX512 build's, lane for lane, and the horizontal sums add in the order GCC's _mm512_reduce_add_ps does
   (halves, then quarters, then pairs). Integer dot products are exact in both builds. So the two builds are meant
   to give the same bits; that has not been checked on one machine with both, and nothing relies on it (a log
   names the kernels that ran in its header's engine config only through the model's dtype and quant).

   No VPDPBUSD: a 4-input dot product is VPMADDUBSW (unsigned 8-bit times signed 8-bit, pairs summed to 16 bits,
   saturating) then VPMADDWD by ones (pairs of those summed to 32 bits), as llama.cpp does on AVX2. Neither
   saturates here: for 4-bit weights a pair is at most 2 * 15 * 127 and eight such (a group's four chunks, low and
   high nibbles) at most 30480 < 32767, so a group sums in 16 bits and widens once; the 8-bit head's weights are
   signed, so the pair is |w| times sign(w) * qx (at most 2 * 128 * 127) and widens at once. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels_common.h"

typedef struct {
    __m256 lo, hi;
} v16;

static inline v16 v16_set1(float a) { return (v16){_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
static inline v16 v16_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline v16 v16_add(v16 a, v16 b) { return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline v16 v16_sub(v16 a, v16 b) { return (v16){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline v16 v16_mul(v16 a, v16 b) { return (v16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline v16 v16_fmadd(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline v16 v16_loadu(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v16_storeu(float *p, v16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}

/* _mm512_reduce_add_ps's order: lane i + lane i + 8, then i + 4, then i + 2, then the two left. */
static inline float v16_reduce_add(v16 v) {
    __m256 h = _mm256_add_ps(v.hi, v.lo);
    __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
    __m128 p = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(p) + _mm_cvtss_f32(_mm_shuffle_ps(p, p, _MM_SHUFFLE(2, 3, 0, 1)));
}

static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline v16 load_bf16(const uint16_t *p) { return (v16){bf16x8(p), bf16x8(p + 8)}; }
static inline v16 load_f16(const uint8_t *p) {
    return (v16){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))};
}

/* float32 -> bfloat16, round to nearest even, NaN kept quiet: VCVTNEPS2BF16's result, eight lanes in 32 bits */
static inline __m256i bf16_bits(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}

static inline void store_bf16x8(uint16_t *p, __m256 v) {
    __m256i bits = bf16_bits(v);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}

static inline void store_bf16(uint16_t *p, v16 v) {
    /* packus works within 128-bit halves: (lo 0-3, hi 0-3, lo 4-7, hi 4-7); the permute puts them in order */
    __m256i packed = _mm256_packus_epi32(bf16_bits(v.lo), bf16_bits(v.hi));
    _mm256_storeu_si256((__m256i *)p, _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
}

/* Asks for the cache lines of [p, p + bytes) ahead of use. On this project's AVX2 VM the hardware prefetcher
   alone did not keep up with the tile stream: batch-1 decoding reached 39% of the limit the memory's read rate
   sets (0.87x llama.cpp's speed); with it, 46% (0.93x). A prefetch past the weights' end reads nothing. */
static inline void prefetch(const uint8_t *p, int bytes) {
    for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)(p + line), _MM_HINT_T0);
}

/* 4-input dot products of unsigned bytes u and signed bytes s, as 16-bit pair sums (not yet widened) */
static inline __m256i pairs(__m256i u, __m256i s) { return _mm256_maddubs_epi16(u, s); }
static inline __m256i widen(__m256i p16) { return _mm256_madd_epi16(p16, _mm256_set1_epi16(1)); }
static inline v16 to_float(__m256i lo, __m256i hi) { return (v16){_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)}; }

/* 32 activations in float32: the unit the int8 rounding works on (prepare, in cpu_kernels_rowwise.h). */
typedef struct {
    __m256 v[4];
} group32;

static inline __attribute__((always_inline)) void load_group(const uint16_t *in, group32 *g) {
    for (int j = 0; j < 4; j++) g->v[j] = bf16x8(in + 8 * j);
}

/* One group rounded to int8, as cpu_kernels.c's round_group: q = v / d to nearest even (the default rounding
   mode's), d = max|v| / 127, where asked d * sum q and d * each half's sum; with `residual` v becomes v - d q, for
   a second pass. The same float operations as the AVX512 build's. */
static inline __attribute__((always_inline)) void round_group(group32 *g, int8_t *q, float *d_out, float *sum,
                                                              float *half, int residual) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, g->v[0]), _mm256_andnot_ps(sign, g->v[1])),
                              _mm256_max_ps(_mm256_andnot_ps(sign, g->v[2]), _mm256_andnot_ps(sign, g->v[3])));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m256i qi[4];
    int32_t lanes[32];
    for (int j = 0; j < 4; j++) {
        qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(g->v[j], _mm256_set1_ps(inv)));
        _mm256_storeu_si256((__m256i *)(lanes + 8 * j), qi[j]);
    }
    for (int j = 0; j < 32; j++) q[j] = (int8_t)lanes[j];
    *d_out = d;
    if (sum || half) {
        int32_t s0 = 0, s1 = 0;
        for (int j = 0; j < 16; j++) {
            s0 += lanes[j];
            s1 += lanes[16 + j];
        }
        if (sum) *sum = d * (float)(s0 + s1);
        if (half) {
            half[0] = d * (float)s0;
            half[1] = d * (float)s1;
        }
    }
    if (residual)
        for (int j = 0; j < 4; j++)
            g->v[j] = _mm256_sub_ps(g->v[j], _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(qi[j])));
}

/* A 5-bit tile's mask for one half of a chunk (32 bits, one per byte) as bytes of 0x10 where it is set. */
static inline __m256i fifth_bits(uint32_t m) {
    const __m256i pick = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i probe = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)m), pick), probe); /* byte j: m's byte j/8 */
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, probe), _mm256_set1_epi8(0x10));
}

/* One chunk (t) of one half (rows 0-7 or 8-15) of a tile times one activation row's 4 + 4 values (xl: the group's
   first half, xh: its second), added to its sums. 4-bit: 16-bit pair sums, widened once a group (group_sum). 5- and
   6-bit values' pairs could overflow 16 bits over four chunks, so those widen each chunk; 6-bit tiles sum a group's
   halves apart (part, part2). The sums are exact integers either way, as VPDPBUSD's are. m: the 5-bit tile's
   masks for the chunk; high: the 6-bit tile's high bits for the chunk. */
static inline __attribute__((always_inline)) void chunk_sums(const uint8_t *tile, int t, int half, int bits,
                                                             __m256i xl, __m256i xh, const uint32_t *m, __m256i high,
                                                             __m256i *part, __m256i *part2) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i bytes = _mm256_loadu_si256((const __m256i *)(tile + 64 * t + 32 * half));
    __m256i lo = _mm256_and_si256(bytes, low);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    if (bits == 4) {
        *part = _mm256_add_epi16(*part, _mm256_add_epi16(pairs(lo, xl), pairs(hi, xh)));
    } else if (bits == 6) { /* the two high bits of 4 values a byte (cpu_kernels.c), a half's in bits 4h .. 4h + 3 */
        const __m256i bits45 = _mm256_set1_epi8(0x30);
        __m256i v = half ? _mm256_srli_epi16(high, 4) : high;
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(v, 4), bits45));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(v, 2), bits45));
        *part = _mm256_add_epi32(*part, widen(pairs(lo, xl)));
        *part2 = _mm256_add_epi32(*part2, widen(pairs(hi, xh)));
    } else { /* per mask, rows 0-7 then 8-15; the low nibbles' fifth bits, then the high ones' */
        lo = _mm256_or_si256(lo, fifth_bits(m[half]));
        hi = _mm256_or_si256(hi, fifth_bits(m[2 + half]));
        *part = _mm256_add_epi32(*part, widen(_mm256_add_epi16(pairs(lo, xl), pairs(hi, xh))));
    }
}

/* A 6-bit tile's scales d sc for 8 rows (cpu_kernels.c): d float32, sc 8 int8. */
static inline __attribute__((always_inline)) __m256 q6_scales(__m256 d, const uint8_t *sc) {
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc))));
}

/* acc + one group's products for one activation row (`at`: its index into dx), half `half` of the tile's rows
   (g: the tile's group, where a 6-bit tile's d is). */
static inline __attribute__((always_inline)) __m256 add_group(__m256 acc, const uint8_t *tile, int64_t g, int half,
                                                              int bits, __m256i part, __m256i part2, const float *dx,
                                                              const float *dxs, const float *dxs16, int64_t at) {
    if (bits != 6) {
        __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 256 + 16 * half)));
        __m256 z = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 288 + 16 * half)));
        __m256i sum = bits == 4 ? widen(part) : part;
        acc = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(dx[at])), _mm256_cvtepi32_ps(sum), acc);
        return _mm256_fmadd_ps(z, _mm256_set1_ps(dxs[at]), acc);
    }
    /* 6-bit tiles: a scale d sc per half, each offset -32 times it (Q6_K) */
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(q6_d_at(tile, g) + 16 * half)));
    __m256 s = q6_scales(d, tile + Q6_SCALES_AT + 8 * half), s1 = q6_scales(d, tile + Q6_SCALES_AT + 16 + 8 * half);
    __m256 dxv = _mm256_set1_ps(dx[at]); /* per half s (dx sum q qx - 32 dx sum qx), as cpu_kernels.c */
    __m256 t0 = _mm256_fmadd_ps(dxv, _mm256_cvtepi32_ps(part), _mm256_set1_ps(-32.0f * dxs16[2 * at]));
    __m256 t1 = _mm256_fmadd_ps(dxv, _mm256_cvtepi32_ps(part2), _mm256_set1_ps(-32.0f * dxs16[2 * at + 1]));
    return _mm256_fmadd_ps(s1, t1, _mm256_fmadd_ps(s, t0, acc));
}

/* Rows [m0, m0 + mt) of the output for halves half0 .. half0 + nhalf - 1 (rows 0-7, 8-15) of row block `block`.
   A few activation rows take both halves in one pass (each activation broadcast serves both); more take one half a
   pass, so that a row's sums fit one register each: sixteen registers would not hold eight rows' of a whole block.
   Either way a lane's arithmetic is the same, so a row's result does not depend on which pass it took. */
static inline __attribute__((always_inline)) void block_rows(
    const uint8_t *w, const int8_t *qx, const float *dx, const float *dxs, const float *dxs16, const int32_t *chosen,
    uint16_t *y, float *yf, int64_t m_rows, int64_t n, int64_t k, int64_t block, int half0, int nhalf, int64_t m0,
    int mt, int bits, int passes) {
    const int64_t groups = k / 32, tile_bytes = TILE_BYTES_OF(bits);
    __m256 acc[2][MT], acc2[2][MT];
    for (int h = 0; h < nhalf; h++)
        for (int i = 0; i < mt; i++) acc[h][i] = acc2[h][i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = tile_at(w, bits, groups, block, g);
        prefetch(tile + 8 * tile_bytes, (int)tile_bytes);
        uint32_t m[4][4] = {{0}};
        __m256i high[4];
        for (int t = 0; t < 4; t++) {
            if (bits == 5) memcpy(m[t], tile + TILE_BYTES + 16 * t, 16);
            high[t] = bits == 6 ? _mm256_loadu_si256((const __m256i *)(tile + Q6_HIGH_AT + 32 * t))
                                : _mm256_setzero_si256();
        }
        __m256i part[2][MT], part2[2][MT];
        for (int h = 0; h < nhalf; h++)
            for (int i = 0; i < mt; i++) part[h][i] = part2[h][i] = _mm256_setzero_si256();
        for (int t = 0; t < 4; t++)
            for (int i = 0; i < mt; i++) {
                const int8_t *xq = qx + (m0 + i) * k + 32 * g + 4 * t;
                __m256i xl = _mm256_set1_epi32(*(const int32_t *)xq);
                __m256i xh = _mm256_set1_epi32(*(const int32_t *)(xq + 16));
                for (int h = 0; h < nhalf; h++)
                    chunk_sums(tile, t, half0 + h, bits, xl, xh, m[t], high[t], &part[h][i], &part2[h][i]);
            }
        for (int h = 0; h < nhalf; h++)
            for (int i = 0; i < mt; i++)
                acc[h][i] = add_group(acc[h][i], tile, g, half0 + h, bits, part[h][i], part2[h][i], dx, dxs, dxs16,
                                      (m0 + i) * groups + g);
    }
    /* the residual's pass, row by row over the groups prepare chose for it, from a list each, into sums of their
       own added at the end: cpu_kernels.c's order (which takes a lone row's groups in the loop above) */
    for (int i = 0; passes == 2 && i < mt; i++) {
        const int64_t r = m_rows + m0 + i;
        const int32_t *list = chosen + (m0 + i) * (groups + 1);
        for (int32_t j = 1; j <= list[0]; j++) {
            const int64_t g = list[j];
            const uint8_t *gt = tile_at(w, bits, groups, block, g);
            for (int h = 0; h < nhalf; h++) {
                __m256i p = _mm256_setzero_si256(), p2 = _mm256_setzero_si256();
                for (int t = 0; t < 4; t++) {
                    uint32_t m[4] = {0, 0, 0, 0};
                    if (bits == 5) memcpy(m, gt + TILE_BYTES + 16 * t, 16);
                    __m256i high = bits == 6 ? _mm256_loadu_si256((const __m256i *)(gt + Q6_HIGH_AT + 32 * t))
                                             : _mm256_setzero_si256();
                    const int8_t *xq = qx + r * k + 32 * g + 4 * t;
                    chunk_sums(gt, t, half0 + h, bits, _mm256_set1_epi32(*(const int32_t *)xq),
                               _mm256_set1_epi32(*(const int32_t *)(xq + 16)), m, high, &p, &p2);
                }
                acc2[h][i] = add_group(acc2[h][i], gt, g, half0 + h, bits, p, p2, dx, dxs, dxs16, r * groups + g);
            }
        }
    }
    for (int h = 0; h < nhalf; h++)
        for (int i = 0; i < mt; i++) {
            int64_t at = (m0 + i) * n + 16 * block + 8 * (half0 + h);
            if (passes == 2) acc[h][i] = _mm256_add_ps(acc[h][i], acc2[h][i]);
            if (yf) _mm256_storeu_ps(yf + at, acc[h][i]);
            else store_bf16x8(y + at, acc[h][i]);
        }
}

static inline __attribute__((always_inline)) void q4_blocks(const uint8_t *w, const int8_t *qx, const float *dx,
                                                             const float *dxs, const float *dxs16,
                                                             const int32_t *chosen, uint16_t *y, float *yf,
                                                             int64_t m_rows, int64_t n, int64_t k, int bits,
                                                             int passes, int threads) {
    const int64_t blocks = n / 16;
    /* `bits` and `passes` are literals in each call below: OpenMP outlines the loop body into a function of its
       own, where a variable would reach block_rows unknown and its loops would not unroll */
#define BLOCK(half0, nhalf, mt, bits_, passes_)                                                                     \
    block_rows(w, qx, dx, dxs, dxs16, chosen, y, yf, m_rows, n, k, b, half0, nhalf, 0, mt, bits_, passes_)
#define FEW_ROWS(bits_, passes_) (m_rows == 1 ? BLOCK(0, 2, 1, bits_, passes_) : BLOCK(0, 2, 2, bits_, passes_))
    if (m_rows <= 2) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t b = 0; b < blocks; b++) {
            if (passes == 2) {
                if (bits == 6) FEW_ROWS(6, 2);
                else if (bits == 5) FEW_ROWS(5, 2);
                else FEW_ROWS(4, 2);
            } else if (bits == 6) FEW_ROWS(6, 1);
            else if (bits == 5) FEW_ROWS(5, 1);
            else FEW_ROWS(4, 1);
        }
        return;
    }
#undef FEW_ROWS
#undef BLOCK
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t bh = 0; bh < 2 * blocks; bh++) {
#define ROWS_OF(mt, bits_, passes_)                                                                                 \
    block_rows(w, qx, dx, dxs, dxs16, chosen, y, yf, m_rows, n, k, bh / 2, (int)(bh % 2), 1, m0, mt, bits_,        \
               passes_)
        FOR_ROW_TILES_OF(m_rows, ROWS_OF, bits, passes);
#undef ROWS_OF
    }
}

static inline __attribute__((always_inline)) void q8_block_rows(
    const uint8_t *w, const int8_t *qx, const float *dx, float *y, int64_t m_rows, int64_t n, int64_t k,
    int64_t block, int64_t m0, int mt) {
    const int64_t groups = k / 32;
    v16 acc[MT];
    for (int i = 0; i < mt; i++) acc[i] = v16_zero();
    const uint8_t *tile = w + block * groups * Q8_TILE_BYTES;
    for (int64_t g = 0; g < groups; g++, tile += Q8_TILE_BYTES) {
        prefetch(tile + 4 * Q8_TILE_BYTES, Q8_TILE_BYTES);
        v16 d = load_f16(tile + 512);
        for (int pass = 0; pass < 2; pass++) {
            const int8_t *xp = qx + pass * m_rows * k;
            const float *dp = dx + pass * m_rows * groups;
            __m256i part[MT][2];
            for (int i = 0; i < mt; i++) part[i][0] = part[i][1] = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                for (int half = 0; half < 2; half++) {
                    __m256i wq = _mm256_loadu_si256((const __m256i *)(tile + 64 * t + 32 * half));
                    __m256i wabs = _mm256_sign_epi8(wq, wq); /* -128 stays 0x80: 128 read unsigned */
                    for (int i = 0; i < mt; i++) {
                        __m256i xq = _mm256_set1_epi32(*(const int32_t *)(xp + (m0 + i) * k + 32 * g + 4 * t));
                        __m256i p = widen(pairs(wabs, _mm256_sign_epi8(xq, wq)));
                        part[i][half] = _mm256_add_epi32(part[i][half], p);
                    }
                }
            }
            for (int i = 0; i < mt; i++) {
                v16 scale = v16_mul(d, v16_set1(dp[(m0 + i) * groups + g]));
                acc[i] = v16_fmadd(scale, to_float(part[i][0], part[i][1]), acc[i]);
            }
        }
    }
    for (int i = 0; i < mt; i++) v16_storeu(y + (m0 + i) * n + 16 * block, acc[i]);
}

int q8_matmul(const uint16_t *x, const uint8_t *w, float *y, int64_t m_rows, int64_t n, int64_t k, void *scratch,
              int threads) {
    if (n % 16 || k % 32) return 1;
    int8_t *qx = (int8_t *)scratch;
    float *dx = (float *)(((uintptr_t)(qx + 2 * m_rows * k) + 63) & ~(uintptr_t)63);
    prepare(x, m_rows, k, 2, 0, qx, dx, NULL, NULL, NULL);
    const int64_t blocks = n / 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
#define Q8_ROWS(mt, unused_a, unused_b) q8_block_rows(w, qx, dx, y, m_rows, n, k, b, m0, mt)
        FOR_ROW_TILES(m_rows, Q8_ROWS, 0, 0);
#undef Q8_ROWS
    }
    return 0;
}

/* e^x for x <= 0, cpu_kernels.c's polynomial; p * 2^n built from n's exponent bits (n >= -126 after the clamp, so
   2^n is a normal float and the product rounds once, as VSCALEFPS's does). */
static inline __m256 exp8_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
static inline v16 exp_nonpositive(v16 x) { return (v16){exp8_nonpositive(x.lo), exp8_nonpositive(x.hi)}; }

/* The softmax's last n < 16 scores, as the AVX512 build's masked tail: lanes past n read 0 and give 0. */
static inline v16 exp_tail(float *p, int64_t n, v16 top) {
    float tail[16] = {0};
    memcpy(tail, p, sizeof(float) * (size_t)n);
    v16_storeu(tail, exp_nonpositive(v16_sub(v16_loadu(tail), top)));
    for (int64_t i = n; i < 16; i++) tail[i] = 0.0f;
    memcpy(p, tail, sizeof(float) * (size_t)n);
    return v16_loadu(tail);
}

/* cpu_kernels.c's silu, eight lanes at a time */
static inline __m256 silu8(__m256 a) {
    const __m256 zero = _mm256_setzero_ps();
    __m256 neg = _mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a));
    __m256 e = exp8_nonpositive(_mm256_max_ps(neg, _mm256_set1_ps(-87.0f)));
    __m256 num = _mm256_blendv_ps(_mm256_mul_ps(a, e), a, _mm256_cmp_ps(a, zero, _CMP_GE_OQ));
    return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
static inline v16 silu(v16 a) { return (v16){silu8(a.lo), silu8(a.hi)}; }

#include "cpu_kernels_rowwise.h"
#include "cpu_kernels_half.h"

#include "cpu_kernels_layers.h"

#include "cpu_kernels_pack.h"
