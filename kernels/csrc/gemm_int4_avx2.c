/* int4 weight-only matmul for bf16 x on CPUs without AVX512-BF16 (AVX2 + FMA).
 *
 *   out[m, n] = bf16( sum_g ( s[g, n] * sum_{k in g} x[m, k] * c[n, k]  +  (z[g, n] - 8 s[g, n]) * xs[m, g] ) )
 *   (= x . W with W = (c - 8) * s + z, the reference's weight, up to float32 rounding)
 *   c: torch's CPU int4 pack "halves" of B rows (B/2 a multiple of 8: row blocks of B stored k-major, byte j of a k
 *   holding rows j (low nibble) and j + B/2 (high)); sz: bf16 [G, N, 2] = (scale, zero) per group of gs columns;
 *   xs[m, g] the sum of x over the group (lanes, then hadd1); x: float32 [M, K] in order, K a multiple of gs.
 *
 * torch's int4 pack op is compute-bound at one row, slower than the bf16 matmul it should beat. One summation order
 * per output element whatever M, the blocking or the thread count: per row, a group's products are added in k order
 * from zero (one chain per row: rows are the lanes), then total = fma(s, group sum, total); total = fma(z - 8 s, xs,
 * total), group by group from zero. M == 1 with blocks of 32 converts the codes in registers; otherwise a group's
 * codes are converted once into a per-thread scratch [gs][B] and every row of x, two at a time, runs over it: the
 * same bits.
 */
#include <stdlib.h>

#include "kw_avx2.h"

typedef struct {
    const float *x;
    const uint8_t *q;
    const uint16_t *sz;
    const float *xs; /* [M, G] */
    uint16_t *out;
    int64_t M, N, K, gs, B;
    atomic_int fail;
} q4_t;

/* 8 codes: low nibbles (lo) and high nibbles (hi) of 8 bytes, as float32 */
static inline void q4_codes(const uint8_t *p, __m256 *lo, __m256 *hi) {
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
}

/* the codes of group g of block b into w [gs][B] as float32, rows in natural order */
static void q4_convert(const q4_t *a, int64_t b, int64_t g, float *w) {
    const int64_t H = a->B / 2;
    const uint8_t *src = a->q + (b * a->K + g * a->gs) * H;
    __m256 lo, hi;
    for (int64_t kk = 0; kk < a->gs; kk++, src += H, w += a->B)
        for (int64_t j = 0; j < H; j += 8) {
            q4_codes(src + j, &lo, &hi);
            _mm256_store_ps(w + j, lo);
            _mm256_store_ps(w + H + j, hi);
        }
}

/* fold a group's sums acc = sum x c (rows n .. n+7) into tot: tot = fma(s, acc, tot); tot = fma(z - 8 s, xs, tot) */
static inline void q4_fold(const q4_t *a, int64_t g, int64_t n, float xsum, __m256 acc, float *tot) {
    __m256i r = _mm256_loadu_si256((const __m256i *)(a->sz + (g * a->N + n) * 2)); /* 8 (scale, zero) pairs */
    __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
    __m256 z = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u)));
    __m256 t = _mm256_fmadd_ps(s, acc, _mm256_load_ps(tot));
    _mm256_store_ps(tot, _mm256_fmadd_ps(_mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, z), _mm256_set1_ps(xsum), t));
}

/* M == 1, B == 32: group g of block b with the codes converted in registers (the same sums as q4_over) */
static void q4_direct32(const q4_t *a, int64_t b, int64_t g, float *tot) {
    const uint8_t *src = a->q + (b * a->K + g * a->gs) * 16;
    const float *x0 = a->x + g * a->gs;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, l0, h0, l1, h1;
    for (int64_t kk = 0; kk < a->gs; kk++, src += 16) {
        __m256 e = _mm256_broadcast_ss(x0 + kk);
        q4_codes(src, &l0, &h0);
        q4_codes(src + 8, &l1, &h1);
        a0 = _mm256_fmadd_ps(l0, e, a0);  /* rows 0..7 */
        a1 = _mm256_fmadd_ps(l1, e, a1);  /* rows 8..15 */
        a2 = _mm256_fmadd_ps(h0, e, a2);  /* rows 16..23 */
        a3 = _mm256_fmadd_ps(h1, e, a3);  /* rows 24..31 */
    }
    int64_t n = b * 32;
    float xsum = a->xs[g];
    q4_fold(a, g, n, xsum, a0, tot);
    q4_fold(a, g, n + 8, xsum, a1, tot + 8);
    q4_fold(a, g, n + 16, xsum, a2, tot + 16);
    q4_fold(a, g, n + 24, xsum, a3, tot + 24);
}

/* rows m (and m + 1 when two) of x over group g's nv (<= 4) vectors of rows from vector v, folded into tot;
 * inlined with nv = 4 and as is, so the accumulators stay in registers */
static inline __attribute__((always_inline)) void q4_over(const q4_t *a, int64_t b, int64_t g, int64_t v, int nv,
                                                          const float *w, float *tot, int64_t m, int two) {
    const int64_t B = a->B, gs = a->gs, G = a->K / gs, K = a->K;
    const float *x0 = a->x + m * K + g * gs, *x1 = two ? x0 + K : x0;
    __m256 a0[4], a1[4];
    for (int i = 0; i < 4; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < gs; kk++) {
        __m256 e0 = _mm256_broadcast_ss(x0 + kk), e1 = _mm256_broadcast_ss(x1 + kk);
        const float *wk = w + kk * B + v * 8;
        for (int i = 0; i < nv; i++) {
            __m256 wv = _mm256_load_ps(wk + i * 8);
            a0[i] = _mm256_fmadd_ps(wv, e0, a0[i]);
            if (two) a1[i] = _mm256_fmadd_ps(wv, e1, a1[i]);
        }
    }
    for (int i = 0; i < nv; i++) {
        int64_t n = b * B + (v + i) * 8;
        q4_fold(a, g, n, a->xs[m * G + g], a0[i], tot + m * B + (v + i) * 8);
        if (two) q4_fold(a, g, n, a->xs[(m + 1) * G + g], a1[i], tot + (m + 1) * B + (v + i) * 8);
    }
}

/* one block of B rows (B <= 64: at most 8 vectors of rows), every row of x; tot: float32 [M][B] */
static void q4_block(const q4_t *a, int64_t b, float *w, float *tot) {
    const int64_t B = a->B, V = B / 8, G = a->K / a->gs;
    memset(tot, 0, (size_t)(a->M * B) * sizeof(float));
    if (a->M == 1 && B == 32) {
        for (int64_t g = 0; g < G; g++) q4_direct32(a, b, g, tot);
        for (int64_t r = 0; r < B; r++) a->out[b * B + r] = f32_to_bf16(tot[r]);
        return;
    }
    for (int64_t g = 0; g < G; g++) {
        q4_convert(a, b, g, w);
        for (int64_t v = 0; v < V; v += 4) { /* 4 vectors (32 rows) at a time: 8 accumulators for two rows of x */
            int nv = V - v < 4 ? (int)(V - v) : 4;
            int64_t m = 0;
            if (nv == 4) {
                for (; m + 2 <= a->M; m += 2) q4_over(a, b, g, v, 4, w, tot, m, 1);
                if (m < a->M) q4_over(a, b, g, v, 4, w, tot, m, 0);
            } else {
                for (; m + 2 <= a->M; m += 2) q4_over(a, b, g, v, nv, w, tot, m, 1);
                if (m < a->M) q4_over(a, b, g, v, nv, w, tot, m, 0);
            }
        }
    }
    for (int64_t m = 0; m < a->M; m++)
        for (int64_t r = 0; r < B; r++) a->out[m * a->N + b * B + r] = f32_to_bf16(tot[m * B + r]);
}

static void q4_slice(const void *arg, int t, int nthreads) {
    q4_t *a = (q4_t *)arg;
    int64_t blocks = a->N / a->B, per = (blocks + nthreads - 1) / nthreads;
    int64_t b0 = t * per, b1 = b0 + per < blocks ? b0 + per : blocks;
    if (b0 >= b1) return;
    static __thread kw_buf codes;
    float *w = kw_scratch(&codes, (size_t)(a->gs * a->B + a->M * a->B) * sizeof(float));
    if (!w) {
        atomic_store(&a->fail, 1);
        return;
    }
    for (int64_t b = b0; b < b1; b++) q4_block(a, b, w, w + a->gs * a->B);
}

/* 0, -1 on bad sizes, -2 when scratch could not be allocated. */
int kw_q4gemm(const float *x, const uint8_t *q, const uint16_t *sz, uint16_t *out, int64_t M, int64_t N, int64_t K,
              int64_t gs, int64_t B, int nthreads) {
    if (M < 1 || N < 1 || gs < 8 || gs % 8 || K % gs || B < 16 || B > 64 || B % 16 || N % B) return -1;
    int64_t G = K / gs;
    float *xs = malloc((size_t)(M * G) * sizeof(float));
    if (!xs) return -2;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + m * K + k));
            xs[m * G + g] = hadd1(acc);
        }
    nthreads = kw_threads(nthreads);
    if (N < 32 * nthreads) nthreads = 1;
    q4_t a = {x, q, sz, xs, out, M, N, K, gs, B, 0};
    kw_run(q4_slice, &a, nthreads);
    free(xs);
    return atomic_load(&a.fail) ? -2 : 0;
}
