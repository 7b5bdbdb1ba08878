/* Entry of the CPU decode: one call per layer and step (qjl_paged_decode, arguments in qjl_decode_args).
 *
 * Work items are (sequence, KV head, chunk of RW query rows, token split), run by parallel_for (decode.h).
 * An item walks its coded tokens SUB per pass, each pass a list of spans (consecutive slots of one block, so
 * the fields sit at fixed strides; small blocks do not shorten the pass): the key terms are scored span by
 * span into logits [RW][SUB], the online softmax
 * is updated (running max, rescaling what was accumulated when it grows), and the values are mixed with
 * the weights p * scale into accumulators [RW][n] (zero points summed per group apart; a value view of K > 1
 * cycles has K of them, a pass's tokens at code positions t with t % K == k mixed into accumulator k as a pass of
 * their own: by_residue).  The thread that finishes the last item of a (sequence, KV head, row chunk) merges that
 * unit's splits exactly and merges the exact tokens (sinks, window, current token) in at the same max, then writes
 * the output (unmix(o) + ox) / l: the codes' values o [K n] are mixed in the value codec's basis and mapped back
 * once per row (TurboQuant's inverse rotations as one [K n, out_dim] matrix), the exact tokens' values ox in the
 * model's.  The key terms' query maps (TurboQuant's rotation, QJL's c S) are applied here too, as matrices, once
 * per item.
 * The AVX2 path (decode_avx2.c) and the portable path (decode_portable.c) compute the same sums in
 * another order: results agree to float32 rounding; the integer path (decode_vnni.c) rounds queries, centroids
 * and weights at the bound stated there.
 * Grouped codes (a vector codebook's, group g > 1: decode.h) take the same passes, softmax and merges: the portable
 * path expands each row through the joint codes' table (unpack_row), the AVX2 path loads each joint code's g floats
 * from it inside its score and mix loops (score_avx2, mix_avx2: unpack8_grouped; keys in pairs of 2-3 bits, in items
 * of 256 tokens or more, through pair tables, score_pairs); run_item never hands a grouped term
 * or view to the lane-sliced loops or the AMX tiles, and to the integer path (VNNI) only keys in pairs of 3-bit codes
 * or in 8-bit joint codes (int8 tables: decode_vnni.c's unpack_pairs32, unpack_joint) -- with "c-int" / "c-amx"
 * grouped values take the AVX2 fp32 loops beside the other role's integer products. */

typedef struct {
    int64_t b, h, rc, t0, t1;
} qjl_item;

/* pw[g][r][i] = p[r][i] * scale[g][i]; zsum[r][g] += sum_i p[r][i] * zero[g][i] (scale, zero: floats [G][SUB]),
 * for the nr live rows */
static void value_weights(const qjl_value_view *v, int nr, const float *scale, const float *zero, int64_t count,
                          const float *p, float *pw, float *zsum) {
    const int64_t G = v->groups;
    for (int64_t g = 0; g < G; g++)
        for (int r = 0; r < nr; r++) {
            const float *pr = p + r * SUB, *sg = scale + g * SUB;
            float *dst = pw + (g * RW + r) * SUB;
            for (int64_t i = 0; i < count; i++) dst[i] = pr[i] * sg[i];
            if (v->has_zero) zsum[r * G + g] += dot_f(pr, zero + g * SUB, count);
        }
}

/* a run's scalars of one field as floats: [groups][SUB] (element g of token i at base + i * stride_token +
 * g * its dtype's size) */
static void read_scalars(const qjl_field *f, const uint8_t *base, int64_t groups, int64_t count, float *out) {
    for (int64_t g = 0; g < groups; g++)
        read_run(base + g * dtype_bytes(f->dtype), f->stride_token, f->dtype, count, out + g * SUB);
}

static inline const uint8_t *at(const qjl_field *f, int64_t blk, int64_t h, int64_t slot) {
    return f->base + blk * f->stride_block + h * f->stride_head + slot * f->stride_token;
}

/* the item's query rows of term k (rows past R are zero), for block-table column j */
static void load_rows(const qjl_decode_args *a, int k, int64_t b, int64_t j, int64_t h, int64_t rc, float *dst) {
    const qjl_key_term *t = &a->key[k];
    const int64_t qb = t->q_per_block ? a->max_blocks : 1, col = t->q_per_block ? j : 0;
    const int64_t width = t->qmap ? t->qdim : t->n;
    const float *src = t->q + (((b * qb + col) * a->heads + h) * a->rows) * width;
    for (int r = 0; r < RW; r++) {
        const int64_t row = rc * RW + r;
        if (row >= a->rows) memset(dst + r * t->n, 0, sizeof(float) * (size_t)t->n);
        else if (!t->qmap) memcpy(dst + r * t->n, src + row * t->n, sizeof(float) * (size_t)t->n);
        else /* the term's query map, applied here: q' = qmap q */
            for (int64_t c = 0; c < t->n; c++) dst[r * t->n + c] = dot_f(t->qmap + c * t->qdim, src + row * t->qdim, t->qdim);
    }
}

/* A pass: up to SUB consecutive coded tokens from `t0` on, as spans of consecutive slots of one block each (a
 * block of 16 slots does not cut a pass to 16 tokens: the softmax, the weights and the value accumulators are per
 * pass). */
typedef struct {
    int n;
    int64_t len;
    int64_t j[SUB], blk[SUB], slot[SUB], off[SUB], cnt[SUB];
    const uint8_t *v[SUB];
} qjl_spans;

static int64_t pass_spans(const qjl_decode_args *a, const qjl_item *it, const qjl_value_view *v, int64_t t0,
                          qjl_spans *s) {
    int ns = 0;
    int64_t len = 0;
    while (len < SUB && t0 + len < it->t1) {
        const int64_t tt = t0 + len, j = tt / a->block_size;
        int64_t cnt = (j + 1) * a->block_size - tt;
        cnt = cnt < it->t1 - tt ? cnt : it->t1 - tt;
        cnt = cnt < SUB - len ? cnt : SUB - len;
        s->j[ns] = j, s->blk[ns] = a->block_table[it->b * a->max_blocks + j], s->slot[ns] = tt % a->block_size;
        s->off[ns] = len, s->cnt[ns] = cnt;
        s->v[ns] = at(&v->codes, s->blk[ns], it->h, s->slot[ns]);
        ns++, len += cnt;
    }
    s->n = ns, s->len = len;
    return len;
}

/* the lines of [p, p + bytes) requested (`near`: towards L1, else L2).  In asm where it can be: GCC -O3 dropped a loop
 * of nothing but __builtin_prefetch (the paged pass prefetch below compiled to no instruction at all) */
static inline void prefetch_run(const uint8_t *p, int64_t bytes, int near) {
    for (int64_t o = 0; o < bytes; o += 64) {
#if defined(__x86_64__) && defined(__GNUC__)
        if (near) __asm__ volatile("prefetcht0 %0" : : "m"(*(const volatile uint8_t *)(p + o)));
        else __asm__ volatile("prefetcht1 %0" : : "m"(*(const volatile uint8_t *)(p + o)));
#else
        if (near) __builtin_prefetch(p + o, 0, 3);
        else __builtin_prefetch(p + o, 0, 2);
#endif
    }
}

/* A pass's codes and scalars requested ahead, every line of every span (keys' codes and norms, values' codes, scales
 * and zero points): a pass of several spans reads blocks in shuffled order, which the hardware prefetchers do not
 * follow, and each block's first lines would wait on memory */
static void prefetch_pass(const qjl_decode_args *a, const qjl_item *it, const qjl_value_view *v, const qjl_spans *s) {
    for (int si = 0; si < s->n; si++) {
        const int64_t blk = s->blk[si], slot = s->slot[si], cnt = s->cnt[si];
        for (int k = 0; k < a->n_terms; k++) {
            const qjl_key_term *kt = &a->key[k];
            prefetch_run(at(&kt->codes, blk, it->h, slot), cnt * kt->codes.stride_token, 0);
            prefetch_run(at(&kt->norm, blk, it->h, slot), cnt * kt->norm.stride_token, 0);
        }
        prefetch_run(s->v[si], cnt * v->codes.stride_token, 0);
        prefetch_run(at(&v->scale, blk, it->h, slot), cnt * v->scale.stride_token, 0);
        if (v->has_zero) prefetch_run(at(&v->zero, blk, it->h, slot), cnt * v->zero.stride_token, 0);
    }
}

/* A pass's tokens by residue (K > 1 cycles; pass token i at code position t0 + i goes into accumulator
 * (t0 + i) % K): residue k's tokens i = first[k], first[k] + K, ... are entries [base[k], base[k] + count[k]) of
 * the residue order, into which their weights p [RW][SUB] (nr live rows), scales and zero points [G][SUB] are
 * gathered (pk, sk, zk; zk with zero points only), and, with `rows` [SUB][row_bytes], their codes copied in one sweep
 * over the spans (a pass of short spans, blocks of a few slots in shuffled order, read from memory once and in
 * order rather than once per residue; a strided gather of the weights measured faster than a sweep's scatter). */
typedef struct {
    int64_t first[64], base[64], count[64];
} qjl_residues;

static void by_residue(const qjl_spans *s, int64_t t0, int64_t K, int64_t stride, int nr, int64_t G, const float *p,
                       const float *scale, const float *zero, uint8_t *rows, int64_t row_bytes, qjl_residues *rz,
                       float *pk, float *sk, float *zk) {
    const int64_t len = s->len;
    int64_t at = 0;
    for (int64_t k = 0; k < K; k++) {
        const int64_t i0 = rz->first[k] = (k - t0 % K + K) % K;
        const int64_t cnt = rz->count[k] = i0 < len ? (len - i0 + K - 1) / K : 0;
        rz->base[k] = at;
        for (int r = 0; r < nr; r++)
            for (int64_t j = 0; j < cnt; j++) pk[r * SUB + at + j] = p[r * SUB + i0 + j * K];
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < cnt; j++) {
                sk[g * SUB + at + j] = scale[g * SUB + i0 + j * K];
                if (zero) zk[g * SUB + at + j] = zero[g * SUB + i0 + j * K];
            }
        at += cnt;
    }
    if (!rows) return;
    for (int64_t k = 0; k < K; k++) /* residue by residue, span by span (residue_spans' places) */
        for (int si = 0; si < s->n; si++) {
            const int64_t i0 = (k - (t0 + s->off[si]) % K + K) % K; /* the span's first token of residue k */
            if (i0 >= s->cnt[si]) continue;
            const int64_t cnt = (s->cnt[si] - i0 + K - 1) / K, step = K * stride;
            const uint8_t *src = s->v[si] + i0 * stride;
            uint8_t *to = rows + (rz->base[k] + (s->off[si] + i0 - rz->first[k]) / K) * row_bytes;
            switch (row_bytes) { /* the usual rows (2-4 bits x 128) as fixed-size copies */
            case 32: for (int64_t j = 0; j < cnt; j++, src += step, to += 32) memcpy(to, src, 32); break;
            case 48: for (int64_t j = 0; j < cnt; j++, src += step, to += 48) memcpy(to, src, 48); break;
            case 64: for (int64_t j = 0; j < cnt; j++, src += step, to += 64) memcpy(to, src, 64); break;
            default: for (int64_t j = 0; j < cnt; j++, src += step, to += row_bytes) memcpy(to, src, (size_t)row_bytes);
            }
        }
}

/* residue k of a pass (by_residue) read in place: span si's tokens i0, i0 + K, ... as a span of `res` (its codes K
 * token strides apart: the caller's view with codes.stride_token * K) at its place in the residue order */
static void residue_spans(const qjl_spans *s, int64_t t0, int64_t K, int64_t k, int64_t stride, const qjl_residues *rz,
                          qjl_spans *res) {
    int ns = 0;
    for (int si = 0; si < s->n; si++) {
        const int64_t i0 = (k - (t0 + s->off[si]) % K + K) % K; /* the span's first token of residue k */
        if (i0 >= s->cnt[si]) continue;
        res->off[ns] = (s->off[si] + i0 - rz->first[k]) / K, res->cnt[ns] = (s->cnt[si] - i0 + K - 1) / K;
        res->v[ns++] = s->v[si] + i0 * stride;
    }
    res->n = ns, res->len = rz->count[k];
}

/* one work item: the partial softmax (m, l, o [RW][K n_v]) of its coded tokens (K = the value view's cycles).  mode:
 * 0 portable, 1 AVX2 (fp32), 2 integer (decode_vnni.c) for the scalar codes of <= VNNI_MAX_BITS bits, AVX2 for the
 * rest (grouped codes included), 3 the integer path on AMX tiles (decode_amx.c; the same sums; with K > 1 the values
 * on vpdpwssd) */
static void run_item(const qjl_decode_args *a, int mode, const qjl_item *it, float *m, float *l, float *o) {
    const qjl_value_view *v = &a->value;
    const int64_t nv = v->n, G = v->groups, K = v->cycles;
    const int nr = a->rows - it->rc * RW < RW ? (int)(a->rows - it->rc * RW) : RW; /* live rows of this chunk */
    float *q[2] = {NULL, NULL};
    for (int k = 0; k < a->n_terms; k++) q[k] = malloc(sizeof(float) * RW * (size_t)a->key[k].n);
    float *logits = malloc(sizeof(float) * RW * SUB), *pw = malloc(sizeof(float) * SUB * (size_t)G * RW);
    float *knorm = malloc(sizeof(float) * SUB), *vscale = malloc(sizeof(float) * SUB * (size_t)G);
    float *vzero = v->has_zero ? malloc(sizeof(float) * SUB * (size_t)G) : NULL;
    float *zsum = calloc((size_t)(K * RW * G), sizeof(float)); /* [K][RW][G] */
    /* K > 1: accumulators [K][RW][n_v] (copied into o's [RW][K n_v] at the end), a residue's spans, the pass's weights,
     * scales, zero points and (short spans) codes in residue order (by_residue), and the views of its codes */
    float *acc = K > 1 ? malloc(sizeof(float) * (size_t)(K * RW * nv)) : o;
    qjl_spans *res = K > 1 ? malloc(sizeof(qjl_spans)) : NULL;
    float *cp = K > 1 ? malloc(sizeof(float) * RW * SUB) : NULL;
    float *cs = K > 1 ? malloc(sizeof(float) * SUB * (size_t)G) : NULL;
    float *cz = K > 1 && v->has_zero ? malloc(sizeof(float) * SUB * (size_t)G) : NULL;
    qjl_value_view vcyc = *v, vrow = *v; /* reading every K-th token; reading rows copied one after another */
    vcyc.codes.stride_token *= K;
    const int64_t row_bytes = nv * v->bits / 8; /* (n_v a multiple of 8) */
    vrow.codes.stride_token = row_bytes;
    uint8_t *rows = K > 1 ? malloc((size_t)(SUB * row_bytes + 64)) : NULL; /* (+64: slack past the last row) */
    qjl_residues rz;
    int64_t nmax = nv;
    for (int k = 0; k < a->n_terms; k++) nmax = a->key[k].n > nmax ? a->key[k].n : nmax;
    float *buf = malloc(sizeof(float) * (size_t)nmax);
#if QJL_HAVE_VNNI
    /* the integer path: per key term its int8 query rows, scales and table; for values the int16 weights */
    int ik[2] = {0, 0};
    int8_t *q8[2] = {NULL, NULL};
    float sq[2][RW], kmul[2][RW], ksc[2] = {1.0f, 1.0f};
    int32_t qsum[2][RW], koff[2][RW];
    uint8_t ktab[2][1024], vtab[32]; /* (scalar codes use 32 bytes, pairs of 3-bit codes 128, 8-bit joint codes 256 g) */
    for (int k = 0; k < a->n_terms; k++) {
        ik[k] = mode >= 2 && vnni_term(&a->key[k]); /* (other codes: the AVX2 loops) */
        if (ik[k]) {
            vnni_tables(); /* (the unpackings' index vectors, once per process) */
            q8[k] = malloc((size_t)RW * (size_t)((a->key[k].n + 31) / 32 * 32));
            const int g = a->key[k].group;
            ksc[k] = g == 1 ? int8_table(a->key[k].cent, a->key[k].bits, 128, ktab[k])
                     : a->key[k].bits == 3 ? int8_pair_table(a->key[k].cent, 128, ktab[k])
                     : int8_joint_table(a->key[k].cent, g, 128, ktab[k]);
        }
    }
    const int iv = mode >= 2 && v->bits <= VNNI_MAX_BITS && (G == 1 || v->group_size % 32 == 0) && v->group == 1;
    int16_t *w16 = iv ? malloc(sizeof(int16_t) * (size_t)(G * RW * (SUB + 2))) : NULL;
    float *vmul = iv ? malloc(sizeof(float) * (size_t)(G * RW)) : NULL;
    const float vsc = iv ? int8_table(v->cent, v->bits, 0, vtab) : 1.0f;
    /* one scale group and no zero points: the softmax and the weights fused (exp_weights) */
    const int fused = iv && G == 1 && !v->has_zero && K == 1;
    float pmax[RW];
#endif
#if QJL_HAVE_AMX
    /* the integer path on tiles (decode_amx.c): per key term its query rows as B tiles; for values the weights'
     * bytes and the pass's rows */
    int ak[2] = {0, 0}, amx_used = 0;
    int64_t kb[2] = {0, 0};
    int8_t *qv[2] = {NULL, NULL};
    uint8_t ktab64[2][64] __attribute__((aligned(64))), vtab64[64] __attribute__((aligned(64)));
    /* tiles where they measured faster than vpdpbusd (kernel_speed, Intel Xeon with AMX, one thread, 64k tokens):
     * from 3 live query rows, or from head dim 128; at d = 64 with 1-2 rows vpdpbusd was 0-9% faster */
    const int amx_here = mode == 3 && (nr >= 3 || v->n >= 128);
    for (int k = 0; k < a->n_terms; k++) {
        ak[k] = amx_here && ik[k] && a->key[k].group == 1 && a->key[k].n <= 64 * AMX_MAX_KB; /* (pairs: vpdpbusd) */
        kb[k] = (a->key[k].n + 63) / 64;
        if (ak[k]) qv[k] = malloc((size_t)(kb[k] * 256)), table64(ktab[k], ktab64[k]);
    }
    const int av = amx_here && iv && K == 1; /* (K > 1: the values on vpdpwssd) */
    uint8_t *wb = av ? calloc((size_t)(G * 2 * RW * SUB), 1) : NULL; /* rows past nr stay zero */
    const uint8_t **vrows = av ? malloc(sizeof(uint8_t *) * SUB) : NULL;
    if (av) table64(vtab, vtab64);
#endif
#if QJL_HAVE_AVX2
    /* the lane-sliced loops (decode_avx2.c) where the widths and sizes allow: keys read their rows sliced (qsl),
     * values accumulate o in the sliced order, put back after the last pass */
    int ks[2] = {0, 0};
    float *qsl[2] = {NULL, NULL};
    for (int k = 0; k < a->n_terms; k++) {
        ks[k] = mode && a->key[k].group == 1 && sliced_ok(a->key[k].bits, a->key[k].n);
        if (ks[k]) qsl[k] = malloc(sizeof(float) * RW * (size_t)a->key[k].n);
    }
    int vs = mode && v->group == 1 && sliced_ok(v->bits, nv) && !v->has_zero && G == 1;
#if QJL_HAVE_VNNI
    vs = vs && !iv;
#endif
    /* pair tables (decode_avx2.c) for keys in pairs of 2-3 bits, in items long enough to pay for them (the integer
     * path never takes grouped keys) */
    int kp[2] = {0, 0};
    float *ptab[2] = {NULL, NULL};
    for (int k = 0; k < a->n_terms; k++) {
        kp[k] = mode && pairs_ok(a->key[k].bits, a->key[k].group) && !a->key[k].q_per_block &&
                it->t1 - it->t0 >= PAIR_MIN_TOKENS;
#if QJL_HAVE_VNNI
        kp[k] = kp[k] && !ik[k];
#endif
        if (kp[k]) ptab[k] = malloc(sizeof(float) * 4 * (size_t)pair_entries(a->key[k].bits, a->key[k].n));
    }
#endif
    for (int r = 0; r < RW; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    memset(acc, 0, sizeof(float) * RW * (size_t)(K * nv));
    int64_t loaded[2] = {-1, -1}; /* block-table column whose query rows each key term holds */
    qjl_spans *cur = malloc(sizeof(qjl_spans)), *nxt = malloc(sizeof(qjl_spans));
    int64_t nlen = it->t0 < it->t1 ? pass_spans(a, it, v, it->t0, nxt) : 0;
    for (int64_t t = it->t0, len; t < it->t1; t += len) {
        qjl_spans *was = cur;
        cur = nxt, nxt = was, len = nlen;
        if (t + len < it->t1) { /* the next pass's spans, and in a paged layout its lines requested now */
            nlen = pass_spans(a, it, v, t + len, nxt);
            if (nxt->n > 1) prefetch_pass(a, it, v, nxt);
        }
        const int ns = cur->n;
        const int64_t *sp_j = cur->j, *sp_blk = cur->blk, *sp_slot = cur->slot, *sp_off = cur->off, *sp_cnt = cur->cnt;
        /* the nr live rows only (scores, softmax, weights): rows past them stay m = -inf, l = 0, o = 0 */
        for (int r = 0; r < nr; r++) memset(logits + r * SUB, 0, sizeof(float) * (size_t)len);
        for (int k = 0; k < a->n_terms; k++) {
            const qjl_key_term *kt = &a->key[k];
#if QJL_HAVE_AMX
            if (ak[k] && loaded[k] >= 0) /* the keys' tiles (the values' configuration replaced them) */
                amx_load_keys(qv[k], kb[k]);
#endif
            for (int si = 0; si < ns; si++) {
                const int64_t j = sp_j[si], blk = sp_blk[si], slot = sp_slot[si], off = sp_off[si], cnt = sp_cnt[si];
                if (loaded[k] < 0 || (kt->q_per_block && loaded[k] != j)) {
                    load_rows(a, k, it->b, j, it->h, it->rc, q[k]);
#if QJL_HAVE_VNNI
                    if (ik[k]) { /* rows that are not finite: this term goes through the float path */
                        const int64_t n = kt->n;
                        if (int8_rows(q[k], n, (n + 31) / 32 * 32, q8[k], sq[k], qsum[k])) ik[k] = 0;
                        for (int r = 0; r < RW; r++) kmul[k][r] = sq[k][r] * ksc[k], koff[k][r] = 128 * qsum[k][r];
                    }
#endif
#if QJL_HAVE_AMX
                    ak[k] = ak[k] && ik[k];
                    if (ak[k]) amx_key_rows(q8[k], kt->n, qv[k]), amx_load_keys(qv[k], kb[k]), amx_used = 1;
#endif
#if QJL_HAVE_AVX2
                    int slice = ks[k];
#if QJL_HAVE_VNNI
                    slice = slice && !ik[k]; /* the integer path scores this term (ik stays 0 once cleared) */
#endif
                    if (slice && !kp[k]) slice_rows(q[k], kt->n, kt->bits, qsl[k]);
                    if (kp[k]) pair_table(q[k], kt->n, kt->bits, kt->cent, nr, ptab[k]);
#endif
                    loaded[k] = j;
                }
                const uint8_t *codes = at(&kt->codes, blk, it->h, slot);
                read_scalars(&kt->norm, at(&kt->norm, blk, it->h, slot), 1, cnt, knorm + off);
#if QJL_HAVE_AMX
                if (ak[k]) score_amx(kt, nr, codes, knorm + off, cnt, ktab64[k], kmul[k], koff[k], logits + off);
                else
#endif
#if QJL_HAVE_VNNI
                if (ik[k]) score_vnni(kt, nr, codes, knorm + off, cnt, q8[k], ktab[k], kmul[k], koff[k], logits + off);
                else
#endif
#if QJL_HAVE_AVX2
                if (kp[k]) score_pairs(kt, nr, codes, knorm + off, cnt, ptab[k], logits + off);
                else if (ks[k]) score_sliced(kt, nr, codes, knorm + off, cnt, qsl[k], logits + off);
                else if (mode) score_avx2(kt, nr, codes, knorm + off, cnt, q[k], logits + off);
                else
#endif
                    score_portable(kt, nr, codes, knorm + off, cnt, q[k], logits + off, buf);
            }
        }
        if (a->bias) {
            const float *br = a->bias + it->b * a->bias_stride + t;
            for (int r = 0; r < nr; r++)
                for (int64_t i = 0; i < len; i++) logits[r * SUB + i] += br[i];
        }
        for (int si = 0; si < ns; si++) {
            read_scalars(&v->scale, at(&v->scale, sp_blk[si], it->h, sp_slot[si]), G, sp_cnt[si], vscale + sp_off[si]);
            if (v->has_zero)
                read_scalars(&v->zero, at(&v->zero, sp_blk[si], it->h, sp_slot[si]), G, sp_cnt[si], vzero + sp_off[si]);
        }
        for (int r = 0; r < nr; r++) { /* online softmax */
            float *x = logits + r * SUB;
            const float mx = max_run(x, len, m[r]);
            if (mx > m[r] && m[r] != -INFINITY) { /* rescale what was accumulated so far */
                const float w = expf(m[r] - mx);
                l[r] *= w;
                for (int64_t k = 0; k < K; k++) {
                    float *ok = acc + (k * RW + r) * nv, *zk = zsum + (k * RW + r) * G;
                    for (int64_t c = 0; c < nv; c++) ok[c] *= w;
                    for (int64_t g = 0; g < G; g++) zk[g] *= w;
                }
            }
            m[r] = mx;
#if QJL_HAVE_VNNI
            if (fused) { /* p, its sum, the weights p * scale and their max in one pass (the same numbers) */
                l[r] += exp_weights(x, len, mx == -INFINITY ? 0.0f : mx, vscale, pw + r * SUB, &pmax[r]);
                continue;
            }
#endif
            l[r] += exp_sum(x, len, mx == -INFINITY ? 0.0f : mx); /* masked logits give p = 0 */
        }
        /* K > 1: the pass by residue; its codes copied where its spans are shorter than 32 tokens per residue on
         * average (blocks of 16 or 128 slots with K = 8: a mix call per span and residue would read a token or two).
         * First the pass's value codes are prefetched, every line of every span: a residue reads one row in K (K
         * token strides apart), which the hardware prefetchers do not follow, and each of the first residues would
         * wait on its lines from L2 / L3 (scalar 2-bit values over 8 rotations with 3-bit keys, d = 128, 64k tokens:
         * 8.59 -> 7.07 ms on one thread, 4.28 -> 3.59 ms on two, contiguous; 11.7 -> 9.8 ms in blocks of 16;
         * "c-int", interleaved calls, 2026-11-29's Zen 5; vector-codebook values, whose fp32 mix is slower, and the
         * fp32 path did not move). */
        if (K > 1)
            for (int si = 0; si < ns; si++) prefetch_run(cur->v[si], cur->cnt[si] * v->codes.stride_token, 1);
        const int copied = K > 1 && len < 32 * K * ns;
        if (K > 1)
            by_residue(cur, t, K, v->codes.stride_token, nr, G, logits, vscale, vzero, copied ? rows : NULL, row_bytes,
                       &rz, cp, cs, cz);
        for (int64_t k = 0; k < K; k++) { /* the pass's values: all (K = 1), or each residue's into its accumulator */
            const qjl_value_view *vk = v;
            const qjl_spans *sp = cur;
            const float *pp = logits, *ps = vscale, *pz = vzero;
            int64_t n_k = len;
            float *ok = acc + k * RW * nv, *zk = zsum + k * RW * G;
            if (K > 1) { /* residue k as a pass of its own (by_residue, above the loop) */
                n_k = rz.count[k];
                if (n_k == 0) continue;
                const int64_t b0 = rz.base[k];
                if (copied)
                    res->n = 1, res->len = n_k, res->off[0] = 0, res->cnt[0] = n_k, res->v[0] = rows + b0 * row_bytes;
                else
                    residue_spans(cur, t, K, k, v->codes.stride_token, &rz, res);
                vk = copied ? &vrow : &vcyc, sp = res, pp = cp + b0, ps = cs + b0, pz = cz ? cz + b0 : NULL;
            }
            const int nk = sp->n;
            const int64_t *k_off = sp->off, *k_cnt = sp->cnt;
            const uint8_t *const *k_v = sp->v;
#if QJL_HAVE_AMX
            if (av) { /* (K = 1) */
                if (fused)
                    for (int r = 0; r < nr; r++)
                        vmul[r] = amx_bytes_row(pw + r * SUB, n_k, pmax[r], vsc, wb + r * SUB, wb + (RW + r) * SUB);
                else {
                    value_weights(vk, nr, ps, pz, n_k, pp, pw, zk);
                    int16_weights(G, nr, n_k, pw, vsc, w16, vmul);
                    amx_weight_bytes(G, nr, n_k, w16, wb);
                }
                for (int si = 0; si < nk; si++) /* the pass's value rows; past len (to 64) the last one, weight zero */
                    for (int64_t i = 0; i < k_cnt[si]; i++) vrows[k_off[si] + i] = k_v[si] + i * vk->codes.stride_token;
                for (int64_t i = n_k; i < (n_k + 63) / 64 * 64; i++) vrows[i] = vrows[n_k - 1];
                amx_configure(&AMX_VALUES), amx_used = 1;
                mix_amx(vk, nr, n_k, vrows, wb, vtab64, vmul, ok);
            } else
#endif
#if QJL_HAVE_VNNI
            if (iv) {
                if (fused) /* (K = 1) */
                    for (int r = 0; r < nr; r++)
                        vmul[r] = int16_row(pw + r * SUB, n_k, pmax[r], vsc, w16 + r * (SUB + 2));
                else {
                    value_weights(vk, nr, ps, pz, n_k, pp, pw, zk);
                    int16_weights(G, nr, n_k, pw, vsc, w16, vmul);
                }
                mix_vnni(vk, nr, nk, k_v, k_off, k_cnt, w16, vtab, vmul, ok);
            } else
#endif
#if QJL_HAVE_AVX2
            if (mode) {
                value_weights(vk, nr, ps, pz, n_k, pp, pw, zk);
                for (int si = 0; si < nk; si++)
                    if (vs) mix_sliced(vk, nr, k_v[si], k_cnt[si], pw + k_off[si], ok);
                    else mix_avx2(vk, nr, k_v[si], k_cnt[si], pw + k_off[si], ok);
            } else
#endif
                for (int si = 0; si < nk; si++)
                    mix_portable(vk, nr, k_v[si], ps + k_off[si], pz ? pz + k_off[si] : NULL, k_cnt[si],
                                 pp + k_off[si], ok, zk, buf);
        }
    }
    free(cur), free(nxt);
#if QJL_HAVE_AVX2
    for (int64_t k = 0; k < K && vs; k++) unslice_rows(acc + k * RW * nv, nv, v->bits, buf);
    for (int k = 0; k < a->n_terms; k++) free(qsl[k]), free(ptab[k]);
#endif
    if (v->has_zero)
        for (int64_t kr = 0; kr < K * RW; kr++) /* (accumulator k, row r) */
            for (int64_t c = 0; c < nv; c++) acc[kr * nv + c] += zsum[kr * G + c / v->group_size];
    if (K > 1) { /* [K][RW][n_v] -> o [RW][K n_v] */
        for (int r = 0; r < RW; r++)
            for (int64_t k = 0; k < K; k++)
                memcpy(o + (r * K + k) * nv, acc + (k * RW + r) * nv, sizeof(float) * (size_t)nv);
        free(acc), free(res), free(cp), free(cs), free(cz), free(rows);
    }
    for (int k = 0; k < a->n_terms; k++) free(q[k]);
#if QJL_HAVE_VNNI
    for (int k = 0; k < a->n_terms; k++) free(q8[k]);
    free(w16), free(vmul);
#endif
#if QJL_HAVE_AMX
    if (amx_used) amx_release();
    for (int k = 0; k < a->n_terms; k++) free(qv[k]);
    free(wb), free(vrows);
#endif
    free(logits), free(pw), free(zsum), free(buf), free(knorm), free(vscale), free(vzero);
}

/* the exact tokens of (b, h) as float32 rows: keys xk [ne][dx], values xv [ne][dx] (the segments joined) */
static void exact_rows(const qjl_decode_args *a, int64_t b, int64_t h, float *xk, float *xv) {
    int64_t j = 0;
    for (int sg = 0; sg < a->n_xseg; sg++) {
        const qjl_exact_seg *e = &a->xseg[sg];
        const uint8_t *k = e->k + h * e->k_sh, *v = e->v + h * e->v_sh;
        for (int64_t i = 0; i < e->n; i++, j++) {
            const int64_t ko = e->k_off ? e->k_off[b * e->n + i] : b * e->k_sb + i * e->k_st;
            const int64_t vo = e->v_off ? e->v_off[b * e->n + i] : b * e->v_sb + i * e->v_st;
            read_row(k + ko, e->dtype, a->dx, xk + j * a->dx);
            read_row(v + vo, e->dtype, a->dx, xv + j * a->dx);
        }
    }
}

/* the exact tokens of (b, h, row chunk) merged into its partial (m, l, o [RW][K n_v]); their values into ox [RW][dx]:
 * s[r][j] = <qx[r], xk[j]> + xbias[r][j]; m' = max(m, max_j s); o *= exp(m - m'); ox[r] = sum_j exp(s - m') xv[j];
 * l' = l exp(m - m') + sum_j exp(s - m').  xk, xv: [ne][dx] float32 (exact_rows) */
static void merge_exact(const qjl_decode_args *a, int64_t b, int64_t h, int64_t rc, const float *xk, const float *xv,
                        float *m, float *l, float *o, float *ox, float *s) {
    const int64_t ne = a->ne, dx = a->dx, nv = a->value.cycles * a->value.n, bh = b * a->heads + h;
    for (int r = 0; r < RW; r++) {
        const int64_t row = rc * RW + r;
        memset(ox + r * dx, 0, sizeof(float) * (size_t)dx);
        if (row >= a->rows) continue;
        const float *qr = a->qx + (bh * a->rows + row) * dx;
        const float *xb = a->xbias ? a->xbias + b * a->xbias_sb + h * a->xbias_sh + row * a->xbias_sr : NULL;
        float mx = m[r];
        for (int64_t j = 0; j < ne; j++) {
            s[j] = dot_f(qr, xk + j * dx, dx) + (xb ? xb[j] : 0.0f);
            mx = s[j] > mx ? s[j] : mx;
        }
        if (mx == -INFINITY) continue; /* nothing visible to this row: l = 0, o = ox = 0 */
        const float wc = m[r] == -INFINITY ? 0.0f : expf(m[r] - mx);
        const float tot = exp_sum(s, ne, mx);
        for (int64_t c = 0; c < nv; c++) o[r * nv + c] *= wc;
        float *dst = ox + r * dx;
        for (int64_t j = 0; j < ne; j++) {
            const float p = s[j];
            if (p == 0.0f) continue;
            const float *src = xv + j * dx;
            for (int64_t c = 0; c < dx; c++) dst[c] += p * src[c];
        }
        l[r] = l[r] * wc + tot;
        m[r] = mx;
    }
}

static int check_args(const qjl_decode_args *a) {
    if (a->n_terms < 1 || a->n_terms > 2 || a->rows < 1 || a->block_size < 1 || a->heads < 1) return -1;
    for (int k = 0; k < a->n_terms; k++) {
        const qjl_key_term *t = &a->key[k];
        if (t->bits < 1 || t->bits > 8 || t->n < 8 || t->n % 8 || t->norm.dtype < 0 || t->norm.dtype > 3 ||
            !group_ok(t->bits, t->group))
            return -1;
    }
    const qjl_value_view *v = &a->value;
    if (v->bits < 1 || v->bits > 8 || v->n < 8 || v->n % 8 || v->group_size < 8 || v->group_size % 8 ||
        !group_ok(v->bits, v->group))
        return -1;
    if (v->groups != (v->n + v->group_size - 1) / v->group_size) return -1;
    if (v->out_dim < 1 || (!v->unmix && v->out_dim != v->n) || (a->ne > 0 && a->dx != v->out_dim)) return -1;
    if (v->cycles < 1 || v->cycles > 64 || (v->cycles > 1 && !v->unmix)) return -1; /* (K accumulators: an unmix) */
    if (a->ne < 0 || a->n_xseg < 0 || a->n_xseg > 2) return -1;
    int64_t nx = 0;
    for (int sg = 0; sg < a->n_xseg; sg++) {
        const qjl_exact_seg *e = &a->xseg[sg];
        if (e->dtype < 0 || e->dtype > 2 || e->n < 0 || (!e->k_off) != (!e->v_off)) return -1;
        nx += e->n;
        if (!e->k_off) continue;
        /* rows read in place through offsets: every row of every head inside its buffer */
        const int64_t row = a->dx * dtype_bytes(e->dtype);
        if (e->k_sh < 0 || e->v_sh < 0) return -1;
        for (int64_t i = 0; i < a->batch * e->n; i++)
            if (e->k_off[i] < 0 || e->v_off[i] < 0 || e->k_off[i] + (a->heads - 1) * e->k_sh + row > e->k_room ||
                e->v_off[i] + (a->heads - 1) * e->v_sh + row > e->v_room)
                return -1;
    }
    if (nx != a->ne) return -1;
    for (int k = 0; k < a->n_terms; k++)
        if (a->key[k].qmap && (a->key[k].qdim < 1 || a->key[k].q_per_block)) return -1;
    if (v->scale.dtype < 0 || v->scale.dtype > 3 || (v->has_zero && (v->zero.dtype < 0 || v->zero.dtype > 3))) return -1;
    return 0;
}

/* float -> bf16 / fp16 bits as torch's .to() on CPU tensors rounds them (nearest even; NaN: bf16 0xffff, as its
 * vectorized conversion writes every NaN, fp16 sign | 0x7e00) */
static inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0xffff;
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
static inline uint16_t float_to_half(float f) { /* fp16_ieee_from_fp32_value's arithmetic (no F16C needed) */
    uint32_t w, shl1, sign, bias;
    memcpy(&w, &f, 4);
    shl1 = w + w;
    sign = w & 0x80000000u;
    bias = shl1 & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    float base = fabsf(f) * 0x1.0p+112f * 0x1.0p-110f, t;
    const uint32_t bb = (bias >> 1) + 0x07800000u;
    memcpy(&t, &bb, 4);
    base = t + base;
    uint32_t bits;
    memcpy(&bits, &base, 4);
    const uint32_t exp_bits = (bits >> 13) & 0x00007c00u, man_bits = bits & 0x00000fffu;
    const uint32_t nonsign = exp_bits + man_bits;
    return (uint16_t)((sign >> 16) | (shl1 > 0xff000000u ? 0x7e00u : nonsign));
}
static void store_half_row(const float *y, int64_t n, int dtype, uint8_t *dst) {
    for (int64_t c = 0; c < n; c++) {
        const uint16_t h = dtype == 2 ? float_to_bf16(y[c]) : float_to_half(y[c]);
        memcpy(dst + 2 * c, &h, 2);
    }
}

/* x [n] rounded into fp16 (dtype 1) or bf16 (dtype 2) as the kernel writes an out_raw row (the tests compare it
 * with torch's .to()); -1 for another dtype */
QJL_EXPORT int qjl_half_rounding(const float *x, int64_t n, int32_t dtype, uint8_t *out) {
    if (dtype < 1 || dtype > 2 || n < 0) return -1;
    store_half_row(x, n, dtype, out);
    return 0;
}

typedef struct {
    const qjl_decode_args *a;
    int mode; /* run_item's */
    const qjl_item *list;
    const int64_t *first, *unit_of; /* items of unit u: [first[u], first[u + 1]); the unit of item i */
    int64_t *left;                  /* items of each unit not finished yet */
    float *pm, *pl, *po;            /* partials of every item: [items][RW], [items][RW][K n_v] */
} qjl_job;

/* y [RW][od] = o [RW][nk] @ U [nk, od]: 16 columns at a time, the RW rows' sums in registers over U's rows, so U is
 * read once per unit (with K cycles it is K rotations' size: read per row it cost 5-10% of a K = 8 call); each
 * element the products o[r][k] U[k][c] added in k's order (rows past the live ones are zero in o) */
static void unmix_rows(const float *o, int64_t nk, const float *U, int64_t od, float *y) {
    int64_t c0 = 0;
    for (; c0 + 16 <= od; c0 += 16) {
        v8f acc[2 * RW];
        memset(acc, 0, sizeof acc);
        for (int64_t k = 0; k < nk; k++) {
            const v8f u0 = load8(U + k * od + c0), u1 = load8(U + k * od + c0 + 8);
            for (int r = 0; r < RW; r++) {
                const float w = o[r * nk + k];
                acc[r] += w * u0;
                acc[RW + r] += w * u1;
            }
        }
        for (int r = 0; r < RW; r++) store8(y + r * od + c0, acc[r]), store8(y + r * od + c0 + 8, acc[RW + r]);
    }
    for (; c0 < od; c0++)
        for (int r = 0; r < RW; r++) {
            float sum = 0.0f;
            for (int64_t k = 0; k < nk; k++) sum += o[r * nk + k] * U[k * od + c0];
            y[r * od + c0] = sum;
        }
}

/* the unit (b, h, row chunk) whose items are done: its splits merged, the exact tokens merged in, written out */
static void finish_unit(const qjl_job *j, int64_t u) {
    const qjl_decode_args *a = j->a;
    const int64_t H = a->heads, rchunks = (a->rows + RW - 1) / RW, nv = a->value.cycles * a->value.n; /* K n_v */
    const int64_t f0 = j->first[u], f1 = j->first[u + 1], b = u / (H * rchunks), h = (u / rchunks) % H,
                  rc = u % rchunks;
    float *pm = j->pm, *pl = j->pl, *po = j->po;
    float *m = pm + f0 * RW, *l = pl + f0 * RW, *o = po + f0 * RW * nv;
    for (int r = 0; r < RW && f1 - f0 > 1; r++) { /* merge the splits into the first */
        float mx = -INFINITY;
        for (int64_t i = f0; i < f1; i++) mx = pm[i * RW + r] > mx ? pm[i * RW + r] : mx;
        if (mx == -INFINITY) continue;
        float tot = 0.0f;
        for (int64_t i = f0; i < f1; i++) {
            const float w = pm[i * RW + r] == -INFINITY ? 0.0f : expf(pm[i * RW + r] - mx);
            tot += w * pl[i * RW + r];
            const float *src = po + (i * RW + r) * nv;
            for (int64_t c = 0; c < nv; c++) o[r * nv + c] = i == f0 ? o[r * nv + c] * w : o[r * nv + c] + w * src[c];
        }
        m[r] = mx;
        l[r] = tot;
    }
    float *ox = NULL, *s = NULL;
    if (a->ne > 0) {
        ox = malloc(sizeof(float) * RW * (size_t)a->dx);
        s = malloc(sizeof(float) * (size_t)a->ne);
        float *xk = malloc(sizeof(float) * 2 * (size_t)(a->ne * a->dx)), *xv = xk + a->ne * a->dx;
        exact_rows(a, b, h, xk, xv);
        merge_exact(a, b, h, rc, xk, xv, m, l, o, ox, s);
        free(xk);
    }
    const int64_t od = a->value.out_dim, live = a->rows - rc * RW < RW ? a->rows - rc * RW : RW;
    const float *U = a->value.unmix;
    float *yrow = a->out ? NULL : malloc(sizeof(float) * (size_t)od); /* a row before out_raw's conversion */
    float *yu = NULL; /* [RW][od]: o @ U (unmix_rows) */
    if ((a->out || a->out_raw) && U) {
        yu = malloc(sizeof(float) * RW * (size_t)od);
        unmix_rows(o, nv, U, od, yu);
    }
    for (int r = 0; r < live; r++) {
        const int64_t row = rc * RW + r, dst = (b * H + h) * a->rows + row;
        if (a->out_m) a->out_m[dst] = m[r];
        if (a->out_l) a->out_l[dst] = l[r];
        if (a->out_o) memcpy(a->out_o + dst * nv, o + r * nv, sizeof(float) * (size_t)nv);
        if (ox && a->out_ox) memcpy(a->out_ox + dst * a->dx, ox + r * a->dx, sizeof(float) * (size_t)a->dx);
        if (a->out || a->out_raw) { /* (unmix(o) + ox) / l (unmix [K n_v, out_dim]); a row that saw nothing: 0 / 0 */
            float *y = a->out ? a->out + dst * od : yrow;
            memcpy(y, U ? yu + r * od : o + r * nv, sizeof(float) * (size_t)od);
            if (ox)
                for (int64_t c = 0; c < od; c++) y[c] += ox[r * a->dx + c];
            const float inv = 1.0f / l[r];
            for (int64_t c = 0; c < od; c++) y[c] = l[r] == 0.0f ? y[c] / l[r] : y[c] * inv;
            if (!a->out) store_half_row(y, od, a->out_dtype, a->out_raw + dst * od * 2);
        }
    }
    free(ox), free(s), free(yrow), free(yu);
}

/* one item; the thread finishing a unit's last item finishes the unit (no barrier between the phases) */
static void do_item(void *ctx, int64_t i) {
    const qjl_job *j = ctx;
    const int64_t nv = j->a->value.cycles * j->a->value.n;
    run_item(j->a, j->mode, &j->list[i], j->pm + i * RW, j->pl + i * RW, j->po + i * RW * nv);
    const int64_t u = j->unit_of[i];
    if (__atomic_sub_fetch(&j->left[u], 1, __ATOMIC_ACQ_REL) == 0) finish_unit(j, u);
}

/* The ranges and every block the items will read, before any is read: 0, or -2 a range out of order (start < 0
 * or end < start), -3 a range past the block table, -4 a negative block, -5 a block past max_block. */
static int check_ranges(const qjl_decode_args *a) {
    for (int64_t b = 0; b < a->batch; b++) {
        const int64_t s = a->code_start[b], e = a->code_end[b];
        if (s < 0 || e < s) return -2;
        if (e > a->max_blocks * a->block_size) return -3;
        for (int64_t j = e > s ? s / a->block_size : 0; e > s && j <= (e - 1) / a->block_size; j++) {
            const int64_t blk = a->block_table[b * a->max_blocks + j];
            if (blk < 0) return -4;
            if (blk > a->max_block) return -5;
        }
    }
    return 0;
}

/* Returns 0, -1 for arguments outside what the kernel reads (the launcher checks them first), or
 * check_ranges' code (nothing read). */
static int decode_checked(const qjl_decode_args *a);

/* the query given raw (q_raw): converted and scaled once into a float buffer every key term and qx then read */
QJL_EXPORT int qjl_paged_decode(const qjl_decode_args *a) {
    if (!a->q_raw) return decode_checked(a);
    if (a->q_dtype < 0 || a->q_dtype > 2 || a->n_terms < 1 || a->n_terms > 2 || a->batch < 0 || a->heads < 1 ||
        a->rows < 1)
        return -1;
    const int64_t qd = a->key[0].qdim;
    for (int k = 0; k < a->n_terms; k++)
        if (!a->key[k].qmap || a->key[k].qdim != qd || qd < 1) return -1;
    if (a->ne > 0 && a->dx != qd) return -1;
    const int64_t n = a->batch * a->heads * a->rows * qd;
    float *qb = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    read_row(a->q_raw, a->q_dtype, n, qb);
    for (int64_t i = 0; i < n; i++) qb[i] *= a->q_scale;
    qjl_decode_args local = *a;
    for (int k = 0; k < local.n_terms; k++) local.key[k].q = qb;
    local.qx = qb;
    local.q_raw = NULL;
    const int rc = decode_checked(&local);
    free(qb);
    return rc;
}

/* The work of one call: checked arguments, the kernel path, the items and their partials' buffers.  `units_all`:
 * the units of every call that shares the parallel region (the split heuristic's count; this call's alone when it
 * runs by itself).  Returns 0 (job filled: free_job frees it) or decode_checked's status (nothing allocated). */
static int plan_job(const qjl_decode_args *a, int64_t units_all, qjl_job *job, int64_t *n_items) {
    if (check_args(a)) return -1;
    if (a->out_raw && (a->out_dtype < 1 || a->out_dtype > 2)) return -1;
    const int bad = check_ranges(a);
    if (bad) return bad;
    const int avx2 = a->simd && QJL_HAVE_AVX2 && cpu_has_avx2();
    const int vnni = a->simd >= 2 && avx2 && QJL_HAVE_VNNI && cpu_has_vnni();
    const int mode = vnni && a->simd == 3 && QJL_HAVE_AMX && amx_ready() ? 3 : vnni ? 2 : avx2;
    const int64_t B = a->batch, H = a->heads, rchunks = (a->rows + RW - 1) / RW, nv = a->value.cycles * a->value.n;
    const int64_t units = B * H * rchunks, all = units_all > units ? units_all : units;
    const int threads = a->threads > 0 ? a->threads : 1;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = a->code_end[b] - a->code_start[b];
        max_len = len > max_len ? len : max_len;
    }
    int64_t split = a->split_tokens;
    if (split <= 0) { /* split sequences only as far as needed to give every thread ~2 items: with fewer units than
                         4 per thread, a multiple of the threads (equal items finish together; 6 items for 3 KV
                         heads on 2 threads took 148 us at 8k tokens where 9 took 160, and 48 took 200: each item
                         prepares its query rows again) */
        int64_t per = (2 * threads + all - 1) / all;
        if (all < 4 * threads)
            while ((all * per) % threads) per++;
        split = (max_len + per - 1) / (per > 0 ? per : 1);
        split = split < 256 ? 256 : split;
    }
    int64_t items = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = a->code_end[b] - a->code_start[b];
        items += (len > 0 ? (len + split - 1) / split : 1) * H * rchunks;
    }
    qjl_item *list = malloc(sizeof(qjl_item) * (size_t)items);
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(units + 1)), *left = malloc(sizeof(int64_t) * (size_t)units);
    int64_t *unit_of = malloc(sizeof(int64_t) * (size_t)items);
    int64_t at_item = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t s0 = a->code_start[b], s1 = a->code_end[b] > s0 ? a->code_end[b] : s0;
        const int64_t ns = s1 > s0 ? (s1 - s0 + split - 1) / split : 1;
        for (int64_t h = 0; h < H; h++)
            for (int64_t rc = 0; rc < rchunks; rc++) {
                const int64_t u = (b * H + h) * rchunks + rc;
                first[u] = at_item;
                left[u] = ns;
                for (int64_t s = 0; s < ns; s++) {
                    const int64_t t0 = s0 + s * split, t1 = t0 + split < s1 ? t0 + split : s1;
                    unit_of[at_item] = u;
                    list[at_item++] = (qjl_item){b, h, rc, t0, t1};
                }
            }
    }
    first[units] = at_item;
    *job = (qjl_job){a, mode, list, first, unit_of, left, malloc(sizeof(float) * RW * (size_t)items),
                     malloc(sizeof(float) * RW * (size_t)items), malloc(sizeof(float) * RW * (size_t)(items * nv))};
    *n_items = items;
    return 0;
}

static void free_job(qjl_job *j) {
    free((void *)j->list), free((void *)j->first), free(j->left), free((void *)j->unit_of), free(j->pm),
        free(j->pl), free(j->po);
}

static int decode_checked(const qjl_decode_args *a) {
    qjl_job job;
    int64_t items = 0;
    const int rc = plan_job(a, 0, &job, &items);
    if (rc) return rc;
    parallel_for(items, a->threads > 0 ? a->threads : 1, do_item, &job);
    free_job(&job);
    return 0;
}

typedef struct { /* several calls' items in one parallel region: call k's items at [start[k], start[k + 1]) */
    qjl_job *jobs;
    const int64_t *start;
    int32_t n;
} qjl_jobs;

static void do_any_item(void *ctx, int64_t i) {
    const qjl_jobs *m = ctx;
    int32_t k = 0;
    while (k + 1 < m->n && i >= m->start[k + 1]) k++;
    do_item(&m->jobs[k], i - m->start[k]);
}

/* One decode step of a layer whose KV heads are coded in runs of their own codecs (qjl.cache.storage.HeadGroupView;
 * launch.DecodeHeads): the n runs' decodes in one parallel region, each run's value mean added to its rows and
 * every row written into one output.  args[k]: run k's filled arguments (codes, codecs, ranges: launch.DecodeCall's
 * struct; its heads the run's, its query, exact segments and outputs ignored) over KV heads [head0[k], head0[k] +
 * args[k]->heads) of the layer's heads_total; the layer's query q_raw [B, heads_total, R, qdim] dense in q_dtype
 * (times q_scale); its exact segments xseg[0 .. n_xseg) over all heads (ne tokens; stride-addressed: no offsets);
 * mean NULL or [B, heads_total, D] float32 contiguous; out [B, heads_total, R, D] dense in out_dtype (0 fp32, 1
 * fp16, 2 bf16).  Each run's rows are what qjl_decode_mean (or qjl_paged_decode) of that run alone writes, the
 * runs' items split as if they were one call's (with one pair of codecs for every run: that call's outputs bit for
 * bit).  Returns 0, or the first failing run's status (failed[0] = k; nothing written). */
QJL_EXPORT int qjl_decode_heads(const qjl_decode_args *const *args, int32_t n, const int64_t *head0,
                                int64_t heads_total, const qjl_exact_seg *xseg, int32_t n_xseg, int64_t ne,
                                const uint8_t *q_raw, int32_t q_dtype, float q_scale, const float *mean,
                                uint8_t *out, int32_t out_dtype, int32_t threads, int32_t simd, int32_t *failed) {
    failed[0] = 0;
    if (n < 1 || n > 4096 || heads_total < 1 || !q_raw || q_dtype < 0 || q_dtype > 2 || !out || out_dtype < 0 ||
        out_dtype > 2 || n_xseg < 0 || n_xseg > 2 || ne < 0)
        return -1;
    for (int32_t s = 0; s < n_xseg; s++)
        if (xseg[s].k_off || xseg[s].v_off) return -1;
    const int64_t B = args[0]->batch, R = args[0]->rows, D = args[0]->value.out_dim;
    int64_t covered = 0, units = 0;
    for (int32_t k = 0; k < n; k++) { /* runs in order, tiling the heads; one query and output geometry */
        const qjl_decode_args *a = args[k];
        if (head0[k] != covered || a->batch != B || a->rows != R || a->value.out_dim != D || a->n_terms < 1 ||
            a->n_terms > 2 || a->key[0].qdim != D || !a->key[0].qmap || (a->n_terms == 2 && a->key[1].qdim != D) ||
            (a->n_terms == 2 && !a->key[1].qmap) || a->heads < 1) {
            failed[0] = k;
            return -1;
        }
        covered += a->heads;
        units += B * a->heads * ((R + RW - 1) / RW);
    }
    if (covered != heads_total || D < 1 || D > 4096) return -1;
    const int64_t qs = dtype_bytes(q_dtype), os = dtype_bytes(out_dtype);
    qjl_decode_args *local = malloc(sizeof(qjl_decode_args) * (size_t)n);
    qjl_job *jobs = malloc(sizeof(qjl_job) * (size_t)n);
    int64_t *start = malloc(sizeof(int64_t) * (size_t)(n + 1));
    float *qb = malloc(sizeof(float) * (size_t)(B * heads_total * R * D + 1)); /* runs' queries, run after run */
    float *ob = malloc(sizeof(float) * (size_t)(B * heads_total * R * D + 1)); /* their float32 outputs */
    int rc = 0;
    int32_t planned = 0;
    start[0] = 0;
    for (int32_t k = 0; k < n && !rc; k++) {
        qjl_decode_args *a = &local[k];
        *a = *args[k];
        const int64_t H = a->heads, off = B * head0[k] * R * D; /* run k's [B, H, R, D] block of qb / ob */
        for (int64_t b = 0; b < B; b++) { /* (the query converted and scaled as qjl_paged_decode does) */
            const int64_t row = (b * heads_total + head0[k]) * R * D;
            float *dst = qb + off + b * H * R * D;
            read_row(q_raw + row * qs, q_dtype, H * R * D, dst);
            for (int64_t i = 0; i < H * R * D; i++) dst[i] *= q_scale;
        }
        for (int t = 0; t < a->n_terms; t++) a->key[t].q = qb + off;
        a->qx = qb + off;
        a->q_raw = NULL;
        a->n_xseg = n_xseg;
        a->ne = ne;
        a->dx = D;
        for (int32_t s = 0; s < n_xseg; s++) { /* the run's heads of every segment */
            a->xseg[s] = xseg[s];
            a->xseg[s].k += head0[k] * xseg[s].k_sh;
            a->xseg[s].v += head0[k] * xseg[s].v_sh;
        }
        a->xbias = NULL;
        a->out = ob + off;
        a->out_raw = NULL;
        a->out_m = a->out_l = a->out_o = a->out_ox = NULL;
        a->threads = threads > 0 ? threads : 1;
        a->simd = simd;
        int64_t items = 0;
        rc = plan_job(a, units, &jobs[k], &items);
        if (rc) failed[0] = k;
        else start[k + 1] = start[k] + items, planned++;
    }
    if (!rc) {
        qjl_jobs all = {jobs, start, n};
        parallel_for(start[n], threads > 0 ? threads : 1, do_any_item, &all);
        float y[D];
        for (int32_t k = 0; k < n; k++) { /* o + mean in float32 (as torch's add), then out's dtype (as .to()) */
            const int64_t H = local[k].heads;
            for (int64_t b = 0; b < B; b++)
                for (int64_t h = 0; h < H; h++) {
                    const int64_t hh = head0[k] + h;
                    const float *mu = mean ? mean + (b * heads_total + hh) * D : NULL;
                    for (int64_t r = 0; r < R; r++) {
                        const float *o = local[k].out + ((b * H + h) * R + r) * D;
                        for (int64_t c = 0; c < D; c++) y[c] = mu ? o[c] + mu[c] : o[c];
                        uint8_t *dst = out + ((b * heads_total + hh) * R + r) * D * os;
                        if (out_dtype == 0) memcpy(dst, y, sizeof(float) * (size_t)D);
                        else store_half_row(y, D, out_dtype, dst);
                    }
                }
        }
    }
    for (int32_t k = 0; k < planned; k++) free_job(&jobs[k]);
    free(local), free(jobs), free(start), free(qb), free(ob);
    return rc;
}
