/* Fast scan over 4-bit code groups with 8-bit tables in registers (qjl.search.fastscan).
 *
 * Layout: vectors in blocks of 32; a code of G nibbles (G even; 4 bits = four 1-bit, two 2-bit or
 * one 4-bit code).  Block b holds G x 16 bytes: for nibble g, byte i = nibble g of vector 32b + i
 * (low half) | nibble g of vector 32b + 16 + i (high half).
 *
 * Per query: lut8 [G][16] uint8 (the float tables shifted by their per-group minimum and divided by
 * one step `delta`), so a vector's approximate score is  f_i * (delta * S_i + beta)  with S_i the
 * integer sum of its G entries.  With AVX2, two nibble groups of 32 vectors take two pshufb
 * (vpshufb looks up 32 entries at once in the 16-entry tables held in the two register lanes);
 * sums are kept in uint16 lanes for at most 256 groups, then folded into uint32.  A shortlist of
 * the `shortlist` best approximate scores is re-scored exactly with the float tables
 * lutf [G][16] (the quantization error of S is at most G / 2 steps), and the k best are returned.
 * The integer sums are the same with or without AVX2 (a scalar loop stands in).
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#ifndef QJL_EXPORT
#define QJL_EXPORT
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

static void fs_sift(float *hs, int64_t *hi, int k, int pos) {
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

static inline void fs_push(float *hs, int64_t *hi, int k, float s, int64_t i) {
    if (s > hs[0] || (s == hs[0] && i < hi[0])) { hs[0] = s; hi[0] = i; fs_sift(hs, hi, k, 0); }
}

static void fs_sort(float *hs, int64_t *hi, int k) {
    for (int end = k - 1; end > 0; end--) {
        float ts = hs[0]; hs[0] = hs[end]; hs[end] = ts;
        int64_t ti = hi[0]; hi[0] = hi[end]; hi[end] = ti;
        fs_sift(hs, hi, end, 0);
    }
}

/* integer sums of one block: out[32] */
static void fs_block_sums(const uint8_t *blk, int G, const uint8_t *lut, uint32_t *out) {
#ifdef __AVX2__
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256i t0 = _mm256_setzero_si256(), t1 = t0, t2 = t0, t3 = t0;  /* uint32 x 8: v0-7, 8-15, 16-23, 24-31 */
    for (int g0 = 0; g0 < G; g0 += 256) {
        int g1 = g0 + 256 < G ? g0 + 256 : G;
        /* 16-bit lanes over the byte results: a lane adds its even byte + 256 * its odd byte, and
         * (r >> 8) adds the odd byte alone; the even bytes' sum is then a - 256 b (mod 2^16), exact
         * for <= 256 groups (sums <= 255 * 256).  Lane 0 of a register holds group g, lane 1 g + 1. */
        __m256i al = _mm256_setzero_si256(), bl = al, ah = al, bh = al;
        for (int g = g0; g < g1; g += 2) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(blk + (int64_t)g * 16));
            __m256i t = _mm256_loadu_si256((const __m256i *)(lut + (int64_t)g * 16));
            __m256i rl = _mm256_shuffle_epi8(t, _mm256_and_si256(x, mask));
            __m256i rh = _mm256_shuffle_epi8(t, _mm256_and_si256(_mm256_srli_epi16(x, 4), mask));
            al = _mm256_add_epi16(al, rl);
            bl = _mm256_add_epi16(bl, _mm256_srli_epi16(rl, 8));
            ah = _mm256_add_epi16(ah, rh);
            bh = _mm256_add_epi16(bh, _mm256_srli_epi16(rh, 8));
        }
        /* even bytes = vectors 0,2,..,14 (lo) / 16,18,.. (hi); odd bytes = 1,3,..,15 / 17,19,.. */
        __m256i el = _mm256_sub_epi16(al, _mm256_slli_epi16(bl, 8)), eh = _mm256_sub_epi16(ah, _mm256_slli_epi16(bh, 8));
        /* fold the two lanes (groups g and g + 1) and interleave even/odd back to vector order */
        __m128i le = _mm_add_epi16(_mm256_castsi256_si128(el), _mm256_extracti128_si256(el, 1));
        __m128i lo_ = _mm_add_epi16(_mm256_castsi256_si128(bl), _mm256_extracti128_si256(bl, 1));
        __m128i he = _mm_add_epi16(_mm256_castsi256_si128(eh), _mm256_extracti128_si256(eh, 1));
        __m128i ho = _mm_add_epi16(_mm256_castsi256_si128(bh), _mm256_extracti128_si256(bh, 1));
        __m256i lo = _mm256_set_m128i(_mm_unpackhi_epi16(le, lo_), _mm_unpacklo_epi16(le, lo_));
        __m256i hi = _mm256_set_m128i(_mm_unpackhi_epi16(he, ho), _mm_unpacklo_epi16(he, ho));
        t0 = _mm256_add_epi32(t0, _mm256_cvtepu16_epi32(_mm256_castsi256_si128(lo)));
        t1 = _mm256_add_epi32(t1, _mm256_cvtepu16_epi32(_mm256_extracti128_si256(lo, 1)));
        t2 = _mm256_add_epi32(t2, _mm256_cvtepu16_epi32(_mm256_castsi256_si128(hi)));
        t3 = _mm256_add_epi32(t3, _mm256_cvtepu16_epi32(_mm256_extracti128_si256(hi, 1)));
    }
    _mm256_storeu_si256((__m256i *)out, t0);
    _mm256_storeu_si256((__m256i *)(out + 8), t1);
    _mm256_storeu_si256((__m256i *)(out + 16), t2);
    _mm256_storeu_si256((__m256i *)(out + 24), t3);
#else
    for (int i = 0; i < 32; i++) out[i] = 0;
    for (int g = 0; g < G; g++) {
        const uint8_t *b = blk + (int64_t)g * 16, *t = lut + (int64_t)g * 16;
        for (int i = 0; i < 16; i++) { out[i] += t[b[i] & 15]; out[16 + i] += t[b[i] >> 4]; }
    }
#endif
}

/* lut8 = round_half_even((lutf - min_g) / delta), delta = max(lutf - min_g) / 255, beta = sum_g min_g
 * (the float32 operations of qjl.search.fastscan.quantize_tables, so the tables are bit-exact with it) */
static void fs_quantize(const float *lutf, int G, uint8_t *lut8, float *delta, float *beta) {
    float top = 0.f, b = 0.f;
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
    *beta = b;
}

QJL_EXPORT int qjl_fastscan(const uint8_t *blocks, int64_t n, int G, const float *factors, const float *lutf,
                            int64_t nq, const int64_t *ranges, int64_t nr, int shortlist, int k,
                            float *out_scores, int64_t *out_idx, int nthreads)
{
    if (G < 2 || G % 2 || k < 1 || shortlist < k) return -1;
#ifdef _OPENMP
    if (nthreads < 1) nthreads = omp_get_max_threads();
#pragma omp parallel num_threads(nthreads)
#endif
    {
        float *hs = malloc(sizeof(float) * shortlist);
        int64_t *hi = malloc(sizeof(int64_t) * shortlist);
        uint32_t sums[32];
        uint8_t *lq = malloc((size_t)G * 16);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t q = 0; q < nq; q++) {
            const float *fq = lutf + q * (int64_t)G * 16;
            float dq, bq;
            fs_quantize(fq, G, lq, &dq, &bq);
            for (int j = 0; j < shortlist; j++) { hs[j] = -INFINITY; hi[j] = -1; }
            for (int64_t r = 0; r < nr; r++) {
                int64_t lo = ranges[(q * nr + r) * 2], end = ranges[(q * nr + r) * 2 + 1];
                if (lo >= end) continue;
                for (int64_t b = lo / 32; b * 32 < end; b++) {
                    fs_block_sums(blocks + b * (int64_t)G * 16, G, lq, sums);
                    int64_t i0 = b * 32 > lo ? b * 32 : lo, i1 = b * 32 + 32 < end ? b * 32 + 32 : end;
#ifdef __AVX2__
                    if (i0 == b * 32 && i1 == b * 32 + 32) {  /* a whole block: test 8 vectors at once */
                        for (int j = 0; j < 32; j += 8) {
                            __m256 sc = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(sums + j)));
                            sc = _mm256_mul_ps(_mm256_loadu_ps(factors + i0 + j),
                                               _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(dq), sc), _mm256_set1_ps(bq)));
                            int m = _mm256_movemask_ps(_mm256_cmp_ps(sc, _mm256_set1_ps(hs[0]), _CMP_GE_OQ));
                            if (!m) continue;
                            float tmp[8];
                            _mm256_storeu_ps(tmp, sc);
                            for (int u = 0; u < 8; u++)
                                if (m >> u & 1) fs_push(hs, hi, shortlist, tmp[u], i0 + j + u);
                        }
                        continue;
                    }
#endif
                    for (int64_t i = i0; i < i1; i++)
                        fs_push(hs, hi, shortlist, factors[i] * (dq * (float)sums[i - b * 32] + bq), i);
                }
            }
            /* exact re-scoring of the shortlist with the float tables */
            float *os = out_scores + q * k;
            int64_t *oi = out_idx + q * k;
            for (int j = 0; j < k; j++) { os[j] = -INFINITY; oi[j] = -1; }
            for (int j = 0; j < shortlist; j++) {
                int64_t i = hi[j];
                if (i < 0) continue;
                const uint8_t *blk = blocks + (i / 32) * (int64_t)G * 16;
                int lane = (int)(i % 32), shift = lane < 16 ? 0 : 4;
                float s = 0.f;
                for (int g = 0; g < G; g++) s += fq[g * 16 + ((blk[g * 16 + (lane & 15)] >> shift) & 15)];
                fs_push(os, oi, k, factors[i] * s, i);
            }
            fs_sort(os, oi, k);
        }
        free(hs);
        free(hi);
        free(lq);
    }
    return 0;
}
