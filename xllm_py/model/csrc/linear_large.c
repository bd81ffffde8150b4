/* y [M, N] = x [M, K] @ W^T (+ b) for many rows (prefill), over the same panels
 * P[ceil(N / 16)][K][16] as the decode kernel, so one copy of the weights serves both.
 *
 * Included by cpu_kernels.c (AVX2/FMA builds, after the panel kernel).
 *
 * The rows go to the threads in blocks of up to XLLM_LARGE_MC rows, taken dynamically (no
 * shared work; a thread the host slows down takes fewer blocks): each thread packs its
 * block by 6-row tiles (AVX-512 builds: 12-row) into its own buffer
 * (xt[tile][K][6], kept in L2 while every panel streams past), then for each panel walks K
 * in chunks of XLLM_LARGE_KC rows (16 KB of panel: it stays in L1 for every tile of the
 * block; the first tile prefetches the next chunk) and each tile in a 6 x 16 register
 * tile. Between chunks a tile's sums wait in a small per-block accumulator; the last chunk
 * adds the bias and writes y straight from the registers. A partial last panel (N % 16)
 * is finished through the accumulator, which has room for 16 columns.
 *
 * Exact float32 (one fma per product), though not in the decode kernel's order:
 * its chunks are 64 rows of K, these 256. With bfloat16 panels (``_bf16``) each thread widens
 * the chunk of the panel it is about to use into a 16 KB float32 buffer (served to every
 * tile of its block from L1), then runs the same tiles: the same sums as float32 panels
 * holding the same values (why these panels serve prompts too: cpu_kernels.PANEL_MAX_ROWS).
 * Int8 and K-quant panels (``_i8``, ``_kq``: int8_panels.py, kquant.c) widen their chunks
 * the same way: the sums of float32 panels holding the same values, in this kernel's order. */

/* What the panels hold besides float32: bfloat16 (bf16), int8 with float32 scales (i8), or
 * a K-quant type (kq, kquant.c). */
struct large_src {
    int bf16;
    const float *i8_scales;
    int kq_type;
    const void *kq_sc, *kq_mn;
    const float *kq_d, *kq_dm;
};

/* rows of x per block of one thread: 96 rows at K = 512 are 192 KB of packed x, which stay
 * in L2 while the panels stream past */
#define XLLM_LARGE_MC 96
/* panel rows per chunk: 16 KB of panel, in L1 for every tile of the block; a tile reloads
 * its sums once per chunk */
#define XLLM_LARGE_KC 256
#define XLLM_LARGE_TILES (XLLM_LARGE_MC / XLLM_TILE_ROWS)
#define XLLM_TILE_FLOATS (XLLM_TILE_ROWS * 16) /* one tile's sums in the accumulator */

/* The tile loops start on a 32-byte boundary: left to chance (the build places them at
 * any offset) a loop that straddles a fetch boundary runs slower. */
#pragma GCC push_options
#pragma GCC optimize("align-loops=32")

#if defined(XLLM_AVX512)
/* AVX-512: 12-row tiles (panels_avx512.c: why), one __m512 per row; the same fmas in the
 * same order per output as the AVX2 tile below, so the same floats. */

/* x rows [rows <= 12][K] (row stride K) -> dst[K][12], rows past ``rows`` zero; per 8
 * columns an 8 x 8 transpose of rows 0-7 and a 4 x 8 one of rows 8-11 in registers. */
static void large_pack_tile(const float *x, int32_t K, int rows, float *dst) {
    const __m256 z = _mm256_setzero_ps();
    const float *xr[XLLM_TILE_ROWS];
    for (int r = 0; r < XLLM_TILE_ROWS; r++)
        xr[r] = x + (int64_t)(r < rows ? r : 0) * K;
    int32_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 r[XLLM_TILE_ROWS];
        for (int i = 0; i < XLLM_TILE_ROWS; i++)
            r[i] = i < rows ? _mm256_loadu_ps(xr[i] + k) : z;
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 t8 = _mm256_unpacklo_ps(r[8], r[9]), t9 = _mm256_unpackhi_ps(r[8], r[9]);
        const __m256 ta = _mm256_unpacklo_ps(r[10], r[11]), tb = _mm256_unpackhi_ps(r[10], r[11]);
        /* s0..s3: rows 0-3 of columns (c, c + 4); s4..s7 rows 4-7; u0..u3 rows 8-11 */
        const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        const __m256 u0 = _mm256_shuffle_ps(t8, ta, 0x44), u1 = _mm256_shuffle_ps(t8, ta, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t9, tb, 0x44), u3 = _mm256_shuffle_ps(t9, tb, 0xEE);
        float *d = dst + (int64_t)k * XLLM_TILE_ROWS;
#define XLLM_COL(c, s, t, u, hi)                                                            \
    _mm256_storeu_ps(d + 12 * c, _mm256_permute2f128_ps(s, t, hi ? 0x31 : 0x20));           \
    _mm_storeu_ps(d + 12 * c + 8, hi ? _mm256_extractf128_ps(u, 1) : _mm256_castps256_ps128(u));
        XLLM_COL(0, s0, s4, u0, 0) XLLM_COL(1, s1, s5, u1, 0) XLLM_COL(2, s2, s6, u2, 0)
        XLLM_COL(3, s3, s7, u3, 0) XLLM_COL(4, s0, s4, u0, 1) XLLM_COL(5, s1, s5, u1, 1)
        XLLM_COL(6, s2, s6, u2, 1) XLLM_COL(7, s3, s7, u3, 1)
#undef XLLM_COL
    }
    for (; k < K; k++)
        for (int r = 0; r < XLLM_TILE_ROWS; r++)
            dst[(int64_t)k * XLLM_TILE_ROWS + r] = r < rows ? xr[r][k] : 0.0f;
}

/* One 12 x 16 tile (its first ``rows``, a constant at every call) over kn steps: as the
 * AVX2 large_tile below (a = packed x [kn][12], acc [12][16] 64-byte aligned). */
static inline __attribute__((always_inline)) void large_tile(
        const float *a, const float *w, int32_t kn, float *acc, const int load,
        const float *pf, float *yt, int64_t ldy, const float *bias, const int rows) {
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
    __m512 c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
#define XLLM_LOAD(r)                                   \
    if (rows > r)                                      \
        c##r = _mm512_load_ps(acc + 16 * r);
    if (load) {
        XLLM_EACH_ROW(XLLM_LOAD)
    }
#undef XLLM_LOAD
    for (int32_t i = 0; i < kn; i++, a += XLLM_TILE_ROWS, w += 16) {
        const __m512 w0 = _mm512_loadu_ps(w);
        if (pf)
            _mm_prefetch((const char *)(pf + 16 * i), _MM_HINT_T0);
#define XLLM_ROW(r)                                                \
    if (rows > r)                                                  \
        c##r = _mm512_fmadd_ps(_mm512_set1_ps(a[r]), w0, c##r);
        XLLM_EACH_ROW(XLLM_ROW)
#undef XLLM_ROW
    }
    if (yt) {
        const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
#define XLLM_STORE(r)                                              \
    if (rows > r)                                                  \
        _mm512_storeu_ps(yt + ldy * r, _mm512_add_ps(c##r, b0));
        XLLM_EACH_ROW(XLLM_STORE)
#undef XLLM_STORE
    } else {
#define XLLM_STORE(r)                                  \
    if (rows > r)                                      \
        _mm512_store_ps(acc + 16 * r, c##r);
        XLLM_EACH_ROW(XLLM_STORE)
#undef XLLM_STORE
    }
}

#else
/* x rows [rows <= 6][K] (row stride K) -> dst[K][6], rows past ``rows`` zero; an 8 x 8
 * transpose in registers per 8 columns (6 rows and 2 zero rows). The 8-float stores
 * overlap: each writes 2 floats past its 6 x 8 block, which the next store overwrites,
 * so dst needs 2 floats of slack after its end. */
static void large_pack_tile(const float *x, int32_t K, int rows, float *dst) {
    const __m256 z = _mm256_setzero_ps();
    const float *xr[XLLM_TILE_ROWS];
    for (int r = 0; r < XLLM_TILE_ROWS; r++)
        xr[r] = x + (int64_t)(r < rows ? r : 0) * K;
    int32_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 r0 = _mm256_loadu_ps(xr[0] + k);
        const __m256 r1 = rows > 1 ? _mm256_loadu_ps(xr[1] + k) : z;
        const __m256 r2 = rows > 2 ? _mm256_loadu_ps(xr[2] + k) : z;
        const __m256 r3 = rows > 3 ? _mm256_loadu_ps(xr[3] + k) : z;
        const __m256 r4 = rows > 4 ? _mm256_loadu_ps(xr[4] + k) : z;
        const __m256 r5 = rows > 5 ? _mm256_loadu_ps(xr[5] + k) : z;
        const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
        const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
        const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
        const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 s4 = _mm256_shuffle_ps(t4, z, 0x44), s5 = _mm256_shuffle_ps(t4, z, 0xEE);
        const __m256 s6 = _mm256_shuffle_ps(t5, z, 0x44), s7 = _mm256_shuffle_ps(t5, z, 0xEE);
        float *d = dst + (int64_t)k * XLLM_TILE_ROWS;
        _mm256_storeu_ps(d, _mm256_permute2f128_ps(s0, s4, 0x20));
        _mm256_storeu_ps(d + 6, _mm256_permute2f128_ps(s1, s5, 0x20));
        _mm256_storeu_ps(d + 12, _mm256_permute2f128_ps(s2, s6, 0x20));
        _mm256_storeu_ps(d + 18, _mm256_permute2f128_ps(s3, s7, 0x20));
        _mm256_storeu_ps(d + 24, _mm256_permute2f128_ps(s0, s4, 0x31));
        _mm256_storeu_ps(d + 30, _mm256_permute2f128_ps(s1, s5, 0x31));
        _mm256_storeu_ps(d + 36, _mm256_permute2f128_ps(s2, s6, 0x31));
        _mm256_storeu_ps(d + 42, _mm256_permute2f128_ps(s3, s7, 0x31));
    }
    for (; k < K; k++)
        for (int r = 0; r < XLLM_TILE_ROWS; r++)
            dst[(int64_t)k * XLLM_TILE_ROWS + r] = r < rows ? xr[r][k] : 0.0f;
}

/* One 6 x 16 tile (its first ``rows``, a constant at every call) over kn steps:
 * a = packed x [kn][6], w = panel rows [kn][16]. load: start from acc (64-byte aligned,
 * [6][16]), else from zero. yt != NULL: add bias and write the rows to yt (row stride ldy);
 * else store the sums back to acc. pf != NULL: prefetch pf, one line per step (the next
 * chunk of the panel, 64 bytes per 16-float row, arrives while this tile computes). */
static inline __attribute__((always_inline)) void large_tile(
        const float *a, const float *w, int32_t kn, float *acc, const int load,
        const float *pf, float *yt, int64_t ldy, const float *bias, const int rows) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define XLLM_LOAD(r, lo, hi)                       \
    if (rows > r) {                                \
        lo = _mm256_load_ps(acc + 16 * r);         \
        hi = _mm256_load_ps(acc + 16 * r + 8);     \
    }
    if (load) {
        XLLM_LOAD(0, c00, c01) XLLM_LOAD(1, c10, c11) XLLM_LOAD(2, c20, c21)
        XLLM_LOAD(3, c30, c31) XLLM_LOAD(4, c40, c41) XLLM_LOAD(5, c50, c51)
    }
#undef XLLM_LOAD
    for (int32_t i = 0; i < kn; i++, a += XLLM_TILE_ROWS, w += 16) {
        const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
        if (pf)
            _mm_prefetch((const char *)(pf + 16 * i), _MM_HINT_T0);
#define XLLM_ROW(r, lo, hi)                             \
    if (rows > r) {                                     \
        const __m256 ar = _mm256_broadcast_ss(a + r);   \
        lo = _mm256_fmadd_ps(ar, w0, lo);               \
        hi = _mm256_fmadd_ps(ar, w1, hi);               \
    }
        XLLM_ROW(0, c00, c01) XLLM_ROW(1, c10, c11) XLLM_ROW(2, c20, c21)
        XLLM_ROW(3, c30, c31) XLLM_ROW(4, c40, c41) XLLM_ROW(5, c50, c51)
#undef XLLM_ROW
    }
    if (yt) {
        const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
        const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#define XLLM_STORE(r, lo, hi)                                       \
    if (rows > r) {                                                 \
        _mm256_storeu_ps(yt + ldy * r, _mm256_add_ps(lo, b0));      \
        _mm256_storeu_ps(yt + ldy * r + 8, _mm256_add_ps(hi, b1));  \
    }
        XLLM_STORE(0, c00, c01) XLLM_STORE(1, c10, c11) XLLM_STORE(2, c20, c21)
        XLLM_STORE(3, c30, c31) XLLM_STORE(4, c40, c41) XLLM_STORE(5, c50, c51)
#undef XLLM_STORE
    } else {
#define XLLM_STORE(r, lo, hi)                      \
    if (rows > r) {                                \
        _mm256_store_ps(acc + 16 * r, lo);         \
        _mm256_store_ps(acc + 16 * r + 8, hi);     \
    }
        XLLM_STORE(0, c00, c01) XLLM_STORE(1, c10, c11) XLLM_STORE(2, c20, c21)
        XLLM_STORE(3, c30, c31) XLLM_STORE(4, c40, c41) XLLM_STORE(5, c50, c51)
#undef XLLM_STORE
    }
}

#endif /* XLLM_AVX512 */

/* large_tile for a partial tile known only at run time. */
static inline __attribute__((always_inline)) void large_tile_rows(
        const float *a, const float *w, int32_t kn, float *acc, int load, const float *pf,
        float *yt, int64_t ldy, const float *bias, int rows) {
    XLLM_TILE_ROWS_SWITCH(rows, large_tile, a, w, kn, acc, load, pf, yt, ldy, bias)
}

/* The calling thread's buffer, 64-byte aligned (the accumulator's aligned loads), kept
 * between calls (a fresh large malloc is an mmap that page faults on every call); its
 * contents are not kept when it grows. NULL when memory runs out. */
static float *large_buffer(size_t need) {
    static __thread float *buf = NULL;
    static __thread size_t cap = 0;
    if (need > cap) {
        free(buf);
        buf = NULL;
        cap = 0;
        if (posix_memalign((void **)&buf, 64, sizeof(float) * need) != 0) {
            buf = NULL;
            return NULL;
        }
        cap = need;
    }
    return buf;
}

static int linear_large(const float *x, const void *P, const float *b, float *y, int32_t M,
                        int32_t N, int32_t K, const struct large_src *src) {
    const int bf16 = src != NULL && src->bf16;
    const float *i8s = src != NULL ? src->i8_scales : NULL;
    const int kqt = src != NULL ? src->kq_type : 0;
    const int widen = bf16 || i8s != NULL || kqt;
    if (M <= 0 || N <= 0 || K <= 0 || (i8s != NULL && K % 32) || (kqt && K % 256))
        return -1;
    const int32_t np = (N + 15) / 16;
    const int32_t tiles = (M + XLLM_TILE_ROWS - 1) / XLLM_TILE_ROWS;
    /* packed x of a block, 16 floats (the packing's 2 of slack, then alignment), the
     * accumulator: XLLM_LARGE_MC * K * 4 bytes is a multiple of 64, so acc stays aligned */
    const size_t xt_floats = (size_t)XLLM_LARGE_MC * K;
    const size_t acc_floats = (size_t)XLLM_LARGE_MC * 16;
    /* then, with bf16 / int8 / K-quant panels, the widened chunk (also 64-byte aligned) */
    const size_t need = xt_floats + 16 + acc_floats + (widen ? XLLM_LARGE_KC * 16 : 0);
    int fail = 0;
    /* Blocks of up to XLLM_LARGE_TILES tiles taken dynamically (a thread the host slows
     * down takes fewer), at least two per thread so that small M still splits evenly. */
    int32_t nblocks = (tiles + XLLM_LARGE_TILES - 1) / XLLM_LARGE_TILES;
    const int32_t min_blocks = 2 * omp_get_max_threads();
    nblocks = nblocks > min_blocks ? nblocks : (tiles < min_blocks ? tiles : min_blocks);
    const int32_t block_tiles = (tiles + nblocks - 1) / nblocks;
#pragma omp parallel
    {
        float *xt = large_buffer(need);
        if (xt == NULL) {
#pragma omp atomic write
            fail = 1;
        }
        float *acc = xt != NULL ? xt + xt_floats + 16 : NULL;
        float *wide = acc != NULL ? acc + acc_floats : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int32_t bi = 0; bi < nblocks; bi++) {
            const int32_t tb = bi * block_tiles;
            if (xt == NULL || tb >= tiles)
                continue; /* failed: the caller computes y another way */
            const int32_t tn = tiles - tb < block_tiles ? tiles - tb : block_tiles;
            const int32_t m0 = tb * XLLM_TILE_ROWS;
            const int32_t mr = M - m0 < tn * XLLM_TILE_ROWS ? M - m0 : tn * XLLM_TILE_ROWS;
            const int32_t full = mr / XLLM_TILE_ROWS, rem = mr - full * XLLM_TILE_ROWS;
            for (int32_t t = 0; t < tn; t++) {
                const int32_t m = m0 + t * XLLM_TILE_ROWS;
                large_pack_tile(x + (int64_t)m * K, K,
                                M - m < XLLM_TILE_ROWS ? M - m : XLLM_TILE_ROWS,
                                xt + (int64_t)t * K * XLLM_TILE_ROWS);
            }
            for (int32_t p = 0; p < np; p++) {
                const float *pp = (const float *)P + (int64_t)p * K * 16;
                const uint16_t *pb = (const uint16_t *)P + (int64_t)p * K * 16;
                const int32_t n0 = p * 16, nv = N - n0 < 16 ? N - n0 : 16;
                const float *bias = b != NULL ? b + n0 : NULL;
                for (int32_t k0 = 0; k0 < K; k0 += XLLM_LARGE_KC) {
                    const int32_t kn = K - k0 < XLLM_LARGE_KC ? K - k0 : XLLM_LARGE_KC;
                    /* the last chunk of a full panel writes y from the registers */
                    const int last = k0 + kn >= K && nv == 16;
                    const float *w = pp + (int64_t)k0 * 16;
                    /* the next chunk (of this panel or the next), unless this is the end */
                    const float *pf = p + 1 < np || k0 + kn < K ? w + (int64_t)kn * 16 : NULL;
                    if (kqt) {
                        const struct kq_panel a = kq_panel_at(kqt, P, src->kq_sc, src->kq_mn,
                                                              src->kq_d, src->kq_dm, p, K);
                        kq_panel_rows(kqt, &a, k0, kn, wide);
                        w = wide;
                        pf = NULL;
                    } else if (i8s != NULL) {
                        i8_panel_rows((const int8_t *)P + (int64_t)p * K * 16 + (int64_t)k0 * 16,
                                      i8s + (int64_t)p * (K / 32) * 16, k0, kn, wide);
                        w = wide;
                        pf = NULL;
                    } else if (bf16) {
                        const uint16_t *src = pb + (int64_t)k0 * 16;
                        bf16_panel_rows(src, kn, wide, pf != NULL ? src + (int64_t)kn * 16 : NULL);
                        w = wide;
                        pf = NULL;
                    }
                    for (int32_t t = 0; t < full; t++) {
                        const int32_t m = m0 + t * XLLM_TILE_ROWS;
                        if (last) {
                            /* the y lines the next tile stores (the next panel's, after
                             * the block's last tile): in cache when its stores come */
                            const float *yn = t + 1 < full ? y + (int64_t)(m + XLLM_TILE_ROWS) * N + n0
                                                           : y + (int64_t)m0 * N + n0 + 16;
                            const int32_t rn = t + 1 < full || p + 1 < np ? XLLM_TILE_ROWS : 0;
                            for (int32_t r = 0; r < rn; r++)
                                _mm_prefetch((const char *)(yn + (int64_t)r * N), _MM_HINT_T0);
                        }
                        large_tile(xt + ((int64_t)t * K + k0) * XLLM_TILE_ROWS, w, kn,
                                   acc + t * XLLM_TILE_FLOATS, k0 > 0, t == 0 ? pf : NULL,
                                   last ? y + (int64_t)m * N + n0 : NULL, N, bias, XLLM_TILE_ROWS);
                    }
                    if (rem)
                        large_tile_rows(xt + ((int64_t)full * K + k0) * XLLM_TILE_ROWS, w, kn,
                                        acc + full * XLLM_TILE_FLOATS, k0 > 0, full == 0 ? pf : NULL,
                                        last ? y + (int64_t)(m0 + full * XLLM_TILE_ROWS) * N + n0 : NULL,
                                        N, bias, rem);
                }
                if (nv < 16) /* a partial last panel: its sums are in acc */
                    for (int32_t m = 0; m < mr; m++) {
                        float *yr = y + (int64_t)(m0 + m) * N + n0;
                        for (int32_t j = 0; j < nv; j++)
                            yr[j] = acc[16 * m + j] + (b != NULL ? b[n0 + j] : 0.0f);
                    }
            }
        }
    }
    return fail ? -1 : 0;
}

int xllm_linear_large_f32(const float *x, const float *P, const float *b, float *y, int32_t M,
                          int32_t N, int32_t K) {
    return linear_large(x, P, b, y, M, N, K, NULL);
}

int xllm_linear_large_bf16(const float *x, const uint16_t *P, const float *b, float *y,
                           int32_t M, int32_t N, int32_t K) {
    const struct large_src src = {1, NULL, 0, NULL, NULL, NULL, NULL};
    return linear_large(x, P, b, y, M, N, K, &src);
}

int xllm_linear_large_i8(const float *x, const int8_t *P, const float *S, const float *b,
                         float *y, int32_t M, int32_t N, int32_t K) {
    const struct large_src src = {0, S, 0, NULL, NULL, NULL, NULL};
    return linear_large(x, P, b, y, M, N, K, &src);
}

int xllm_linear_large_kq(int32_t type, const float *x, const void *Q, const void *SC,
                         const void *MN, const float *D, const float *DM, const float *b,
                         float *y, int32_t M, int32_t N, int32_t K) {
    if ((type != XLLM_KQ_Q4K && type != XLLM_KQ_Q6K) ||
        (type == XLLM_KQ_Q4K && (MN == NULL || DM == NULL)))
        return -1;
    const struct large_src src = {0, NULL, type, SC, MN, D, DM};
    return linear_large(x, Q, b, y, M, N, K, &src);
}

#pragma GCC pop_options
