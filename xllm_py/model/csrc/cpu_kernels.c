/* CPU kernels for the paged KV cache, loaded through ctypes (xllm_py/model/cpu_kernels.py).
 *
 * Plain C99 + OpenMP, no Python or torch headers, so it compiles in well under a second
 * and links to the OpenMP runtime torch already loaded (same thread pool).
 *
 * Cache layout (docs/DESIGN.md): per layer K and V, each [num_blocks, block_size,
 * num_kv_heads, head_dim] float32; the slot of token t of a sequence is
 * table[t / block_size] * block_size + t % block_size. Callers validate block ids and
 * lengths; the kernels read only the blocks a table names, up to seq_len tokens.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define XLLM_MAX_GROUP 16
#define XLLM_MAX_HEAD_DIM 256
#define XLLM_MAX_BLOCK 256
#define XLLM_MAX_ROWS 64 /* query heads per work item of decode attention */

/* e^x for x <= 0 (softmax after subtracting the max), vectorisable by the compiler:
 * x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6 polynomial (rel. error ~2e-7),
 * 2^n through the exponent bits. Inputs below -87 give 2^-126 scale: effectively 0. */
static inline __attribute__((always_inline)) float xexp(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* s[t] = q . k_t for the n slots of a block, k_t = k + t * stride (one KV head). */
static inline void block_scores(const float *q, const float *k, int64_t stride, int32_t n,
                                int32_t D, float *s) {
    int32_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if ((D & 7) == 0) /* four slots at a time, one horizontal reduction for the four */
        for (; t + 4 <= n; t += 4) {
            const float *k0 = k + t * stride, *k1 = k0 + stride, *k2 = k1 + stride,
                        *k3 = k2 + stride;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int32_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
            }
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            _mm_storeu_ps(s + t, _mm_add_ps(_mm256_castps256_ps128(h),
                                            _mm256_extractf128_ps(h, 1)));
        }
#endif
    for (; t < n; t++) {
        const float *kt = k + t * stride;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int32_t d = 0; d < D; d++)
            dot += q[d] * kt[d];
        s[t] = dot;
    }
}

/* acc += sum_t p[t] * v_t over the n slots of a block, v_t = v + t * stride. */
static inline void block_values(const float *p, const float *v, int64_t stride, int32_t n,
                                int32_t D, float *acc) {
#if defined(__AVX2__) && defined(__FMA__)
    if ((D & 31) == 0) { /* 32 outputs in registers across the slots: no store per slot */
        for (int32_t d = 0; d < D; d += 32) {
            __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
            __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
            for (int32_t t = 0; t < n; t++) {
                const float *vt = v + t * stride + d;
                const __m256 pt = _mm256_broadcast_ss(p + t);
                a0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt), a0);
                a1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8), a1);
                a2 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 16), a2);
                a3 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 24), a3);
            }
            _mm256_storeu_ps(acc + d, a0);
            _mm256_storeu_ps(acc + d + 8, a1);
            _mm256_storeu_ps(acc + d + 16, a2);
            _mm256_storeu_ps(acc + d + 24, a3);
        }
        return;
    }
#endif
    for (int32_t t = 0; t < n; t++) {
        const float *vt = v + t * stride;
        const float pt = p[t];
#pragma omp simd
        for (int32_t d = 0; d < D; d++)
            acc[d] += pt * vt[d];
    }
}

/* Rows r = (kh - kh0) * G + g of one sequence's queries against its cached context, heads
 * [kh0, kh1). Blocks are read in order, each slot's heads in one contiguous sweep.
 * nk0 / nv0: the first K / V block of the next work item's sequence (prefetched during the
 * last block), or NULL. */
static void decode_attend_seq(const float *q, float *out, const float *k_cache,
                              const float *v_cache, int64_t block_stride,
                              const int64_t *table, int64_t L, int32_t H, int32_t KVH,
                              int32_t D, int32_t bs, float scale, int64_t window, int32_t kh0,
                              int32_t kh1, float *work, const float *nk0, const float *nv0) {
    const int32_t G = H / KVH, R = (kh1 - kh0) * G;
    const int64_t slot_stride = (int64_t)KVH * D;
    float *qs = work, *acc = work + (int64_t)R * D, *s = acc + (int64_t)R * D;
    float *m = s + (int64_t)R * bs, *l = m + R;
    for (int32_t r = 0; r < R; r++) {
        const float *qr = q + ((int64_t)kh0 * G + r) * D;
#pragma omp simd
        for (int32_t d = 0; d < D; d++) {
            qs[r * D + d] = qr[d] * scale;
            acc[r * D + d] = 0.0f;
        }
        m[r] = -3.0e38f;
        l[r] = 0.0f;
    }
    /* a sliding window (window > 0) reads only the last `window` positions: from `first` */
    const int64_t first = window > 0 && L > window ? L - window : 0;
    for (int64_t start = first - first % bs; start < L; start += bs) {
        const int64_t blk = table[start / bs];
        const int32_t skip = (int32_t)(start < first ? first - start : 0);
        const int32_t n = (int32_t)((L - start) < bs ? (L - start) : bs) - skip;
        const float *kb = k_cache + blk * block_stride + (int64_t)skip * slot_stride;
        const float *vb = v_cache + blk * block_stride + (int64_t)skip * slot_stride;
        /* The next block (after the last: the next sequence's first) is elsewhere in the
         * pool: prefetch it while this one is computed, K during the scores and V during the
         * values, a 1/R share after each row. Issued in one burst instead (512 lines at 32 x
         * 96 tokens), the prefetches stalled the core until the memory system took them: 8
         * layers x 32 sequences x 96 tokens from DRAM 5.6-6.7 -> 4.4-5.3 ms (the next
         * sequence's first block: -2% more); 2 blocks ahead: slower. Into L2, not L1
         * (locality 2: prefetcht1): fetched into L1 (the next block's K and V are 32 KB,
         * the size of L1) it ran at 0.28-0.33 us a context token and layer from scattered
         * blocks, into L2 at 0.16-0.20 (`python benchmarks/bench_decode_attention.py`, AMD
         * EPYC, one thread: 15 sequences x 1500 tokens, 8 layers 54 -> 26-34 ms a step; 0.31x
         * -> 0.48-0.68x the speed of a plain read of the same bytes; the same floats). */
        const int64_t nblk = start + bs < L ? table[start / bs + 1] : -1;
        const float *kn = nblk >= 0 ? k_cache + nblk * block_stride : nk0;
        const float *vn = nblk >= 0 ? v_cache + nblk * block_stride : nv0;
        const int64_t pf_len = (int64_t)bs * slot_stride, pf_share = (pf_len + R - 1) / R;
        for (int32_t r = 0; r < R; r++) { /* scores: row r reads KV head kh0 + r / G */
            block_scores(qs + (int64_t)r * D, kb + (int64_t)(kh0 + r / G) * D, slot_stride,
                         n, D, s + (int64_t)r * bs);
            if (kn != NULL)
                for (int64_t o = r * pf_share; o < (r + 1) * pf_share && o < pf_len; o += 16)
                    __builtin_prefetch(kn + o, 0, 2);
        }
        for (int32_t r = 0; r < R; r++) {
            float *sr = s + (int64_t)r * bs;
            float bmax = -3.0e38f;
            for (int32_t t = 0; t < n; t++)
                bmax = sr[t] > bmax ? sr[t] : bmax;
            const float mnew = bmax > m[r] ? bmax : m[r];
            const float corr = xexp(m[r] - mnew);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int32_t t = 0; t < n; t++) {
                sr[t] = xexp(sr[t] - mnew);
                sum += sr[t];
            }
            l[r] = l[r] * corr + sum;
            m[r] = mnew;
            float *a = acc + (int64_t)r * D;
#pragma omp simd
            for (int32_t d = 0; d < D; d++)
                a[d] *= corr;
        }
        for (int32_t r = 0; r < R; r++) {
            block_values(s + (int64_t)r * bs, vb + (int64_t)(kh0 + r / G) * D, slot_stride, n,
                         D, acc + (int64_t)r * D);
            if (vn != NULL)
                for (int64_t o = r * pf_share; o < (r + 1) * pf_share && o < pf_len; o += 16)
                    __builtin_prefetch(vn + o, 0, 2);
        }
    }
    for (int32_t r = 0; r < R; r++) {
        float *o = out + ((int64_t)kh0 * G + r) * D;
        const float inv = 1.0f / l[r];
#pragma omp simd
        for (int32_t d = 0; d < D; d++)
            o[d] = acc[r * D + d] * inv;
    }
}

/* Decode attention: one new query token per sequence, attending to its cached context.
 * q, out: [B, H, D] contiguous. k_cache/v_cache: block-major as above, block_stride
 * elements between blocks. tables: [B, table_stride] block ids. seq_lens: [B] (>= 1).
 * Work items: one per sequence (all heads: blocks read sequentially), or per (sequence,
 * KV head) when the batch is too small to keep every thread busy.
 * Returns 0, or -1 when a size is out of range or memory runs out (nothing written). */
static int attention_sizes_ok(int32_t H, int32_t KVH, int32_t D, int32_t bs) {
    return KVH > 0 && H % KVH == 0 && H / KVH <= XLLM_MAX_GROUP && D <= XLLM_MAX_HEAD_DIM &&
           bs <= XLLM_MAX_BLOCK && bs > 0 && D > 0;
}

/* KV heads per work item (called outside a parallel region: it asks for the team size) */
static int32_t attention_heads_per_item(int32_t B, int32_t H, int32_t KVH) {
    int32_t khc = XLLM_MAX_ROWS / (H / KVH);
    if (khc > KVH)
        khc = KVH;
    return B < 2 * omp_get_max_threads() ? 1 : khc;
}

/* The work sharing of decode attention, inside a parallel region (orphaned omp for). */
static void decode_attention_body(const float *q, float *out, const float *k_cache,
                                  const float *v_cache, int64_t block_stride,
                                  const int64_t *tables, int64_t table_stride,
                                  const int64_t *seq_lens, int32_t B, int32_t H, int32_t KVH,
                                  int32_t D, int32_t bs, float scale, int64_t window,
                                  int32_t khc, int *failed) {
    const int32_t G = H / KVH, chunks = (KVH + khc - 1) / khc;
    float *work = (float *)malloc(sizeof(float) * (size_t)khc * G * (2 * D + bs + 2));
    if (work == NULL) {
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp for schedule(static)
    for (int64_t idx = 0; idx < (int64_t)B * chunks; idx++) {
        if (work == NULL)
            continue;
        const int64_t b = idx / chunks;
        const int32_t kh0 = (int32_t)(idx % chunks) * khc;
        const int32_t kh1 = kh0 + khc < KVH ? kh0 + khc : KVH;
        const float *nk0 = NULL, *nv0 = NULL;
        if (idx + 1 < (int64_t)B * chunks && (idx + 1) / chunks != b && seq_lens[b + 1] > 0) {
            const int64_t first = tables[(b + 1) * table_stride];
            nk0 = k_cache + first * block_stride;
            nv0 = v_cache + first * block_stride;
        }
        decode_attend_seq(q + b * H * D, out + b * H * D, k_cache, v_cache, block_stride,
                          tables + b * table_stride, seq_lens[b], H, KVH, D, bs, scale, window,
                          kh0, kh1, work, nk0, nv0);
    }
    free(work);
}

int xllm_paged_decode_attention_f32(const float *q, float *out, const float *k_cache,
                                    const float *v_cache, int64_t block_stride,
                                    const int64_t *tables, int64_t table_stride,
                                    const int64_t *seq_lens, int32_t B, int32_t H,
                                    int32_t KVH, int32_t D, int32_t bs, float scale,
                                    int64_t window) {
    if (!attention_sizes_ok(H, KVH, D, bs) || B < 0 || window < 0)
        return -1;
    const int32_t khc = attention_heads_per_item(B, H, KVH);
    int failed = 0;
#pragma omp parallel
    decode_attention_body(q, out, k_cache, v_cache, block_stride, tables, table_stride,
                          seq_lens, B, H, KVH, D, bs, scale, window, khc, &failed);
    return failed ? -1 : 0;
}

/* o = w * (h * rsqrt(mean(h^2) + eps)) over n values: transformers' float32 formula. */
static inline __attribute__((always_inline)) void rms_norm_row(const float *h, const float *w,
                                                               float *o, int32_t n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int32_t i = 0; i < n; i++)
        ss += h[i] * h[i];
    const float r = 1.0f / __builtin_sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int32_t i = 0; i < n; i++)
        o[i] = w[i] * (h[i] * r);
}

/* RMSNorm of T rows of width H, optionally after a residual add:
 * residual == NULL: out = rmsnorm(x) * w
 * residual != NULL: residual += x (in place, the new residual stream), out = rmsnorm(residual) * w
 * Same float32 formula as transformers: w * (h * rsqrt(mean(h^2) + eps)). */
static void add_rms_norm_body(const float *x, float *residual, const float *w, float *out,
                              int64_t T, int32_t H, float eps) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float *o = out + t * H;
        const float *h = xr;
        if (residual != NULL) {
            float *rr = residual + t * H;
#pragma omp simd
            for (int32_t i = 0; i < H; i++)
                rr[i] = xr[i] + rr[i];
            h = rr;
        }
        rms_norm_row(h, w, o, H, eps);
    }
}

void xllm_add_rms_norm_f32(const float *x, float *residual, const float *w, float *out,
                           int64_t T, int32_t H, float eps) {
#pragma omp parallel if (T >= 64)
    add_rms_norm_body(x, residual, w, out, T, H, eps);
}

/* One head of D values: optional RMSNorm (w != NULL), then neox RoPE with cos/sin rows. */
static inline void norm_rope_head(const float *x, float *o, const float *w, float eps,
                                  const float *cs, const float *sn, int32_t D) {
    float tmp[XLLM_MAX_HEAD_DIM];
    if (w != NULL) {
        rms_norm_row(x, w, tmp, D, eps);
    } else {
        memcpy(tmp, x, sizeof(float) * D);
    }
    const int32_t half = D / 2;
#pragma omp simd
    for (int32_t i = 0; i < half; i++)
        o[i] = tmp[i] * cs[i] + (-tmp[i + half]) * sn[i];
#pragma omp simd
    for (int32_t i = half; i < D; i++)
        o[i] = tmp[i] * cs[i] + tmp[i - half] * sn[i];
}

/* The attention input of T tokens from the fused qkv projection [T, (H + 2 KVH) * D]:
 * q_out [T, H, D] = rope(norm_q(q)); the cache slots slots[t] get rope(norm_k(k)) and v.
 * q_w / k_w: per-head RMSNorm weights [D] (Qwen3) or NULL. cos/sin: [T, D] rows of each
 * token's position. Caches are [num_slots, KVH, D] views (contiguous blocks). */
static void qk_norm_rope_store_body(const float *qkv, float *q_out, float *k_cache,
                                    float *v_cache, const int64_t *slots, const float *q_w,
                                    const float *k_w, float eps, const float *cos_t,
                                    const float *sin_t, int64_t T, int32_t H, int32_t KVH,
                                    int32_t D) {
    const int64_t row = (int64_t)(H + 2 * KVH) * D;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *src = qkv + t * row;
        const float *cs = cos_t + t * D, *sn = sin_t + t * D;
        for (int32_t h = 0; h < H; h++)
            norm_rope_head(src + h * D, q_out + (t * H + h) * D, q_w, eps, cs, sn, D);
        float *kd = k_cache + slots[t] * KVH * D;
        float *vd = v_cache + slots[t] * KVH * D;
        const float *ks = src + (int64_t)H * D, *vs = src + (int64_t)(H + KVH) * D;
        for (int32_t h = 0; h < KVH; h++)
            norm_rope_head(ks + h * D, kd + h * D, k_w, eps, cs, sn, D);
        memcpy(vd, vs, sizeof(float) * KVH * D);
    }
}

int xllm_qk_norm_rope_store_f32(const float *qkv, float *q_out, float *k_cache,
                                float *v_cache, const int64_t *slots, const float *q_w,
                                const float *k_w, float eps, const float *cos_t,
                                const float *sin_t, int64_t T, int32_t H, int32_t KVH,
                                int32_t D) {
    if (D > XLLM_MAX_HEAD_DIM || D % 2 != 0 || D <= 0)
        return -1;
#pragma omp parallel if (T >= 16)
    qk_norm_rope_store_body(qkv, q_out, k_cache, v_cache, slots, q_w, k_w, eps, cos_t, sin_t,
                            T, H, KVH, D);
    return 0;
}

/* Gated activations, x [T, 2I] = [gate | up] -> out [T, I]: SwiGLU silu(gate) * up, or
 * (``gelu``) GeGLU (Gemma) gelu_tanh(gate) * up in one pass into one output (torch: a GELU
 * tensor, then a product tensor, each a fresh 8 MB-per-1,000-rows allocation at prompt
 * sizes). gelu_tanh(g) = g / 2 (1 + tanh(u)) = g sigmoid(2u), u = sqrt(2 / pi) (g +
 * 0.044715 g^3): silu's form, g / (1 + e^a), through xexp (a few ulp from torch's, more
 * accurate where torch's 1 + tanh cancels). */
static void gated_act_body(const float *x, float *out, int64_t T, int32_t I, int gelu) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * (int64_t)I, *u = g + I;
        float *o = out + t * (int64_t)I;
#pragma omp simd
        for (int32_t i = 0; i < I; i++) {
            const float v = g[i];
            float a = gelu ? -1.5957691216057308f * (v + 0.044715f * v * v * v) : -v;
            /* GeGLU, sigmoid(2u) < e^-18: torch's 1 + tanh(u) is 0 there, and the tiny
             * products would otherwise reach the next GEMM as denormals (slow FMAs) */
            const int zero = gelu && a > 18.0f;
            a = zero ? 0.0f : a > 88.0f ? 88.0f : a;
            o[i] = zero ? 0.0f : v / (1.0f + xexp(a)) * u[i];
        }
    }
}

/* SwiGLU inside a parallel region (the fused decode layer's too, decode_layer.c) */
static void silu_and_mul_body(const float *x, float *out, int64_t T, int32_t I) {
    gated_act_body(x, out, T, I, 0);
}

void xllm_silu_and_mul_f32(const float *x, float *out, int64_t T, int32_t I) {
#pragma omp parallel if (T >= 16)
    silu_and_mul_body(x, out, T, I);
}

void xllm_gelu_tanh_and_mul_f32(const float *x, float *out, int64_t T, int32_t I) {
#pragma omp parallel if (T >= 16)
    gated_act_body(x, out, T, I, 1);
}

/* y [M, N] = x [M, K] @ W^T (+ b) for decode-size M, W packed once as panels
 * P[ceil(N / 16)][K][16] (row n of W at panel n / 16, column n % 16; zero padded).
 * Each thread takes whole panels; a 6 x 16 tile of y lives in 12 AVX registers (AVX-512
 * builds: 12 x 16 in 12 registers, panels_avx512.c) while the
 * panel streams through once per tile of x (from L1/L2 after the first pass), so the
 * weights come from memory once per call. Returns -1 without AVX2/FMA (caller: oneDNN).
 *
 * The panels are float32 or bfloat16 (the ``_bf16`` entry points: a checkpoint stored in
 * bfloat16 keeps its linear weights so, half the bytes streamed per decode step). bf16 is
 * the top half of a float32, so a weight widens exactly (a zero-extend and a 16-bit
 * shift) as it is loaded, and the sums are those of float32 panels holding the same
 * values, bit for bit: one row widens in registers, several rows widen each 64-row chunk
 * of the panel once into a 4 KB buffer that serves every tile. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* rows of x per register tile: 6 x 16 in 12 AVX2 registers, 12 x 16 in 12 AVX-512 ones
 * (panels_avx512.c: why) */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define XLLM_AVX512 1
#define XLLM_TILE_ROWS 12
#else
#define XLLM_TILE_ROWS 6
#endif
/* TILE(..., r) for a tile of 1..XLLM_TILE_ROWS rows known only at run time (a partial
 * tile), r a constant in each call so the tile's unused rows compile away; TILE: a tile
 * function whose last argument is the rows. */
#define XLLM_TILE_CASE_(TILE, r, ...) case r: TILE(__VA_ARGS__, r); break;
#if defined(XLLM_AVX512)
#define XLLM_TILE_ROWS_SWITCH(rows, TILE, ...)                                             \
    switch (rows) {                                                                        \
    XLLM_TILE_CASE_(TILE, 1, __VA_ARGS__) XLLM_TILE_CASE_(TILE, 2, __VA_ARGS__)            \
    XLLM_TILE_CASE_(TILE, 3, __VA_ARGS__) XLLM_TILE_CASE_(TILE, 4, __VA_ARGS__)            \
    XLLM_TILE_CASE_(TILE, 5, __VA_ARGS__) XLLM_TILE_CASE_(TILE, 6, __VA_ARGS__)            \
    XLLM_TILE_CASE_(TILE, 7, __VA_ARGS__) XLLM_TILE_CASE_(TILE, 8, __VA_ARGS__)            \
    XLLM_TILE_CASE_(TILE, 9, __VA_ARGS__) XLLM_TILE_CASE_(TILE, 10, __VA_ARGS__)           \
    XLLM_TILE_CASE_(TILE, 11, __VA_ARGS__)                                                 \
    default: TILE(__VA_ARGS__, 12); break;                                                 \
    }
#else
#define XLLM_TILE_ROWS_SWITCH(rows, TILE, ...)                                             \
    switch (rows) {                                                                        \
    XLLM_TILE_CASE_(TILE, 1, __VA_ARGS__) XLLM_TILE_CASE_(TILE, 2, __VA_ARGS__)            \
    XLLM_TILE_CASE_(TILE, 3, __VA_ARGS__) XLLM_TILE_CASE_(TILE, 4, __VA_ARGS__)            \
    XLLM_TILE_CASE_(TILE, 5, __VA_ARGS__)                                                  \
    default: TILE(__VA_ARGS__, 6); break;                                                  \
    }
#endif
#define XLLM_PANEL_MAX_ROWS 96 /* cpu_kernels.PANEL_MAX_ROWS */
/* panel rows per chunk: 4 KB. With the next chunk prefetched and the chunk of x of every
 * tile (9 KB at 32 rows) it stays in L1; a chunk of 128 rows would not. */
#define XLLM_PANEL_KC 64

#if defined(XLLM_AVX512)
#include "panels_avx512.c"
#else
/* One panel row of 16 outputs for a single x row (M == 1: memory-bound, no tiling). One
 * sum per output, k in order, as a tile row's: the floats of a row do not depend on how
 * many rows its step has (a speculative verify step's rows equal decode steps' rows). */
static void panel_one_row(const float *x0, const float *pp, int32_t K, float *tile) {
    __m256 e0 = _mm256_setzero_ps(), e1 = e0;
    int32_t k = 0;
    for (; k + 1 < K; k += 2) {
        const __m256 a = _mm256_broadcast_ss(x0 + k), a2 = _mm256_broadcast_ss(x0 + k + 1);
        e0 = _mm256_fmadd_ps(a, _mm256_loadu_ps(pp + (int64_t)k * 16), e0);
        e1 = _mm256_fmadd_ps(a, _mm256_loadu_ps(pp + (int64_t)k * 16 + 8), e1);
        e0 = _mm256_fmadd_ps(a2, _mm256_loadu_ps(pp + (int64_t)k * 16 + 16), e0);
        e1 = _mm256_fmadd_ps(a2, _mm256_loadu_ps(pp + (int64_t)k * 16 + 24), e1);
    }
    if (k < K) {
        const __m256 a = _mm256_broadcast_ss(x0 + k);
        e0 = _mm256_fmadd_ps(a, _mm256_loadu_ps(pp + (int64_t)k * 16), e0);
        e1 = _mm256_fmadd_ps(a, _mm256_loadu_ps(pp + (int64_t)k * 16 + 8), e1);
    }
    _mm256_storeu_ps(tile, e0);
    _mm256_storeu_ps(tile + 8, e1);
}

/* 16 bfloat16 -> two float32 vectors (columns 0-7, 8-15): exact. */
static inline __attribute__((always_inline)) void bf16x16_load(const uint16_t *p, __m256 *lo,
                                                               __m256 *hi) {
    const __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8)));
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
    *hi = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
}

/* panel_one_row on a bfloat16 panel: the same fmas in the same order. */
static void panel_one_row_bf16(const float *x0, const uint16_t *pp, int32_t K, float *tile) {
    __m256 e0 = _mm256_setzero_ps(), e1 = e0, w0, w1, w2, w3;
    int32_t k = 0;
    for (; k + 1 < K; k += 2) {
        const __m256 a = _mm256_broadcast_ss(x0 + k), a2 = _mm256_broadcast_ss(x0 + k + 1);
        bf16x16_load(pp + (int64_t)k * 16, &w0, &w1);
        bf16x16_load(pp + (int64_t)k * 16 + 16, &w2, &w3);
        e0 = _mm256_fmadd_ps(a, w0, e0);
        e1 = _mm256_fmadd_ps(a, w1, e1);
        e0 = _mm256_fmadd_ps(a2, w2, e0);
        e1 = _mm256_fmadd_ps(a2, w3, e1);
    }
    if (k < K) {
        const __m256 a = _mm256_broadcast_ss(x0 + k);
        bf16x16_load(pp + (int64_t)k * 16, &w0, &w1);
        e0 = _mm256_fmadd_ps(a, w0, e0);
        e1 = _mm256_fmadd_ps(a, w1, e1);
    }
    _mm256_storeu_ps(tile, e0);
    _mm256_storeu_ps(tile + 8, e1);
}

/* int8 panels: P[np][K][16] int8 and S[np][K / 32][16] float32, the weight at (k, j) is
 * P[k][j] * S[k / 32][j] -- a GGUF Q8_0 or Q5_0 weight is exactly that (a float16 scale
 * times a small integer: the product is exact in float32). Widened as they are loaded, the
 * sums are those of float32 panels holding the same values, bit for bit, from a quarter of
 * the bytes. K is a multiple of 32. */
static inline __attribute__((always_inline)) void i8x16_load(const int8_t *p, const float *sc,
                                                             __m256 *lo, __m256 *hi) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
    *lo = _mm256_mul_ps(a, _mm256_loadu_ps(sc));
    *hi = _mm256_mul_ps(b, _mm256_loadu_ps(sc + 8));
}

/* panel_one_row on an int8 panel: the same fmas in the same order. */
static void panel_one_row_i8(const float *x0, const int8_t *pp, const float *ps, int32_t K,
                             float *tile) {
    __m256 e0 = _mm256_setzero_ps(), e1 = e0, w0, w1, w2, w3;
    for (int32_t k = 0; k + 1 < K; k += 2) {
        const float *sc = ps + (int64_t)(k / 32) * 16;
        const __m256 a = _mm256_broadcast_ss(x0 + k), a2 = _mm256_broadcast_ss(x0 + k + 1);
        i8x16_load(pp + (int64_t)k * 16, sc, &w0, &w1);
        i8x16_load(pp + (int64_t)k * 16 + 16, sc, &w2, &w3);
        e0 = _mm256_fmadd_ps(a, w0, e0);
        e1 = _mm256_fmadd_ps(a, w1, e1);
        e0 = _mm256_fmadd_ps(a2, w2, e0);
        e1 = _mm256_fmadd_ps(a2, w3, e1);
    }
    _mm256_storeu_ps(tile, e0);
    _mm256_storeu_ps(tile + 8, e1);
}

/* kn rows (from row k0) of an int8 panel -> float32 rows dst[kn][16] */
static inline void i8_panel_rows(const int8_t *src, const float *ps, int32_t k0, int32_t kn,
                                 float *dst) {
    for (int32_t i = 0; i < kn; i++) {
        __m256 lo, hi;
        i8x16_load(src + (int64_t)i * 16, ps + (int64_t)((k0 + i) / 32) * 16, &lo, &hi);
        _mm256_storeu_ps(dst + (int64_t)i * 16, lo);
        _mm256_storeu_ps(dst + (int64_t)i * 16 + 8, hi);
    }
}

/* kn rows of a bfloat16 panel -> float32 rows dst[kn][16]; prefetches ``pf`` (the next
 * chunk, NULL: none), one line per two rows. */
static inline void bf16_panel_rows(const uint16_t *src, int32_t kn, float *dst,
                                   const uint16_t *pf) {
    for (int32_t i = 0; i < kn; i++) {
        __m256 lo, hi;
        if (pf != NULL && (i & 1) == 0)
            _mm_prefetch((const char *)(pf + (int64_t)i * 16), _MM_HINT_T0);
        bf16x16_load(src + (int64_t)i * 16, &lo, &hi);
        _mm256_storeu_ps(dst + (int64_t)i * 16, lo);
        _mm256_storeu_ps(dst + (int64_t)i * 16 + 8, hi);
    }
}

/* acc[r] += xt[k0:k0+kn][r] @ panel[k0:k0+kn] for the first ``rows`` (1..6, a constant at
 * every call) rows of a tile of x packed as xt[K][6] (the broadcasts of a step read one
 * stream instead of rows 2-6 KB apart); twelve named accumulators (an array of __m256 is
 * not kept in registers), those of rows past ``rows`` unused: a partial last tile costs its
 * rows, not six (M = 32: 5 tiles + 2 rows, ~6% off the matmuls of a decode step).
 * ``pf``: also prefetch the panel's next chunk, one line per step (the first tile of a
 * chunk does it, so the chunk is in cache when the tiles reach it). */
static inline __attribute__((always_inline)) void panel_tile(const float *xt, const float *pp,
                                                             int32_t k0, int32_t kn,
                                                             float (*acc)[16], const int pf,
                                                             const int rows) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define XLLM_LOAD(r, lo, hi)                   \
    if (rows > r) {                            \
        lo = _mm256_loadu_ps(acc[r]);          \
        hi = _mm256_loadu_ps(acc[r] + 8);      \
    }
    XLLM_LOAD(0, c00, c01) XLLM_LOAD(1, c10, c11) XLLM_LOAD(2, c20, c21)
    XLLM_LOAD(3, c30, c31) XLLM_LOAD(4, c40, c41) XLLM_LOAD(5, c50, c51)
#undef XLLM_LOAD
    const float *a = xt + (int64_t)k0 * XLLM_TILE_ROWS;
    const float *w = pp + (int64_t)k0 * 16;
    for (int32_t i = 0; i < kn; i++, a += XLLM_TILE_ROWS, w += 16) {
        const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
        if (pf) /* the next chunk's row, one line: it arrives while the tiles compute */
            _mm_prefetch((const char *)(w + XLLM_PANEL_KC * 16), _MM_HINT_T0);
#define XLLM_ROW(r, lo, hi)                             \
    if (rows > r) {                                     \
        const __m256 ar = _mm256_broadcast_ss(a + r);   \
        lo = _mm256_fmadd_ps(ar, w0, lo);               \
        hi = _mm256_fmadd_ps(ar, w1, hi);               \
    }
        XLLM_ROW(0, c00, c01)
        XLLM_ROW(1, c10, c11)
        XLLM_ROW(2, c20, c21)
        XLLM_ROW(3, c30, c31)
        XLLM_ROW(4, c40, c41)
        XLLM_ROW(5, c50, c51)
#undef XLLM_ROW
    }
#define XLLM_STORE(r, lo, hi)                  \
    if (rows > r) {                            \
        _mm256_storeu_ps(acc[r], lo);          \
        _mm256_storeu_ps(acc[r] + 8, hi);      \
    }
    XLLM_STORE(0, c00, c01) XLLM_STORE(1, c10, c11) XLLM_STORE(2, c20, c21)
    XLLM_STORE(3, c30, c31) XLLM_STORE(4, c40, c41) XLLM_STORE(5, c50, c51)
#undef XLLM_STORE
}


#endif /* XLLM_AVX512 */

/* panel_tile for a partial tile known only at run time. */
static inline __attribute__((always_inline)) void panel_tile_rows(
        const float *xt, const float *pp, int32_t k0, int32_t kn, float (*acc)[16], const int pf,
        const int rows) {
    XLLM_TILE_ROWS_SWITCH(rows, panel_tile, xt, pp, k0, kn, acc, pf)
}

/* *buf grown to at least `bytes` (kept, with *cap, in the caller's thread-local
 * variables: a buffer kept between calls, where a fresh large malloc is an mmap that page
 * faults on every call). NULL when memory runs out (*buf then as it was). */
static void *thread_buffer(void **buf, size_t *cap, size_t bytes) {
    if (bytes > *cap) {
        void *grown = realloc(*buf, bytes);
        if (grown == NULL)
            return NULL;
        *buf = grown;
        *cap = bytes;
    }
    return *buf;
}

/* x packed by tiles, xt[tile][K][XLLM_TILE_ROWS] (rows past M zero): the calling thread's
 * buffer (thread_buffer). */
static float *panel_pack_buffer(size_t need) {
    static __thread void *buf = NULL;
    static __thread size_t cap = 0;
    return thread_buffer(&buf, &cap, sizeof(float) * need);
}

static size_t panel_pack_floats(int32_t M, int32_t K) {
    return M > 1 ? (size_t)((M + XLLM_TILE_ROWS - 1) / XLLM_TILE_ROWS) * K * XLLM_TILE_ROWS : 0;
}

/* The tiles of x after the first over kn rows of one panel: xt packed x from the chunk's
 * first row (tile t at xt + t * K * XLLM_TILE_ROWS), w the panel's rows [kn][16]. */
static inline __attribute__((always_inline)) void panel_chunk_rest(const float *xt,
                                                                   const float *w, int32_t kn,
                                                                   int32_t K, int32_t M,
                                                                   float (*acc)[16]) {
    const int32_t tiles = (M + XLLM_TILE_ROWS - 1) / XLLM_TILE_ROWS;
    const int32_t full = M / XLLM_TILE_ROWS; /* whole tiles */
    for (int32_t t = 1; t < full; t++)
        panel_tile(xt + (int64_t)t * K * XLLM_TILE_ROWS, w, 0, kn, acc + t * XLLM_TILE_ROWS, 0,
                   XLLM_TILE_ROWS);
    if (full > 0 && full < tiles) /* the partial last tile */
        panel_tile_rows(xt + (int64_t)full * K * XLLM_TILE_ROWS, w, 0, kn,
                        acc + full * XLLM_TILE_ROWS, 0, M - full * XLLM_TILE_ROWS);
}

/* Every tile of x over kn rows of one panel, as panel_chunk_rest (pf: w in place in the
 * panel, prefetch the next chunk). */
static inline __attribute__((always_inline)) void panel_chunk(const float *xt, const float *w,
                                                              int32_t kn, int32_t K, int32_t M,
                                                              float (*acc)[16], const int pf) {
    if (M >= XLLM_TILE_ROWS)
        panel_tile(xt, w, 0, kn, acc, pf, XLLM_TILE_ROWS);
    else
        panel_tile_rows(xt, w, 0, kn, acc, pf, M);
    panel_chunk_rest(xt, w, kn, K, M, acc);
}

#if !defined(XLLM_AVX512) /* there: panels_avx512.c, the first tile widens */
/* y rows [M][n0, n0 + nv) = acc (+ b) */
static inline void panel_store_rows(float *y, const float (*acc)[16], int32_t M, int32_t N,
                                    int32_t n0, int32_t nv, const float *b) {
    for (int32_t m = 0; m < M; m++) {
        float *yr = y + (int64_t)m * N + n0;
        for (int32_t j = 0; j < nv; j++)
            yr[j] = acc[m][j] + (b != NULL ? b[n0 + j] : 0.0f);
    }
}

/* panel_chunk over kn rows (from row k0) of an int8 panel (q: the chunk's rows, ps: the
 * panel's scales), widened into wide[kn][16] first. */
static inline __attribute__((always_inline)) void panel_chunk_i8(
        const float *xt, const int8_t *q, const float *ps, int32_t k0, int32_t kn, int32_t K,
        int32_t M, float (*acc)[16], float *wide) {
    i8_panel_rows(q, ps, k0, kn, wide);
    panel_chunk(xt, wide, kn, K, M, acc, 0);
}

/* the same for kn rows of a bfloat16 panel (src: the chunk's rows, pf: bf16_panel_rows') */
static inline __attribute__((always_inline)) void panel_chunk_bf16(
        const float *xt, const uint16_t *src, const uint16_t *pf, int32_t kn, int32_t K,
        int32_t M, float (*acc)[16], float *wide) {
    bf16_panel_rows(src, kn, wide, pf);
    panel_chunk(xt, wide, kn, K, M, acc, 0);
}
#endif

/* x [M > 1][K] packed by tiles into xt (panel_pack_floats), shared among the threads of
 * the parallel region (ends in the loop's barrier). */
static void panel_pack_x(const float *x, int32_t M, int32_t K, float *xt) {
    const int32_t tiles = (M + XLLM_TILE_ROWS - 1) / XLLM_TILE_ROWS;
#pragma omp for schedule(static)
    for (int32_t t = 0; t < tiles; t++) {
        float *dst = xt + (int64_t)t * K * XLLM_TILE_ROWS;
        for (int32_t r = 0; r < XLLM_TILE_ROWS; r++) {
            const int32_t m = t * XLLM_TILE_ROWS + r;
            if (m < M) {
                const float *src = x + (int64_t)m * K;
                for (int32_t k = 0; k < K; k++)
                    dst[(int64_t)k * XLLM_TILE_ROWS + r] = src[k];
            } else {
                for (int32_t k = 0; k < K; k++)
                    dst[(int64_t)k * XLLM_TILE_ROWS + r] = 0.0f;
            }
        }
    }
}

/* acc[m][0..16) = row m of x times panel p, for every row (M == 1: x itself, else xt:
 * panel_pack_x). P: float32 panels, bfloat16 ones with ``bf16``, or int8 ones with their
 * scales S. The same sums whatever else the call computes (one panel, k in order). */
static inline __attribute__((always_inline)) void panel_acc(
    const float *x, const float *xt, const void *P, const float *S, int bf16, int32_t p,
    int32_t M, int32_t K, float (*acc)[16]) {
    const float *pp = (const float *)P + (int64_t)p * K * 16;
    const uint16_t *pb = (const uint16_t *)P + (int64_t)p * K * 16;
    const int8_t *pi = (const int8_t *)P + (int64_t)p * K * 16;
    const float *ps = S != NULL ? S + (int64_t)p * (K / 32) * 16 : NULL;
    float wide[XLLM_PANEL_KC * 16]; /* a bf16 or int8 chunk widened */
    if (M == 1) {
        if (ps != NULL)
            panel_one_row_i8(x, pi, ps, K, acc[0]);
        else if (bf16)
            panel_one_row_bf16(x, pb, K, acc[0]);
        else
            panel_one_row(x, pp, K, acc[0]);
        return;
    }
    const int32_t tiles = (M + XLLM_TILE_ROWS - 1) / XLLM_TILE_ROWS;
    memset(acc, 0, sizeof(float) * 16 * (size_t)(tiles * XLLM_TILE_ROWS));
    /* k outer, tiles inner: each chunk of the panel comes from memory once and serves
     * every tile from L1 */
    for (int32_t k0 = 0; k0 < K; k0 += XLLM_PANEL_KC) {
        const int32_t kn = K - k0 < XLLM_PANEL_KC ? K - k0 : XLLM_PANEL_KC;
        const float *xk = xt + (int64_t)k0 * XLLM_TILE_ROWS;
        if (ps != NULL) {
            panel_chunk_i8(xk, pi + (int64_t)k0 * 16, ps, k0, kn, K, M, acc, wide);
        } else if (bf16) {
            const uint16_t *src = pb + (int64_t)k0 * 16;
            panel_chunk_bf16(xk, src, k0 + kn < K ? src + (int64_t)kn * 16 : NULL, kn, K, M,
                             acc, wide);
        } else {
            panel_chunk(xk, pp + (int64_t)k0 * 16, kn, K, M, acc, 1);
        }
    }
}

/* The work sharing of linear_panels inside a parallel region; xt: panel_pack_floats.
 * P: float32 panels, bfloat16 ones with ``bf16``, or int8 ones with their scales S. */
static void linear_panels_body_s(const float *x, const void *P, const float *S, const float *b,
                                 float *y, int32_t M, int32_t N, int32_t K, float *xt,
                                 int bf16) {
    const int32_t np = (N + 15) / 16;
    if (M > 1)
        panel_pack_x(x, M, K, xt);
    /* static: every panel costs the same, so an even split needs no scheduling work */
#pragma omp for schedule(static)
    for (int32_t p = 0; p < np; p++) {
        const int32_t n0 = p * 16, nv = N - n0 < 16 ? N - n0 : 16;
        float acc[XLLM_PANEL_MAX_ROWS + XLLM_TILE_ROWS][16];
        panel_acc(x, xt, P, S, bf16, p, M, K, acc);
        panel_store_rows(y, (const float (*)[16])acc, M, N, n0, nv, b);
    }
}

static void linear_panels_body(const float *x, const void *P, const float *b, float *y,
                               int32_t M, int32_t N, int32_t K, float *xt, int bf16) {
    linear_panels_body_s(x, P, NULL, b, y, M, N, K, xt, bf16);
}

static int linear_panels_s(const float *x, const void *P, const float *S, const float *b,
                           float *y, int32_t M, int32_t N, int32_t K, int bf16) {
    if (M <= 0 || M > XLLM_PANEL_MAX_ROWS || K <= 0 || (S != NULL && K % 32))
        return -1;
    const size_t need = panel_pack_floats(M, K);
    float *xt = need ? panel_pack_buffer(need) : NULL;
    if (need && xt == NULL)
        return -1;
#pragma omp parallel
    linear_panels_body_s(x, P, S, b, y, M, N, K, xt, bf16);
    return 0;
}

static int linear_panels(const float *x, const void *P, const float *b, float *y, int32_t M,
                         int32_t N, int32_t K, int bf16) {
    return linear_panels_s(x, P, NULL, b, y, M, N, K, bf16);
}

int xllm_linear_panels_i8(const float *x, const int8_t *P, const float *S, const float *b,
                          float *y, int32_t M, int32_t N, int32_t K) {
    return linear_panels_s(x, P, S, b, y, M, N, K, 0);
}

int xllm_linear_panels_f32(const float *x, const float *P, const float *b, float *y, int32_t M,
                           int32_t N, int32_t K) {
    return linear_panels(x, P, b, y, M, N, K, 0);
}

int xllm_linear_panels_bf16(const float *x, const uint16_t *P, const float *b, float *y,
                            int32_t M, int32_t N, int32_t K) {
    return linear_panels(x, P, b, y, M, N, K, 1);
}

#include "decode_layer.c"
#include "kquant.c"
#include "linear_large.c"
#include "head_argmax.c"
#include "head_vnni.c"
#else
int xllm_linear_large_i8(const float *x, const int8_t *P, const float *S, const float *b,
                         float *y, int32_t M, int32_t N, int32_t K) {
    (void)x; (void)P; (void)S; (void)b; (void)y; (void)M; (void)N; (void)K;
    return -1;
}
int xllm_linear_large_kq(int32_t type, const float *x, const void *Q, const void *SC,
                         const void *MN, const float *D, const float *DM, const float *b,
                         float *y, int32_t M, int32_t N, int32_t K) {
    (void)type; (void)x; (void)Q; (void)SC; (void)MN; (void)D; (void)DM; (void)b; (void)y;
    (void)M; (void)N; (void)K;
    return -1;
}
int xllm_linear_panels_kq(int32_t type, const float *x, const void *Q, const void *SC,
                          const void *MN, const float *D, const float *DM, const float *b,
                          float *y, int32_t M, int32_t N, int32_t K) {
    (void)type; (void)x; (void)Q; (void)SC; (void)MN; (void)D; (void)DM; (void)b; (void)y;
    (void)M; (void)N; (void)K;
    return -1;
}
int xllm_dequant_panels_kq(int32_t type, const void *Q, const void *SC, const void *MN,
                           const float *D, const float *DM, int32_t np, int32_t K, float *out) {
    (void)type; (void)Q; (void)SC; (void)MN; (void)D; (void)DM; (void)np; (void)K; (void)out;
    return -1;
}
int xllm_linear_panels_f32(const float *x, const float *P, const float *b, float *y, int32_t M,
                           int32_t N, int32_t K) {
    (void)x; (void)P; (void)b; (void)y; (void)M; (void)N; (void)K;
    return -1;
}
int xllm_linear_large_f32(const float *x, const float *P, const float *b, float *y, int32_t M,
                          int32_t N, int32_t K) {
    (void)x; (void)P; (void)b; (void)y; (void)M; (void)N; (void)K;
    return -1;
}
int xllm_linear_panels_bf16(const float *x, const uint16_t *P, const float *b, float *y,
                            int32_t M, int32_t N, int32_t K) {
    (void)x; (void)P; (void)b; (void)y; (void)M; (void)N; (void)K;
    return -1;
}
int xllm_linear_panels_i8(const float *x, const int8_t *P, const float *S, const float *b,
                          float *y, int32_t M, int32_t N, int32_t K) {
    (void)x; (void)P; (void)S; (void)b; (void)y; (void)M; (void)N; (void)K;
    return -1;
}
int xllm_linear_large_bf16(const float *x, const uint16_t *P, const float *b, float *y,
                           int32_t M, int32_t N, int32_t K) {
    (void)x; (void)P; (void)b; (void)y; (void)M; (void)N; (void)K;
    return -1;
}
int xllm_head_argmax(int32_t kind, const float *x, const void *P, const float *S,
                     const float *b, int64_t *ids, int32_t M, int32_t N, int32_t K) {
    (void)kind; (void)x; (void)P; (void)S; (void)b; (void)ids; (void)M; (void)N; (void)K;
    return -1;
}
int xllm_head_argmax_vnni(const float *x, const uint8_t *V, const float *S, const float *SA,
                          const int8_t *P, int64_t *ids, int32_t M, int32_t N, int32_t K) {
    (void)x; (void)V; (void)S; (void)SA; (void)P; (void)ids; (void)M; (void)N; (void)K;
    return -1;
}
#endif
/* Without AVX2/FMA there is no xllm_decode_stack_f32: the model takes the per-op path. */

/* Blocks of 32 floats that are exactly s * i, |i| <= 127 integers (int8_panels.py): for
 * each block the first of s = max|w| / 127, max|w| / 16 that holds every value exactly
 * (GGUF Q8_0, Q5_0) -> q[b][32], s[b]. Returns 0, or -1 when some block is neither (q and s
 * then partly written). */
int xllm_int8_blocks(const float *w, int64_t nb, int8_t *q, float *s) {
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int64_t b = 0; b < nb; b++) {
        if (bad)
            continue;
        const float *x = w + b * 32;
        int8_t *qb = q + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++)
            amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        if (amax == 0.0f) {
            s[b] = 0.0f;
            memset(qb, 0, 32);
            continue;
        }
        const float levels[2] = {127.0f, 16.0f};
        int found = 0;
        for (int l = 0; l < 2 && !found; l++) {
            const float sc = amax / levels[l];
            int ok = 1;
            for (int i = 0; i < 32 && ok; i++) {
                const float r = rintf(x[i] / sc);
                if (fabsf(r) > 127.0f || r * sc != x[i])
                    ok = 0;
                else
                    qb[i] = (int8_t)r;
            }
            if (ok) {
                s[b] = sc;
                found = 1;
            }
        }
        if (!found)
            bad = 1;
    }
    return bad ? -1 : 0;
}

/* Copies n chunks, dst[i] <- src[i], each row an (address, length) pair of uint64 with equal
 * lengths on both sides: the KV transfer's mapped-pool path (kv_transfer/ucx/shared_memory.py)
 * copies a pull's slices in one call, outside the GIL.
 *
 * Chunks of 1 KB and more are copied with 32-byte loads and non-temporal stores, 256 bytes per
 * step: 10-12 GB/s on the 2-core VM at any chunk size from 16 KB up, where glibc memcpy runs at
 * ~6 GB/s for chunks up to 128 MB (it reaches ~10 only for single copies above ~200 MB, its
 * 4-page interleaved path). Measured with a C harness, 256 MB per round. */
#if defined(__AVX2__) && defined(__FMA__)
static void copy_stream(char *d, const char *s, size_t n) {
    size_t head = (size_t)(-(uintptr_t)d & 31);
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        __m256i r0 = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i r1 = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i r2 = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i r3 = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        __m256i r4 = _mm256_loadu_si256((const __m256i *)(s + i + 128));
        __m256i r5 = _mm256_loadu_si256((const __m256i *)(s + i + 160));
        __m256i r6 = _mm256_loadu_si256((const __m256i *)(s + i + 192));
        __m256i r7 = _mm256_loadu_si256((const __m256i *)(s + i + 224));
        _mm256_stream_si256((__m256i *)(d + i), r0);
        _mm256_stream_si256((__m256i *)(d + i + 32), r1);
        _mm256_stream_si256((__m256i *)(d + i + 64), r2);
        _mm256_stream_si256((__m256i *)(d + i + 96), r3);
        _mm256_stream_si256((__m256i *)(d + i + 128), r4);
        _mm256_stream_si256((__m256i *)(d + i + 160), r5);
        _mm256_stream_si256((__m256i *)(d + i + 192), r6);
        _mm256_stream_si256((__m256i *)(d + i + 224), r7);
    }
    memcpy(d + i, s + i, n - i);
}
#endif

void xllm_copy_chunks(const uint64_t *dst, const uint64_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        char *d = (char *)(uintptr_t)dst[2 * i];
        const char *s = (const char *)(uintptr_t)src[2 * i];
        size_t len = (size_t)dst[2 * i + 1];
#if defined(__AVX2__) && defined(__FMA__)
        if (len >= 1024) {
            copy_stream(d, s, len);
            continue;
        }
#endif
        memcpy(d, s, len);
    }
#if defined(__AVX2__) && defined(__FMA__)
    _mm_sfence(); /* the streamed stores are visible before the caller reports completion */
#endif
}

#include "sample.c"
