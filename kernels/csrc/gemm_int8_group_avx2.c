/* int8 weight-only matmul with a scale and a zero per group of columns (the int8_group layout: GGUF Q8_0, Q5_K,
 * Q6_K and Q4_K load into it) for bf16 x, on AVX2 + FMA (every build; gemm_int8_group_avx512.c: the same with 16
 * lanes, for the AVX512 levels).
 *
 *   out[m, n] = bf16( sum_k x[m, k] * (q[n, k] * s[n, g(k)])  +  sum_g z[n, g] * xs[m, g] )
 *   x: bf16 [M, K]; q: int8 [N, K]; s, z: bf16 [N, G] (G = K / gs, gs a multiple of 16); xs[m, g]: x's sum over
 *   group g (float32: 8 lanes, then hadd1). That is x . (q * s + z), the weight the reference dequantizes (and
 *   rounds to bf16 before its matmul: here it is never rounded).
 *
 * q * s is exact in float32 (8 + 8 significant bits) and so is x times it (8 + 16): every product is the true one,
 * only the sums round. One summation order per output whatever M, the blocking or the thread count: lane j adds
 * x[k] * (q * s)[k] for k = j mod 8 in k order (fused multiply-adds: the product is exact, so one rounding each);
 * a second vector adds z[g] * xs[g] for g = j mod 8 in order; the two are added lane by lane, the lanes by hadd1,
 * the sum rounded to bf16 once. M == 1 (or a chunk's last single row) converts the codes in registers (one
 * streaming pass, 8 rows in lockstep, the next 8 prefetched meanwhile); M > 1 converts 4 rows at
 * a time to q * s in a per-thread float32 scratch and runs 4 x 3 blocks over it (3 x 4 and 2 x 6 measured slower),
 * for chunks of 48 rows of x (each thread converts its x chunk and its group sums once, for all its rows).
 * The body: gemm_int8_group.h.
 */
#include "kw_avx2.h"

#define VEC __m256
#define LANES 8
#define XB 3 /* 4 x 3 accumulators + 3 rows of x + one weight vector: the 16 registers */
#define ENTRY kw_q8group
#define ENTRY_U4 kw_q8group_u4

static inline __m256 v_zero(void) { return _mm256_setzero_ps(); }
static inline __m256 v_set1(float f) { return _mm256_set1_ps(f); }
static inline __m256 v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 v_load_a(const float *p) { return _mm256_load_ps(p); }
static inline void v_store_u(float *p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void v_store_a(float *p, __m256 v) { _mm256_store_ps(p, v); }
static inline __m256 v_add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
static inline __m256 v_mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
static inline __m256 v_fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
static inline float v_hsum(__m256 v) { return hadd1(v); }

static inline __m256 v_codes(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 v_codes4(const uint8_t *p, int shift) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(b, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(15)));
}

static inline __m256 v_widen(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

#include "gemm_int8_group.h"

/* ---- the weight as bf16 [N, K] for the widest calls (then oneDNN's bf16 matmul): bf16(q * s + z), the float32
 * sum rounded once (q * s is exact) and then to nearest even bf16, as the reference's dequantize and cast ---- */
typedef struct {
    const int8_t *q;
    const uint16_t *s, *z;
    uint16_t *out;
    int64_t N, K, gs;
    int u4;
} g8d_t;

static void g8_bf16_slice(const void *arg, int t, int nthreads) {
    const g8d_t *d = (const g8d_t *)arg;
    const int64_t K = d->K, G = K / d->gs, per = (d->N + nthreads - 1) / nthreads;
    int64_t n1 = (t + 1) * per < d->N ? (t + 1) * per : d->N;
    for (int64_t n = t * per; n < n1; n++)
        for (int64_t g = 0, k = 0; g < G; g++) {
            __m256 s = _mm256_set1_ps(bf16f(d->s[n * G + g])), z = _mm256_set1_ps(bf16f(d->z[n * G + g]));
            const int8_t *row = d->q + n * g8_row_bytes(K, d->u4);
            for (int64_t end = k + d->gs; k < end; k += 16) {
                __m256 c0 = d->u4 ? g8_codes(row, k, 1) : g8_codes(row, k, 0);
                __m256 c1 = d->u4 ? g8_codes(row, k + 8, 1) : g8_codes(row, k + 8, 0);
                __m256i lo = _mm256_srli_epi32(bf16_bits(_mm256_fmadd_ps(c0, s, z)), 16);
                __m256i hi = _mm256_srli_epi32(bf16_bits(_mm256_fmadd_ps(c1, s, z)), 16);
                _mm256_storeu_si256((__m256i *)(d->out + n * K + k),
                                    _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8));
            }
        }
}

static int g8_bf16(const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t N, int64_t K,
                   int64_t gs, int nthreads, int u4) {
    if (N < 1 || gs < 16 || gs % 16 || K < gs || K % gs || (u4 && K % 32)) return -1;
    nthreads = kw_threads(nthreads);
    if (N < 32 * nthreads) nthreads = 1;
    g8d_t d = {q, s, z, out, N, K, gs, u4};
    kw_run(g8_bf16_slice, &d, nthreads);
    return 0;
}

/* q, s, z as for kw_q8group (kw_q8group_u4: q the 4-bit pack); out: bf16 [N, K]. 0, -1 on bad sizes. */
int kw_q8group_bf16(const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t N, int64_t K,
                    int64_t gs, int nthreads);
int kw_q8group_u4_bf16(const uint8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t N, int64_t K,
                       int64_t gs, int nthreads);

int kw_q8group_bf16(const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t N, int64_t K,
                    int64_t gs, int nthreads) {
    return g8_bf16(q, s, z, out, N, K, gs, nthreads, 0);
}

int kw_q8group_u4_bf16(const uint8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t N, int64_t K,
                       int64_t gs, int nthreads) {
    return g8_bf16((const int8_t *)q, s, z, out, N, K, gs, nthreads, 1);
}
