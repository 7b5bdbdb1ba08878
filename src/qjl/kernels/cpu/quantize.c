/* The CPU half of TurboQuant MSE quantization: Lloyd-Max cells and LSB-first packing in one pass. */

typedef struct {
    const float *y, *bnd, *cent;
    int64_t n, nbytes;
    int32_t nbnd, bits;
    uint8_t *codes;
    float *cos;
} qjl_bucket_job;

static void bucket_row(void *ctx, int64_t i) {
    const qjl_bucket_job *j = ctx;
    const int64_t n = j->n, nbytes = j->nbytes;
    const int bits = j->bits, nbnd = j->nbnd;
    const float *yi = j->y + i * n, *bnd = j->bnd;
    uint8_t *out = j->codes + i * nbytes;
    memset(out, 0, (size_t)nbytes);
    float acc = 0.0f;
    for (int64_t c = 0; c < n; c++) {
        const float v = yi[c];
        int lo = 0, hi = nbnd; /* first boundary >= v */
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (bnd[mid] < v) lo = mid + 1;
            else hi = mid;
        }
        acc += v * j->cent[lo];
        const int64_t pos = c * bits;
        const uint32_t w = (uint32_t)lo << (pos & 7);
        out[pos >> 3] |= (uint8_t)w;
        if ((pos & 7) + bits > 8) out[(pos >> 3) + 1] |= (uint8_t)(w >> 8);
    }
    j->cos[i] = acc;
}

/* codes[i] = the cells of y[i] (number of boundaries below each coordinate, as torch.bucketize) packed
 * LSB-first, `bits` bits each; cos[i] = sum_c y[i, c] * cent[cell] (summed in coordinate order).
 * y [rows, n] float32; codes [rows, nbytes]. */
QJL_EXPORT int qjl_bucket_pack(const float *y, int64_t rows, int64_t n, const float *bnd, int32_t nbnd,
                               const float *cent, int32_t bits, uint8_t *codes, int64_t nbytes, float *cos,
                               int32_t threads) {
    if (bits < 1 || bits > 8 || nbnd != (1 << bits) - 1 || nbytes != (n * bits + 7) / 8) return -1;
    const qjl_bucket_job job = {y, bnd, cent, n, nbytes, nbnd, bits, codes, cos};
    parallel_for(rows, threads > 0 ? threads : 1, bucket_row, (void *)&job);
    return 0;
}
