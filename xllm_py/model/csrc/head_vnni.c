/* The argmax of an int8 LM head's rows by integer dot products, then exact sums for the
 * few columns that can still win (included by cpu_kernels.c; called only on CPUs with
 * AVX512-VNNI, which lm_head.py checks).
 *
 * At a batch of 32 greedy rows the head (Gemma 3: 262,144 x 640) is compute-bound, and the
 * float path widens each int8 weight and spends one FMA per weight and row. VPDPBUSD
 * multiplies four byte pairs per lane, so an approximate pass over the same weights with
 * the row quantized to int8 per block of 32 does the products several times faster. Its
 * error is bounded per column: with x ~ sx_b * xq (|x - sx_b * xq| <= sx_b / 2, sx_b =
 * max|x over block b| / 127) and w = q * s_b,
 *     |approx - exact| <= sum_b max|x|_b * |s_b| * sum_{k in b} |q_k| * C,
 * C = 1/254 (the rounding of x) plus float rounding of both sums, taken here as 1/250 +
 * 1e-4. SA = |s_b| * sum |q| per block and column is precomputed (rounded up), so the
 * bound costs one FMA per block and row. A column whose approx + bound is below some
 * column's approx - bound cannot be the argmax; the others (a handful for a real model's
 * hidden state; hundreds for a flat one, after a random prompt) get the exact sums the
 * float kernels compute, a panel at a time: k in order, one fused multiply-add each with
 * the widened weight q * s_b (exact in float32). So the index is the one the logits'
 * argmax gives, the first on a tie. A row with more candidates than a thread keeps goes
 * exact over that thread's panels. -1 (the caller takes the float path): a non-finite x,
 * no memory. A head with a bias is not taken (its rounding would need a bound of its own).
 *
 * V: the weights as u8 q + 128 in VNNI order [np][K/4][16][4] (x is the signed operand;
 * the +128 comes off as 128 * sum xq per block and row); S: the scales [np][K/32][16];
 * P: the int8 panels [np][K][16] of the exact sums. */

#define XLLM_VNNI_CAP 4096 /* candidates kept per row and thread before a compaction */
#define XLLM_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni")))

/* out[16] = the exact sums of panel p's columns for row x, as linear_panels_i8 computes
 * each (panel_one_row_i8: k in order, one fused multiply-add of x[k] and the widened weight
 * q * s, exact in float32), so the values are bit for bit the logits' */
XLLM_VNNI_TARGET
static void vnni_exact_panel(const float *x, const int8_t *P, const float *S, int32_t p,
                             int32_t K, float *out) {
    const int8_t *q = P + (int64_t)p * K * 16;
    const float *s = S + (int64_t)p * (K / 32) * 16;
    __m512 acc = _mm512_setzero_ps();
    for (int32_t k = 0; k < K; k++) {
        const __m512 w = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + (int64_t)k * 16)))),
            _mm512_loadu_ps(s + (int64_t)(k / 32) * 16));
        acc = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), w, acc);
    }
    _mm512_storeu_ps(out, acc);
}

typedef struct {
    int32_t n; /* candidates kept */
    int32_t idx[XLLM_VNNI_CAP];
    float hi[XLLM_VNNI_CAP]; /* approx + bound */
} vnni_cands;

/* drop the candidates below ``floor``; 0 when there is room left after it */
static int vnni_compact(vnni_cands *c, float floor) {
    int32_t kept = 0;
    for (int32_t i = 0; i < c->n; i++)
        if (c->hi[i] >= floor) {
            c->idx[kept] = c->idx[i];
            c->hi[kept++] = c->hi[i];
        }
    c->n = kept;
    return kept < XLLM_VNNI_CAP ? 0 : -1;
}

/* the calling thread's candidate lists, kept between calls: 32 KB a row and thread, of
 * which a call touches a few lines (a fresh allocation each step would page-fault) */
static vnni_cands *vnni_cands_buffer(size_t n) {
    static __thread void *buf = NULL;
    static __thread size_t cap = 0;
    return thread_buffer(&buf, &cap, sizeof(vnni_cands) * n);
}

XLLM_VNNI_TARGET
static float vnni_hmax(__m512 v) { return _mm512_reduce_max_ps(v); }

#define XLLM_VNNI_ROWS 4 /* rows per pass over a panel's block (its 8 weight vectors) */

typedef struct { /* a tile's rows, quantized (their first row's entries) */
    const int8_t *xq;
    const int32_t *corr;
    const float *sx, *xm;
    int32_t K, nb;
} vnni_rows_t;

/* acc[r], bound[r] for the first ``rows`` (a constant at each call) rows of the tile over
 * one panel: each block's weights loaded once for all of them; a row's integer sum starts
 * at -128 * sum xq (the u8 offset), one dot product chain per row. */
XLLM_VNNI_TARGET
static inline __attribute__((always_inline)) void vnni_tile(
        const uint8_t *vp, const float *sp, const float *ap, const vnni_rows_t *rw,
        __m512 *acc, __m512 *bound, const int rows) {
    for (int r = 0; r < rows; r++) {
        acc[r] = _mm512_setzero_ps();
        bound[r] = _mm512_setzero_ps();
    }
    for (int32_t bk = 0; bk < rw->nb; bk++) {
        const uint8_t *w = vp + (int64_t)bk * 32 * 16;
        __m512i wv[8];
        for (int i = 0; i < 8; i++)
            wv[i] = _mm512_loadu_si512((const void *)(w + i * 64));
        const __m512 scale = _mm512_loadu_ps(sp + bk * 16), sa = _mm512_loadu_ps(ap + bk * 16);
        for (int r = 0; r < rows; r++) {
            const int32_t *xs = (const int32_t *)(rw->xq + (int64_t)r * rw->K + bk * 32);
            const int32_t e = r * rw->nb + bk;
            __m512i s = _mm512_set1_epi32(-rw->corr[e]);
            for (int i = 0; i < 8; i++)
                s = _mm512_dpbusd_epi32(s, wv[i], _mm512_set1_epi32(xs[i]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                     _mm512_mul_ps(scale, _mm512_set1_ps(rw->sx[e])), acc[r]);
            bound[r] = _mm512_fmadd_ps(sa, _mm512_set1_ps(rw->xm[e]), bound[r]);
        }
    }
}

int xllm_head_argmax_vnni(const float *x, const uint8_t *V, const float *S, const float *SA,
                          const int8_t *P, int64_t *ids, int32_t M, int32_t N, int32_t K);

XLLM_VNNI_TARGET
int xllm_head_argmax_vnni(const float *x, const uint8_t *V, const float *S, const float *SA,
                          const int8_t *P, int64_t *ids, int32_t M, int32_t N, int32_t K) {
    if (M <= 0 || M > XLLM_PANEL_MAX_ROWS || N <= 0 || K <= 0 || K % 32)
        return -1;
    const int32_t nb = K / 32, np = (N + 15) / 16, whole = N / 16;
    const float C = 1.0f / 250.0f + 1e-4f;
    /* the rows quantized per block: xq, sx, max|x|, and 128 * sum xq */
    int8_t *xq = malloc((size_t)M * K);
    float *sx = malloc(sizeof(float) * (size_t)M * nb);
    float *xm = malloc(sizeof(float) * (size_t)M * nb);
    int32_t *corr = malloc(sizeof(int32_t) * (size_t)M * nb);
    const int nt = omp_get_max_threads();
    vnni_cands *cands = vnni_cands_buffer((size_t)nt * M);
    float *floors = malloc(sizeof(float) * (size_t)nt * M);
    int ok = xq != NULL && sx != NULL && xm != NULL && corr != NULL && cands != NULL &&
             floors != NULL;
    for (int32_t m = 0; ok && m < M; m++)
        for (int32_t bk = 0; bk < nb; bk++) {
            const float *xb = x + (int64_t)m * K + bk * 32;
            float mx = 0.0f;
            for (int k = 0; k < 32; k++) {
                if (!isfinite(xb[k]))
                    ok = 0;
                mx = fabsf(xb[k]) > mx ? fabsf(xb[k]) : mx;
            }
            const float inv = mx > 0.0f ? 127.0f / mx : 0.0f;
            int32_t sum = 0;
            for (int k = 0; k < 32; k++) {
                const int32_t v = (int32_t)nearbyintf(xb[k] * inv);
                xq[(int64_t)m * K + bk * 32 + k] = (int8_t)v;
                sum += v;
            }
            sx[m * nb + bk] = mx / 127.0f;
            xm[m * nb + bk] = mx;
            corr[m * nb + bk] = 128 * sum;
        }
    float *tbest = malloc(sizeof(float) * (size_t)nt * M);
    int64_t *tidx = malloc(sizeof(int64_t) * (size_t)nt * M);
    ok = ok && tbest != NULL && tidx != NULL;
    int used = 1;
    if (ok) {
#pragma omp parallel
        {
            const int t = omp_get_thread_num();
#pragma omp single
            used = omp_get_num_threads();
            /* each thread one run of panels, the threads in panel order (the merge) */
            const int32_t chunk = (np + used - 1) / used;
            const int32_t p0 = t * chunk < np ? t * chunk : np;
            const int32_t p1 = p0 + chunk < np ? p0 + chunk : np;
            vnni_cands *mine = cands + (int64_t)t * M;
            float *floor = floors + (int64_t)t * M;
            /* per row: whether its candidates overflowed (then every panel goes exact), and
             * the running lane-wise max of approx - bound: a lower bound of the row's
             * floor, so a column below it is out already */
            char full[XLLM_PANEL_MAX_ROWS];
            __m512 lanes[XLLM_PANEL_MAX_ROWS];
            for (int32_t m = 0; m < M; m++) {
                mine[m].n = 0;
                floor[m] = -INFINITY;
                full[m] = 0;
                lanes[m] = _mm512_set1_ps(-INFINITY);
            }
            for (int32_t p = p0; p < p1; p++) {
                const uint8_t *vp = V + (int64_t)p * K * 16;
                const float *sp = S + (int64_t)p * nb * 16, *ap = SA + (int64_t)p * nb * 16;
                __m512 accs[XLLM_VNNI_ROWS], bounds[XLLM_VNNI_ROWS];
                for (int32_t m = 0; m < M; m++) {
                    const int32_t r = m % XLLM_VNNI_ROWS;
                    if (r == 0) { /* the next tile of rows over this panel */
                        const int32_t rows = M - m < XLLM_VNNI_ROWS ? M - m : XLLM_VNNI_ROWS;
                        const vnni_rows_t rw = {xq + (int64_t)m * K, corr + m * nb,
                                                sx + m * nb, xm + m * nb, K, nb};
                        switch (rows) {
                        case 1: vnni_tile(vp, sp, ap, &rw, accs, bounds, 1); break;
                        case 2: vnni_tile(vp, sp, ap, &rw, accs, bounds, 2); break;
                        case 3: vnni_tile(vp, sp, ap, &rw, accs, bounds, 3); break;
                        default: vnni_tile(vp, sp, ap, &rw, accs, bounds, 4); break;
                        }
                    }
                    if (full[m])
                        continue;
                    vnni_cands *c = mine + m;
                    const __m512 bound = _mm512_mul_ps(bounds[r], _mm512_set1_ps(C));
                    const __m512 lo = _mm512_sub_ps(accs[r], bound);
                    const __m512 hi = _mm512_add_ps(accs[r], bound);
                    __mmask16 in;
                    if (p >= whole) { /* the partial last panel: its columns all go exact */
                        in = (__mmask16)((1u << (N - p * 16)) - 1);
                    } else {
                        lanes[m] = _mm512_max_ps(lanes[m], lo);
                        in = _mm512_cmp_ps_mask(hi, _mm512_set1_ps(floor[m]), _CMP_GE_OQ);
                        if (!in)
                            continue;
                        /* a column that may be in: tighten the floor, keep what passes */
                        floor[m] = vnni_hmax(lanes[m]);
                        in = _mm512_mask_cmp_ps_mask(in, hi, _mm512_set1_ps(floor[m]),
                                                     _CMP_GE_OQ);
                    }
                    float his[16];
                    _mm512_storeu_ps(his, hi);
                    for (int j = 0; in; j++, in >>= 1) {
                        if (!(in & 1))
                            continue;
                        if (c->n == XLLM_VNNI_CAP && vnni_compact(c, floor[m]) != 0) {
                            full[m] = 1; /* too flat a row to bound: exact throughout */
                            break;
                        }
                        c->idx[c->n] = p * 16 + j;
                        c->hi[c->n++] = p >= whole ? INFINITY : his[j];
                    }
                }
            }
            /* this thread's exact winner per row, over its candidates above its floor (the
             * row's winner is among them where it lies in this thread's panels) */
            for (int32_t m = 0; m < M; m++) {
                const float *xr = x + (int64_t)m * K;
                const float top = vnni_hmax(lanes[m]);
                const vnni_cands *c = mine + m;
                float best = -INFINITY, sums[16];
                int64_t at = -1;
                int32_t have = -1; /* the panel whose sums are in ``sums`` */
                const int32_t n_all = full[m] ? (p1 - p0) * 16 : c->n;
                for (int32_t i = 0; i < n_all; i++) {
                    const int32_t n = full[m] ? p0 * 16 + i : c->idx[i];
                    if (n >= N || (!full[m] && c->hi[i] < top))
                        continue;
                    if (n / 16 != have) {
                        have = n / 16;
                        vnni_exact_panel(xr, P, S, have, K, sums);
                    }
                    if (at < 0 || sums[n % 16] > best) {
                        best = sums[n % 16];
                        at = n;
                    }
                }
                tbest[(int64_t)t * M + m] = best;
                tidx[(int64_t)t * M + m] = at;
            }
        }
        for (int32_t m = 0; m < M; m++) { /* threads in panel order: the first on a tie */
            float best = -INFINITY;
            int64_t at = -1;
            for (int t = 0; t < used && t < nt; t++) {
                const int64_t i = tidx[(int64_t)t * M + m];
                if (i >= 0 && (at < 0 || tbest[(int64_t)t * M + m] > best)) {
                    best = tbest[(int64_t)t * M + m];
                    at = i;
                }
            }
            ok = ok && at >= 0;
            ids[m] = at;
        }
    }
    free(tbest);
    free(tidx);
    free(xq);
    free(sx);
    free(xm);
    free(corr);
    free(floors);
    return ok ? 0 : -1;
}
