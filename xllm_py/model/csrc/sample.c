/* One token per row from temperature, top-k, top-p and min-p, drawn by inverse CDF
 * (included by cpu_kernels.c; plain C, every build).
 *
 * The distribution and the draw of sampler.compute_probs + Sampler._sample_random: the
 * logits divided by the temperature; top_k keeps the k largest; top_p keeps, best first,
 * each token while the mass of the better ones is below top_p times the mass of those
 * kept so far (the best always stays); min_p drops what is below min_p times the best's
 * probability; then the first token in vocabulary order whose cumulative mass exceeds
 * u times the total. Where torch sorts the whole row for top_k / top_p, this selects: a
 * heap keeps the k best (one compare per token for most), and top_p alone asks for the
 * best 64, then for the tokens above a threshold of weight that leaves the kept mass
 * (select_mass), sorting only those; a softmax is weights
 * exp(v - max) summed in double, never normalised (the draw scales u instead). */

typedef struct {
    float v;
    int32_t i;
} xllm_cand;

/* a better than b: larger, or equal and earlier in the vocabulary */
static inline int cand_better(xllm_cand a, xllm_cand b) {
    return a.v > b.v || (a.v == b.v && a.i < b.i);
}

/* Min-heap (the worst candidate at the root) of at most k candidates. */
static void heap_sift_down(xllm_cand *h, int32_t n, int32_t at) {
    for (;;) {
        int32_t l = 2 * at + 1, w = at;
        if (l < n && cand_better(h[w], h[l]))
            w = l;
        if (l + 1 < n && cand_better(h[w], h[l + 1]))
            w = l + 1;
        if (w == at)
            return;
        xllm_cand t = h[at];
        h[at] = h[w];
        h[w] = t;
        at = w;
    }
}

static int cand_desc(const void *a, const void *b) {
    const xllm_cand *x = a, *y = b;
    return cand_better(*x, *y) ? -1 : cand_better(*y, *x) ? 1 : 0;
}

static int cand_by_index(const void *a, const void *b) {
    const xllm_cand *x = a, *y = b;
    return (x->i > y->i) - (x->i < y->i);
}

/* The k best of v[0..V) (finite or -inf), best first, into h; returns how many. */
static int32_t select_best(const float *v, int32_t V, int32_t k, xllm_cand *h) {
    int32_t n = 0;
    for (int32_t i = 0; i < V; i++) {
        xllm_cand c = {v[i], i};
        if (n < k) {
            h[n++] = c;
            if (n == k) /* heapify once full */
                for (int32_t j = k / 2 - 1; j >= 0; j--)
                    heap_sift_down(h, k, j);
        } else if (c.v > h[0].v) { /* ties keep the earlier token */
            h[0] = c;
            heap_sift_down(h, k, 0);
        }
    }
    qsort(h, (size_t)n, sizeof *h, cand_desc);
    return n;
}

static inline float sample_exp(float x) { return x < -87.0f ? 0.0f : xexp(x); }

/* Every token of v [V] (max m) whose weight exp(v - m) reaches the largest threshold that
 * still leaves ``limit`` of the weights' mass at or above it (bisection on the threshold's
 * log, one SIMD pass a step), best first, into h; returns how many. A superset of top_p's
 * tokens (the best ones until their mass reaches the limit) when the mass is the whole
 * row's: for a flat row, where selecting the best 64, 512, ... would sort most of it. w:
 * scratch of V floats. */
static int32_t select_mass(const float *v, int32_t V, float m, float limit, float *w,
                           xllm_cand *h) {
#pragma omp simd
    for (int32_t i = 0; i < V; i++)
        w[i] = sample_exp(v[i] - m);
    float lo = 0.0f, hi = 88.0f; /* -log of the threshold */
    for (int it = 0; it < 16; it++) {
        const float mid = 0.5f * (lo + hi), t = expf(-mid);
        double above = 0.0;
#pragma omp simd reduction(+ : above)
        for (int32_t i = 0; i < V; i++)
            above += w[i] >= t ? w[i] : 0.0f;
        if ((float)above >= limit)
            hi = mid;
        else
            lo = mid;
    }
    const float t = hi >= 87.0f ? 0.0f : expf(-hi);
    int32_t n = 0;
    for (int32_t i = 0; i < V; i++)
        if (w[i] >= t)
            h[n++] = (xllm_cand){v[i], i};
    qsort(h, (size_t)n, sizeof *h, cand_desc);
    return n;
}

/* The chosen token of one row: v [V] the row already divided by its temperature; w and
 * h scratch of V floats / candidates. -1: no finite logit, or a NaN (the caller's torch
 * path). */
static int64_t sample_row(const float *v, int32_t V, int32_t top_k, float top_p, float min_p,
                          double u, float *w, xllm_cand *h) {
    /* the passes over the whole row are SIMD reductions (omp simd: lanes, then lanes
     * combined); the draw's walk keeps vocabulary order */
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int32_t i = 0; i < V; i++) {
        m = v[i] > m ? v[i] : m;
        nan |= v[i] != v[i];
    }
    if (!(m > -INFINITY) || nan)
        return -1;
    const int by_k = top_k > 0 && top_k < V, by_p = top_p < 1.0f;
    if (!by_k && !by_p) { /* every token: weights in place, drawn in one walk */
        double total = 0.0;
        const float floor = min_p > 0.0f ? min_p : 0.0f;
#pragma omp simd reduction(+ : total)
        for (int32_t i = 0; i < V; i++) {
            const float e = sample_exp(v[i] - m);
            w[i] = e < floor ? 0.0f : e;
            total += w[i];
        }
        double target = u * total, cum = 0.0;
        if (target >= total)
            target = nextafter(total, 0.0);
        int64_t last = 0;
        for (int32_t i = 0; i < V; i++) {
            if (w[i] > 0.0f) {
                cum += w[i];
                last = i;
                if (cum > target)
                    return i;
            }
        }
        return last;
    }
    double mass = 0.0; /* top_p's total: every token top_k keeps */
    if (!by_k) {
#pragma omp simd reduction(+ : mass)
        for (int32_t i = 0; i < V; i++)
            mass += sample_exp(v[i] - m);
    }
    int32_t want = by_k ? top_k : 64, n, keep, by_mass = 0;
    for (;;) {
        n = by_mass ? select_mass(v, V, m, top_p * (float)mass, w, h)
                    : select_best(v, V, want, h);
        double sum = 0.0;
        if (by_k)
            for (int32_t j = 0; j < n; j++)
                sum += sample_exp(h[j].v - m);
        const float limit = by_p ? top_p * (float)(by_k ? sum : mass) : INFINITY;
        double before = 0.0;
        keep = n;
        for (int32_t j = 1; j < n; j++) { /* the best always stays */
            before += sample_exp(h[j - 1].v - m);
            if ((float)before >= limit) {
                keep = j;
                break;
            }
        }
        if (keep < n || by_k || n == V)
            break;
        /* the kept mass lies past the best 64: by the mass; should rounding leave that
         * one short, every token */
        want = by_mass ? V : want;
        by_mass = !by_mass;
    }
    double total = 0.0;
    int32_t kept = 0;
    for (int32_t j = 0; j < keep; j++) {
        if (!(h[j].v > -INFINITY))
            break;
        float e = sample_exp(h[j].v - m);
        if (min_p > 0.0f && e < min_p)
            break; /* best first: the rest are smaller still */
        h[kept++] = h[j];
        total += e;
    }
    qsort(h, (size_t)kept, sizeof *h, cand_by_index); /* the draw walks the vocabulary */
    double target = u * total, cum = 0.0;
    if (target >= total)
        target = nextafter(total, 0.0);
    for (int32_t j = 0; j < kept; j++) {
        cum += sample_exp(h[j].v - m);
        if (cum > target)
            return h[j].i;
    }
    return h[kept - 1].i;
}

/* ids [N]: one token per row of logits [N][V] (row stride ``stride`` floats) with row r's
 * temperature temp[r] (1: none), top_k[r] (0 or >= V: none), top_p[r] (1: none), min_p[r]
 * (0: none) and uniform u[r] in [0, 1). Returns 0, -1 when some row has no finite logit or
 * memory runs out (ids then partly written: the caller samples another way). */
int xllm_sample_rows_f32(const float *logits, int64_t stride, int32_t N, int32_t V,
                         const float *temp, const int32_t *top_k, const float *top_p,
                         const float *min_p, const double *u, int64_t *ids) {
    int bad = 0;
#pragma omp parallel reduction(| : bad)
    {
        float *scaled = malloc(sizeof(float) * (size_t)V * 2);
        xllm_cand *h = malloc(sizeof(xllm_cand) * (size_t)V);
        if (scaled == NULL || h == NULL)
            bad = 1;
#pragma omp for schedule(dynamic, 1)
        for (int32_t r = 0; r < N; r++) {
            if (scaled == NULL || h == NULL)
                continue;
            const float *row = logits + (int64_t)r * stride, t = temp[r];
            const float *v = row;
            if (t != 1.0f) { /* torch's logits / temperature, one division each */
                for (int32_t i = 0; i < V; i++)
                    scaled[i] = row[i] / t;
                v = scaled;
            }
            ids[r] = sample_row(v, V, top_k[r], top_p[r], min_p[r], u[r], scaled + V, h);
            bad |= ids[r] < 0;
        }
        free(scaled);
        free(h);
    }
    return bad ? -1 : 0;
}
