/* ---- 16-bit weights: GGUF F16 and BF16 as the file stores them ----

   y (M x N float32) = x (M x K float32) @ w^T, with w N x K in bfloat16 (kind 0) or float16 (kind 1), row-major
   as in the file. No packing, so a weight can stay in the file's mapping.

   Why: a float16 file loaded as float32 held twice the file in memory and read twice its bytes per token, so it
   ran at half of llama.cpp's speed at batch 1. Here both sides widen to float32 and multiply-add in float32: the
   products are exact (a 16-bit float times a float32 fits float32's product before rounding, as in the float32
   model), so the result is the float32 model's up to the order of the sums.

   Tiling: HN output rows share each activation load and up to HM activation rows share each weight load (at
   batch 1 the weights stream from memory once; at larger batches they are read from cache). A row's sums are 16
   lanes reduced once at its end, in the same order whatever the batch, the tile or the thread count, so a row's
   result does not depend on what else is in the batch. Written against v16 (one __m512, or two __m256 on AVX2),
   so both builds share it. */

#define HN 4 /* output rows per pass */
#define HM 4 /* activation rows per pass */

static inline __attribute__((always_inline)) v16 load_half(const uint16_t *p, int kind) {
    return kind ? load_f16((const uint8_t *)p) : load_bf16(p);
}

static inline __attribute__((always_inline)) void half_rows(const float *x, const uint16_t *w, float *y, int64_t n,
                                                            int64_t k, int kind, int64_t n0, int nt, int64_t m0,
                                                            int mt) {
    v16 acc[HM][HN];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = v16_zero();
    for (int64_t c = 0; c < k; c += 16) {
        v16 wv[HN];
        for (int j = 0; j < nt; j++) {
            /* the next HN rows, a line at a time: at batch 1 this took the stream from 14 to 16 GB/s here (a hint;
               it never faults, even past the last row) */
            if (c % 32 == 0) __builtin_prefetch(w + (n0 + HN + j) * k + c);
            wv[j] = load_half(w + (n0 + j) * k + c, kind);
        }
        for (int i = 0; i < mt; i++) {
            v16 xv = v16_loadu(x + (m0 + i) * k + c);
            for (int j = 0; j < nt; j++) acc[i][j] = v16_fmadd(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) y[(m0 + i) * n + n0 + j] = v16_reduce_add(acc[i][j]);
}

/* Every activation row against output rows n0 .. n0 + nt - 1; mt and nt constants after inlining. */
static inline __attribute__((always_inline)) void half_block(const float *x, const uint16_t *w, float *y,
                                                             int64_t m_rows, int64_t n, int64_t k, int kind,
                                                             int64_t n0, int nt) {
    int64_t m0 = 0;
    for (; m0 + HM <= m_rows; m0 += HM) half_rows(x, w, y, n, k, kind, n0, nt, m0, HM);
    switch (m_rows - m0) {
    case 3: half_rows(x, w, y, n, k, kind, n0, nt, m0, 3); break;
    case 2: half_rows(x, w, y, n, k, kind, n0, nt, m0, 2); break;
    case 1: half_rows(x, w, y, n, k, kind, n0, nt, m0, 1); break;
    default: break;
    }
}

static inline __attribute__((always_inline)) void half_matmul_kind(const float *x, const uint16_t *w, float *y,
                                                                   int64_t m_rows, int64_t n, int64_t k, int kind,
                                                                   int threads) {
    const int64_t blocks = n / HN;
    /* `kind` is a literal in each call: OpenMP outlines the loop body, where a variable would stay unknown */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        if (kind) half_block(x, w, y, m_rows, n, k, 1, b * HN, HN);
        else half_block(x, w, y, m_rows, n, k, 0, b * HN, HN);
    }
    switch (n - blocks * HN) {
    case 3: half_block(x, w, y, m_rows, n, k, kind, blocks * HN, 3); break;
    case 2: half_block(x, w, y, m_rows, n, k, kind, blocks * HN, 2); break;
    case 1: half_block(x, w, y, m_rows, n, k, kind, blocks * HN, 1); break;
    default: break;
    }
}

/* y (M x N float32) = x (M x K float32) @ w^T, w N x K bfloat16 (kind 0) or float16 (kind 1). K % 16 == 0.
   Returns 0, or 1 for what it does not take. */
int half_matmul(const float *x, const uint16_t *w, float *y, int64_t m_rows, int64_t n, int64_t k, int kind,
                int threads) {
    if (k % 16 || (kind != 0 && kind != 1)) return 1;
    if (kind) half_matmul_kind(x, w, y, m_rows, n, k, 1, threads);
    else half_matmul_kind(x, w, y, m_rows, n, k, 0, threads);
    return 0;
}
