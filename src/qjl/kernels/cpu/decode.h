/* Shared by the CPU kernel sources (decode_portable.c, decode_avx2.c, decode.c, quantize.c): the argument
 * struct the launcher fills by name (qjl.kernels.cpu.launch), scalar reads of stored dtypes, the vectorized
 * exp, dot products and parallel_for.  The sources are compiled as one translation unit, this header first
 * (qjl.kernels.cpu.build).
 *
 * Paged addressing: field f of coded token t of sequence b, KV head h, lives at
 *   f.base + block_table[b * max_blocks + t / block_size] * f.stride_block + h * f.stride_head
 *          + (t % block_size) * f.stride_token                                              (bytes)
 * transformers' contiguous store is the case of one block per sequence (block_size >= its length).
 *
 * Grouped codes (a vector codebook, qjl.codecs.vq.TurboQuantVQ: qjl_key_term.group / qjl_value_view.group g > 1) are
 * stored as scalar ones (b-bit fields, LSB first), but the g fields of coordinates [g j, g j + g) form one joint code
 * e = sum_s field[g j + s] << (s b) -- the row's (g b)-bit code j -- and coordinate c stands for cent[e g + c % g]
 * (cent [2^(g b) g]).  The portable path and rows.c expand a row through that table; the AVX2 path loads each
 * joint code's g floats from it inside its loops (decode_avx2.c); the lane-sliced and AMX paths read scalar codes
 * only, the integer path scalar codes and keys of 6- and 8-bit joint codes (run_item routes the rest past them). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h> /* fp16 rows of the exact tokens: vcvtph2ps */
#endif

#define QJL_EXPORT
#define RW 4     /* query rows per work item (a GQA group of 4, or a chunk of a larger one) */
#define SUB 512  /* tokens scored per pass: logits, weights and the pass's value codes stay in L1 */

/* cdef begin (read by qjl.kernels.cpu.build: these declarations are the Python-visible interface) */
typedef struct {
    const uint8_t *base;  /* byte address of block 0, head 0, slot 0 */
    int64_t stride_block, stride_head, stride_token;  /* bytes */
    int32_t dtype;        /* scalar fields: 0 fp32, 1 fp16, 2 bf16, 3 float8 e4m3; codes: unused */
} qjl_field;

typedef struct {          /* s[t] += norm[t] * sum_c q[c] * value(t, c), value(t, c) = cent[code[t, c]] (group 1) */
    qjl_field codes, norm;
    int32_t bits, n;      /* bits per code (1..8), codes per vector (a multiple of 8) */
    const float *cent;    /* [2^bits], or with group g > 1 [2^(g bits) g] */
    int32_t group;        /* g: 1 scalar codes; 2, 4 or 8 (g bits <= 8) a vector codebook: the g codes of coordinates
                             [g j, g j + g) are the fields of one joint code e (field s at bits [s bits, (s + 1) bits)
                             of e: bits [g j bits, g (j + 1) bits) of the row, read as one code) and coordinate c is
                             cent[e g + c % g] (PackedCodes.group) */
    const float *q;       /* [B, QB, H, R, n]: the query rows mapped into this term's basis, or, with qmap,
                             [B, H, R, qdim]: the query itself */
    int32_t q_per_block;  /* QB: 0 -> one map per sequence, 1 -> one per block-table column (max_blocks) */
    const float *qmap;    /* [n, qdim]: the term's query map as a matrix (applied in the kernel), or NULL */
    int32_t qdim;
} qjl_key_term;

typedef struct {          /* v[t, c] = zero[t, c / group_size] + scale[t, c / group_size] * value(t, c) (value: as
                             qjl_key_term's, cent[code[t, c]] for scalar codes) */
    qjl_field codes, scale, zero;
    int32_t bits, n, group_size, groups, has_zero;
    const float *cent;    /* [2^bits], or with group g > 1 [2^(g bits) g] */
    int32_t group;        /* g: 1 scalar codes, 2 / 4 / 8 joint codes of g fields (as qjl_key_term's group) */
    const float *unmix;   /* [K n, out_dim]: mixed rows back to the model's basis (o @ unmix), or NULL (identity) */
    int32_t out_dim;
    int32_t cycles;       /* K >= 1: the token at code position t is mixed into accumulator t % K; a mixed row is
                             K n wide (accumulator k in columns [k n, (k + 1) n)); K > 1 needs an unmix */
} qjl_value_view;

typedef struct {          /* exact tokens [B, H, n, dx] (sinks, window, the current token): rows of dx contiguous
                             elements, the rest at byte strides; token i of sequence b at
                             k + b * k_sb + h * k_sh + i * k_st, or, with k_off, k + k_off[b * n + i] + h * k_sh
                             (rows read in place from pages: byte offsets per sequence and token) */
    const uint8_t *k, *v;
    int64_t n;            /* tokens */
    int64_t k_sb, k_sh, k_st, v_sb, v_sh, v_st; /* bytes between sequences, heads, tokens */
    const int64_t *k_off, *v_off;               /* [B, n] byte offsets, or NULL (the strides) */
    int64_t k_room, v_room;                     /* with offsets: the bytes from k / v on that rows may reach */
    int32_t dtype;        /* 0 fp32, 1 fp16, 2 bf16 */
} qjl_exact_seg;

typedef struct {
    int32_t n_terms;      /* 1 or 2 key terms */
    qjl_key_term key[2];
    qjl_value_view value;
    int64_t batch, heads, rows;           /* B, H_kv, R query rows per KV head */
    const int32_t *block_table;           /* [B, max_blocks] */
    int64_t max_blocks, block_size;
    int64_t max_block;                    /* the largest block index every field's buffer holds (checked) */
    const int32_t *code_start, *code_end; /* [B]: coded tokens [start, end) of each sequence */
    const float *bias;                    /* [B, bias_stride] additive over coded tokens t, or NULL */
    int64_t bias_stride;
    int64_t ne, dx;                       /* exact tokens per sequence and head (all segments), their dim (0: none) */
    int32_t n_xseg;                       /* segments (0-2), joined in this order */
    qjl_exact_seg xseg[2];
    const float *qx;                      /* [B, H, R, dx] the query (model basis, scale included) */
    const float *xbias;                   /* additive, or NULL: xbias[b * sb + h * sh + r * sr + j] */
    int64_t xbias_sb, xbias_sh, xbias_sr; /* element strides (0: the same for every head / row) */
    float *out;                           /* [B, H, R, value.out_dim]: the attention output, or NULL */
    uint8_t *out_raw;                     /* or NULL: the output written here instead, in out_dtype (1 fp16, 2 bf16;
                                             rounded to nearest even, NaN as torch writes it) */
    int32_t out_dtype;
    const uint8_t *q_raw;                 /* or NULL: the query [B, H, R, qdim] dense in q_dtype (0 fp32, 1 fp16,
                                             2 bf16), times q_scale, converted once: every key term's q (each term
                                             with its qmap) and qx */
    int32_t q_dtype;
    float q_scale;
    float *out_m, *out_l;                 /* [B, H, R] the partial softmax (m, l), or NULL */
    float *out_o;                         /* [B, H, R, K value.n] codes' values (the value codec's basis; K =
                                             value.cycles accumulators), or NULL */
    float *out_ox;                        /* [B, H, R, dx] exact values, at the same max (if ne > 0), or NULL */
    int64_t split_tokens;                 /* coded tokens per work item (0: automatic) */
    int32_t threads, simd;                /* simd 0: portable path; 1: the AVX2 path where the CPU has it; 2: the
                                             integer path (decode_vnni.c) where it has AVX-512 VBMI + VNNI, else 1;
                                             3: the integer path on AMX tiles (decode_amx.c) where the CPU and
                                             the OS allow them, else 2 */
} qjl_decode_args;

typedef struct {          /* one role's rows for qjl_encode_store (quantize.c) */
    const uint8_t *x;     /* token t, KV head h: dim contiguous elements at x + t * x_st + h * x_sh (bytes) */
    int64_t x_st, x_sh;
    int32_t x_dtype;      /* 0 fp32, 1 fp16, 2 bf16 */
    int64_t dim, n;       /* input and rotated dimensions */
    const float *matrix_t; /* [cycles, dim, n]: each rotation's dense matrix M [n, dim], transposed */
    const float *bnd, *cent; /* [2^bits - 1] sorted boundaries, [2^bits] centroids (group 1) */
    int32_t nbnd, bits, correct;
    float norm_max;
    qjl_field codes, norm_field;
    int32_t group;        /* 1: scalar cells; g > 1: a vector codebook, each g coordinates' nearest codeword of
                             table [words, g] (sq [words] its squared norms, tt [g, words] it transposed or NULL),
                             stored as its g bits-bit fields; pairs may search through a grid (grid_cells > 0) */
    int32_t words;
    const float *table, *sq, *tt;
    float grid_lo, grid_inv;
    int32_t grid_cells;
    const int32_t *grid_off, *grid_cand;
    float cos_floor;      /* the corrected norm divides by max(cos, cos_floor) (0: by cos where positive) */
    int32_t cycles;       /* rotations in turn: token t's rows rotated by matrix pos[t] % cycles (cycles 1: pos unread) */
    const int64_t *pos;
} qjl_encode_job;
typedef struct {          /* one decode step of a layer in one call (step.c): B sequences, one new token each */
    const uint8_t *k, *v;  /* the new keys / values: token b, KV head h at k + b * k_st + h * k_sh (bytes; v
                              alike), dim contiguous elements in k_dtype / v_dtype (0 fp32, 1 fp16, 2 bf16) */
    int64_t k_st, k_sh, v_st, v_sh;
    int32_t k_dtype, v_dtype;
    int64_t dim;
    qjl_field mu;          /* key means: sequence b's at mu.base + block_table[b * max_blocks] * mu.stride_block
                              + h * mu.stride_head (its block 0, slot 0), dim elements in mu.dtype; base NULL: none */
    int64_t mu_max_block;  /* the largest block index the mean field's buffer holds */
    qjl_field mu_v;        /* value means, as mu (base NULL: none); with them the attention of the smoothed values
                              goes to decode.out (float32) and mu_v is added to each query row of its KV head in
                              out_final, written in out_final_dtype (0 fp32, 1 fp16, 2 bf16, rounded as .to()) */
    int64_t mu_v_max_block;
    uint8_t *out_final;
    int32_t out_final_dtype;
    float *k_out, *v_out;  /* [B, H, dim] float32: k - mu and v - mu_v, what is stored and attended */
    const qjl_encode_job *jobs; /* jobs[0] reads k_out, jobs[1] the values (v_out where mu_v is given) */
    int32_t n_jobs;
    const int64_t *blocks, *slots; /* [B]: where each token's codes go */
    int32_t threads;
    int32_t stage, failed; /* out: where a call failed (0 the arguments, 1 the store: `failed` its job, 2 the
                              decode) */
    qjl_decode_args decode; /* its last exact segment reads k_out / v_out (the current tokens) */
    uint8_t *wk, *wv;       /* exact copies written after the attention (NULL: none): the layer's exact key / value
                               field buffers, wk_room / wv_room bytes, entries of dim elements in wk_dtype / wv_dtype
                               (0 fp32, 1 fp16, 2 bf16; rounded as .to()) */
    int64_t wk_room, wv_room;
    int32_t wk_dtype, wv_dtype;
    int64_t n_writes;       /* write i: token w_rows[i]'s k_out / v_out rows of head h to byte offsets
                               wk_off[i * H + h] / wv_off[i * H + h] of wk / wv (checked before anything is done) */
    const int64_t *w_rows, *wk_off, *wv_off;
} qjl_step_args;
typedef struct {          /* what every layer's call of one decode step shares (step.c's qjl_decode_store_at): the
                             step's block table, coded ranges, exact-token bias and exact rows' offsets, threads and
                             kernel path, filled once per step (launch.DecodeStep.shared) */
    int64_t batch, max_blocks;
    const int32_t *block_table, *code_start, *code_end;
    const float *xbias;   /* or NULL */
    int64_t xbias_sb, xbias_sh, xbias_sr;
    int64_t n_rows;       /* exact rows read in the layer's pages (segment 0 of the template), 0: none */
    int32_t rows_dtype;
    const int64_t *k_off, *v_off;
    int32_t threads, simd;
} qjl_step_shared;
/* cdef end */

/* norms, scales and zero points in their storage dtype */
static inline float e4m3_to_float(uint8_t b) {
    const uint32_t e = (b >> 3) & 0xf, m = b & 7;
    float f = 0.0f; /* (set on both branches; GCC cannot see it through memcpy) */
    if (e == 0) f = (float)m * 0.001953125f; /* subnormal: m * 2^-9 */
    else {
        const uint32_t bits = ((e + 127 - 7) << 23) | (m << 20);
        memcpy(&f, &bits, 4);
    }
    return (b & 0x80) ? -f : f;
}
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
static inline int64_t dtype_bytes(int dtype) { return dtype == 0 ? 4 : dtype == 3 ? 1 : 2; }

/* out[i] = the scalar at p + i * stride (bytes) in its storage dtype, i < count (one loop per dtype) */
static void read_run(const uint8_t *p, int64_t stride, int dtype, int64_t count, float *out) {
    int64_t i;
    uint16_t h;
    switch (dtype) {
    case 0:
        for (i = 0; i < count; i++) memcpy(out + i, p + i * stride, 4);
        break;
    case 1:
#if defined(__F16C__)
        i = 0;
#if defined(__AVX__)
        if (stride == 2) /* contiguous (the transformers cache's norms): 8 at a time */
            for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))));
#endif
        for (; i < count; i++) { memcpy(&h, p + i * stride, 2); out[i] = _cvtsh_ss(h); } /* vcvtph2ps */
#else
        for (i = 0; i < count; i++) { memcpy(&h, p + i * stride, 2); out[i] = half_to_float(h); }
#endif
        break;
    case 2:
        for (i = 0; i < count; i++) {
            memcpy(&h, p + i * stride, 2);
            const uint32_t bits = (uint32_t)h << 16;
            memcpy(out + i, &bits, 4);
        }
        break;
    default:
        {
            static float table[256]; /* every e4m3 byte's value, built once (a lookup per scalar, no branches) */
            static int ready = 0;
            if (!__atomic_load_n(&ready, __ATOMIC_ACQUIRE)) {
                for (int b = 0; b < 256; b++) table[b] = e4m3_to_float((uint8_t)b); /* idempotent: races are benign */
                __atomic_store_n(&ready, 1, __ATOMIC_RELEASE);
            }
            i = 0;
#if defined(__AVX2__)
            if (stride == 1) /* contiguous (the transformers cache's norms): e4m3_to_float's bits, 8 at a time */
                for (; i + 8 <= count; i += 8) {
                    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + i)));
                    const __m256i e = _mm256_and_si256(_mm256_srli_epi32(b, 3), _mm256_set1_epi32(0xf));
                    const __m256i m = _mm256_and_si256(b, _mm256_set1_epi32(7));
                    const __m256i normal = _mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(120)), 23),
                                                           _mm256_slli_epi32(m, 20));
                    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(0.001953125f));
                    const __m256 mag = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub,
                                                        _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_setzero_si256())));
                    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
                    _mm256_storeu_ps(out + i, _mm256_or_ps(mag, _mm256_castsi256_ps(sign)));
                }
#endif
            for (; i < count; i++) out[i] = table[p[i * stride]];
        }
    }
}

/* b-bit code i of a packed row (LSB first) */
static inline int code_at(const uint8_t *row, int bits, int64_t i) {
    const int64_t pos = i * bits;
    uint32_t w = row[pos >> 3];
    if ((pos & 7) + bits > 8) w |= (uint32_t)row[(pos >> 3) + 1] << 8;
    return (int)((w >> (pos & 7)) & ((1u << bits) - 1));
}

/* whether codes of `bits` bits read `group` at a time are ones the kernels read: group 1 (scalar codes), or a vector
 * codebook's joint codes of g = 2, 4 or 8 fields of g bits <= 8 bits (whole joint codes in each byte-aligned run of
 * 8 codes, so every path reads 8 coordinates from `bits` bytes) */
static inline int group_ok(int bits, int group) {
    return group == 1 || ((group == 2 || group == 4 || group == 8) && group * bits <= 8);
}

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float *p) { v8f x; memcpy(&x, p, 32); return x; }
static inline void store8(float *p, v8f x) { memcpy(p, &x, 32); }
static inline float hsum8(v8f x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* exp(x) for x <= 0 (-inf allowed), 8 lanes: Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2, degree-6
 * Taylor polynomial (relative error < 2e-7), 2^k through the exponent bits; x < -87 gives exactly 0.
 * Plain GCC vector code: AVX2 where compiled for it, SSE pairs otherwise. */
static inline v8f select8(v8i mask, v8f a, v8f b) { /* mask ? a : b, lane by lane (masks are 0 / -1) */
    v8i ai, bi;
    memcpy(&ai, &a, 32);
    memcpy(&bi, &b, 32);
    ai = (ai & mask) | (bi & ~mask);
    memcpy(&a, &ai, 32);
    return a;
}

#if defined(__AVX2__) && defined(__FMA__)
/* the same steps with fused multiply-adds (one rounding per step) and the lane selects as blends */
static inline v8f exp8(v8f xv) {
    __m256 x;
    memcpy(&x, &xv, 32);
    const __m256 lo = _mm256_set1_ps(-87.0f), live = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_max_ps(x, lo); /* NaN -> -87 (the second operand), masked to 0 below like x < -87 */
    __m256 kf = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    kf = _mm256_add_ps(kf, _mm256_blendv_ps(_mm256_set1_ps(0.5f), _mm256_set1_ps(-0.5f), kf));
    const __m256i ki = _mm256_cvttps_epi32(kf); /* round half away from zero */
    kf = _mm256_cvtepi32_ps(ki);
    __m256 r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_fmadd_ps(r, _mm256_set1_ps(1.0f / 720), _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ki, _mm256_set1_epi32(127)), 23));
    const __m256 out = _mm256_and_ps(_mm256_mul_ps(p, scale), live);
    memcpy(&xv, &out, 32);
    return xv;
}
#else
static inline v8f exp8(v8f x) {
    const v8f zero = {0, 0, 0, 0, 0, 0, 0, 0};
    const v8i live = x >= -87.0f;
    x = select8(live, x, zero - 87.0f);
    v8f kf = x * 1.44269504088896341f;
    kf = kf + select8(kf < 0, zero - 0.5f, zero + 0.5f);
    const v8i ki = __builtin_convertvector(kf, v8i); /* round half away from zero */
    kf = __builtin_convertvector(ki, v8f);
    v8f r = x - kf * 0.693359375f;
    r = r - kf * -2.12194440e-4f;
    v8f p = r * (1.0f / 720) + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const v8i bits = (ki + 127) << 23;
    v8f scale;
    memcpy(&scale, &bits, 32);
    const v8f out = p * scale;
    v8i oi;
    memcpy(&oi, &out, 32);
    oi &= live;
    v8f res;
    memcpy(&res, &oi, 32);
    return res;
}
#endif

/* a row of n contiguous floats in dtype 0 fp32, 1 fp16 (F16C where compiled for it) or 2 bf16, as float32 */
static void read_row(const uint8_t *p, int dtype, int64_t n, float *out) {
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    if (dtype == 1)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))));
#endif
    read_run(p + i * dtype_bytes(dtype), dtype_bytes(dtype), dtype, n - i, out + i);
}

/* max(m, x[0], ..., x[len - 1]) (NaNs ignored, like `x > m ? x : m`) */
static inline float max_run(const float *x, int64_t len, float m) {
    int64_t i = 0;
#if defined(__AVX__)
    /* vmaxps(y, acc) is `y > acc ? y : acc` lane by lane (a NaN y keeps acc); two accumulators */
    __m256 m0 = _mm256_set1_ps(m), m1 = m0;
    for (; i + 16 <= len; i += 16) {
        m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
        m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
    }
    for (; i + 8 <= len; i += 8) m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
    float t[16];
    _mm256_storeu_ps(t, m0);
    _mm256_storeu_ps(t + 8, m1);
    for (int j = 0; j < 16; j++) m = t[j] > m ? t[j] : m;
#else
    v8f m8 = {m, m, m, m, m, m, m, m};
    for (; i + 8 <= len; i += 8) {
        const v8f y = load8(x + i);
        m8 = select8(y > m8, y, m8);
    }
    for (int j = 0; j < 8; j++) m = m8[j] > m ? m8[j] : m;
#endif
    for (; i < len; i++) m = x[i] > m ? x[i] : m;
    return m;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX2__) && defined(__FMA__)
/* exp8's steps on 16 lanes (each lane computed exactly as exp8 computes it) */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 live = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 kf = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __mmask16 neg = _mm512_movepi32_mask(_mm512_castps_si512(kf)); /* blendv's sign-bit select */
    kf = _mm512_add_ps(kf, _mm512_mask_blend_ps(neg, _mm512_set1_ps(0.5f), _mm512_set1_ps(-0.5f)));
    const __m512i ki = _mm512_cvttps_epi32(kf);
    kf = _mm512_cvtepi32_ps(ki);
    __m512 r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.0f / 720), _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(ki, _mm512_set1_epi32(127)), 23));
    return _mm512_maskz_mov_ps(live, _mm512_mul_ps(p, scale));
}
/* tot + e's lanes 0-7 + its lanes 8-15: 16 exponentials added as exp8's loop adds two groups of 8 */
static inline v8f add16_as_exp8(v8f tot, __m512 e) {
    v8f e0, e1;
    const __m256 h0 = _mm512_castps512_ps256(e), h1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1));
    memcpy(&e0, &h0, 32);
    memcpy(&e1, &h1, 32);
    tot += e0;
    return tot + e1;
}
#define QJL_HAVE_EXP16 1
#else
#define QJL_HAVE_EXP16 0
#endif

/* x[i] = exp(x[i] - m) for i < len; returns their sum (m finite; with exp16, the sums in exp8's order) */
static inline float exp_sum(float *x, int64_t len, float m) {
    v8f tot = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
#if QJL_HAVE_EXP16
    for (; i + 16 <= len; i += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(m)));
        _mm512_storeu_ps(x + i, e);
        tot = add16_as_exp8(tot, e);
    }
#endif
    for (; i + 8 <= len; i += 8) {
        const v8f e = exp8(load8(x + i) - m);
        store8(x + i, e);
        tot += e;
    }
    float s = hsum8(tot);
    if (i < len) {
        float buf[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
        memcpy(buf, x + i, sizeof(float) * (size_t)(len - i));
        const v8f e = exp8(load8(buf) - m);
        store8(buf, e);
        memcpy(x + i, buf, sizeof(float) * (size_t)(len - i));
        s += hsum8(e);
    }
    return s;
}

static inline float dot_f(const float *a, const float *b, int64_t n) {
    v8f acc0 = {0, 0, 0, 0, 0, 0, 0, 0}, acc1 = acc0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 += load8(a + i) * load8(b + i);
        acc1 += load8(a + i + 8) * load8(b + i + 8);
    }
    for (; i + 8 <= n; i += 8) acc0 += load8(a + i) * load8(b + i);
    float s = hsum8(acc0 + acc1);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* parallel_for: items [0, n) on `threads` threads (this one included), one at a time (dynamic scheduling).
 * With OpenMP (the build's default) the threads are libgomp's, the pool torch itself uses, so a worker still
 * spinning after torch's last operation takes the work at once instead of competing with a thread of ours;
 * without OpenMP, plain pthreads created per call and joined.  On an oversubscribed machine libgomp's
 * spin-waiting is costly (a 4k-token Llama layer: 335 ms with the default spin count, 28 ms with
 * OMP_WAIT_POLICY=passive, 5 ms with GOMP_SPINCOUNT=1000, set before torch is imported). */
#if defined(_OPENMP)
static void parallel_for(int64_t n, int threads, void (*fn)(void *, int64_t), void *ctx) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < n; i++) fn(ctx, i);
}
#else
#include <pthread.h>
typedef struct {
    void (*fn)(void *ctx, int64_t i);
    void *ctx;
    int64_t n, next;
} qjl_work;

static void *qjl_worker(void *p) {
    qjl_work *w = p;
    int64_t i;
    while ((i = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED)) < w->n) w->fn(w->ctx, i);
    return NULL;
}

static void parallel_for(int64_t n, int threads, void (*fn)(void *, int64_t), void *ctx) {
    qjl_work w = {fn, ctx, n, 0};
    int64_t extra = threads - 1 < n - 1 ? threads - 1 : n - 1;
    pthread_t tid[63];
    int started = 0;
    for (int64_t t = 0; t < extra && t < 63; t++)
        if (pthread_create(&tid[started], NULL, qjl_worker, &w) == 0) started++;
    qjl_worker(&w);
    for (int t = 0; t < started; t++) pthread_join(tid[t], NULL);
}
#endif

/* A run: `count` consecutive slots of one block (their fields at a fixed stride from `at`). */
typedef struct {
    const uint8_t *codes[2], *norm[2], *vcodes, *vscale, *vzero;
    int64_t t0, count; /* first coded token index of the run, and its length */
} qjl_run;
