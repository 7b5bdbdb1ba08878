/* Decoded rows of paged codes: the vectors a value view (qjl_value_view, decode.h) describes, read through one
 * sequence's block-table row, for a run of tokens and every KV head -- what the vLLM backend's prefill attends
 * to as its history.  In the codec's basis (TurboQuant: rotated):
 *     r[t, h, c] = zero[t, h, g] + scale[t, h, g] * cent[code[t, h, c]],  g = c / group_size
 * (without a zero point: scale * cent; for grouped codes, a vector codebook's with view group G > 1, cent[e G + c % G]
 * with e the joint code of c's G fields: grouped_row), one float multiply and one add per element, in that order and
 * never fused, so that the result equals the codecs' torch dequantization in their basis bit for bit (the torch
 * reference: qjl.kernels.cpu.rows.value_rows_reference).  With the view's unmix [K n, out_dim] the row is mapped
 * back, o[j] = sum_c r[c] * unmix[k n + c, j] in float32 (c in order, fused multiply-adds; K the view's cycles, k = t
 * % K for the token at code position t: its own rotation's inverse; rows of K > 1 cycles are read mapped back
 * only), one row at a time while it is in L1 (no [tokens, heads, n] intermediate).  Each row is written in the
 * output's dtype (fp32, or fp16 / bf16 rounded to nearest even as torch's .to(), quantize.c's store_scalar) at byte
 * strides per token and head. */

/* the codes of one packed row -> cent[code] (n codes, n a multiple of 8: whole bytes per 8 codes); `bits` a
 * constant at each call site, so that the 8-code loads and shifts compile to fixed ones */
static inline __attribute__((always_inline)) void centroid_row(const uint8_t *row, const int bits, int64_t n,
                                                               const float *cent, float *out) {
    const uint64_t mask = (1u << bits) - 1u;
    const int64_t groups = n / 8;
    for (int64_t g = 0; g < groups; g++) {
        uint64_t w = 0; /* 8 codes in `bits` bytes (little-endian, LSB first); a whole word where the row has 8 bytes
                           from here (the bytes past the group are shifted out), else exactly `bits` */
        if ((groups - g) * bits >= 8) memcpy(&w, row + g * bits, 8);
        else memcpy(&w, row + g * bits, (size_t)bits);
        for (int j = 0; j < 8; j++) out[8 * g + j] = cent[(w >> (j * bits)) & mask];
    }
}

/* grouped codes (a vector codebook, group g = 2, 4 or 8 with g bits <= 8; decode.h): centroid_row's words, each 8
 * codes' 8 / g joint codes e of g bits bits (the g fields, the first in the low bits) copied as cent[e g .. e g + g)
 * -- PackedCodes.values, bit for bit; `bits` and `group` constants at the vector codebooks' call sites */
static inline __attribute__((always_inline)) void grouped_row(const uint8_t *row, const int bits, const int group,
                                                              int64_t n, const float *cent, float *out) {
    const int jb = group * bits;
    const uint64_t mask = (1u << jb) - 1u;
    const int64_t groups = n / 8;
    for (int64_t g = 0; g < groups; g++) {
        uint64_t w = 0; /* (as centroid_row) */
        if ((groups - g) * bits >= 8) memcpy(&w, row + g * bits, 8);
        else memcpy(&w, row + g * bits, (size_t)bits);
        for (int j = 0; j < 8 / group; j++) {
            const float *src = cent + ((w >> (j * jb)) & mask) * (uint64_t)group;
            for (int s = 0; s < group; s++) out[8 * g + j * group + s] = src[s];
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
/* centroid_row for codes of up to 5 bits where the build has AVX-512 (-march=native): 16 codes at a time, two
 * 8-code words each broadcast to 8 qword lanes, shifted per lane to their code, narrowed to 16 dword indices and
 * looked up in the centroids held in two registers (vpermt2ps; cent[j & mask] repeated over 32 entries) -- the
 * same floats as the scalar lookups, about 6x fewer instructions.  n a multiple of 16; `tab` [32]. */
static inline __attribute__((always_inline)) void centroid_row16(const uint8_t *row, const int bits, int64_t n,
                                                                 const float *tab, float *out) {
    const __m512i shifts = _mm512_setr_epi64(0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits, 6 * bits, 7 * bits);
    const __m512i mask = _mm512_set1_epi64((1 << bits) - 1);
    const __m512 lo = _mm512_loadu_ps(tab), hi = _mm512_loadu_ps(tab + 16);
    const int64_t groups = n / 8;
    for (int64_t g = 0; g < groups; g += 2) {
        uint64_t w0 = 0, w1 = 0; /* as centroid_row: a whole word where the row has 8 bytes from there */
        if ((groups - g) * bits >= 8) memcpy(&w0, row + g * bits, 8);
        else memcpy(&w0, row + g * bits, (size_t)bits);
        if ((groups - g - 1) * bits >= 8) memcpy(&w1, row + (g + 1) * bits, 8);
        else memcpy(&w1, row + (g + 1) * bits, (size_t)bits);
        const __m512i c0 = _mm512_and_si512(_mm512_srlv_epi64(_mm512_set1_epi64((long long)w0), shifts), mask);
        const __m512i c1 = _mm512_and_si512(_mm512_srlv_epi64(_mm512_set1_epi64((long long)w1), shifts), mask);
        const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(c0)),
                                               _mm512_cvtepi64_epi32(c1), 1);
        _mm512_storeu_ps(out + 8 * g, _mm512_permutex2var_ps(lo, idx, hi));
    }
}
#define QJL_ROWS16 1
#else
#define QJL_ROWS16 0
#endif

/* out[k] = sum_c r[c] * u[c * m + k], c in order, each step one fused multiply-add (fmaf: vectorized over k; the
 * unmixed rows are held to the reference's rows times the matrix within 1e-5, not bit for bit).  Against a rounded
 * product then a sum, the unmix of 10.7k 64-wide rows took 0.49 instead of 0.71 ms (Intel Xeon with AVX-512, 2
 * threads, a scratch timing); 512-bit vectors measured no faster than GCC's default 256. */
static inline __attribute__((always_inline)) void unmix_row(const float *restrict r, int64_t n,
                                                           const float *restrict u, const int64_t m,
                                                           float *restrict out) {
    float acc[m]; /* (local, so that with m a constant the sums can live in registers) */
    for (int64_t k = 0; k < m; k++) acc[k] = 0.0f;
    for (int64_t c = 0; c < n; c++) {
        const float rc = r[c], *uc = u + c * m;
        for (int64_t k = 0; k < m; k++) acc[k] = fmaf(rc, uc[k], acc[k]);
    }
    for (int64_t k = 0; k < m; k++) out[k] = acc[k];
}

/* x [m] -> bf16 bits, rounded to nearest even, NaN as torch writes it (quantize.c's float_to_bf16_bits, in a loop
 * the compiler vectorizes) */
static inline void bf16_row(const float *x, int64_t m, uint16_t *out) {
    for (int64_t k = 0; k < m; k++) {
        uint32_t b;
        memcpy(&b, x + k, 4);
        const uint32_t r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
        out[k] = (uint16_t)((b & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r);
    }
}

typedef struct {
    const qjl_value_view *v;
    const int32_t *blocks;
    int64_t block_size, heads, start, end, first_block;
    uint8_t *out;
    int32_t out_dtype;
    int64_t out_st, out_sh; /* bytes between tokens, heads (elements contiguous) */
    int *failed;            /* set where an item could not get its buffers (then the call returns -1) */
} qjl_rows_job;

/* one (block, head): its tokens within [start, end) */
static void rows_item(void *ctx, int64_t item) {
    const qjl_rows_job *j = ctx;
    const qjl_value_view *v = j->v;
    const int64_t b = j->first_block + item / j->heads, h = item % j->heads, bs = j->block_size;
    const int64_t t0 = b * bs > j->start ? b * bs : j->start, t1 = (b + 1) * bs < j->end ? (b + 1) * bs : j->end;
    const int64_t count = t1 - t0, n = v->n, G = v->groups, gs = v->group_size;
    if (count <= 0) return;
    const int64_t blk = j->blocks[b], slot = t0 - b * bs;
    const uint8_t *codes = v->codes.base + blk * v->codes.stride_block + h * v->codes.stride_head +
                           slot * v->codes.stride_token;
    const int64_t m = v->unmix ? v->out_dim : n, es = dtype_bytes(j->out_dtype);
    float *scale = malloc(sizeof(float) * (size_t)(2 * G * count)), *zero = scale + G * count;
    float *o = malloc(sizeof(float) * (size_t)(n + m)), *mixed = o + n; /* one row, in the codec's basis and out */
    if (!scale || !o) {
        __atomic_store_n(j->failed, 1, __ATOMIC_RELAXED);
        free(scale), free(o);
        return;
    }
    for (int64_t g = 0; g < G; g++) { /* a group's scalars of the run (entry g of each token's [groups] field) */
        const int64_t eb = dtype_bytes(v->scale.dtype);
        read_run(v->scale.base + blk * v->scale.stride_block + h * v->scale.stride_head + slot * v->scale.stride_token
                 + g * eb, v->scale.stride_token, v->scale.dtype, count, scale + g * count);
        if (v->has_zero)
            read_run(v->zero.base + blk * v->zero.stride_block + h * v->zero.stride_head +
                     slot * v->zero.stride_token + g * dtype_bytes(v->zero.dtype),
                     v->zero.stride_token, v->zero.dtype, count, zero + g * count);
    }
    float tab[32]; /* the centroids repeated over 32 entries (centroid_row16's registers) */
    /* rows in the codec's basis only: before the unmix the wide lookups measured no faster, at times slower (a
     * scratch timing on an Intel Xeon with AVX-512; rows alone 0.47 -> 0.32 ms for 10.7k rows of 3-bit codes) */
    const int wide = QJL_ROWS16 && v->bits <= 5 && n % 16 == 0 && !v->unmix && v->group == 1;
    for (int j = 0; j < 32 && wide; j++) tab[j] = v->cent[j & ((1 << v->bits) - 1)];
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = codes + i * v->codes.stride_token;
        if (v->group > 1) switch (v->group * 16 + v->bits) { /* a vector codebook's joint codes */
            case 0x42: grouped_row(row, 2, 4, n, v->cent, o); break;
            case 0x23: grouped_row(row, 3, 2, n, v->cent, o); break;
            case 0x24: grouped_row(row, 4, 2, n, v->cent, o); break;
            default: grouped_row(row, v->bits, v->group, n, v->cent, o); break;
            }
        else
#if QJL_ROWS16
        if (wide) switch (v->bits) {
            case 1: centroid_row16(row, 1, n, tab, o); break;
            case 2: centroid_row16(row, 2, n, tab, o); break;
            case 3: centroid_row16(row, 3, n, tab, o); break;
            case 4: centroid_row16(row, 4, n, tab, o); break;
            default: centroid_row16(row, 5, n, tab, o); break;
            }
        else
#endif
        switch (v->bits) {
        case 1: centroid_row(row, 1, n, v->cent, o); break;
        case 2: centroid_row(row, 2, n, v->cent, o); break;
        case 3: centroid_row(row, 3, n, v->cent, o); break;
        case 4: centroid_row(row, 4, n, v->cent, o); break;
        case 5: centroid_row(row, 5, n, v->cent, o); break;
        case 6: centroid_row(row, 6, n, v->cent, o); break;
        case 7: centroid_row(row, 7, n, v->cent, o); break;
        default: centroid_row(row, 8, n, v->cent, o); break;
        }
        for (int64_t g = 0; g < G; g++) {
            const float s = scale[g * count + i];
            const int64_t c1 = (g + 1) * gs < n ? (g + 1) * gs : n;
            if (v->has_zero) {
                const float z = zero[g * count + i];
                for (int64_t c = g * gs; c < c1; c++) {
                    const float p = s * o[c]; /* (two statements: no contraction into a fused multiply-add) */
                    o[c] = z + p;
                }
            } else
                for (int64_t c = g * gs; c < c1; c++) o[c] = s * o[c];
        }
        const float *res = o;
        if (v->unmix) { /* mixed = o @ unmix (the usual widths as constants: the sums stay in registers) */
            const float *u = v->unmix + ((t0 + i) % v->cycles) * n * m; /* the token's own rotation (K cycles) */
            if (m == 64) unmix_row(o, n, u, 64, mixed);
            else if (m == 128) unmix_row(o, n, u, 128, mixed);
            else unmix_row(o, n, u, m, mixed);
            res = mixed;
        }
        uint8_t *dst = j->out + (t0 - j->start + i) * j->out_st + h * j->out_sh;
        if (j->out_dtype == 0) memcpy(dst, res, sizeof(float) * (size_t)m);
        else if (j->out_dtype == 2) bf16_row(res, m, (uint16_t *)(void *)dst);
        else
            for (int64_t k = 0; k < m; k++) store_scalar(dst + k * es, res[k], j->out_dtype);
    }
    free(o);
    free(scale);
}

/* Rows of tokens [start, end) of one sequence (`blocks`: its block-table row, n_blocks entries, each <= max_block),
 * every head: row (t, h) at out + (t - start) * out_st + h * out_sh (bytes), v->n elements in the codec's basis, or
 * v->out_dim mapped back where v->unmix is set (required with v->cycles > 1), in out_dtype (0 fp32, 1 fp16, 2
 * bf16).  Returns 0, -1 for arguments outside this contract (nothing written) or no memory for a work item's
 * buffers (its rows unwritten), -4 / -5 for a block index below 0 / above max_block (nothing written). */
QJL_EXPORT int qjl_value_rows(const qjl_value_view *v, const int32_t *blocks, int64_t n_blocks, int64_t block_size,
                              int64_t heads, int64_t start, int64_t end, int64_t max_block, uint8_t *out,
                              int32_t out_dtype, int64_t out_st, int64_t out_sh, int32_t threads) {
    if (!v || !blocks || !out || !v->cent || v->bits < 1 || v->bits > 8 || v->n < 8 || v->n % 8 ||
        v->group_size < 1 || v->groups < 1 || (v->groups - 1) * v->group_size >= v->n || block_size < 1 ||
        heads < 1 || start < 0 || end < start || end > n_blocks * block_size || v->scale.dtype < 0 ||
        v->scale.dtype > 3 || (v->has_zero && (v->zero.dtype < 0 || v->zero.dtype > 3)) || out_dtype < 0 ||
        out_dtype > 2 || (v->unmix && v->out_dim < 1) || out_st < 0 || out_sh < 0 || v->cycles < 1 ||
        v->cycles > 64 || (v->cycles > 1 && !v->unmix) || !group_ok(v->bits, v->group))
        return -1;
    if (end == start) return 0;
    const int64_t b0 = start / block_size, b1 = (end - 1) / block_size;
    for (int64_t b = b0; b <= b1; b++) {
        if (blocks[b] < 0) return -4;
        if (blocks[b] > max_block) return -5;
    }
    int failed = 0;
    qjl_rows_job job = {v, blocks, block_size, heads, start, end, b0, out, out_dtype, out_st, out_sh, &failed};
    parallel_for((b1 - b0 + 1) * heads, threads > 0 ? threads : 1, rows_item, &job);
    return failed ? -1 : 0;
}
