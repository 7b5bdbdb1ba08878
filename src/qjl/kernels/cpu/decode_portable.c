/* Portable path of the CPU decode (any C99 compiler; GCC vector extensions where they help): each token's
 * codes are unpacked into a float row (grouped codes through their joint codes' table: unpack_row), then dotted
 * with every query row (keys) or added to every output row with its softmax weight (values).  The reference the
 * AVX2 path is tested beside (simd = 0). */

/* one packed row -> its n floats: scalar codes (group 1) cent[code]; grouped codes (g > 1, decode.h) per joint code
 * j -- the row's (g bits)-bit code j, its g fields with the first in the low bits -- the g floats cent[e g .. e g + g) */
static inline void unpack_row(const uint8_t *row, int bits, int group, int64_t n, const float *cent, float *out) {
    if (group <= 1) {
        for (int64_t c = 0; c < n; c++) out[c] = cent[code_at(row, bits, c)];
        return;
    }
    for (int64_t j = 0; j < n / group; j++) {
        const float *src = cent + (int64_t)code_at(row, group * bits, j) * group;
        for (int s = 0; s < group; s++) out[j * group + s] = src[s];
    }
}

/* logits[r * SUB + i] += norm[i] * sum_c q[r][c] * cent[code[i][c]], i < count, r < nr (norm: floats) */
static void score_portable(const qjl_key_term *k, int nr, const uint8_t *codes, const float *norm, int64_t count,
                           const float *q, float *logits, float *buf) {
    for (int64_t i = 0; i < count; i++) {
        unpack_row(codes + i * k->codes.stride_token, k->bits, k->group, k->n, k->cent, buf);
        const float nt = norm[i];
        for (int r = 0; r < nr; r++) logits[r * SUB + i] += nt * dot_f(q + r * k->n, buf, k->n);
    }
}

/* acc[r][c] += p[r][i] * scale[g(c)][i] * cent[code[i][c]]; zsum[r][g] += p[r][i] * zero[g][i], i < count, r < nr
 * (scale, zero: floats [G][SUB]) */
static void mix_portable(const qjl_value_view *v, int nr, const uint8_t *codes, const float *scale, const float *zero,
                         int64_t count, const float *p, float *acc, float *zsum, float *buf) {
    const int64_t n = v->n, G = v->groups, gs = v->group_size;
    for (int64_t i = 0; i < count; i++) {
        unpack_row(codes + i * v->codes.stride_token, v->bits, v->group, n, v->cent, buf);
        for (int64_t g = 0; g < G; g++) {
            const float s = scale[g * SUB + i];
            const float z = v->has_zero ? zero[g * SUB + i] : 0;
            const int64_t c1 = (g + 1) * gs < n ? (g + 1) * gs : n;
            for (int r = 0; r < nr; r++) {
                const float w = p[r * SUB + i];
                if (w == 0.0f) continue;
                const float ws = w * s;
                float *a = acc + r * n;
                for (int64_t c = g * gs; c < c1; c++) a[c] += ws * buf[c];
                zsum[r * G + g] += w * z;
            }
        }
    }
}
