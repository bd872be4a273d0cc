/* A decode step's per-token glue (AVX2 + FMA, every build): RMSNorm (with the residual add), neox rotary, the KV
 * store. Each call does what 5-12 small torch ops did (on a 2-core CPU those ops cost their dispatch, not their
 * arithmetic), one thread, rounding where kernels/reference.py rounds (no product is fused into a sum unless
 * written as an fma):
 * - kw_rms_norm: r = bf16(x + residual) (the new residual); y = bf16(r * (1 / sqrt(sum(r * r) / H + eps)));
 *   out = bf16(y * w). The sum of squares (each square of a bf16 is exact in float32) is added up in the order of
 *   ATen's CPU sum (torch_sumsq), so the result is torch's, bit for bit.
 * - kw_rotary_neox: over whole heads (rot_dim == D), out[i] = x[i] * cos[i] - x[i + D/2] * sin[i] and
 *   out[i + D/2] = x[i + D/2] * cos[i] + x[i] * sin[i], each product rounded, then the sum, then to bf16: torch's
 *   ``x * cos2 + roll(x) * sin2`` exactly.
 * - kw_store_kv: rows copied into the [Hk, num_blocks, block_size, D] pools at their slots (-1: skipped); every slot
 *   is checked before anything is written.
 */
#include <math.h>

#include "kw_avx2.h"

static inline __m256 load8_bf16(const uint16_t *p) {
    __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}

static inline void store8_bf16(uint16_t *p, __m256 v) {
    __m256i b = _mm256_srli_epi32(bf16_bits(v), 16); /* each lane's low half: its bf16 */
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

static inline __m256 sq8(const uint16_t *p) {
    __m256 v = load8_bf16(p);
    return _mm256_mul_ps(v, v);
}

/* sum(x[i]^2) over a contiguous bf16 row, in ATen's order for a contiguous float32 row (cascade_sum ->
 * vectorized_inner_sum with 8-float vectors, as torch 2.13 runs it on x86 with AVX2 and AVX-512 alike): rows of 4
 * vectors go to 4 vector accumulators, cascaded up 4 levels every 2^lp rows (lp = max(4, ceil_log2(rows) / 4)); then
 * the levels are folded, the vectors past the last whole row added to the first accumulator, the 4 accumulators
 * added in order; the scalar tail is summed first and the 8 lanes added to it in order.
 * tests/unit/kernels/test_cpu_glue.py checks the bits against torch's. */
static float torch_sumsq(const uint16_t *x, int64_t n) {
    int64_t nvec = n / 8, rows = nvec / 4;
    int cl = rows <= 2 ? 1 : 64 - __builtin_clzll((unsigned long long)(rows - 1));
    int lp = cl / 4 > 4 ? cl / 4 : 4;
    int64_t step = (int64_t)1 << lp, mask = step - 1, i = 0;
    __m256 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int k = 0; k < 4; k++) acc[j][k] = _mm256_setzero_ps();
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], sq8(x + (i * 4 + k) * 8));
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++) {
                acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = _mm256_setzero_ps();
            }
            if (i & (mask << (j * lp))) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], sq8(x + (i * 4 + k) * 8));
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
    for (int64_t v = rows * 4; v < nvec; v++) acc[0][0] = _mm256_add_ps(acc[0][0], sq8(x + v * 8));
    for (int k = 1; k < 4; k++) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
    float total = 0.0f, lanes[8];
    for (int64_t k = nvec * 8; k < n; k++) {
        uint32_t u = (uint32_t)x[k] << 16;
        float f;
        memcpy(&f, &u, 4);
        total += f * f;
    }
    _mm256_storeu_ps(lanes, acc[0][0]);
    for (int l = 0; l < 8; l++) total += lanes[l];
    return total;
}

/* x [T, H] (row stride xs), residual NULL or [T, H] (row stride rs), w [H]; out and newres [T, H] contiguous.
 * 0, or -1 on bad sizes (H a multiple of 8). */
int kw_rms_norm(const uint16_t *x, int64_t xs, const uint16_t *res, int64_t rs, const uint16_t *w, uint16_t *out,
                uint16_t *newres, int64_t T, int64_t H, float eps) {
    if (T < 0 || H < 8 || H % 8 || (res && !newres)) return -1;
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *src = x + t * xs;
        if (res) {
            uint16_t *nr = newres + t * H;
            for (int64_t i = 0; i < H; i += 8)
                store8_bf16(nr + i, _mm256_add_ps(load8_bf16(src + i), load8_bf16(res + t * rs + i)));
            src = nr;
        }
        __m256 r = _mm256_set1_ps(1.0f / sqrtf(torch_sumsq(src, H) / (float)H + eps));
        uint16_t *o = out + t * H;
        for (int64_t i = 0; i < H; i += 8)
            store8_bf16(o + i, _mm256_mul_ps(bf16_round(_mm256_mul_ps(load8_bf16(src + i), r)), load8_bf16(w + i)));
    }
    return 0;
}

/* q [T, Hq * D] and k [T, Hk * D] (row strides qs, ks; heads contiguous), cos and sin [T, D / 2] float32 (row
 * stride cs) -> qo [T, Hq * D], ko [T, Hk * D] contiguous. 0, or -1 on bad sizes (D a multiple of 16). */
int kw_rotary_neox(const uint16_t *q, int64_t qs, const uint16_t *k, int64_t ks, const float *cos, const float *sin,
                   int64_t cs, uint16_t *qo, uint16_t *ko, int64_t T, int64_t Hq, int64_t Hk, int64_t D) {
    if (T < 0 || Hq < 1 || Hk < 0 || D < 16 || D % 16) return -1;
    int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * cs, *s = sin + t * cs;
        for (int64_t h = 0; h < Hq + Hk; h++) {
            const uint16_t *src = h < Hq ? q + t * qs + h * D : k + t * ks + (h - Hq) * D;
            uint16_t *dst = h < Hq ? qo + (t * Hq + h) * D : ko + (t * Hk + h - Hq) * D;
            for (int64_t i = 0; i < half; i += 8) {
                __m256 x1 = load8_bf16(src + i), x2 = load8_bf16(src + half + i);
                __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
                store8_bf16(dst + i, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
                store8_bf16(dst + half + i, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
            }
        }
    }
    return 0;
}

/* k, v [T, Hk, D] (row strides ks, vs; heads contiguous) into kc, vc [Hk, num_blocks, bs, D] at slots [T].
 * 0, or -1 (nothing written) when a slot is below -1 or past the pools. */
int kw_store_kv(const uint16_t *k, int64_t ks, const uint16_t *v, int64_t vs, uint16_t *kc, uint16_t *vc,
                const int64_t *slots, int64_t T, int64_t Hk, int64_t D, int64_t num_blocks, int64_t bs) {
    int64_t total = num_blocks * bs;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < -1 || slots[t] >= total) return -1;
    size_t row = (size_t)D * sizeof(uint16_t);
    for (int64_t t = 0; t < T; t++) {
        int64_t s = slots[t];
        if (s < 0) continue;
        for (int64_t h = 0; h < Hk; h++) {
            memcpy(kc + (h * total + s) * D, k + t * ks + h * D, row);
            memcpy(vc + (h * total + s) * D, v + t * vs + h * D, row);
        }
    }
    return 0;
}
