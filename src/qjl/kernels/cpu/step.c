/* One decode step of a layer in one call (the vLLM backend's decode-only steps on the CPU): every sequence's new
 * key less its key mean and value less its value mean (key and value smoothing,
 * qjl.integrations.vllm.smoothing), both roles quantized and stored into their pages (qjl_encode_store), the paged
 * decode with the new tokens as the last exact segment (qjl_paged_decode), the value mean added back to the output
 * -- what the backend's Python path computes with four calls, the same arithmetic in the same order, so the codes,
 * the pages and the output are equal bit for bit (tests/integrations/test_vllm_fused.py).
 *
 * Returns 0, or a status with `stage` where it arose: 0 the arguments (-1; -6 a mean's block outside its field;
 * nothing read or stored), 1 qjl_encode_store's (with `failed` its job; nothing stored: -2 a non-finite entry,
 * -3 / -4 a norm beyond its dtype, -1 arguments), 2 qjl_paged_decode's (after the store, as in the Python path). */
static void add_value_mean(const qjl_decode_args *a, const qjl_field *mu_v, int by_block, uint8_t *out_final,
                           int32_t dtype);

QJL_EXPORT int qjl_decode_store(qjl_step_args *s) {
    const qjl_decode_args *a = &s->decode;
    const int64_t B = a->batch, H = a->heads, D = s->dim;
    s->stage = s->failed = 0;
    if (B < 1 || H < 1 || D < 1 || D > 4096 || s->n_jobs < 1 || s->n_jobs > 4 || s->k_dtype < 0 || s->k_dtype > 2 ||
        s->v_dtype < 0 || s->v_dtype > 2 || (s->mu.base && (s->mu.dtype < 0 || s->mu.dtype > 2)) ||
        (s->mu_v.base && (s->mu_v.dtype < 0 || s->mu_v.dtype > 2 || !a->out || !s->out_final ||
                          s->out_final_dtype < 0 || s->out_final_dtype > 2 || a->value.out_dim != D)))
        return -1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t blk = a->block_table[b * a->max_blocks];
        if ((s->mu.base && (blk < 0 || blk > s->mu_max_block)) ||
            (s->mu_v.base && (blk < 0 || blk > s->mu_v_max_block)))
            return -6;
    }
    float mu[D];
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            float *ko = s->k_out + (b * H + h) * D, *vo = s->v_out + (b * H + h) * D;
            read_row(s->k + b * s->k_st + h * s->k_sh, s->k_dtype, D, ko);
            read_row(s->v + b * s->v_st + h * s->v_sh, s->v_dtype, D, vo);
            const int64_t blk = a->block_table[b * a->max_blocks];
            if (s->mu.base) { /* as torch's key.float() - mu.float(): one rounding per element */
                read_row(s->mu.base + blk * s->mu.stride_block + h * s->mu.stride_head, s->mu.dtype, D, mu);
                for (int64_t c = 0; c < D; c++) ko[c] = ko[c] - mu[c];
            }
            if (s->mu_v.base) {
                read_row(s->mu_v.base + blk * s->mu_v.stride_block + h * s->mu_v.stride_head, s->mu_v.dtype, D, mu);
                for (int64_t c = 0; c < D; c++) vo[c] = vo[c] - mu[c];
            }
        }
    int32_t failed = 0;
    s->stage = 1;
    const int rc = qjl_encode_store(s->jobs, s->n_jobs, B, H, s->blocks, s->slots, s->threads, &failed);
    s->failed = failed;
    if (rc) return rc;
    s->stage = 2;
    const int drc = qjl_paged_decode(a);
    if (drc || !s->mu_v.base) return drc;
    add_value_mean(a, &s->mu_v, 1, s->out_final, s->out_final_dtype);
    return 0;
}

/* a->out (float32 [B, H, R, D]) plus each sequence's value mean added to every query row of its KV head in float32
 * (as torch's add), written to out_final in dtype (0 fp32, 1 fp16, 2 bf16; rounded as .to()).  Sequence b's mean of
 * head h: D elements in mu_v->dtype at mu_v->base + blk * mu_v->stride_block + h * mu_v->stride_head, blk its first
 * block-table entry (by_block; checked by the caller) or b. */
static void add_value_mean(const qjl_decode_args *a, const qjl_field *mu_v, int by_block, uint8_t *out_final,
                           int32_t dtype) {
    const int64_t B = a->batch, H = a->heads, R = a->rows, D = a->value.out_dim, es = dtype_bytes(dtype);
    float mu[D], y[D];
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t blk = by_block ? a->block_table[b * a->max_blocks] : b;
            read_row(mu_v->base + blk * mu_v->stride_block + h * mu_v->stride_head, mu_v->dtype, D, mu);
            for (int64_t r = 0; r < R; r++) {
                const int64_t row = (b * H + h) * R + r;
                const float *o = a->out + row * D;
                for (int64_t c = 0; c < D; c++) y[c] = o[c] + mu[c];
                uint8_t *dst = out_final + row * D * es;
                if (dtype == 0) memcpy(dst, y, sizeof(float) * (size_t)D);
                else store_half_row(y, D, dtype, dst);
            }
        }
}

/* The paged decode (qjl_paged_decode) with each sequence's value mean added to its output rows in the same call:
 * the transformers cache's decode step with value smoothing (qjl.cache.attention, launch.DecodeCall), equal bit for
 * bit to the kernel's float32 output + mean, then .to(dtype).  a->out: the float32 [B, H, R, D] the kernel writes
 * (a->out_raw NULL); mean: [B, H, D] float32, contiguous; out_final: [B, H, R, D] in out_final_dtype (0 fp32, 1
 * fp16, 2 bf16).  Returns qjl_paged_decode's status, or -1 for arguments it refuses (nothing read). */
QJL_EXPORT int qjl_decode_mean(const qjl_decode_args *a, const float *mean, uint8_t *out_final,
                               int32_t out_final_dtype) {
    const int64_t D = a->value.out_dim;
    if (!a->out || a->out_raw || !mean || !out_final || out_final_dtype < 0 || out_final_dtype > 2 || D < 1 ||
        D > 4096 || a->batch < 1 || a->heads < 1)
        return -1;
    const int rc = qjl_paged_decode(a);
    if (rc) return rc;
    qjl_field mu;
    memset(&mu, 0, sizeof mu);
    mu.base = (const uint8_t *)mean;
    mu.stride_block = a->heads * D * 4;
    mu.stride_head = D * 4;
    add_value_mean(a, &mu, 0, out_final, out_final_dtype);
    return 0;
}
