/* AVX2 + FMA path of the CPU decode (x86-64 CPUs since 2013, AVX-512 ones included), chosen at run time.
 * 8 codes of b <= 4 bits are b bytes: one broadcast 32-bit word, vpsrlvd moving code j to the low bits of
 * lane j, and vpermps over the centroids held in a register (it reads the low 3 bits of each lane, so the
 * table repeats every 2^b entries for b < 3 and the neighbouring code's bits need no masking; 4-bit codes
 * use two tables blended on bit 3, 5-bit codes four blended on bits 3 and 4, their indices shifted out of two
 * 32-bit words (codes 0-3 and 4-7); 6-8-bit codes go through a gather.  Keys: 2 tokens x 4 query rows
 * accumulate in 8 FMA registers, reduced together by one horizontal-add tree.  Values: per 16 coordinates
 * the 4 rows' accumulators stay in registers over a whole pass of tokens, one FMA per token, row and 8
 * coordinates with the weight p * scale (weights [groups][4 rows][tokens]).  Words are read with exact-size copies at a row's last group, so
 * nothing past a token's codes is read.  Codes of 1-5 bits at sizes that are multiples of 64 (32 for 5 bits) take
 * the lane-sliced loops at the end of this file instead (score_sliced, mix_sliced).  Grouped codes (a vector
 * codebook's, group g > 1: decode.h) take the unpack8 loops with unpack8_grouped in unpack8's place: the 8 / g joint
 * codes of each 8 coordinates' `bits` bytes each index g floats of the table, one load each (g = 2: 8 bytes, 4: 16,
 * 8: 32) blended into the 8 lanes; never the lane-sliced loops.  Keys in pairs of 2-3 bits score through pair tables
 * instead in items long enough (score_pairs). */
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define QJL_HAVE_AVX2 1
#define QJL_AVX2 __attribute__((target("avx2,fma")))

static int cpu_has_avx2(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return cached;
}

typedef struct {
    __m256i shifts;
    __m256 lo, hi, lo2, hi2; /* centroids 0-7, 8-15 (4 and 5 bits), 16-23, 24-31 (5 bits) */
    const float *cent;
} unpack8_t;

QJL_AVX2 static inline __attribute__((always_inline)) unpack8_t unpack_setup(const int bits, const float *cent) {
    unpack8_t u;
    int32_t sh[8];
    float lo[8], hi[8], lo2[8], hi2[8];
    for (int j = 0; j < 8; j++) {
        sh[j] = bits <= 4 ? j * bits : (j % 4) * bits;
        lo[j] = bits <= 3 ? cent[j & ((1 << bits) - 1)] : bits <= 5 ? cent[j] : 0;
        hi[j] = bits == 4 || bits == 5 ? cent[8 + j] : 0;
        lo2[j] = bits == 5 ? cent[16 + j] : 0;
        hi2[j] = bits == 5 ? cent[24 + j] : 0;
    }
    u.shifts = _mm256_loadu_si256((const __m256i *)sh);
    u.lo = _mm256_loadu_ps(lo);
    u.hi = _mm256_loadu_ps(hi);
    u.lo2 = _mm256_loadu_ps(lo2);
    u.hi2 = _mm256_loadu_ps(hi2);
    u.cent = cent;
    return u;
}

/* the centroids of the 8 codes at p (b bytes); `last`: the row's last group (no read past it) */
QJL_AVX2 static inline __attribute__((always_inline)) __m256 unpack8(const uint8_t *p, const int bits, const int last,
                                                                  const unpack8_t *u) {
    if (bits <= 4) {
        uint32_t w;
        if (bits == 1) w = p[0];
        else if (bits == 2) { uint16_t h; memcpy(&h, p, 2); w = h; }
        else if (bits == 3 && last) { uint16_t h; memcpy(&h, p, 2); w = h | (uint32_t)p[2] << 16; }
        else memcpy(&w, p, 4); /* 3 bits: the 4th byte belongs to the next group (masked off by vpermps) */
        const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32((int)w), u->shifts);
        __m256 v = _mm256_permutevar8x32_ps(u->lo, idx);
        if (bits == 4)
            v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(u->hi, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
        return v;
    }
    uint64_t w = 0; /* 5-8 bits: codes 0-3 lie in the low 32 bits, codes 4-7 in the 32 from bit 4b on */
    if (last) memcpy(&w, p, (size_t)bits);
    else memcpy(&w, p, 8); /* one load (bytes past the group belong to the next one and are shifted out) */
    const int lo = (int)(uint32_t)w, hi = (int)(uint32_t)(w >> (4 * bits));
    const __m256i words = _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi);
    const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(words, u->shifts), _mm256_set1_epi32((1 << bits) - 1));
    if (bits == 5) { /* four 8-entry tables, blended on bits 3 and 4 of each code */
        const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
        const __m256 b4 = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 27));
        const __m256 v0 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(u->lo, idx),
                                           _mm256_permutevar8x32_ps(u->hi, idx), b3);
        const __m256 v1 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(u->lo2, idx),
                                           _mm256_permutevar8x32_ps(u->hi2, idx), b3);
        return _mm256_blendv_ps(v0, v1, b4);
    }
    return _mm256_i32gather_ps(u->cent, idx, 4);
}

/* grouped codes (decode.h; group g = 2, 4 or 8, g bits <= 8): the floats of the 8 coordinates whose 8 / g joint codes
 * of g bits bits lie in the `bits` bytes at p, each joint code's g floats one load from the table (g = 2: 8 bytes,
 * 4: 16, 8: 32; broadcast, then blended into its lanes); `last`: the row's last 8 coordinates (no read past them).  On the
 * AVX2-only AMD EPYC (one thread, keys 3 bits in pairs, d = 128, 4 rows, 16k tokens) the four pairs' vpgatherdpd took
 * 1.7x the scalar codes' time where these loads take ~1.2x; a 12-bit table of pairs of joint codes (64 KB, two loads
 * per 8 coordinates) measured no faster, and vmovsd / vmovhpd / vinsertf128 the same as the broadcasts (scratch
 * timings). */
QJL_AVX2 static inline __attribute__((always_inline)) __m256 unpack8_grouped(const uint8_t *p, const int bits,
                                                                          const int group, const int last,
                                                                          const float *cent) {
    if (group == 8) return _mm256_loadu_ps(cent + 8 * (size_t)p[0]); /* (1 bit: one byte, one joint code) */
    const int jb = group * bits;
    const uint32_t mask = (1u << jb) - 1u;
    uint32_t w;
    if (bits == 1) w = p[0];
    else if (bits == 2) { uint16_t h; memcpy(&h, p, 2); w = h; }
    else if (bits == 3 && last) { uint16_t h; memcpy(&h, p, 2); w = h | (uint32_t)p[2] << 16; }
    else memcpy(&w, p, 4); /* 3 bits: the 4th byte belongs to the next 8 coordinates (masked off) */
    if (group == 4) {
        const __m128 lo = _mm_loadu_ps(cent + 4 * (size_t)(w & mask));
        const __m256 hi = _mm256_broadcast_ps((const __m128 *)(const void *)(cent + 4 * (size_t)((w >> jb) & mask)));
        return _mm256_blend_ps(_mm256_castps128_ps256(lo), hi, 0xF0);
    }
    const double *pairs = (const double *)(const void *)cent; /* (g = 2: joint code e's floats as one 8-byte load) */
    const __m256d b0 = _mm256_broadcast_sd(pairs + (w & mask)), b1 = _mm256_broadcast_sd(pairs + ((w >> jb) & mask));
    const __m256d b2 = _mm256_broadcast_sd(pairs + ((w >> 2 * jb) & mask));
    const __m256d b3 = _mm256_broadcast_sd(pairs + ((w >> 3 * jb) & mask));
    return _mm256_castpd_ps(_mm256_blend_pd(_mm256_blend_pd(b0, b1, 0x2), _mm256_blend_pd(b2, b3, 0x8), 0xC));
}

/* unpack8 (group 1) or unpack8_grouped (group > 1) */
QJL_AVX2 static inline __attribute__((always_inline)) __m256 unpack8_any(const uint8_t *p, const int bits, const int group,
                                                                      const int last, const unpack8_t *u) {
    return group == 1 ? unpack8(p, bits, last, u) : unpack8_grouped(p, bits, group, last, u->cent);
}

/* unpack_setup for scalar codes; grouped codes read the table only */
QJL_AVX2 static inline __attribute__((always_inline)) unpack8_t unpack_setup_any(const int bits, const int group,
                                                                              const float *cent) {
    if (group == 1) return unpack_setup(bits, cent);
    unpack8_t u;
    memset(&u, 0, sizeof u);
    u.cent = cent;
    return u;
}

/* lane i of the result = the sum of the 8 lanes of a[i] */
QJL_AVX2 static inline __attribute__((always_inline)) __m256 hsum8x8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* logits of tokens i and i + 1 (if i + 1 < count) from their rows' accumulators a[0..nr), a[4..4 + nr), times norms */
QJL_AVX2 static inline __attribute__((always_inline)) void add_pair(const __m256 *a, const int nr, const float *norm,
                                                                 int64_t i, int64_t count, float *logits) {
    float s[8];
    _mm256_storeu_ps(s, hsum8x8(a));
    const float n0 = norm[i];
    for (int r = 0; r < nr; r++) logits[r * SUB + i] += s[r] * n0;
    if (i + 1 < count) {
        const float n1 = norm[i + 1];
        for (int r = 0; r < nr; r++) logits[r * SUB + i + 1] += s[4 + r] * n1;
    }
}

QJL_AVX2 static inline __attribute__((always_inline)) void score_rows_(const int bits, const int group, const int nr,
                                                                    const qjl_key_term *k, const uint8_t *codes,
                                                                    const float *norm, int64_t count, const float *q,
                                                                    float *logits) {
    const unpack8_t u = unpack_setup_any(bits, group, k->cent);
    const int64_t n = k->n, groups = n / 8, cs = k->codes.stride_token;
    for (int64_t i = 0; i < count; i += 2) {
        const uint8_t *r0 = codes + i * cs, *r1 = codes + (i + 1 < count ? i + 1 : i) * cs;
        _mm_prefetch((const char *)(r0 + 40 * cs), _MM_HINT_T0); /* (decode_vnni.c's distances) */
        _mm_prefetch((const char *)(r0 + 41 * cs), _MM_HINT_T0);
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups - 1; g++) {
            const __m256 v0 = unpack8_any(r0 + g * bits, bits, group, 0, &u);
            const __m256 v1 = unpack8_any(r1 + g * bits, bits, group, 0, &u);
            for (int r = 0; r < nr; r++) {
                const __m256 qr = _mm256_loadu_ps(q + r * n + 8 * g);
                a[r] = _mm256_fmadd_ps(v0, qr, a[r]);
                a[4 + r] = _mm256_fmadd_ps(v1, qr, a[4 + r]);
            }
        }
        { /* the row's last group: exact-size reads */
            const int64_t g = groups - 1;
            const __m256 v0 = unpack8_any(r0 + g * bits, bits, group, 1, &u);
            const __m256 v1 = unpack8_any(r1 + g * bits, bits, group, 1, &u);
            for (int r = 0; r < nr; r++) {
                const __m256 qr = _mm256_loadu_ps(q + r * n + 8 * g);
                a[r] = _mm256_fmadd_ps(v0, qr, a[r]);
                a[4 + r] = _mm256_fmadd_ps(v1, qr, a[4 + r]);
            }
        }
        add_pair(a, nr, norm, i, count, logits);
    }
}

QJL_AVX2 static inline __attribute__((always_inline)) void score_avx2_(const int bits, const int nr, const qjl_key_term *k,
                                                                    const uint8_t *codes, const float *norm,
                                                                    int64_t count, const float *q, float *logits) {
    score_rows_(bits, 1, nr, k, codes, norm, count, q, logits);
}

/* one specialized loop per code width (1-8) and number of live query rows (1-4: a smaller GQA group, or the last
 * chunk of a larger one; rows past it are not computed) */
#define QJL_BY_BITS(F, NR, ...)                                                                                         \
    switch (bits) {                                                                                                    \
    case 1: F(1, NR, __VA_ARGS__); break;                                                                              \
    case 2: F(2, NR, __VA_ARGS__); break;                                                                              \
    case 3: F(3, NR, __VA_ARGS__); break;                                                                              \
    case 4: F(4, NR, __VA_ARGS__); break;                                                                              \
    case 5: F(5, NR, __VA_ARGS__); break;                                                                              \
    case 6: F(6, NR, __VA_ARGS__); break;                                                                              \
    case 7: F(7, NR, __VA_ARGS__); break;                                                                              \
    default: F(8, NR, __VA_ARGS__); break;                                                                             \
    }
#define QJL_ROWS_OF(BY_BITS, F, ...) /* BY_BITS: the width dispatch (QJL_BY_BITS; decode_vnni.c's 1-5) */             \
    switch (nr) {                                                                                                      \
    case 1: BY_BITS(F, 1, __VA_ARGS__) break;                                                                          \
    case 2: BY_BITS(F, 2, __VA_ARGS__) break;                                                                          \
    case 3: BY_BITS(F, 3, __VA_ARGS__) break;                                                                          \
    default: BY_BITS(F, 4, __VA_ARGS__) break;                                                                         \
    }
#define QJL_BY_ROWS(F, ...) QJL_ROWS_OF(QJL_BY_BITS, F, __VA_ARGS__)
/* widths 1-5 (the lane-sliced loops here, decode_vnni.c's integer path) */
#define QJL_BY_BITS5(F, NR, ...)                                                                                        \
    switch (bits) {                                                                                                    \
    case 1: F(1, NR, __VA_ARGS__); break;                                                                              \
    case 2: F(2, NR, __VA_ARGS__); break;                                                                              \
    case 3: F(3, NR, __VA_ARGS__); break;                                                                              \
    case 4: F(4, NR, __VA_ARGS__); break;                                                                              \
    default: F(5, NR, __VA_ARGS__); break;                                                                             \
    }
#define QJL_BY_ROWS5(F, ...) QJL_ROWS_OF(QJL_BY_BITS5, F, __VA_ARGS__)
/* grouped codes: the vector codebooks' widths (TurboQuantVQ: 2 bits in fours, 3 and 4 in pairs) as constants, the
 * other groups decode.h's group_ok admits with `bits` and `group` read at run time.  F(bits, group, nr, ...) */
#define QJL_BY_GROUPS(F, NR, ...)                                                                                       \
    switch (group * 16 + bits) {                                                                                       \
    case 0x42: F(2, 4, NR, __VA_ARGS__); break;                                                                        \
    case 0x23: F(3, 2, NR, __VA_ARGS__); break;                                                                        \
    case 0x24: F(4, 2, NR, __VA_ARGS__); break;                                                                        \
    default: F(bits, group, NR, __VA_ARGS__); break;                                                                   \
    }
#define QJL_BY_ROWS_G(F, ...) QJL_ROWS_OF(QJL_BY_GROUPS, F, __VA_ARGS__)

QJL_AVX2 static void score_avx2(const qjl_key_term *k, int nr, const uint8_t *codes, const float *norm, int64_t count,
                                const float *q, float *logits) {
    const int bits = k->bits, group = k->group;
    if (group > 1) {
        QJL_BY_ROWS_G(score_rows_, k, codes, norm, count, q, logits)
    } else {
        QJL_BY_ROWS(score_avx2_, k, codes, norm, count, q, logits)
    }
}

/* `chunks` (1 or 2) groups of 8 coordinates from coordinate c0, over the run's tokens */
/* (`shared`: k0 == k1 known here, a weight broadcast once for both chunks; the same products) */
QJL_AVX2 static inline __attribute__((always_inline)) void mix_chunk(const int bits, const int group, const int nr,
                                                                  const int chunks, const int shared,
                                                                  const unpack8_t *u, const uint8_t *codes,
                                                                  int64_t cs, int64_t count, int64_t c0,
                                                                  int64_t n, int64_t k0, int64_t k1,
                                                                  int last1, const float *pw, float *acc) {
    __m256 a[2 * RW];
    for (int r = 0; r < nr; r++) {
        a[r] = _mm256_loadu_ps(acc + r * n + c0);
        a[RW + r] = chunks == 2 ? _mm256_loadu_ps(acc + r * n + c0 + 8) : _mm256_setzero_ps();
    }
    const uint8_t *src = codes + (c0 / 8) * bits;
    const int last0 = chunks == 1 && last1;
    for (int64_t i = 0; i < count; i++, src += cs) {
        const float *w0 = pw + k0 * RW * SUB + i, *w1 = pw + k1 * RW * SUB + i;
        if (c0 == 0) _mm_prefetch((const char *)(src + 64 * cs), _MM_HINT_T0); /* the first chunk reads DRAM */
        const __m256 v0 = unpack8_any(src, bits, group, last0, u);
        if (shared && chunks == 2) {
            const __m256 v1 = unpack8_any(src + bits, bits, group, last1, u);
            for (int r = 0; r < nr; r++) {
                const __m256 w = _mm256_broadcast_ss(w0 + r * SUB);
                a[r] = _mm256_fmadd_ps(w, v0, a[r]);
                a[RW + r] = _mm256_fmadd_ps(w, v1, a[RW + r]);
            }
            continue;
        }
        for (int r = 0; r < nr; r++) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(w0 + r * SUB), v0, a[r]);
        if (chunks == 2) {
            const __m256 v1 = unpack8_any(src + bits, bits, group, last1, u);
            for (int r = 0; r < nr; r++) a[RW + r] = _mm256_fmadd_ps(_mm256_broadcast_ss(w1 + r * SUB), v1, a[RW + r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        _mm256_storeu_ps(acc + r * n + c0, a[r]);
        if (chunks == 2) _mm256_storeu_ps(acc + r * n + c0 + 8, a[RW + r]);
    }
}

QJL_AVX2 static inline __attribute__((always_inline)) void mix_rows_(const int bits, const int group, const int nr,
                                                                  const qjl_value_view *v, const uint8_t *codes,
                                                                  int64_t count, const float *pw, float *acc) {
    const unpack8_t u = unpack_setup_any(bits, group, v->cent);
    const int64_t n = v->n, gs = v->group_size, groups8 = n / 8, cs = v->codes.stride_token;
    int64_t g = 0;
    if (group > 1 && v->groups == 1) /* grouped codes of one scale group (TurboQuantVQ): one broadcast per weight */
        for (; g + 2 <= groups8; g += 2)
            mix_chunk(bits, group, nr, 2, 1, &u, codes, cs, count, 8 * g, n, 0, 0, g + 2 == groups8, pw, acc);
    for (; g + 2 <= groups8; g += 2)
        mix_chunk(bits, group, nr, 2, 0, &u, codes, cs, count, 8 * g, n, (8 * g) / gs, (8 * g + 8) / gs,
                  g + 2 == groups8, pw, acc);
    if (g < groups8)
        mix_chunk(bits, group, nr, 1, 0, &u, codes, cs, count, 8 * g, n, (8 * g) / gs, (8 * g) / gs, 1, pw, acc);
}

QJL_AVX2 static inline __attribute__((always_inline)) void mix_avx2_(const int bits, const int nr, const qjl_value_view *v,
                                                                  const uint8_t *codes, int64_t count,
                                                                  const float *pw, float *acc) {
    mix_rows_(bits, 1, nr, v, codes, count, pw, acc);
}

QJL_AVX2 static void mix_avx2(const qjl_value_view *v, int nr, const uint8_t *codes, int64_t count, const float *pw,
                              float *acc) {
    const int bits = v->bits, group = v->group;
    if (group > 1) {
        QJL_BY_ROWS_G(mix_rows_, v, codes, count, pw, acc)
    } else {
        QJL_BY_ROWS(mix_avx2_, v, codes, count, pw, acc)
    }
}

/* Pair tables for keys of a vector codebook's pairs of 2 or 3 bits (group 2; TurboQuantVQ's 3-bit keys): the 2b bits
 * of coordinates 2p and 2p + 1 are one joint code j of E = 2^(2b) (field 2p in the low bits, as stored), and T[p][j]
 * holds that pair's part of the score for the 4 query rows, q[r][2p] t(j, 0) + q[r][2p + 1] t(j, 1) (t: the joint
 * code's two floats).  A token's score is then a sum of n / 2 16-byte entries, one load-and-add each (the 4 rows at
 * once), the code's bits shifted into a byte offset: no table loads blended into lanes and no products per token.
 * Built once per item (its query rows), n E / 2 entries (64 KB at d = 128 and 3 bits: in L2), so run_item takes it for
 * items of PAIR_MIN_TOKENS or more.  The same products as unpack8_grouped's loops, summed in another order (float
 * rounding only).  Against the lane-sliced scalar keys' time (d = 128, 4 rows, one thread, 2026-11-29's Zen 3 EPYC;
 * docs/runs/pair-tables-ab-20261129) 3-bit pairs went from 1.29x to 1.22x (16k tokens in blocks of 128) and 1.41x to
 * 1.24x (64k contiguous); at d = 64 with 3 rows no change beyond the noise (the FMA loops' cost grows with the rows,
 * the tables' does not).  Scalar 3-bit keys through the same tables measured ~12% slower than the lane-sliced loops,
 * so they keep those. */
#define PAIR_MIN_TOKENS 256

/* (n: check_args already requires a multiple of 8) */
static int pairs_ok(int bits, int group) { return (bits == 2 || bits == 3) && group == 2; }

static int64_t pair_entries(int bits, int64_t n) { return n / 2 * ((int64_t)1 << (2 * bits)); }

/* T [n / 2][E][4] from the query rows q [RW][n] (rows from nr on: zero) and the pairs' table cent [E][2] */
QJL_AVX2 static void pair_table(const float *q, int64_t n, int bits, const float *cent, int nr, float *T) {
    const int E = 1 << (2 * bits);
    for (int64_t p = 0; p < n / 2; p++) {
        float a[4] = {0, 0, 0, 0}, b[4] = {0, 0, 0, 0};
        for (int r = 0; r < nr; r++) a[r] = q[r * n + 2 * p], b[r] = q[r * n + 2 * p + 1];
        const __m128 q0 = _mm_loadu_ps(a), q1 = _mm_loadu_ps(b);
        float *t = T + p * E * 4;
        for (int j = 0; j < E; j++)
            _mm_storeu_ps(t + 4 * j,
                          _mm_fmadd_ps(q1, _mm_set1_ps(cent[2 * j + 1]), _mm_mul_ps(q0, _mm_set1_ps(cent[2 * j]))));
    }
}

/* the 4 pairs' codes of 8 coordinates at p (b bytes; `last`: no read past them) as one word */
QJL_AVX2 static inline __attribute__((always_inline)) uint32_t pair_word(const uint8_t *p, const int bits,
                                                                      const int last) {
    uint32_t w;
    if (bits == 2) { uint16_t h; memcpy(&h, p, 2); w = h; }
    else if (last) { uint16_t h; memcpy(&h, p, 2); w = h | (uint32_t)p[2] << 16; }
    else memcpy(&w, p, 4); /* 3 bits: the 4th byte belongs to the next 8 coordinates (masked off) */
    return w;
}

/* the pair entries of 8 coordinates (4 pairs, E entries of 16 bytes each, from tb) added to a0..a3 */
#define QJL_PAIR_ADD(w, a0, a1, a2, a3)                                                                                \
    do {                                                                                                               \
        a0 = _mm_add_ps(a0, _mm_loadu_ps((const float *)(tb + (((w) << 4) & mask))));                                 \
        a1 = _mm_add_ps(a1, _mm_loadu_ps((const float *)(tb + 16 * E + (((w) >> (jb - 4)) & mask))));                \
        a2 = _mm_add_ps(a2, _mm_loadu_ps((const float *)(tb + 32 * E + (((w) >> (2 * jb - 4)) & mask))));            \
        a3 = _mm_add_ps(a3, _mm_loadu_ps((const float *)(tb + 48 * E + (((w) >> (3 * jb - 4)) & mask))));            \
    } while (0)

QJL_AVX2 static inline __attribute__((always_inline)) void score_pairs_(const int bits, const int nr,
                                                                     const qjl_key_term *k, const uint8_t *codes,
                                                                     const float *norm, int64_t count, const float *T,
                                                                     float *logits) {
    const int jb = 2 * bits, E = 1 << jb;
    const uint32_t mask = (uint32_t)(E - 1) << 4; /* a code's entry as a byte offset */
    const int64_t groups = k->n / 8, cs = k->codes.stride_token;
    for (int64_t i = 0; i < count; i += 2) {
        const uint8_t *r0 = codes + i * cs, *r1 = codes + (i + 1 < count ? i + 1 : i) * cs;
        _mm_prefetch((const char *)(r0 + 40 * cs), _MM_HINT_T0);
        _mm_prefetch((const char *)(r0 + 41 * cs), _MM_HINT_T0);
        __m128 a0 = _mm_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        const uint8_t *tb = (const uint8_t *)(const void *)T;
        for (int64_t g = 0; g < groups - 1; g++, tb += 64 * E) {
            const uint32_t w0 = pair_word(r0 + g * bits, bits, 0), w1 = pair_word(r1 + g * bits, bits, 0);
            QJL_PAIR_ADD(w0, a0, a1, a2, a3);
            QJL_PAIR_ADD(w1, b0, b1, b2, b3);
        }
        { /* the row's last 8 coordinates: exact-size reads */
            const int64_t g = groups - 1;
            const uint32_t w0 = pair_word(r0 + g * bits, bits, 1), w1 = pair_word(r1 + g * bits, bits, 1);
            QJL_PAIR_ADD(w0, a0, a1, a2, a3);
            QJL_PAIR_ADD(w1, b0, b1, b2, b3);
        }
        float s[8];
        _mm_storeu_ps(s, _mm_add_ps(_mm_add_ps(a0, a1), _mm_add_ps(a2, a3)));
        _mm_storeu_ps(s + 4, _mm_add_ps(_mm_add_ps(b0, b1), _mm_add_ps(b2, b3)));
        const float n0 = norm[i];
        for (int r = 0; r < nr; r++) logits[r * SUB + i] += s[r] * n0;
        if (i + 1 < count) {
            const float n1 = norm[i + 1];
            for (int r = 0; r < nr; r++) logits[r * SUB + i + 1] += s[4 + r] * n1;
        }
    }
}
#undef QJL_PAIR_ADD

#define QJL_BY_BITS23(F, NR, ...)                                                                                       \
    switch (bits) {                                                                                                    \
    case 2: F(2, NR, __VA_ARGS__); break;                                                                              \
    default: F(3, NR, __VA_ARGS__); break;                                                                             \
    }

/* keys of pairs_ok(bits, group, n): T their pair_table */
QJL_AVX2 static void score_pairs(const qjl_key_term *k, int nr, const uint8_t *codes, const float *norm, int64_t count,
                                 const float *T, float *logits) {
    const int bits = k->bits;
    QJL_ROWS_OF(QJL_BY_BITS23, score_pairs_, k, codes, norm, count, T, logits)
}

/* Lane-sliced traversal for codes of b <= 5 bits when a vector's n codes are a multiple of the slab (64 codes for
 * b <= 4, 32 for b = 5; the other sizes take the loops above).  One 256-bit register holds a slab, L = slab / 8
 * codes per 32-bit lane: lane i the codes L*i .. L*i + L - 1 (slab_load: b = 1 vpmovzxbd, 2 vpmovzxwd, 3 vpshufb of
 * 24 bytes, 4 a plain load, 5 vpshufb of 20 bytes and a shift of the odd lanes by 4; never a byte past the slab),
 * and shifting all lanes right by kk * b puts code L*i + kk at the low bits of lane i: register kk of slab s holds
 * coordinates s * slab + L*i + kk.  Keys read query rows permuted the same way (slice_rows), values accumulate in
 * that order and are put back at the end of a work item (unslice_rows).  Per 8 codes it saves the word's
 * broadcast and the variable shift of unpack8 (one immediate shift instead), and b <= 2 looks up with the in-lane
 * vpermilps: per token (d = 128, 4 query rows, one thread, the AVX2-only AMD EPYC of 2026-11-27) 3-bit keys 75 -> 56
 * ns and 2-bit values 75 -> 52 ns in a scratch microbenchmark.  The same products as unpack8's loops, summed in
 * another order (float rounding only). */
static inline int slab_codes(int bits) { return bits == 5 ? 32 : 64; }

static int sliced_ok(int bits, int64_t n) { return bits >= 1 && bits <= 5 && n > 0 && n % slab_codes(bits) == 0; }

/* q [RW][n] -> qs [RW][n]: qs[r][s + 8kk + i] = q[r][s + L i + kk] for each slab s (L codes per lane);
 * unslice_rows is its inverse */
static void slice_rows(const float *q, int64_t n, int bits, float *qs) {
    const int S = slab_codes(bits), L = S / 8;
    for (int r = 0; r < RW; r++)
        for (int64_t s = 0; s < n; s += S)
            for (int kk = 0; kk < L; kk++)
                for (int i = 0; i < 8; i++) qs[r * n + s + 8 * kk + i] = q[r * n + s + L * i + kk];
}

static void unslice_rows(float *o, int64_t n, int bits, float *tmp) {
    const int S = slab_codes(bits), L = S / 8;
    for (int r = 0; r < RW; r++) {
        memcpy(tmp, o + r * n, sizeof(float) * (size_t)n);
        for (int64_t s = 0; s < n; s += S)
            for (int kk = 0; kk < L; kk++)
                for (int i = 0; i < 8; i++) o[r * n + s + L * i + kk] = tmp[s + 8 * kk + i];
    }
}

/* the slab at p in lanes, code L*i + kk of the slab at bit kk * bits of lane i (bits above the lane's codes: zero,
 * or for b = 5 the next lane's first bits) */
QJL_AVX2 static inline __attribute__((always_inline)) __m256i slab_load(const uint8_t *p, const int bits) {
    if (bits == 1) return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    if (bits == 2) return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    if (bits == 3) { /* lanes 0-3 from bytes 0-11 (a load at p), lanes 4-7 from bytes 12-23 (a load at p + 8) */
        const __m256i spread = _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,
                                                4, 5, 6, -1, 7, 8, 9, -1, 10, 11, 12, -1, 13, 14, 15, -1);
        const __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                                  _mm_loadu_si128((const __m128i *)(p + 8)), 1);
        return _mm256_shuffle_epi8(x, spread);
    }
    if (bits == 5) { /* lane i: bits 20i .. 20i + 19, from byte 20i / 8 on (odd lanes then 4 bits further):
                        lanes 0-3 from bytes 0-9 (a load at p), lanes 4-7 from bytes 10-19 (a load at p + 4) */
        const __m256i spread = _mm256_setr_epi8(0, 1, 2, -1, 2, 3, 4, -1, 5, 6, 7, -1, 7, 8, 9, -1,
                                                6, 7, 8, -1, 8, 9, 10, -1, 11, 12, 13, -1, 13, 14, 15, -1);
        const __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                                  _mm_loadu_si128((const __m128i *)(p + 4)), 1);
        return _mm256_srlv_epi32(_mm256_shuffle_epi8(x, spread), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    }
    return _mm256_loadu_si256((const __m256i *)p);
}

/* the centroids of the codes at the low bits of each lane (bits above them ignored) */
QJL_AVX2 static inline __attribute__((always_inline)) __m256 slab_lookup(const __m256i idx, const int bits,
                                                                      const unpack8_t *u) {
    if (bits <= 2) return _mm256_permutevar_ps(u->lo, idx); /* the table repeats in each 128-bit lane */
    __m256 v = _mm256_permutevar8x32_ps(u->lo, idx);
    if (bits == 3) return v;
    const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
    v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(u->hi, idx), b3);
    if (bits == 4) return v;
    const __m256 v1 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(u->lo2, idx), _mm256_permutevar8x32_ps(u->hi2, idx), b3);
    return _mm256_blendv_ps(v, v1, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 27)));
}

QJL_AVX2 static inline __attribute__((always_inline)) void score_sliced_(const int bits, const int nr,
                                                                      const qjl_key_term *k, const uint8_t *codes,
                                                                      const float *norm, int64_t count,
                                                                      const float *qs, float *logits) {
    const unpack8_t u = unpack_setup(bits, k->cent);
    const int S = slab_codes(bits), L = S / 8, sb = S * bits / 8; /* codes, codes per lane, bytes per slab */
    const int64_t n = k->n, slabs = n / S, cs = k->codes.stride_token;
    for (int64_t i = 0; i < count; i += 2) {
        const uint8_t *r0 = codes + i * cs, *r1 = codes + (i + 1 < count ? i + 1 : i) * cs;
        _mm_prefetch((const char *)(r0 + 40 * cs), _MM_HINT_T0);
        _mm_prefetch((const char *)(r0 + 41 * cs), _MM_HINT_T0);
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (int64_t sl = 0; sl < slabs; sl++) {
            __m256i x0 = slab_load(r0 + sl * sb, bits), x1 = slab_load(r1 + sl * sb, bits);
            const float *qk = qs + sl * S;
            for (int kk = 0; kk < L; kk++, qk += 8) {
                const __m256 v0 = slab_lookup(x0, bits, &u), v1 = slab_lookup(x1, bits, &u);
                x0 = _mm256_srli_epi32(x0, bits), x1 = _mm256_srli_epi32(x1, bits);
                for (int r = 0; r < nr; r++) {
                    const __m256 qr = _mm256_loadu_ps(qk + r * n);
                    a[r] = _mm256_fmadd_ps(v0, qr, a[r]);
                    a[4 + r] = _mm256_fmadd_ps(v1, qr, a[4 + r]);
                }
            }
        }
        add_pair(a, nr, norm, i, count, logits);
    }
}


/* keys of sliced_ok(bits, n): qs the query rows through slice_rows */
QJL_AVX2 static void score_sliced(const qjl_key_term *k, int nr, const uint8_t *codes, const float *norm,
                                  int64_t count, const float *qs, float *logits) {
    const int bits = k->bits;
    QJL_BY_ROWS5(score_sliced_, k, codes, norm, count, qs, logits)
}

/* values of sliced_ok(bits, n) with one scale group and no zero points: acc [RW][n] in the sliced order */
QJL_AVX2 static inline __attribute__((always_inline)) void mix_sliced_(const int bits, const int nr,
                                                                    const qjl_value_view *v, const uint8_t *codes,
                                                                    int64_t count, const float *pw, float *acc) {
    const unpack8_t u = unpack_setup(bits, v->cent);
    const int S = slab_codes(bits), L = S / 8, sb = S * bits / 8;
    const int64_t n = v->n, cs = v->codes.stride_token;
    for (int64_t sl = 0; sl < n / S; sl++) {
        for (int kk = 0; kk < L; kk += 2) {
            float *dst = acc + sl * S + 8 * kk;
            __m256 a[2 * RW];
            for (int r = 0; r < nr; r++) a[r] = _mm256_loadu_ps(dst + r * n), a[RW + r] = _mm256_loadu_ps(dst + r * n + 8);
            const uint8_t *src = codes + sl * sb;
            for (int64_t i = 0; i < count; i++, src += cs) {
                if (sl == 0 && kk == 0) _mm_prefetch((const char *)(src + 64 * cs), _MM_HINT_T0);
                const __m256i x = _mm256_srli_epi32(slab_load(src, bits), kk * bits);
                const __m256 v0 = slab_lookup(x, bits, &u), v1 = slab_lookup(_mm256_srli_epi32(x, bits), bits, &u);
                for (int r = 0; r < nr; r++) {
                    const __m256 w = _mm256_broadcast_ss(pw + r * SUB + i);
                    a[r] = _mm256_fmadd_ps(w, v0, a[r]);
                    a[RW + r] = _mm256_fmadd_ps(w, v1, a[RW + r]);
                }
            }
            for (int r = 0; r < nr; r++) _mm256_storeu_ps(dst + r * n, a[r]), _mm256_storeu_ps(dst + r * n + 8, a[RW + r]);
        }
    }
}

/* (not inlined: run_item calls it per residue of cycled values too, and GCC then inlined it there, as it never did
 * before, into a run_item twice the size) */
QJL_AVX2 __attribute__((noinline)) static void mix_sliced(const qjl_value_view *v, int nr, const uint8_t *codes,
                                                          int64_t count, const float *pw, float *acc) {
    const int bits = v->bits;
    QJL_BY_ROWS5(mix_sliced_, v, codes, count, pw, acc)
}
#else
#define QJL_HAVE_AVX2 0
static int cpu_has_avx2(void) { return 0; }
#endif
