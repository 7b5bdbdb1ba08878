/* Lloyd-Max encoding of rotated unit vectors (qjl.search.encode): the bucket + pack step of
 * TurboQuantMSE.quantize, fused, one pass per vector, OpenMP over vectors.
 *
 * y: [n, dim] float32; bounds: [nb] increasing interior cell edges; cents: [nb + 1].
 * idx_j = #{k : y_j > bounds[k]} (as qjl.lloyd_max.bucket), written as `bits`-bit little-endian
 * fields of one bit stream, LSB first (qjl.packing.pack_bits): out [n, ceil(dim * bits / 8)].
 * dot[i] = sum_j y_ij * cents[idx_ij] (<u, u_hat>, for the norm correction).
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

int qjl_encode_lm(const float *y, int64_t n, int64_t dim, const float *bounds, int nb, int bits,
                  const float *cents, uint8_t *out, float *dot, int nthreads)
{
    if (bits < 1 || bits > 8 || nb != (1 << bits) - 1) return -1;
    int64_t stride = (dim * bits + 7) / 8;
#ifdef _OPENMP
    if (nthreads < 1) nthreads = omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(nthreads)
#endif
    for (int64_t i = 0; i < n; i++) {
        const float *v = y + i * dim;
        uint8_t *o = out + i * stride;
        uint32_t acc = 0;
        int nacc = 0;
        int64_t w = 0;
        float d = 0.f;
        for (int64_t j = 0; j < dim; j++) {
            float x = v[j];
            int idx = 0;
            for (int k = 0; k < nb; k++) idx += x > bounds[k];
            d += x * cents[idx];
            acc |= (uint32_t)idx << nacc;
            nacc += bits;
            while (nacc >= 8) { o[w++] = (uint8_t)(acc & 0xFF); acc >>= 8; nacc -= 8; }
        }
        if (nacc > 0) o[w++] = (uint8_t)(acc & 0xFF);
        dot[i] = d;
    }
    return 0;
}
