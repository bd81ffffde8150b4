/* The decode panel kernels of cpu_kernels.c in AVX-512: one panel row of 16 outputs is
 * exactly one __m512, so a row of a tile is one register instead of a pair.
 *
 * Included by cpu_kernels.c in place of the AVX2 versions when the build has
 * AVX512F/BW/VL/DQ (cpu_kernels.py picks the flags from /proc/cpuinfo; XLLM_CPU_ISA=avx2
 * forces the AVX2 build). Same names, same arguments, same sums: every output is
 * accumulated over k in the same order with one fma per product as the AVX2 code (one sum
 * per output, k in order, the single row as a tile's: a row's outputs do not depend on the
 * other rows of its step, which speculative decoding's exactness rests on), and
 * the widened bf16 / int8 / K-quant weights are the same floats. So the two builds give
 * the same floats, bit for bit (tests/unit/model/test_cpu_kernels.py compares them).
 *
 * The tile is 12 rows x 16 (XLLM_TILE_ROWS): twelve independent fma chains keep both
 * 512-bit FMA pipes busy through the 4-cycle latency (a 6-row tile has only six, half of
 * what the two pipes need in flight), each step one panel row load and twelve
 * broadcasts, which the fmas take as memory operands. */

/* One panel row of 16 outputs for a single x row (M == 1: memory-bound, no tiling). */
static void panel_one_row(const float *x0, const float *pp, int32_t K, float *tile) {
    __m512 e = _mm512_setzero_ps();
    int32_t k = 0;
    for (; k + 1 < K; k += 2) {
        e = _mm512_fmadd_ps(_mm512_set1_ps(x0[k]), _mm512_loadu_ps(pp + (int64_t)k * 16), e);
        e = _mm512_fmadd_ps(_mm512_set1_ps(x0[k + 1]),
                            _mm512_loadu_ps(pp + (int64_t)k * 16 + 16), e);
    }
    if (k < K)
        e = _mm512_fmadd_ps(_mm512_set1_ps(x0[k]), _mm512_loadu_ps(pp + (int64_t)k * 16), e);
    _mm512_storeu_ps(tile, e);
}

/* 16 bfloat16 -> float32: exact. */
static inline __attribute__((always_inline)) __m512 bf16x16_load(const uint16_t *p) {
    const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
}

/* panel_one_row on a bfloat16 panel: the same fmas in the same order. */
static void panel_one_row_bf16(const float *x0, const uint16_t *pp, int32_t K, float *tile) {
    __m512 e = _mm512_setzero_ps();
    int32_t k = 0;
    for (; k + 1 < K; k += 2) {
        e = _mm512_fmadd_ps(_mm512_set1_ps(x0[k]), bf16x16_load(pp + (int64_t)k * 16), e);
        e = _mm512_fmadd_ps(_mm512_set1_ps(x0[k + 1]), bf16x16_load(pp + (int64_t)k * 16 + 16),
                            e);
    }
    if (k < K)
        e = _mm512_fmadd_ps(_mm512_set1_ps(x0[k]), bf16x16_load(pp + (int64_t)k * 16), e);
    _mm512_storeu_ps(tile, e);
}

/* 16 int8 times their 16 scales (int8 panels: cpu_kernels.c): exact products. */
static inline __attribute__((always_inline)) __m512 i8x16_load(const int8_t *p, __m512 sc) {
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(v), sc);
}

/* panel_one_row on an int8 panel: the same fmas in the same order. */
static void panel_one_row_i8(const float *x0, const int8_t *pp, const float *ps, int32_t K,
                             float *tile) {
    __m512 e = _mm512_setzero_ps();
    for (int32_t k = 0; k + 1 < K; k += 2) {
        const __m512 sc = _mm512_loadu_ps(ps + (int64_t)(k / 32) * 16);
        e = _mm512_fmadd_ps(_mm512_set1_ps(x0[k]), i8x16_load(pp + (int64_t)k * 16, sc), e);
        e = _mm512_fmadd_ps(_mm512_set1_ps(x0[k + 1]),
                            i8x16_load(pp + (int64_t)k * 16 + 16, sc), e);
    }
    _mm512_storeu_ps(tile, e);
}

/* kn rows (from row k0) of an int8 panel -> float32 rows dst[kn][16] */
static inline void i8_panel_rows(const int8_t *src, const float *ps, int32_t k0, int32_t kn,
                                 float *dst) {
    for (int32_t i = 0; i < kn; i++)
        _mm512_storeu_ps(dst + (int64_t)i * 16,
                         i8x16_load(src + (int64_t)i * 16,
                                    _mm512_loadu_ps(ps + (int64_t)((k0 + i) / 32) * 16)));
}

/* kn rows of a bfloat16 panel -> float32 rows dst[kn][16]; prefetches ``pf`` (the next
 * chunk, NULL: none), one line per two rows. */
static inline void bf16_panel_rows(const uint16_t *src, int32_t kn, float *dst,
                                   const uint16_t *pf) {
    for (int32_t i = 0; i < kn; i++) {
        if (pf != NULL && (i & 1) == 0)
            _mm_prefetch((const char *)(pf + (int64_t)i * 16), _MM_HINT_T0);
        _mm512_storeu_ps(dst + (int64_t)i * 16, bf16x16_load(src + (int64_t)i * 16));
    }
}

/* The register tile's parts, shared by the tiles below and kquant.c's: twelve named
 * accumulators (an array of __m512 is not kept in registers), those of rows past ``rows``
 * (a constant at every use) unused; XLLM_TILE_FMA adds a[r] * w0 to row r. */
#define XLLM_EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define XLLM_TILE_BEGIN(acc, rows)                                                         \
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;           \
    __m512 c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;                          \
    XLLM_EACH_ROW(XLLM_TILE_LOAD_)
#define XLLM_TILE_LOAD_(r)                                                                 \
    if (rows > r)                                                                          \
        c##r = _mm512_loadu_ps(acc[r]);
#define XLLM_TILE_FMA_(r)                                                                  \
    if (rows > r)                                                                          \
        c##r = _mm512_fmadd_ps(_mm512_set1_ps(a[r]), w0, c##r);
#define XLLM_TILE_FMA() XLLM_EACH_ROW(XLLM_TILE_FMA_)
#define XLLM_TILE_STORE_(r)                                                                \
    if (rows > r)                                                                          \
        _mm512_storeu_ps(acc[r], c##r);
#define XLLM_TILE_END(acc, rows) XLLM_EACH_ROW(XLLM_TILE_STORE_)

/* acc[r] += xt[k0:k0+kn][r] @ panel[k0:k0+kn] for the first ``rows`` (1..12, a constant at
 * every call) rows of a tile of x packed as xt[K][12]. ``pf``: also prefetch the panel's
 * next chunk, one line (one panel row) per step. */
static inline __attribute__((always_inline)) void panel_tile(const float *xt, const float *pp,
                                                             int32_t k0, int32_t kn,
                                                             float (*acc)[16], const int pf,
                                                             const int rows) {
    XLLM_TILE_BEGIN(acc, rows)
    const float *a = xt + (int64_t)k0 * XLLM_TILE_ROWS;
    const float *w = pp + (int64_t)k0 * 16;
    for (int32_t i = 0; i < kn; i++, a += XLLM_TILE_ROWS, w += 16) {
        const __m512 w0 = _mm512_loadu_ps(w);
        if (pf) /* the next chunk's row, one line: it arrives while the tiles compute */
            _mm_prefetch((const char *)(w + XLLM_PANEL_KC * 16), _MM_HINT_T0);
        XLLM_TILE_FMA()
    }
    XLLM_TILE_END(acc, rows)
}

/* The first tile of a chunk of an int8 panel (kn rows from row k0: whole 32-row scale
 * blocks), widening each row as it goes and leaving it in wide[kn][16] for the other
 * tiles: the widening runs between the fmas instead of in a pass of its own (the 512-bit
 * fmas are fast enough that a separate pass cost a quarter of the matmul). xt: the tile's
 * x from the chunk's first row, q: the chunk's rows, ps: the panel's scales. */
static inline __attribute__((always_inline)) void panel_tile_i8(const float *xt, const int8_t *q,
                                                                const float *ps, int32_t k0,
                                                                int32_t kn, float *wide,
                                                                float (*acc)[16], const int rows) {
    XLLM_TILE_BEGIN(acc, rows)
    const float *a = xt;
    for (int32_t g = 0; g < kn; g += 32) {
        const __m512 sc = _mm512_loadu_ps(ps + (int64_t)((k0 + g) / 32) * 16);
        for (int32_t i = g; i < g + 32; i++, a += XLLM_TILE_ROWS) {
            const __m512 w0 = i8x16_load(q + (int64_t)i * 16, sc);
            _mm512_storeu_ps(wide + (int64_t)i * 16, w0);
            XLLM_TILE_FMA()
        }
    }
    XLLM_TILE_END(acc, rows)
}

/* panel_tile_i8 on a chunk of a bfloat16 panel (src: the chunk's rows); prefetches ``pf``
 * (the next chunk, NULL: none), one line per two rows. */
static inline __attribute__((always_inline)) void panel_tile_bf16(const float *xt,
                                                                  const uint16_t *src,
                                                                  const uint16_t *pf,
                                                                  int32_t kn, float *wide,
                                                                  float (*acc)[16],
                                                                  const int rows) {
    XLLM_TILE_BEGIN(acc, rows)
    const float *a = xt;
    for (int32_t i = 0; i < kn; i++, a += XLLM_TILE_ROWS) {
        if (pf != NULL && (i & 1) == 0)
            _mm_prefetch((const char *)(pf + (int64_t)i * 16), _MM_HINT_T0);
        const __m512 w0 = bf16x16_load(src + (int64_t)i * 16);
        _mm512_storeu_ps(wide + (int64_t)i * 16, w0);
        XLLM_TILE_FMA()
    }
    XLLM_TILE_END(acc, rows)
}

/* the first tile on a bfloat16 chunk, then the other tiles on the widened rows (M > 1) */
static inline __attribute__((always_inline)) void panel_chunk_rest(const float *xt,
        const float *w, int32_t kn, int32_t K, int32_t M, float (*acc)[16]);
static inline __attribute__((always_inline)) void panel_chunk_bf16(
        const float *xt, const uint16_t *src, const uint16_t *pf, int32_t kn, int32_t K,
        int32_t M, float (*acc)[16], float *wide) {
    const int rows = M < XLLM_TILE_ROWS ? M : XLLM_TILE_ROWS;
    XLLM_TILE_ROWS_SWITCH(rows, panel_tile_bf16, xt, src, pf, kn, wide, acc)
    panel_chunk_rest(xt, wide, kn, K, M, acc);
}

/* the first tile on an int8 chunk, then the other tiles on the widened rows (M > 1) */
static inline __attribute__((always_inline)) void panel_chunk_i8(
        const float *xt, const int8_t *q, const float *ps, int32_t k0, int32_t kn, int32_t K,
        int32_t M, float (*acc)[16], float *wide) {
    const int rows = M < XLLM_TILE_ROWS ? M : XLLM_TILE_ROWS;
    XLLM_TILE_ROWS_SWITCH(rows, panel_tile_i8, xt, q, ps, k0, kn, wide, acc)
    panel_chunk_rest(xt, wide, kn, K, M, acc);
}

/* y rows [M][n0, n0 + nv) = acc (+ b): one masked store per row (nv < 16: the partial last
 * panel), the same additions as the scalar loop of the AVX2 build. */
static inline void panel_store_rows(float *y, const float (*acc)[16], int32_t M, int32_t N,
                                    int32_t n0, int32_t nv, const float *b) {
    const __mmask16 k = (__mmask16)((1u << nv) - 1);
    const __m512 bias = b != NULL ? _mm512_maskz_loadu_ps(k, b + n0) : _mm512_setzero_ps();
    for (int32_t m = 0; m < M; m++)
        _mm512_mask_storeu_ps(y + (int64_t)m * N + n0, k,
                              _mm512_add_ps(_mm512_loadu_ps(acc[m]), bias));
}
