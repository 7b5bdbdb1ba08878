/* Integer path of the CPU decode (simd = 2, impl "c-int"): AVX-512 VBMI + VNNI (AMD Zen 4, Intel Ice Lake and
 * later), chosen at run time, for codes of b <= 5 bits.  Byte-granular unpacking: the 4b bytes holding 32 codes
 * are spread so that qword i holds codes 8i..8i+7 (vpermb; for keys two tokens' bytes at once, vpermt2b), vpmultishiftqb
 * moves code j of each qword to the low bits of byte j, and vpermb looks the codes up in a table of int8
 * centroids (the table repeats every 2^b entries, so the neighbouring codes' bits left above need no mask).
 * Keys: two tokens per zmm (token 0 in the low half), each query row's 32 bytes in both halves, so one vpdpbusd
 * per row and chunk serves both tokens; the sums reduced per token without vphaddd (hsum2x4_i32).  On the Zen 5
 * of 2026-11-30 this took one thread 6% less time than two 256-bit lookups and vphaddd
 * (`benchmarks/kernel_speed.py --tokens 65536 --codecs tq-k3v2 --threads 1`, 4.71-4.93 ms against 5.08-5.13).
 *
 *   Keys: the query rows are rounded to int8 per row (scale max|q| / 127), the centroids to int8 (scale
 *   max|c| / 127, stored + 128 as unsigned bytes), and vpdpbusd sums 4 products per lane in int32:
 *       s[t] = norm[t] * sq * sc * (sum_c q8[c] * (c8[code] + 128) - 128 * sum_c q8[c]).
 *   Error against the fp32 sum: |q - sq q8| <= sq / 2 and |c - sc c8| <= sc / 2 per coordinate, so
 *       |ds[t]| <= norm[t] * (||c[code[t]]||_1 * sq + ||q||_1 * sc) / 2        (exact int32 arithmetic).
 *   Values: the pass's weights w = p * scale are rounded to int16 per (group, row) (scale W = max w / 32767)
 *   and the centroids to int8 (sc as above); vpdpwssd sums two tokens' products per lane in int32
 *   (|sum| <= 32767 * 512 * 127 = 2130640384 < 2^31 over a pass of SUB = 512 tokens: SUB may not grow), and
 *   the pass ends with one float multiply-add per coordinate: o[c] += W * sc * acc[c].  Error: |dw| <= W / 2 = max w / 65534 per token,
 *       |do[c]| <= (sum_t |dw_t|) * max|c| + (sum_t w_t) * sc / 2 .
 *   Measured against fp32: 0.3-0.75% of the values' scale at logits of std 2, far below the codecs' own error
 *   at these widths; the tests hold the kernel to a torch model of this arithmetic within 1e-3 of the values'
 *   scale (tests/kernels/test_cpu_int.py).
 * Keys of a vector codebook take the same sums: pairs of 3-bit codes through one 128-byte table of the codewords'
 * int8 coordinates (unpack_pairs32), 8-bit joint codes (pairs of 4-bit codes, fours of 2-bit codes) through 2 g
 * tables of 128 bytes (unpack_joint); the scale max|c| / 127 over all the codewords' coordinates.
 * For values two tokens are unpacked together into the int16 pairs (c0[j], c1[j]) vpdpwssd reads, with as few
 * shuffles as the width allows (on the Zen 5 the shuffles share their pipes with the products; mix_operands: 2-bit
 * codes from broadcasts, blends, per-word shifts and one vpermw; other widths one vpermt2b gather, a shift and one
 * vpermw; chunks cut short by the head dim the spread, vpmultishiftqb, vpermb and widening of before), and 2-4-bit
 * keys in full chunks come from 8-byte broadcasts instead of the spreading vpermt2b (unpack2x32b).  Zero points
 * (KIVI) stay in float as in the other paths. */
#if defined(__GNUC__) && defined(__x86_64__) && (__GNUC__ >= 9 || defined(__clang__))
#define QJL_HAVE_VNNI 1
#define QJL_VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")))

static int cpu_has_vnni(void) { /* decode_avx2.c's check (it initializes the CPU model) and the AVX-512 parts */
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") &&
           __builtin_cpu_supports("avx512vnni");
}

#define VNNI_MAX_BITS 5

/* int8 lookup table of b-bit centroids (repeated to 32 entries) and its scale max|c| / 127; `bias` 128 for the
 * unsigned key table */
static float int8_table(const float *cent, int bits, int bias, uint8_t *table) {
    float cmax = 0.0f;
    for (int j = 0; j < (1 << bits); j++) cmax = fabsf(cent[j]) > cmax ? fabsf(cent[j]) : cmax;
    const float sc = cmax > 0.0f ? cmax / 127.0f : 1.0f;
    for (int j = 0; j < 32; j++) table[j] = (uint8_t)(int)(lrintf(cent[j & ((1 << bits) - 1)] / sc) + bias);
    return sc;
}

/* int8 lookup table of a codebook of pairs of 3-bit codes (a vector codebook's keys, PackedCodes.group 2: 64
 * codewords of 2 coordinates, cent [64][2]): entry e | o << 6 is coordinate o of codeword e, + `bias`; returns its
 * scale max|c| / 127 over all 128 coordinates (int8_table's rounding) */
static float int8_pair_table(const float *cent, int bias, uint8_t *table) {
    float cmax = 0.0f;
    for (int j = 0; j < 128; j++) cmax = fabsf(cent[j]) > cmax ? fabsf(cent[j]) : cmax;
    const float sc = cmax > 0.0f ? cmax / 127.0f : 1.0f;
    for (int e = 0; e < 64; e++)
        for (int o = 0; o < 2; o++) table[e | o << 6] = (uint8_t)(int)(lrintf(cent[2 * e + o] / sc) + bias);
    return sc;
}

/* int8 lookup tables of a codebook of 8-bit joint codes (a vector codebook's keys in groups of g = 2 codes of 4 bits
 * or g = 4 of 2 bits: one byte per group, 256 codewords of g coordinates, cent [256][g]): table (s, h), 128 bytes
 * at table + (2 s + h) 128, holds coordinate s of codewords h 128 + i, + `bias`; returns the scale max|c| / 127 over
 * all 256 g coordinates (int8_table's rounding) */
static float int8_joint_table(const float *cent, int g, int bias, uint8_t *table) {
    float cmax = 0.0f;
    for (int j = 0; j < 256 * g; j++) cmax = fabsf(cent[j]) > cmax ? fabsf(cent[j]) : cmax;
    const float sc = cmax > 0.0f ? cmax / 127.0f : 1.0f;
    for (int sl = 0; sl < g; sl++)
        for (int e = 0; e < 256; e++)
            table[(2 * sl + (e >> 7)) * 128 + (e & 127)] = (uint8_t)(int)(lrintf(cent[e * g + sl] / sc) + bias);
    return sc;
}

/* q [RW][n] float -> q8 [RW][n32] (zero past n), per-row scales and sums; 0, or -1 where a row is not finite */
static int int8_rows(const float *q, int64_t n, int64_t n32, int8_t *q8, float *sq, int32_t *qsum) {
    for (int r = 0; r < RW; r++) {
        const float *x = q + r * n;
        float mx = 0.0f;
        for (int64_t c = 0; c < n; c++) {
            const float ax = fabsf(x[c]);
            if (!(ax <= 3.4e38f)) return -1; /* NaN or inf: the float path propagates it */
            mx = ax > mx ? ax : mx;
        }
        const float s = mx > 0.0f ? mx / 127.0f : 1.0f, inv = 1.0f / s;
        int32_t tot = 0;
        for (int64_t c = 0; c < n32; c++) {
            int v = c < n ? (int)lrintf(x[c] * inv) : 0;
            v = v > 127 ? 127 : v < -127 ? -127 : v;
            q8[r * n32 + c] = (int8_t)v;
            tot += v;
        }
        sq[r] = s;
        qsum[r] = tot;
    }
    return 0;
}

/* the byte-granular unpacking's index vectors for `qwords` qwords: spread (vpermb: qword i <- the `bits` bytes
 * holding codes 8i .. 8i + 7) and shifts (vpmultishiftqb: code k of the qword to byte k) */
static inline void unpack_indices(const int bits, int qwords, uint8_t *sp, uint8_t *sh) {
    for (int i = 0; i < qwords; i++)
        for (int k = 0; k < 8; k++) {
            sp[8 * i + k] = (uint8_t)(bits * i + (k < bits ? k : 0));
            sh[8 * i + k] = (uint8_t)(k * bits);
        }
}

/* The unpackings' index vectors and masks, built once (the decode calls vnni_tables where it takes the integer path
 * for keys; idempotent, so a race between threads writes the same bytes): the setups below run once per span, and
 * blocks of 16 slots make a span of 16 tokens */
static uint8_t U2_SP[6][64], U2_SH[6][64]; /* unpack2x32, widths 1-5 */
static uint8_t UP_SP[32], UP_SH[32];       /* unpack_pairs32 */
static uint8_t UJ_SP[5][64];               /* unpack_joint, g = 2, 4 */
static uint64_t UJ_SLOT[5][4];
static int vnni_ready = 0;

static void vnni_tables(void) {
    if (__atomic_load_n(&vnni_ready, __ATOMIC_ACQUIRE)) return;
    for (int b = 1; b <= 5; b++) {
        unpack_indices(b, 4, U2_SP[b], U2_SH[b]);
        for (int i = 0; i < 32; i++) U2_SP[b][32 + i] = (uint8_t)(64 + U2_SP[b][i]), U2_SH[b][32 + i] = U2_SH[b][i];
    }
    unpack_indices(3, 4, UP_SP, UP_SH);
    for (int i = 0; i < 32; i++) UP_SH[i] = (uint8_t)(3 * ((i & 7) & ~1));
    for (int g = 2; g <= 4; g += 2) {
        for (int c = 0; c < 64; c++) UJ_SP[g][c] = (uint8_t)(c < 32 ? c / g : 64 + (c - 32) / g);
        for (int sl = 0; sl < g; sl++) {
            uint64_t m = 0;
            for (int c = 0; c < 64; c++) m |= (uint64_t)(c % g == sl) << c;
            UJ_SLOT[g][sl] = m;
        }
    }
    __atomic_store_n(&vnni_ready, 1, __ATOMIC_RELEASE);
}

/* Pairs of 3-bit codes (a vector codebook's joint 6-bit codes e = code[2p] | code[2p + 1] << 3): the same spread as
 * 3-bit scalar codes, but vpmultishiftqb moves pair p's 6 bits (bits 6p.. of the qword: a pair never straddles
 * the qword's 3 bytes) to both its bytes 2p and 2p + 1; vpternlogd keeps the low 6 bits and sets bit 6 in odd
 * bytes, and one vpermt2b over the 128-byte pair table (int8_pair_table: entry e | o << 6) gives each byte its
 * coordinate of the codeword.  Five instructions per 32 codes against the scalar codes' four. */
typedef struct {
    __m256i spread, shifts, keep, odd;
    __m512i lo, hi;
} unpack_pairs32_t;

QJL_VNNI static inline __attribute__((always_inline)) unpack_pairs32_t unpack_pairs32_setup(const uint8_t *table) {
    unpack_pairs32_t u; /* (index vectors from vnni_tables) */
    u.spread = _mm256_loadu_si256((const __m256i *)UP_SP);
    u.shifts = _mm256_loadu_si256((const __m256i *)UP_SH);
    u.keep = _mm256_set1_epi8(0x3f);
    u.odd = _mm256_set1_epi16(0x4000);
    u.lo = _mm512_loadu_si512((const void *)table);
    u.hi = _mm512_loadu_si512((const void *)(table + 64));
    return u;
}

/* the int8 table entries of the 32 codes (16 pairs) at p (12 bytes; `mask` the bytes to read) */
QJL_VNNI static inline __attribute__((always_inline)) __m256i unpack_pairs32(const uint8_t *p, __mmask32 mask,
                                                                          const unpack_pairs32_t *u) {
    const __m256i raw = _mm256_maskz_loadu_epi8(mask, p);
    const __m256i codes = _mm256_multishift_epi64_epi8(u->shifts, _mm256_permutexvar_epi8(u->spread, raw));
    const __m256i idx = _mm256_ternarylogic_epi32(codes, u->keep, u->odd, 0xEA); /* (codes & keep) | odd */
    return _mm512_castsi512_si256(_mm512_permutex2var_epi8(u->lo, _mm512_castsi256_si512(idx), u->hi));
}

/* Two tokens' 32 codes of 8-bit joint codes (g = 2 at 4 bits, 4 at 2 bits; 32 / g bytes per token and chunk): one
 * vpermt2b puts token t's group byte of coordinate c at byte 32 t + c of X; then for each coordinate slot s and
 * half h (the byte's bit 7) one vpermt2b over table (s, h) (int8_joint_table) writes, under the mask of the bytes
 * with that slot and half, the int8 coordinate into X -- the other bytes keep their code for the next lookups (the
 * masks are disjoint) -- so 2 g lookups give both tokens' operands (token 0: the low 256 bits). */
typedef struct {
    __m512i spread, t[16]; /* t[2 i], t[2 i + 1]: the halves of table i = 2 s + h */
    __mmask64 slot[4];
} unpack_joint_t;

QJL_VNNI static inline __attribute__((always_inline)) void unpack_joint_setup(const int g, const uint8_t *table,
                                                                           unpack_joint_t *u) {
    u->spread = _mm512_loadu_si512((const void *)UJ_SP[g]); /* (index vectors and masks from vnni_tables) */
    for (int i = 0; i < 4 * g; i++) u->t[i] = _mm512_loadu_si512((const void *)(table + 64 * i));
    for (int sl = 0; sl < g; sl++) u->slot[sl] = (__mmask64)UJ_SLOT[g][sl];
}

QJL_VNNI static inline __attribute__((always_inline)) void unpack_joint(const int g, const uint8_t *p0,
                                                                     const uint8_t *p1, __mmask32 mask,
                                                                     const unpack_joint_t *u, __m256i *v0,
                                                                     __m256i *v1) {
    const __m512i a = _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(mask, p0));
    const __m512i b = _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(mask, p1));
    __m512i x = _mm512_permutex2var_epi8(a, u->spread, b);
    const __mmask64 hi = _mm512_movepi8_mask(x);
    for (int sl = 0; sl < g; sl++) {
        x = _mm512_mask2_permutex2var_epi8(u->t[4 * sl], x, u->slot[sl] & ~hi, u->t[4 * sl + 1]);
        x = _mm512_mask2_permutex2var_epi8(u->t[4 * sl + 2], x, u->slot[sl] & hi, u->t[4 * sl + 3]);
    }
    *v0 = _mm512_castsi512_si256(x);
    *v1 = _mm512_extracti64x4_epi64(x, 1);
}

/* Two tokens' 32 scalar codes at once, in the two halves of a zmm: two masked loads, one vpermt2b spreads both
 * tokens' bytes (qwords 0-3: token 0, 4-7: token 1), one vpmultishiftqb and one vpermb over a 64-byte table (the
 * 32-byte table twice: it repeats every 2^b entries, so the neighbours' bits above need no mask). */
typedef struct {
    __m512i spread, shifts, table;
} unpack2x32_t;

QJL_VNNI static inline __attribute__((always_inline)) unpack2x32_t unpack2x32_setup(const int bits,
                                                                                 const uint8_t *table) {
    unpack2x32_t u; /* (index vectors from vnni_tables; token 1's bytes are vpermt2b's b, indices + 64) */
    u.spread = _mm512_loadu_si512((const void *)U2_SP[bits]);
    u.shifts = _mm512_loadu_si512((const void *)U2_SH[bits]);
    u.table = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)table)); /* the 32 bytes twice */
    return u;
}

/* the int8 table entries of the 32 codes at p0 (low half) and p1 (high half), 4b bytes each under `mask` */
QJL_VNNI static inline __attribute__((always_inline)) __m512i unpack2x32(const uint8_t *p0, const uint8_t *p1,
                                                                      __mmask32 mask, const unpack2x32_t *u) {
    const __m512i a = _mm512_maskz_loadu_epi8((__mmask64)mask, p0); /* (zmm loads: a ymm load cast to zmm went */
    const __m512i b = _mm512_maskz_loadu_epi8((__mmask64)mask, p1); /* through the stack in GCC's code) */
    const __m512i codes = _mm512_multishift_epi64_epi8(u->shifts, _mm512_permutex2var_epi8(a, u->spread, b));
    return _mm512_permutexvar_epi8(codes, u->table);
}

/* unpack2x32 for codes of 2-4 bits in full chunks (n a multiple of 32), without the spreading vpermt2b: qword i of a
 * token (codes 8i .. 8i + 7, bytes b i .. b i + b - 1 of the chunk's 4 b) lies in the 8 bytes at 0 (i < 2) or at
 * 4 b - 8 (i >= 2), so four 8-byte broadcasts from memory (loads, not shuffles: on the Zen 5 the shuffles share their
 * pipes with vpdpbusd) merged by qword masks give the register vpmultishiftqb reads, its shifts offset by where each
 * qword's bytes sit in its window.  The same table entries as unpack2x32, in the same bytes. */
typedef struct {
    __m512i shifts, table;
} unpack2x32b_t;

QJL_VNNI static inline __attribute__((always_inline)) unpack2x32b_t unpack2x32b_setup(const int bits,
                                                                                   const uint8_t *table) {
    unpack2x32b_t u;
    uint8_t sh[64];
    const int hi = 4 * bits - 8; /* the second window's first byte */
    for (int i = 0; i < 8; i++)
        for (int k = 0; k < 8; k++) {
            const int q = i & 3, start = q < 2 ? 0 : hi;
            sh[8 * i + k] = (uint8_t)((8 * (bits * q - start) + bits * k) & 63);
        }
    u.shifts = _mm512_loadu_si512((const void *)sh);
    u.table = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)table)); /* the 32 bytes twice */
    return u;
}

QJL_VNNI static inline __attribute__((always_inline)) __m512i unpack2x32b(const int bits, const uint8_t *p0,
                                                                       const uint8_t *p1, const unpack2x32b_t *u) {
    const int hi = 4 * bits - 8;
    __m512i x = _mm512_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)p0)); /* token 0: qwords 0-3, 1: 4-7 */
    if (hi) {
        x = _mm512_mask_broadcastq_epi64(x, 0x0C, _mm_loadl_epi64((const __m128i *)(p0 + hi)));
        x = _mm512_mask_broadcastq_epi64(x, 0x30, _mm_loadl_epi64((const __m128i *)p1));
        x = _mm512_mask_broadcastq_epi64(x, 0xC0, _mm_loadl_epi64((const __m128i *)(p1 + hi)));
    } else { /* 2 bits: the chunk is one 8-byte window */
        x = _mm512_mask_broadcastq_epi64(x, 0xF0, _mm_loadl_epi64((const __m128i *)p1));
    }
    return _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(u->shifts, x), u->table);
}

/* [t0 r0..3, t1 r0..3] (int32): the sums over each 256-bit half (token 0 low, token 1 high) of the rows' four
 * accumulators.  Two unpack-and-add steps leave each 128-bit lane's four sums per row, one lane shuffle adds each
 * token's two lanes; no vphaddd (three uops each on these CPUs) */
QJL_VNNI static inline __attribute__((always_inline)) __m256i hsum2x4_i32(__m512i a0, __m512i a1, __m512i a2,
                                                                       __m512i a3) {
    const __m512i b01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i b23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    const __m512i c = _mm512_add_epi32(_mm512_unpacklo_epi64(b01, b23), _mm512_unpackhi_epi64(b01, b23));
    const __m512i d = _mm512_add_epi32(c, _mm512_shuffle_i32x4(c, c, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castsi512_si256(_mm512_shuffle_i32x4(d, d, _MM_SHUFFLE(2, 0, 2, 0)));
}

static inline __mmask32 chunk_mask(int64_t n, int64_t c, int bits) { /* bytes of chunk c (32 codes from 32c) */
    const int64_t left = n - 32 * c, codes = left < 32 ? left : 32;
    const int64_t bytes = codes * bits / 8;
    return bytes >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << bytes) - 1u);
}

/* logits[r * SUB + i] += norm[i] * mul[r] * (dots[4 i + r] - off[r]), i < count, r < nr: the int32 sums
 * [token][4 rows] transposed 8 tokens at a time, offset, scaled and multiplied by the tokens' norms (one load) */
QJL_VNNI static inline void add_dots(const int nr, int64_t count, const int32_t *dots, const float *norm,
                                     const float *mul, const int32_t *off, float *logits) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) { /* [8 tokens][4 rows] -> [4 rows][8 tokens], then scaled and added */
        const __m256 x0 = _mm256_castsi256_ps(_mm256_load_si256((const __m256i *)(dots + 4 * i)));
        const __m256 x1 = _mm256_castsi256_ps(_mm256_load_si256((const __m256i *)(dots + 4 * i + 8)));
        const __m256 x2 = _mm256_castsi256_ps(_mm256_load_si256((const __m256i *)(dots + 4 * i + 16)));
        const __m256 x3 = _mm256_castsi256_ps(_mm256_load_si256((const __m256i *)(dots + 4 * i + 24)));
        /* x0 = t0r0..3 t1r0..3, x1 = t2.. t3.., x2 = t4 t5, x3 = t6 t7 */
        const __m256 y0 = _mm256_permute2f128_ps(x0, x2, 0x20), y1 = _mm256_permute2f128_ps(x0, x2, 0x31);
        const __m256 y2 = _mm256_permute2f128_ps(x1, x3, 0x20), y3 = _mm256_permute2f128_ps(x1, x3, 0x31);
        /* y0 = t0 | t4, y1 = t1 | t5, y2 = t2 | t6, y3 = t3 | t7 (4 rows each) */
        const __m256 z0 = _mm256_unpacklo_ps(y0, y1), z1 = _mm256_unpackhi_ps(y0, y1);
        const __m256 z2 = _mm256_unpacklo_ps(y2, y3), z3 = _mm256_unpackhi_ps(y2, y3);
        /* z0 = r0t0 r0t1 r1t0 r1t1 | (t4 t5), z1 = r2.. r3.., z2 = r0t2 r0t3 r1t2 r1t3, z3 = r2 r3 */
        const __m256 w[4] = {_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(z0), _mm256_castps_pd(z2))),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(z0), _mm256_castps_pd(z2))),
                             _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(z1), _mm256_castps_pd(z3))),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(z1), _mm256_castps_pd(z3)))};
        /* w[r] = row r's sums of tokens i..i+7 */
        const __m256 nv = _mm256_loadu_ps(norm + i);
        for (int r = 0; r < nr; r++) {
            const __m256 d = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_castps_si256(w[r]), _mm256_set1_epi32(off[r])));
            float *lg = logits + r * SUB + i;
            _mm256_storeu_ps(lg, _mm256_add_ps(_mm256_loadu_ps(lg), _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(mul[r])), nv)));
        }
    }
    for (; i < count; i++)
        for (int r = 0; r < nr; r++) logits[r * SUB + i] += (float)(dots[4 * i + r] - off[r]) * mul[r] * norm[i];
}

/* logits[r * SUB + i] += norm[i] * mul[r] * (sum_c q8[r][c] (c8[code[i][c]] + 128) - off[r]), i < count;
 * q8 [RW][n32], mul[r] = sq[r] * sc, off[r] = 128 * qsum[r].  Two tokens x 4 rows accumulate in 4 zmm registers
 * (token 0 in the low halves; named, so that they stay in registers), reduced by hsum2x4_i32 into lanes
 * [row + 4 * token] of the int32 `dots` [SUB][4]; then a 4 x 8 transpose per 8 tokens gives each row's 8 sums, offset, scaled and multiplied by
 * the 8 tokens' norms (one load) as they are added to the logits [RW][SUB].  `fixed`: the chunk count n32 / 32
 * as a constant (2 and 4, head dims 64 and 128: the chunk loop unrolled), or 0 (read from k->n). */
QJL_VNNI static inline __attribute__((always_inline)) void score_vnni_(const int bits, const int nr, const int fixed,
                                                                    const int grp, const qjl_key_term *k,
                                                                    const uint8_t *codes, const float *norm,
                                                                    int64_t count, const int8_t *q8,
                                                                    const uint8_t *table, const float *mul,
                                                                    const int32_t *off, float *logits) {
    /* grp: 0 scalar codes, 1 pairs of 3-bit codes (unpack_pairs32), 2 8-bit joint codes of 8 / bits codes
     * (unpack_joint); their tables are 32, 128 and 256 g bytes */
    unpack2x32_t uw;
    unpack_pairs32_t up;
    memset(&uw, 0, sizeof(uw));
    const int bcast = grp == 0 && fixed && bits >= 2 && bits <= 4 && k->n % 32 == 0;
    unpack2x32b_t ub;
    memset(&ub, 0, sizeof(ub));
    if (bcast) ub = unpack2x32b_setup(bits, table);
    else if (grp == 0) uw = unpack2x32_setup(bits, table);
    unpack_joint_t uj;
    memset(&up, 0, sizeof(up));
    if (grp == 1) up = unpack_pairs32_setup(table);
    if (grp == 2) unpack_joint_setup(8 / bits, table, &uj);
    const int64_t n = k->n, chunks = fixed ? fixed : (n + 31) / 32, cs = k->codes.stride_token;
    const __mmask32 last = chunk_mask(n, chunks - 1, bits);
    const int64_t n32 = 32 * chunks;
    int32_t dots[(SUB + 8) * 4] __attribute__((aligned(32))); /* [token][4 rows]: the integer sums */
    const int8_t *q0 = q8, *q1 = q8 + n32, *q2 = q8 + 2 * n32, *q3 = q8 + 3 * n32;
    /* fixed chunk counts: each row's chunks broadcast once, before the tokens (with the chunk loop unrolled they
     * stay in registers: 16 at d = 128 with 4 rows) */
    __m512i qb[4][4];
    for (int r = 0; r < 4 && fixed; r++)
        for (int c = 0; c < fixed; c++)
            qb[r][c] = r < nr ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(q8 + r * n32 + 32 * c)))
                              : _mm512_setzero_si512();
    for (int64_t i = 0; i < count; i += 2) {
        const uint8_t *r0 = codes + i * cs, *r1 = codes + (i + 1 < count ? i + 1 : i) * cs;
        _mm_prefetch((const char *)(r0 + 40 * cs), _MM_HINT_T0); /* 40 tokens ahead (a prefetch past the codes */
        _mm_prefetch((const char *)(r0 + 41 * cs), _MM_HINT_T0); /* never faults) */
        /* both tokens in one zmm (token 0 in the low half), each row's 32 query bytes in both halves */
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t c = 0; c < chunks; c++) {
            const __mmask32 m = c + 1 < chunks ? (__mmask32)0xffffffffu : last;
            __m512i v;
            if (bcast) {
                v = unpack2x32b(bits, r0 + c * 4 * bits, r1 + c * 4 * bits, &ub);
            } else if (grp == 0) {
                v = unpack2x32(r0 + c * 4 * bits, r1 + c * 4 * bits, m, &uw);
            } else {
                __m256i v0, v1;
                if (grp == 2)
                    unpack_joint(8 / bits, r0 + c * 4 * bits, r1 + c * 4 * bits, m, &uj, &v0, &v1);
                else
                    v0 = unpack_pairs32(r0 + c * 4 * bits, m, &up), v1 = unpack_pairs32(r1 + c * 4 * bits, m, &up);
                v = _mm512_inserti64x4(_mm512_castsi256_si512(v0), v1, 1);
            }
#define QJL_ROW(R)                                                                                                     \
    if (nr > R) a##R = _mm512_dpbusd_epi32(a##R, v, fixed ? qb[R][c & 3] :                                             \
                                                  _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(q##R + 32 * c))));
            QJL_ROW(0) QJL_ROW(1) QJL_ROW(2) QJL_ROW(3)
#undef QJL_ROW
        }
        _mm256_store_si256((__m256i *)(dots + 4 * i), hsum2x4_i32(a0, a1, a2, a3));
    }
    add_dots(nr, count, dots, norm, mul, off, logits);
}


QJL_VNNI static void score_vnni(const qjl_key_term *k, int nr, const uint8_t *codes, const float *norm, int64_t count,
                                const int8_t *q8, const uint8_t *table, const float *mul, const int32_t *off,
                                float *logits) {
    const int bits = k->bits;
/* the usual head dims' chunk counts as constants (the chunk loop unrolled), rows by QJL_ROWS_OF, widths by BY */
#define QJL_BY_CHUNKS(BY, GRP)                                                                                         \
    switch ((k->n + 31) / 32) {                                                                                        \
    case 2: QJL_ROWS_OF(BY, score_vnni_, 2, GRP, k, codes, norm, count, q8, table, mul, off, logits) break;            \
    case 4: QJL_ROWS_OF(BY, score_vnni_, 4, GRP, k, codes, norm, count, q8, table, mul, off, logits) break;            \
    default: QJL_ROWS_OF(BY, score_vnni_, 0, GRP, k, codes, norm, count, q8, table, mul, off, logits) break;           \
    }
#define QJL_PAIRS3(F, NR, ...) F(3, NR, __VA_ARGS__);
#define QJL_JOINT8(F, NR, ...) if (bits == 4) F(4, NR, __VA_ARGS__); else F(2, NR, __VA_ARGS__);
    if (k->group == 1) {
        QJL_BY_CHUNKS(QJL_BY_BITS5, 0) /* scalar codes, the 32-byte table */
    } else if (bits == 3) {
        QJL_BY_CHUNKS(QJL_PAIRS3, 1) /* pairs of 3-bit codes (vnni_term), the 128-byte pair table */
    } else {
        QJL_BY_CHUNKS(QJL_JOINT8, 2) /* 8-bit joint codes (vnni_term): pairs of 4-bit codes, fours of 2-bit codes */
    }
#undef QJL_JOINT8
#undef QJL_PAIRS3
#undef QJL_BY_CHUNKS
}

/* whether the integer path scores key term k: scalar codes of <= VNNI_MAX_BITS bits, pairs of 3-bit codes, and
 * 8-bit joint codes (pairs of 4-bit codes, fours of 2-bit codes); other grouped codes: the AVX2 fp32 loops */
static int vnni_term(const qjl_key_term *k) {
    if (k->group == 1) return k->bits <= VNNI_MAX_BITS;
    return (k->group == 2 && k->bits == 3) || (k->group == 2 && k->bits == 4) || (k->group == 4 && k->bits == 2);
}

/* one row's weights x [count] (floats) with their max mx -> dst int16 (zero at count, count + 1); returns the
 * row's scale W / 32767 * sc (W = mx) */
QJL_VNNI static float int16_row(const float *x, int64_t count, float mx, float sc, int16_t *dst) {
    const float inv = mx > 0.0f ? 32767.0f / mx : 0.0f;
    const __m256 vi = _mm256_set1_ps(inv);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) /* round to nearest even, then narrow (values in [0, 32767]) */
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtepi32_epi16(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vi))));
    for (; i < count; i++) dst[i] = (int16_t)lrintf(x[i] * inv);
    dst[count] = dst[count + 1] = 0;
    return mx / 32767.0f * sc;
}

/* the pass's weights pw [G][RW][SUB] (floats) -> w16 [G][RW][SUB + 2] int16 (zero past count) and mul[g][r] =
 * W / 32767 * sc, W = max_i pw[g][r][i] */
QJL_VNNI static void int16_weights(int64_t G, int nr, int64_t count, const float *pw, float sc, int16_t *w16,
                                   float *mul) {
    for (int64_t g = 0; g < G; g++)
        for (int r = 0; r < nr; r++) {
            const float *x = pw + (g * RW + r) * SUB;
            mul[g * RW + r] = int16_row(x, count, max_run(x, count, 0.0f), sc, w16 + (g * RW + r) * (SUB + 2));
        }
}

/* A row's softmax weights in one pass (one scale group, no zero points): p = exp(x - m) as exp_sum computes it
 * (returned: their sum, in exp_sum's order), pw = p * s, *pmax = max(0, pw[..]) as max_run(pw, len, 0.0f) gives
 * it (a NaN weight ignored); x is left as it was.  Equal to exp_sum, then value_weights' product, then max_run. */
QJL_VNNI static float exp_weights(const float *x, int64_t len, float m, const float *s, float *pw, float *pmax) {
    v8f tot = {0, 0, 0, 0, 0, 0, 0, 0};
    __m256 mx = _mm256_setzero_ps();
    int64_t i = 0;
#if QJL_HAVE_EXP16
    __m512 mx16 = _mm512_setzero_ps();
    for (; i + 16 <= len; i += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(m)));
        tot = add16_as_exp8(tot, e);
        const __m512 w = _mm512_mul_ps(e, _mm512_loadu_ps(s + i));
        _mm512_storeu_ps(pw + i, w);
        mx16 = _mm512_max_ps(w, mx16); /* `w > acc ? w : acc`: a NaN w keeps acc */
    }
    mx = _mm256_max_ps(_mm512_castps512_ps256(mx16), mx);
    mx = _mm256_max_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(mx16), 1)), mx);
#endif
    for (; i + 8 <= len; i += 8) {
        const v8f e = exp8(load8(x + i) - m);
        tot += e;
        __m256 ev;
        memcpy(&ev, &e, 32);
        const __m256 w = _mm256_mul_ps(ev, _mm256_loadu_ps(s + i));
        _mm256_storeu_ps(pw + i, w);
        mx = _mm256_max_ps(w, mx);
    }
    float sum = hsum8(tot), t[8], pm = 0.0f;
    _mm256_storeu_ps(t, mx);
    for (int j = 0; j < 8; j++) pm = t[j] > pm ? t[j] : pm;
    if (i < len) {
        float buf[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
        memcpy(buf, x + i, sizeof(float) * (size_t)(len - i));
        const v8f e = exp8(load8(buf) - m);
        sum += hsum8(e);
        for (int64_t j = 0; i + j < len; j++) {
            pw[i + j] = e[j] * s[i + j];
            pm = pw[i + j] > pm ? pw[i + j] : pm;
        }
    }
    *pmax = pm;
    return sum;
}

/* Two tokens' int16 operands of vpdpwssd for a chunk of 32 coordinates, plo and phi: 32-bit lane l holds the pair
 * (c8[code_t0], c8[code_t1]) of one coordinate.  On the Zen 5 (family 26) vpdpwssd issues on the same two pipes as the
 * shuffles (vpermb, vpermt2b, vpermw, vpmultishiftqb, vpmovsxbw), but not as blends and per-word shifts (a scratch
 * loop, 8 vpdpwssd per step: alone 1.03 ns, beside 8 of those shuffles 1.58-1.89, beside 8 vpblendmw or vpsrlvw
 * 1.06-1.08; docs/runs/kernel-pipes-20261130/pipes.c), so the operands are built with as few shuffles as the codes
 * allow.  Three ways (`kind`), the same int16 products in the same lanes up to the lane order of kind 1 (MIX_BCAST):
 *
 *   MIX_SPREAD (a chunk cut short: n not a multiple of 32): masked loads, one vpermt2b per 16 coordinates puts the
 *     bytes of codes 16h + 4i .. + 3 of token 0 and of token 1 in qword i, vpmultishiftqb moves code 16h + 4i + m of
 *     token t to byte 2m + t, vpermb looks the bytes up in the int8 table and vpmovsxbw widens them (8 shuffles per
 *     pair and chunk); lane l: coordinate l (plo), 16 + l (phi).
 *   MIX_BCAST (2-bit codes, full chunks): each token's chunk (8 bytes: four 16-bit words of 8 codes) broadcast from
 *     memory to every qword (a load, no shuffle), one blend per register interleaves the two tokens' words
 *     (plo: t0 w0, t1 w0, t0 w2, t1 w2 per qword, t1's qword shifted up 16 bits; phi: the odd words, t0's shifted
 *     down), vpsrlvw shifts qword q's words right by 2q, and one vpermw looks the words up in the int16 table (the
 *     int8 centroids widened and repeated every 4 entries: the bits above a code pick the same entry): 2 shuffles;
 *     lane 2q + h: coordinate q + 16h (plo), q + 8 + 16h (phi).
 *   MIX_WORDS (1, 3, 4, 5 bits, full chunks): one vpermt2b gathers into lane j the two bytes of each token holding
 *     code j (from byte B_j = floor(b j / 8)), vpsrlvw shifts each word right by b j - 8 B_j (<= 7, so the code lies
 *     in the word: 7 + b <= 16), one vpermw: 4 shuffles; lane l: coordinate l (plo), 16 + l (phi).
 *
 * int32 addition is exact, so every kind gives the same sums. */
enum { MIX_SPREAD, MIX_BCAST, MIX_WORDS };

typedef struct {
    __m256i spread[2], shifts[2], table8; /* MIX_SPREAD */
    __m512i gather[2], wshift[2], table16; /* MIX_WORDS (gather, wshift), MIX_BCAST (wshift[0]), both table16 */
} mix_ops_t;

QJL_VNNI static inline __attribute__((always_inline)) mix_ops_t mix_setup(const int kind, const int bits,
                                                                       const uint8_t *table) {
    mix_ops_t u;
    memset(&u, 0, sizeof(u));
    if (kind == MIX_SPREAD) {
        for (int h = 0; h < 2; h++) {
            uint8_t sp[32], sh[32];
            for (int i = 0; i < 4; i++) {
                const int first = (16 * h + 4 * i) * bits, byte = first / 8, off = first % 8;
                for (int k = 0; k < 8; k++) {
                    sp[8 * i + k] = (uint8_t)(k < 3 ? byte + k : k < 6 ? 32 + byte + k - 3 : 0);
                    sh[8 * i + k] = (uint8_t)((k & 1 ? 24 : 0) + off + bits * (k >> 1));
                }
            }
            u.spread[h] = _mm256_loadu_si256((const __m256i *)sp);
            u.shifts[h] = _mm256_loadu_si256((const __m256i *)sh);
        }
        u.table8 = _mm256_loadu_si256((const __m256i *)table);
        return u;
    }
    int16_t t16[32], sh16[2][32];
    uint8_t gi[2][64];
    for (int j = 0; j < 32; j++) t16[j] = (int16_t)(int8_t)table[j & ((1 << bits) - 1)];
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 16; l++) {
            const int j = 16 * h + l, byte = bits * j / 8;
            gi[h][4 * l] = (uint8_t)byte, gi[h][4 * l + 1] = (uint8_t)(byte + 1);
            gi[h][4 * l + 2] = (uint8_t)(64 + byte), gi[h][4 * l + 3] = (uint8_t)(64 + byte + 1);
            /* MIX_BCAST: qword q = words 4q .. 4q + 3 shift by 2q; MIX_WORDS: lane l's words by b j - 8 B_j */
            sh16[h][2 * l] = sh16[h][2 * l + 1] = (int16_t)(kind == MIX_BCAST ? 2 * (l / 2) : bits * j - 8 * byte);
        }
    u.table16 = _mm512_loadu_si512((const void *)t16);
    for (int h = 0; h < 2; h++) {
        if (kind == MIX_WORDS) u.gather[h] = _mm512_loadu_si512((const void *)gi[h]); /* (MIX_BCAST: no gather) */
        u.wshift[h] = _mm512_loadu_si512((const void *)sh16[h]);
    }
    return u;
}

/* the operands of the tokens at p0, p1 (the chunk's 4 b bytes each; `m` the bytes to read, MIX_SPREAD) */
QJL_VNNI static inline __attribute__((always_inline)) void mix_operands(const int kind, const int bits,
                                                                     const uint8_t *p0, const uint8_t *p1,
                                                                     __mmask32 m, const mix_ops_t *u, __m512i *plo,
                                                                     __m512i *phi) {
    if (kind == MIX_SPREAD) {
        const __m256i r0 = _mm256_maskz_loadu_epi8(m, p0), r1 = _mm256_maskz_loadu_epi8(m, p1);
        const __m256i c0 = _mm256_multishift_epi64_epi8(u->shifts[0], _mm256_permutex2var_epi8(r0, u->spread[0], r1));
        const __m256i c1 = _mm256_multishift_epi64_epi8(u->shifts[1], _mm256_permutex2var_epi8(r0, u->spread[1], r1));
        *plo = _mm512_cvtepi8_epi16(_mm256_permutexvar_epi8(c0, u->table8));
        *phi = _mm512_cvtepi8_epi16(_mm256_permutexvar_epi8(c1, u->table8));
    } else if (kind == MIX_BCAST) { /* (broadcasts from memory: a load each; from a general register, a transfer) */
        const __mmask32 odd_words = 0xAAAAAAAAu;
        const __m512i a = _mm512_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)p0));
        const __m512i b = _mm512_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)p1));
        const __m512i x = _mm512_mask_blend_epi16(odd_words, a, _mm512_slli_epi64(b, 16));
        const __m512i y = _mm512_mask_blend_epi16(odd_words, _mm512_srli_epi64(a, 16), b);
        *plo = _mm512_permutexvar_epi16(_mm512_srlv_epi16(x, u->wshift[0]), u->table16);
        *phi = _mm512_permutexvar_epi16(_mm512_srlv_epi16(y, u->wshift[0]), u->table16);
    } else {
        const __mmask64 mb = (__mmask64)((1ull << (4 * bits)) - 1); /* the chunk's 4 b bytes (<= 20) */
        const __m512i r0 = _mm512_maskz_loadu_epi8(mb, p0), r1 = _mm512_maskz_loadu_epi8(mb, p1);
        *plo = _mm512_permutexvar_epi16(_mm512_srlv_epi16(_mm512_permutex2var_epi8(r0, u->gather[0], r1), u->wshift[0]),
                                        u->table16);
        *phi = _mm512_permutexvar_epi16(_mm512_srlv_epi16(_mm512_permutex2var_epi8(r0, u->gather[1], r1), u->wshift[1]),
                                        u->table16);
    }
}

/* two tokens' int16 weights as the int32 vpdpwssd pairs them with, in every lane (a broadcast from memory: a
 * value built in a general register and moved over costs a transfer per row and pair) */
QJL_VNNI static inline __attribute__((always_inline)) __m512i pair_weights(const int16_t *w) {
    int32_t pair;
    memcpy(&pair, w, 4);
    return _mm512_set1_epi32(pair);
}

/* acc[r][c] += mul[g(c)][r] * sum_i w16[g(c)][r][i] * c8[code[i][c]], i < count (weights in pairs of tokens, each
 * pair one 32-bit broadcast from memory; an odd span's last token alone, its partner weight zero; accumulators
 * named so that they stay in registers), the operands built by mix_operands' `kind` */
QJL_VNNI static inline __attribute__((always_inline)) void mix_kind_(const int kind, const int bits, const int nr,
                                                                  const qjl_value_view *v, int ns,
                                                                  const uint8_t *const *codes, const int64_t *offs,
                                                                  const int64_t *cnts, const int16_t *w16,
                                                                  const uint8_t *table, const float *mul, float *acc) {
    const mix_ops_t u = mix_setup(kind, bits, table);
    const int64_t n = v->n, chunks = (n + 31) / 32, cs = v->codes.stride_token, gs = v->group_size;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t g = v->groups == 1 ? 0 : (32 * c) / gs;
        const __mmask32 m = chunk_mask(n, c, bits);
        const int16_t *w0 = w16 + g * RW * (SUB + 2), *w1 = w0 + (SUB + 2), *w2 = w1 + (SUB + 2), *w3 = w2 + (SUB + 2);
        __m512i lo0 = _mm512_setzero_si512(), lo1 = lo0, lo2 = lo0, lo3 = lo0, hi0 = lo0, hi1 = lo0, hi2 = lo0,
                hi3 = lo0;
        for (int si = 0; si < ns; si++) { /* the pass's spans, into the same accumulators */
            const uint8_t *src = codes[si] + c * 4 * bits;
            const int64_t count = cnts[si], off = offs[si];
            for (int64_t i = 0; i < count; i += 2, src += 2 * cs) {
                const int odd = i + 1 >= count; /* an odd span's last token: it goes alone */
                if (c == 0) _mm_prefetch((const char *)(src + 64 * cs), _MM_HINT_T0); /* the first chunk reads DRAM */
                __m512i plo, phi;
                mix_operands(kind, bits, src, odd ? src : src + cs, m, &u, &plo, &phi);
#define QJL_ROW(R, W)                                                                                                  \
    if (nr > R) {                                                                                                      \
        const __m512i w = W;                                                                                           \
        lo##R = _mm512_dpwssd_epi32(lo##R, plo, w);                                                                    \
        hi##R = _mm512_dpwssd_epi32(hi##R, phi, w);                                                                    \
    }
#define QJL_PAIR(R) pair_weights(w##R + off + i)                        /* the pair's weights, one broadcast load */
#define QJL_ALONE(R) _mm512_set1_epi32((int32_t)(uint16_t)w##R[off + i]) /* the last token's weight, partner zero */
                if (!odd) {
                    QJL_ROW(0, QJL_PAIR(0)) QJL_ROW(1, QJL_PAIR(1)) QJL_ROW(2, QJL_PAIR(2)) QJL_ROW(3, QJL_PAIR(3))
                } else {
                    QJL_ROW(0, QJL_ALONE(0)) QJL_ROW(1, QJL_ALONE(1)) QJL_ROW(2, QJL_ALONE(2)) QJL_ROW(3, QJL_ALONE(3))
                }
#undef QJL_ROW
#undef QJL_PAIR
#undef QJL_ALONE
            }
        }
        const int64_t live = n - 32 * c < 32 ? n - 32 * c : 32;
        const __m512i L[4] = {lo0, lo1, lo2, lo3}, H[4] = {hi0, hi1, hi2, hi3};
        for (int r = 0; r < nr; r++) {
            int32_t s[32];
            _mm512_storeu_si512(s, L[r]);
            _mm512_storeu_si512(s + 16, H[r]);
            const float f = mul[g * RW + r];
            float *o = acc + r * n + 32 * c;
            if (kind == MIX_BCAST) /* lane 2q + h: coordinate q + 16h (plo), q + 8 + 16h (phi) */
                for (int q = 0; q < 8; q++) {
                    o[q] += f * (float)s[2 * q];
                    o[q + 16] += f * (float)s[2 * q + 1];
                    o[q + 8] += f * (float)s[16 + 2 * q];
                    o[q + 24] += f * (float)s[16 + 2 * q + 1];
                }
            else
                for (int64_t j = 0; j < live; j++) o[j] += f * (float)s[j];
        }
    }
}

QJL_VNNI static inline __attribute__((always_inline)) void mix_vnni_(const int bits, const int nr, const qjl_value_view *v,
                                                                  int ns, const uint8_t *const *codes,
                                                                  const int64_t *offs, const int64_t *cnts,
                                                                  const int16_t *w16, const uint8_t *table,
                                                                  const float *mul, float *acc) {
    if (v->n % 32) mix_kind_(MIX_SPREAD, bits, nr, v, ns, codes, offs, cnts, w16, table, mul, acc);
    else if (bits == 2) mix_kind_(MIX_BCAST, bits, nr, v, ns, codes, offs, cnts, w16, table, mul, acc);
    else mix_kind_(MIX_WORDS, bits, nr, v, ns, codes, offs, cnts, w16, table, mul, acc);
}

/* the pass's value codes, as ns spans (codes[s]: its first token's codes, offs[s]: its first token's index in
 * the pass, cnts[s]: its tokens), mixed with the pass's int16 weights w16 [G][RW][SUB + 2] */
QJL_VNNI static void mix_vnni(const qjl_value_view *v, int nr, int ns, const uint8_t *const *codes, const int64_t *offs,
                              const int64_t *cnts, const int16_t *w16, const uint8_t *table, const float *mul,
                              float *acc) {
    const int bits = v->bits;
    QJL_BY_ROWS5(mix_vnni_, v, ns, codes, offs, cnts, w16, table, mul, acc)
}
#else
#define QJL_HAVE_VNNI 0
#define VNNI_MAX_BITS 0
static int cpu_has_vnni(void) { return 0; }
#endif
