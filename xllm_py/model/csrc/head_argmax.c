/* The LM head's argmax without its logits (included by cpu_kernels.c, AVX2/FMA builds).
 *
 * A greedy row needs only the index of its largest logit; writing the whole row (262,144
 * floats for Gemma 3, 1 MB) and reading it back to find that index is a pass over memory
 * per row. Here each panel's 16 x M products come from panel_acc (the sums linear_panels
 * stores, bit for bit, bias added the same way) and are reduced at once into a running
 * (max, panel) per row and column lane (SIMD), then across the lanes, per thread; the
 * threads' results are merged in panel order. Ties go to the first index, as torch.argmax;
 * a NaN makes the call decline (-1): the caller takes the logits' argmax (torch's rule). */

/* ids [M] = argmax over n of (x [M, K] @ W^T + b)[m, n], W as panels (linear_panels'
 * kinds: float32, bfloat16 with ``bf16``, int8 with scales S). -1: unsupported sizes, no
 * memory or a NaN. */
static int head_argmax(const float *x, const void *P, const float *S, const float *b,
                       int64_t *ids, int32_t M, int32_t N, int32_t K, int bf16) {
    if (M <= 0 || M > XLLM_PANEL_MAX_ROWS || K <= 0 || N <= 0 || (S != NULL && K % 32))
        return -1;
    const size_t need = panel_pack_floats(M, K);
    float *xt = need ? panel_pack_buffer(need) : NULL;
    if (need && xt == NULL)
        return -1;
    const int nt = omp_get_max_threads();
    float *tv = malloc(sizeof(float) * (size_t)nt * M);
    int64_t *ti = malloc(sizeof(int64_t) * (size_t)nt * M);
    if (tv == NULL || ti == NULL) {
        free(tv);
        free(ti);
        return -1;
    }
    for (int64_t j = 0; j < (int64_t)nt * M; j++) {
        tv[j] = -INFINITY;
        ti[j] = -1;
    }
    const int32_t np = (N + 15) / 16, whole = N / 16; /* panels with 16 columns */
    int used = 1, nan = 0;
#pragma omp parallel reduction(| : nan)
    {
        if (M > 1)
            panel_pack_x(x, M, K, xt);
        const int t = omp_get_thread_num();
#pragma omp single
        used = omp_get_num_threads();
        /* per row and column lane: the running max over this thread's panels and the
         * panel it came from (strictly larger replaces: the earliest panel of a lane) */
        float lane_v[XLLM_PANEL_MAX_ROWS][16];
        int32_t lane_p[XLLM_PANEL_MAX_ROWS][16];
        for (int32_t m = 0; m < M; m++)
            for (int c = 0; c < 16; c++) {
                lane_v[m][c] = -INFINITY;
                lane_p[m][c] = -1;
            }
        float *bv = tv + (int64_t)t * M;
        int64_t *bi = ti + (int64_t)t * M;
        /* static: each thread one run of panels, the threads in panel order (the merge) */
#pragma omp for schedule(static)
        for (int32_t p = 0; p < np; p++) {
            const int32_t n0 = p * 16;
            float acc[XLLM_PANEL_MAX_ROWS + XLLM_TILE_ROWS][16];
            panel_acc(x, xt, P, S, bf16, p, M, K, acc);
            if (p < whole) {
                for (int32_t m = 0; m < M; m++) {
                    float *lv = lane_v[m];
                    int32_t *lp = lane_p[m];
#pragma omp simd reduction(| : nan)
                    for (int c = 0; c < 16; c++) {
                        const float v = b != NULL ? acc[m][c] + b[n0 + c] : acc[m][c];
                        const int take = v > lv[c] || lp[c] < 0;
                        lv[c] = take ? v : lv[c];
                        lp[c] = take ? p : lp[c];
                        nan |= v != v;
                    }
                }
            } else { /* the partial last panel: its valid columns, in order, after the lanes */
                for (int32_t m = 0; m < M; m++)
                    for (int32_t c = 0; c < N - n0; c++) {
                        const float v = b != NULL ? acc[m][c] + b[n0 + c] : acc[m][c];
                        nan |= v != v;
                        if (bi[m] < 0 || v > bv[m]) {
                            bv[m] = v;
                            bi[m] = n0 + c;
                        }
                    }
            }
        }
        /* the lanes' winners, the first index on a tie, ahead of the partial panel's */
        for (int32_t m = 0; m < M; m++) {
            float best = -INFINITY;
            int64_t at = -1;
            for (int c = 0; c < 16; c++) {
                if (lane_p[m][c] < 0)
                    continue;
                const int64_t i = (int64_t)lane_p[m][c] * 16 + c;
                if (at < 0 || lane_v[m][c] > best || (lane_v[m][c] == best && i < at)) {
                    best = lane_v[m][c];
                    at = i;
                }
            }
            if (at >= 0 && (bi[m] < 0 || !(bv[m] > best))) {
                bv[m] = best;
                bi[m] = at;
            }
        }
    }
    for (int32_t m = 0; m < M; m++) {
        float best = -INFINITY;
        int64_t at = -1;
        for (int t = 0; t < used && t < nt; t++) {
            const int64_t i = ti[(int64_t)t * M + m];
            const float v = tv[(int64_t)t * M + m];
            if (i >= 0 && (at < 0 || v > best)) {
                best = v;
                at = i;
            }
        }
        ids[m] = at;
    }
    free(tv);
    free(ti);
    return nan ? -1 : 0; /* a NaN: the caller takes the logits' argmax (torch's rule) */
}

int xllm_head_argmax(int32_t kind, const float *x, const void *P, const float *S,
                     const float *b, int64_t *ids, int32_t M, int32_t N, int32_t K) {
    if (kind < 0 || kind > 2 || (kind == 2) != (S != NULL))
        return -1;
    return head_argmax(x, P, S, b, ids, M, N, K, kind == 1);
}
