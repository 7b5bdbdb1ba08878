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
 * query-batched fast scan); vpshufb looks up 32 vectors at once; sums stay in 16-bit lanes for up
 * to 256 nibbles, then are folded into 32 bits.  Threads split the queries into batches and, when
 * there are fewer batches than threads, the vectors into slices whose shortlists are merged.
 * Without AVX2 a scalar loop computes the same integer sums.
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

#define FS_NQ 3 /* queries per pass: 12 accumulators + 7 working registers (4 per pass, 16 accumulators,
                     spills on AVX2's 16 registers: measured no faster, benchmarks/search_speed.py) */

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
    __m256i t[FS_NQ][4];
    for (int q = 0; q < NQ; q++) for (int j = 0; j < 4; j++) t[q][j] = _mm256_setzero_si256();
    for (int g0 = 0; g0 < Gs; g0 += 256) {
        int g1 = g0 + 256 < Gs ? g0 + 256 : Gs;
        /* 16-bit lanes over byte results: a lane adds its even byte + 256 * its odd byte, (r >> 8) adds
         * the odd byte; the even bytes' sum is a - 256 b (exact for <= 128 steps: sums <= 255 * 128).
         * Lane 0 of a register holds nibble g, lane 1 nibble g + 1. */
        __m256i a[FS_NQ][4];
        for (int q = 0; q < NQ; q++) for (int j = 0; j < 4; j++) a[q][j] = _mm256_setzero_si256();
        for (int g = g0; g < g1; g += 2) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(blk + (int64_t)g * 16));
            __m256i lo = _mm256_and_si256(x, mask), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), mask);
            for (int q = 0; q < NQ; q++) {
                __m256i tb = _mm256_loadu_si256((const __m256i *)(lut[q] + (int64_t)g * 16));
                __m256i rl = _mm256_shuffle_epi8(tb, lo), rh = _mm256_shuffle_epi8(tb, hi);
                a[q][0] = _mm256_add_epi16(a[q][0], rl);
                a[q][1] = _mm256_add_epi16(a[q][1], _mm256_srli_epi16(rl, 8));
                a[q][2] = _mm256_add_epi16(a[q][2], rh);
                a[q][3] = _mm256_add_epi16(a[q][3], _mm256_srli_epi16(rh, 8));
            }
        }
        for (int q = 0; q < NQ; q++) {
            /* even bytes = vectors 0,2,..,14 (lo) / 16,18,.. (hi); odd bytes = 1,3,.. / 17,19,.. */
            __m256i el = _mm256_sub_epi16(a[q][0], _mm256_slli_epi16(a[q][1], 8));
            __m256i eh = _mm256_sub_epi16(a[q][2], _mm256_slli_epi16(a[q][3], 8));
            /* fold the two lanes (nibbles g and g + 1), interleave even/odd back to vector order */
            __m128i le = _mm_add_epi16(_mm256_castsi256_si128(el), _mm256_extracti128_si256(el, 1));
            __m128i lod = _mm_add_epi16(_mm256_castsi256_si128(a[q][1]), _mm256_extracti128_si256(a[q][1], 1));
            __m128i he = _mm_add_epi16(_mm256_castsi256_si128(eh), _mm256_extracti128_si256(eh, 1));
            __m128i hod = _mm_add_epi16(_mm256_castsi256_si128(a[q][3]), _mm256_extracti128_si256(a[q][3], 1));
            t[q][0] = _mm256_add_epi32(t[q][0], _mm256_cvtepu16_epi32(_mm_unpacklo_epi16(le, lod)));
            t[q][1] = _mm256_add_epi32(t[q][1], _mm256_cvtepu16_epi32(_mm_unpackhi_epi16(le, lod)));
            t[q][2] = _mm256_add_epi32(t[q][2], _mm256_cvtepu16_epi32(_mm_unpacklo_epi16(he, hod)));
            t[q][3] = _mm256_add_epi32(t[q][3], _mm256_cvtepu16_epi32(_mm_unpackhi_epi16(he, hod)));
        }
    }
    for (int q = 0; q < NQ; q++)
        for (int j = 0; j < 4; j++) _mm256_storeu_si256((__m256i *)(out[q] + 8 * j), t[q][j]);
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
} fs_codes;

/* approx = ((f (delta S + beta)) + add) + bias for rows i0..i1-1 of block b, pushed into the heap */
static inline void fs_handle(const fs_codes *cx, const uint32_t *sums, int64_t b, int64_t i0, int64_t i1,
                             float dq, float bq, float bias, float *hs, int64_t *hi, int sl) {
    const float *f = cx->factors, *add = cx->add;
#ifdef __AVX2__
    if (i0 == b * 32 && i1 == b * 32 + 32) {  /* a whole block: 8 vectors per compare */
        const __m256 vd = _mm256_set1_ps(dq), vb = _mm256_set1_ps(bq), vbias = _mm256_set1_ps(bias);
        for (int j = 0; j < 32; j += 8) {
            __m256 sc = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(sums + j)));
            sc = _mm256_mul_ps(_mm256_loadu_ps(f + i0 + j), _mm256_add_ps(_mm256_mul_ps(vd, sc), vb));
            if (add) sc = _mm256_add_ps(sc, _mm256_loadu_ps(add + i0 + j));
            sc = _mm256_add_ps(sc, vbias);
            int m = _mm256_movemask_ps(_mm256_cmp_ps(sc, _mm256_set1_ps(hs[0]), _CMP_GE_OQ));
            if (!m) continue;
            float tmp[8];
            _mm256_storeu_ps(tmp, sc);
            for (int u = 0; u < 8; u++)
                if (m >> u & 1) fs_push(hs, hi, sl, tmp[u], i0 + j + u);
        }
        return;
    }
#endif
    for (int64_t i = i0; i < i1; i++) {
        float s = f[i] * (dq * (float)sums[i - b * 32] + bq);
        if (add) s = s + add[i];
        fs_push(hs, hi, sl, s + bias, i);
    }
}

/* one pass of NQ queries over the rows [lo, hi) of one range; heaps[q] */
#define FS_DEFINE_PASS(NQ)                                                                                   \
    static void fs_pass_##NQ(const fs_codes *cx, const uint8_t *const *lut, const float *dq, const float *bq,  \
                             const float *bias, int64_t lo, int64_t end, float **hs, int64_t **hi, int sl) {   \
        uint32_t sums[FS_NQ][32];                                                                            \
        for (int64_t b = lo / 32; b * 32 < end; b++) {                                                       \
            fs_accum(cx->blocks + b * (int64_t)cx->G * 16, cx->Gs, lut, NQ, sums);                            \
            int64_t i0 = b * 32 > lo ? b * 32 : lo, i1 = b * 32 + 32 < end ? b * 32 + 32 : end;               \
            for (int q = 0; q < NQ; q++) fs_handle(cx, sums[q], b, i0, i1, dq[q], bq[q], bias[q], hs[q], hi[q], sl); \
        }                                                                                                    \
    }
FS_DEFINE_PASS(1)
FS_DEFINE_PASS(2)
FS_DEFINE_PASS(3)

static void fs_pass(int nqb, const fs_codes *cx, const uint8_t *const *lut, const float *dq, const float *bq,
                    const float *bias, int64_t lo, int64_t end, float **hs, int64_t **hi, int sl) {
    if (nqb == 3) fs_pass_3(cx, lut, dq, bq, bias, lo, end, hs, hi, sl);
    else if (nqb == 2) fs_pass_2(cx, lut, dq, bq, bias, lo, end, hs, hi, sl);
    else fs_pass_1(cx, lut, dq, bq, bias, lo, end, hs, hi, sl);
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
    float s = 0.f;
    if (rbits == 0) {
        for (int g = 0; g < Gs; g++) s += lutf[g * 16 + nib[g]];
        return s;
    }
    int nv = 1 << (sbits + rbits);
    for (int p = 0; 2 * p < nc; p++) {
        int hb = 2 * p * sbits, rb = 2 * p * rbits;
        int h = (nib[hb >> 2] >> (hb & 3)) & ((1 << (2 * sbits)) - 1);
        int l = (nib[Gs + (rb >> 2)] >> (rb & 3)) & ((1 << (2 * rbits)) - 1);
        int d = dec[h | (l << (2 * sbits))];
        s += T[(2 * p) * nv + (d & 15)] + T[(2 * p + 1) * nv + (d >> 4)];
    }
    return s;
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
    float *cs_ = malloc(sizeof(float) * nslice * nq * sl);
    int64_t *ci = malloc(sizeof(int64_t) * nslice * nq * sl);
    uint8_t dec[256];
    if (!lutf || !lut8 || !dq || !bq || (rbits && !T) || !cs_ || !ci) {
        free(lutf); free(lut8); free(dq); free(bq); free(T); free(cs_); free(ci);
        return -3;
    }
    for (int key = 0; key < 256; key++) {
        int h = key & ((1 << (2 * sbits)) - 1), l = key >> (2 * sbits), smask = (1 << sbits) - 1;
        int rmask = (1 << rbits) - 1;
        int i0 = ((h & smask) << rbits) | (l & rmask), i1 = (((h >> sbits) & smask) << rbits) | ((l >> rbits) & rmask);
        dec[key] = (uint8_t)((i0 & 15) | ((i1 & 15) << 4));
    }
    fs_codes cx = {blocks, n, G, Gs, factors, add};
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
                for (int j = 0; j < sl; j++) { cs_[(s * nq + q) * sl + j] = -INFINITY; ci[(s * nq + q) * sl + j] = -1; }
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t t = 0; t < ntask; t++) {
            int64_t batch = t / nslice, s = t % nslice;
            int64_t q0 = shared ? batch * FS_NQ : batch;
            int nqb = shared ? (int)(nq - q0 < FS_NQ ? nq - q0 : FS_NQ) : 1;
            const uint8_t *lut[FS_NQ];
            float bias_r[FS_NQ], *hs[FS_NQ];
            int64_t *hi[FS_NQ];
            for (int u = 0; u < nqb; u++) {
                lut[u] = lut8 + (q0 + u) * Gs * 16;
                hs[u] = cs_ + (s * nq + q0 + u) * sl;
                hi[u] = ci + (s * nq + q0 + u) * sl;
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
                fs_pass(nqb, &cx, lut, dq + q0, bq + q0, bias_r, lo, end, hs, hi, sl);
            }
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 4)
#endif
        for (int64_t q = 0; q < nq; q++) {
            float *hs = cs_ + q * sl;
            int64_t *hi = ci + q * sl;
            for (int64_t s = 1; s < nslice; s++)  /* merge the slices' shortlists into slice 0's */
                for (int j = 0; j < sl; j++)
                    if (ci[(s * nq + q) * sl + j] >= 0) fs_push(hs, hi, sl, cs_[(s * nq + q) * sl + j], ci[(s * nq + q) * sl + j]);
            float *os = out_scores + q * k;
            int64_t *oi = out_idx + q * k;
            for (int j = 0; j < k; j++) { os[j] = -INFINITY; oi[j] = -1; }
            const float *Tq = rbits ? T + q * ncp * nv : NULL;
            for (int j = 0; j < sl; j++) {
                int64_t i = hi[j];
                if (i < 0) continue;
                fs_nibbles(&cx, i, nib);
                float e = factors[i] * fs_exact(nib, Gs, nc, sbits, rbits, lutf + q * Gs * 16, Tq, dec);
                if (add) e = e + add[i];
                fs_push(os, oi, k, e + fs_bias_of(bias ? bias + q * nr : NULL, ranges + q * nr * 2, nr, i), i);
            }
            fs_sort(os, oi, k);
        }
        free(nib);
    }
    free(lutf); free(lut8); free(dq); free(bq); free(T); free(cs_); free(ci);
    return 0;
}
