/* What the AVX2 + FMA files share: bf16 rounding of float32 vectors, the lane sum every matmul's output takes, and
 * kw_bgemm's blocks (gemm_bf16_avx2.c), which the int8 / fp8 kernel (gemm_int8_avx2.c) runs over its codes. */
#ifndef KW_AVX2_H
#define KW_AVX2_H

#include <immintrin.h>

#include "kw.h"

/* float32 -> the nearest-even bf16, as float32 bits (low half zero); NaN -> 0x7FC0, as torch's conversion. */
static inline __m256i bf16_bits(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u));
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                                _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
}

static inline __m256 bf16_round(__m256 x) { return _mm256_castsi256_ps(bf16_bits(x)); }

/* The 8 lanes added in one fixed tree. */
static inline float hadd1(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}

/* kw_bgemm's operands: x float32 [M, K] split (each 16 values as their 8 even then 8 odd), w bf16 [N, K]. */
typedef struct {
    const float *x;
    const uint16_t *w;
    uint16_t *out;
    int64_t M, N, K;
} bgemm_t;

/* rows n .. n+3 of out's columns (weight rows wn .. wn+3) against rows m, m+1 of x; sc: NULL, or one float32
 * scale per weight row, applied to each sum before its rounding. */
KW_INTERNAL void bgemm_4x2s(const bgemm_t *g, int64_t n, int64_t m, int64_t wn, const float *sc);
/* the same for nr <= 8 weight rows against row m of x. */
KW_INTERNAL void bgemm_8x1s(const bgemm_t *g, int64_t n, int nr, int64_t m, int64_t wn, const float *sc);

#endif /* KW_AVX2_H */
