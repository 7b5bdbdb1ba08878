/* CPU decode attention over packed codes.
 *
 * Work items: (sequence x KV head, row chunk of RW = 4 query rows, token split).  Portable path,
 * the C twin of the numba kernel in cpu.py (same algorithm and layouts, see cpu.py and plan.py):
 * a table T[field][value][RW] scores all rows with one 16-byte vector load per byte-sized field
 * of packed codes; values are mixed through a histogram over the same fields.  AVX-512 VBMI path
 * (chosen at run time; `simd` bits 1 values, 2 keys, 4 softmax and exact tokens): codes of 1-4
 * bits unpacked in registers (dq16), keys scored 4 tokens x RW rows at a time (score512), values
 * mixed with register-blocked accumulators (mix512), vectorized exp.  Online softmax within an
 * item, splits merged at the end, then the exact sinks + window merged in (exact512/exact_part).
 * Built once per machine by cpu_build.py (cffi), OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RW 4
typedef float v4 __attribute__((vector_size(16)));

static inline v4 load4(const float *p) { v4 x; memcpy(&x, p, 16); return x; }

/* norms, scales and zero points are read in their storage dtype: 0 = fp32, 1 = fp16, 2 = bf16, 3 = float8 e4m3 */
static inline int64_t kind_bytes(int kind) { return kind == 0 ? 4 : kind == 3 ? 1 : 2; }
static inline float e4m3_to_float(uint8_t b) {
    const uint32_t e = (b >> 3) & 0xf, m = b & 7;
    float f;
    if (e == 0) f = (float)m * 0.001953125f; /* subnormal: m * 2^-9 */
    else {
        const uint32_t bits = ((e + 127 - 7) << 23) | (m << 20);
        memcpy(&f, &bits, 4);
    }
    return (b & 0x80) ? -f : f;
}
#if defined(__F16C__)
#include <immintrin.h>
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal: normalize */
            int e = -1;
            uint32_t m = man;
            do { e++; m <<= 1; } while ((m & 0x400) == 0);
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif
static inline float read_f(const void *p, int64_t i, int kind) {
    if (kind == 0) return ((const float *)p)[i];
    if (kind == 4) return 1.0f; /* internal: no array (the exact tokens' unit norms and scales) */
    if (kind == 3) return e4m3_to_float(((const uint8_t *)p)[i]);
    uint16_t h = ((const uint16_t *)p)[i];
    if (kind == 1) return half_to_float(h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline void store4(float *p, v4 x) { memcpy(p, &x, 16); }

static inline __attribute__((always_inline)) uint64_t load_word(const uint8_t *p, const int bits) {
    uint64_t w = 0;
    for (int j = 0; j < bits; j++) w |= (uint64_t)p[j] << (8 * j);
    return w;
}

/* T[i][v][r] = sum_j q[r][i*g+j] * cent[code_j(v)], g = 8 / bits codes per field */
static inline __attribute__((always_inline)) void build_table(const int bits, const float *q, int64_t n,
                                                              const float *cent, float *tab) {
    const int g = 8 / bits, width = g * bits, mask = (1 << bits) - 1;
    const int64_t nv = (int64_t)1 << width;
    for (int64_t i = 0; i < n / g; i++)
        for (int64_t v = 0; v < nv; v++) {
            v4 acc = {0, 0, 0, 0};
            for (int j = 0; j < g; j++) {
                const int64_t c = i * g + j;
                const float cv = cent[(v >> (j * bits)) & mask];
                v4 qc = {q[c], q[n + c], q[2 * n + c], q[3 * n + c]};
                acc += qc * cv;
            }
            store4(tab + (i * nv + v) * RW, acc);
        }
}

/* out[r][t - t0] += norm[t] * sum_fields T[field][value(t)][r] */
static inline __attribute__((always_inline)) void score(const int bits, const int64_t chunks, const uint8_t *codes,
                                                        int64_t nb, const float *tab, const void *norm, int nkind,
                                                        int64_t t0, int64_t t1, float *out, int64_t len) {
    const int g = 8 / bits, width = g * bits, per = 8 / g;
    const int64_t nv = (int64_t)1 << width;
    const uint64_t fmask = (uint64_t)nv - 1;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *row = codes + t * nb;
        v4 acc[4] = {{0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}};
        for (int64_t ch = 0; ch < chunks; ch++) {
            const uint64_t w = load_word(row + ch * bits, bits);
            const float *base = tab + ch * per * nv * RW;
            for (int f = 0; f < per; f++)
                acc[(ch * per + f) & 3] += load4(base + (f * nv + ((w >> (f * width)) & fmask)) * RW);
        }
        const v4 a = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        const float nt = read_f(norm, t, nkind);
        for (int r = 0; r < RW; r++) out[r * len + (t - t0)] += a[r] * nt;
    }
}

/* hist[field][value][r] += p[r][t - t0] * scale[t][group]; zsum[group][r] += p * zero (one pass over codes) */
static inline __attribute__((always_inline)) void mix(const int bits, const int64_t chunks, const uint8_t *codes,
                                                      int64_t nb, int64_t gs,
                                                      int64_t ngroups, const void *scale, const void *zero,
                                                      int skind, int has_zero, const float *p, int64_t len,
                                                      int64_t t0, int64_t t1, float *hist, float *zsum) {
    const int g = 8 / bits, width = g * bits, per = 8 / g;
    const int64_t nv = (int64_t)1 << width;
    const uint64_t fmask = (uint64_t)nv - 1;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *row = codes + t * nb;
        const int64_t c = t - t0;
        const v4 pw = {p[c], p[len + c], p[2 * len + c], p[3 * len + c]};
        if (has_zero)
            for (int64_t k = 0; k < ngroups; k++)
                store4(zsum + k * RW, load4(zsum + k * RW) + pw * read_f(zero, t * ngroups + k, skind));
        int64_t k_prev = -1;
        v4 ws = {0, 0, 0, 0};
        for (int64_t ch = 0; ch < chunks; ch++) {
            const int64_t k = (ch * 8) / gs;
            if (k != k_prev) { ws = pw * read_f(scale, t * ngroups + k, skind); k_prev = k; }
            const uint64_t w = load_word(row + ch * bits, bits);
            float *base = hist + ch * per * nv * RW;
            for (int f = 0; f < per; f++) {
                float *h = base + (f * nv + ((w >> (f * width)) & fmask)) * RW;
                store4(h, load4(h) + ws);
            }
        }
    }
}

/* out[r][c] = sum_v hist[i][v][r] * cent[code_j(v)] + zsum[c / gs][r] */
static void expand(int bits, int64_t n, const float *cent, int64_t gs, const float *hist, const float *zsum,
                   int has_zero, float *out) {
    const int g = 8 / bits, width = g * bits, mask = (1 << bits) - 1;
    const int64_t nv = (int64_t)1 << width;
    for (int64_t i = 0; i < n / g; i++)
        for (int64_t v = 0; v < nv; v++) {
            const v4 h = load4(hist + (i * nv + v) * RW);
            for (int j = 0; j < g; j++) {
                const float cv = cent[(v >> (j * bits)) & mask];
                const int64_t cc = i * g + j;
                for (int r = 0; r < RW; r++) out[r * n + cc] += h[r] * cv;
            }
        }
    if (has_zero)
        for (int64_t cc = 0; cc < n; cc++)
            for (int r = 0; r < RW; r++) out[r * n + cc] += zsum[(cc / gs) * RW + r];
}

/* Specialized per bit width B and code length N (64, 128, 256; 0 = any): with both constant the
   compiler unrolls the field loops completely, which halves the time per token. */
#define SPECIALIZE_N(B, N)                                                                                    \
    static void score_##B##_##N(const uint8_t *codes, int64_t nb, const float *tab, const void *norm, int nk,  \
                                int64_t t0, int64_t t1, float *out, int64_t len) {                            \
        score(B, N ? N / 8 : nb / B, codes, nb, tab, norm, nk, t0, t1, out, len);                             \
    }                                                                                                         \
    static void mix_##B##_##N(const uint8_t *codes, int64_t nb, int64_t gs, int64_t ngroups,                  \
                              const void *scale, const void *zero, int skind, int has_zero, const float *p,   \
                              int64_t len, int64_t t0, int64_t t1, float *hist, float *zsum) {                \
        mix(B, N ? N / 8 : nb / B, codes, nb, gs, ngroups, scale, zero, skind, has_zero, p, len, t0, t1, hist, \
            zsum);                                                                                            \
    }
#define SPECIALIZE(B)                                                                                         \
    static void table_##B(const float *q, int64_t n, const float *cent, float *tab) {                        \
        build_table(B, q, n, cent, tab);                                                                      \
    }                                                                                                         \
    SPECIALIZE_N(B, 0) SPECIALIZE_N(B, 64) SPECIALIZE_N(B, 128) SPECIALIZE_N(B, 256)
SPECIALIZE(1)
SPECIALIZE(2)
SPECIALIZE(3)
SPECIALIZE(4)
SPECIALIZE(5)
SPECIALIZE(6)
SPECIALIZE(7)
SPECIALIZE(8)

typedef void (*table_fn)(const float *, int64_t, const float *, float *);
typedef void (*score_fn)(const uint8_t *, int64_t, const float *, const void *, int, int64_t, int64_t, float *,
                         int64_t);
typedef void (*mix_fn)(const uint8_t *, int64_t, int64_t, int64_t, const void *, const void *, int, int,
                       const float *, int64_t, int64_t, int64_t, float *, float *);
static const table_fn TABLES[9] = {0, table_1, table_2, table_3, table_4, table_5, table_6, table_7, table_8};
#define ROW(F, B) {F##_##B##_0, F##_##B##_64, F##_##B##_128, F##_##B##_256}
static const score_fn SCORES[9][4] = {{0, 0, 0, 0}, ROW(score, 1), ROW(score, 2), ROW(score, 3), ROW(score, 4),
                                      ROW(score, 5), ROW(score, 6), ROW(score, 7), ROW(score, 8)};
static const mix_fn MIXES[9][4] = {{0, 0, 0, 0}, ROW(mix, 1), ROW(mix, 2), ROW(mix, 3), ROW(mix, 4),
                                   ROW(mix, 5), ROW(mix, 6), ROW(mix, 7), ROW(mix, 8)};

static int n_slot(int64_t n) { return n == 64 ? 1 : n == 128 ? 2 : n == 256 ? 3 : 0; }

/* ---- AVX-512 value path (bits <= 4, lengths multiple of 16): codes unpacked in registers -------------
 * 16 codes of b bits are 2b bytes: one 64-bit word, spread to 16 bytes by vpmultishiftqb (VBMI), masked,
 * widened to 16 lanes and looked up in the <= 16 centroids held in one register (vpermps); the values
 * are then mixed by FMAs into per-row accumulators [RW][n] (no histogram).  Chosen at run time where the
 * CPU has AVX-512 F/BW/VL/VBMI.  (Scoring keys this way measured slower than the tables: the per-token
 * horizontal sums cost more than the lookups they save.) */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define QJL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi")))
#define QJL_HAVE_AVX512_PATH 1

static int cpu_has_avx512(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi");
    }
    return cached;
}

/* Unpacking 16 codes of b <= 4 bits (2b bytes, LSB first) to their 16 centroids in 3 instructions: an 8-byte
 * broadcast load, vpmultishiftqb moving code i's bits to the low byte of dword i, and vpermps, which reads
 * only the low 4 bits of each index -- the bits above a code are those of the next one, so the centroid
 * table repeats every 2^b entries.  Loads are 8 bytes: the last 16 codes of a row load the 8 bytes that
 * end the row instead (offsets shifted by `ctrl_tail`), so nothing past a row is read (rows under 8 bytes are
 * read exactly). */
typedef struct {
    __m512i ctrl, ctrl_tail;
    __m512 centv;
} unpack16;

QJL_AVX512 static inline __attribute__((always_inline)) unpack16 setup16(const int bits, const float *cent) {
    unpack16 u;
    if (bits == 32) { /* float rows: nothing to unpack */
        u.ctrl = u.ctrl_tail = _mm512_setzero_si512();
        u.centv = _mm512_setzero_ps();
        return u;
    }
    uint8_t cb[64] = {0}, ct[64] = {0};
    float c16[16];
    const int shift = 8 * (8 - 2 * bits);
    for (int i = 0; i < 16; i++) {
        cb[4 * i] = (uint8_t)(i * bits);
        ct[4 * i] = (uint8_t)(i * bits + shift);
        c16[i] = cent[i & ((1 << bits) - 1)];
    }
    u.ctrl = _mm512_loadu_si512(cb);
    u.ctrl_tail = _mm512_loadu_si512(ct);
    u.centv = _mm512_loadu_ps(c16);
    return u;
}

/* the 16 centroids of the codes at p (tail: p is a row's last 2b bytes; short_row: rows under 8 bytes,
   read exactly) */
QJL_AVX512 static inline __attribute__((always_inline)) __m512 dq16(const uint8_t *p, const int bits, const int tail,
                                                                    const int short_row, const unpack16 *u) {
    if (bits == 32) return _mm512_loadu_ps((const float *)p); /* exact float32 rows (16 floats = 2 * 32 bytes) */
    uint64_t w = 0;
    __m512i ctrl = u->ctrl;
    if (short_row) memcpy(&w, p, (size_t)(2 * bits));
    else if (tail) {
        memcpy(&w, p + 2 * bits - 8, 8);
        ctrl = u->ctrl_tail;
    } else memcpy(&w, p, 8);
    return _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(ctrl, _mm512_set1_epi64((long long)w)), u->centv);
}

/* acc[r][c] += p[r][t - t0] * scale[t][c / gs] * cent[code(t, c)]; zsum[g][r] += p * zero[t][g].
 * Blocks of TB tokens: the weights p * scale first (pw [TB][ngroups][RW]), then per 16 channels the RW
 * accumulators stay in registers over the block (one unpack and RW broadcast FMAs per token). */
#define TB 256
QJL_AVX512 static inline __attribute__((always_inline)) void mix512_(const int bits, const uint8_t *codes, int64_t nb, int64_t n, const float *cent, int64_t gs,
                              int64_t ngroups, const void *scale, const void *zero, int skind, int has_zero,
                              const float *p, int64_t len, int64_t t0, int64_t t1, float *acc, float *zsum,
                              float *pw) {
    const unpack16 u = setup16(bits, cent);
    const int64_t groups = n / 16, step = 2 * bits;
    const int short_row = nb < 8;
    for (int64_t tb = t0; tb < t1; tb += TB) {
        const int64_t te = tb + TB < t1 ? tb + TB : t1;
        for (int64_t t = tb; t < te; t++) {
            const int64_t c = t - t0;
            const v4 pv = {p[c], p[len + c], p[2 * len + c], p[3 * len + c]};
            float *w = pw + (t - tb) * ngroups * RW;
            for (int64_t k = 0; k < ngroups; k++) {
                store4(w + k * RW, pv * read_f(scale, t * ngroups + k, skind));
                if (has_zero) store4(zsum + k * RW, load4(zsum + k * RW) + pv * read_f(zero, t * ngroups + k, skind));
            }
        }
        for (int64_t g = 0; g < groups; g++) {
            const int64_t k = (16 * g) / gs;
            const int tail = g == groups - 1;
            float *a = acc + 16 * g;
            __m512 a0 = _mm512_loadu_ps(a), a1 = _mm512_loadu_ps(a + n), a2 = _mm512_loadu_ps(a + 2 * n),
                   a3 = _mm512_loadu_ps(a + 3 * n);
            const uint8_t *src = codes + tb * nb + g * step;
            const float *w = pw + k * RW;
            for (int64_t t = tb; t < te; t++, src += nb, w += ngroups * RW) {
                const __m512 v = dq16(src, bits, tail, short_row, &u);
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(w[0]), v, a0);
                a1 = _mm512_fmadd_ps(_mm512_set1_ps(w[1]), v, a1);
                a2 = _mm512_fmadd_ps(_mm512_set1_ps(w[2]), v, a2);
                a3 = _mm512_fmadd_ps(_mm512_set1_ps(w[3]), v, a3);
            }
            _mm512_storeu_ps(a, a0);
            _mm512_storeu_ps(a + n, a1);
            _mm512_storeu_ps(a + 2 * n, a2);
            _mm512_storeu_ps(a + 3 * n, a3);
        }
    }
}
/* bit width as a compile-time constant (one 2b-byte load per 16 codes, no memcpy call) */
QJL_AVX512 static void mix512(int bits, const uint8_t *codes, int64_t nb, int64_t n, const float *cent, int64_t gs,
                              int64_t ngroups, const void *scale, const void *zero, int skind, int has_zero,
                              const float *p, int64_t len, int64_t t0, int64_t t1, float *acc, float *zsum,
                              float *pw) {
    switch (bits) {
    case 1: mix512_(1, codes, nb, n, cent, gs, ngroups, scale, zero, skind, has_zero, p, len, t0, t1, acc, zsum, pw); break;
    case 2: mix512_(2, codes, nb, n, cent, gs, ngroups, scale, zero, skind, has_zero, p, len, t0, t1, acc, zsum, pw); break;
    case 3: mix512_(3, codes, nb, n, cent, gs, ngroups, scale, zero, skind, has_zero, p, len, t0, t1, acc, zsum, pw); break;
    case 32: mix512_(32, codes, nb, n, cent, gs, ngroups, scale, zero, skind, has_zero, p, len, t0, t1, acc, zsum, pw); break;
    default: mix512_(4, codes, nb, n, cent, gs, ngroups, scale, zero, skind, has_zero, p, len, t0, t1, acc, zsum, pw); break;
    }
}

/* 16 horizontal sums at once: out[k] = sum of the 16 lanes of a[k] (a transpose-and-add tree, 45 ops) */
QJL_AVX512 static inline __attribute__((always_inline)) __m512 hsum16(const __m512 *a) {
    __m512 c[8], e[4];
    for (int i = 0; i < 8; i++)
        c[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(c[2 * i]), y = _mm512_castps_pd(c[2 * i + 1]);
        e[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xdd));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(e[2], e[3], 0x88), _mm512_shuffle_f32x4(e[2], e[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xdd));
}

/* out[r][t - t0] += norm[t] * sum_c q[r][c] * cent[code(t, c)]: 4 tokens x RW rows per pass, codes unpacked
 * in registers (as for values), 16 FMA accumulators reduced together by hsum16 */
QJL_AVX512 static inline __attribute__((always_inline)) void score512_(const int bits, const uint8_t *codes, int64_t nb,
                                                                      int64_t n, const float *cent, const float *q,
                                                                      const void *norm, int nkind, int64_t t0,
                                                                      int64_t t1, float *out, int64_t len) {
    const unpack16 u = setup16(bits, cent);
    const int64_t groups = n / 16, step = 2 * bits;
    const int short_row = nb < 8;
    float s[16], qsum[RW] = {0, 0, 0, 0}, c0 = 0.0f, dc = 0.0f;
    if (bits == 1) {
        c0 = cent[0];
        dc = cent[1] - cent[0];
        for (int r = 0; r < RW; r++)
            for (int64_t c = 0; c < n; c++) qsum[r] += q[r * n + c];
    }
    for (int64_t t = t0; t < t1; t += 4) {
        const uint8_t *rows[4];
        for (int j = 0; j < 4; j++) rows[j] = codes + (t + j < t1 ? t + j : t1 - 1) * nb; /* tail: repeat the last */
        __m512 acc[16];
        for (int k = 0; k < 16; k++) acc[k] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const __m512 q0 = _mm512_loadu_ps(q + 16 * g), q1 = _mm512_loadu_ps(q + n + 16 * g);
            const __m512 q2 = _mm512_loadu_ps(q + 2 * n + 16 * g), q3 = _mm512_loadu_ps(q + 3 * n + 16 * g);
            const int tail = g == groups - 1;
            for (int j = 0; j < 4; j++) {
                if (bits == 1) { /* sign bits as a mask: acc += q where the bit is set (see below) */
                    uint16_t bm;
                    memcpy(&bm, rows[j] + g * 2, 2);
                    const __mmask16 k = (__mmask16)bm;
                    acc[4 * j] = _mm512_mask_add_ps(acc[4 * j], k, acc[4 * j], q0);
                    acc[4 * j + 1] = _mm512_mask_add_ps(acc[4 * j + 1], k, acc[4 * j + 1], q1);
                    acc[4 * j + 2] = _mm512_mask_add_ps(acc[4 * j + 2], k, acc[4 * j + 2], q2);
                    acc[4 * j + 3] = _mm512_mask_add_ps(acc[4 * j + 3], k, acc[4 * j + 3], q3);
                    continue;
                }
                const __m512 v = dq16(rows[j] + g * step, bits, tail, short_row, &u);
                acc[4 * j] = _mm512_fmadd_ps(v, q0, acc[4 * j]);
                acc[4 * j + 1] = _mm512_fmadd_ps(v, q1, acc[4 * j + 1]);
                acc[4 * j + 2] = _mm512_fmadd_ps(v, q2, acc[4 * j + 2]);
                acc[4 * j + 3] = _mm512_fmadd_ps(v, q3, acc[4 * j + 3]);
            }
        }
        _mm512_storeu_ps(s, hsum16(acc));
        if (bits == 1) /* sum_c q[c] cent[b_c] = cent0 * sum_c q[c] + (cent1 - cent0) * sum_{b_c = 1} q[c] */
            for (int k = 0; k < 16; k++) s[k] = c0 * qsum[k % RW] + dc * s[k];
        for (int j = 0; j < 4 && t + j < t1; j++) {
            const float nt = read_f(norm, t + j, nkind);
            for (int r = 0; r < RW; r++) out[r * len + (t + j - t0)] += s[4 * j + r] * nt;
        }
    }
}
QJL_AVX512 static void score512(int bits, const uint8_t *codes, int64_t nb, int64_t n, const float *cent,
                                const float *q, const void *norm, int nkind, int64_t t0, int64_t t1, float *out,
                                int64_t len) {
    switch (bits) {
    case 1: score512_(1, codes, nb, n, cent, q, norm, nkind, t0, t1, out, len); break;
    case 2: score512_(2, codes, nb, n, cent, q, norm, nkind, t0, t1, out, len); break;
    case 3: score512_(3, codes, nb, n, cent, q, norm, nkind, t0, t1, out, len); break;
    case 32: score512_(32, codes, nb, n, cent, q, norm, nkind, t0, t1, out, len); break;
    default: score512_(4, codes, nb, n, cent, q, norm, nkind, t0, t1, out, len); break;
    }
}

/* exp(x) for 16 lanes, x <= 0 (-inf allowed): Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2, degree-6
 * Taylor polynomial (relative error < 2e-7), 2^k by vscalefps; x < -87 gives exactly 0 */
QJL_AVX512 static inline __m512 exp512(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, k));
}

/* max of x[0:len] */
QJL_AVX512 static float max512(const float *x, int64_t len) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + t));
    if (t < len) m = _mm512_mask_max_ps(m, (__mmask16)((1u << (len - t)) - 1), m, _mm512_maskz_loadu_ps((__mmask16)((1u << (len - t)) - 1), x + t));
    return _mm512_reduce_max_ps(m);
}

/* x[t] = exp(x[t] - m) for t < len; returns the sum */
QJL_AVX512 static float exp_sum512(float *x, int64_t len, float m) {
    const __m512 mv = _mm512_set1_ps(m);
    __m512 tot = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + t), mv));
        _mm512_storeu_ps(x + t, e);
        tot = _mm512_add_ps(tot, e);
    }
    if (t < len) {
        const __mmask16 k = (__mmask16)((1u << (len - t)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + t), mv)));
        _mm512_mask_storeu_ps(x + t, k, e);
        tot = _mm512_add_ps(tot, e);
    }
    return _mm512_reduce_add_ps(tot);
}

/* exact_part (below) with the AVX-512 routines: float32 rows are "32-bit codes" for score512/mix512 */
QJL_AVX512 static void exact512(int64_t item, int64_t bh, int64_t ne, int64_t dx, int64_t nvn, const float *qx,
                                const float *xk, const float *xv, const float *xbias, int has_xbias, float *m,
                                float *l, float *o, float *ox) {
    const uint8_t *k = (const uint8_t *)(xk + bh * ne * dx), *v = (const uint8_t *)(xv + bh * ne * dx);
    float *s = calloc((size_t)(RW * ne), sizeof(float));
    float *pw = malloc(sizeof(float) * TB * RW);
    float zsum[RW];
    score512(32, k, dx * 4, dx, NULL, qx + item * RW * dx, NULL, 4, 0, ne, s, ne);
    for (int r = 0; r < RW; r++) {
        float *sr = s + r * ne;
        if (has_xbias)
            for (int64_t j = 0; j < ne; j++) sr[j] += xbias[(item * RW + r) * ne + j];
        const float mm = max512(sr, ne), mx = mm > m[r] ? mm : m[r];
        if (mx == -INFINITY) { /* nothing visible to this row */
            memset(sr, 0, sizeof(float) * (size_t)ne);
            continue;
        }
        const float wc = m[r] == -INFINITY ? 0.0f : expf(m[r] - mx);
        const float tot = exp_sum512(sr, ne, mx);
        for (int64_t c = 0; c < nvn; c++) o[r * nvn + c] *= wc;
        l[r] = l[r] * wc + tot;
        m[r] = mx;
    }
    mix512(32, v, dx * 4, dx, NULL, dx, 1, NULL, NULL, 4, 0, s, ne, 0, ne, ox + item * RW * dx, zsum, pw);
    free(s);
    free(pw);
}
#else
#define QJL_HAVE_AVX512_PATH 0
static int cpu_has_avx512(void) { return 0; }
#endif

/* 1-, 2- and 4-bit codes only: with 3 bits (6-byte words) this path measured 1.7x slower than the histogram */
static int use512(int bits, int64_t n) {
    return QJL_HAVE_AVX512_PATH && bits <= 4 && n % 16 == 0 && cpu_has_avx512();
}

/* keys of 1-4 bits: codes unpacked in registers (score512) instead of the tables */
static int use512k(int bits, int64_t n) {
    return QJL_HAVE_AVX512_PATH && bits <= 4 && n % 16 == 0 && cpu_has_avx512();
}

static int64_t table_size(int bits, int64_t n) {
    const int g = 8 / bits;
    return (n / g) * ((int64_t)1 << (g * bits)) * RW;
}

/* The exact tokens of one (sequence x KV head, row chunk) item, merged into its code partial (m, l, o):
 * s[r][j] = <qx[r], xk[j]> + xbias[r][j]; m' = max(m, max_j s); o *= exp(m - m'); ox[r] = sum_j exp(s - m') xv[j];
 * l' = l exp(m - m') + sum_j exp(s - m').  The window is short (~100-200 tokens): plain loops, rows in a v4. */
static void exact_part(int64_t item, int64_t bh, int64_t ne, int64_t dx, int64_t nvn, const float *qx,
                       const float *xk, const float *xv, const float *xbias, int has_xbias, float *m, float *l,
                       float *o, float *ox) {
    const float *q = qx + item * RW * dx, *k = xk + bh * ne * dx, *v = xv + bh * ne * dx;
    float *s = malloc(sizeof(float) * RW * (size_t)ne);
    v4 *qt = malloc(sizeof(v4) * (size_t)dx); /* q transposed: one v4 of the RW rows per channel */
    for (int64_t c = 0; c < dx; c++) qt[c] = (v4){q[c], q[dx + c], q[2 * dx + c], q[3 * dx + c]};
    for (int64_t j = 0; j < ne; j++) {
        v4 a0 = {0, 0, 0, 0}, a1 = a0, a2 = a0, a3 = a0; /* four chains: the FMA latency, not one long sum */
        const float *kj = k + j * dx;
        int64_t c = 0;
        for (; c + 4 <= dx; c += 4) {
            a0 += qt[c] * kj[c];
            a1 += qt[c + 1] * kj[c + 1];
            a2 += qt[c + 2] * kj[c + 2];
            a3 += qt[c + 3] * kj[c + 3];
        }
        for (; c < dx; c++) a0 += qt[c] * kj[c];
        const v4 acc = (a0 + a1) + (a2 + a3);
        for (int r = 0; r < RW; r++)
            s[r * ne + j] = acc[r] + (has_xbias ? xbias[(item * RW + r) * ne + j] : 0.0f);
    }
    for (int r = 0; r < RW; r++) {
        float mx = m[r];
        for (int64_t j = 0; j < ne; j++) mx = s[r * ne + j] > mx ? s[r * ne + j] : mx;
        if (mx == -INFINITY) continue; /* nothing visible to this row: l = 0, o = ox = 0 */
        const float wc = m[r] == -INFINITY ? 0.0f : expf(m[r] - mx);
        float tot = 0.0f, *dst = ox + r * dx;
        for (int64_t j = 0; j < ne; j++) {
            const float p = expf(s[r * ne + j] - mx);
            tot += p;
            for (int64_t c = 0; c < dx; c++) dst[c] += p * v[j * dx + c];
        }
        for (int64_t c = 0; c < nvn; c++) o[r * nvn + c] *= wc;
        l[r] = l[r] * wc + tot;
        m[r] = mx;
    }
    free(s);
    free(qt);
}

/* exact512 where the CPU and the width allow it, exact_part otherwise; out_ox is [items][RW][dx] */
static void merge_exact(int x512, int64_t item, int64_t bh, int64_t ne, int64_t dx, int64_t nvn, const float *qx,
                        const float *xk, const float *xv, const float *xbias, int has_xbias, float *m, float *l,
                        float *o, float *out_ox) {
#if QJL_HAVE_AVX512_PATH
    if (x512 && dx % 16 == 0) {
        exact512(item, bh, ne, dx, nvn, qx, xk, xv, xbias, has_xbias, m, l, o, out_ox);
        return;
    }
#else
    (void)x512;
#endif
    exact_part(item, bh, ne, dx, nvn, qx, xk, xv, xbias, has_xbias, m, l, o, out_ox + item * RW * dx);
}

#define SUB 1024 /* tokens scored per pass: the logits stay in L1/L2, the histogram is rescaled online */

/* Shapes: c [BH, N, nb]; norm [BH, N]; q [BH, rchunks, RW, n]; vc [BH, N, nbv]; vscale/vzero [BH, N, G];
 * bias [B, N]; out_m/out_l [BH, rchunks, splits, RW]; out_o [BH, rchunks, splits, RW, nvn].
 * has_x: also the exact tokens (sinks + window), merged into split 0: qx [BH, rchunks, RW, dx] (the query,
 * not rotated), xk/xv [BH, ne, dx] float32, xbias [BH, rchunks, RW, ne] additive (per row) or none;
 * their values go to out_ox [BH, rchunks, RW, dx] (out_o stays in the codes' space), at the same m, l.
 * nkind1/nkind2/skind: storage of norm1/norm2/(vscale, vzero): 0 fp32, 1 fp16, 2 bf16, 3 float8 e4m3.
 * simd: 0 keeps to the portable table/histogram code (tests compare both).
 * Returns 0, -1 for unsupported bit widths, -2 for an unknown storage dtype code. */
int qjl_decode(int kbits1, const uint8_t *c1, int64_t nb1, int64_t n1, const float *cent1, const void *norm1,
               int nkind1, const float *q1, int has2, int kbits2, const uint8_t *c2, int64_t nb2, int64_t n2,
               const float *cent2, const void *norm2, int nkind2, const float *q2, int vbits, const uint8_t *vc,
               int64_t nbv, int64_t nvn, const float *vcent, int64_t gs, int64_t ngroups, const void *vscale,
               const void *vzero, int skind, int has_zero, const float *bias, int has_bias, int64_t heads,
               int64_t bh_count, int64_t rchunks, int64_t n_tok, int64_t block, int64_t splits, float *out_m,
               float *out_l, float *out_o, int has_x, int64_t ne, int64_t dx, const float *qx, const float *xk,
               const float *xv, const float *xbias, int has_xbias, float *out_ox, int threads, int simd) {
    if (kbits1 < 1 || kbits1 > 8 || kbits2 < 1 || kbits2 > 8 || vbits < 1 || vbits > 8) return -1;
    if (nkind1 < 0 || nkind1 > 3 || nkind2 < 0 || nkind2 > 3 || skind < 0 || skind > 3) return -2;
    const int64_t items = bh_count * rchunks * splits;
    const int gv = 8 / vbits;
    /* values: AVX-512 where it applies (mix512), the histogram over fields otherwise; keys: tables */
    const int v512 = (simd & 1) && use512(vbits, nvn) && gs % 16 == 0;
    const int x512 = (simd & 4) && QJL_HAVE_AVX512_PATH && cpu_has_avx512();
    const int k512a = (simd & 2) && use512k(kbits1, n1), k512b = (simd & 2) && has2 && use512k(kbits2, n2);
    /* values accumulate in a histogram over fields [field][value][RW], or directly in [RW][nvn] */
    const int64_t hist_size = v512 ? RW * nvn : (nvn / gv) * ((int64_t)1 << (gv * vbits)) * RW;
    const int64_t sbytes = kind_bytes(skind);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t item = 0; item < items; item++) {
        const int64_t bh = item / (rchunks * splits), rc = (item / splits) % rchunks, s = item % splits;
        const int64_t t0 = s * block, t1 = t0 + block < n_tok ? t0 + block : n_tok;
        const int64_t slot = (bh * rchunks + rc) * splits + s;
        float m_run[RW], l_run[RW];
        for (int r = 0; r < RW; r++) { m_run[r] = -INFINITY; l_run[r] = 0.0f; }
        if (t1 > t0) {
            float *tab1 = k512a ? NULL : malloc(sizeof(float) * (size_t)table_size(kbits1, n1));
            float *tab2 = has2 && !k512b ? malloc(sizeof(float) * (size_t)table_size(kbits2, n2)) : NULL;
            const float *qr1 = q1 + (bh * rchunks + rc) * RW * n1;
            const float *qr2 = has2 ? q2 + (bh * rchunks + rc) * RW * n2 : NULL;
            float *hist = calloc((size_t)hist_size, sizeof(float));
            float *zsum = calloc((size_t)(ngroups * RW), sizeof(float));
            float *logits = malloc(sizeof(float) * RW * SUB);
            float *pw = v512 ? malloc(sizeof(float) * TB * ngroups * RW) : NULL;
            if (!k512a) TABLES[kbits1](qr1, n1, cent1, tab1);
            if (has2 && !k512b) TABLES[kbits2](qr2, n2, cent2, tab2);
            const uint8_t *k1 = c1 + bh * n_tok * nb1, *k2 = has2 ? c2 + bh * n_tok * nb2 : NULL;
            const char *n1p = (const char *)norm1 + bh * n_tok * kind_bytes(nkind1);
            const char *n2p = has2 ? (const char *)norm2 + bh * n_tok * kind_bytes(nkind2) : NULL;
            for (int64_t a = t0; a < t1; a += SUB) {
                const int64_t b = a + SUB < t1 ? a + SUB : t1, len = b - a;
                memset(logits, 0, sizeof(float) * RW * (size_t)len);
#if QJL_HAVE_AVX512_PATH
                if (k512a) score512(kbits1, k1, nb1, n1, cent1, qr1, n1p, nkind1, a, b, logits, len);
                if (k512b) score512(kbits2, k2, nb2, n2, cent2, qr2, n2p, nkind2, a, b, logits, len);
#endif
                if (!k512a) SCORES[kbits1][n_slot(n1)](k1, nb1, tab1, n1p, nkind1, a, b, logits, len);
                if (has2 && !k512b) SCORES[kbits2][n_slot(n2)](k2, nb2, tab2, n2p, nkind2, a, b, logits, len);
                if (has_bias) {
                    const float *brow = bias + (bh / heads) * n_tok;
                    for (int r = 0; r < RW; r++)
                        for (int64_t t = a; t < b; t++) logits[r * len + t - a] += brow[t];
                }
                for (int r = 0; r < RW; r++) {
                    float m = m_run[r];
#if QJL_HAVE_AVX512_PATH
                    if (x512) {
                        const float mm = max512(logits + r * len, len);
                        m = mm > m ? mm : m;
                    } else
#endif
                        for (int64_t t = 0; t < len; t++) m = logits[r * len + t] > m ? logits[r * len + t] : m;
                    if (m > m_run[r] && m_run[r] != -INFINITY) { /* rescale what was accumulated so far */
                        const float w = expf(m_run[r] - m);
                        l_run[r] *= w;
                        if (v512)
                            for (int64_t i = r * nvn; i < (r + 1) * nvn; i++) hist[i] *= w;
                        else
                            for (int64_t i = r; i < hist_size; i += RW) hist[i] *= w;
                        for (int64_t i = r; i < ngroups * RW; i += RW) zsum[i] *= w;
                    }
                    m_run[r] = m;
                    const float sm = m == -INFINITY ? 0.0f : m;
                    float tot = 0.0f;
#if QJL_HAVE_AVX512_PATH
                    if (x512) tot = exp_sum512(logits + r * len, len, sm);
                    else
#endif
                        for (int64_t t = 0; t < len; t++) {
                            const float e = expf(logits[r * len + t] - sm);
                            logits[r * len + t] = e;
                            tot += e;
                        }
                    l_run[r] += tot;
                }
                const uint8_t *vrow = vc + bh * n_tok * nbv;
                const char *vs = (const char *)vscale + bh * n_tok * ngroups * sbytes;
                const char *vz = (const char *)vzero + bh * n_tok * ngroups * sbytes;
#if QJL_HAVE_AVX512_PATH
                if (v512) mix512(vbits, vrow, nbv, nvn, vcent, gs, ngroups, vs, vz, skind, has_zero, logits, len, a, b,
                                 hist, zsum, pw);
#endif
                if (!v512) MIXES[vbits][n_slot(nvn)](vrow, nbv, gs, ngroups, vs, vz, skind, has_zero, logits, len, a, b,
                                                     hist, zsum);
            }
            float *dst = out_o + slot * RW * nvn;
            if (v512) {
                for (int64_t i = 0; i < RW * nvn; i++) dst[i] += hist[i];
                if (has_zero)
                    for (int64_t cc = 0; cc < nvn; cc++)
                        for (int r = 0; r < RW; r++) dst[r * nvn + cc] += zsum[(cc / gs) * RW + r];
            } else {
                expand(vbits, nvn, vcent, gs, hist, zsum, has_zero, dst);
            }
            free(tab1);
            free(tab2);
            free(hist);
            free(zsum);
            free(logits);
            free(pw);
        }
        for (int r = 0; r < RW; r++) { out_m[slot * RW + r] = m_run[r]; out_l[slot * RW + r] = l_run[r]; }
    }
    if (splits > 1 || has_x) {
#pragma omp parallel for num_threads(threads)
        for (int64_t item = 0; item < bh_count * rchunks; item++) {
            const int64_t first = item * splits;
            for (int r = 0; r < RW && splits > 1; r++) {
                float m = -INFINITY;
                for (int64_t s = 0; s < splits; s++) m = out_m[(first + s) * RW + r] > m ? out_m[(first + s) * RW + r] : m;
                if (m == -INFINITY) continue;
                float tot = 0.0f;
                for (int64_t s = 0; s < splits; s++) {
                    const float w = out_m[(first + s) * RW + r] == -INFINITY ? 0.0f : expf(out_m[(first + s) * RW + r] - m);
                    tot += w * out_l[(first + s) * RW + r];
                    float *dst = out_o + (first * RW + r) * nvn;
                    const float *src = out_o + ((first + s) * RW + r) * nvn;
                    for (int64_t c = 0; c < nvn; c++) dst[c] = s == 0 ? dst[c] * w : dst[c] + w * src[c];
                }
                out_m[first * RW + r] = m;
                out_l[first * RW + r] = tot;
            }
            if (has_x && ne > 0)
                merge_exact(x512, item, item / rchunks, ne, dx, nvn, qx, xk, xv, xbias, has_xbias,
                            out_m + first * RW, out_l + first * RW, out_o + first * RW * nvn, out_ox);
        }
    }
    return 0;
}
