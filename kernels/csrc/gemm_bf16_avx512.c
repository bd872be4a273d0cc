/* bf16 x bf16 matmul for a few rows of x (AVX512-BF16): a decode step's dense linears, where the weights stream
 * from memory once per step and the read rate is the step's speed.
 *
 *   out[m, n] = bf16( sum_k x[m, k] * w[n, k] )     x bf16 [M, K], w bf16 [N, K], both contiguous; M <= 4, K % 32 == 0
 *
 * One summation order per (m, n), whatever M, N's blocking or the threads: 16 float32 lanes, lane j taking the pair
 * (k + 2j, k + 2j + 1) of each 32 values of k in turn through vdpbf16ps, then the lanes added by one fixed tree
 * (lanes_sum) and rounded to bf16 once (nearest even). vdpbf16ps treats bf16 subnormals as zero and flushes
 * subnormal results (its definition), so where the sums stay normal the result is within float32 summation of the
 * exact one (tests/unit/kernels/test_cpu_bf16_gemv.py bounds it).
 *
 * Why a kernel of its own: one weight row is one sequential stream, and a core reading one stream at a time keeps
 * too few reads in flight: a C matrix-vector loop over a 1B's 20 layers from memory (1.8 GB, one row of x, 2
 * threads) reads 21 GB/s one weight row at a time, 27-29 GB/s with 4-8 side by side; oneDNN's bf16 matmul and the
 * AVX2 kernel 21 / 20 GB/s. So 8 weight rows (4 for 3-4 rows of x: at most 16 accumulators) are read side by side,
 * each prefetched PF_AHEAD bytes ahead, an accumulator per (row of x, weight row). Through native_ops (one row, the
 * same layers): oneDNN 20.8 GB/s, this kernel 25.0 with 4 rows side by side, 26.6 with 8 (prefetch 256 B to 1 KB
 * ahead within 3%).
 */
#include "kw_avx512.h"

#define NR 8 /* 8 weight rows for 1-2 rows of x, 4 for 3-4: at most 16 accumulators */
#define PF_AHEAD 512

typedef struct {
    const uint16_t *x, *w;
    uint16_t *out;
    int64_t M, N, K;
} bgemv_t;

/* The 16 lanes' sum in a fixed order: halves added pairwise, 8 + 8, 4 + 4, 2 + 2, 1 + 1. */
static inline float lanes_sum(__m512 v) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); /* AVX512-F: no 32x8 extract */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

/* Rows n .. n + nr - 1 (nr <= NR) against the M (<= 4) rows of x. M and nr are constants at each call site. */
static inline __attribute__((always_inline)) void bgemv_block(const bgemv_t *g, int64_t n, const int nr,
                                                              const int M) {
    const int64_t K = g->K;
    const uint16_t *w = g->w + n * K;
    __m512 acc[4][NR];
    for (int m = 0; m < M; m++)
        for (int r = 0; r < nr; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh xv[4];
        for (int m = 0; m < M; m++) xv[m] = (__m512bh)_mm512_loadu_si512(g->x + m * K + k);
        for (int r = 0; r < nr; r++) {
            const uint16_t *p = w + r * K + k;
            _mm_prefetch((const char *)p + PF_AHEAD, _MM_HINT_T0); /* never faults, even past the tensor */
            __m512bh wv = (__m512bh)_mm512_loadu_si512(p);
            for (int m = 0; m < M; m++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv[m], wv);
        }
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < nr; r++) g->out[m * g->N + n + r] = f32_to_bf16(lanes_sum(acc[m][r]));
}

#define BLOCKS(M, R)                                                \
    do {                                                            \
        int64_t n = n0;                                             \
        for (; n + (R) <= n1; n += (R)) bgemv_block(g, n, (R), M);  \
        for (; n < n1; n++) bgemv_block(g, n, 1, M);                \
    } while (0)

static void bgemv_slice(const void *arg, int t, int nthreads) {
    const bgemv_t *g = (const bgemv_t *)arg;
    /* whole 32-output chunks per thread: no two threads write one cache line of out */
    int64_t chunks = (g->N + 31) / 32, n0 = chunks * t / nthreads * 32, n1 = chunks * (t + 1) / nthreads * 32;
    if (n1 > g->N) n1 = g->N;
    switch (g->M) {
    case 1: BLOCKS(1, 8); break;
    case 2: BLOCKS(2, 8); break;
    case 3: BLOCKS(3, 4); break;
    default: BLOCKS(4, 4); break;
    }
}

/* 0, or -1 on bad sizes (M outside 1..4, K not a positive multiple of 32, N < 1). */
int kw_bgemv512(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K, int nthreads) {
    if (M < 1 || M > 4 || N < 1 || K < 32 || K % 32) return -1;
    nthreads = kw_threads(nthreads);
    if (N < 64 * nthreads) nthreads = 1; /* tiny outputs: not worth a wake-up */
    bgemv_t g = {x, w, out, M, N, K};
    kw_run(bgemv_slice, &g, nthreads);
    return 0;
}
