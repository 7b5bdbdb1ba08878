/* Fast scan: 4-bit groups looked up in 8-bit tables held in registers, several queries per pass
 * over the codes, an exact re-scoring of a shortlist (qjl.search.fastscan; its torch reference is
 * fastscan_torch, of the same contract).
 *
 * Codes.  Vector i has nc coordinates with a `bits`-bit code idx_ij each, split into a scan plane
 * h_ij = idx_ij >> rbits (sbits bits) and a refine plane l_ij = idx_ij & (2^rbits - 1).  Each plane
 * is a bit stream (LSB first) cut into nibbles: Gs scan nibbles then Gr refine nibbles, G = Gs + Gr,
 * both even.  Vectors are stored in blocks of 32: block b holds G x 16 bytes; for nibble g, byte
 * t = nibble g of vector 32b + t (low half) | nibble g of vector 32b + 16 + t (high half).
 *
 * Estimate.  With y [nq, nc] the query's coordinates (rotated / projected) and c [2^bits] the
 * centroids, vector i scores   exact_i = f_i * sum_j y_j c[idx_ij] + add_i + bias[q, r]
 * (r: the range holding i).  The scan ranks by the scan plane alone, with cs [2^sbits] the
 * centroids of the scan cells:  lutf[g][v] = sum over the nibble's coordinates (highest first) of
 * y_j cs[digit_j(v)]; lut8 = round((lutf - min_g) / delta), delta = max(lutf - min_g) / 255, beta =
 * sum_g min_g, and approx_i = f_i (delta S_i + beta) + add_i + bias with S_i the integer sum of lut8.
 * The `shortlist` best approx (ties: lower index) are re-scored exactly, the k best returned.
 *
 * Kernel.  Per pass, up to FS_NQ queries share each load of 32 vectors' nibbles (faiss's
 * query-batched fast scan); vpshufb looks up 16 vectors' nibbles at once (the low nibbles, then the
 * high ones: 2 accumulators per query, no register spills); sums stay in 16-bit lanes for up to 256
 * nibbles, then are folded into 32 bits.  A block of 32 is skipped for a query when an upper bound
 * of its approx (its largest S with the block's largest / smallest factor and largest add term,
 * float rounding being monotone) is below the shortlist's threshold; otherwise its vectors are
 * compared 8 at a time.  The shortlist is a reservoir (faiss's reservoir handler): candidates better
 * than the threshold are appended; when it holds 4 x shortlist, a quickselect keeps the best
 * shortlist and raises the threshold to the worst of them (no per-candidate heap operations).
 * Threads split the queries into batches and, when there are fewer batches than threads, the vectors
 * into slices whose shortlists are merged.  Without AVX2 a scalar loop computes the same integer sums.
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifndef QJL_EXPORT
#define QJL_EXPORT
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define FS_NQ 4 /* queries per pass: 8 accumulators + 5 working registers (3 and 5 measured slower) */

/* heap_sift (the k-heap's sift-down, worst score at the root) is scan.c's: the search sources are compiled as one
   translation unit, scan.c first (scan.py, _SOURCES). */

/* a min-heap of the k best (score desc, index asc) */
static inline void fs_push(float *hs, int64_t *hi, int k, float s, int64_t i) {
    if (s > hs[0] || (s == hs[0] && i < hi[0])) { hs[0] = s; hi[0] = i; heap_sift(hs, hi, k, 0); }
}

static void fs_sort(float *hs, int64_t *hi, int k) {
    for (int end = k - 1; end > 0; end--) {
        float ts = hs[0]; hs[0] = hs[end]; hs[end] = ts;
        int64_t ti = hi[0]; hi[0] = hi[end]; hi[end] = ti;
        heap_sift(hs, hi, end, 0);
    }
}

/* (s, i) ranks before (ts, ti): higher score, ties to the lower index */
static inline int fs_better(float s, int64_t i, float ts, int64_t ti) { return (s > ts) | ((s == ts) & (i < ti)); }

/* quickselect: afterwards [0, m) hold the m best of [0, n) (any order), 0 < m < n.  Lomuto partitions
 * around the median of three, written without branches on the data (the comparisons are unpredictable) */
static void fs_select(float *s, int64_t *ix, int64_t n, int64_t m) {
    int64_t l = 0, r = n - 1;
    while (r > l) {
        int64_t a = l, p = l + (r - l) / 2, c = r, t;  /* the median of three by the ranking, moved to r */
        if (fs_better(s[p], ix[p], s[a], ix[a])) { t = a; a = p; p = t; }
        if (fs_better(s[c], ix[c], s[p], ix[p])) { t = p; p = c; c = t; if (fs_better(s[p], ix[p], s[a], ix[a])) p = a; }
        float ps = s[p];
        int64_t pi = ix[p];
        s[p] = s[r]; ix[p] = ix[r]; s[r] = ps; ix[r] = pi;
        int64_t st = l;
        for (int64_t j = l; j < r; j++) {
            float u = s[st], v = s[j];
            int64_t ui = ix[st], vi = ix[j];
            int64_t b = fs_better(v, vi, ps, pi);
            s[j] = b ? u : v; ix[j] = b ? ui : vi;  /* swap j into the better part when it ranks before the pivot */
            s[st] = b ? v : u; ix[st] = b ? vi : ui;
            st += b;
        }
        s[r] = s[st]; ix[r] = ix[st]; s[st] = ps; ix[st] = pi;  /* the pivot at its rank st */
        if (st == m - 1 || st == m) return;  /* [0, m) are the m best */
        if (st > m) r = st - 1; else l = st + 1;
    }
}

/* a shortlist: every candidate better than (ts, ti), the worst of the sl kept at the last compaction */
typedef struct {
    float *s;
    int64_t *i;
    int n, sl, cap;
    float ts;
    int64_t ti;
} fs_res;

static void fs_res_init(fs_res *r, float *s, int64_t *i, int sl, int cap) {
    r->s = s; r->i = i; r->n = 0; r->sl = sl; r->cap = cap; r->ts = -INFINITY; r->ti = -1;
}

/* keep the sl best; the threshold becomes the worst of them */
static void fs_res_compact(fs_res *r) {
    if (r->n < r->sl) return;
    if (r->n > r->sl) fs_select(r->s, r->i, r->n, r->sl);
    r->n = r->sl;
    int w = 0;
    for (int j = 1; j < r->n; j++) if (fs_better(r->s[w], r->i[w], r->s[j], r->i[j])) w = j;
    r->ts = r->s[w]; r->ti = r->i[w];
}

static inline void fs_res_push(fs_res *r, float s, int64_t i) {
    if (!fs_better(s, i, r->ts, r->ti)) return;
    r->s[r->n] = s; r->i[r->n] = i;
    if (++r->n == r->cap) fs_res_compact(r);
}

/* lutf [Gs][16] of one query (the float32 operations of fastscan.nibble_tables) */
static void fs_lutf(const float *y, int nc, int sbits, const float *cs, int Gs, float *lutf) {
    int per = 4 / sbits, mask = (1 << sbits) - 1;
    for (int g = 0; g < Gs; g++)
        for (int v = 0; v < 16; v++) {
            float acc = 0.f;
            for (int t = per - 1; t >= 0; t--) {
                int j = g * per + t;
                float term = j < nc ? y[j] * cs[(v >> (t * sbits)) & mask] : 0.f;
                acc = t == per - 1 ? term : acc + term;
            }
            lutf[g * 16 + v] = acc;
        }
}

/* lut8, delta, beta of one query (the float32 operations of fastscan.quantize_tables; beta summed in
 * double and rounded once, as the reference does) */
static void fs_quantize(const float *lutf, int G, uint8_t *lut8, float *delta, float *beta) {
    float top = 0.f;
    double b = 0.0;
    for (int g = 0; g < G; g++) {
        float m = lutf[g * 16];
        for (int v = 1; v < 16; v++) m = lutf[g * 16 + v] < m ? lutf[g * 16 + v] : m;
        for (int v = 0; v < 16; v++) { float d = lutf[g * 16 + v] - m; top = d > top ? d : top; }
        b += m;
    }
    float d = top / 255.f;
    d = d < 1e-30f ? 1e-30f : d;
    for (int g = 0; g < G; g++) {
        float m = lutf[g * 16];
        for (int v = 1; v < 16; v++) m = lutf[g * 16 + v] < m ? lutf[g * 16 + v] : m;
        for (int v = 0; v < 16; v++) {
            float r = nearbyintf((lutf[g * 16 + v] - m) / d);
            lut8[g * 16 + v] = (uint8_t)(r < 0.f ? 0.f : (r > 255.f ? 255.f : r));
        }
    }
    *delta = d;
    *beta = (float)b;
}

/* integer sums of NQ queries over one block: out[q][32] */
static inline __attribute__((always_inline)) void fs_accum(const uint8_t *blk, int Gs, const uint8_t *const *lut,
                                                            const int NQ, uint32_t out[][32]) {
#ifdef __AVX2__
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {  /* h = 0: the low nibbles (vectors 0-15), 1: the high ones (16-31) */
        __m256i t[FS_NQ][2];
        for (int q = 0; q < NQ; q++) t[q][0] = t[q][1] = _mm256_setzero_si256();
        for (int g0 = 0; g0 < Gs; g0 += 256) {
            int g1 = g0 + 256 < Gs ? g0 + 256 : Gs;
            /* 16-bit lanes over byte results: a lane adds its even byte + 256 * its odd byte, (r >> 8) adds
             * the odd byte; the even bytes' sum is a - 256 b (exact for <= 128 steps: sums <= 255 * 128).
             * Lane 0 of a register holds nibble g, lane 1 nibble g + 1. */
            __m256i a[FS_NQ][2];
            for (int q = 0; q < NQ; q++) a[q][0] = a[q][1] = _mm256_setzero_si256();
            for (int g = g0; g < g1; g += 2) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(blk + (int64_t)g * 16));
                __m256i nb = _mm256_and_si256(h ? _mm256_srli_epi16(x, 4) : x, mask);
                for (int q = 0; q < NQ; q++) {
                    __m256i r = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(lut[q] + (int64_t)g * 16)), nb);
                    a[q][0] = _mm256_add_epi16(a[q][0], r);
                    a[q][1] = _mm256_add_epi16(a[q][1], _mm256_srli_epi16(r, 8));
                }
            }
            for (int q = 0; q < NQ; q++) {
                /* even bytes = vectors 0, 2, .., 14 (+ 16 h), odd bytes 1, 3, ..: fold the two lanes (nibbles g
                 * and g + 1), interleave even / odd back to vector order */
                __m256i e = _mm256_sub_epi16(a[q][0], _mm256_slli_epi16(a[q][1], 8));
                __m128i le = _mm_add_epi16(_mm256_castsi256_si128(e), _mm256_extracti128_si256(e, 1));
                __m128i lo = _mm_add_epi16(_mm256_castsi256_si128(a[q][1]), _mm256_extracti128_si256(a[q][1], 1));
                t[q][0] = _mm256_add_epi32(t[q][0], _mm256_cvtepu16_epi32(_mm_unpacklo_epi16(le, lo)));
                t[q][1] = _mm256_add_epi32(t[q][1], _mm256_cvtepu16_epi32(_mm_unpackhi_epi16(le, lo)));
            }
        }
        for (int q = 0; q < NQ; q++) {
            _mm256_storeu_si256((__m256i *)(out[q] + 16 * h), t[q][0]);
            _mm256_storeu_si256((__m256i *)(out[q] + 16 * h + 8), t[q][1]);
        }
    }
#else
    for (int q = 0; q < NQ; q++) {
        for (int i = 0; i < 32; i++) out[q][i] = 0;
        for (int g = 0; g < Gs; g++) {
            const uint8_t *b = blk + (int64_t)g * 16, *tb = lut[q] + (int64_t)g * 16;
            for (int i = 0; i < 16; i++) { out[q][i] += tb[b[i] & 15]; out[q][16 + i] += tb[b[i] >> 4]; }
        }
    }
#endif
}

typedef struct {
    const uint8_t *blocks;
    int64_t n;
    int G, Gs;
    const float *factors, *add;
    /* per block of 32: the smallest / largest factor and the largest add term; bounded[b]: the block's
     * bound holds (every factor >= 0, every factor and add term finite) */
    const float *flo, *fhi, *ahi;
    const uint8_t *bounded;
} fs_codes;

/* approx = ((f (delta S + beta)) + add) + bias for rows i0..i1-1 of block b, into the shortlist */
static inline void fs_handle(const fs_codes *cx, const uint32_t *sums, int64_t b, int64_t i0, int64_t i1,
                             float dq, float bq, float bias, fs_res *res) {
    const float *f = cx->factors, *add = cx->add;
#ifdef __AVX2__
    if (i0 == b * 32 && i1 == b * 32 + 32) {  /* a whole block */
        const __m256i s0 = _mm256_loadu_si256((const __m256i *)sums), s1 = _mm256_loadu_si256((const __m256i *)(sums + 8));
        const __m256i s2 = _mm256_loadu_si256((const __m256i *)(sums + 16)), s3 = _mm256_loadu_si256((const __m256i *)(sums + 24));
        if (cx->bounded[b] && res->ts > -INFINITY) {  /* an upper bound of the block's approx against the threshold */
            __m256i m = _mm256_max_epu32(_mm256_max_epu32(s0, s1), _mm256_max_epu32(s2, s3));
            __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
            m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4E));
            m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xB1));
            float u = dq * (float)_mm_cvtsi128_si32(m4) + bq;
            float hi = cx->fhi[b] * u, lo = cx->flo[b] * u, ub = hi > lo ? hi : lo;
            if (add) ub = ub + cx->ahi[b];
            ub = ub + bias;
            if (ub + 1e-6f * fabsf(ub) < res->ts) return;  /* margin: against any contraction of the float ops */
        }
        const __m256 vd = _mm256_set1_ps(dq), vb = _mm256_set1_ps(bq), vbias = _mm256_set1_ps(bias);
        const __m256i sv[4] = {s0, s1, s2, s3};
        for (int j = 0; j < 4; j++) {
            __m256 sc = _mm256_cvtepi32_ps(sv[j]);
            sc = _mm256_mul_ps(_mm256_loadu_ps(f + i0 + 8 * j), _mm256_add_ps(_mm256_mul_ps(vd, sc), vb));
            if (add) sc = _mm256_add_ps(sc, _mm256_loadu_ps(add + i0 + 8 * j));
            sc = _mm256_add_ps(sc, vbias);
            int m = _mm256_movemask_ps(_mm256_cmp_ps(sc, _mm256_set1_ps(res->ts), _CMP_GE_OQ));
            if (!m) continue;
            float tmp[8];
            _mm256_storeu_ps(tmp, sc);
            for (int u = 0; u < 8; u++)
                if (m >> u & 1) fs_res_push(res, tmp[u], i0 + 8 * j + u);
        }
        return;
    }
#endif
    for (int64_t i = i0; i < i1; i++) {
        float s = f[i] * (dq * (float)sums[i - b * 32] + bq);
        if (add) s = s + add[i];
        fs_res_push(res, s + bias, i);
    }
}

/* one pass of NQ queries over the rows [lo, hi) of one range; res[q] */
#define FS_DEFINE_PASS(NQ)                                                                                   \
    static void fs_pass_##NQ(const fs_codes *cx, const uint8_t *const *lut, const float *dq, const float *bq,  \
                             const float *bias, int64_t lo, int64_t end, fs_res *const *res) {                 \
        uint32_t sums[FS_NQ][32];                                                                            \
        for (int64_t b = lo / 32; b * 32 < end; b++) {                                                       \
            fs_accum(cx->blocks + b * (int64_t)cx->G * 16, cx->Gs, lut, NQ, sums);                            \
            int64_t i0 = b * 32 > lo ? b * 32 : lo, i1 = b * 32 + 32 < end ? b * 32 + 32 : end;               \
            for (int q = 0; q < NQ; q++) fs_handle(cx, sums[q], b, i0, i1, dq[q], bq[q], bias[q], res[q]);    \
        }                                                                                                    \
    }
FS_DEFINE_PASS(1)
FS_DEFINE_PASS(2)
FS_DEFINE_PASS(3)
FS_DEFINE_PASS(4)

static void fs_pass(int nqb, const fs_codes *cx, const uint8_t *const *lut, const float *dq, const float *bq,
                    const float *bias, int64_t lo, int64_t end, fs_res *const *res) {
    if (nqb == 4) fs_pass_4(cx, lut, dq, bq, bias, lo, end, res);
    else if (nqb == 3) fs_pass_3(cx, lut, dq, bq, bias, lo, end, res);
    else if (nqb == 2) fs_pass_2(cx, lut, dq, bq, bias, lo, end, res);
    else fs_pass_1(cx, lut, dq, bq, bias, lo, end, res);
}

/* the nibbles of row i: nib[G] */
static inline void fs_nibbles(const fs_codes *cx, int64_t i, uint8_t *nib) {
    const uint8_t *blk = cx->blocks + (i / 32) * (int64_t)cx->G * 16;
    int lane = (int)(i % 32), shift = lane < 16 ? 0 : 4;
    for (int g = 0; g < cx->G; g++) nib[g] = (blk[g * 16 + (lane & 15)] >> shift) & 15;
}

/* sum_j y_j c[idx_j] of one row.  rbits == 0: the float tables lutf; else coordinate pairs, decoded with
 * dec[(two scan digits) | (two refine digits) << 2 sbits] = idx_2p | idx_2p+1 << 4 and looked up in
 * T[j][2^bits] = y_j c[v] (an extra zero row when nc is odd) */
static float fs_exact(const uint8_t *nib, int Gs, int nc, int sbits, int rbits, const float *lutf,
                      const float *T, const uint8_t *dec) {
    float s0 = 0.f, s1 = 0.f;  /* two chains: the sum's latency, not its rounding, is what counts here */
    if (rbits == 0) {
        for (int g = 0; g + 1 < Gs; g += 2) { s0 += lutf[g * 16 + nib[g]]; s1 += lutf[(g + 1) * 16 + nib[g + 1]]; }
        return s0 + s1;  /* Gs is even */
    }
    int nv = 1 << (sbits + rbits);
    for (int p = 0; 2 * p < nc; p++) {
        int hb = 2 * p * sbits, rb = 2 * p * rbits;
        int h = (nib[hb >> 2] >> (hb & 3)) & ((1 << (2 * sbits)) - 1);
        int l = (nib[Gs + (rb >> 2)] >> (rb & 3)) & ((1 << (2 * rbits)) - 1);
        int d = dec[h | (l << (2 * sbits))];
        s0 += T[(2 * p) * nv + (d & 15)];
        s1 += T[(2 * p + 1) * nv + (d >> 4)];
    }
    return s0 + s1;
}

static float fs_bias_of(const float *bias, const int64_t *rq, int64_t nr, int64_t i) {
    if (!bias) return 0.f;
    for (int64_t r = 0; r < nr; r++)
        if (i >= rq[2 * r] && i < rq[2 * r + 1]) return bias[r];
    return 0.f;
}

/* blocks [ceil(n/32), G, 16]; factors [n]; add [n] or NULL; y [nq, nc]; cs [2^sbits]; c [2^(sbits+rbits)];
 * ranges [nq, nr, 2] (disjoint per query); bias [nq, nr] or NULL; shared: every query has the same
 * ranges (then queries are batched and, with nr == 1, the range may be sliced over threads). */
QJL_EXPORT int qjl_fastscan(const uint8_t *blocks, int64_t n, int G, int Gs, int nc, int sbits, int rbits,
                            const float *factors, const float *add, const float *y, const float *cs,
                            const float *c, int64_t nq, const int64_t *ranges, int64_t nr, const float *bias,
                            int shared, int shortlist, int k, float *out_scores, int64_t *out_idx, int nthreads)
{
    if (G < 2 || G % 2 || Gs < 2 || Gs % 2 || Gs > G || k < 1 || shortlist < k || nq < 0) return -1;
    if ((sbits != 1 && sbits != 2 && sbits != 4) || rbits < 0 || rbits > 2 || (rbits && sbits == 4)) return -2;
    if (nq == 0) return 0;
    int nt = 1;
#ifdef _OPENMP
    nt = nthreads < 1 ? omp_get_max_threads() : nthreads;
#endif
    int sl = shortlist, bits = sbits + rbits, nv = 1 << bits;
    int64_t ncp = nc + (nc & 1);
    int64_t nbatch = shared ? (nq + FS_NQ - 1) / FS_NQ : nq;
    int64_t nslice = (shared && nr == 1 && nbatch < nt) ? (nt + nbatch - 1) / nbatch : 1;
    int64_t ntask = nbatch * nslice;
    float *lutf = malloc(sizeof(float) * nq * Gs * 16);
    uint8_t *lut8 = malloc((size_t)nq * Gs * 16);
    float *dq = malloc(sizeof(float) * nq), *bq = malloc(sizeof(float) * nq);
    float *T = rbits ? malloc(sizeof(float) * nq * ncp * nv) : NULL;
    int64_t extra = 3 * (int64_t)sl < n ? 3 * (int64_t)sl : n;
    int cap = sl + (int)(extra > 0 ? extra : 1);  /* reservoir: compacted to sl when it holds cap */
    int64_t nblk = (n + 31) / 32;
    float *cs_ = malloc(sizeof(float) * nslice * nq * cap);
    int64_t *ci = malloc(sizeof(int64_t) * nslice * nq * cap);
    fs_res *res = malloc(sizeof(fs_res) * nslice * nq);
    float *bstat = malloc(sizeof(float) * 3 * (nblk > 0 ? nblk : 1));
    uint8_t *bounded = malloc(nblk > 0 ? nblk : 1);
    uint8_t dec[256];
    if (!lutf || !lut8 || !dq || !bq || (rbits && !T) || !cs_ || !ci || !res || !bstat || !bounded) {
        free(lutf); free(lut8); free(dq); free(bq); free(T); free(cs_); free(ci); free(res); free(bstat); free(bounded);
        return -3;
    }
    for (int64_t b = 0; b < nblk; b++) {  /* per block: the bound's terms (fs_handle) */
        float flo = INFINITY, fhi = -INFINITY, ahi = -INFINITY;
        int ok = 1;
        for (int64_t i = 32 * b; i < n && i < 32 * b + 32; i++) {
            float f = factors[i], a = add ? add[i] : 0.f;
            ok &= isfinite(f) && isfinite(a) && f >= 0.f;
            flo = f < flo ? f : flo; fhi = f > fhi ? f : fhi; ahi = a > ahi ? a : ahi;
        }
        bstat[b] = flo; bstat[nblk + b] = fhi; bstat[2 * nblk + b] = ahi;
        bounded[b] = (uint8_t)ok;
    }
    for (int key = 0; key < 256; key++) {
        int h = key & ((1 << (2 * sbits)) - 1), l = key >> (2 * sbits), smask = (1 << sbits) - 1;
        int rmask = (1 << rbits) - 1;
        int i0 = ((h & smask) << rbits) | (l & rmask), i1 = (((h >> sbits) & smask) << rbits) | ((l >> rbits) & rmask);
        dec[key] = (uint8_t)((i0 & 15) | ((i1 & 15) << 4));
    }
    fs_codes cx = {blocks, n, G, Gs, factors, add, bstat, bstat + nblk, bstat + 2 * nblk, bounded};
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
    {
        uint8_t *nib = malloc(G);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t q = 0; q < nq; q++) {
            fs_lutf(y + q * nc, nc, sbits, cs, Gs, lutf + q * Gs * 16);
            fs_quantize(lutf + q * Gs * 16, Gs, lut8 + q * Gs * 16, dq + q, bq + q);
            if (rbits) {
                float *Tq = T + q * ncp * nv;
                for (int64_t j = 0; j < ncp; j++)
                    for (int v = 0; v < nv; v++) Tq[j * nv + v] = j < nc ? y[q * nc + j] * c[v] : 0.f;
            }
            for (int64_t s = 0; s < nslice; s++)
                fs_res_init(res + s * nq + q, cs_ + (s * nq + q) * cap, ci + (s * nq + q) * cap, sl, cap);
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t t = 0; t < ntask; t++) {
            int64_t batch = t / nslice, s = t % nslice;
            int64_t q0 = shared ? batch * FS_NQ : batch;
            int nqb = shared ? (int)(nq - q0 < FS_NQ ? nq - q0 : FS_NQ) : 1;
            const uint8_t *lut[FS_NQ];
            float bias_r[FS_NQ];
            fs_res *rq[FS_NQ];
            for (int u = 0; u < nqb; u++) {
                lut[u] = lut8 + (q0 + u) * Gs * 16;
                rq[u] = res + s * nq + q0 + u;
            }
            for (int64_t r = 0; r < nr; r++) {
                int64_t lo = ranges[(q0 * nr + r) * 2], end = ranges[(q0 * nr + r) * 2 + 1];
                if (nslice > 1) {  /* slice s of the range, cut at block boundaries */
                    int64_t nb = (end - lo + 31) / 32, b0 = lo + 32 * (nb * s / nslice), b1 = lo + 32 * (nb * (s + 1) / nslice);
                    end = b1 < end ? b1 : end;
                    lo = b0;
                }
                if (lo >= end) continue;
                for (int u = 0; u < nqb; u++) bias_r[u] = bias ? bias[(q0 + u) * nr + r] : 0.f;
                fs_pass(nqb, &cx, lut, dq + q0, bq + q0, bias_r, lo, end, rq);
            }
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 4)
#endif
        for (int64_t q = 0; q < nq; q++) {
            fs_res *r0 = res + q;
            for (int64_t s = 1; s < nslice; s++) {  /* merge the slices' shortlists into slice 0's */
                fs_res *rs = res + s * nq + q;
                for (int j = 0; j < rs->n; j++) fs_res_push(r0, rs->s[j], rs->i[j]);
            }
            if (r0->n > sl) fs_res_compact(r0);
            float *os = out_scores + q * k;
            int64_t *oi = out_idx + q * k;
            for (int j = 0; j < k; j++) { os[j] = -INFINITY; oi[j] = -1; }
            const float *Tq = rbits ? T + q * ncp * nv : NULL;
            for (int j = 0; j < r0->n; j++) {
                int64_t i = r0->i[j];
                fs_nibbles(&cx, i, nib);
                float e = factors[i] * fs_exact(nib, Gs, nc, sbits, rbits, lutf + q * Gs * 16, Tq, dec);
                if (add) e = e + add[i];
                fs_push(os, oi, k, e + fs_bias_of(bias ? bias + q * nr : NULL, ranges + q * nr * 2, nr, i), i);
            }
            fs_sort(os, oi, k);
        }
        free(nib);
    }
    free(lutf); free(lut8); free(dq); free(bq); free(T); free(cs_); free(ci); free(res); free(bstat); free(bounded);
    return 0;
}
