/* One decoder layer of a decode batch (one new token per sequence) in one parallel region.
 *
 * Included by cpu_kernels.c (AVX2/FMA builds): it chains that file's work-sharing bodies,
 * so the layer costs one thread-team wake-up and one call from Python instead of nine, and
 * its intermediates live in one caller-owned scratch buffer instead of fresh tensors:
 *
 *   h = rmsnorm(residual += x)            (first layer: h = rmsnorm(residual))
 *   qkv = h @ Wqkv;  q, cache[slot] = qk-norm + RoPE (+ v)
 *   a = paged decode attention(q)
 *   o = a @ Wo;  h = rmsnorm(residual += o)
 *   out = (silu(gate) * up)(h @ Wgate_up) @ Wdown
 *
 * The numbers are those of the separate kernels (same bodies, same order), so a batch
 * gives the same floats whichever path ran it. */

struct xllm_decode_layer {
    /* sizes */
    int64_t T; /* tokens = sequences, 1..XLLM_PANEL_MAX_ROWS */
    int32_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float rms_eps, qk_eps, scale;
    /* weights: norms [hidden] / [head_dim] (q/k norm: NULL without), panels, biases or NULL */
    const float *input_norm, *post_norm, *q_norm, *k_norm;
    const float *qkv_w, *qkv_b, *o_w, *o_b, *gate_up_w, *gate_up_b, *down_w, *down_b;
    /* this layer's caches and the step's slots, tables, lengths, RoPE rows [T, head_dim] */
    float *k_cache, *v_cache;
    int64_t block_stride, table_stride;
    const int64_t *slots, *tables, *seq_lens;
    const float *cos, *sin;
    /* x: the previous layer's output (NULL in the first layer); residual [T, hidden] is
     * updated in place; out [T, hidden]; scratch: xllm_decode_layer_scratch floats */
    const float *x;
    float *residual, *out, *scratch;
};

static size_t decode_layer_pack_floats(const struct xllm_decode_layer *a) {
    const int32_t q = a->num_heads * a->head_dim;
    int32_t k = a->hidden > q ? a->hidden : q;
    k = k > a->intermediate ? k : a->intermediate;
    return panel_pack_floats((int32_t)a->T, k);
}

/* Floats of scratch the layer needs for these sizes. */
int64_t xllm_decode_layer_scratch(const struct xllm_decode_layer *a) {
    const int64_t q = (int64_t)a->num_heads * a->head_dim;
    const int64_t qkv = q + 2 * (int64_t)a->num_kv_heads * a->head_dim;
    return a->T * (a->hidden + qkv + 2 * q + 3 * (int64_t)a->intermediate) +
           (int64_t)decode_layer_pack_floats(a);
}

/* 0, or -1 (nothing run) when a size is out of range; -2 when attention ran out of memory
 * (the caches hold this step's K/V, the outputs are not valid). */
int xllm_decode_layer_f32(const struct xllm_decode_layer *a) {
    const int32_t M = (int32_t)a->T, H = a->num_heads, KVH = a->num_kv_heads, D = a->head_dim;
    if (a->T <= 0 || a->T > XLLM_PANEL_MAX_ROWS || a->hidden <= 0 || a->intermediate <= 0 ||
        !attention_sizes_ok(H, KVH, D, a->block_size) || D % 2 != 0)
        return -1;
    const int32_t q = H * D, qkv_n = q + 2 * KVH * D, I = a->intermediate;
    float *h = a->scratch;                       /* [T, hidden] */
    float *qkv = h + a->T * a->hidden;           /* [T, qkv_n] */
    float *qr = qkv + a->T * qkv_n;              /* [T, q] */
    float *att = qr + a->T * q;                  /* [T, q] */
    float *gu = att + a->T * q;                  /* [T, 2I] */
    float *act = gu + a->T * 2 * I;              /* [T, I] */
    float *xt = act + a->T * I;                  /* panel packing */
    const int32_t khc = attention_heads_per_item(M, H, KVH);
    int failed = 0;
#pragma omp parallel
    {
        if (a->x == NULL)
            add_rms_norm_body(a->residual, NULL, a->input_norm, h, a->T, a->hidden, a->rms_eps);
        else
            add_rms_norm_body(a->x, a->residual, a->input_norm, h, a->T, a->hidden,
                              a->rms_eps);
        linear_panels_body(h, a->qkv_w, a->qkv_b, qkv, M, qkv_n, a->hidden, xt);
        qk_norm_rope_store_body(qkv, qr, a->k_cache, a->v_cache, a->slots, a->q_norm,
                                a->k_norm, a->qk_eps, a->cos, a->sin, a->T, H, KVH, D);
        decode_attention_body(qr, att, a->k_cache, a->v_cache, a->block_stride, a->tables,
                              a->table_stride, a->seq_lens, M, H, KVH, D, a->block_size,
                              a->scale, khc, &failed);
        linear_panels_body(att, a->o_w, a->o_b, a->out, M, a->hidden, q, xt);
        add_rms_norm_body(a->out, a->residual, a->post_norm, h, a->T, a->hidden, a->rms_eps);
        linear_panels_body(h, a->gate_up_w, a->gate_up_b, gu, M, 2 * I, a->hidden, xt);
        silu_and_mul_body(gu, act, a->T, I);
        linear_panels_body(act, a->down_w, a->down_b, a->out, M, a->hidden, I, xt);
    }
    return failed ? -2 : 0;
}
