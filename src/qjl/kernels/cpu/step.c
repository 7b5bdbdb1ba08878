/* One decode step of a layer in one call (the vLLM backend's decode-only steps on the CPU): every sequence's new
 * key less its key mean and value less its value mean (key and value smoothing,
 * qjl.integrations.vllm.smoothing), both roles quantized and stored into their pages (qjl_encode_store), the paged
 * decode with the new tokens as the last exact segment (qjl_paged_decode), the value mean added back to the output
 * -- what the backend's Python path computes with four calls, the same arithmetic in the same order, so the codes,
 * the pages and the output are equal bit for bit (tests/integrations/test_vllm_fused.py).
 *
 * Either role may be a vector codebook's (group > 1) and the values may be coded over rotations in turn (their
 * encode job's cycles > 1, reading each token's position from the job's pos, as the decode's accumulators do).
 * Returns 0, or a status with `stage` where it arose: 0 the arguments (-1; -6 a mean's block outside its field;
 * nothing read or stored), 1 qjl_encode_store's (with `failed` its job; nothing stored: -2 a non-finite entry,
 * -3 / -4 a norm beyond its dtype, -1 arguments), 2 qjl_paged_decode's (after the store, as in the Python path).
 * Last, the exact copies the step keeps (n_writes, the backend's write_exact): k_out / v_out rows written into the
 * exact fields in their dtype (-7 at stage 0 for a write outside its buffer or of a token not in the step). */
static void add_value_mean(const qjl_decode_args *a, const qjl_field *mu_v, int by_block, uint8_t *out_final,
                           int32_t dtype);

/* the step's exact copies: token w_rows[i]'s stored key / value rows (k_out / v_out, float32) of every head, in
 * the exact fields' dtypes (fp16 / bf16 rounded as torch's .to()), at their checked byte offsets */
static void write_exact_rows(const qjl_step_args *s) {
    const int64_t H = s->decode.heads, D = s->dim;
    for (int64_t i = 0; i < s->n_writes; i++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t row = (s->w_rows[i] * H + h) * D;
            const float *src[2] = {s->k_out + row, s->v_out + row};
            uint8_t *dst[2] = {s->wk + s->wk_off[i * H + h], s->wv + s->wv_off[i * H + h]};
            const int32_t dt[2] = {s->wk_dtype, s->wv_dtype};
            for (int r = 0; r < 2; r++) {
                if (dt[r] == 0) memcpy(dst[r], src[r], sizeof(float) * (size_t)D);
                else store_half_row(src[r], D, dt[r], dst[r]);
            }
        }
}

QJL_EXPORT int qjl_decode_store(qjl_step_args *s) {
    const qjl_decode_args *a = &s->decode;
    const int64_t B = a->batch, H = a->heads, D = s->dim;
    s->stage = s->failed = 0;
    if (B < 1 || H < 1 || D < 1 || D > 4096 || s->n_jobs < 1 || s->n_jobs > 4 || s->k_dtype < 0 || s->k_dtype > 2 ||
        s->v_dtype < 0 || s->v_dtype > 2 || (s->mu.base && (s->mu.dtype < 0 || s->mu.dtype > 2)) ||
        (s->mu_v.base && (s->mu_v.dtype < 0 || s->mu_v.dtype > 2 || !a->out || !s->out_final ||
                          s->out_final_dtype < 0 || s->out_final_dtype > 2 || a->value.out_dim != D)) ||
        a->n_terms < 1 || a->n_terms > 2 || s->n_jobs < 2 || s->jobs[0].group != a->key[0].group ||
        (a->n_terms == 2 && a->key[1].group > 1) || s->jobs[1].group != a->value.group ||
        s->jobs[1].cycles != a->value.cycles || s->jobs[0].cycles != 1)
        return -1; /* (the store jobs must code what the decode reads) */
    for (int64_t b = 0; b < B; b++) {
        const int64_t blk = a->block_table[b * a->max_blocks];
        if ((s->mu.base && (blk < 0 || blk > s->mu_max_block)) ||
            (s->mu_v.base && (blk < 0 || blk > s->mu_v_max_block)))
            return -6;
    }
    if (s->n_writes < 0 || (s->n_writes && (!s->wk || !s->wv || !s->w_rows || !s->wk_off || !s->wv_off ||
                                            s->wk_dtype < 0 || s->wk_dtype > 2 || s->wv_dtype < 0 || s->wv_dtype > 2)))
        return -1;
    for (int64_t i = 0; i < s->n_writes; i++) { /* every write inside its buffer, of a token of the step */
        if (s->w_rows[i] < 0 || s->w_rows[i] >= B) return -7;
        for (int64_t h = 0; h < H; h++) {
            const int64_t ko = s->wk_off[i * H + h], vo = s->wv_off[i * H + h];
            if (ko < 0 || ko > s->wk_room - D * dtype_bytes(s->wk_dtype) || vo < 0 ||
                vo > s->wv_room - D * dtype_bytes(s->wv_dtype))
                return -7;
        }
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
    if (drc) return drc;
    if (s->mu_v.base) add_value_mean(a, &s->mu_v, 1, s->out_final, s->out_final_dtype);
    write_exact_rows(s);
    return 0;
}

/* qjl_decode_store of a layer's kept template `tpl` (everything that does not change from step to step: codecs,
 * fields, exact-row binding, means, the jobs' static parts) with the step's shared arguments `sh` and this call's
 * tensors given as addresses and strides (bytes): the query q [B, H, R, D] in q_dtype times q_scale, the new keys /
 * values k, v (token b, head h at k + b * k_st + h * k_sh), out [B, H, R, D] in out_dtype, the float32 scratch
 * k_out, v_out [B, H, D] and mixed [B, H, R, D] (with value means), the codes' blocks and slots [B], the tokens'
 * positions [B] (int64, read by jobs over rotations in turn; 0: none), threads (0: the step's), the step's exact
 * copies to write (n_writes, w_rows [n_writes], wk_off / wv_off [n_writes, H] int64; 0: none).  The template is
 * copied, never written; `jobs` (the template's two encode jobs) get this call's rows.
 * status[0] / status[1]: qjl_decode_store's stage and failed job.  The same call as filling the struct field by
 * field from Python (launch.DecodeStore before stop 36), in one crossing. */
QJL_EXPORT int qjl_decode_store_at(const qjl_step_args *tpl, qjl_encode_job *jobs, const qjl_step_shared *sh,
                                   intptr_t q, int32_t q_dtype, float q_scale, intptr_t k, int64_t k_st,
                                   int64_t k_sh, int32_t k_dtype, intptr_t v, int64_t v_st, int64_t v_sh,
                                   int32_t v_dtype, intptr_t out, int32_t out_dtype, intptr_t k_out,
                                   intptr_t v_out, intptr_t mixed, intptr_t blocks, intptr_t slots,
                                   intptr_t positions, int32_t threads, int64_t n_writes, intptr_t w_rows,
                                   intptr_t wk_off, intptr_t wv_off, int32_t *status) {
    qjl_step_args s = *tpl;
    qjl_decode_args *c = &s.decode;
    c->q_raw = (const uint8_t *)q;
    c->q_dtype = q_dtype;
    c->q_scale = q_scale;
    c->batch = sh->batch;
    c->block_table = sh->block_table;
    c->max_blocks = sh->max_blocks;
    c->code_start = sh->code_start;
    c->code_end = sh->code_end;
    if (sh->xbias) {
        c->xbias = sh->xbias;
        c->xbias_sb = sh->xbias_sb;
        c->xbias_sh = sh->xbias_sh;
        c->xbias_sr = sh->xbias_sr;
    }
    c->ne = sh->n_rows + 1;
    if (sh->n_rows) { /* segment 0: the step's exact rows in this layer's pages (the binding is the template's) */
        qjl_exact_seg *e0 = &c->xseg[0];
        e0->n = sh->n_rows;
        e0->dtype = sh->rows_dtype;
        e0->k_off = sh->k_off;
        e0->v_off = sh->v_off;
    }
    qjl_exact_seg *e = &c->xseg[c->n_xseg - 1]; /* the new tokens, as stored */
    e->k = (const uint8_t *)k_out;
    e->v = (const uint8_t *)v_out;
    if (s.mu_v.base) { /* the attention in float32, the value mean added into out */
        c->out = (float *)mixed;
        s.out_final = (uint8_t *)out;
        s.out_final_dtype = out_dtype;
    } else if (out_dtype == 0) {
        c->out = (float *)out;
    } else {
        c->out_raw = (uint8_t *)out;
        c->out_dtype = out_dtype;
    }
    c->threads = s.threads = threads > 0 ? threads : sh->threads;
    c->simd = sh->simd;
    s.k = (const uint8_t *)k;
    s.k_st = k_st;
    s.k_sh = k_sh;
    s.k_dtype = k_dtype;
    s.v = (const uint8_t *)v;
    s.v_st = v_st;
    s.v_sh = v_sh;
    s.v_dtype = v_dtype;
    s.k_out = (float *)k_out;
    s.v_out = (float *)v_out;
    jobs[0].x = (const uint8_t *)k_out; /* the keys less their means */
    if (s.mu_v.base) jobs[1].x = (const uint8_t *)v_out;
    else {
        jobs[1].x = (const uint8_t *)v;
        jobs[1].x_st = v_st;
        jobs[1].x_sh = v_sh;
        jobs[1].x_dtype = v_dtype;
    }
    jobs[0].pos = jobs[1].pos = (const int64_t *)positions;
    s.n_writes = n_writes; /* (the write fields are the template's) */
    s.w_rows = (const int64_t *)w_rows;
    s.wk_off = (const int64_t *)wk_off;
    s.wv_off = (const int64_t *)wv_off;
    s.jobs = jobs;
    s.blocks = (const int64_t *)blocks;
    s.slots = (const int64_t *)slots;
    const int rc = qjl_decode_store(&s);
    status[0] = s.stage;
    status[1] = s.failed;
    return rc;
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
