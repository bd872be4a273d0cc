/* bf16 x bf16 matmul (AVX2 + FMA), for CPUs where oneDNN has no bf16 matmul (no AVX512-BW, no AVX-NE-CONVERT:
 * Zen 2/3, older Xeons), where torch's bf16 linear falls back to a generic loop.
 *
 *   out[m, n] = bf16( sum_k x[m, k] * w[n, k] )     w: bf16 [N, K] contiguous, out: bf16 [M, N]; K % 16 == 0
 *   x: the caller's bf16 x in float32 (exact), each 16 values of a row stored as their 8 even then their 8 odd
 *
 * 16 weights load as one vector and split into their even and odd elements as float32 by a shift and a mask
 * (exact), which is why x comes split the same way. One summation order for every (m, n), whatever M, the blocking
 * or the thread count: lane j of one float32 accumulator takes, for each 16 values of k in turn, the product of
 * element 2j then of element 2j + 1 (fused multiply-adds); then the 8 lanes are added in a fixed tree (hadd1) and
 * the sum rounded to bf16 once (nearest even). So a row's output does not depend on the other rows of the batch.
 * Blocks: 4 weight rows x 2 rows of x (8 independent FMA chains: the FMA latency hidden), or 8 weight rows x 1
 * row of x for the last odd row. The N range is split over the threads in multiples of 8.
 */
#include "kw_avx2.h"

#define W16(p, e, o)                                                                  \
    do {                                                                              \
        __m256i r_ = _mm256_loadu_si256((const __m256i *)(p));                        \
        e = _mm256_castsi256_ps(_mm256_slli_epi32(r_, 16));                           \
        o = _mm256_castsi256_ps(_mm256_and_si256(r_, _mm256_set1_epi32((int)0xFFFF0000u))); \
    } while (0)

void bgemm_4x2s(const bgemm_t *g, int64_t n, int64_t m, int64_t wn, const float *sc) {
    const int64_t K = g->K;
    const uint16_t *w0 = g->w + wn * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    const float *x0 = g->x + m * K, *x1 = x0 + K;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t k = 0; k < K; k += 16) {
        __m256 e0 = _mm256_loadu_ps(x0 + k), o0 = _mm256_loadu_ps(x0 + k + 8);
        __m256 e1 = _mm256_loadu_ps(x1 + k), o1 = _mm256_loadu_ps(x1 + k + 8), we, wo;
        /* one weight row's 16 values into both rows' accumulators */
#define ROW2(wr, a0, a1)                                         \
    W16(wr + k, we, wo);                                         \
    a0 = _mm256_fmadd_ps(wo, o0, _mm256_fmadd_ps(we, e0, a0));   \
    a1 = _mm256_fmadd_ps(wo, o1, _mm256_fmadd_ps(we, e1, a1))
        ROW2(w0, a00, a01);
        ROW2(w1, a10, a11);
        ROW2(w2, a20, a21);
        ROW2(w3, a30, a31);
#undef ROW2
    }
    uint16_t *p0 = g->out + m * g->N + n, *p1 = p0 + g->N;
    float s0 = sc ? sc[0] : 1.0f, s1 = sc ? sc[1] : 1.0f, s2 = sc ? sc[2] : 1.0f, s3 = sc ? sc[3] : 1.0f;
    p0[0] = f32_to_bf16(hadd1(a00) * s0), p1[0] = f32_to_bf16(hadd1(a01) * s0);
    p0[1] = f32_to_bf16(hadd1(a10) * s1), p1[1] = f32_to_bf16(hadd1(a11) * s1);
    p0[2] = f32_to_bf16(hadd1(a20) * s2), p1[2] = f32_to_bf16(hadd1(a21) * s2);
    p0[3] = f32_to_bf16(hadd1(a30) * s3), p1[3] = f32_to_bf16(hadd1(a31) * s3);
}

static void bgemm_4x2(const bgemm_t *g, int64_t n, int64_t m) { bgemm_4x2s(g, n, m, n, NULL); }

/* rows n .. n+nr-1 (nr <= 8) of w against row m of x; inlined with nr = 8 (unrolled, in registers) and as is */
static inline __attribute__((always_inline)) void bgemm_rows_1(const bgemm_t *g, int64_t n, int nr, int64_t m,
                                                               int64_t wn, const float *sc) {
    const int64_t K = g->K;
    const float *x0 = g->x + m * K;
    const uint16_t *w = g->w + wn * K;
    __m256 a[8], we, wo;
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        /* the next block's 8 rows (8 K values right after these: 256 bytes a step) fetched over this block */
        for (int b = 0; b < 256; b += 64) _mm_prefetch((const char *)(w + 8 * K + k * 8) + b, _MM_HINT_T0);
        __m256 e = _mm256_loadu_ps(x0 + k), o = _mm256_loadu_ps(x0 + k + 8);
        for (int i = 0; i < nr; i++) {
            W16(w + i * K + k, we, wo);
            a[i] = _mm256_fmadd_ps(wo, o, _mm256_fmadd_ps(we, e, a[i]));
        }
    }
    uint16_t *p = g->out + m * g->N + n;
    for (int i = 0; i < nr; i++) p[i] = f32_to_bf16(sc ? hadd1(a[i]) * sc[i] : hadd1(a[i]));
}

void bgemm_8x1s(const bgemm_t *g, int64_t n, int nr, int64_t m, int64_t wn, const float *sc) {
    if (nr == 8)
        bgemm_rows_1(g, n, 8, m, wn, sc);
    else
        bgemm_rows_1(g, n, nr, m, wn, sc);
}

static void bgemm_8x1(const bgemm_t *g, int64_t n, int nr, int64_t m) { bgemm_8x1s(g, n, nr, m, n, NULL); }

static void bgemm_slice(const void *arg, int t, int nthreads) {
    const bgemm_t *g = (const bgemm_t *)arg;
    int64_t blocks = (g->N + 7) / 8, per = (blocks + nthreads - 1) / nthreads;
    int64_t n0 = t * per * 8, n1 = (t + 1) * per * 8;
    if (n1 > g->N) n1 = g->N;
    for (int64_t n = n0; n < n1; n += 8) {
        int nr = n1 - n < 8 ? (int)(n1 - n) : 8;
        int64_t m = 0;
        if (nr == 8)
            for (; m + 2 <= g->M; m += 2) {
                bgemm_4x2(g, n, m);
                bgemm_4x2(g, n + 4, m);
            }
        for (; m < g->M; m++) bgemm_8x1(g, n, nr, m);
    }
}

/* 0, or -1 on bad sizes. */
int kw_bgemm(const float *x, const uint16_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K, int nthreads) {
    if (M < 1 || N < 1 || K < 16 || K % 16) return -1;
    nthreads = kw_threads(nthreads);
    if (N < 32 * nthreads) nthreads = 1; /* tiny outputs: not worth a wake-up */
    bgemm_t g = {x, w, out, M, N, K};
    kw_run(bgemm_slice, &g, nthreads);
    return 0;
}
