/* A decode batch (one new token per sequence) through every decoder layer, and optionally
 * the final norm and the LM head, in one parallel region.
 *
 * Included by cpu_kernels.c (AVX2/FMA builds): it chains that file's work-sharing bodies,
 * so a step costs one thread-team wake-up and one call from Python instead of nine per
 * layer, and its intermediates live in one caller-owned scratch buffer instead of fresh
 * tensors. Per layer:
 *
 *   h = rmsnorm(residual += x)            (first layer: h = rmsnorm(residual))
 *   qkv = h @ Wqkv;  q, cache[slot] = qk-norm + RoPE (+ v)
 *   a = paged decode attention(q)
 *   o = a @ Wo;  h = rmsnorm(residual += o)
 *   out = (silu(gate) * up)(h @ Wgate_up) @ Wdown
 *
 * then, with a head: logits = rmsnorm(residual += out) @ Wlm.
 * The numbers are those of the separate kernels (same bodies, same order), so a batch
 * gives the same floats whichever path ran it. */

/* What stays the same from step to step: one layer's sizes, weights and caches. */
struct xllm_decode_layer {
    int32_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float rms_eps, qk_eps, scale;
    /* norms [hidden] / [head_dim] (q/k norm: NULL without), panels, biases or NULL */
    const float *input_norm, *post_norm, *q_norm, *k_norm;
    /* panels (float32, or bfloat16 with weight_bf16) and biases */
    const void *qkv_w;
    const float *qkv_b;
    const void *o_w;
    const float *o_b;
    const void *gate_up_w;
    const float *gate_up_b;
    const void *down_w;
    const float *down_b;
    float *k_cache, *v_cache; /* this layer's caches (block_stride apart blocks) */
    int32_t weight_bf16; /* 1: the four panels hold bfloat16 (cpu_kernels.c), 0: float32 */
};

/* One step: the batch, its attention metadata and the buffers. */
struct xllm_decode_step {
    int64_t T; /* tokens = sequences, 1..XLLM_PANEL_MAX_ROWS */
    int32_t block_size;
    int64_t block_stride, table_stride;
    const int64_t *slots, *tables, *seq_lens;
    const float *cos, *sin; /* RoPE rows [T, head_dim] */
    /* or (ids != NULL) gathered here: residual[t] = embed[ids[t]], cos/sin rows
     * cos_table[positions[t]] (embed [embed_rows, hidden], tables [table_rows, head_dim]) */
    const int64_t *ids, *positions;
    const float *embed, *cos_table, *sin_table;
    int64_t embed_rows, table_rows;
    /* residual [T, hidden]: the embeddings in, the residual stream out; out [2][T, hidden]:
     * layer i writes out[i % 2]; scratch: xllm_decode_stack_scratch floats */
    float *residual, *out0, *out1, *scratch;
    /* head (lm_w NULL: none, the last layer's output stays in out[(n - 1) % 2]):
     * final norm weight, its eps, LM head panels and bias (or NULL), logits [T, vocab] */
    const float *final_norm;
    const void *lm_w;
    const float *lm_b;
    float final_eps;
    int32_t vocab;
    float *logits;
    int32_t lm_bf16; /* 1: the LM head panels hold bfloat16 */
};

static size_t decode_layer_pack_floats(const struct xllm_decode_layer *a, int64_t T) {
    const int32_t q = a->num_heads * a->head_dim;
    int32_t k = a->hidden > q ? a->hidden : q;
    k = k > a->intermediate ? k : a->intermediate;
    return panel_pack_floats((int32_t)T, k);
}

static int64_t decode_layer_scratch_floats(const struct xllm_decode_layer *a, int64_t T) {
    const int64_t q = (int64_t)a->num_heads * a->head_dim;
    const int64_t qkv = q + 2 * (int64_t)a->num_kv_heads * a->head_dim;
    return T * (a->hidden + qkv + 2 * q + 3 * (int64_t)a->intermediate) +
           (int64_t)decode_layer_pack_floats(a, T);
}

/* Floats of scratch a step of these layers needs: one layer's (the head reuses it), then
 * the gathered RoPE rows. */
int64_t xllm_decode_stack_scratch(const struct xllm_decode_layer *a, int64_t T) {
    return decode_layer_scratch_floats(a, T) + 2 * T * (int64_t)a->head_dim;
}

static int decode_layer_sizes_ok(const struct xllm_decode_layer *a, int32_t block_size) {
    return a->hidden > 0 && a->intermediate > 0 && a->head_dim % 2 == 0 &&
           attention_sizes_ok(a->num_heads, a->num_kv_heads, a->head_dim, block_size);
}

/* One layer inside the parallel region. */
static void decode_layer_body(const struct xllm_decode_layer *a,
                              const struct xllm_decode_step *s, const float *x, float *out,
                              int32_t khc, int *failed) {
    const int32_t M = (int32_t)s->T, H = a->num_heads, KVH = a->num_kv_heads;
    const int32_t D = a->head_dim;
    const int32_t q = H * D, qkv_n = q + 2 * KVH * D, I = a->intermediate;
    float *h = s->scratch;                       /* [T, hidden] */
    float *qkv = h + s->T * a->hidden;           /* [T, qkv_n] */
    float *qr = qkv + s->T * qkv_n;              /* [T, q] */
    float *att = qr + s->T * q;                  /* [T, q] */
    float *gu = att + s->T * q;                  /* [T, 2I] */
    float *act = gu + s->T * 2 * I;              /* [T, I] */
    float *xt = act + s->T * I;                  /* panel packing */
    if (x == NULL)
        add_rms_norm_body(s->residual, NULL, a->input_norm, h, s->T, a->hidden, a->rms_eps);
    else
        add_rms_norm_body(x, s->residual, a->input_norm, h, s->T, a->hidden, a->rms_eps);
    linear_panels_body(h, a->qkv_w, a->qkv_b, qkv, M, qkv_n, a->hidden, xt, a->weight_bf16);
    qk_norm_rope_store_body(qkv, qr, a->k_cache, a->v_cache, s->slots, a->q_norm, a->k_norm,
                            a->qk_eps, s->cos, s->sin, s->T, H, KVH, D);
    decode_attention_body(qr, att, a->k_cache, a->v_cache, s->block_stride, s->tables,
                          s->table_stride, s->seq_lens, M, H, KVH, D, s->block_size, a->scale,
                          0, khc, failed);
    linear_panels_body(att, a->o_w, a->o_b, out, M, a->hidden, q, xt, a->weight_bf16);
    add_rms_norm_body(out, s->residual, a->post_norm, h, s->T, a->hidden, a->rms_eps);
    linear_panels_body(h, a->gate_up_w, a->gate_up_b, gu, M, 2 * I, a->hidden, xt,
                       a->weight_bf16);
    silu_and_mul_body(gu, act, s->T, I);
    linear_panels_body(act, a->down_w, a->down_b, out, M, a->hidden, I, xt, a->weight_bf16);
}

/* 0, or -1 (nothing run) when a size is out of range; -2 when attention ran out of memory
 * (the caches hold this step's K/V, the outputs are not valid). The layers share their
 * sizes (one scratch layout). */
int xllm_decode_stack_f32(const struct xllm_decode_layer *layers, int32_t n,
                          const struct xllm_decode_step *s) {
    if (n <= 0 || s->T <= 0 || s->T > XLLM_PANEL_MAX_ROWS)
        return -1;
    for (int32_t i = 0; i < n; i++)
        if (!decode_layer_sizes_ok(&layers[i], s->block_size) ||
            layers[i].hidden != layers[0].hidden || layers[i].num_heads != layers[0].num_heads ||
            layers[i].num_kv_heads != layers[0].num_kv_heads ||
            layers[i].head_dim != layers[0].head_dim ||
            layers[i].intermediate != layers[0].intermediate)
            return -1;
    if (s->lm_w != NULL && s->vocab <= 0)
        return -1;
    const int32_t khc =
        attention_heads_per_item((int32_t)s->T, layers[0].num_heads, layers[0].num_kv_heads);
    const int32_t hidden = layers[0].hidden, D = layers[0].head_dim;
    float *const outs[2] = {s->out0, s->out1};
    struct xllm_decode_step st = *s;
    if (s->ids != NULL) {
        for (int64_t t = 0; t < s->T; t++)
            if (s->ids[t] < 0 || s->ids[t] >= s->embed_rows || s->positions[t] < 0 ||
                s->positions[t] >= s->table_rows)
                return -1;
        float *rope = s->scratch + decode_layer_scratch_floats(&layers[0], s->T);
        st.cos = rope;
        st.sin = rope + s->T * D;
    }
    int failed = 0;
#pragma omp parallel
    {
        if (s->ids != NULL) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < s->T; t++) {
                memcpy(s->residual + t * hidden, s->embed + s->ids[t] * hidden,
                       sizeof(float) * (size_t)hidden);
                memcpy((float *)st.cos + t * D, s->cos_table + s->positions[t] * D,
                       sizeof(float) * (size_t)D);
                memcpy((float *)st.sin + t * D, s->sin_table + s->positions[t] * D,
                       sizeof(float) * (size_t)D);
            }
        }
        for (int32_t i = 0; i < n; i++) /* each layer ends in a barrier (the down matmul) */
            decode_layer_body(&layers[i], &st, i == 0 ? NULL : outs[(i - 1) % 2], outs[i % 2],
                              khc, &failed);
        if (s->lm_w != NULL) {
            float *h = s->scratch, *xt = s->scratch + s->T * (int64_t)hidden;
            add_rms_norm_body(outs[(n - 1) % 2], s->residual, s->final_norm, h, s->T, hidden,
                              s->final_eps);
            linear_panels_body(h, s->lm_w, s->lm_b, s->logits, (int32_t)s->T, s->vocab,
                               hidden, xt, s->lm_bf16);
        }
    }
    return failed ? -2 : 0;
}
