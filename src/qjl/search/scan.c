/* Top-k scan over packed codes with per-query lookup tables (qjl.search.scan).
 *
 * A vector's code is `stride` bytes: up to 4 segments, each a packed bit stream cut into
 * groups of `gbits` bits (8: one byte; 6: two 3-bit codes, four groups per 3 bytes).  Each
 * group indexes a per-query table, so
 *
 *     score[i] = sum_s factor[s][i] * sum_g lut[s][g][group_g(code_i)] + add[i] + bias[q][r]
 *
 * which is <q', x_hat_i> for any codec whose estimate is a sum over coordinates of a
 * function of one code (TurboQuant MSE / Prod, QJL): the tables hold those sums for every
 * value a group can take (built by qjl.search.scan.build_luts, in torch).  Bytes past a
 * segment's end read as 0 (the tables give 0 for padding coordinates).  bias (optional, [nq, nr]) is
 * a per-(query, range) term: an IVF index encoding residuals adds <q, centroid of the list> there.
 *
 * OpenMP over queries: each query scans its own ranges of vectors into its own min-heap of
 * the k best (score, index) pairs, so threads share nothing but the read-only codes.
 * Output: scores [nq, k] descending, indices [nq, k] (-1 / -inf where fewer than k vectors).
 */
#include <stdint.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static void heap_sift(float *hs, int64_t *hi, int k, int pos) {
    for (;;) {
        int l = 2 * pos + 1, r = l + 1, m = pos;
        if (l < k && (hs[l] < hs[m] || (hs[l] == hs[m] && hi[l] > hi[m]))) m = l;
        if (r < k && (hs[r] < hs[m] || (hs[r] == hs[m] && hi[r] > hi[m]))) m = r;
        if (m == pos) return;
        float ts = hs[m]; hs[m] = hs[pos]; hs[pos] = ts;
        int64_t ti = hi[m]; hi[m] = hi[pos]; hi[pos] = ti;
        pos = m;
    }
}

/* sum over the groups of one segment: code points at the segment's first byte */
static inline float seg_sum8(const uint8_t *code, int nbytes, const float *lut) {
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    int p = 0;
    for (; p + 4 <= nbytes; p += 4) {
        a0 += lut[(p + 0) * 256 + code[p + 0]];
        a1 += lut[(p + 1) * 256 + code[p + 1]];
        a2 += lut[(p + 2) * 256 + code[p + 2]];
        a3 += lut[(p + 3) * 256 + code[p + 3]];
    }
    for (; p < nbytes; p++) a0 += lut[p * 256 + code[p]];
    return (a0 + a1) + (a2 + a3);
}

static inline float seg_sum6(const uint8_t *code, int nbytes, const float *lut) {
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    int w = 0, p = 0;
    for (; p + 3 <= nbytes; p += 3, w++) {
        uint32_t v = (uint32_t)code[p] | ((uint32_t)code[p + 1] << 8) | ((uint32_t)code[p + 2] << 16);
        const float *t = lut + (int64_t)w * 256;  /* 4 groups x 64 entries */
        a0 += t[v & 63];
        a1 += t[64 + ((v >> 6) & 63)];
        a2 += t[128 + ((v >> 12) & 63)];
        a3 += t[192 + ((v >> 18) & 63)];
    }
    if (p < nbytes) {  /* a last, partial 3-byte word: missing bytes read as 0 */
        uint32_t v = code[p];
        if (p + 1 < nbytes) v |= (uint32_t)code[p + 1] << 8;
        const float *t = lut + (int64_t)w * 256;
        a0 += t[v & 63] + t[64 + ((v >> 6) & 63)] + t[128 + ((v >> 12) & 63)] + t[192 + ((v >> 18) & 63)];
    }
    return (a0 + a1) + (a2 + a3);
}

int qjl_scan(const uint8_t *codes, int64_t n, int64_t stride,
             int nseg, const int32_t *seg_off, const int32_t *seg_bytes, const int32_t *seg_gbits,
             const int64_t *lut_off, const float *factors, const float *add,
             const float *luts, int64_t lut_size, int64_t nq,
             const int64_t *ranges, int64_t nr, const float *bias, int k,
             float *out_scores, int64_t *out_idx, int nthreads)
{
    if (nseg < 1 || nseg > 4 || k < 1) return -1;
    for (int s = 0; s < nseg; s++)
        if (seg_gbits[s] != 8 && seg_gbits[s] != 6) return -2;
#ifdef _OPENMP
    if (nthreads < 1) nthreads = omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
#endif
    for (int64_t q = 0; q < nq; q++) {
        float *hs = out_scores + q * k;
        int64_t *hi = out_idx + q * k;
        for (int j = 0; j < k; j++) { hs[j] = -INFINITY; hi[j] = -1; }
        const float *lq = luts + q * lut_size;
        for (int64_t r = 0; r < nr; r++) {
            int64_t lo = ranges[(q * nr + r) * 2], hi_end = ranges[(q * nr + r) * 2 + 1];
            float br = bias ? bias[q * nr + r] : 0.f;
            for (int64_t i = lo; i < hi_end; i++) {
                const uint8_t *c = codes + i * stride;
                float score = add ? add[i] : 0.f;
                for (int s = 0; s < nseg; s++) {
                    const float *t = lq + lut_off[s];
                    float part = seg_gbits[s] == 8 ? seg_sum8(c + seg_off[s], seg_bytes[s], t)
                                                   : seg_sum6(c + seg_off[s], seg_bytes[s], t);
                    score += factors[s * n + i] * part;
                }
                score = score + br;
                if (score > hs[0] || (score == hs[0] && i < hi[0])) {
                    hs[0] = score; hi[0] = i;
                    heap_sift(hs, hi, k, 0);
                }
            }
        }
        /* heap -> descending order (heap sort in place) */
        for (int end = k - 1; end > 0; end--) {
            float ts = hs[0]; hs[0] = hs[end]; hs[end] = ts;
            int64_t ti = hi[0]; hi[0] = hi[end]; hi[end] = ti;
            heap_sift(hs, hi, end, 0);
        }
    }
    return 0;
}
