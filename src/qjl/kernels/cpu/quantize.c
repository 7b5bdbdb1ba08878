/* The CPU half of TurboQuant MSE quantization: Lloyd-Max cells (the number of boundaries below each coordinate,
 * as torch.bucketize), LSB-first packing, the norm correction's cosine (summed in coordinate order) and the
 * stored norm in one pass (qjl_bucket_norms); the rows' store into paged fields (qjl_store_rows); the cells'
 * moments per row, which the width allocation's distortions read (qjl_cell_moments). */

typedef struct {
    const float *y, *bnd, *cent;
    int64_t n, nbytes;
    int32_t nbnd, bits;
    uint8_t *codes;
    float *cos;
} qjl_bucket_job;

/* The Lloyd-Max cell of v: the number of the 2^bits - 1 sorted boundaries below it (torch.bucketize), by a
 * branchless search (top = 2^(bits - 1)). */
static inline int lm_cell(const float *bnd, int top, float v) {
    int idx = 0;
    for (int step = top; step; step >>= 1) idx += bnd[idx + step - 1] < v ? step : 0;
    return idx;
}

/* Up to this many boundaries (5-bit codebooks) the cells are counted boundary by boundary across coordinates (the
 * compiler vectorizes the count; the same cells as lm_cell's search, which is serial per coordinate); above, searched. */
#define QJL_COUNT_CELLS 31

/* y [n]'s cells (lm_cell) packed `bits` bits each, LSB-first, into out [ceil(n bits / 8)]; returns the norm
 * correction's cosine sum_c y[c] * cent[cell_c], summed in float32 in coordinate order. */
static float cells_packed(const float *y, int64_t n, const float *bnd, int nbnd, const float *cent, int bits,
                          uint8_t *out) {
    memset(out, 0, (size_t)((n * bits + 7) / 8));
    float cos = 0.0f;
    const int top = (nbnd + 1) / 2;
    int32_t cells[n]; /* (head dimensions: a few KB on the stack) */
    if (nbnd <= QJL_COUNT_CELLS) {
        for (int64_t c = 0; c < n; c++) cells[c] = 0;
        for (int b = 0; b < nbnd; b++) { /* the number of boundaries below y[c]: lm_cell's result, sorted bnd */
            const float t = bnd[b];
            for (int64_t c = 0; c < n; c++) cells[c] += t < y[c];
        }
    } else {
        for (int64_t c = 0; c < n; c++) cells[c] = lm_cell(bnd, top, y[c]);
    }
    for (int64_t c = 0; c < n; c++) {
        const int cell = cells[c];
        cos += y[c] * cent[cell];
        const int64_t pos = c * bits;
        const uint32_t w = (uint32_t)cell << (pos & 7);
        out[pos >> 3] |= (uint8_t)w;
        if ((pos & 7) + bits > 8) out[(pos >> 3) + 1] |= (uint8_t)(w >> 8);
    }
    return cos;
}

static void bucket_row(void *ctx, int64_t i) {
    const qjl_bucket_job *j = ctx;
    j->cos[i] = cells_packed(j->y + i * j->n, j->n, j->bnd, j->nbnd, j->cent, j->bits, j->codes + i * j->nbytes);
}

/* Moments of rows y [rows, n] against a Lloyd-Max codebook of 2^bits cells: cos[i] = sum_c y[i,c] * cent[cell],
 * cc[i] = sum_c cent[cell]^2 (cell = the number of boundaries below y[i,c], as torch.bucketize), float64 sums
 * in coordinate order (cells counted boundary by boundary up to QJL_COUNT_CELLS boundaries, else lm_cell). */
typedef struct {
    const float *y, *bnd, *cent;
    int64_t rows, n;
    int32_t bits;
    double *cos, *cc;
} qjl_moments_job;

#define QJL_MOMENT_ROWS 64
#define QJL_MOMENT_CHUNK 256 /* coordinates whose cells are found together */

static void moments_rows(void *ctx, int64_t item) {
    const qjl_moments_job *j = ctx;
    const int64_t r0 = item * QJL_MOMENT_ROWS;
    const int64_t r1 = r0 + QJL_MOMENT_ROWS < j->rows ? r0 + QJL_MOMENT_ROWS : j->rows;
    const int top = 1 << (j->bits - 1), nbnd = (1 << j->bits) - 1;
    int32_t cells[QJL_MOMENT_CHUNK];
    for (int64_t i = r0; i < r1; i++) {
        const float *yi = j->y + i * j->n;
        double cs = 0.0, sq = 0.0;
        for (int64_t c0 = 0; c0 < j->n; c0 += QJL_MOMENT_CHUNK) {
            const int64_t m = j->n - c0 < QJL_MOMENT_CHUNK ? j->n - c0 : QJL_MOMENT_CHUNK;
            if (nbnd <= QJL_COUNT_CELLS) { /* the cells counted boundary by boundary (vectorized), as cells_packed */
                for (int64_t c = 0; c < m; c++) cells[c] = 0;
                for (int b = 0; b < nbnd; b++) {
                    const float t = j->bnd[b];
                    for (int64_t c = 0; c < m; c++) cells[c] += t < yi[c0 + c];
                }
            } else {
                for (int64_t c = 0; c < m; c++) cells[c] = lm_cell(j->bnd, top, yi[c0 + c]);
            }
            for (int64_t c = 0; c < m; c++) { /* then the sums, in coordinate order */
                const double ct = j->cent[cells[c]];
                cs += (double)yi[c0 + c] * ct;
                sq += ct * ct;
            }
        }
        j->cos[i] = cs;
        j->cc[i] = sq;
    }
}

/* Returns 0, or -1 for bad arguments (bits outside 1..8, nbnd != 2^bits - 1, a non-finite entry of y: then
 * the outputs are unspecified). */
QJL_EXPORT int qjl_cell_moments(const float *y, int64_t rows, int64_t n, const float *bnd, int32_t nbnd,
                                const float *cent, int32_t bits, double *cos, double *cc, int32_t threads) {
    if (bits < 1 || bits > 8 || nbnd != (1 << bits) - 1 || rows < 0 || n < 1) return -1;
    for (int64_t i = 0; i < rows * n; i++)
        if (!isfinite(y[i])) return -1;
    const qjl_moments_job job = {y, bnd, cent, rows, n, bits, cos, cc};
    const int64_t items = (rows + QJL_MOMENT_ROWS - 1) / QJL_MOMENT_ROWS;
    parallel_for(items, items > 1 && threads > 1 ? threads : 1, moments_rows, (void *)&job);
    return 0;
}

/* -- nearest codeword of a vector codebook (TurboQuantVQ) ----------------------------------------------------------
 * The index minimizing sq[e] - 2 <y, c_e> in float32, the products summed in coordinate order, then the subtraction
 * (no fused multiply-add: -std=c99 keeps fp-contract off), ties to the lowest index: exactly
 * qjl.core.vq_codebook.nearest_reference.  Three ways, the same indices: a plain loop; AVX2, 8 codewords at a time
 * over the table transposed to [g][k]; for pairs (g = 2), a grid of candidate lists
 * (qjl.core.vq_codebook.search_grid: cells x cells squares of [lo, lo + cells / inv)^2, each listing every codeword
 * that can be nearest to a point of the square, slightly enlarged, with a margin above float32 rounding): a pair
 * inside the grid is compared with its square's list (ascending: ties to the lowest), a pair outside with all. */
typedef struct {
    float lo, inv;
    int32_t cells;
    const int32_t *off, *cand;
} qjl_grid;

#define QJL_NEAREST_GROUPS 256

#if QJL_HAVE_AVX2
/* The nearest codeword of u (1, 2 or 4) groups y [u][g] (g <= 4) against the transposed table tt [g][k]
 * (k % 8 == 0): each lane keeps its first strict minimum and that codeword's index; the groups are independent
 * chains. */
static inline __attribute__((always_inline)) void nearest_avx2(const float *y, const int u, const int g,
                                                               const float *tt, const float *sq, int32_t k,
                                                               int64_t *out) {
    __m256 yv[4][4], best[4];
    __m256i arg8[4];
    for (int q = 0; q < u; q++) {
        for (int t = 0; t < g; t++) yv[q][t] = _mm256_set1_ps(y[q * g + t]);
        best[q] = _mm256_set1_ps(INFINITY);
        arg8[q] = _mm256_setzero_si256();
    }
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    for (int32_t e = 0; e < k; e += 8) {
        __m256 c[4];
        c[0] = _mm256_loadu_ps(tt + e); /* (g >= 1) */
        for (int t = 1; t < g; t++) c[t] = _mm256_loadu_ps(tt + (size_t)t * k + e);
        const __m256 sqe = _mm256_loadu_ps(sq + e);
        for (int q = 0; q < u; q++) {
            __m256 s = _mm256_mul_ps(yv[q][0], c[0]);
            for (int t = 1; t < g; t++) s = _mm256_add_ps(s, _mm256_mul_ps(yv[q][t], c[t]));
            const __m256 de = _mm256_sub_ps(sqe, _mm256_add_ps(s, s)); /* sq - 2 s, exactly */
            const __m256 lt = _mm256_cmp_ps(de, best[q], _CMP_LT_OQ);
            best[q] = _mm256_blendv_ps(best[q], de, lt);
            arg8[q] = _mm256_castps_si256(
                _mm256_blendv_ps(_mm256_castsi256_ps(arg8[q]), _mm256_castsi256_ps(idx), lt));
        }
        idx = _mm256_add_epi32(idx, step);
    }
    for (int q = 0; q < u; q++) {
        float bv[8];
        int32_t bi[8];
        _mm256_storeu_ps(bv, best[q]);
        _mm256_storeu_si256((__m256i *)bi, arg8[q]);
        float m = bv[0];
        int32_t arg = bi[0];
        for (int l = 1; l < 8; l++) /* the smallest value; among equal ones the lowest index, as torch.argmin */
            if (bv[l] < m || (bv[l] == m && bi[l] < arg)) m = bv[l], arg = bi[l];
        out[q] = arg;
    }
}
#endif

/* The first strict minimum over `count` codewords (list[p], or p without a list) of one group y [g]. */
static inline int32_t group_best(const float *y, int g, const float *table, const float *sq, const int32_t *list,
                                 int32_t count) {
    float best = INFINITY;
    int32_t arg = list ? list[0] : 0;
    for (int32_t p = 0; p < count; p++) {
        const int32_t e = list ? list[p] : p;
        float s = y[0] * table[(int64_t)e * g];
        for (int t = 1; t < g; t++) s = s + y[t] * table[(int64_t)e * g + t];
        const float de = sq[e] - 2.0f * s;
        if (de < best) best = de, arg = e;
    }
    return arg;
}

/* The nearest codeword of `count` consecutive groups y [count][g] -> out [count]; tt: the table transposed [g][k]
 * (or NULL: the plain loop), grid: for pairs (or NULL). */
static void nearest_block(const float *y, int64_t count, int g, const float *table, const float *tt, const float *sq,
                          int32_t k, const qjl_grid *grid, int64_t *out) {
    if (grid && g == 2) {
        const float top = (float)grid->cells;
        for (int64_t i = 0; i < count; i++) {
            const float y0 = y[2 * i], y1 = y[2 * i + 1];
            const float fa = (y0 - grid->lo) * grid->inv, fb = (y1 - grid->lo) * grid->inv;
            if (fa >= 0.0f && fa < top && fb >= 0.0f && fb < top) {
                const int32_t c = (int32_t)fa * grid->cells + (int32_t)fb;
                out[i] = group_best(y + 2 * i, 2, table, sq, grid->cand + grid->off[c], grid->off[c + 1] - grid->off[c]);
            } else {
                out[i] = group_best(y + 2 * i, 2, table, sq, NULL, k);
            }
        }
        return;
    }
#if QJL_HAVE_AVX2
    if (tt && k % 8 == 0 && g <= 4) { /* (the group size a constant in each call, so that the loops unroll) */
        int64_t i = 0;
        if (g == 2)
            for (; i + 4 <= count; i += 4) nearest_avx2(y + i * 2, 4, 2, tt, sq, k, out + i);
        else if (g == 4)
            for (; i + 2 <= count; i += 2) nearest_avx2(y + i * 4, 2, 4, tt, sq, k, out + i);
        for (; i < count; i++) nearest_avx2(y + i * g, 1, g, tt, sq, k, out + i);
        return;
    }
#else
    (void)tt;
#endif
    for (int64_t i = 0; i < count; i++) out[i] = group_best(y + i * g, g, table, sq, NULL, k);
}

/* The table transposed to [g][k] for the AVX2 search (NULL where it is not used or memory is short: the caller
 * then searches with the plain loop, the same indices). */
static float *transposed(const float *table, int g, int32_t k, const qjl_grid *grid) {
    if ((grid && g == 2) || !QJL_HAVE_AVX2 || k % 8 || g > 4) return NULL;
    float *tt = malloc(sizeof(float) * (size_t)g * (size_t)k);
    if (tt)
        for (int t = 0; t < g; t++)
            for (int32_t e = 0; e < k; e++) tt[(size_t)t * k + e] = table[(int64_t)e * g + t];
    return tt;
}

typedef struct {
    const float *y, *table, *sq;
    int64_t groups;
    int32_t g, k;
    const qjl_grid *grid;
    int64_t *out;
} qjl_nearest_job;

static void nearest_groups(void *ctx, int64_t item) {
    const qjl_nearest_job *j = ctx;
    const int64_t i0 = item * QJL_NEAREST_GROUPS;
    const int64_t i1 = i0 + QJL_NEAREST_GROUPS < j->groups ? i0 + QJL_NEAREST_GROUPS : j->groups;
    float *tt = transposed(j->table, j->g, j->k, j->grid);
    nearest_block(j->y + i0 * j->g, i1 - i0, j->g, j->table, tt, j->sq, j->k, j->grid, j->out + i0);
    free(tt);
}

/* Checks the arguments the searches share: 0, or -1 (g outside 1..8, k outside 1..65536, a grid that is not one:
 * a square with an empty list or an index out of range, or a non-finite y). */
static int check_search(const float *y, int64_t values, int32_t g, int32_t k, const qjl_grid *grid) {
    if (g < 1 || g > 8 || k < 1 || k > 65536 || values < 0) return -1;
    if (grid) {
        if (g != 2 || grid->cells < 1 || grid->cells > 4096 || !(grid->inv > 0.0f) || !isfinite(grid->lo)) return -1;
        const int64_t squares = (int64_t)grid->cells * grid->cells;
        if (grid->off[0] != 0) return -1;
        for (int64_t c = 0; c < squares; c++)
            if (grid->off[c + 1] <= grid->off[c]) return -1;
        for (int64_t p = 0; p < grid->off[squares]; p++)
            if (grid->cand[p] < 0 || grid->cand[p] >= k) return -1;
    }
    for (int64_t i = 0; i < values; i++)
        if (!isfinite(y[i])) return -1;
    return 0;
}

/* The nearest codeword of each group: y [groups, g], table [k, g], sq [k] (the codewords' squared norms) -> out
 * [groups].  Returns 0; -1 for bad arguments (g outside 1..8, k outside 1..65536) or a non-finite y. */
QJL_EXPORT int qjl_vq_nearest(const float *y, int64_t groups, int32_t g, const float *table, int32_t k, const float *sq,
                              int64_t *out, int32_t threads) {
    if (check_search(y, groups * g, g, k, NULL)) return -1;
    const qjl_nearest_job job = {y, table, sq, groups, g, k, NULL, out};
    const int64_t items = (groups + QJL_NEAREST_GROUPS - 1) / QJL_NEAREST_GROUPS;
    parallel_for(items, items > 1 && threads > 1 ? threads : 1, nearest_groups, (void *)&job);
    return 0;
}

/* The same for pairs through a grid (lo, inv: squares per unit, cells; off [cells^2 + 1], cand [off[cells^2]]: each
 * square's codewords, ascending) -> qjl_vq_nearest's indices.  Returns 0; -1 for bad arguments or a non-finite y. */
QJL_EXPORT int qjl_vq_nearest_grid(const float *y, int64_t groups, const float *table, int32_t k, const float *sq,
                                   float lo, float inv, int32_t cells, const int32_t *off, const int32_t *cand,
                                   int64_t *out, int32_t threads) {
    const qjl_grid grid = {lo, inv, cells, off, cand};
    if (check_search(y, groups * 2, 2, k, &grid)) return -1;
    const qjl_nearest_job job = {y, table, sq, groups, 2, k, &grid, out};
    const int64_t items = (groups + QJL_NEAREST_GROUPS - 1) / QJL_NEAREST_GROUPS;
    parallel_for(items, items > 1 && threads > 1 ? threads : 1, nearest_groups, (void *)&job);
    return 0;
}

/* Moments of rows y [rows, n] against their nearest codewords, group by group (g | n): cos[i] = sum_c y[i,c] *
 * chat[c], cc[i] = sum_c chat[c]^2 with chat the codewords chosen (qjl_vq_nearest's), float64 sums in coordinate
 * order: what the width allocation reads a vector candidate's error from (TurboQuantVQ.cell_moments). */
typedef struct {
    const float *y, *table, *sq;
    int64_t rows, n;
    int32_t g, k;
    const qjl_grid *grid;
    double *cos, *cc;
} qjl_vq_moments_job;

static void vq_moments_rows(void *ctx, int64_t item) {
    const qjl_vq_moments_job *j = ctx;
    const int64_t r0 = item * QJL_MOMENT_ROWS;
    const int64_t r1 = r0 + QJL_MOMENT_ROWS < j->rows ? r0 + QJL_MOMENT_ROWS : j->rows;
    const int64_t per = j->n / j->g;
    int64_t *code = malloc(sizeof(int64_t) * (size_t)per);
    float *tt = transposed(j->table, j->g, j->k, j->grid);
    for (int64_t i = r0; i < r1; i++) {
        const float *yi = j->y + i * j->n;
        double cs = 0.0, sq = 0.0;
        if (code) nearest_block(yi, per, j->g, j->table, tt, j->sq, j->k, j->grid, code);
        for (int64_t q = 0; q < per; q++) { /* (no memory for the codes: one group at a time, the same indices) */
            const int64_t e = code ? code[q] : group_best(yi + q * j->g, j->g, j->table, j->sq, NULL, j->k);
            for (int t = 0; t < j->g; t++) {
                const double ct = j->table[e * j->g + t];
                cs += (double)yi[q * j->g + t] * ct;
                sq += ct * ct;
            }
        }
        j->cos[i] = cs;
        j->cc[i] = sq;
    }
    free(tt);
    free(code);
}

/* y [rows, n] (n a multiple of g), table [k, g], sq [k], the grid for pairs (cells 0: none) -> cos, cc [rows].
 * Returns 0; -1 for bad arguments or a non-finite y. */
QJL_EXPORT int qjl_vq_moments(const float *y, int64_t rows, int64_t n, int32_t g, const float *table, int32_t k,
                              const float *sq, float lo, float inv, int32_t cells, const int32_t *off,
                              const int32_t *cand, double *cos, double *cc, int32_t threads) {
    const qjl_grid grid = {lo, inv, cells, off, cand};
    const qjl_grid *gp = cells > 0 ? &grid : NULL;
    if (rows < 0 || n < 1 || g < 1 || n % g || check_search(y, rows * n, g, k, gp)) return -1;
    const qjl_vq_moments_job job = {y, table, sq, rows, n, g, k, gp, cos, cc};
    const int64_t items = (rows + QJL_MOMENT_ROWS - 1) / QJL_MOMENT_ROWS;
    parallel_for(items, items > 1 && threads > 1 ? threads : 1, vq_moments_rows, (void *)&job);
    return 0;
}

/* float32 -> a stored dtype's bits, rounded to nearest even exactly as torch's .to(dtype) (the callers
 * have checked the value is finite and within the dtype's range). */
static inline uint16_t float_to_half_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to Inf */
    if (ax < 0x38800000u) { /* below 2^-14: a subnormal half; adding 0.5 (ulp 2^-24) rounds to its grid */
        float a, r;
        uint32_t rb;
        memcpy(&a, &ax, 4);
        r = a + 0.5f;
        memcpy(&rb, &r, 4);
        return (uint16_t)(sign | (rb - 0x3f000000u));
    }
    const uint32_t odd = (ax >> 13) & 1u;
    return (uint16_t)(sign | ((ax + ((uint32_t)(15 - 127) << 23) + 0xfffu + odd) >> 13));
}

static inline uint16_t float_to_bf16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static inline uint8_t float_to_e4m3_bits(float f) { /* float8 e4m3fn: no Inf, 0x7f is NaN */
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = x & 0x80000000u, ax = x ^ sign;
    uint8_t r;
    if (ax >= (1087u << 20)) r = 0x7f; /* >= 480 (or NaN/Inf): NaN */
    else if (ax < (121u << 23)) { /* below 2^-6: subnormal, rounded by a float addition onto its grid */
        const uint32_t magic = 141u << 23;
        float a, m, s;
        uint32_t sb;
        memcpy(&a, &ax, 4);
        memcpy(&m, &magic, 4);
        s = a + m;
        memcpy(&sb, &s, 4);
        r = (uint8_t)(sb - magic);
    } else {
        const uint32_t odd = (ax >> 20) & 1u;
        r = (uint8_t)((ax + ((uint32_t)(7 - 127) << 23) + 0x7ffffu + odd) >> 20);
    }
    return (uint8_t)(r | (sign >> 24));
}

static void store_scalar(uint8_t *dst, float v, int dtype) {
    if (dtype == 0) memcpy(dst, &v, 4);
    else if (dtype == 1) { const uint16_t h = float_to_half_bits(v); memcpy(dst, &h, 2); }
    else if (dtype == 2) { const uint16_t h = float_to_bf16_bits(v); memcpy(dst, &h, 2); }
    else *dst = float_to_e4m3_bits(v);
}

/* Codes and stored norms of rows y [rows, n] (rotated unit vectors) with norms norm [rows]: the cells packed
 * `bits` bits each, LSB-first, into codes [rows, nbytes]; stored[i] = norm[i], or with `correct`
 * norm[i] / cos[i] (where cos > 0), as float32 (qjl_store_rows converts it to its dtype).
 * Returns 0; -1 for bad arguments; -2 when a norm is not finite; -3 when a norm exceeds norm_max; -4 when a
 * corrected norm does (the outputs are then unspecified). */
QJL_EXPORT int qjl_bucket_norms(const float *y, const float *norm, int64_t rows, int64_t n, const float *bnd,
                                int32_t nbnd, const float *cent, int32_t bits, int32_t correct, float norm_max,
                                uint8_t *codes, float *stored, int32_t threads) {
    if (bits < 1 || bits > 8 || nbnd != (1 << bits) - 1) return -1;
    for (int64_t i = 0; i < rows; i++) {
        if (!isfinite(norm[i])) return -2;
        if (fabsf(norm[i]) > norm_max) return -3;
    }
    const qjl_bucket_job job = {y, bnd, cent, n, (n * bits + 7) / 8, nbnd, bits, codes, stored};
    parallel_for(rows, rows >= 256 && threads > 1 ? threads : 1, bucket_row, (void *)&job);
    for (int64_t i = 0; i < rows; i++) { /* stored holds the cosines here */
        const float v = correct ? norm[i] / (stored[i] > 0.0f ? stored[i] : 1.0f) : norm[i];
        if (!(fabsf(v) <= norm_max)) return -4;
        stored[i] = v;
    }
    return 0;
}

/* Rows [rows] of packed codes [rows, nbytes] and float32 norms [rows] stored into paged fields: row i is
 * token i / heads, KV head i % heads, at block blocks[i / heads], slot slots[i / heads]; the norm converted
 * to norm_field.dtype (0 fp32, 1 fp16, 2 bf16, 3 e4m3fn) as torch's .to(dtype) does. */
QJL_EXPORT int qjl_store_rows(int64_t rows, int64_t heads, const int64_t *blocks, const int64_t *slots,
                              const uint8_t *codes, int64_t nbytes, const float *norms, qjl_field codes_field,
                              qjl_field norm_field) {
    if (heads < 1 || rows % heads || nbytes < 1 || norm_field.dtype < 0 || norm_field.dtype > 3) return -1;
    const int nb = norm_field.dtype == 0 ? 4 : norm_field.dtype == 3 ? 1 : 2;
    for (int64_t i = 0; i < rows; i++) {
        const int64_t t = i / heads, h = i % heads;
        uint8_t *c = (uint8_t *)codes_field.base + blocks[t] * codes_field.stride_block +
                     h * codes_field.stride_head + slots[t] * codes_field.stride_token;
        uint8_t *s = (uint8_t *)norm_field.base + blocks[t] * norm_field.stride_block + h * norm_field.stride_head +
                     slots[t] * norm_field.stride_token;
        uint8_t tmp[4];
        memcpy(c, codes + i * nbytes, (size_t)nbytes);
        store_scalar(tmp, norms[i], norm_field.dtype);
        memcpy(s, tmp, (size_t)nb);
    }
    return 0;
}

/* float32 values -> their bits in a stored dtype (0 fp32, 1 fp16, 2 bf16, 3 e4m3fn), as torch's .to(dtype);
 * out holds n entries of the dtype's size.  (Tested against torch; used by qjl_store_rows.) */
QJL_EXPORT int qjl_store_scalars(const float *v, int64_t n, int32_t dtype, uint8_t *out) {
    if (dtype < 0 || dtype > 3) return -1;
    const int nb = dtype == 0 ? 4 : dtype == 3 ? 1 : 2;
    for (int64_t i = 0; i < n; i++) {
        uint8_t tmp[4];
        store_scalar(tmp, v[i], dtype);
        memcpy(out + i * nb, tmp, (size_t)nb);
    }
    return 0;
}

/* One encode job of qjl_encode_store: the rows x of a role (token t, KV head h at x + t * x_st + h * x_sh, fp32 /
 * fp16 / bf16 rows of dim contiguous elements) rotated by a dense matrix, bucketed, packed and stored. */
typedef struct {
    const qjl_encode_job *j;
    int64_t heads;
    const int64_t *blocks, *slots;
    uint8_t *codes;  /* [rows, nbytes] */
    float *stored;   /* [rows] */
    int *status;     /* [rows]: 0, -2 a non-finite entry, -3 the norm beyond norm_max, -4 the corrected norm */
} qjl_encode_ctx;

/* y [n]'s nearest codewords of a job's vector codebook, group by group (nearest_block: qjl_vq_nearest's indices),
 * each stored as its g bits-bit fields packed LSB-first into out [ceil(n bits / 8)]; returns the norm correction's
 * cosine sum_c y[c] * table[e_(c / g) g + c % g] in float32, in coordinate order. */
static float vq_packed(const float *y, const qjl_encode_job *j, uint8_t *out) {
    const int64_t n = j->n, g = j->group, per = n / g;
    const int bits = j->bits;
    int64_t code[per]; /* (head dimensions: a few KB on the stack) */
    const qjl_grid grid = {j->grid_lo, j->grid_inv, j->grid_cells, j->grid_off, j->grid_cand};
    nearest_block(y, per, (int)g, j->table, j->tt, j->sq, j->words, j->grid_cells > 0 ? &grid : NULL, code);
    memset(out, 0, (size_t)((n * bits + 7) / 8));
    const uint32_t mask = (1u << bits) - 1u;
    float cos = 0.0f;
    for (int64_t q = 0; q < per; q++) {
        const int64_t e = code[q];
        for (int64_t t = 0; t < g; t++) {
            const int64_t c = q * g + t;
            cos += y[c] * j->table[e * g + t];
            const int64_t pos = c * bits;
            const uint32_t w = ((uint32_t)(e >> (t * bits)) & mask) << (pos & 7);
            out[pos >> 3] |= (uint8_t)w;
            if ((pos & 7) + bits > 8) out[(pos >> 3) + 1] |= (uint8_t)(w >> 8);
        }
    }
    return cos;
}

/* The rotation of token t's rows: matrix pos[t] % cycles of the job's (its only one when cycles is 1). */
static inline const float *job_matrix(const qjl_encode_job *j, int64_t t) {
    return j->cycles > 1 ? j->matrix_t + (j->pos[t] % j->cycles) * j->dim * j->n : j->matrix_t;
}

/* Codes of the rotated unit row y into out; returns the cosine the norm correction divides by (cells_packed's or
 * vq_packed's, clamped at cos_floor). */
static inline float job_cells(const qjl_encode_job *j, const float *y, uint8_t *out) {
    if (j->group > 1) {
        const float cos = vq_packed(y, j, out);
        return cos < j->cos_floor ? j->cos_floor : cos;
    }
    const float cos = cells_packed(y, j->n, j->bnd, j->nbnd, j->cent, j->bits, out);
    return cos < j->cos_floor ? j->cos_floor : cos;
}

/* Row i of a job in a fixed order (what qjl.kernels.encode.encode_reference computes op for op in torch):
 *   ss = sum_j x_j^2 in float64, j = 0, 1, ...; norm = (float)sqrt(ss); u_j = x_j / (norm > 0 ? norm : 1);
 *   y_k = sum_j u_j * M[k, j] in float32, j = 0, 1, ... (each product and sum rounded: no fused multiply-add,
 *   the build being -std=c99; M the token's rotation, job_matrix); cells as torch.bucketize, packed LSB-first, and
 *   cos = sum_k y_k * cent[cell_k] in float32, k = 0, 1, ... (a vector codebook: vq_packed's codewords and cosine);
 *   cos = max(cos, cos_floor); stored = correct ? norm / (cos > 0 ? cos : 1) : norm. */
static void encode_row(void *ctx, int64_t i) {
    const qjl_encode_ctx *c = ctx;
    const qjl_encode_job *j = c->j;
    const int64_t t = i / c->heads, h = i % c->heads, d = j->dim, n = j->n, nbytes = (n * j->bits + 7) / 8;
    float buf[d + n], *x = buf, *y = buf + d; /* (head dimensions: a few KB on the stack) */
    read_row(j->x + t * j->x_st + h * j->x_sh, j->x_dtype, d, x);
    double ss = 0.0;
    int finite = 1;
    for (int64_t k = 0; k < d; k++) {
        finite &= isfinite(x[k]) != 0;
        ss += (double)x[k] * (double)x[k];
    }
    const float norm = (float)sqrt(ss), div = norm > 0.0f ? norm : 1.0f;
    for (int64_t k = 0; k < d; k++) x[k] = x[k] / div;
    for (int64_t k = 0; k < n; k++) y[k] = 0.0f;
    const float *mt = job_matrix(j, t);
    for (int64_t k = 0; k < d; k++) { /* y += u_k * M[:, k]: each output summed over k in order */
        const float uk = x[k], *col = mt + k * n;
        for (int64_t o = 0; o < n; o++) y[o] = y[o] + uk * col[o];
    }
    const float cos = job_cells(j, y, c->codes + i * nbytes);
    const float v = j->correct ? norm / (cos > 0.0f ? cos : 1.0f) : norm;
    c->stored[i] = v;
    c->status[i] = !finite ? -2 : !(norm <= j->norm_max) ? -3 : !(fabsf(v) <= j->norm_max) ? -4 : 0;
}

/* encode_row for the 4 rows i0 .. i0 + 3, each computed in encode_row's order (the same bits), their serial sums
 * interleaved: the float64 squares and the rotation (one column of M read for the 4 rows) are chains of dependent
 * additions per row, so one row at a time waits on each addition's latency (interleaving the cosine sums of the
 * cells as well measured slower: its gathers). */
#define ENCODE_ILP 4
static void encode_rows4(const qjl_encode_ctx *c, int64_t i0) {
    const qjl_encode_job *j = c->j;
    const int64_t d = j->dim, n = j->n, nbytes = (n * j->bits + 7) / 8;
    float xb[ENCODE_ILP][d], yb[ENCODE_ILP][n], norm[ENCODE_ILP];
    double ss[ENCODE_ILP];
    int finite[ENCODE_ILP];
    for (int r = 0; r < ENCODE_ILP; r++) {
        const int64_t t = (i0 + r) / c->heads, h = (i0 + r) % c->heads;
        read_row(j->x + t * j->x_st + h * j->x_sh, j->x_dtype, d, xb[r]);
        ss[r] = 0.0, finite[r] = 1;
    }
    for (int64_t k = 0; k < d; k++)
        for (int r = 0; r < ENCODE_ILP; r++) {
            finite[r] &= isfinite(xb[r][k]) != 0;
            ss[r] += (double)xb[r][k] * (double)xb[r][k];
        }
    for (int r = 0; r < ENCODE_ILP; r++) {
        norm[r] = (float)sqrt(ss[r]);
        const float div = norm[r] > 0.0f ? norm[r] : 1.0f;
        for (int64_t k = 0; k < d; k++) xb[r][k] = xb[r][k] / div;
        for (int64_t o = 0; o < n; o++) yb[r][o] = 0.0f;
    }
    const float *m0 = job_matrix(j, i0 / c->heads), *m3 = job_matrix(j, (i0 + 3) / c->heads);
    if (m0 == m3) { /* one rotation for the 4 rows (always with one matrix): one column of M read for the 4 */
        for (int64_t k = 0; k < d; k++) { /* y += u_k * M[:, k] for the 4 rows: each output summed over k in order */
            const float *col = m0 + k * n;
            const float u0 = xb[0][k], u1 = xb[1][k], u2 = xb[2][k], u3 = xb[3][k];
            for (int64_t o = 0; o < n; o++) {
                const float m = col[o];
                yb[0][o] = yb[0][o] + u0 * m;
                yb[1][o] = yb[1][o] + u1 * m;
                yb[2][o] = yb[2][o] + u2 * m;
                yb[3][o] = yb[3][o] + u3 * m;
            }
        }
    } else { /* rows of tokens at positions with different rotations: each its own matrix, the same order */
        const float *mr[ENCODE_ILP];
        for (int r = 0; r < ENCODE_ILP; r++) mr[r] = job_matrix(j, (i0 + r) / c->heads);
        for (int64_t k = 0; k < d; k++)
            for (int r = 0; r < ENCODE_ILP; r++) {
                const float u = xb[r][k], *col = mr[r] + k * n;
                for (int64_t o = 0; o < n; o++) yb[r][o] = yb[r][o] + u * col[o];
            }
    }
    for (int r = 0; r < ENCODE_ILP; r++) {
        const int64_t i = i0 + r;
        const float cos = job_cells(j, yb[r], c->codes + i * nbytes);
        const float v = j->correct ? norm[r] / (cos > 0.0f ? cos : 1.0f) : norm[r];
        c->stored[i] = v;
        c->status[i] = !finite[r] ? -2 : !(norm[r] <= j->norm_max) ? -3 : !(fabsf(v) <= j->norm_max) ? -4 : 0;
    }
}

#define ENCODE_BLOCK 32 /* rows per work item of qjl_encode_store (one dynamic grab per row cost more than a row) */
typedef struct {
    const qjl_encode_ctx *c;
    int64_t rows;
} qjl_encode_blocks;

static void encode_block(void *ctx, int64_t b) {
    const qjl_encode_blocks *e = ctx;
    const int64_t end = (b + 1) * ENCODE_BLOCK < e->rows ? (b + 1) * ENCODE_BLOCK : e->rows;
    int64_t i = b * ENCODE_BLOCK;
    for (; i + ENCODE_ILP <= end; i += ENCODE_ILP) encode_rows4(e->c, i);
    for (; i < end; i++) encode_row((void *)e->c, i);
}

/* Several roles (a layer's keys and values) quantized as encode_row says and stored into paged fields, the rows
 * never leaving C (scalar cells or a vector codebook, one rotation or several in turn by the tokens' positions
 * pos): row i of a job is token i / heads, KV head i % heads, stored at (blocks[i / heads],
 * slots[i / heads]) of its codes and norm fields (the norm converted to the field's dtype as torch's .to(dtype)).
 * Nothing is stored unless every row of every job passes; else *failed is the first job that did not and the
 * return value its first row's status (-2 non-finite x, -3 norm beyond norm_max, -4 corrected norm; -1 bad
 * arguments or no memory). */
QJL_EXPORT int qjl_encode_store(const qjl_encode_job *jobs, int32_t n_jobs, int64_t tokens, int64_t heads,
                                const int64_t *blocks, const int64_t *slots, int32_t threads, int32_t *failed) {
    *failed = 0;
    if (n_jobs < 1 || n_jobs > 4 || heads < 1 || tokens < 1) return -1;
    const int64_t rows = tokens * heads;
    uint8_t *codes[4] = {0};
    float *stored[4] = {0};
    int *status = malloc(sizeof(int) * (size_t)rows);
    int rc = status ? 0 : -1;
    for (int k = 0; k < n_jobs && !rc; k++) {
        const qjl_encode_job *j = &jobs[k];
        *failed = k;
        if (j->dim < 1 || j->dim > 4096 || j->n < 1 || j->n > 4096 || j->bits < 1 || j->bits > 8 ||
            j->x_dtype < 0 || j->x_dtype > 2 || j->norm_field.dtype < 0 || j->norm_field.dtype > 3 ||
            j->cycles < 1 || j->cycles > 64 || (j->cycles > 1 && !j->pos) || !(j->cos_floor >= 0.0f) ||
            (j->group == 1 ? j->nbnd != (1 << j->bits) - 1
                           : (j->group < 2 || j->group > 8 || j->n % j->group || j->group * j->bits > 16 ||
                              j->words != 1 << (j->group * j->bits) || !j->table || !j->sq ||
                              (j->grid_cells > 0 && j->group != 2)))) { /* (a grid is checked once by its caller:
                                                                           store.EncodeStore) */
            rc = -1;
            break;
        }
        for (int64_t t = 0; t < tokens && j->cycles > 1 && !rc; t++)
            if (j->pos[t] < 0) rc = -1;
        if (rc) break;
        codes[k] = malloc((size_t)(rows * ((j->n * j->bits + 7) / 8)));
        stored[k] = malloc(sizeof(float) * (size_t)rows);
        if (!codes[k] || !stored[k]) { rc = -1; break; }
        const qjl_encode_ctx ctx = {j, heads, blocks, slots, codes[k], stored[k], status};
        const qjl_encode_blocks blocks_of = {&ctx, rows};
        parallel_for((rows + ENCODE_BLOCK - 1) / ENCODE_BLOCK, rows >= 64 && threads > 1 ? threads : 1, encode_block,
                     (void *)&blocks_of);
        for (int64_t i = 0; i < rows && !rc; i++) rc = status[i];
    }
    for (int k = 0; k < n_jobs && !rc; k++) {
        const qjl_encode_job *j = &jobs[k];
        *failed = k;
        rc = qjl_store_rows(rows, heads, blocks, slots, codes[k], (j->n * j->bits + 7) / 8, stored[k], j->codes,
                            j->norm_field);
    }
    for (int k = 0; k < n_jobs; k++) free(codes[k]), free(stored[k]);
    free(status);
    return rc;
}
