/* Weight-only int8 and fp8 matmuls for bf16 activations on the vector units (AVX512-BF16), and the codes -> bf16
 * conversion for the widest calls.
 *
 *   out[m, n] = bf16( scale[n] * sum_k x[m, k] * w[n, k] )     x: bf16 [M, K], w: int8 [N, K], scale: f32 [N]
 *
 * With fp8 set, w holds float8_e4m3fn codes and enters the sum as its value / 256 (the caller's scale is 256x).
 * - int8 -> bf16 is exact (|q| <= 128 fits bf16's 8-bit significand), so is e4m3 -> bf16 (3-bit mantissa); products
 *   are summed in float32 by vdpbf16ps, the scale is applied in float32 and the result rounded to bf16 once (round
 *   to nearest even), so the only difference from the reference (dequantize, matmul) is the order of the sums.
 * - M == 1 streams each weight row once, converting it in registers (decode is memory-bound).
 *   M > 1 converts a tile of 32 channels once into a per-thread bf16 scratch (in k-pair order) and multiplies it
 *   with every row of x from there, x read from a per-thread panel of its pairs. The next tile is converted inside
 *   those products (its shuffles run beside their multiply-adds) and the one after it fetched toward L2.
 * - With the AMX tiles on (gemm_int8_amx.c) M >= 2 and K % 32 == 0 run there instead: the same rounding points.
 * - Threads: the N range is split over `nthreads` in whole blocks (kw_run).
 */
#include "kw_avx512.h"

#define NB 4 /* output channels per inner block (M == 1) */

static inline __m512bh load_bf16(const uint16_t *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

/* M == 1: NB rows at a time, converted in registers. */
static void gemv_rows(const job_t *j, int64_t n0, int64_t n1) {
    const int64_t K = j->K;
    int64_t n = n0;
    for (; n + NB <= n1; n += NB) {
        __m512 acc[NB];
        for (int c = 0; c < NB; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            __mmask32 m = tail_mask(K - k);
            __m512bh xv = load_bf16(j->x + k, m);
            for (int c = 0; c < NB; c++) acc[c] = _mm512_dpbf16_ps(acc[c], xv, cvt_w(j->w + (n + c) * K + k, m, j->fp8));
        }
        for (int c = 0; c < NB; c++) j->out[n + c] = f32_to_bf16(_mm512_reduce_add_ps(acc[c]) * j->scale[n + c]);
    }
    for (; n < n1; n++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            __mmask32 m = tail_mask(K - k);
            acc = _mm512_dpbf16_ps(acc, load_bf16(j->x + k, m), cvt_w(j->w + n * K + k, m, j->fp8));
        }
        j->out[n] = f32_to_bf16(_mm512_reduce_add_ps(acc) * j->scale[n]);
    }
}
/* ---- M > 1: 32 output channels at a time, weights interleaved in pairs of k ("VNNI" order) in a scratch tile,
 * so one vdpbf16ps multiplies a broadcast pair of x by the same pair of 16 channels: no horizontal sums. */
#define KB2 128 /* k pairs per scratch tile: 16 KiB of bf16 pairs; two (this one, the next) fill L1 */

/* One tile of the weight: channels n .. n+nc-1 (nc <= NT), k pairs k0 .. k0+kb2-1 (kb2 <= KB2). */
typedef struct {
    int64_t n, k0, kb2;
    int nc;
} tile_t;

/* Unit u of packing tile t (units h * Q + q/16: half h of the channels, k pairs q .. q+15) into scratch:
 * scratch[k2][c] = bf16 pair (w[n+c][2(k0+k2)], w[n+c][2(k0+k2)+1]) for c < nc, 0 beyond. Each channel's 32 codes
 * of 16 pairs are converted as they lie (contiguous loads, never past a row's end), then transposed in registers.
 * Not inlined: inlined into the micro-kernels, GCC spilled their accumulators (measured slower). */
static __attribute__((noinline)) void pack_unit(const job_t *j, const tile_t *t, int u, uint32_t *scratch) {
    const int64_t Q = (t->kb2 + 15) / 16, K = j->K;
    const int h = (int)(u / Q), rows = t->nc - 16 * h;
    const int64_t q = (u % Q) * 16, k = 2 * (t->k0 + q);
    const int8_t *base = j->w + (t->n + 16 * h) * K;
    __mmask32 m = tail_mask(K - k);
    __m512i r[16];
    for (int c = 0; c < 16; c++) r[c] = c < rows ? (__m512i)cvt_w(base + c * K + k, m, j->fp8) : _mm512_setzero_si512();
    transpose16(r);
    int np = t->kb2 - q < 16 ? (int)(t->kb2 - q) : 16;
    for (int p = 0; p < np; p++) _mm512_storeu_si512(scratch + (q + p) * NT + 16 * h, r[p]);
}

static int pack_units(const tile_t *t) { return (int)(2 * ((t->kb2 + 15) / 16)); }

/* The next tile's packing, done inside the micro-kernels that multiply this one (units u0 .. u1-1 in one call), so
 * its converts and shuffles run beside their vdpbf16ps instead of after them; and the tile after that fetched toward
 * L2 (one line per k pair step, `per` lines of each of `pf_rows` channels K bytes apart), so those loads hit the
 * cache. A call with no pack job (NULL) only multiplies. */
struct pack_job {
    const job_t *j;
    tile_t t;
    uint32_t *dst;
    int u0, u1;
    const int8_t *pf; /* NULL: nothing to fetch */
    int per, pf_rows;
};

/* x rows m .. m+R-1 by kb2 k pairs of a weight tile (pair k2's NT channels at scratch + k2 * ws), added to acc_out
 * (R rows of NT floats). x comes as a panel of its pairs (xp[k2 * R + r]: one pointer, no row pointers to keep in
 * registers). With a pack job the next tile is packed on the way (`every` steps a unit) and the one after fetched;
 * without (NULL) it only multiplies. The sums are the same, in the same order, either way. */
#define MICRO(R)                                                                                              \
    static void micro_##R(const uint32_t *xp, const uint32_t *scratch, int64_t ws, int64_t kb2, float *acc_out, \
                          const pack_job *pj) {                                                              \
        __m512 acc[R][2];                                                                                     \
        _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {                                               \
            acc[r][0] = _mm512_loadu_ps(acc_out + r * NT);                                                     \
            acc[r][1] = _mm512_loadu_ps(acc_out + r * NT + 16);                                                \
        }                                                                                                     \
        const int units = pj ? pj->u1 - pj->u0 : 0;                                                           \
        const int64_t every = units ? (kb2 / units > 0 ? kb2 / units : 1) : kb2 + 1, K = pj ? pj->j->K : 0;    \
        int64_t left = every;                                                                                 \
        int u = 0, line = 0, rows_left = pj ? pj->pf_rows : 0;                                                \
        const int8_t *pf = pj ? pj->pf : NULL;                                                                \
        for (int64_t k2 = 0; k2 < kb2; k2++) {                                                                \
            if (pf) {                                                                                         \
                _mm_prefetch((const char *)(pf + line * 64), _MM_HINT_T1);                                    \
                if (++line == pj->per) {                                                                      \
                    line = 0;                                                                                 \
                    pf = --rows_left ? pf + K : NULL;                                                         \
                }                                                                                             \
            }                                                                                                 \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(scratch + k2 * ws);                                    \
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(scratch + k2 * ws + 16);                               \
            _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {                                           \
                __m512bh xb = (__m512bh)_mm512_set1_epi32((int32_t)xp[k2 * R + r]);                           \
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);                                              \
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);                                              \
            }                                                                                                 \
            if (--left == 0) {                                                                                \
                left = every;                                                                                 \
                if (u < units) pack_unit(pj->j, &pj->t, pj->u0 + u++, pj->dst);                               \
            }                                                                                                 \
        }                                                                                                     \
        for (; u < units; u++) pack_unit(pj->j, &pj->t, pj->u0 + u, pj->dst);                                 \
        _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {                                               \
            _mm512_storeu_ps(acc_out + r * NT, acc[r][0]);                                                     \
            _mm512_storeu_ps(acc_out + r * NT + 16, acc[r][1]);                                                \
        }                                                                                                     \
    }
MICRO(1) MICRO(2) MICRO(3) MICRO(4) MICRO(5) MICRO(6) MICRO(7) MICRO(8) MICRO(9) MICRO(10) MICRO(11) MICRO(12)
const micro_fn kw_micros[MB + 1] = {NULL,    micro_1, micro_2, micro_3,  micro_4,  micro_5, micro_6,
                                    micro_7, micro_8, micro_9, micro_10, micro_11, micro_12};

void x_panel(const uint16_t *x, int64_t M, int64_t K, uint32_t *panel) {
    const int64_t K2 = K / 2;
    for (int64_t m = 0; m < M; m += MB) {
        const int R = (int)(M - m < MB ? M - m : MB);
        uint32_t *blk = panel + m * K2;
        for (int64_t k2 = 0; k2 < K2; k2++)
            for (int r = 0; r < R; r++) memcpy(blk + k2 * R + r, x + (m + r) * K + 2 * k2, 4);
    }
}

/* t moved to the tile after it within channels [.., n1): the next k block of the same channels, else the next
 * channels' first; 0 when there is none. */
static int tile_next(const job_t *j, int64_t n1, tile_t *t) {
    const int64_t K2 = j->K / 2;
    t->k0 += KB2;
    if (t->k0 >= K2) {
        t->k0 = 0;
        t->n += NT;
    }
    if (t->n >= n1) return 0;
    t->kb2 = K2 - t->k0 < KB2 ? K2 - t->k0 : KB2;
    t->nc = (int)(n1 - t->n < NT ? n1 - t->n : NT);
    return 1;
}

/* Tile cur's products for every row of x (in buffer `b` of two), packing `next` into the other buffer on the way
 * (spread over the row blocks) and fetching `far`'s codes in the first. */
static void tile_rows(const job_t *j, const uint32_t *panel, const tile_t *cur, const tile_t *next,
                      const tile_t *far, uint32_t *bufs[2], int b, float *acc) {
    const int64_t M = j->M, K = j->K, K2 = K / 2;
    pack_job pj = {j, next ? *next : *cur, bufs[b ^ 1], 0, 0, NULL, 0, 0};
    const int U = next ? pack_units(next) : 0, blocks = (int)((M + MB - 1) / MB);
    for (int64_t m = 0, bi = 0; m < M; m += MB, bi++) {
        int r = (int)(M - m < MB ? M - m : MB);
        pj.u0 = (int)(U * bi / blocks);
        pj.u1 = (int)(U * (bi + 1) / blocks);
        pj.pf = NULL;
        if (m == 0 && far) {
            pj.pf = j->w + far->n * K + 2 * far->k0;
            pj.per = (int)((2 * far->kb2 + 63) / 64);
            pj.pf_rows = far->nc;
        }
        kw_micros[r](panel + m * K2 + cur->k0 * r, bufs[b], NT, cur->kb2, acc + m * NT, &pj);
    }
}

/* Rows of x per pass over the weight (MC, a multiple of MB): every tile is packed once per pass and multiplied by the
 * pass's rows, whose panel stays near while the tiles go by; one pass over all of a prefill chunk's rows streams x
 * from L3 once per tile (one 1B layer at 2048 rows, Zen 4: 1.42x bf16's time in one pass, 1.13x / 1.06x / 1.05x in
 * passes of 240 / 480 / 720 rows). */
#define MC 480

static void gemm_pass(const job_t *j, int64_t n0, int64_t n1);

/* M > 1 needs K even (pairs); the caller routes odd K to the M == 1 path row by row. */
void gemm_rows(const job_t *j, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < j->M; m += MC) {
        job_t pass = *j;
        pass.x = j->x + m * j->K;
        pass.out = j->out + m * j->N;
        pass.M = j->M - m < MC ? j->M - m : MC;
        gemm_pass(&pass, n0, n1);
    }
}

static void gemm_pass(const job_t *j, int64_t n0, int64_t n1) {
    static __thread kw_buf scratch_b, acc_b, panel_b;
    const int64_t K = j->K, M = j->M, N = j->N, K2 = K / 2;
    if (n0 >= n1) return;
    uint32_t *scratch = kw_scratch(&scratch_b, 2 * KB2 * NT * 4);
    float *acc = kw_scratch(&acc_b, (size_t)(M * NT * 4));
    uint32_t *panel = kw_scratch(&panel_b, (size_t)(M * K2 * 4));
    if (!scratch || !acc || !panel) { /* no memory for the tiles: the same product row by row */
        for (int64_t m = 0; m < M; m++) {
            job_t row = {j->x + m * K, j->w, j->scale, j->out + m * N, 1, N, K, j->fp8, NULL, 0};
            gemv_rows(&row, n0, n1);
        }
        return;
    }
    x_panel(j->x, M, K, panel);
    uint32_t *bufs[2] = {scratch, scratch + KB2 * NT};
    tile_t cur = {n0, 0, K2 < KB2 ? K2 : KB2, (int)(n1 - n0 < NT ? n1 - n0 : NT)};
    for (int u = 0; u < pack_units(&cur); u++) pack_unit(j, &cur, u, bufs[0]);
    for (int b = 0;; b ^= 1) {
        if (cur.k0 == 0) memset(acc, 0, (size_t)M * NT * 4);
        tile_t next = cur, far;
        int has_next = tile_next(j, n1, &next);
        far = next;
        int has_far = has_next && tile_next(j, n1, &far);
        tile_rows(j, panel, &cur, has_next ? &next : NULL, has_far ? &far : NULL, bufs, b, acc);
        if (cur.k0 + cur.kb2 == K2)
            for (int64_t m = 0; m < M; m++)
                for (int c = 0; c < cur.nc; c++)
                    j->out[m * N + cur.n + c] = f32_to_bf16(acc[m * NT + c] * j->scale[cur.n + c]);
        if (!has_next) return;
        cur = next;
    }
}

static void run_slice(const job_t *j, int t, int nthreads) {
    /* slices aligned to whole blocks (NB rows, or NT-channel tiles) so only the last slice has a partial one */
    const int64_t align = j->M == 1 ? NB : NT;
    int64_t blocks = (j->N + align - 1) / align;
    int64_t b0 = blocks * t / nthreads, b1 = blocks * (t + 1) / nthreads;
    int64_t n0 = b0 * align, n1 = b1 * align < j->N ? b1 * align : j->N;
    if (n0 >= n1) return;
    if (j->xt) {
        gemm_rows_amx(j, n0, n1);
        return;
    }
    if (j->M > 1 && j->K % 2 == 0 && j->K >= 4) {
        gemm_rows(j, n0, n1);
        return;
    }
    for (int64_t m = 0; m < j->M; m++) { /* M == 1, or odd K: row by row */
        job_t row = {j->x + m * j->K, j->w, j->scale, j->out + m * j->N, 1, j->N, j->K, j->fp8, NULL, 0};
        gemv_rows(&row, n0, n1);
    }
}

static void gemm_slice(const void *arg, int t, int nthreads) { run_slice((const job_t *)arg, t, nthreads); }

/* Returns 0 on success, -1 on bad arguments. Without pool threads it runs on the calling thread alone. */
int kw_gemm(const uint16_t *x, const int8_t *w, const float *scale, uint16_t *out, int64_t M, int64_t N,
            int64_t K, int fp8, int nthreads) {
    if (M < 1 || N < 1 || K < 1) return -1;
    nthreads = kw_threads(nthreads);
    if (N < 4 * NB * nthreads) nthreads = 1; /* tiny outputs: not worth a wake-up */
    job_t j = {x, w, scale, out, M, N, K, fp8 != 0, NULL, (M + 15) / 16 * 16};
    j.xt = amx_pairs(x, M, K, j.Mp); /* NULL: the vector path */
    kw_run(gemm_slice, &j, nthreads);
    return 0;
}

/* ---- codes -> bf16 for the widest matmuls (prefill chunks): out [N, K] = the codes as bf16 (int8 exact; fp8 as
 * value / 256, exact), rows split over the threads; the caller multiplies with oneDNN's bf16 matmul, which at
 * hundreds of rows beats every per-call conversion above (docs/kernels.md has the figures). */
typedef struct {
    const int8_t *w;
    uint16_t *out;
    int64_t N, K;
    int fp8;
} codes_t;

static void codes_slice(const void *arg, int t, int nthreads) {
    const codes_t *c = (const codes_t *)arg;
    int64_t r0 = c->N * t / nthreads, r1 = c->N * (t + 1) / nthreads;
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *src = c->w + r * c->K;
        uint16_t *dst = c->out + r * c->K;
        for (int64_t k = 0; k < c->K; k += 32) {
            __mmask32 m = tail_mask(c->K - k);
            _mm512_mask_storeu_epi16(dst + k, m, (__m512i)cvt_w(src + k, m, c->fp8));
        }
    }
}

int kw_codes_bf16(const int8_t *w, uint16_t *out, int64_t N, int64_t K, int fp8, int nthreads) {
    if (N < 1 || K < 1) return -1;
    nthreads = kw_threads(nthreads);
    codes_t c = {w, out, N, K, fp8 != 0};
    kw_run(codes_slice, &c, N < nthreads ? 1 : nthreads);
    return 0;
}
