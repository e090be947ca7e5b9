/* ---- 16-bit weights: GGUF F16 and BF16 as the file stores them ----

   y (M x N float32) = x (M x K float32) @ w^T, w N x K in bfloat16 (kind 0) or float16 (kind 1), in tiles of HN
   rows: the file's values, reordered once at load (native.pack_half_tiles) so that tile b (rows HN b .. HN b + HN -
   1, zero rows past N) is HN K values in a row, chunk c (16 columns) of its row j at HN c + 16 j. K % 16 == 0.

   Why: a float16 file loaded as float32 held twice the file in memory and read twice its bytes per token, so it
   ran at half of llama.cpp's speed at batch 1. Here both sides widen to float32 and multiply-add in float32: the
   products are exact (a 16-bit float times a float32 fits float32's product before rounding, as in the float32
   model), so the result is the float32 model's up to the order of the sums. The tiles make a step's reads one
   stream: reading HN rows of the file's layout side by side (HN streams a row apart) ran at 16 GB/s on one core
   here, where a plain read runs at 22 to 28.

   Tiling: HN output rows share each activation load and up to HM activation rows share each weight load (at
   batch 1 the weights stream from memory once; at larger batches they are read from cache). A row's sums are 16
   lanes reduced once at its end, in the same order whatever the batch, the tile or the thread count, so a row's
   result does not depend on what else is in the batch. Written against v16 (one __m512, or two __m256 on AVX2),
   so both builds share it. */

#define HN 4 /* output rows per tile and pass */
#define HM 4 /* activation rows per pass */

static inline __attribute__((always_inline)) v16 load_half(const uint16_t *p, int kind) {
    return kind ? load_f16((const uint8_t *)p) : load_bf16(p);
}

static inline __attribute__((always_inline)) void half_rows(const float *x, const uint16_t *tile, float *y,
                                                            int64_t n, int64_t k, int kind, int64_t n0, int64_t m0,
                                                            int mt) {
    v16 acc[HM][HN];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < HN; j++) acc[i][j] = v16_zero();
    for (int64_t c = 0; c < k; c += 16) {
        if (mt > 1) { /* 1.1-1.2x at batch 8, up to 1.07x at 32; at one row it cost 14%: that stream prefetches well */
            _mm_prefetch((const char *)(tile + HN * c + 512), _MM_HINT_T0);
            _mm_prefetch((const char *)(tile + HN * c + 544), _MM_HINT_T0);
        }
        v16 wv[HN];
        for (int j = 0; j < HN; j++) wv[j] = load_half(tile + HN * c + 16 * j, kind);
        for (int i = 0; i < mt; i++) {
            v16 xv = v16_loadu(x + (m0 + i) * k + c);
            for (int j = 0; j < HN; j++) acc[i][j] = v16_fmadd(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < HN && n0 + j < n; j++) y[(m0 + i) * n + n0 + j] = v16_reduce_add(acc[i][j]);
}

/* Every activation row against tile `b`; mt a constant after inlining. */
static inline __attribute__((always_inline)) void half_tile(const float *x, const uint16_t *w, float *y,
                                                            int64_t m_rows, int64_t n, int64_t k, int kind,
                                                            int64_t b) {
    const uint16_t *tile = w + b * HN * k;
    int64_t m0 = 0;
    for (; m0 + HM <= m_rows; m0 += HM) half_rows(x, tile, y, n, k, kind, b * HN, m0, HM);
    switch (m_rows - m0) {
    case 3: half_rows(x, tile, y, n, k, kind, b * HN, m0, 3); break;
    case 2: half_rows(x, tile, y, n, k, kind, b * HN, m0, 2); break;
    case 1: half_rows(x, tile, y, n, k, kind, b * HN, m0, 1); break;
    default: break;
    }
}

/* y (M x N float32) = x (M x K float32) @ w^T for the tiles above, w bfloat16 (kind 0) or float16 (kind 1).
   Returns 0, or 1 for what it does not take. */
int half_matmul(const float *x, const uint16_t *w, float *y, int64_t m_rows, int64_t n, int64_t k, int kind,
                int threads) {
    if (k % 16 || (kind != 0 && kind != 1)) return 1;
    const int64_t tiles = (n + HN - 1) / HN;
    /* `kind` is a literal in each call: OpenMP outlines the loop body, where a variable would stay unknown */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < tiles; b++) {
        if (kind) half_tile(x, w, y, m_rows, n, k, 1, b);
        else half_tile(x, w, y, m_rows, n, k, 0, b);
    }
    return 0;
}
