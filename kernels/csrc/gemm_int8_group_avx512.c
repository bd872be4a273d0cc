/* The int8_group matmul of gemm_int8_group_avx2.c on 16 lanes (AVX-512F; the avx512 build): the same arithmetic,
 * every product exact, with lane j taking k = j mod 16 (and g = j mod 16 for the zero term) and the 16 lanes added
 * in one fixed tree, so its sums are in another (fixed) order than the AVX2 kernel's: one order per output whatever
 * M, the blocking or the thread count. M > 1 runs 4 x 4 blocks (4 x 6 and 8 x 3 measured no faster).
 * Against the AVX2 kernel on a Sapphire Rapids class VM, one thread, interleaved: 0.8x its time at 1 row with the
 * weight in L2 (from memory the two tie), 0.7-0.78x at 8 and 32 rows. The body: gemm_int8_group.h.
 */
#include "kw_avx512.h"

#define VEC __m512
#define LANES 16
#define XB 4
#define ENTRY kw_q8group512
#define G8_FIRST g8_tiles /* 4-bit codes on the tiles first where they are on (gemm_int8_group_amx.c) */
#define ENTRY_U4 kw_q8group512_u4
#define ENTRY_BF16 kw_q8group512_bf16
#define ENTRY_U4_BF16 kw_q8group512_u4_bf16

static inline __m512 v_zero(void) { return _mm512_setzero_ps(); }
static inline __m512 v_set1(float f) { return _mm512_set1_ps(f); }
static inline __m512 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 v_load_a(const float *p) { return _mm512_load_ps(p); }
static inline void v_store_u(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void v_store_a(float *p, __m512 v) { _mm512_store_ps(p, v); }
static inline __m512 v_add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
static inline __m512 v_mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
static inline __m512 v_fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }

/* the 16 lanes added in one fixed tree: halves, then quarters, then pairs */
static inline float v_hsum(__m512 v) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); /* AVX-512F: no DQ needed */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline __m512 v_codes(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline __m512 v_codes4(const uint8_t *p, int shift) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(b, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(15)));
}

/* 4-bit codes by table (gemm_int8_group.h's g8_rows_1_u4): 16 bytes as 16 index lanes, their high nibbles, and
 * table[index & 15] (vpermps reads the low 4 bits) */
#define V_U4_TABLE
typedef __m512i v_idx16;
static inline __m512 v_iota16(void) { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline __m512i v_u4_load(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline __m512i v_u4_high(__m512i c) { return _mm512_srli_epi32(c, 4); }
static inline __m512 v_lookup4(__m512 table, __m512i c) { return _mm512_permutexvar_ps(c, table); }

static inline __m512 v_widen(const uint16_t *p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

/* LANES float32 as bf16 (nearest even; a NaN as 0x7FC0) */
static inline void v_store_bf16(uint16_t *p, __m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}

#include "gemm_int8_group.h"
