/* y [M, N] = x [M, K] @ W^T (+ b) with W a GGUF K-quant weight kept quantized: Q4_K and
 * Q6_K panels (kquant_panels.py packs the file's blocks so). Each panel of 16 output rows:
 *
 *   Q4_K: Q[K][8] uint8, row k's 16 values as nibbles (byte i: column i low, column i + 8
 *         high); SC, MN [K / 32][16] uint8 (each 32-row sub-block's 6-bit scale and min);
 *         D, DM [K / 256][16] float32 (the super-block's scale and min scale).
 *         w(k, j) = (D * SC) * q - DM * MN
 *   Q6_K: Q[K][16] int8 (q - 32, -32..31); SC [K / 16][16] int8 (per 16 rows); D as Q4_K.
 *         w(k, j) = (D * SC) * q
 *
 * which is what the gguf package's dequantize computes, in float32: D is a float16 widened,
 * SC has 6 (Q4_K) or 8 bits, q 4 or 6, so D * SC and (D * SC) * q are exact products and
 * the Q4_K difference rounds once (an fmsub rounds once too, after the exact product): the
 * values are bit for bit the dequantized weight's. They widen in registers (one row) or a
 * 64-row chunk at a time into a 4 KB buffer that serves every tile (several rows), and the
 * fmas are those of linear_panels on float32 panels holding the dequantized weight, in the
 * same order: the same sums, from 0.59 (Q4_K) or 1.08 (Q6_K) bytes a weight instead of 4.
 *
 * Included by cpu_kernels.c (AVX2/FMA builds, after the panel kernel). */

#define XLLM_KQ_Q4K 12 /* GGMLQuantizationType.Q4_K */
#define XLLM_KQ_Q6K 14 /* GGMLQuantizationType.Q6_K */

/* One panel's arrays (pointers at the panel's start). */
struct kq_panel {
    const uint8_t *q;
    const uint8_t *sc; /* Q6_K: int8 */
    const uint8_t *mn; /* Q4_K only */
    const float *d, *dm;
};

static inline struct kq_panel kq_panel_at(int type, const void *Q, const void *SC,
                                          const void *MN, const float *D, const float *DM,
                                          int32_t p, int32_t K) {
    struct kq_panel a;
    const int64_t rows = (int64_t)p * K;
    a.d = D + (int64_t)p * (K / 256) * 16;
    if (type == XLLM_KQ_Q4K) {
        a.q = (const uint8_t *)Q + rows * 8;
        a.sc = (const uint8_t *)SC + (int64_t)p * (K / 32) * 16;
        a.mn = (const uint8_t *)MN + (int64_t)p * (K / 32) * 16;
        a.dm = DM + (int64_t)p * (K / 256) * 16;
    } else {
        a.q = (const uint8_t *)Q + rows * 16;
        a.sc = (const uint8_t *)SC + (int64_t)p * (K / 16) * 16;
        a.mn = NULL;
        a.dm = NULL;
    }
    return a;
}

#if defined(XLLM_AVX512)
/* AVX-512: a panel row of 16 columns widens into one __m512, by the same float operations
 * as the AVX2 code below (the same floats), and the sums run in the same order. */

/* 16 uint8 / int8 -> float32, exact */
static inline __attribute__((always_inline)) __m512 u8x16_float(__m128i v) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}
static inline __attribute__((always_inline)) __m512 i8x16_float(__m128i v) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

/* Q4_K sub-block s (32 rows): D * SC and DM * MN for the 16 columns. */
static inline __attribute__((always_inline)) void q4k_scales(const struct kq_panel *a, int32_t s,
                                                             __m512 *ds, __m512 *dm) {
    const float *d = a->d + (int64_t)(s / 8) * 16, *m = a->dm + (int64_t)(s / 8) * 16;
    *ds = _mm512_mul_ps(_mm512_loadu_ps(d),
                        u8x16_float(_mm_loadu_si128((const __m128i *)(a->sc + (int64_t)s * 16))));
    *dm = _mm512_mul_ps(_mm512_loadu_ps(m),
                        u8x16_float(_mm_loadu_si128((const __m128i *)(a->mn + (int64_t)s * 16))));
}

/* Q4_K row k (8 bytes of nibbles): columns 0-7 are the low nibbles, 8-15 the high ones, so
 * the two halves side by side are the 16 columns in order. */
static inline __attribute__((always_inline)) __m512 q4k_row(const uint8_t *q, __m512 ds,
                                                            __m512 dm) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)q), m = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_unpacklo_epi64(_mm_and_si128(b, m),
                                         _mm_and_si128(_mm_srli_epi16(b, 4), m));
    return _mm512_fmsub_ps(ds, u8x16_float(v), dm);
}

/* Q6_K sub-block s (16 rows): D * SC for the 16 columns. */
static inline __attribute__((always_inline)) __m512 q6k_scales(const struct kq_panel *a,
                                                               int32_t s) {
    return _mm512_mul_ps(_mm512_loadu_ps(a->d + (int64_t)(s / 16) * 16),
                         i8x16_float(_mm_loadu_si128((const __m128i *)(a->sc + (int64_t)s * 16))));
}

/* Q6_K row k (16 int8) */
static inline __attribute__((always_inline)) __m512 q6k_row(const uint8_t *q, __m512 ds) {
    return _mm512_mul_ps(ds, i8x16_float(_mm_loadu_si128((const __m128i *)q)));
}

/* rows [k0, k0 + kn) of a panel (k0 a multiple of 32, kn of 16) -> float32 dst[kn][16] */
static void kq_panel_rows(int type, const struct kq_panel *a, int32_t k0, int32_t kn,
                          float *dst) {
    __m512 ds = _mm512_setzero_ps(), dm = ds;
    if (type == XLLM_KQ_Q4K) {
        for (int32_t i = 0; i < kn; i++) {
            const int32_t k = k0 + i;
            if (k % 32 == 0)
                q4k_scales(a, k / 32, &ds, &dm);
            _mm512_storeu_ps(dst + (int64_t)i * 16, q4k_row(a->q + (int64_t)k * 8, ds, dm));
        }
    } else {
        for (int32_t i = 0; i < kn; i++) {
            const int32_t k = k0 + i;
            if (k % 16 == 0)
                ds = q6k_scales(a, k / 16);
            _mm512_storeu_ps(dst + (int64_t)i * 16, q6k_row(a->q + (int64_t)k * 16, ds));
        }
    }
}

/* panel_one_row on a K-quant panel: the same fmas in the same order (K % 256 == 0). */
static void kq_one_row(int type, const float *x0, const struct kq_panel *a, int32_t K,
                       float *tile) {
    __m512 e = _mm512_setzero_ps(), ds, dm;
    if (type == XLLM_KQ_Q4K) {
        for (int32_t s = 0; s < K / 32; s++) {
            q4k_scales(a, s, &ds, &dm);
            for (int32_t k = s * 32; k < s * 32 + 32; k += 2) {
                if ((k & 7) == 0) /* the next sub-block's nibbles: 4 lines ahead */
                    _mm_prefetch((const char *)(a->q + (int64_t)k * 8 + 256), _MM_HINT_T0);
                e = _mm512_fmadd_ps(_mm512_set1_ps(x0[k]), q4k_row(a->q + (int64_t)k * 8, ds, dm), e);
                e = _mm512_fmadd_ps(_mm512_set1_ps(x0[k + 1]),
                                    q4k_row(a->q + (int64_t)k * 8 + 8, ds, dm), e);
            }
        }
    } else {
        for (int32_t s = 0; s < K / 16; s++) {
            ds = q6k_scales(a, s);
            for (int32_t k = s * 16; k < s * 16 + 16; k += 2) {
                if ((k & 3) == 0)
                    _mm_prefetch((const char *)(a->q + (int64_t)k * 16 + 512), _MM_HINT_T0);
                e = _mm512_fmadd_ps(_mm512_set1_ps(x0[k]), q6k_row(a->q + (int64_t)k * 16, ds), e);
                e = _mm512_fmadd_ps(_mm512_set1_ps(x0[k + 1]),
                                    q6k_row(a->q + (int64_t)k * 16 + 16, ds), e);
            }
        }
    }
    _mm512_storeu_ps(tile, e);
}

/* The first tile of a chunk of a K-quant panel (kn rows from row k0, whole sub-blocks),
 * widening each row as it goes and leaving it in wide[kn][16] for the other tiles (as
 * panel_tile_i8, panels_avx512.c: why). */
static inline __attribute__((always_inline)) void kq_tile_first(
        int type, const float *xt, const struct kq_panel *kp, int32_t k0, int32_t kn,
        float *wide, float (*acc)[16], const int rows) {
    XLLM_TILE_BEGIN(acc, rows)
    const float *a = xt;
    __m512 ds, dm;
    if (type == XLLM_KQ_Q4K) {
        for (int32_t g = 0; g < kn; g += 32) {
            q4k_scales(kp, (k0 + g) / 32, &ds, &dm);
            for (int32_t i = g; i < g + 32; i++, a += XLLM_TILE_ROWS) {
                const __m512 w0 = q4k_row(kp->q + (int64_t)(k0 + i) * 8, ds, dm);
                _mm512_storeu_ps(wide + (int64_t)i * 16, w0);
                XLLM_TILE_FMA()
            }
        }
    } else {
        for (int32_t g = 0; g < kn; g += 16) {
            ds = q6k_scales(kp, (k0 + g) / 16);
            for (int32_t i = g; i < g + 16; i++, a += XLLM_TILE_ROWS) {
                const __m512 w0 = q6k_row(kp->q + (int64_t)(k0 + i) * 16, ds);
                _mm512_storeu_ps(wide + (int64_t)i * 16, w0);
                XLLM_TILE_FMA()
            }
        }
    }
    XLLM_TILE_END(acc, rows)
}

/* panel_chunk over rows [k0, k0 + kn) of a K-quant panel (M > 1), widened into wide by
 * the first tile. */
static void kq_panel_chunk(int type, const float *xt, const struct kq_panel *kp, int32_t k0,
                           int32_t kn, int32_t K, int32_t M, float (*acc)[16], float *wide) {
    const int rows = M < XLLM_TILE_ROWS ? M : XLLM_TILE_ROWS;
    XLLM_TILE_ROWS_SWITCH(rows, kq_tile_first, type, xt, kp, k0, kn, wide, acc)
    panel_chunk_rest(xt, wide, kn, K, M, acc);
}

#else
/* 16 uint8 (or int8) -> float32 [2][8], exact */
static inline __attribute__((always_inline)) void u8x16_float(__m128i v, __m256 *lo, __m256 *hi) {
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
}
static inline __attribute__((always_inline)) void i8x16_float(__m128i v, __m256 *lo, __m256 *hi) {
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}

/* Q4_K sub-block s (32 rows): D * SC and DM * MN for the 16 columns. */
static inline __attribute__((always_inline)) void q4k_scales(const struct kq_panel *a, int32_t s,
                                                             __m256 *ds0, __m256 *ds1,
                                                             __m256 *dm0, __m256 *dm1) {
    const float *d = a->d + (int64_t)(s / 8) * 16, *dm = a->dm + (int64_t)(s / 8) * 16;
    __m256 s0, s1, m0, m1;
    u8x16_float(_mm_loadu_si128((const __m128i *)(a->sc + (int64_t)s * 16)), &s0, &s1);
    u8x16_float(_mm_loadu_si128((const __m128i *)(a->mn + (int64_t)s * 16)), &m0, &m1);
    *ds0 = _mm256_mul_ps(_mm256_loadu_ps(d), s0);
    *ds1 = _mm256_mul_ps(_mm256_loadu_ps(d + 8), s1);
    *dm0 = _mm256_mul_ps(_mm256_loadu_ps(dm), m0);
    *dm1 = _mm256_mul_ps(_mm256_loadu_ps(dm + 8), m1);
}

/* Q4_K row k (8 bytes of nibbles) -> w0 (columns 0-7), w1 (8-15): each byte widened to a
 * 32-bit lane holds column i in its low nibble and column i + 8 in the next four bits. */
static inline __attribute__((always_inline)) void q4k_row(const uint8_t *q, __m256 ds0,
                                                          __m256 ds1, __m256 dm0, __m256 dm1,
                                                          __m256 *w0, __m256 *w1) {
    const __m256i z = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    const __m256i lo = _mm256_and_si256(z, _mm256_set1_epi32(0x0F));
    const __m256i hi = _mm256_srli_epi32(z, 4);
    *w0 = _mm256_fmsub_ps(ds0, _mm256_cvtepi32_ps(lo), dm0);
    *w1 = _mm256_fmsub_ps(ds1, _mm256_cvtepi32_ps(hi), dm1);
}

/* Q6_K sub-block s (16 rows): D * SC for the 16 columns. */
static inline __attribute__((always_inline)) void q6k_scales(const struct kq_panel *a, int32_t s,
                                                             __m256 *ds0, __m256 *ds1) {
    const float *d = a->d + (int64_t)(s / 16) * 16;
    __m256 s0, s1;
    i8x16_float(_mm_loadu_si128((const __m128i *)(a->sc + (int64_t)s * 16)), &s0, &s1);
    *ds0 = _mm256_mul_ps(_mm256_loadu_ps(d), s0);
    *ds1 = _mm256_mul_ps(_mm256_loadu_ps(d + 8), s1);
}

/* Q6_K row k (16 int8) -> w0, w1. */
static inline __attribute__((always_inline)) void q6k_row(const uint8_t *q, __m256 ds0, __m256 ds1,
                                                          __m256 *w0, __m256 *w1) {
    const __m256i a = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q));
    const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
    *w0 = _mm256_mul_ps(ds0, _mm256_cvtepi32_ps(a));
    *w1 = _mm256_mul_ps(ds1, _mm256_cvtepi32_ps(b));
}

/* rows [k0, k0 + kn) of a panel (k0 a multiple of 32, kn of 16) -> float32 dst[kn][16] */
static void kq_panel_rows(int type, const struct kq_panel *a, int32_t k0, int32_t kn,
                          float *dst) {
    __m256 ds0 = _mm256_setzero_ps(), ds1 = ds0, dm0 = ds0, dm1 = ds0, w0, w1;
    if (type == XLLM_KQ_Q4K) {
        for (int32_t i = 0; i < kn; i++) {
            const int32_t k = k0 + i;
            if (k % 32 == 0)
                q4k_scales(a, k / 32, &ds0, &ds1, &dm0, &dm1);
            q4k_row(a->q + (int64_t)k * 8, ds0, ds1, dm0, dm1, &w0, &w1);
            _mm256_storeu_ps(dst + (int64_t)i * 16, w0);
            _mm256_storeu_ps(dst + (int64_t)i * 16 + 8, w1);
        }
    } else {
        for (int32_t i = 0; i < kn; i++) {
            const int32_t k = k0 + i;
            if (k % 16 == 0)
                q6k_scales(a, k / 16, &ds0, &ds1);
            q6k_row(a->q + (int64_t)k * 16, ds0, ds1, &w0, &w1);
            _mm256_storeu_ps(dst + (int64_t)i * 16, w0);
            _mm256_storeu_ps(dst + (int64_t)i * 16 + 8, w1);
        }
    }
}

/* panel_one_row on a K-quant panel: the same fmas in the same order (K % 256 == 0). */
static void kq_one_row(int type, const float *x0, const struct kq_panel *a, int32_t K,
                       float *tile) {
    __m256 e0 = _mm256_setzero_ps(), e1 = e0;
    __m256 ds0, ds1, dm0, dm1, w0, w1, w2, w3;
    if (type == XLLM_KQ_Q4K) {
        for (int32_t s = 0; s < K / 32; s++) {
            q4k_scales(a, s, &ds0, &ds1, &dm0, &dm1);
            for (int32_t k = s * 32; k < s * 32 + 32; k += 2) {
                if ((k & 7) == 0) /* the next sub-block's nibbles: 4 lines ahead */
                    _mm_prefetch((const char *)(a->q + (int64_t)k * 8 + 256), _MM_HINT_T0);
                const __m256 x = _mm256_broadcast_ss(x0 + k), x2 = _mm256_broadcast_ss(x0 + k + 1);
                q4k_row(a->q + (int64_t)k * 8, ds0, ds1, dm0, dm1, &w0, &w1);
                q4k_row(a->q + (int64_t)k * 8 + 8, ds0, ds1, dm0, dm1, &w2, &w3);
                e0 = _mm256_fmadd_ps(x, w0, e0);
                e1 = _mm256_fmadd_ps(x, w1, e1);
                e0 = _mm256_fmadd_ps(x2, w2, e0);
                e1 = _mm256_fmadd_ps(x2, w3, e1);
            }
        }
    } else {
        for (int32_t s = 0; s < K / 16; s++) {
            q6k_scales(a, s, &ds0, &ds1);
            for (int32_t k = s * 16; k < s * 16 + 16; k += 2) {
                if ((k & 3) == 0)
                    _mm_prefetch((const char *)(a->q + (int64_t)k * 16 + 512), _MM_HINT_T0);
                const __m256 x = _mm256_broadcast_ss(x0 + k), x2 = _mm256_broadcast_ss(x0 + k + 1);
                q6k_row(a->q + (int64_t)k * 16, ds0, ds1, &w0, &w1);
                q6k_row(a->q + (int64_t)k * 16 + 16, ds0, ds1, &w2, &w3);
                e0 = _mm256_fmadd_ps(x, w0, e0);
                e1 = _mm256_fmadd_ps(x, w1, e1);
                e0 = _mm256_fmadd_ps(x2, w2, e0);
                e1 = _mm256_fmadd_ps(x2, w3, e1);
            }
        }
    }
    _mm256_storeu_ps(tile, e0);
    _mm256_storeu_ps(tile + 8, e1);
}

/* panel_chunk over rows [k0, k0 + kn) of a K-quant panel (M > 1), widened into wide first */
static void kq_panel_chunk(int type, const float *xt, const struct kq_panel *kp, int32_t k0,
                           int32_t kn, int32_t K, int32_t M, float (*acc)[16], float *wide) {
    kq_panel_rows(type, kp, k0, kn, wide);
    panel_chunk(xt, wide, kn, K, M, acc, 0);
}
#endif /* XLLM_AVX512 */

static int kq_sizes_ok(int type, int32_t M, int32_t N, int32_t K) {
    return (type == XLLM_KQ_Q4K || type == XLLM_KQ_Q6K) && N > 0 && K > 0 && K % 256 == 0 &&
           M > 0 && M <= XLLM_PANEL_MAX_ROWS;
}

/* linear_panels_body_s for K-quant panels (inside a parallel region). */
static void kq_panels_body(int type, const float *x, const void *Q, const void *SC,
                           const void *MN, const float *D, const float *DM, const float *b,
                           float *y, int32_t M, int32_t N, int32_t K, float *xt) {
    const int32_t np = (N + 15) / 16;
    const int32_t tiles = (M + XLLM_TILE_ROWS - 1) / XLLM_TILE_ROWS;
    if (M > 1)
        panel_pack_x(x, M, K, xt);
#pragma omp for schedule(static)
    for (int32_t p = 0; p < np; p++) {
        const struct kq_panel a = kq_panel_at(type, Q, SC, MN, D, DM, p, K);
        const int32_t n0 = p * 16, nv = N - n0 < 16 ? N - n0 : 16;
        float acc[XLLM_PANEL_MAX_ROWS + XLLM_TILE_ROWS][16];
        float wide[XLLM_PANEL_KC * 16];
        if (M == 1) {
            kq_one_row(type, x, &a, K, acc[0]);
        } else {
            memset(acc, 0, sizeof(float) * 16 * (size_t)(tiles * XLLM_TILE_ROWS));
            for (int32_t k0 = 0; k0 < K; k0 += XLLM_PANEL_KC) {
                const int32_t kn = K - k0 < XLLM_PANEL_KC ? K - k0 : XLLM_PANEL_KC;
                kq_panel_chunk(type, xt + (int64_t)k0 * XLLM_TILE_ROWS, &a, k0, kn, K, M, acc,
                               wide);
            }
        }
        panel_store_rows(y, (const float (*)[16])acc, M, N, n0, nv, b);
    }
}

/* 0, or -1 for sizes it does not take (M past XLLM_PANEL_MAX_ROWS, K not whole blocks, an
 * unknown type) or no memory. MN and DM: NULL for Q6_K. */
int xllm_linear_panels_kq(int32_t type, const float *x, const void *Q, const void *SC,
                          const void *MN, const float *D, const float *DM, const float *b,
                          float *y, int32_t M, int32_t N, int32_t K) {
    if (!kq_sizes_ok(type, M, N, K) || (type == XLLM_KQ_Q4K && (MN == NULL || DM == NULL)))
        return -1;
    const size_t need = panel_pack_floats(M, K);
    float *xt = need ? panel_pack_buffer(need) : NULL;
    if (need && xt == NULL)
        return -1;
#pragma omp parallel
    kq_panels_body(type, x, Q, SC, MN, D, DM, b, y, M, N, K, xt);
    return 0;
}

/* The float32 panels out[np][K][16] holding the same values (tests, and the load-time
 * check against the dequantized weight). */
int xllm_dequant_panels_kq(int32_t type, const void *Q, const void *SC, const void *MN,
                           const float *D, const float *DM, int32_t np, int32_t K, float *out) {
    if (!kq_sizes_ok(type, 1, np, K) || (type == XLLM_KQ_Q4K && (MN == NULL || DM == NULL)))
        return -1;
#pragma omp parallel for schedule(static)
    for (int32_t p = 0; p < np; p++) {
        const struct kq_panel a = kq_panel_at(type, Q, SC, MN, D, DM, p, K);
        kq_panel_rows(type, &a, 0, K, out + (int64_t)p * K * 16);
    }
    return 0;
}
