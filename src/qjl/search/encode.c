/* Lloyd-Max encoding of rotated vectors (qjl.search.encode): the scale + bucket + pack step of
 * TurboQuantMSE.quantize, fused, one pass per vector, OpenMP over vectors.
 *
 * y: [n, dim] float32; norm: [n] divisors (NULL: none), u_ij = y_ij / norm_i (IEEE division, as torch's
 * y / norm[:, None]); bounds: [nb] increasing interior cell edges; cents: [nb + 1].
 * idx_j = #{k : u_j > bounds[k]} (as qjl.lloyd_max.bucket), written as `bits`-bit little-endian
 * fields of one bit stream, LSB first (qjl.packing.pack_bits): out [n, ceil(dim * bits / 8)].
 * rbits > 0 writes the fast scan's planes instead (qjl.search.fastscan.rows_to_planes): the stream of
 * idx >> rbits (bits - rbits each), then the stream of idx & (2^rbits - 1), each padded to whole bytes:
 * out [n, ceil(dim * (bits - rbits) / 8) + ceil(dim * rbits / 8)].
 * dot[i] = sum_j u_ij * cents[idx_ij] (<u, u_hat>, for the norm correction; summed in lanes of 8 on AVX2,
 * so equal to the reference up to float32 rounding).
 *
 * With AVX2 and bits <= 4, groups of 8 coordinates are bucketed by 8-wide compares and packed into `bits`
 * whole bytes (8 fields of `bits` bits); the remainder (dim % 8 coordinates) goes through the scalar loop.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef struct { uint8_t *o; uint32_t acc; int nacc; int64_t w; } bitstream;

static void put(bitstream *b, uint32_t v, int bits)
{
    b->acc |= v << b->nacc;
    b->nacc += bits;
    while (b->nacc >= 8) { b->o[b->w++] = (uint8_t)(b->acc & 0xFF); b->acc >>= 8; b->nacc -= 8; }
}

static void flush(bitstream *b)
{
    if (b->nacc > 0) b->o[b->w++] = (uint8_t)(b->acc & 0xFF);
}

/* coordinates [j0, dim) of one vector, appended to the stream(s) at byte offsets w0 (scan) and w1 (refine) */
static float encode_tail(const float *v, int64_t j0, int64_t dim, float s, int has_s, const float *bounds, int nb,
                         int bits, int rbits, const float *cents, uint8_t *o, int64_t w0, int64_t w1)
{
    bitstream a = {o, 0, 0, w0}, r = {o, 0, 0, w1};
    float d = 0.f;
    for (int64_t j = j0; j < dim; j++) {
        float x = has_s ? v[j] / s : v[j];
        int idx = 0;
        for (int k = 0; k < nb; k++) idx += x > bounds[k];
        d += x * cents[idx];
        if (rbits) {
            put(&a, (uint32_t)idx >> rbits, bits - rbits);
            put(&r, (uint32_t)idx & ((1u << rbits) - 1), rbits);
        } else {
            put(&a, (uint32_t)idx, bits);
        }
    }
    flush(&a);
    if (rbits) flush(&r);
    return d;
}

#ifdef __AVX2__
/* the 8 fields (each < 2^fbits) of lanes 0..7 as fbits whole bytes, lane 0 in the low bits */
static inline void put8(__m256i f, __m256i sh, int fbits, uint8_t *o)
{
    f = _mm256_sllv_epi32(f, sh);  /* disjoint fields: their sum is their OR */
    __m128i f4 = _mm_add_epi32(_mm256_castsi256_si128(f), _mm256_extracti128_si256(f, 1));
    f4 = _mm_add_epi32(f4, _mm_shuffle_epi32(f4, 0x4E));
    f4 = _mm_add_epi32(f4, _mm_shuffle_epi32(f4, 0xB1));
    uint32_t word = (uint32_t)_mm_cvtsi128_si32(f4);
    for (int b = 0; b < fbits; b++) o[b] = (uint8_t)(word >> (8 * b));
}
#endif

int qjl_encode_lm(const float *y, int64_t n, int64_t dim, const float *norm, const float *bounds, int nb, int bits,
                  int rbits, const float *cents, uint8_t *out, float *dot, int nthreads)
{
    if (bits < 1 || bits > 8 || nb != (1 << bits) - 1 || rbits < 0 || rbits >= bits) return -1;
    int sbits = bits - rbits;
    int64_t scan_bytes = (dim * sbits + 7) / 8;
    int64_t stride = rbits ? scan_bytes + (dim * rbits + 7) / 8 : (dim * bits + 7) / 8;
#ifdef __AVX2__
    float cpad[16] = {0};  /* the centroids, zero-padded to two 8-lane registers */
    if (bits <= 4) memcpy(cpad, cents, (size_t)(nb + 1) * sizeof(float));
#endif
#ifdef _OPENMP
    if (nthreads < 1) nthreads = omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(nthreads)
#endif
    for (int64_t i = 0; i < n; i++) {
        const float *v = y + i * dim;
        uint8_t *o = out + i * stride;
        float s = norm ? norm[i] : 1.f;
        int64_t j0 = 0;
        float d = 0.f;
#ifdef __AVX2__
        if (bits <= 4) {
            __m256 vs = _mm256_set1_ps(s), acc = _mm256_setzero_ps();
            __m256 lo = _mm256_loadu_ps(cpad), hi = _mm256_loadu_ps(cpad + 8);
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i sh = _mm256_mullo_epi32(lane, _mm256_set1_epi32(sbits));
            const __m256i shr = _mm256_mullo_epi32(lane, _mm256_set1_epi32(rbits));
            const __m256i rmask = _mm256_set1_epi32((1 << rbits) - 1);
            const __m128i rshift = _mm_cvtsi32_si128(rbits);
            int64_t groups = dim / 8;
            for (int64_t g = 0; g < groups; g++) {
                __m256 x = _mm256_loadu_ps(v + 8 * g);
                if (norm) x = _mm256_div_ps(x, vs);
                __m256i idx = _mm256_setzero_si256();
                for (int k = 0; k < nb; k++)  /* a true compare is all ones (-1): subtracting counts it */
                    idx = _mm256_sub_epi32(idx, _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_set1_ps(bounds[k]),
                                                                                    _CMP_GT_OQ)));
                __m256 c = _mm256_permutevar8x32_ps(lo, idx);
                if (nb + 1 > 8) {  /* 16 centroids: the high half where idx >= 8 */
                    __m256 ch = _mm256_permutevar8x32_ps(hi, idx);
                    __m256i big = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7));
                    c = _mm256_blendv_ps(c, ch, _mm256_castsi256_ps(big));
                }
                acc = _mm256_fmadd_ps(x, c, acc);
                if (rbits) {
                    put8(_mm256_srl_epi32(idx, rshift), sh, sbits, o + g * sbits);
                    put8(_mm256_and_si256(idx, rmask), shr, rbits, o + scan_bytes + g * rbits);
                } else {
                    put8(idx, sh, bits, o + g * bits);
                }
            }
            __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            a4 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
            a4 = _mm_add_ss(a4, _mm_shuffle_ps(a4, a4, 0x55));
            d = _mm_cvtss_f32(a4);
            j0 = groups * 8;
        }
#endif
        d += encode_tail(v, j0, dim, s, norm != 0, bounds, nb, bits, rbits, cents, o,
                         j0 * (rbits ? sbits : bits) / 8, scan_bytes + j0 * rbits / 8);
        dot[i] = d;
    }
    return 0;
}
