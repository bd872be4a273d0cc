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
#define ENTRY_BF16 kw_q8group_bf16
#define ENTRY_U4_BF16 kw_q8group_u4_bf16

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

/* LANES float32 as bf16 (nearest even; a NaN as 0x7FC0) */
static inline void v_store_bf16(uint16_t *p, __m256 v) {
    __m256i b = _mm256_srli_epi32(bf16_bits(v), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

#include "gemm_int8_group.h"
