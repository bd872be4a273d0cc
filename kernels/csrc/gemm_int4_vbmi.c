/* int4 weight-only matmul for bf16 x without the tiles (AVX512-BF16 + VBMI: Zen 4, Intel without AMX), M > 1, and
 * the paired-code scratch the tile kernel (gemm_int4_amx.c) shares.
 *
 * torch's CPU "halves" pack (blocks of B = 32 or 64 rows, k-major, byte j = rows j and j + B/2) is read in place:
 * each pair of k rows of a block becomes B scratch rows of (16 + code k, 16 + code k+1) bf16 pairs per channel in
 * L1 (exact; q4_pack_pairs), multiplied by the int8 kernel's micro-kernels (kw_micros: a broadcast pair of x by 32
 * channels' pairs, vdpbf16ps) with the block's stride. A group's sums start from zero and fold into the float32
 * total as total = fma(scale, sum x (16 + c), total), then fma(zero - 24 scale, sum x, total): w = (c - 8) scale +
 * zero, group by group in k order: one order per output whatever M, so a row's bits do not depend on its batch.
 * The 16 costs float32 headroom (sums of x (16 + c), not x c: ~3x the rounding error of kw_q4gemm's x c, still far
 * inside one bf16 rounding; tests/unit/kernels/test_cpu_amx.py bounds it).
 */
#include "kw_avx512.h"

/* vpermb's table: dword i (i < 16) = (byte o0 + i, -, byte o1 + i, -): two k rows' codes of the
 * same channels, each byte a low and a high nibble's channel. The unset bytes are masked off after the shift. */
static void q4_row_index(int o0, int o1, uint8_t idx[64]) {
    for (int i = 0; i < 16; i++) {
        idx[4 * i] = idx[4 * i + 1] = (uint8_t)(o0 + i);
        idx[4 * i + 2] = idx[4 * i + 3] = (uint8_t)(o1 + i);
    }
}

/* The two tables for a block of B rows: B = 64: channels 0-15 and 32-47 (idx0), 16-31 and 48-63 (idx1) of (k, k+1);
 * B = 32: channels 0-31 of (k, k+1) (idx0), of (k+2, k+3) (idx1). */
static void q4_row_tables(int64_t B, __m512i *idx0, __m512i *idx1) {
    uint8_t i0[64], i1[64];
    q4_row_index(0, B == 64 ? 32 : 16, i0);
    q4_row_index(B == 64 ? 16 : 32, 48, i1);
    *idx0 = _mm512_loadu_si512(i0), *idx1 = _mm512_loadu_si512(i1);
}

/* (16 + code k, 16 + code k+1) bf16 pairs from q4_row_index's dwords: the low (LO) or high (HI) nibble of each
 * byte shifted to bits 3-6 of its 16-bit half, the mantissa's top bits under 0x4180 = 16.0 (q4_pack_pairs). */
#define Q4_PAIRS_LO(d) _mm512_ternarylogic_epi32(_mm512_slli_epi32(d, 3), m78, c41, 0xEA)
#define Q4_PAIRS_HI(d) _mm512_ternarylogic_epi32(_mm512_srli_epi32(d, 1), m78, c41, 0xEA)

/* Groups ahead prefetched: a group's scales are a row of [K / gs, N, 2] apart, a stride no hardware
 * prefetcher follows, and the L2 streamer stops at each 4 KB page of the codes. Measured on a 1B model's layers
 * read from memory (20 layers, 564 MB, AMX kind, one row, 2 threads): 120 ms without, 49 ms with the scales', 39 ms
 * with the codes' too (distances 2-16 within 5%). */
#define PF_SCALES 4
#define PF_CODES 2

/* s[k2][c] = (16 + code[k0 + 2 k2][c], 16 + code[k0 + 2 k2 + 1][c]) as bf16, c < B, for kc k of block b. 16 + c
 * is bf16 0x4180 | c << 3 (16..31, step 1: exact), so a byte permute, a shift and a mask build each tile row from
 * the codes with no widening or conversion; the fold takes the 16 back out (q4_tiles_amx). One 64-byte load holds
 * 2 (B = 64) or 4 (B = 32) consecutive k rows of the block. The fold's scales of these groups are prefetched. */
void q4_pack_pairs(const q4amx_t *a, int64_t b, int64_t k0, int64_t kc, uint32_t *s) {
    const int64_t hb = a->B / 2, B = a->B;
    __m512i idx0, idx1;
    q4_row_tables(B, &idx0, &idx1);
    const __m512i c41 = _mm512_set1_epi32(0x41804180), m78 = _mm512_set1_epi32(0x00780078);
    const uint8_t *blk = a->q + b * a->K * hb;
    for (int64_t g = k0 / a->gs; g < (k0 + kc) / a->gs; g++)
        for (int64_t c = 0; c < B; c += 16)
            _mm_prefetch((const char *)(a->sz + (g * a->N + b * B + c) * 2), _MM_HINT_T0);
    for (int64_t k = k0; k < k0 + kc; k += 128 / B) {
        __m512i v = _mm512_loadu_si512(blk + k * hb);
        _mm_prefetch((const char *)(blk + k * hb + PF_CODES * 1024), _MM_HINT_T0);
        __m512i d0 = _mm512_permutexvar_epi8(idx0, v), d1 = _mm512_permutexvar_epi8(idx1, v);
        uint32_t *dst = s + (k - k0) / 2 * B;
        /* B = 64: channels 0-15, 16-31, 32-47, 48-63 of (k, k+1); B = 32: 0-15, 16-31 of (k, k+1), then of
         * (k+2, k+3) */
        _mm512_storeu_si512(dst, Q4_PAIRS_LO(d0));
        _mm512_storeu_si512(dst + 16, B == 64 ? Q4_PAIRS_LO(d1) : Q4_PAIRS_HI(d0));
        _mm512_storeu_si512(dst + 32, B == 64 ? Q4_PAIRS_HI(d0) : Q4_PAIRS_LO(d1));
        _mm512_storeu_si512(dst + 48, Q4_PAIRS_HI(d1));
    }
}

int q4_slice_start(const q4amx_t *a, int t, int nthreads, int64_t rows, int64_t *b0, int64_t *b1, uint32_t **s,
                   float **cg, float **tot) {
    static __thread kw_buf sb, cb, totb;
    int64_t blocks = a->N / a->B;
    *b0 = blocks * t / nthreads, *b1 = blocks * (t + 1) / nthreads;
    if (*b0 >= *b1) return 1;
    *s = kw_scratch(&sb, QKC / 2 * 64 * 4);
    *cg = kw_scratch(&cb, 16 * 64 * 4); /* the tiles' [16][64]; the vector kernel uses [12][32] */
    *tot = kw_scratch(&totb, (size_t)(rows * a->B) * sizeof(float));
    return *s && *cg && *tot ? 0 : -1;
}

void x_group_sums(const uint16_t *x, int64_t M, int64_t Mp, int64_t K, int64_t gs, float *xs) {
    for (int64_t g = 0; g < K / gs; g++)
        for (int64_t m = 0; m < Mp; m++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t k = g * gs; m < M && k < (g + 1) * gs; k += 16) {
                __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + m * K + k)));
                acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
            }
            xs[g * Mp + m] = _mm512_reduce_add_ps(acc);
        }
}

int x_prep(const uint16_t *x, int64_t M, int64_t K, int64_t gs, uint16_t **xpo, float **xso, int64_t *Mpo) {
    static __thread kw_buf xpb, xsb;
    const int64_t Mp = (M + 15) / 16 * 16, G = K / gs;
    uint16_t *xp = kw_scratch(&xpb, (size_t)(Mp * K * 2));
    float *xs = kw_scratch(&xsb, (size_t)(G * Mp * 4));
    if (!xp || !xs) return -2;
    memcpy(xp, x, (size_t)(M * K * 2));
    memset(xp + M * K, 0, (size_t)((Mp - M) * K * 2));
    x_group_sums(x, M, Mp, K, gs, xs);
    *xpo = xp, *xso = xs, *Mpo = Mp;
    return 0;
}

static int q4_sizes_ok(int64_t M, int64_t N, int64_t K, int64_t gs, int64_t B) {
    return M >= 1 && K % 32 == 0 && gs >= 32 && gs % 32 == 0 && K % gs == 0 && (B == 32 || B == 64) && N >= B &&
           N % B == 0;
}

int q4_run(kw_slice_fn slice, const uint16_t *x, const uint8_t *q, const uint16_t *sz, uint16_t *out, int64_t M,
           int64_t N, int64_t K, int64_t gs, int64_t B, int nthreads) {
    if (!q4_sizes_ok(M, N, K, gs, B)) return -1;
    uint16_t *xp;
    float *xs;
    int64_t Mp;
    if (x_prep(x, M, K, gs, &xp, &xs, &Mp)) return -2;
    nthreads = kw_threads(nthreads);
    q4amx_t a = {xp, q, sz, xs, out, M, Mp, N, K, gs, B, 0};
    kw_run(slice, &a, nthreads);
    return atomic_load(&a.fail) ? -2 : 0;
}

/* tot[m][c0 + c] += scale * cg[m][c] + (zero - 24 scale) * xs[g][m], rows mb..mb+R-1, channels c0..c0+31 of block b */
static void q4v_fold(const q4amx_t *a, int64_t b, int64_t g, int64_t mb, int R, int64_t c0, const float *cg,
                    float *tot) {
    for (int64_t c = 0; c < 32; c += 16) {
        __m512 sc, zf;
        q4_scale_zero(a, g, b * a->B + c0 + c, &sc, &zf);
        for (int i = 0; i < R; i++) {
            float *t = tot + (mb + i) * a->B + c0 + c;
            __m512 v = _mm512_fmadd_ps(sc, _mm512_loadu_ps(cg + i * 32 + c), _mm512_loadu_ps(t));
            _mm512_storeu_ps(t, _mm512_fmadd_ps(zf, _mm512_set1_ps(a->xs[g * a->Mp + mb + i]), v));
        }
    }
}

/* M == 1: block b's outputs with q4vec_slice's sums, the pairs built in registers instead of the code scratch (a
 * decode step's matmuls): a single-source byte permute puts two k rows' bytes of 16 channels in each dword, a
 * shift and a mask make the bf16 pairs of the low and of the high nibbles' channels. Per group and 16 channels one
 * accumulator from zero, the k pairs in order through vdpbf16ps, then q4v_fold's two fmas, the total rounded once:
 * the same bits as every other M. NB (1 or 2) blocks bs[] side by side, each block's arithmetic its own: two
 * streams of codes keep more reads in flight than one (a 1B's 20 layers from memory, one row, 2 threads: 16.7 ->
 * 18.2 GB/s, 34 -> 31 ms; L2-resident the same speed). */
static inline __attribute__((always_inline)) void q4vec_rows(const q4amx_t *a, const int64_t *bs, const int NB) {
    const int64_t K = a->K, B = a->B, gs = a->gs, hb = B / 2, V = B / 16, G = K / gs;
    __m512i idx0, idx1;
    q4_row_tables(B, &idx0, &idx1);
    const __m512i c41 = _mm512_set1_epi32(0x41804180), m78 = _mm512_set1_epi32(0x00780078);
    const uint32_t *xp = (const uint32_t *)a->x; /* one row: its bf16 pairs are the panel */
    const uint8_t *blk[2];
    __m512 tot[2][4];
    for (int j = 0; j < NB; j++) {
        blk[j] = a->q + bs[j] * K * hb;
        for (int c = 0; c < 4; c++) tot[j][c] = _mm512_setzero_ps();
    }
    for (int64_t g = 0; g < G; g++) {
        __m512 cg[2][4];
        for (int j = 0; j < NB; j++) {
            for (int c = 0; c < 4; c++) cg[j][c] = _mm512_setzero_ps();
            /* past the last group: the next block's first (a prefetch never faults, even past the tensor) */
            const int64_t gp = (g + PF_SCALES) % G, bp = bs[j] + (g + PF_SCALES) / G;
            for (int64_t c = 0; c < V; c++)
                _mm_prefetch((const char *)(a->sz + (gp * a->N + bp * B + c * 16) * 2), _MM_HINT_T0);
            for (int64_t o = 0; o < gs * hb; o += 64) /* the blocks lie one after another */
                _mm_prefetch((const char *)(blk[j] + (g + PF_CODES) * gs * hb + o), _MM_HINT_T0);
        }
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 128 / B) {
            __m512bh x0 = (__m512bh)_mm512_set1_epi32((int32_t)xp[k / 2]);
            __m512bh x1 = (__m512bh)_mm512_set1_epi32((int32_t)xp[k / 2 + (B == 64 ? 0 : 1)]);
            for (int j = 0; j < NB; j++) {
                __m512i v = _mm512_loadu_si512(blk[j] + k * hb);
                __m512i d0 = _mm512_permutexvar_epi8(idx0, v), d1 = _mm512_permutexvar_epi8(idx1, v);
                if (B == 64) { /* one k pair: channels 0-15, 32-47 (d0), 16-31, 48-63 (d1) */
                    cg[j][0] = _mm512_dpbf16_ps(cg[j][0], x0, (__m512bh)Q4_PAIRS_LO(d0));
                    cg[j][1] = _mm512_dpbf16_ps(cg[j][1], x0, (__m512bh)Q4_PAIRS_LO(d1));
                    cg[j][2] = _mm512_dpbf16_ps(cg[j][2], x0, (__m512bh)Q4_PAIRS_HI(d0));
                    cg[j][3] = _mm512_dpbf16_ps(cg[j][3], x0, (__m512bh)Q4_PAIRS_HI(d1));
                } else { /* channels 0-15 (low), 16-31 (high); two k pairs, in order */
                    cg[j][0] = _mm512_dpbf16_ps(cg[j][0], x0, (__m512bh)Q4_PAIRS_LO(d0));
                    cg[j][1] = _mm512_dpbf16_ps(cg[j][1], x0, (__m512bh)Q4_PAIRS_HI(d0));
                    cg[j][0] = _mm512_dpbf16_ps(cg[j][0], x1, (__m512bh)Q4_PAIRS_LO(d1));
                    cg[j][1] = _mm512_dpbf16_ps(cg[j][1], x1, (__m512bh)Q4_PAIRS_HI(d1));
                }
            }
        }
        const __m512 xs = _mm512_set1_ps(a->xs[g * a->Mp]);
        for (int j = 0; j < NB; j++)
            for (int64_t c = 0; c < V; c++) { /* q4v_fold's two fmas */
                __m512 sc, zf;
                q4_scale_zero(a, g, bs[j] * B + c * 16, &sc, &zf);
                tot[j][c] = _mm512_fmadd_ps(zf, xs, _mm512_fmadd_ps(sc, cg[j][c], tot[j][c]));
            }
    }
    for (int j = 0; j < NB; j++) {
        float t[64];
        for (int64_t c = 0; c < V; c++) _mm512_storeu_ps(t + c * 16, tot[j][c]);
        for (int64_t c = 0; c < B; c++) a->out[bs[j] * B + c] = f32_to_bf16(t[c]);
    }
}

static void q4vec_row(const q4amx_t *a, int64_t b) { q4vec_rows(a, &b, 1); }

static void q4vec_row2(const q4amx_t *a, int64_t b, int64_t b2) {
    const int64_t bs[2] = {b, b2};
    q4vec_rows(a, bs, 2);
}

static void q4vec_slice(const void *arg, int t, int nthreads) {
    q4amx_t *a = (q4amx_t *)arg;
    int64_t b0, b1;
    uint32_t *s;
    float *cg, *tot;
    int rc = q4_slice_start(a, t, nthreads, a->M, &b0, &b1, &s, &cg, &tot);
    if (rc > 0) return;
    if (rc < 0) {
        atomic_store(&a->fail, 1);
        return;
    }
    if (a->M == 1) {
        int64_t b = b0;
        for (; b + 1 < b1; b += 2) q4vec_row2(a, b, b + 1);
        if (b < b1) q4vec_row(a, b);
        return;
    }
    const int64_t K = a->K, B = a->B, gs = a->gs, K2 = K / 2;
    static __thread kw_buf panel_b;
    uint32_t *panel = kw_scratch(&panel_b, (size_t)(a->M * K2 * 4));
    if (!panel) {
        atomic_store(&a->fail, 1);
        return;
    }
    x_panel(a->x, a->M, K, panel);
    for (int64_t b = b0; b < b1; b++) {
        memset(tot, 0, (size_t)(a->M * B) * 4);
        for (int64_t k0 = 0; k0 < K; k0 += QKC) {
            int64_t kc = K - k0 < QKC ? K - k0 : QKC;
            q4_pack_pairs(a, b, k0, kc, s);
            for (int64_t mb = 0; mb < a->M; mb += MB) {
                int R = (int)(a->M - mb < MB ? a->M - mb : MB);
                for (int64_t c0 = 0; c0 < B; c0 += 32)
                    for (int64_t g0 = k0; g0 < k0 + kc; g0 += gs) {
                        memset(cg, 0, (size_t)R * NT * 4); /* a group's sums start from zero */
                        kw_micros[R](panel + mb * K2 + g0 / 2 * R, s + (g0 - k0) / 2 * B + c0, B, gs / 2, cg, NULL);
                        q4v_fold(a, b, g0 / gs, mb, R, c0, cg, tot);
                    }
            }
        }
        for (int64_t m = 0; m < a->M; m++)
            for (int64_t c = 0; c < B; c++) a->out[m * a->N + b * B + c] = f32_to_bf16(tot[m * B + c]);
    }
}

/* kw_q4amx's product on the vector units (the caller checks avx512vbmi); q4_run's codes. */
int kw_q4vec(const uint16_t *x, const uint8_t *q, const uint16_t *sz, uint16_t *out, int64_t M, int64_t N, int64_t K,
             int64_t gs, int64_t B, int nthreads) {
    return q4_run(q4vec_slice, x, q, sz, out, M, N, K, gs, B, nthreads);
}
