/* int8 and fp8 weight-only matmul for bf16 x on CPUs without AVX512-BF16 (AVX2 + FMA).
 *
 *   out[m, n] = bf16( s[n] * sum_k x[m, k] * q[n, k] )     q: int8 or float8_e4m3fn [N, K], s: float32 [N]
 *   x: float32 [M, K] (the caller's bf16 x, exact), K a multiple of 16, each 16 values stored as their 8 even then
 *   their 8 odd (kw_bgemm's layout).
 *
 * torch's int8 pack op converts every weight once per row of x and runs compute-bound at one row, slower than the
 * bf16 matmul it should beat (decode is memory-bound: half the bytes); fp8 had no fused op. Codes are exact in
 * float32; products and sums are float32, rounded to bf16 once, in kw_bgemm's order (lane j takes elements 2j then
 * 2j + 1 of each 16 columns in turn, fused multiply-adds; hadd1 adds the lanes; the sum times s[n] is rounded):
 * one order per output whatever M. M == 1 converts the codes to float32 in registers (one pass over the weight);
 * M > 1 converts 8 rows at a time to bf16 into a per-thread scratch and runs kw_bgemm's blocks over it (a float32
 * scratch with its own blocks was 1.17x slower at 32 rows, interleaved A/B): the same arithmetic, the same bits.
 * Software prefetches and unrolling were tried (interleaved A/B): no gain, so none.
 */
#include "kw_avx2.h"

/* 8 codes (sign-extended to int32 lanes) as float32, exactly: int8 -> its value; float8_e4m3fn (fp8) -> its value,
 * built from its bits (sign, then exponent and mantissa shifted onto float32's, which reads them 2^120 too small,
 * subnormals included: exact while MXCSR's DAZ is off, as torch leaves it) times 2^120. e4m3's NaN codes (never
 * written by quantize) would read as +-480. */
static inline __m256 code8(__m256i v, int fp8) {
    if (!fp8) return _mm256_cvtepi32_ps(v);
    __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7F)), 20),
                                   _mm256_and_si256(v, _mm256_set1_epi32((int)0x80000000u)));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}

static inline __m256 c8x8(const int8_t *p, int fp8) {
    return code8(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)), fp8);
}

typedef struct {
    const float *x; /* split as for kw_bgemm */
    const int8_t *q;
    const float *s; /* one per row */
    uint16_t *out;
    int64_t M, N, K;
    int fp8;
    atomic_int fail; /* a slice had no memory for its scratch */
} q8_t;

/* 16 codes as float32: their 8 even then their 8 odd elements (exact), the order kw_bgemm splits bf16 weights in */
static inline void c8x16_split(const int8_t *p, int fp8, __m256 *even, __m256 *odd) {
    __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); /* lane j: element 2j | 2j+1 << 16 */
    *even = code8(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16), fp8);
    *odd = code8(_mm256_srai_epi32(v, 16), fp8);
}

/* M == 1: rows n .. n+nr-1 (nr <= 8), codes converted in registers; the sums of kw_bgemm's one-row block on the
 * bf16 codes. Inlined with constant nr (8, or as is) and fp8. */
static inline __attribute__((always_inline)) void q8_rows_1(const q8_t *g, int64_t n, int nr, int fp8) {
    const int64_t K = g->K;
    const int8_t *w = g->q + n * K;
    __m256 a[8], we, wo;
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m256 e = _mm256_loadu_ps(g->x + k), o = _mm256_loadu_ps(g->x + k + 8);
        for (int i = 0; i < nr; i++) {
            c8x16_split(w + i * K + k, fp8, &we, &wo);
            a[i] = _mm256_fmadd_ps(wo, o, _mm256_fmadd_ps(we, e, a[i]));
        }
    }
    for (int i = 0; i < nr; i++) g->out[n + i] = f32_to_bf16(hadd1(a[i]) * g->s[n + i]);
}

static void q8_rows_1_any(const q8_t *g, int64_t n, int nr) {
    if (g->fp8) {
        if (nr == 8)
            q8_rows_1(g, n, 8, 1);
        else
            q8_rows_1(g, n, nr, 1);
    } else {
        if (nr == 8)
            q8_rows_1(g, n, 8, 0);
        else
            q8_rows_1(g, n, nr, 0);
    }
}

/* rows n .. n+nr-1 of q as bf16 into w [nr][K]: exact (an int8 code has at most 8 significant bits, an e4m3 one 4,
 * and e4m3's exponents fit bf16's) */
static void q8_to_bf16(const q8_t *g, int64_t n, int nr, uint16_t *w) {
    const int64_t K = g->K;
    const int8_t *src = g->q + n * K;
    const int fp8 = g->fp8;
    for (int64_t k = 0; k < K; k += 16) /* the rows in lockstep, as at M == 1: nr steady streams */
        for (int i = 0; i < nr; i++) {
            __m256i f0 = _mm256_srli_epi32(_mm256_castps_si256(c8x8(src + i * K + k, fp8)), 16);
            __m256i f1 = _mm256_srli_epi32(_mm256_castps_si256(c8x8(src + i * K + k + 8, fp8)), 16);
            __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(f0, f1), 0xD8);
            _mm256_storeu_si256((__m256i *)(w + i * K + k), h);
        }
}

static void q8_slice(const void *arg, int t, int nthreads) {
    q8_t *g = (q8_t *)arg;
    int64_t blocks = (g->N + 7) / 8, per = (blocks + nthreads - 1) / nthreads;
    int64_t n0 = t * per * 8, n1 = (t + 1) * per * 8;
    if (n1 > g->N) n1 = g->N;
    if (n0 >= n1) return;
    if (g->M == 1) {
        for (int64_t n = n0; n < n1; n += 8) q8_rows_1_any(g, n, n1 - n < 8 ? (int)(n1 - n) : 8);
        return;
    }
    /* M > 1: 8 rows at a time converted to bf16 in a per-thread scratch, then kw_bgemm's blocks over it */
    static __thread kw_buf rows8;
    uint16_t *w = kw_scratch(&rows8, (size_t)(16 * g->K)); /* 8 bf16 rows */
    if (!w) {
        atomic_store(&g->fail, 1);
        return;
    }
    bgemm_t b = {g->x, w, g->out, g->M, g->N, g->K};
    for (int64_t n = n0; n < n1; n += 8) {
        int nr = n1 - n < 8 ? (int)(n1 - n) : 8;
        q8_to_bf16(g, n, nr, w);
        int64_t m = 0;
        if (nr == 8)
            for (; m + 2 <= g->M; m += 2) {
                bgemm_4x2s(&b, n, m, 0, g->s + n);
                bgemm_4x2s(&b, n + 4, m, 4, g->s + n + 4);
            }
        for (; m < g->M; m++) bgemm_8x1s(&b, n, nr, m, 0, g->s + n);
    }
}

/* q: int8 codes, or float8_e4m3fn ones (fp8 = 1); s: float32, one per row. 0, -1 on bad sizes, -2 when a thread's
 * scratch could not be allocated. */
int kw_q8gemm(const float *x, const int8_t *q, const float *s, uint16_t *out, int64_t M, int64_t N, int64_t K,
              int fp8, int nthreads) {
    if (M < 1 || N < 1 || K < 16 || K % 16) return -1;
    nthreads = kw_threads(nthreads);
    if (N < 32 * nthreads) nthreads = 1;
    q8_t g = {x, q, s, out, M, N, K, fp8 != 0, 0};
    kw_run(q8_slice, &g, nthreads);
    return atomic_load(&g.fail) ? -2 : 0;
}
