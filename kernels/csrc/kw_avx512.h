/* What the AVX512-BF16 files share (the avx512 build only): the int8 / fp8 matmul's job and code conversion, the
 * vdpbf16ps micro-kernels and x panel (gemm_int8_avx512.c) that the int4 vector kernel reuses, the AMX tile state
 * (gemm_int8_amx.c) the tile kernels use, the int4 paired-code scratch (gemm_int4_vbmi.c) both int4 kernels fill,
 * x's group sums, the 16 x 16 dword transposition, and the int8_group tile entry (gemm_int8_group_amx.c). */
#ifndef KW_AVX512_H
#define KW_AVX512_H

#include <immintrin.h>

#include "kw.h"

/* In place: r[c] lane j -> r[j] lane c, for 16 x 16 32-bit units (a channel's bf16 pairs -> a pair's channels).
 * Unpacks of 32 and 64 bits within 128-bit lanes, then two rounds of 128-bit lane shuffles: 64 shuffles. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    __m512i u[16]; /* u[4g + q], 128-bit lane L: rows 4g..4g+3 at column 4L + q */
    for (int g = 0; g < 4; g++) {
        const __m512i *a = t + 4 * g;
        u[4 * g + 0] = _mm512_unpacklo_epi64(a[0], a[2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(a[0], a[2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(a[1], a[3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(a[1], a[3]);
    }
    for (int q = 0; q < 4; q++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0x88), w0 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0xDD);
        __m512i v1 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0x88);
        __m512i w1 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0xDD);
        r[q] = _mm512_shuffle_i32x4(v0, v1, 0x88);
        r[8 + q] = _mm512_shuffle_i32x4(v0, v1, 0xDD);
        r[4 + q] = _mm512_shuffle_i32x4(w0, w1, 0x88);
        r[12 + q] = _mm512_shuffle_i32x4(w0, w1, 0xDD);
    }
}

/* ---- the int8 / fp8 matmul: out[m, n] = bf16( scale[n] * sum_k x[m, k] * w[n, k] ) (gemm_int8_avx512.c) ---- */
typedef struct {
    const uint16_t *x;
    const int8_t *w;
    const float *scale;
    uint16_t *out;
    int64_t M, N, K;
    int fp8; /* w holds float8_e4m3fn codes, not int8 */
    const uint32_t *xt; /* AMX only: x's bf16 pairs transposed in 16-row blocks, [Mp/16][K/2][16], zero beyond M;
                         * NULL: no AMX */
    int64_t Mp;         /* M rounded up to 16 */
} job_t;

#define NT 32 /* channels per tile (two zmm of 16) */
#define MB 12 /* x rows per micro-kernel call: 24 accumulators + 2 weights + 1 broadcast */

static inline __mmask32 tail_mask(int64_t left) { return left >= 32 ? 0xFFFFFFFFu : ((1u << left) - 1u); }

/* 32 weight bytes -> 32 bf16, exactly: int8 codes as integers; float8_e4m3fn codes as their value / 256 (the
 * bits shifted onto float16's, as kernels.quant.fp8_as_float16 does; the caller's scale carries the 256). */
static inline __m512bh cvt_bytes(__m256i b, int fp8) {
    __m512 lo, hi;
    if (fp8) {
        __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7), _mm512_set1_epi16(~0x4000));
        lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
        hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    } else {
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    }
    return _mm512_cvtne2ps_pbh(hi, lo); /* elements 0-15 from lo, 16-31 from hi */
}

static inline __m512bh cvt_w(const int8_t *p, __mmask32 m, int fp8) {
    return cvt_bytes(_mm256_maskz_loadu_epi8(m, p), fp8);
}

/* The vector path over channels [n0, n1) for M > 1 (K even, >= 4): the AMX path's fallback without memory. */
KW_INTERNAL void gemm_rows(const job_t *j, int64_t n0, int64_t n1);

/* Micro-kernel of R rows (kw_micros[R], 1 <= R <= MB): x rows by kb2 k pairs of a weight tile (pair k2's NT channels
 * at scratch + k2 * ws), added to acc_out (R rows of NT floats); x as a panel of its pairs (xp[k2 * R + r]). The
 * pack job (NULL: none) lets the int8 kernel pack its next tile on the way; the sums are the same either way. */
typedef struct pack_job pack_job;
typedef void (*micro_fn)(const uint32_t *xp, const uint32_t *scratch, int64_t ws, int64_t kb2, float *acc_out,
                         const pack_job *pj);
KW_INTERNAL extern const micro_fn kw_micros[MB + 1];
/* x's pairs in MB-row blocks, as the micro-kernels read them: block m at panel + m * K2, pair (m + r, k2) at
 * k2 * R + r. */
KW_INTERNAL void x_panel(const uint16_t *x, int64_t M, int64_t K, uint32_t *panel);

/* ---- AMX tiles (gemm_int8_amx.c) ---- */
KW_INTERNAL int amx_on(void);       /* kw_amx_enable(1) succeeded: the kernels may run tile instructions */
KW_INTERNAL void amx_counted(void); /* one more call took the tiles (kw_amx_calls) */
KW_INTERNAL void tiles_on(void);    /* this thread's eight tiles as 16 rows x 64 bytes; _tile_release() after */
KW_INTERNAL void tiles_shape(const uint8_t rows[8], const uint16_t colsb[8]); /* tile t: rows[t] x colsb[t] bytes */
/* x's pairs transposed for the tiles when kw_gemm takes them (tiles on, M >= 2, K % 32 == 0), counted; else NULL */
KW_INTERNAL const uint32_t *amx_pairs(const uint16_t *x, int64_t M, int64_t K, int64_t Mp);
KW_INTERNAL void gemm_rows_amx(const job_t *j, int64_t n0, int64_t n1);

/* x rows padded to *Mp (M rounded up to 16) with zeros (*xp, bf16 [Mp][K]), and each row's sum over each group
 * (*xs, [K / gs][Mp], x_group_sums): per calling thread, kept. 0; -2 out of memory. (gemm_int4_vbmi.c) */
/* xs[g][m] = row m's sum over group g (gs % 16 == 0): 16 lanes in k order, then _mm512_reduce_add_ps; zero for
 * M <= m < Mp */
KW_INTERNAL void x_group_sums(const uint16_t *x, int64_t M, int64_t Mp, int64_t K, int64_t gs, float *xs);
KW_INTERNAL int x_prep(const uint16_t *x, int64_t M, int64_t K, int64_t gs, uint16_t **xp, float **xs, int64_t *Mp);

/* The int8_group matmul on the AMX tiles (gemm_int8_group_amx.c), gemm_int8_group.h's g8_entry's first choice: 0;
 * -1 where it does not take the call (one row, tiles off, K % 64 (4-bit codes: K % 128), groups other than 16 and
 * 32); -2 out of memory. Sizes as g8_sizes_ok. */
KW_INTERNAL int g8_tiles(const uint16_t *x, const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out,
                         int64_t M, int64_t N, int64_t K, int64_t gs, int nthreads, int u4);

/* ---- int4 in torch's CPU "halves" pack, as (16 + code) bf16 pairs (gemm_int4_vbmi.c, gemm_int4_amx.c) ---- */
typedef struct {
    const uint16_t *x; /* bf16 [Mp][K], zero rows beyond M */
    const uint8_t *q;
    const uint16_t *sz; /* bf16 [K / gs][N][2]: (scale, zero) */
    const float *xs;    /* [K / gs][Mp]: each row's sum over each group */
    uint16_t *out;
    int64_t M, Mp, N, K, gs, B;
    atomic_int fail;
} q4amx_t;

#define QKC 256 /* k per code scratch: 128 pairs x 64 channels x 4 bytes = 32 KiB */

/* Group g's 16 (scale, zero) pairs from column `col`: the scale, and the zero less 24 scales, as every int4 path
 * folds a group's sums (the codes entered as 16 + c: c - 8 = (16 + c) - 24): one definition, the same bits. */
static inline void q4_scale_zero(const q4amx_t *a, int64_t g, int64_t col, __m512 *sc, __m512 *zf) {
    __m512i r = _mm512_loadu_si512(a->sz + (g * a->N + col) * 2);
    *sc = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
    __m512 z = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u)));
    *zf = _mm512_fnmadd_ps(_mm512_set1_ps(24.0f), *sc, z);
}

/* s[k2][c] = (16 + code[k0 + 2 k2][c], 16 + code[k0 + 2 k2 + 1][c]) as bf16, c < B, for kc k of block b. */
KW_INTERNAL void q4_pack_pairs(const q4amx_t *a, int64_t b, int64_t k0, int64_t kc, uint32_t *s);
/* Slice t's blocks of channels [*b0, *b1), this thread's code scratch, group sums and a float total of `rows` x B:
 * 0; 1 when the slice is empty; -1 out of memory. */
KW_INTERNAL int q4_slice_start(const q4amx_t *a, int t, int nthreads, int64_t rows, int64_t *b0, int64_t *b1,
                               uint32_t **s, float **cg, float **tot);
/* Both int4 entries: the sizes, x prepared, then `slice` over the blocks of channels. 0; -1 on sizes they do not
 * take (K and gs multiples of 32, B 32 or 64, N a multiple of B); -2 out of memory. */
KW_INTERNAL int q4_run(kw_slice_fn slice, const uint16_t *x, const uint8_t *q, const uint16_t *sz, uint16_t *out,
                       int64_t M, int64_t N, int64_t K, int64_t gs, int64_t B, int nthreads);

#endif /* KW_AVX512_H */
