/* The integer path on AMX tiles (simd = 3, impl "c-amx"): Intel Xeon 4th generation (Sapphire Rapids) and later,
 * chosen at run time.  The same integers as decode_vnni.c, summed by the tile unit instead of vpdpbusd /
 * vpdpwssd, so the outputs are the integer path's bit for bit (int32 sums are exact in any order); only the
 * work moves:
 *
 *   On these CPUs the integer path is bound by its shuffles (vpermb, vpmultishiftqb, vpermt2b, the key sums'
 *   horizontal adds), which all issue on one port, and its 512-bit integer products, which issue on another
 *   (docs/kernels.md: ~37 cycles per token and KV head at d = 128 with one query row, about the count of those
 *   shuffles).  Here the codes are unpacked at 512-bit width (64 codes per three shuffles), stored, and summed
 *   by tdpbusd, which also does the reduction over coordinates that the key sums spent a shuffle tree on.
 *
 *   Keys (per 16 tokens): the tokens' int8 centroids (+128, unsigned) as tile A [16 tokens][64 coordinates] per
 *   64 coordinates, the int8 query rows as tile B [16][4 rows x 4 coordinates] (vpdpbusd's operand order), so C
 *   [16 tokens][4 rows] int32 = the sums decode_vnni.c reduces by horizontal adds; then the same transpose,
 *   offset and scaling (add_dots).
 *   Values (per 32 coordinates and 64 tokens): the int16 weights split into bytes w = 256 hi + lo (hi <= 127,
 *   lo <= 255; both unsigned) as tiles A [4 rows][64 tokens], the tokens' int8 centroids as tile B [16 token
 *   quads][16 coordinates x 4 tokens], C_hi and C_lo [4 rows][16 coordinates] int32, and 256 C_hi + C_lo =
 *   sum_t w[t] c8[code[t]], the integer vpdpwssd accumulates (no overflow: |256 C_hi| <= 127 * 127 * 512 * 256
 *   < 2^31 and the sum itself is bounded as there).  A B tile row is four tokens' codes of 16 coordinates: two
 *   tokens' codes interleaved as in decode_vnni.c (one vpermt2b, one vpmultishiftqb, one vpermb for 32
 *   coordinates of two tokens), and two such pairs interleaved by 16-bit unpacks, with the coordinates spread
 *   so that the unpacks leave them in order.
 *
 * Tiles need the process's permission (arch_prctl ARCH_REQ_XCOMP_PERM, Linux >= 5.16): amx_ready() asks once;
 * without it the integer path runs on vpdpbusd as before.  A thread loads its tile configuration where it starts
 * using tiles in an item and releases the tiles when the item ends (torch's oneDNN configures its own). */
#if QJL_HAVE_VNNI && defined(__linux__) && (__GNUC__ >= 11 || defined(__clang__))
#define QJL_HAVE_AMX 1
#define QJL_AMX __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,amx-tile,amx-int8")))
#include <cpuid.h>

#define AMX_MAX_KB 6 /* key blocks of 64 coordinates held in tiles 2-7 (head dims up to 384) */

static int amx_ready(void) { /* the CPU has AMX-TILE + AMX-INT8, and Linux lets this process use the tiles */
    static int state = -1;
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s >= 0) return s;
    unsigned a = 0, b = 0, c = 0, d = 0;
    int ok = cpu_has_vnni() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1u) && (d >> 25 & 1u);
    if (ok) { /* arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): the raw system call (ISO C build) */
        long r;
        __asm__ volatile("syscall" : "=a"(r) : "a"(158L), "D"(0x1023L), "S"(18L) : "rcx", "r11", "memory");
        ok = r == 0;
    }
    __atomic_store_n(&state, ok, __ATOMIC_RELEASE);
    return ok;
}

typedef struct {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_config;

/* Tiles are not renamed: a tile loaded while an earlier product still reads it waits, and a tile load waits for
 * the vector stores of the bytes it reads to reach the cache.  So the kernels alternate two sets of tiles and two
 * buffers: the codes of one group of tokens are unpacked while the group before is multiplied.
 * Keys of <= 2 blocks (head dims <= 128): tmm0-1 C [16 tokens][4 rows] int32 (set 0, 1), tmm2-3 and tmm4-5 A
 * [16 tokens][64] bytes of blocks 0-1 (set 0, 1), tmm6-7 B [16][4 rows x 4] bytes of blocks 0-1.
 * Keys of 3-6 blocks: tmm0 C, tmm1 A, tmm2-7 B of blocks 0-5 (one set). */
static const amx_config AMX_KEYS2 = {1, 0, {0}, {16, 16, 64, 64, 64, 64, 16, 16}, {16, 16, 16, 16, 16, 16, 16, 16}};
static const amx_config AMX_KEYS6 = {1, 0, {0}, {16, 64, 16, 16, 16, 16, 16, 16}, {16, 16, 16, 16, 16, 16, 16, 16}};
/* values: tmm0-1 C [8][16] int32 of coordinates 0-15 and 16-31 (rows 0-3: the weights' high bytes' sums, 4-7:
 * the low bytes'), tmm2-3 A [8 = hi rows, lo rows][64 tokens] bytes (set 0, 1), tmm4-5 and tmm6-7 B [16 token
 * quads][16 coordinates x 4 tokens] bytes of coordinates 0-15 and 16-31 (set 0, 1) */
static const amx_config AMX_VALUES = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {8, 8, 8, 8, 16, 16, 16, 16}};

QJL_AMX static inline void amx_configure(const amx_config *c) { _tile_loadconfig(c); }
QJL_AMX static inline void amx_release(void) { _tile_release(); }

/* the 64-entry tables vpermb zmm reads (the 32-byte tables of decode_vnni.c, twice) */
static void table64(const uint8_t *t32, uint8_t *t64) {
    memcpy(t64, t32, 32);
    memcpy(t64 + 32, t32, 32);
}

/* q8 [RW][n32] -> the B tiles of the key blocks: qv [kb][16][16] with qv[kb][i][4 r + m] = q8[r][64 kb + 4 i + m]
 * (zero past n32) */
static void amx_key_rows(const int8_t *q8, int64_t n, int8_t *qv) {
    const int64_t n32 = (n + 31) / 32 * 32, kb = (n + 63) / 64;
    for (int64_t b = 0; b < kb; b++)
        for (int i = 0; i < 16; i++)
            for (int r = 0; r < RW; r++)
                for (int m = 0; m < 4; m++) {
                    const int64_t c = 64 * b + 4 * i + m;
                    qv[(b * 16 + i) * 16 + 4 * r + m] = c < n32 ? q8[r * n32 + c] : 0;
                }
}

/* the key configuration for kb blocks, and its B tiles <- the blocks' query rows */
QJL_AMX static void amx_load_keys(const int8_t *qv, int64_t kb) {
    if (kb <= 2) {
        amx_configure(&AMX_KEYS2);
        _tile_loadd(6, qv, 16);
        if (kb == 2) _tile_loadd(7, qv + 256, 16);
        return;
    }
    amx_configure(&AMX_KEYS6);
    for (int64_t b = 0; b < kb; b++) {
        const int8_t *p = qv + b * 256;
        switch (b) {
        case 0: _tile_loadd(2, p, 16); break;
        case 1: _tile_loadd(3, p, 16); break;
        case 2: _tile_loadd(4, p, 16); break;
        case 3: _tile_loadd(5, p, 16); break;
        case 4: _tile_loadd(6, p, 16); break;
        default: _tile_loadd(7, p, 16); break;
        }
    }
}

/* the int8 table entries (+128 for keys) of the 64 codes at p (8b bytes, `mask`: the bytes to read) */
typedef struct {
    __m512i spread, shifts, table;
} unpack64_t;

QJL_AMX static inline __attribute__((always_inline)) unpack64_t unpack64_setup(const int bits, const uint8_t *t64) {
    uint8_t sp[64], sh[64];
    unpack_indices(bits, 8, sp, sh); /* decode_vnni.c's, for 8 qwords */
    unpack64_t u;
    u.spread = _mm512_loadu_si512(sp);
    u.shifts = _mm512_loadu_si512(sh);
    u.table = _mm512_loadu_si512(t64);
    return u;
}

static inline __mmask64 block_mask(int64_t n, int64_t b, int bits) { /* bytes of key block b (64 codes from 64b) */
    const int64_t left = n - 64 * b, codes = left < 64 ? left : 64, bytes = codes * bits / 8;
    return bytes >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << bytes) - 1);
}

/* 16 tokens' key codes from `src` (stride cs) -> a [16][64 kb] (int8 centroids + 128) */
QJL_AMX static inline __attribute__((always_inline)) void unpack_keys(const int bits, const int kb, const uint8_t *src,
                                                                   int64_t cs, int64_t live, const __mmask64 *m,
                                                                   const unpack64_t *u, uint8_t *a) {
    for (int64_t t = 0; t < live; t++, src += cs) {
        _mm_prefetch((const char *)(src + 40 * cs), _MM_HINT_T0); /* 40 tokens ahead, as decode_vnni.c */
        for (int b = 0; b < kb; b++) {
            const __m512i raw = _mm512_maskz_loadu_epi8(m[b], src + b * 8 * bits);
            const __m512i cd = _mm512_multishift_epi64_epi8(u->shifts, _mm512_permutexvar_epi8(u->spread, raw));
            _mm512_store_si512(a + t * 64 * kb + 64 * b, _mm512_permutexvar_epi8(cd, u->table));
        }
    }
}

/* s[t] of decode_vnni.c's score_vnni for a run of `count` tokens at `codes` (under amx_load_keys' configuration
 * and B tiles) */
QJL_AMX static inline __attribute__((always_inline)) void score_amx_(const int bits, const int kb,
                                                                  const qjl_key_term *k, int nr,
                                                                  const uint8_t *codes, const float *norm,
                                                                  int64_t count, const uint8_t *t64,
                                                                  const float *mul, const int32_t *off,
                                                                  float *logits) {
    const unpack64_t u = unpack64_setup(bits, t64);
    const int64_t n = k->n, cs = k->codes.stride_token, row = 64 * kb, groups = (count + 15) / 16;
    __mmask64 m[AMX_MAX_KB];
    for (int b = 0; b < kb; b++) m[b] = block_mask(n, b, bits);
    uint8_t a[2][16 * 64 * AMX_MAX_KB] __attribute__((aligned(64))); /* [16 tokens][kb * 64], two groups */
    int32_t dots[(SUB + 16) * 4] __attribute__((aligned(64)));      /* [token][4 rows] */
    if (kb <= 2) { /* at step g: group g unpacked into a[g % 2], group g - 2's sums stored from tile set g % 2,
                      group g - 1 multiplied on tile set (g - 1) % 2 (a tile store waits for its products) */
        for (int64_t g = 0; g <= groups + 1; g++) {
            if (g < groups) {
                const int64_t live = count - 16 * g < 16 ? count - 16 * g : 16;
                unpack_keys(bits, kb, codes + 16 * g * cs, cs, live, m, &u, a[g % 2]);
            }
            if (g >= 2) {
                int32_t *dp = dots + 4 * 16 * (g - 2);
                if (g % 2 == 0) _tile_stored(0, dp, 16);
                else _tile_stored(1, dp, 16);
            }
            if (g == 0 || g > groups) continue;
            const uint8_t *ap = a[(g - 1) % 2];
#define QJL_KEY_SET(C, A0, A1) /* tile set: sums C, the blocks' A tiles A0, A1 (tile numbers are immediates) */     \
    do {                                                                                                               \
        _tile_zero(C);                                                                                                 \
        _tile_loadd(A0, ap, row);                                                                                      \
        _tile_dpbusd(C, A0, 6);                                                                                        \
        if (kb == 2) {                                                                                                 \
            _tile_loadd(A1, ap + 64, row);                                                                             \
            _tile_dpbusd(C, A1, 7);                                                                                    \
        }                                                                                                              \
    } while (0)
            if ((g - 1) % 2 == 0) QJL_KEY_SET(0, 2, 3);
            else QJL_KEY_SET(1, 4, 5);
#undef QJL_KEY_SET
        }
    } else
        for (int64_t g = 0; g < groups; g++) {
            const int64_t live = count - 16 * g < 16 ? count - 16 * g : 16;
            unpack_keys(bits, kb, codes + 16 * g * cs, cs, live, m, &u, a[0]);
            _tile_zero(0);
            _tile_loadd(1, a[0], row);
            _tile_dpbusd(0, 1, 2);
#define QJL_KB(B, T)                                                                                                   \
    if (kb > B) {                                                                                                      \
        _tile_loadd(1, a[0] + 64 * B, row);                                                                            \
        _tile_dpbusd(0, 1, T);                                                                                         \
    }
            QJL_KB(1, 3) QJL_KB(2, 4) QJL_KB(3, 5) QJL_KB(4, 6) QJL_KB(5, 7)
#undef QJL_KB
            _tile_stored(0, dots + 4 * 16 * g, 16);
        }
    add_dots(nr, count, dots, norm, mul, off, logits);
}

QJL_AMX static void score_amx(const qjl_key_term *k, int nr, const uint8_t *codes, const float *norm, int64_t count,
                              const uint8_t *t64, const float *mul, const int32_t *off, float *logits) {
    const int bits = k->bits;
#define QJL_AMX_KB(B, KB) score_amx_(B, KB, k, nr, codes, norm, count, t64, mul, off, logits)
#define QJL_AMX_BITS(KB)                                                                                               \
    switch (bits) {                                                                                                    \
    case 1: QJL_AMX_KB(1, KB); break;                                                                                  \
    case 2: QJL_AMX_KB(2, KB); break;                                                                                  \
    case 3: QJL_AMX_KB(3, KB); break;                                                                                  \
    case 4: QJL_AMX_KB(4, KB); break;                                                                                  \
    default: QJL_AMX_KB(5, KB); break;                                                                             \
    }
    switch ((k->n + 63) / 64) { /* the usual head dims' block counts as constants */
    case 1: QJL_AMX_BITS(1) break;
    case 2: QJL_AMX_BITS(2) break;
    case 4: QJL_AMX_BITS(4) break;
    default: QJL_AMX_BITS((int)((k->n + 63) / 64)) break;
    }
#undef QJL_AMX_BITS
#undef QJL_AMX_KB
}

/* A B tile row is four tokens' codes of 16 coordinates, (c0[j], c1[j], c2[j], c3[j]) in dword j.
 *
 * Codes of <= 4 bits: the four tokens' 4b bytes of a 32-coordinate chunk are loaded two to a register (token 0 in
 * bytes 0-31, token 1 in 32-63: a zero-masked load and a merge-masked one 32 bytes before its row, no byte outside
 * the rows read), and for the 16 coordinates 16h .. 16h + 15 one vpermt2b gives qword i the two bytes of each
 * token that hold coordinates 16h + 2i and 16h + 2i + 1 (2b bits from a bit offset < 8 fit in two bytes),
 * vpmultishiftqb moves code 16h + 2i + m of token t to byte 4m + t, and the table maps it: three shuffles per 64
 * codes (spread[h], shifts[h]).
 * Codes of 5 bits (3 bytes for two coordinates): two tokens' codes interleaved per register (bytes (c0[j], c1[j])
 * in 16-bit word j' of the result) with the coordinates in the order the 16-bit unpacks put back in order: qword i
 * holds coordinates s_i .. s_i + 3, s_i = 2i (i even) or 14 + 2i (i odd), token 0's 3 bytes then token 1's
 * (vpermt2b), and vpmultishiftqb moves code s_i + m of token t to byte 2m + t (spread[0], shifts[0]); then two
 * such pairs interleaved by vpunpck{l,h}wd: four shuffles per 64 codes. */
typedef struct {
    __m512i spread[2], shifts[2], table;
} unpack_quads_t;

QJL_AMX static inline __attribute__((always_inline)) unpack_quads_t unpack_quads_setup(const int bits,
                                                                                     const uint8_t *t64) {
    unpack_quads_t u;
    u.table = _mm512_loadu_si512(t64);
    if (bits <= 4) {
        for (int h = 0; h < 2; h++) {
            uint8_t sp[64], sh[64];
            for (int i = 0; i < 8; i++) {
                const int first = (16 * h + 2 * i) * bits, byte = first / 8, off = first % 8;
                for (int k = 0; k < 8; k++) { /* byte k: token k / 2's byte `byte + k % 2` (its register's half) */
                    sp[8 * i + k] = (uint8_t)(32 * (k / 2) + byte + k % 2);
                    sh[8 * i + k] = (uint8_t)(16 * (k % 4) + off + bits * (k / 4)); /* byte 4m + t: code m, token t */
                }
            }
            u.spread[h] = _mm512_loadu_si512(sp);
            u.shifts[h] = _mm512_loadu_si512(sh);
        }
        return u;
    }
    uint8_t sp[64], sh[64];
    for (int i = 0; i < 8; i++) {
        const int s = i % 2 ? 14 + 2 * i : 2 * i, first = s * bits, byte = first / 8, off = first % 8;
        for (int k = 0; k < 8; k++) {
            sp[8 * i + k] = (uint8_t)(k < 3 ? byte + k : k < 6 ? 64 + byte + k - 3 : 0);
            sh[8 * i + k] = (uint8_t)((k & 1 ? 24 : 0) + off + bits * (k >> 1));
        }
    }
    u.spread[0] = _mm512_loadu_si512(sp);
    u.shifts[0] = _mm512_loadu_si512(sh);
    return u;
}

QJL_AMX static inline __attribute__((always_inline)) __m512i unpack_pair(const uint8_t *r0, const uint8_t *r1,
                                                                      __mmask64 m, const unpack_quads_t *u) {
    const __m512i a = _mm512_maskz_loadu_epi8(m, r0), b = _mm512_maskz_loadu_epi8(m, r1);
    const __m512i cd = _mm512_multishift_epi64_epi8(u->shifts[0], _mm512_permutex2var_epi8(a, u->spread[0], b));
    return _mm512_permutexvar_epi8(cd, u->table);
}

/* two rows' chunk bytes (4b <= 16 of them, `m`) in one register: r0's in bytes 0-31, r1's in 32-63 */
QJL_AMX static inline __attribute__((always_inline)) __m512i two_rows(const uint8_t *r0, const uint8_t *r1,
                                                                   __mmask64 m) {
    const __m512i a = _mm512_maskz_loadu_epi8(m, r0);
    return _mm512_mask_loadu_epi8(a, m << 32, (const void *)((uintptr_t)r1 - 32)); /* masked: nothing else read */
}

/* 64 tokens' codes of a 32-coordinate chunk (rows rq[0..63] + at) -> the B tiles of coordinates 0-15 (bt) and
 * 16-31 (bt + 1024) */
QJL_AMX static inline __attribute__((always_inline)) void unpack_values(const int bits, const uint8_t *const *rq,
                                                                     int64_t at,
                                                                     __mmask64 m, int first, int64_t ahead,
                                                                     const unpack_quads_t *u, uint8_t *bt) {
    for (int j = 0; j < 16; j++) {
        if (first) /* the first chunk reads DRAM: the rows `ahead` bytes on (a prefetch never faults) */
            for (int t = 0; t < 4; t++) _mm_prefetch((const char *)(rq[4 * j + t] + ahead), _MM_HINT_T0);
        if (bits <= 4) {
            const __m512i a = two_rows(rq[4 * j] + at, rq[4 * j + 1] + at, m);
            const __m512i b = two_rows(rq[4 * j + 2] + at, rq[4 * j + 3] + at, m);
            for (int h = 0; h < 2; h++) {
                const __m512i cd = _mm512_multishift_epi64_epi8(u->shifts[h], _mm512_permutex2var_epi8(a, u->spread[h], b));
                _mm512_store_si512(bt + 1024 * h + 64 * j, _mm512_permutexvar_epi8(cd, u->table));
            }
            continue;
        }
        const __m512i p01 = unpack_pair(rq[4 * j] + at, rq[4 * j + 1] + at, m, u);
        const __m512i p23 = unpack_pair(rq[4 * j + 2] + at, rq[4 * j + 3] + at, m, u);
        _mm512_store_si512(bt + 64 * j, _mm512_unpacklo_epi16(p01, p23));
        _mm512_store_si512(bt + 1024 + 64 * j, _mm512_unpackhi_epi16(p01, p23));
    }
}

/* acc[r][c] += mul[g(c)][r] * sum_i w16[g(c)][r][i] * c8[code[i][c]] over the pass's `len` tokens, whose value
 * codes are at rows[i] (i < len; rows[len .. len64) repeat a valid row: their weights are zero); wb: the weights'
 * bytes [G][2][RW][SUB] (hi, lo; zero past len and for rows past nr); under AMX_VALUES.  Per chunk, group q of 64
 * tokens is unpacked into bt[q % 2] while group q - 1 is multiplied on tile set (q - 1) % 2. */
QJL_AMX static inline __attribute__((always_inline)) void mix_amx_(const int bits, const qjl_value_view *v, int nr,
                                                                int64_t len, const uint8_t *const *rows,
                                                                const uint8_t *wb, const uint8_t *t64,
                                                                const float *mul, float *acc) {
    const unpack_quads_t u = unpack_quads_setup(bits, t64);
    const int64_t n = v->n, chunks = (n + 31) / 32, gs = v->group_size, groups = (len + 63) / 64;
    const int64_t ahead = 64 * v->codes.stride_token;
    uint8_t bt[2][2 * 16 * 64] __attribute__((aligned(64))); /* two groups' B tiles: coordinates 0-15, 16-31 */
    int32_t ct[2][8 * 16] __attribute__((aligned(64)));
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t g = v->groups == 1 ? 0 : (32 * c) / gs, at = c * 4 * bits;
        const __mmask64 m = chunk_mask(n, c, bits);
        const uint8_t *w = wb + g * 2 * RW * SUB;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t q = 0; q <= groups; q++) {
            if (q < groups) unpack_values(bits, rows + 64 * q, at, m, c == 0, ahead, &u, bt[q % 2]);
            if (q == 0) continue;
            const uint8_t *bp = bt[(q - 1) % 2], *wp = w + 64 * (q - 1);
            if ((q - 1) % 2 == 0) {
                _tile_loadd(2, wp, SUB);
                _tile_loadd(4, bp, 64);
                _tile_loadd(5, bp + 1024, 64);
                _tile_dpbusd(0, 2, 4);
                _tile_dpbusd(1, 2, 5);
            } else {
                _tile_loadd(3, wp, SUB);
                _tile_loadd(6, bp, 64);
                _tile_loadd(7, bp + 1024, 64);
                _tile_dpbusd(0, 3, 6);
                _tile_dpbusd(1, 3, 7);
            }
        }
        _tile_stored(0, ct[0], 64);
        _tile_stored(1, ct[1], 64);
        const int64_t live = n - 32 * c < 32 ? n - 32 * c : 32;
        for (int r = 0; r < nr; r++) { /* 256 hi + lo, scaled into the float accumulators */
            const __m512 f = _mm512_set1_ps(mul[g * RW + r]);
            float *o = acc + r * n + 32 * c;
            for (int h = 0; h < 2 && 16 * h < live; h++) {
                const __m512i hi = _mm512_load_si512(ct[h] + 16 * r), lo = _mm512_load_si512(ct[h] + 16 * (r + RW));
                const __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo));
                const __mmask16 lm = live - 16 * h >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (live - 16 * h)) - 1);
                _mm512_mask_storeu_ps(o + 16 * h, lm, /* o + f s, two roundings as decode_vnni.c's */
                                      _mm512_add_ps(_mm512_maskz_loadu_ps(lm, o + 16 * h), _mm512_mul_ps(f, s)));
            }
        }
    }
}

/* the pass's weights w16 [G][RW][SUB + 2] (int16_weights; nr live rows) -> wb [G][2][RW][SUB] bytes (hi, lo),
 * zero past len (to the next multiple of 64) and for the rows past nr */
QJL_AMX static void amx_weight_bytes(int64_t G, int nr, int64_t len, const int16_t *w16, uint8_t *wb) {
    const int64_t len64 = (len + 63) / 64 * 64;
    for (int64_t g = 0; g < G; g++)
        for (int r = 0; r < RW; r++) {
            uint8_t *hi = wb + (g * 2 * RW + r) * SUB, *lo = hi + RW * SUB;
            const int16_t *w = w16 + (g * RW + r) * (SUB + 2);
            int64_t i = 0;
            if (r < nr)
                for (; i + 32 <= len; i += 32) {
                    const __m512i x = _mm512_loadu_si512(w + i);
                    _mm256_storeu_si256((__m256i *)(hi + i), _mm512_cvtepi16_epi8(_mm512_srli_epi16(x, 8)));
                    _mm256_storeu_si256((__m256i *)(lo + i), _mm512_cvtepi16_epi8(_mm512_and_si512(x, _mm512_set1_epi16(255))));
                }
            for (; i < len64; i++) {
                const int x = r < nr && i < len ? w[i] : 0;
                hi[i] = (uint8_t)(x >> 8), lo[i] = (uint8_t)(x & 255);
            }
        }
}

/* one row's weights x [len] (floats) with their max mx -> bytes hi / lo of w = round(x 32767 / mx) (w16 of
 * int16_row, split; zero from len to the next multiple of 64); returns the row's scale W / 32767 * sc */
QJL_AMX static float amx_bytes_row(const float *x, int64_t len, float mx, float sc, uint8_t *hi, uint8_t *lo) {
    const float inv = mx > 0.0f ? 32767.0f / mx : 0.0f;
    const __m512 vi = _mm512_set1_ps(inv);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m512i w = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vi)); /* nearest even */
        _mm_storeu_si128((__m128i *)(hi + i), _mm512_cvtepi32_epi8(_mm512_srli_epi32(w, 8)));
        _mm_storeu_si128((__m128i *)(lo + i), _mm512_cvtepi32_epi8(_mm512_and_si512(w, _mm512_set1_epi32(255))));
    }
    for (; i < len; i++) {
        const int w = (int)lrintf(x[i] * inv);
        hi[i] = (uint8_t)(w >> 8), lo[i] = (uint8_t)(w & 255);
    }
    for (; i < (len + 63) / 64 * 64; i++) hi[i] = lo[i] = 0;
    return mx / 32767.0f * sc;
}

QJL_AMX static void mix_amx(const qjl_value_view *v, int nr, int64_t len, const uint8_t *const *rows,
                            const uint8_t *wb, const uint8_t *t64, const float *mul, float *acc) {
    switch (v->bits) {
    case 1: mix_amx_(1, v, nr, len, rows, wb, t64, mul, acc); break;
    case 2: mix_amx_(2, v, nr, len, rows, wb, t64, mul, acc); break;
    case 3: mix_amx_(3, v, nr, len, rows, wb, t64, mul, acc); break;
    case 4: mix_amx_(4, v, nr, len, rows, wb, t64, mul, acc); break;
    default: mix_amx_(5, v, nr, len, rows, wb, t64, mul, acc); break;
    }
}
#else
#define QJL_HAVE_AMX 0
static int amx_ready(void) { return 0; }
#endif
