/* keepwarm native CPU kernels: weight-only int8 and fp8 matmuls for bfloat16 activations (AVX512-BF16); and, in
 * AVX2 + FMA (later in this file), a bfloat16 decode attention over the paged KV cache, a decode step's glue and a
 * bf16 x bf16 matmul for CPUs where oneDNN has none.
 *
 *   out[m, n] = bf16( scale[n] * sum_k x[m, k] * w[n, k] )     x: bf16 [M, K], w: int8 [N, K], scale: f32 [N]
 *
 * With fp8 set, w holds float8_e4m3fn codes and enters the sum as its value / 256 (the caller's scale is 256x).
 * Built with -DKW_ATTENTION_ONLY (and AVX2 flags) it is everything but the int8 / fp8 matmuls, for CPUs
 * without AVX512-BF16.
 *
 * Rules:
 * - The weight is only read (it may be a read-only mapping of the daemon's arena); nothing is copied up front.
 * - int8 -> bf16 is exact (|q| <= 128 fits bf16's 8-bit significand), so is e4m3 -> bf16 (3-bit mantissa); products are summed in float32 by
 *   vdpbf16ps, the scale is applied in float32 and the result rounded to bf16 once (round to nearest even), so
 *   the only difference from the reference (dequantize, matmul) is the order of the float32 sums.
 * - M == 1 streams each weight row once, converting it in registers (decode is memory-bound).
 *   M > 1 converts a tile of 32 channels once into a per-thread bf16 scratch (in k-pair order) and multiplies it
 *   with every row of x from there, x read from a per-thread panel of its pairs. The next tile is converted inside
 *   those products (its shuffles run beside their multiply-adds) and the one after it fetched toward L2.
 * - Threads: the N range (the attention: its (sequence, kv head) units) is split over `nthreads` (the caller
 *   passes torch's intra-op count). The slices run on the calling thread's OpenMP team, torch's own, where Python
 *   has seen that the process has one OpenMP runtime (kw_use_openmp); else on a pool of T-1 threads of ours that
 *   park on a condition variable between calls after a short spin. Calls from several threads take turns (one
 *   owns the pool at a time). A fork()ed child starts with no pool and uses the pool, not OpenMP.
 */
#include <immintrin.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define NB 4        /* output channels per inner block */
#define MAXT 64
#define SPIN 2000

/* float32 -> bf16, round to nearest even; NaN -> 0x7FC0, as torch's conversion (and bf16_bits below). Both builds. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Per thread, grown as needed, kept between calls (NULL without memory). */
static void *grown(void **p, int64_t *cap, int64_t bytes) {
    if (*cap < bytes) {
        free(*p);
        *p = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        *cap = *p ? bytes : 0;
    }
    return *p;
}

#ifndef KW_ATTENTION_ONLY /* the matmuls need AVX512-BF16; the attention-only build (AVX2) leaves them out */
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
#define NT 32       /* channels per tile (two zmm of 16) */
#define KB2 128     /* k pairs per scratch tile: 16 KiB of bf16 pairs; two (this one, the next) fill L1 */
#define MB 12       /* x rows per micro-kernel call: 24 accumulators + 2 weights + 1 broadcast */

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
typedef struct {
    const job_t *j;
    tile_t t;
    uint32_t *dst;
    int u0, u1;
    const int8_t *pf; /* NULL: nothing to fetch */
    int per, pf_rows;
} pack_job;

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
typedef void (*micro_fn)(const uint32_t *, const uint32_t *, int64_t, int64_t, float *, const pack_job *);
static const micro_fn MICROS[MB + 1] = {NULL,     micro_1,  micro_2, micro_3, micro_4,  micro_5, micro_6,
                                        micro_7,  micro_8,  micro_9, micro_10, micro_11, micro_12};

/* x's pairs in MB-row blocks, as the micro-kernels read them: block m at panel + m * K2, pair (m + r, k2) at
 * k2 * R + r. */
static void x_panel(const uint16_t *x, int64_t M, int64_t K, uint32_t *panel) {
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
        MICROS[r](panel + m * K2 + cur->k0 * r, bufs[b], NT, cur->kb2, acc + m * NT, &pj);
    }
}

/* Rows of x per pass over the weight (MC, a multiple of MB): every tile is packed once per pass and multiplied by the
 * pass's rows, whose panel stays near while the tiles go by; one pass over all of a prefill chunk's rows streams x
 * from L3 once per tile (one 1B layer at 2048 rows, Zen 4: 1.42x bf16's time in one pass, 1.13x / 1.06x / 1.05x in
 * passes of 240 / 480 / 720 rows). */
#define MC 480

static void gemm_pass(const job_t *j, int64_t n0, int64_t n1);

/* M > 1 needs K even (pairs); the caller routes odd K to the M == 1 path row by row. */
static void gemm_rows(const job_t *j, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < j->M; m += MC) {
        job_t pass = *j;
        pass.x = j->x + m * j->K;
        pass.out = j->out + m * j->N;
        pass.M = j->M - m < MC ? j->M - m : MC;
        gemm_pass(&pass, n0, n1);
    }
}

static void gemm_pass(const job_t *j, int64_t n0, int64_t n1) {
    static __thread void *scratch_p, *acc_p, *panel_p;
    static __thread int64_t scratch_cap, acc_cap, panel_cap;
    const int64_t K = j->K, M = j->M, N = j->N, K2 = K / 2;
    if (n0 >= n1) return;
    uint32_t *scratch = grown(&scratch_p, &scratch_cap, 2 * KB2 * NT * 4);
    float *acc = grown(&acc_p, &acc_cap, M * NT * 4);
    uint32_t *panel = grown(&panel_p, &panel_cap, M * K2 * 4);
    if (!scratch || !acc || !panel) { /* no memory for the tiles: the same product row by row */
        for (int64_t m = 0; m < M; m++) {
            job_t row = {j->x + m * K, j->w, j->scale, j->out + m * N, 1, N, K, j->fp8};
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

/* ---- AMX (Intel, amx-tile + amx-bf16), M > 1 and K % 32 == 0: the same sums on the tiles (tdpbf16ps).
 * The roles are swapped so the weight needs no pair reordering: A = 16 weight rows x 32 k, converted from their
 * codes straight into an L1 scratch in row order (each row contiguous, as stored); B = x's bf16 pairs transposed
 * in 16-row blocks (transpose_pairs, once per call by the calling thread); C = out^T, 16 channels x 16 rows of x. Each output
 * is a float32 sum over k in a fixed order that does not depend on M or on the other rows, scaled in float32 and
 * rounded to bf16 once, as above. Tile rules: every thread loads its config at the start of a slice (oneDNN may
 * have used the tiles on the same thread in between) and releases them at the end. */
#define AKB 512 /* k per A scratch: 32 rows x 512 bf16 = 32 KiB */
#define AMX_MIN_ROWS 2 /* rows of x from which kw_gemm takes the tiles */
static int g_amx; /* kw_amx_enable() succeeded: the kernel may run tile instructions */
static atomic_long g_amx_calls; /* kw_gemm calls that took the tiles (tests ask) */
long kw_amx_calls(void) { return atomic_load(&g_amx_calls); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")))

/* This thread's tiles, all eight as 16 rows x 64 bytes (every kernel here uses that one shape); loaded at the start
 * of each slice, released (_tile_release) at its end. */
AMX_TARGET static void tiles_on(void) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* on: asks Linux for the tile data state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), 0 when granted, and the
 * matmuls take the tiles from then on; Python asks only where /proc/cpuinfo lists amx_tile, amx_bf16 and avx512vbmi
 * (the int4 kernel's byte permute). Off: the vector path again (A/B benchmarks, tests). */
int kw_amx_enable(int on) {
    if (!on) {
        g_amx = 0;
        return 0;
    }
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return -1;
    g_amx = 1;
    return 0;
}

/* a[c][0..kb) = row n+c's codes k0..k0+kb as bf16, c < nc; zero rows beyond (kb % 32 == 0). */
static void pack_rows_amx(const job_t *j, int64_t n, int nc, int64_t k0, int64_t kb, uint16_t *a) {
    for (int c = 0; c < NT; c++) {
        uint16_t *dst = a + (int64_t)c * AKB;
        if (c >= nc) {
            memset(dst, 0, (size_t)kb * 2);
            continue;
        }
        const int8_t *src = j->w + (n + c) * j->K + k0;
        for (int64_t k = 0; k < kb; k += 32)
            _mm512_storeu_si512(dst + k, (__m512i)cvt_bytes(_mm256_loadu_si256((const __m256i *)(src + k)), j->fp8));
    }
}

/* acc (out^T, [NT][Mp] float32) += a's 32 rows x xt's columns mb..mb+16*two, over kb k. */
AMX_TARGET static void tiles_amx(const job_t *j, const uint16_t *a, int64_t k0, int64_t kb, int64_t mb, int two,
                                 float *acc) {
    const int64_t Mp = j->Mp, cs = Mp * 4;
    _tile_loadd(0, acc + mb, cs);
    _tile_loadd(2, acc + 16 * Mp + mb, cs);
    if (two) {
        _tile_loadd(1, acc + mb + 16, cs);
        _tile_loadd(3, acc + 16 * Mp + mb + 16, cs);
    }
    for (int64_t k = 0; k < kb; k += 32) {
        const uint32_t *b = j->xt + mb / 16 * (j->K / 2 * 16) + (k0 + k) / 2 * 16; /* 1 KiB, contiguous */
        _tile_loadd(4, a + k, AKB * 2);
        _tile_loadd(5, a + 16 * AKB + k, AKB * 2);
        _tile_loadd(6, b, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (two) {
            _tile_loadd(7, b + j->K / 2 * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc + mb, cs);
    _tile_stored(2, acc + 16 * Mp + mb, cs);
    if (two) {
        _tile_stored(1, acc + mb + 16, cs);
        _tile_stored(3, acc + 16 * Mp + mb + 16, cs);
    }
}

AMX_TARGET static void gemm_rows_amx(const job_t *j, int64_t n0, int64_t n1) {
    static __thread uint16_t *a;
    static __thread float *acc;
    static __thread int64_t acc_cap;
    const int64_t K = j->K, M = j->M, N = j->N, Mp = j->Mp;
    if (!a) a = aligned_alloc(64, (size_t)NT * AKB * 2);
    if (acc_cap < Mp) {
        free(acc);
        acc = aligned_alloc(64, (size_t)Mp * NT * 4);
        acc_cap = acc ? Mp : 0;
    }
    if (!a || !acc) { /* no memory for the scratch: the vector path */
        gemm_rows(j, n0, n1);
        return;
    }
    tiles_on();
    for (int64_t n = n0; n < n1; n += NT) {
        int nc = (int)(n1 - n < NT ? n1 - n : NT);
        memset(acc, 0, (size_t)Mp * NT * 4);
        for (int64_t k0 = 0; k0 < K; k0 += AKB) {
            int64_t kb = K - k0 < AKB ? K - k0 : AKB;
            pack_rows_amx(j, n, nc, k0, kb, a);
            for (int64_t mb = 0; mb < Mp; mb += 32) tiles_amx(j, a, k0, kb, mb, Mp - mb >= 32, acc);
        }
        for (int c = 0; c < nc; c++) {
            const float s = j->scale[n + c];
            for (int64_t m = 0; m < M; m++) j->out[m * N + n + c] = f32_to_bf16(acc[c * Mp + m] * s);
        }
    }
    _tile_release();
}

/* xt[m / 16][k2][m % 16] = x[m]'s k-pair k2 (as one u32), m < M; zero for M <= m < Mp: each B tile (16 pairs of k
 * x 16 rows of x) is 1 KiB in one piece. */
static void transpose_pairs(const uint16_t *x, int64_t M, int64_t K, int64_t Mp, uint32_t *xt) {
    const int64_t K2 = K / 2;
    for (int64_t mb = 0; mb < Mp; mb += 16) {
        uint32_t *blk = xt + mb * K2;
        for (int64_t k2 = 0; k2 < K2; k2++)
            for (int64_t i = 0; i < 16; i++) {
                if (mb + i < M)
                    memcpy(blk + k2 * 16 + i, x + (mb + i) * K + 2 * k2, 4);
                else
                    blk[k2 * 16 + i] = 0;
            }
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
        job_t row = {j->x + m * j->K, j->w, j->scale, j->out + m * j->N, 1, j->N, j->K, j->fp8};
        gemv_rows(&row, n0, n1);
    }
}

#endif /* KW_ATTENTION_ONLY */

/* ------------------------------------------------------------------ thread pool */
static pthread_mutex_t g_call = PTHREAD_MUTEX_INITIALIZER; /* one call at a time owns the pool */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
typedef void (*slice_fn)(const void *arg, int t, int nthreads); /* runs slice t of nthreads of one call */
static slice_fn g_fn;
static const void *g_arg; /* the calling thread's job: it waits for every slice before returning */
static atomic_int g_gen, g_done, g_nactive;
static int g_pool; /* pool threads started (T-1) */
static int g_born[MAXT]; /* the generation each pool thread was started at: its first job is the next one */
static int g_atfork;
static int g_openmp; /* kw_use_openmp(1): slices run on the calling thread's OpenMP team (torch's) */

static void *worker(void *arg) {
    int t = (int)(intptr_t)arg;
    int seen = g_born[t];
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&g_gen, memory_order_acquire) == seen && spins < SPIN) {
            _mm_pause();
            spins++;
        }
        if (atomic_load_explicit(&g_gen, memory_order_acquire) == seen) {
            pthread_mutex_lock(&g_mu);
            while (atomic_load(&g_gen) == seen) pthread_cond_wait(&g_cv, &g_mu);
            pthread_mutex_unlock(&g_mu);
        }
        seen = atomic_load(&g_gen);
        int n = atomic_load(&g_nactive);
        if (t < n) g_fn(g_arg, t, n);
        atomic_fetch_add_explicit(&g_done, 1, memory_order_release);
    }
    return NULL;
}

static void child_after_fork(void) {
    /* a forked child inherits none of the pool's threads: start afresh */
    g_pool = 0;
    g_openmp = 0;
    pthread_mutex_init(&g_call, NULL);
    pthread_mutex_init(&g_mu, NULL);
    pthread_cond_init(&g_cv, NULL);
}

static int ensure_pool(int want) {
    if (!g_atfork) {
        pthread_atfork(NULL, NULL, child_after_fork);
        g_atfork = 1;
    }
    while (g_pool < want) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        g_born[g_pool + 1] = atomic_load(&g_gen);
        int rc = pthread_create(&th, &attr, worker, (void *)(intptr_t)(g_pool + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) return 0;
        g_pool++;
    }
    return 1;
}

/* Runs fn's slices 0..nthreads-1: slice 0 on the calling thread, the others on the pool; alone when the pool
 * cannot grow. Returns when every slice is done. */
/* Python turns this on once it has seen that the libgomp this library uses is the one torch uses (one runtime in
 * the process): the team torch's last op left spinning then runs our slices at once, where a pool of our own
 * competes with it for the cores (measured: 2-2.4x slower calls right after a torch matmul). A forked child goes
 * back to the pool (child_after_fork): libgomp's team does not survive a fork (torch's own ops hang there). */
void kw_use_openmp(int on) {
    if (!g_atfork) {
        pthread_atfork(NULL, NULL, child_after_fork);
        g_atfork = 1;
    }
    g_openmp = on;
}

static void run_pool(slice_fn fn, const void *arg, int nthreads) {
#ifdef _OPENMP
    if (nthreads > 1 && g_openmp) {
#pragma omp parallel num_threads(nthreads)
        fn(arg, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
#endif
    if (nthreads > 1) pthread_mutex_lock(&g_call);
    if (nthreads == 1 || !ensure_pool(nthreads - 1)) {
        fn(arg, 0, 1);
        if (nthreads > 1) pthread_mutex_unlock(&g_call);
        return;
    }
    g_fn = fn;
    g_arg = arg;
    atomic_store(&g_nactive, nthreads);
    atomic_store(&g_done, 0);
    pthread_mutex_lock(&g_mu);
    atomic_fetch_add_explicit(&g_gen, 1, memory_order_release);
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
    fn(arg, 0, nthreads);
    while (atomic_load_explicit(&g_done, memory_order_acquire) < g_pool) _mm_pause();
    pthread_mutex_unlock(&g_call);
}

#ifndef KW_ATTENTION_ONLY
static void gemm_slice(const void *arg, int t, int nthreads) { run_slice((const job_t *)arg, t, nthreads); }

/* Returns 0 on success, -1 on bad arguments. Without pool threads it runs on the calling thread alone. */
int kw_gemm(const uint16_t *x, const int8_t *w, const float *scale, uint16_t *out, int64_t M, int64_t N,
            int64_t K, int fp8, int nthreads) {
    if (M < 1 || N < 1 || K < 1) return -1;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAXT) nthreads = MAXT;
    if (N < 4 * NB * nthreads) nthreads = 1; /* tiny outputs: not worth a wake-up */
    job_t j = {x, w, scale, out, M, N, K, fp8 != 0, NULL, (M + 15) / 16 * 16};
    static __thread uint32_t *xt;
    static __thread int64_t xt_cap;
    if (g_amx && M >= AMX_MIN_ROWS && K % 32 == 0) {
        if (xt_cap < j.Mp * K / 2) {
            free(xt);
            xt = aligned_alloc(64, (size_t)(j.Mp * K / 2 * 4 + 63) / 64 * 64);
            xt_cap = xt ? j.Mp * K / 2 : 0;
        }
        if (xt) {
            transpose_pairs(x, M, K, j.Mp, xt);
            j.xt = xt;
            atomic_fetch_add(&g_amx_calls, 1);
        }
    }
    run_pool(gemm_slice, &j, nthreads);
    return 0;
}

/* ---- codes -> bf16 for the widest matmuls (prefill chunks): out [N, K] = the codes as bf16 (int8 exact; fp8 as
 * value / 256, exact), rows split over the threads; the caller multiplies with oneDNN's bf16 matmul, which at
 * hundreds of rows beats every per-call conversion above (kernels/quant.py has the figures). */
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
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAXT) nthreads = MAXT;
    codes_t c = {w, out, N, K, fp8 != 0};
    run_pool(codes_slice, &c, N < nthreads ? 1 : nthreads);
    return 0;
}
#endif /* KW_ATTENTION_ONLY */


/* ------------------------------------------------------------------ decode attention over the paged KV cache
 *
 * One query row per sequence, read against its keys and values where they lie in the cache (no gather copy):
 *
 *   q: bf16, sequence s's heads at q + s * q_stride (heads contiguous, D apart); out: bf16 [S, Hq, D] contiguous
 *   kc, vc: bf16 [Hk, num_blocks, bs, D] contiguous; query head h reads kv head h / G (G = Hq / Hk); D % 16 == 0
 *   plan: int64 [3 + 3S + S*W] = S, W, f32, then ctx[S], lo[S], base[S], then table [S, W]: sequence s sees the
 *         positions lo[s] .. ctx[s]-1, and position p lies in block table[s][(p - base[s]) / bs], offset p % bs
 *
 * With f32 0 (decode rows) the rounding points are the torch path's (kernels/reference.py `_decode_attention`):
 * score = bf16(q . k) with the dot product in float32, then * scale, cap * tanh(score / cap) when capped, softmax
 * in float32 (max, exp, sum, times 1 / sum), probabilities rounded to bf16, out = bf16(sum_p prob_p * v_p) in
 * float32. With f32 1 (prefill rows, each a one-row query of its own) scores and probabilities are not rounded,
 * as in SDPA's CPU kernel, which keeps both in float32 and rounds only the output. What differs is
 * the order of the float32 sums, and exp / tanh's last-ulp implementations (exp flushes results below 2^-126,
 * where torch's go on into subnormals: probabilities under 1e-38 of the largest).
 *
 * AVX2 + FMA only, so the same code runs where the matmuls above cannot (this file's attention-only build,
 * KW_ATTENTION_ONLY). Work: one (sequence, kv head) pair is one unit: its G query heads share each K/V row read;
 * units are split over the threads by their key count, so long and short sequences balance.
 */
typedef struct {
    const uint16_t *q, *kc, *vc;
    uint16_t *out;
    const int64_t *plan;
    int64_t q_stride, Hq, Hk, D, num_blocks, bs, S, W;
    float scale, softcap; /* softcap 0: none */
    char *scratch;        /* scratch_per_thread bytes per thread (unit_scratch) */
    int64_t scratch_per_thread;
    int f32; /* plan[2] == 1: scores and probabilities stay float32 (SDPA's roundings), else rounded to bf16 */
} attn_t;

#define KCHUNK 8            /* keys per score block: 8 dot products reduced into one vector */
#define ATTN_MIN_WORK 1024  /* (key, query head) pairs per thread below which one thread runs the call */

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

/* Lane j of the result: the sum of v[j]'s 8 lanes. */
static inline __m256 hsum8(const __m256 v[8]) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float hmax1(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline float hadd1(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}

/* exp(x) for x <= 0 (a softmax's x - max): 2^n * e^r with |r| <= ln2/2 and a degree-7 Taylor polynomial
 * (relative error ~1e-8 before rounding); 0 below -87, where the result would leave float32's normal range.
 * NaN stays NaN (max's second operand is returned when one is NaN). */
static inline __m256 exp_le0(__m256 x) {
    __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 in two parts (Cody-Waite) */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline __m256 lanes_below(int64_t left) { /* all ones in lanes j < left */
    int k = (int)(left < 8 ? left : 8);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

/* 16 bf16 -> float32 as two vectors, exactly: the even elements (0, 2, .., 14) and the odd ones. Sums over
 * both (dot products) or kept apart and re-interleaved on the way out (store_pairs) need no lane shuffles. */
static inline void bf16x16_split(const uint16_t *p, __m256 *even, __m256 *odd) {
    __m256i x = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* The inverse: bf16 of the even and odd elements, stored as 16 consecutive bf16. */
static inline void store_pairs(uint16_t *p, __m256 even, __m256 odd) {
    __m256i x = _mm256_or_si256(_mm256_srli_epi32(bf16_bits(even), 16), bf16_bits(odd));
    _mm256_storeu_si256((__m256i *)p, x);
}

/* One unit's scratch: scores [G][Lp] floats, its q rows in float32 split as bf16x16_split does [G][D], dot
 * product partials [G][KCHUNK][8], and each visible position's row offset in a kv head's part of the cache [L]
 * (Lp: L rounded up to KCHUNK, so score rows take whole vectors). */
typedef struct {
    float *sc, *qf, *part;
    int64_t *off;
} unit_scratch;

static int64_t scratch_bytes(int64_t G, int64_t D, int64_t longest) {
    int64_t Lp = (longest + KCHUNK - 1) / KCHUNK * KCHUNK;
    return ((G * Lp + G * D + G * KCHUNK * 8) * 4 + longest * 8 + 63) / 64 * 64;
}

static unit_scratch carve(char *p, int64_t G, int64_t D, int64_t Lp) {
    unit_scratch u;
    u.sc = (float *)p;
    u.qf = u.sc + G * Lp;
    u.part = u.qf + G * D;
    u.off = (int64_t *)(u.part + G * KCHUNK * 8); /* 32-byte aligned: every size before is a multiple of 8 */
    return u;
}

/* off[i] = the row offset of position lo + i, walking the blocks (no division per key). */
static void row_offsets(const attn_t *a, int64_t s, int64_t lo, int64_t L, int64_t *off) {
    const int64_t base = a->plan[3 + 2 * a->S + s], bs = a->bs;
    const int64_t *table = a->plan + 3 + 3 * a->S + s * a->W;
    int64_t col = (lo - base) / bs, o = lo % bs;
    for (int64_t i = 0; i < L; i++) {
        off[i] = (table[col] * bs + o) * a->D;
        if (++o == bs) {
            o = 0;
            col++;
        }
    }
}

/* part[((g0 + g) * KCHUNK + j0 + j) * 8 ..] = 8 partial sums of q(h*G+g0+g) . k(j0+j), for GN query heads and
 * KB keys at once: each 16 columns of the GN q rows are loaded once for the KB keys, and GN * KB independent
 * accumulators keep the FMA pipes busy (2 GN + GN KB + 2 <= 16 registers: AVX2 has 16). */
#define DOT(GN, KB)                                                                                            \
    static void dot_##GN(const float *qf, const uint16_t *const *k, int64_t D, int64_t g0, int j0,            \
                         float *part) {                                                                       \
        __m256 acc[KB][GN];                                                                                   \
        for (int j = 0; j < KB; j++)                                                                          \
            for (int g = 0; g < GN; g++) acc[j][g] = _mm256_setzero_ps();                                     \
        for (int64_t d = 0; d < D; d += 16) {                                                                 \
            __m256 qe[GN], qo[GN];                                                                            \
            for (int g = 0; g < GN; g++) {                                                                    \
                qe[g] = _mm256_loadu_ps(qf + (g0 + g) * D + d);                                               \
                qo[g] = _mm256_loadu_ps(qf + (g0 + g) * D + d + 8);                                           \
            }                                                                                                 \
            for (int j = 0; j < KB; j++) {                                                                    \
                __m256 ke, ko;                                                                                \
                bf16x16_split(k[j0 + j] + d, &ke, &ko);                                                       \
                for (int g = 0; g < GN; g++)                                                                  \
                    acc[j][g] = _mm256_fmadd_ps(qo[g], ko, _mm256_fmadd_ps(qe[g], ke, acc[j][g]));            \
            }                                                                                                 \
        }                                                                                                     \
        for (int j = 0; j < KB; j++)                                                                          \
            for (int g = 0; g < GN; g++) _mm256_storeu_ps(part + ((g0 + g) * KCHUNK + j0 + j) * 8, acc[j][g]); \
    }
DOT(1, 8) DOT(2, 4) DOT(3, 2) DOT(4, 1)
typedef void (*dot_fn)(const float *, const uint16_t *const *, int64_t, int64_t, int, float *);
static const dot_fn DOTS[5] = {NULL, dot_1, dot_2, dot_3, dot_4};
static const int DOT_KEYS[5] = {0, 8, 4, 2, 1}; /* KB of each */

/* u.sc[g * Lp + i] = the scaled (and capped) score of query head h*G+g against position lo+i, for i < L. */
static void scores(const attn_t *a, int64_t s, int64_t h, int64_t L, int64_t Lp, unit_scratch u) {
    const int64_t G = a->Hq / a->Hk, D = a->D;
    const uint16_t *kh = a->kc + h * a->num_blocks * a->bs * D;
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d += 16) {
            __m256 e, o;
            bf16x16_split(a->q + s * a->q_stride + (h * G + g) * D + d, &e, &o);
            _mm256_storeu_ps(u.qf + g * D + d, e);
            _mm256_storeu_ps(u.qf + g * D + d + 8, o);
        }
    for (int64_t i0 = 0; i0 < L; i0 += KCHUNK) {
        int n = (int)(L - i0 < KCHUNK ? L - i0 : KCHUNK);
        const uint16_t *k[KCHUNK];
        for (int j = 0; j < KCHUNK; j++) k[j] = kh + u.off[i0 + (j < n ? j : 0)]; /* past L: unused repeats */
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            int gn = (int)(G - g0 < 4 ? G - g0 : 4);
            for (int j0 = 0; j0 < n; j0 += DOT_KEYS[gn]) DOTS[gn](u.qf, k, D, g0, j0, u.part);
        }
        for (int64_t g = 0; g < G; g++) {
            __m256 acc[KCHUNK];
            for (int j = 0; j < KCHUNK; j++) acc[j] = _mm256_loadu_ps(u.part + (g * KCHUNK + j) * 8);
            /* torch: bmm's bf16 result, then .float() * scale */
            __m256 dot = hsum8(acc);
            _mm256_storeu_ps(u.sc + g * Lp + i0, _mm256_mul_ps(a->f32 ? dot : bf16_round(dot), _mm256_set1_ps(a->scale)));
        }
    }
    if (a->softcap != 0.0f) /* transformers' op order: tanh(s / cap) * cap */
        for (int64_t g = 0; g < G; g++)
            for (int64_t i = 0; i < L; i++) u.sc[g * Lp + i] = tanhf(u.sc[g * Lp + i] / a->softcap) * a->softcap;
}

/* In place: the first L of a row of Lp scores -> their softmax, each rounded to bf16 unless f32 (kept as float32
 * either way); the padding after L becomes 0. */
static void softmax_row(float *x, int64_t L, int64_t Lp, int f32) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 mx = ninf, sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < Lp; i += 8) mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(x + i),
                                                                                  lanes_below(L - i)));
    __m256 m = _mm256_set1_ps(hmax1(mx));
    for (int64_t i = 0; i < Lp; i += 8) {
        __m256 e = _mm256_and_ps(exp_le0(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)), lanes_below(L - i));
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(x + i, e);
    }
    __m256 inv = _mm256_set1_ps(1.0f / hadd1(sum));
    for (int64_t i = 0; i < Lp; i += 8) {
        __m256 p = _mm256_mul_ps(_mm256_loadu_ps(x + i), inv);
        _mm256_storeu_ps(x + i, f32 ? p : bf16_round(p));
    }
}

/* out rows of query heads h*G+g0 .. +GN-1 = bf16(sum_i p[g][i] * v(lo+i)), float32 sums of exact products, 16
 * columns at a time as even and odd halves; U interleaved sums (keys i % U) for more independent accumulators
 * (U * GN * 2, 12 at most: AVX2 has 16 registers), added at the end. */
#define PV(GN, U)                                                                                              \
    static void pv_##GN(const attn_t *a, int64_t s, int64_t h, int64_t g0, int64_t L, int64_t Lp,             \
                        unit_scratch u) {                                                                     \
        const int64_t D = a->D, G = a->Hq / a->Hk;                                                            \
        const uint16_t *vh = a->vc + h * a->num_blocks * a->bs * D;                                           \
        for (int64_t d0 = 0; d0 < D; d0 += 16) {                                                              \
            __m256 acc[U][GN][2];                                                                             \
            for (int r = 0; r < U; r++)                                                                       \
                for (int g = 0; g < GN; g++) acc[r][g][0] = acc[r][g][1] = _mm256_setzero_ps();               \
            int64_t i = 0;                                                                                    \
            for (; i + U <= L; i += U)                                                                        \
                for (int r = 0; r < U; r++) pv_step(vh + u.off[i + r] + d0, u.sc + g0 * Lp + i + r, Lp, GN,   \
                                                    acc[r]);                                                  \
            for (; i < L; i++) pv_step(vh + u.off[i] + d0, u.sc + g0 * Lp + i, Lp, GN, acc[0]);               \
            for (int r = 1; r < U; r++)                                                                       \
                for (int g = 0; g < GN; g++) {                                                                \
                    acc[0][g][0] = _mm256_add_ps(acc[0][g][0], acc[r][g][0]);                                 \
                    acc[0][g][1] = _mm256_add_ps(acc[0][g][1], acc[r][g][1]);                                 \
                }                                                                                             \
            for (int g = 0; g < GN; g++)                                                                      \
                store_pairs(a->out + (s * a->Hq + h * G + g0 + g) * D + d0, acc[0][g][0], acc[0][g][1]);      \
        }                                                                                                     \
    }

/* acc[g] += p[g * Lp] * (one V row's 16 columns, as even and odd halves), for g < gn. */
static inline __attribute__((always_inline)) void pv_step(const uint16_t *v, const float *p, int64_t Lp, int gn,
                                                          __m256 (*acc)[2]) {
    __m256 ve, vo;
    bf16x16_split(v, &ve, &vo);
    for (int g = 0; g < gn; g++) {
        __m256 b = _mm256_broadcast_ss(p + g * Lp);
        acc[g][0] = _mm256_fmadd_ps(b, ve, acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(b, vo, acc[g][1]);
    }
}
PV(1, 4) PV(2, 3) PV(3, 2) PV(4, 1) PV(5, 1) PV(6, 1)
typedef void (*pv_fn)(const attn_t *, int64_t, int64_t, int64_t, int64_t, int64_t, unit_scratch);
static const pv_fn PVS[7] = {NULL, pv_1, pv_2, pv_3, pv_4, pv_5, pv_6};

static int64_t unit_keys(const attn_t *a, int64_t s) { return a->plan[3 + s] - a->plan[3 + a->S + s]; }

/* One (sequence, kv head) unit, in the thread's scratch. */
static void attn_unit(const attn_t *a, int64_t s, int64_t h, char *scratch) {
    const int64_t lo = a->plan[3 + a->S + s], L = unit_keys(a, s), G = a->Hq / a->Hk;
    const int64_t Lp = (L + KCHUNK - 1) / KCHUNK * KCHUNK;
    unit_scratch u = carve(scratch, G, a->D, Lp);
    row_offsets(a, s, lo, L, u.off);
    scores(a, s, h, L, Lp, u);
    for (int64_t g = 0; g < G; g++) softmax_row(u.sc + g * Lp, L, Lp, a->f32);
    for (int64_t g0 = 0; g0 < G; g0 += 6) PVS[G - g0 < 6 ? G - g0 : 6](a, s, h, g0, L, Lp, u);
}

/* Slice t of n: the units whose first key, counted over every unit in order, falls in its share of the keys. */
static void attn_slice(const void *arg, int t, int n) {
    const attn_t *a = arg;
    int64_t total = 0, before = 0;
    for (int64_t s = 0; s < a->S; s++) total += unit_keys(a, s) * a->Hk;
    char *scratch = a->scratch + t * a->scratch_per_thread;
    for (int64_t s = 0; s < a->S; s++) {
        int64_t L = unit_keys(a, s);
        for (int64_t h = 0; h < a->Hk; h++, before += L)
            if (before * n / total == t) attn_unit(a, s, h, scratch);
    }
}

/* The plan's entries every read depends on, checked before any is made: -1 on the first that is out of range. */
static int check_plan(const int64_t *plan, int64_t S, int64_t W, int64_t num_blocks, int64_t bs) {
    for (int64_t s = 0; s < S; s++) {
        int64_t ctx = plan[3 + s], lo = plan[3 + S + s], base = plan[3 + 2 * S + s];
        if (lo < base || lo >= ctx || base % bs || (ctx - 1 - base) / bs >= W) return -1;
        for (int64_t c = (lo - base) / bs; c <= (ctx - 1 - base) / bs; c++) {
            int64_t b = plan[3 + 3 * S + s * W + c];
            if (b < 0 || b >= num_blocks) return -1;
        }
    }
    return 0;
}

/* Returns 0 on success, -1 on bad arguments, -2 without memory for the scratch (nothing written on failure).
 * Threads: as kw_gemm's, but one thread below ATTN_MIN_WORK (key, query head) pairs per thread. */
int kw_decode_attention(const uint16_t *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc, uint16_t *out,
                        const int64_t *plan, int64_t S, int64_t Hq, int64_t Hk, int64_t D, int64_t num_blocks,
                        int64_t bs, float scale, float softcap, int nthreads) {
    if (S < 1 || plan[0] != S || plan[1] < 1 || (plan[2] != 0 && plan[2] != 1) || Hk < 1 || Hq < 1 || Hq % Hk ||
        D < 16 || D % 16 || bs < 1 || num_blocks < 1)
        return -1;
    if (check_plan(plan, S, plan[1], num_blocks, bs)) return -1;
    attn_t a = {q,      kc,      vc,   out, plan, q_stride, Hq, Hk, D, num_blocks, bs, S, plan[1], scale,
                softcap, NULL, 0, (int)plan[2]};
    int64_t work = 0, longest = 0;
    for (int64_t s = 0; s < S; s++) {
        int64_t L = unit_keys(&a, s);
        work += L * Hq;
        longest = L > longest ? L : longest;
    }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAXT) nthreads = MAXT;
    if (nthreads > S * Hk) nthreads = (int)(S * Hk);
    if (work < ATTN_MIN_WORK * nthreads) nthreads = 1; /* a few hundred keys: not worth a wake-up */
    a.scratch_per_thread = scratch_bytes(Hq / Hk, D, longest);
    a.scratch = aligned_alloc(64, (size_t)(a.scratch_per_thread * nthreads));
    if (!a.scratch) return -2;
    run_pool(attn_slice, &a, nthreads);
    free(a.scratch);
    return 0;
}

/* ---- a decode step's per-token glue: RMSNorm (with the residual add), neox rotary, the KV store (AVX2 + FMA) ----
 * Each call does what 5-12 small torch ops did (on a 2-core CPU those ops cost their dispatch, not their
 * arithmetic), one thread, rounding where kernels/reference.py rounds (the build has -ffp-contract=off: no product
 * is fused into a sum unless written as an fma):
 * - kw_rms_norm: r = bf16(x + residual) (the new residual); y = bf16(r * (1 / sqrt(sum(r * r) / H + eps)));
 *   out = bf16(y * w). The sum of squares (each square of a bf16 is exact in float32) is added up in the order of
 *   ATen's CPU sum (torch_sumsq), so the result is torch's, bit for bit.
 * - kw_rotary_neox: over whole heads (rot_dim == D), out[i] = x[i] * cos[i] - x[i + D/2] * sin[i] and
 *   out[i + D/2] = x[i + D/2] * cos[i] + x[i] * sin[i], each product rounded, then the sum, then to bf16: torch's
 *   ``x * cos2 + roll(x) * sin2`` exactly.
 * - kw_store_kv: rows copied into the [Hk, num_blocks, block_size, D] pools at their slots (-1: skipped); every slot
 *   is checked before anything is written. */

static inline __m256 load8_bf16(const uint16_t *p) {
    __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}

static inline void store8_bf16(uint16_t *p, __m256 v) {
    __m256i b = _mm256_srli_epi32(bf16_bits(v), 16); /* each lane's low half: its bf16 */
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

static inline __m256 sq8(const uint16_t *p) {
    __m256 v = load8_bf16(p);
    return _mm256_mul_ps(v, v);
}

/* sum(x[i]^2) over a contiguous bf16 row, in ATen's order for a contiguous float32 row (cascade_sum ->
 * vectorized_inner_sum with 8-float vectors, as torch 2.13 runs it on x86 with AVX2 and AVX-512 alike): rows of 4
 * vectors go to 4 vector accumulators, cascaded up 4 levels every 2^lp rows (lp = max(4, ceil_log2(rows) / 4)); then
 * the levels are folded, the vectors past the last whole row added to the first accumulator, the 4 accumulators
 * added in order; the scalar tail is summed first and the 8 lanes added to it in order. tests/test_cpu_glue.py
 * checks the bits against torch's. */
static float torch_sumsq(const uint16_t *x, int64_t n) {
    int64_t nvec = n / 8, rows = nvec / 4;
    int cl = rows <= 2 ? 1 : 64 - __builtin_clzll((unsigned long long)(rows - 1));
    int lp = cl / 4 > 4 ? cl / 4 : 4;
    int64_t step = (int64_t)1 << lp, mask = step - 1, i = 0;
    __m256 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int k = 0; k < 4; k++) acc[j][k] = _mm256_setzero_ps();
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], sq8(x + (i * 4 + k) * 8));
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++) {
                acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = _mm256_setzero_ps();
            }
            if (i & (mask << (j * lp))) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], sq8(x + (i * 4 + k) * 8));
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
    for (int64_t v = rows * 4; v < nvec; v++) acc[0][0] = _mm256_add_ps(acc[0][0], sq8(x + v * 8));
    for (int k = 1; k < 4; k++) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
    float total = 0.0f, lanes[8];
    for (int64_t k = nvec * 8; k < n; k++) {
        uint32_t u = (uint32_t)x[k] << 16;
        float f;
        memcpy(&f, &u, 4);
        total += f * f;
    }
    _mm256_storeu_ps(lanes, acc[0][0]);
    for (int l = 0; l < 8; l++) total += lanes[l];
    return total;
}

/* x [T, H] (row stride xs), residual NULL or [T, H] (row stride rs), w [H]; out and newres [T, H] contiguous.
 * 0, or -1 on bad sizes (H a multiple of 8). */
int kw_rms_norm(const uint16_t *x, int64_t xs, const uint16_t *res, int64_t rs, const uint16_t *w, uint16_t *out,
                uint16_t *newres, int64_t T, int64_t H, float eps) {
    if (T < 0 || H < 8 || H % 8 || (res && !newres)) return -1;
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *src = x + t * xs;
        if (res) {
            uint16_t *nr = newres + t * H;
            for (int64_t i = 0; i < H; i += 8)
                store8_bf16(nr + i, _mm256_add_ps(load8_bf16(src + i), load8_bf16(res + t * rs + i)));
            src = nr;
        }
        __m256 r = _mm256_set1_ps(1.0f / sqrtf(torch_sumsq(src, H) / (float)H + eps));
        uint16_t *o = out + t * H;
        for (int64_t i = 0; i < H; i += 8)
            store8_bf16(o + i, _mm256_mul_ps(bf16_round(_mm256_mul_ps(load8_bf16(src + i), r)), load8_bf16(w + i)));
    }
    return 0;
}

/* q [T, Hq * D] and k [T, Hk * D] (row strides qs, ks; heads contiguous), cos and sin [T, D / 2] float32 (row
 * stride cs) -> qo [T, Hq * D], ko [T, Hk * D] contiguous. 0, or -1 on bad sizes (D a multiple of 16). */
int kw_rotary_neox(const uint16_t *q, int64_t qs, const uint16_t *k, int64_t ks, const float *cos, const float *sin,
                   int64_t cs, uint16_t *qo, uint16_t *ko, int64_t T, int64_t Hq, int64_t Hk, int64_t D) {
    if (T < 0 || Hq < 1 || Hk < 0 || D < 16 || D % 16) return -1;
    int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * cs, *s = sin + t * cs;
        for (int64_t h = 0; h < Hq + Hk; h++) {
            const uint16_t *src = h < Hq ? q + t * qs + h * D : k + t * ks + (h - Hq) * D;
            uint16_t *dst = h < Hq ? qo + (t * Hq + h) * D : ko + (t * Hk + h - Hq) * D;
            for (int64_t i = 0; i < half; i += 8) {
                __m256 x1 = load8_bf16(src + i), x2 = load8_bf16(src + half + i);
                __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
                store8_bf16(dst + i, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
                store8_bf16(dst + half + i, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
            }
        }
    }
    return 0;
}

/* k, v [T, Hk, D] (row strides ks, vs; heads contiguous) into kc, vc [Hk, num_blocks, bs, D] at slots [T].
 * 0, or -1 (nothing written) when a slot is below -1 or past the pools. */
int kw_store_kv(const uint16_t *k, int64_t ks, const uint16_t *v, int64_t vs, uint16_t *kc, uint16_t *vc,
                const int64_t *slots, int64_t T, int64_t Hk, int64_t D, int64_t num_blocks, int64_t bs) {
    int64_t total = num_blocks * bs;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < -1 || slots[t] >= total) return -1;
    size_t row = (size_t)D * sizeof(uint16_t);
    for (int64_t t = 0; t < T; t++) {
        int64_t s = slots[t];
        if (s < 0) continue;
        for (int64_t h = 0; h < Hk; h++) {
            memcpy(kc + (h * total + s) * D, k + t * ks + h * D, row);
            memcpy(vc + (h * total + s) * D, v + t * vs + h * D, row);
        }
    }
    return 0;
}


/* ------------------------------------------------------------------ bf16 x bf16 matmul (AVX2 + FMA)
 *
 *   out[m, n] = bf16( sum_k x[m, k] * w[n, k] )     w: bf16 [N, K] contiguous, out: bf16 [M, N]; K % 16 == 0
 *   x: the caller's bf16 x in float32 (exact), each 16 values of a row stored as their 8 even then their 8 odd
 *
 * For CPUs where oneDNN has no bf16 matmul (no AVX512-BW, no AVX-NE-CONVERT: Zen 2/3, older Xeons), where torch's
 * bf16 linear falls back to a generic loop. 16 weights load as one vector and split into their even and odd
 * elements as float32 by a shift and a mask (exact), which is why x comes split the same way.
 *
 * One summation order for every (m, n), whatever M, the blocking or the thread count: lane j of one float32
 * accumulator takes, for each 16 values of k in turn, the product of element 2j then of element 2j + 1 (fused
 * multiply-adds); then the 8 lanes are added in a fixed tree (hadd1) and the sum rounded to bf16 once (nearest
 * even). So a row's output does not depend on the other rows of the batch.
 * Blocks: 4 weight rows x 2 rows of x (8 independent FMA chains: the FMA latency hidden), or 8 weight rows x 1
 * row of x for the last odd row. The N range is split over the threads in multiples of 8. */
typedef struct {
    const float *x;
    const uint16_t *w;
    uint16_t *out;
    int64_t M, N, K;
} bgemm_t;

#define W16(p, e, o)                                                                  \
    do {                                                                              \
        __m256i r_ = _mm256_loadu_si256((const __m256i *)(p));                        \
        e = _mm256_castsi256_ps(_mm256_slli_epi32(r_, 16));                           \
        o = _mm256_castsi256_ps(_mm256_and_si256(r_, _mm256_set1_epi32((int)0xFFFF0000u))); \
    } while (0)

/* rows n .. n+3 of w against rows m, m+1 of x (wn: the weight's first row is row wn of out's columns; sc: NULL,
 * or one float32 scale per row of w, applied to each sum before its rounding) */
static void bgemm_4x2s(const bgemm_t *g, int64_t n, int64_t m, int64_t wn, const float *sc) {
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

/* rows n .. n+nr-1 (nr <= 8) of w against row m of x; inlined with nr = 8 (unrolled, in registers) and as is
 * (wn, sc: as in bgemm_4x2s) */
static inline __attribute__((always_inline)) void bgemm_rows_1(const bgemm_t *g, int64_t n, int nr, int64_t m,
                                                               int64_t wn, const float *sc) {
    const int64_t K = g->K;
    const float *x0 = g->x + m * K;
    const uint16_t *w = g->w + wn * K;
    __m256 a[8], we, wo;
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m256 e = _mm256_loadu_ps(x0 + k), o = _mm256_loadu_ps(x0 + k + 8);
        for (int i = 0; i < nr; i++) {
            W16(w + i * K + k, we, wo);
            a[i] = _mm256_fmadd_ps(wo, o, _mm256_fmadd_ps(we, e, a[i]));
        }
    }
    uint16_t *p = g->out + m * g->N + n;
    for (int i = 0; i < nr; i++) p[i] = f32_to_bf16(sc ? hadd1(a[i]) * sc[i] : hadd1(a[i]));
}

static void bgemm_8x1s(const bgemm_t *g, int64_t n, int nr, int64_t m, int64_t wn, const float *sc) {
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
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAXT) nthreads = MAXT;
    if (N < 32 * nthreads) nthreads = 1; /* tiny outputs: not worth a wake-up */
    bgemm_t g = {x, w, out, M, N, K};
    run_pool(bgemm_slice, &g, nthreads);
    return 0;
}


/* ------------------------------------------------------------------ int8 and int4 weight-only matmuls (AVX2 + FMA)
 *
 *   int8:  out[m, n] = bf16( s[n] * sum_k x[m, k] * q[n, k] )     q: int8 or float8_e4m3fn [N, K], s: float32 [N]
 *   int4:  out[m, n] = bf16( sum_g ( s[g, n] * sum_{k in g} x[m, k] * c[n, k]  +  (z[g, n] - 8 s[g, n]) * xs[m, g] ) )
 *          (= x . W with W = (c - 8) * s + z, the reference's weight, up to float32 rounding)
 *          c: torch's CPU int4 pack "halves" of B rows (B/2 a multiple of 8: row blocks of B stored k-major, byte j
 *          of a k holding rows j (low nibble) and j + B/2 (high)); sz: bf16 [G, N, 2] = (scale, zero) per group of
 *          gs columns; xs[m, g] the sum of x over the group (lanes as below, then hadd1).
 *   x: float32 [M, K] (the caller's bf16 x, exact); for int8 K a multiple of 16 and each 16 values stored as
 *   their 8 even then their 8 odd (kw_bgemm's layout); for int4 in order, K a multiple of gs.
 *
 * For CPUs without AVX512-BF16, where torch's int8 / int4 pack ops convert every weight once per row of x and run
 * compute-bound at one row, slower than the bf16 matmul they should beat (decode is memory-bound: half and a
 * quarter of the bytes). Codes are exact in float32; products and sums are float32, rounded to bf16 once.
 *
 * One summation order per output element whatever M, the blocking or the thread count (a row's output does not
 * depend on the rest of its batch):
 * - int8: kw_bgemm's sums on the codes as bf16 (exact): lane j takes elements 2j then 2j + 1 of each 16 columns in
 *   turn (fused multiply-adds), hadd1 adds the lanes, the sum times s[n] is rounded to bf16. M == 1 converts the
 *   codes to float32 in registers (one pass over the weight); M > 1 converts 8 rows at a time to bf16 into a
 *   per-thread scratch and runs kw_bgemm's blocks over it (a float32 scratch with its own blocks was 1.17x slower
 *   at 32 rows, interleaved A/B): the same arithmetic, the same bits.
 * - int4: per row, a group's products are added in k order from zero (one chain per row: rows are the lanes), then
 *   total = fma(s, group sum, total); total = fma(z - 8 s, xs, total), group by group from zero. M == 1 with
 *   blocks of 32 converts the codes in registers; otherwise a group's codes are converted once into a per-thread
 *   scratch [gs][B] and every row of x, two at a time, runs over it: the same bits.
 * Software prefetches and unrolling were tried (interleaved A/B): no gain, so none. */

static __thread void *q_scratch;
static __thread int64_t q_scratch_bytes;

static float *scratch_floats(size_t n) { return grown(&q_scratch, &q_scratch_bytes, (int64_t)(n * sizeof(float))); }

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
    int fp8, fail;
} q8_t;

/* 16 codes as float32: their 8 even then their 8 odd elements (exact), the order kw_bgemm splits bf16 weights in */
static inline void c8x16_split(const int8_t *p, int fp8, __m256 *even, __m256 *odd) {
    __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); /* lane j: element 2j | 2j+1 << 16 */
    *even = code8(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16), fp8);
    *odd = code8(_mm256_srai_epi32(v, 16), fp8);
}

/* M == 1: rows n .. n+nr-1 (nr <= 8), codes converted in registers; the sums of bgemm_rows_1 on the bf16 codes.
 * Inlined with constant nr (8, or as is) and fp8. */
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
    uint16_t *w = (uint16_t *)scratch_floats((size_t)(4 * g->K)); /* 8 bf16 rows */
    if (!w) {
        g->fail = 1; /* a benign race: every writer writes 1 */
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
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAXT) nthreads = MAXT;
    if (N < 32 * nthreads) nthreads = 1;
    q8_t g = {x, q, s, out, M, N, K, fp8 != 0, 0};
    run_pool(q8_slice, &g, nthreads);
    return g.fail ? -2 : 0;
}

typedef struct {
    const float *x;
    const uint8_t *q;
    const uint16_t *sz;
    const float *xs; /* [M, G] */
    uint16_t *out;
    int64_t M, N, K, gs, B;
    int fail;
} q4_t;

/* 8 codes: low nibbles (lo) and high nibbles (hi) of 8 bytes, as float32 */
static inline void q4_codes(const uint8_t *p, __m256 *lo, __m256 *hi) {
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
}

/* the codes of group g of block b into w [gs][B] as float32, rows in natural order */
static void q4_convert(const q4_t *a, int64_t b, int64_t g, float *w) {
    const int64_t H = a->B / 2;
    const uint8_t *src = a->q + (b * a->K + g * a->gs) * H;
    __m256 lo, hi;
    for (int64_t kk = 0; kk < a->gs; kk++, src += H, w += a->B)
        for (int64_t j = 0; j < H; j += 8) {
            q4_codes(src + j, &lo, &hi);
            _mm256_store_ps(w + j, lo);
            _mm256_store_ps(w + H + j, hi);
        }
}

/* fold a group's sums acc = sum x c (rows n .. n+7) into tot: tot = fma(s, acc, tot); tot = fma(z - 8 s, xs, tot) */
static inline void q4_fold(const q4_t *a, int64_t g, int64_t n, float xsum, __m256 acc, float *tot) {
    __m256i r = _mm256_loadu_si256((const __m256i *)(a->sz + (g * a->N + n) * 2)); /* 8 (scale, zero) pairs */
    __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
    __m256 z = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u)));
    __m256 t = _mm256_fmadd_ps(s, acc, _mm256_load_ps(tot));
    _mm256_store_ps(tot, _mm256_fmadd_ps(_mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, z), _mm256_set1_ps(xsum), t));
}

/* M == 1, B == 32: group g of block b with the codes converted in registers (the same sums as q4_over) */
static void q4_direct32(const q4_t *a, int64_t b, int64_t g, float *tot) {
    const uint8_t *src = a->q + (b * a->K + g * a->gs) * 16;
    const float *x0 = a->x + g * a->gs;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, l0, h0, l1, h1;
    for (int64_t kk = 0; kk < a->gs; kk++, src += 16) {
        __m256 e = _mm256_broadcast_ss(x0 + kk);
        q4_codes(src, &l0, &h0);
        q4_codes(src + 8, &l1, &h1);
        a0 = _mm256_fmadd_ps(l0, e, a0);  /* rows 0..7 */
        a1 = _mm256_fmadd_ps(l1, e, a1);  /* rows 8..15 */
        a2 = _mm256_fmadd_ps(h0, e, a2);  /* rows 16..23 */
        a3 = _mm256_fmadd_ps(h1, e, a3);  /* rows 24..31 */
    }
    int64_t n = b * 32;
    float xsum = a->xs[g];
    q4_fold(a, g, n, xsum, a0, tot);
    q4_fold(a, g, n + 8, xsum, a1, tot + 8);
    q4_fold(a, g, n + 16, xsum, a2, tot + 16);
    q4_fold(a, g, n + 24, xsum, a3, tot + 24);
}

/* rows m (and m + 1 when two) of x over group g's nv (<= 4) vectors of rows from vector v, folded into tot;
 * inlined with nv = 4 and as is, so the accumulators stay in registers */
static inline __attribute__((always_inline)) void q4_over(const q4_t *a, int64_t b, int64_t g, int64_t v, int nv,
                                                          const float *w, float *tot, int64_t m, int two) {
    const int64_t B = a->B, gs = a->gs, G = a->K / gs, K = a->K;
    const float *x0 = a->x + m * K + g * gs, *x1 = two ? x0 + K : x0;
    __m256 a0[4], a1[4];
    for (int i = 0; i < 4; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < gs; kk++) {
        __m256 e0 = _mm256_broadcast_ss(x0 + kk), e1 = _mm256_broadcast_ss(x1 + kk);
        const float *wk = w + kk * B + v * 8;
        for (int i = 0; i < nv; i++) {
            __m256 wv = _mm256_load_ps(wk + i * 8);
            a0[i] = _mm256_fmadd_ps(wv, e0, a0[i]);
            if (two) a1[i] = _mm256_fmadd_ps(wv, e1, a1[i]);
        }
    }
    for (int i = 0; i < nv; i++) {
        int64_t n = b * B + (v + i) * 8;
        q4_fold(a, g, n, a->xs[m * G + g], a0[i], tot + m * B + (v + i) * 8);
        if (two) q4_fold(a, g, n, a->xs[(m + 1) * G + g], a1[i], tot + (m + 1) * B + (v + i) * 8);
    }
}

/* one block of B rows (B <= 64: at most 8 vectors of rows), every row of x; tot: float32 [M][B] */
static void q4_block(const q4_t *a, int64_t b, float *w, float *tot) {
    const int64_t B = a->B, V = B / 8, G = a->K / a->gs;
    memset(tot, 0, (size_t)(a->M * B) * sizeof(float));
    if (a->M == 1 && B == 32) {
        for (int64_t g = 0; g < G; g++) q4_direct32(a, b, g, tot);
        for (int64_t r = 0; r < B; r++) a->out[b * B + r] = f32_to_bf16(tot[r]);
        return;
    }
    for (int64_t g = 0; g < G; g++) {
        q4_convert(a, b, g, w);
        for (int64_t v = 0; v < V; v += 4) { /* 4 vectors (32 rows) at a time: 8 accumulators for two rows of x */
            int nv = V - v < 4 ? (int)(V - v) : 4;
            int64_t m = 0;
            if (nv == 4) {
                for (; m + 2 <= a->M; m += 2) q4_over(a, b, g, v, 4, w, tot, m, 1);
                if (m < a->M) q4_over(a, b, g, v, 4, w, tot, m, 0);
            } else {
                for (; m + 2 <= a->M; m += 2) q4_over(a, b, g, v, nv, w, tot, m, 1);
                if (m < a->M) q4_over(a, b, g, v, nv, w, tot, m, 0);
            }
        }
    }
    for (int64_t m = 0; m < a->M; m++)
        for (int64_t r = 0; r < B; r++) a->out[m * a->N + b * B + r] = f32_to_bf16(tot[m * B + r]);
}

static void q4_slice(const void *arg, int t, int nthreads) {
    q4_t *a = (q4_t *)arg;
    int64_t blocks = a->N / a->B, per = (blocks + nthreads - 1) / nthreads;
    int64_t b0 = t * per, b1 = b0 + per < blocks ? b0 + per : blocks;
    if (b0 >= b1) return;
    float *w = scratch_floats((size_t)(a->gs * a->B + a->M * a->B));
    if (!w) {
        a->fail = 1;
        return;
    }
    for (int64_t b = b0; b < b1; b++) q4_block(a, b, w, w + a->gs * a->B);
}

/* 0, -1 on bad sizes, -2 when scratch could not be allocated. */
int kw_q4gemm(const float *x, const uint8_t *q, const uint16_t *sz, uint16_t *out, int64_t M, int64_t N, int64_t K,
              int64_t gs, int64_t B, int nthreads) {
    if (M < 1 || N < 1 || gs < 8 || gs % 8 || K % gs || B < 16 || B > 64 || B % 16 || N % B) return -1;
    int64_t G = K / gs;
    float *xs = malloc((size_t)(M * G) * sizeof(float));
    if (!xs) return -2;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + m * K + k));
            xs[m * G + g] = hadd1(acc);
        }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAXT) nthreads = MAXT;
    if (N < 32 * nthreads) nthreads = 1;
    q4_t a = {x, q, sz, xs, out, M, N, K, gs, B, 0};
    run_pool(q4_slice, &a, nthreads);
    free(xs);
    return a.fail ? -2 : 0;
}

#ifndef KW_ATTENTION_ONLY
/* ---- int4 on AMX: torch's CPU "halves" pack (blocks of B = 32 or 64 rows, k-major, byte j = rows j and
 * j + B/2) read in place. Here x is A (its bf16 rows as they lie), the codes are B: each pair of k rows of a
 * block becomes B tile rows of (16 + code k, 16 + code k+1) bf16 pairs per channel in an L1 scratch (exact), and
 * C = x w^T. Per group the tiles start from zero, and the group's sums enter the float32 total as
 * total = fma(scale, sum x (16 + c), total), then fma(zero - 24 scale, sum x, total): w = (c - 8) scale + zero.
 * One order per output whatever M. The 16 costs float32 headroom (sums of x (16 + c), not x c: ~3x the rounding
 * error of kw_q4gemm's x c, still far inside one bf16 rounding; tests/test_cpu_amx.py bounds it). */
typedef struct {
    const uint16_t *x; /* bf16 [Mp][K], zero rows beyond M */
    const uint8_t *q;
    const uint16_t *sz; /* bf16 [K / gs][N][2]: (scale, zero) */
    const float *xs;    /* [K / gs][Mp]: each row's sum over each group */
    uint16_t *out;
    int64_t M, Mp, N, K, gs, B;
    int fail;
} q4amx_t;

#define QKC 256 /* k per code scratch: 128 pairs x 64 channels x 4 bytes = 32 KiB */
#define VBMI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")))

/* vpermt2b's table: bytes 0..63 from the loaded codes, 64 = the constant 0x41. For 16 channels whose codes lie
 * at bytes o0 + i (k) and o1 + i (k + 1), i < 16: each dword = the two bf16 (low byte, 0x41), k first. */
static void q4_perm_index(int o0, int o1, uint8_t idx[64]) {
    for (int i = 0; i < 16; i++) {
        idx[4 * i] = (uint8_t)(o0 + i);
        idx[4 * i + 1] = 64;
        idx[4 * i + 2] = (uint8_t)(o1 + i);
        idx[4 * i + 3] = 64;
    }
}

/* s[k2][c] = (16 + code[k0 + 2 k2][c], 16 + code[k0 + 2 k2 + 1][c]) as bf16, c < B, for kc k of block b. 16 + c
 * is bf16 0x4180 | c << 3 (16..31, step 1: exact), so a byte permute builds each tile row from the codes with no
 * widening or conversion; the fold takes the 16 back out (q4_tiles_amx). One 64-byte load holds 2 (B = 64) or 4
 * (B = 32) consecutive k rows of the block. */
VBMI_TARGET static void q4_pack_amx(const q4amx_t *a, int64_t b, int64_t k0, int64_t kc, uint32_t *s) {
    const int64_t hb = a->B / 2, B = a->B;
    uint8_t i0[64], i1[64];
    q4_perm_index(0, B == 64 ? 32 : 16, i0);        /* B = 64: channels 0-15 (k, k+1); B = 32: the first pair */
    q4_perm_index(B == 64 ? 16 : 32, 48, i1);       /* B = 64: channels 16-31; B = 32: the second pair */
    const __m512i idx0 = _mm512_loadu_si512(i0), idx1 = _mm512_loadu_si512(i1);
    const __m512i c41 = _mm512_set1_epi8(0x41), m78 = _mm512_set1_epi8(0x78), m80 = _mm512_set1_epi8((char)0x80);
    const uint8_t *blk = a->q + b * a->K * hb;
    for (int64_t k = k0; k < k0 + kc; k += 128 / B) {
        __m512i v = _mm512_loadu_si512(blk + k * hb);
        /* per byte: (low nibble << 3) | 0x80 and (high nibble << 3) | 0x80 (ternary logic: (a & b) | c) */
        __m512i lo = _mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), m78, m80, 0xEA);
        __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), m78, m80, 0xEA);
        uint32_t *dst = s + (k - k0) / 2 * B;
        if (B == 64) { /* low nibbles: channels 0-31, high: 32-63 */
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi8(lo, idx0, c41));
            _mm512_storeu_si512(dst + 16, _mm512_permutex2var_epi8(lo, idx1, c41));
            _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi8(hi, idx0, c41));
            _mm512_storeu_si512(dst + 48, _mm512_permutex2var_epi8(hi, idx1, c41));
        } else { /* low nibbles: channels 0-15, high: 16-31; two k pairs */
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi8(lo, idx0, c41));
            _mm512_storeu_si512(dst + 16, _mm512_permutex2var_epi8(hi, idx0, c41));
            _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi8(lo, idx1, c41));
            _mm512_storeu_si512(dst + 48, _mm512_permutex2var_epi8(hi, idx1, c41));
        }
    }
}

/* tot[m][c] for x rows mb..mb+15 and block b's channels, over the groups of k0..k0+kc; cg: float [16][64] */
AMX_TARGET static void q4_tiles_amx(const q4amx_t *a, int64_t b, const uint32_t *s, int64_t k0, int64_t kc,
                                    int64_t mb, float *cg, float *tot) {
    const int64_t K = a->K, B = a->B, bs = B * 4;
    const uint16_t *x = a->x + mb * K;
    for (int64_t g0 = k0; g0 < k0 + kc; g0 += a->gs) {
        _tile_zero(0);
        _tile_zero(1);
        if (B == 64) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t k = g0; k < g0 + a->gs; k += 32) {
            const uint32_t *w = s + (k - k0) / 2 * B;
            _tile_loadd(4, x + k, K * 2);
            _tile_loadd(5, w, bs);
            _tile_loadd(6, w + 16, bs);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            if (B == 64) {
                _tile_loadd(7, w + 32, bs);
                _tile_loadd(5, w + 48, bs);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, cg, 256);
        _tile_stored(1, cg + 16, 256);
        if (B == 64) {
            _tile_stored(2, cg + 32, 256);
            _tile_stored(3, cg + 48, 256);
        }
        const int64_t g = g0 / a->gs;
        for (int64_t c = 0; c < B; c += 16) {
            __m512i r = _mm512_loadu_si512(a->sz + (g * a->N + b * B + c) * 2); /* 16 (scale, zero) pairs */
            __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
            __m512 z = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u)));
            /* the codes entered as 16 + c: c - 8 = (16 + c) - 24 */
            __m512 zf = _mm512_fnmadd_ps(_mm512_set1_ps(24.0f), sc, z);
            for (int64_t i = 0; i < 16; i++) {
                float *t = tot + (mb + i) * B + c;
                __m512 v = _mm512_fmadd_ps(sc, _mm512_loadu_ps(cg + i * 64 + c), _mm512_loadu_ps(t));
                _mm512_storeu_ps(t, _mm512_fmadd_ps(zf, _mm512_set1_ps(a->xs[g * a->Mp + mb + i]), v));
            }
        }
    }
}

/* Slice t's blocks of channels [*b0, *b1), this thread's code scratch and group sums (kept between calls) and a
 * float total of `rows` x B: 0; 1 when the slice is empty; -1 out of memory (the call then fails). */
static int q4_slice_start(const q4amx_t *a, int t, int nthreads, int64_t rows, int64_t *b0, int64_t *b1,
                          uint32_t **s, float **cg, float **tot) {
    static __thread uint32_t *sb;
    static __thread float *cb;
    int64_t blocks = a->N / a->B;
    *b0 = blocks * t / nthreads, *b1 = blocks * (t + 1) / nthreads;
    if (*b0 >= *b1) return 1;
    if (!sb) sb = aligned_alloc(64, QKC / 2 * 64 * 4);
    if (!cb) cb = aligned_alloc(64, 16 * 64 * 4); /* the tiles' [16][64]; the vector kernel uses [12][32] */
    *s = sb, *cg = cb, *tot = scratch_floats((size_t)(rows * a->B));
    return sb && cb && *tot ? 0 : -1;
}

AMX_TARGET static void q4amx_slice(const void *arg, int t, int nthreads) {
    q4amx_t *a = (q4amx_t *)arg;
    int64_t b0, b1;
    uint32_t *s;
    float *cg, *tot;
    int rc = q4_slice_start(a, t, nthreads, a->Mp, &b0, &b1, &s, &cg, &tot);
    if (rc > 0) return;
    if (rc < 0) {
        a->fail = 1;
        return;
    }
    tiles_on();
    for (int64_t b = b0; b < b1; b++) {
        memset(tot, 0, (size_t)(a->Mp * a->B) * 4);
        for (int64_t k0 = 0; k0 < a->K; k0 += QKC) {
            int64_t kc = a->K - k0 < QKC ? a->K - k0 : QKC;
            q4_pack_amx(a, b, k0, kc, s);
            for (int64_t mb = 0; mb < a->Mp; mb += 16) q4_tiles_amx(a, b, s, k0, kc, mb, cg, tot);
        }
        for (int64_t m = 0; m < a->M; m++)
            for (int64_t c = 0; c < a->B; c++) a->out[m * a->N + b * a->B + c] = f32_to_bf16(tot[m * a->B + c]);
    }
    _tile_release();
}

/* x rows padded to Mp (a multiple of 16) with zeros, and each row's sum over each group: per thread, kept. */
static int q4_prep(const uint16_t *x, int64_t M, int64_t K, int64_t gs, uint16_t **xpo, float **xso, int64_t *Mpo) {
    static __thread uint16_t *xp;
    static __thread float *xs;
    static __thread int64_t cap;
    const int64_t Mp = (M + 15) / 16 * 16, G = K / gs;
    if (cap < Mp * K) {
        free(xp);
        free(xs);
        xp = aligned_alloc(64, (size_t)(Mp * K * 2 + 63) / 64 * 64);
        xs = aligned_alloc(64, (size_t)(Mp * K / 32 * 4 + 63) / 64 * 64); /* G * Mp <= Mp * K / 32 */
        cap = xp && xs ? Mp * K : 0;
        if (!cap) return -2;
    }
    memcpy(xp, x, (size_t)(M * K * 2));
    memset(xp + M * K, 0, (size_t)((Mp - M) * K * 2));
    for (int64_t g = 0; g < G; g++)
        for (int64_t m = 0; m < Mp; m++) {
            float acc = 0.0f;
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
                uint32_t bits = (uint32_t)xp[m * K + k] << 16;
                float v;
                memcpy(&v, &bits, 4);
                acc += v;
            }
            xs[g * Mp + m] = acc;
        }
    *xpo = xp, *xso = xs, *Mpo = Mp;
    return 0;
}

static int q4_sizes_ok(int64_t M, int64_t N, int64_t K, int64_t gs, int64_t B) {
    return M >= 1 && K % 32 == 0 && gs >= 32 && gs % 32 == 0 && K % gs == 0 && (B == 32 || B == 64) && N >= B &&
           N % B == 0;
}

/* Both int4 entries: the sizes, x prepared (q4_prep), then `slice` over the blocks of channels. 0; -1 on sizes they
 * do not take (K and gs multiples of 32, B 32 or 64, N a multiple of B); -2 out of memory. */
static int q4_run(slice_fn slice, const uint16_t *x, const uint8_t *q, const uint16_t *sz, uint16_t *out, int64_t M,
                  int64_t N, int64_t K, int64_t gs, int64_t B, int nthreads) {
    if (!q4_sizes_ok(M, N, K, gs, B)) return -1;
    uint16_t *xp;
    float *xs;
    int64_t Mp;
    if (q4_prep(x, M, K, gs, &xp, &xs, &Mp)) return -2;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAXT) nthreads = MAXT;
    q4amx_t a = {xp, q, sz, xs, out, M, Mp, N, K, gs, B, 0};
    run_pool(slice, &a, nthreads);
    return a.fail ? -2 : 0;
}

/* out = x w^T for bf16 x [M, K] and an int4 weight in the halves pack (kw_q4gemm's), on the tiles (q4_run's
 * codes; -1 also without AMX). */
int kw_q4amx(const uint16_t *x, const uint8_t *q, const uint16_t *sz, uint16_t *out, int64_t M, int64_t N, int64_t K,
             int64_t gs, int64_t B, int nthreads) {
    if (!g_amx) return -1;
    int rc = q4_run(q4amx_slice, x, q, sz, out, M, N, K, gs, B, nthreads);
    if (rc == 0) atomic_fetch_add(&g_amx_calls, 1);
    return rc;
}

/* ---- int4 without the tiles (AVX512-BF16 + VBMI: Zen 4, Intel without AMX), M > 1: the same scratch of (16 + code)
 * bf16 pairs (q4_pack_amx), multiplied by kw_gemm's micro-kernels (MICRO: a broadcast pair of x by 32 channels'
 * pairs, vdpbf16ps) with the block's stride; a group's sums start from zero and fold into the float32 total as on
 * the tiles (q4v_fold), group by group in k order: one order per output whatever M, so a row's bits do not depend on
 * its batch. */

/* tot[m][c0 + c] += scale * cg[m][c] + (zero - 24 scale) * xs[g][m], rows mb..mb+R-1, channels c0..c0+31 of block b */
static void q4v_fold(const q4amx_t *a, int64_t b, int64_t g, int64_t mb, int R, int64_t c0, const float *cg,
                    float *tot) {
    for (int64_t c = 0; c < 32; c += 16) {
        __m512i r = _mm512_loadu_si512(a->sz + (g * a->N + b * a->B + c0 + c) * 2); /* 16 (scale, zero) pairs */
        __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
        __m512 z = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u)));
        __m512 zf = _mm512_fnmadd_ps(_mm512_set1_ps(24.0f), sc, z); /* the codes entered as 16 + c */
        for (int i = 0; i < R; i++) {
            float *t = tot + (mb + i) * a->B + c0 + c;
            __m512 v = _mm512_fmadd_ps(sc, _mm512_loadu_ps(cg + i * 32 + c), _mm512_loadu_ps(t));
            _mm512_storeu_ps(t, _mm512_fmadd_ps(zf, _mm512_set1_ps(a->xs[g * a->Mp + mb + i]), v));
        }
    }
}

static void q4vec_slice(const void *arg, int t, int nthreads) {
    q4amx_t *a = (q4amx_t *)arg;
    int64_t b0, b1;
    uint32_t *s;
    float *cg, *tot;
    int rc = q4_slice_start(a, t, nthreads, a->M, &b0, &b1, &s, &cg, &tot);
    if (rc > 0) return;
    if (rc < 0) {
        a->fail = 1;
        return;
    }
    const int64_t K = a->K, B = a->B, gs = a->gs, K2 = K / 2;
    static __thread void *panel_p;
    static __thread int64_t panel_cap;
    uint32_t *panel = grown(&panel_p, &panel_cap, a->M * K2 * 4);
    if (!panel) {
        a->fail = 1;
        return;
    }
    x_panel(a->x, a->M, K, panel);
    for (int64_t b = b0; b < b1; b++) {
        memset(tot, 0, (size_t)(a->M * B) * 4);
        for (int64_t k0 = 0; k0 < K; k0 += QKC) {
            int64_t kc = K - k0 < QKC ? K - k0 : QKC;
            q4_pack_amx(a, b, k0, kc, s);
            for (int64_t mb = 0; mb < a->M; mb += MB) {
                int R = (int)(a->M - mb < MB ? a->M - mb : MB);
                for (int64_t c0 = 0; c0 < B; c0 += 32)
                    for (int64_t g0 = k0; g0 < k0 + kc; g0 += gs) {
                        memset(cg, 0, (size_t)R * NT * 4); /* a group's sums start from zero */
                        MICROS[R](panel + mb * K2 + g0 / 2 * R, s + (g0 - k0) / 2 * B + c0, B, gs / 2, cg, NULL);
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
#endif /* KW_ATTENTION_ONLY */

/* ---- int8 per-row quantization of a bfloat16 weight, both builds --------------------------------------------------
 * keepwarm.formats.quant's int8 formula, bit for bit: scale = amax|w| / 127 in float32 (1 for an all-zero row),
 * stored as bfloat16 rounded to nearest even and one step up where that rounded down (so no code clips); code =
 * round-half-even(w / stored) in float32, clamped to +-127. The row's max is taken on the bits (|bf16| orders as
 * its low 15 bits), which also finds a NaN or an infinity: then -1 and q / scales are not to be used. One thread:
 * the daemon's preload runs several tensors at once. */
static inline float bf16f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int kw_quant_int8(const uint16_t *w, int64_t N, int64_t K, int8_t *q, uint16_t *scales) {
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *r = w + n * K;
        uint16_t hi = 0;
        for (int64_t k = 0; k < K; k++) {
            uint16_t a = r[k] & 0x7FFFu;
            hi = a > hi ? a : hi;
        }
        if (hi >= 0x7F80u) return -1;
        float amax = bf16f(hi);
        float s = amax > 0.0f ? amax / 127.0f : 1.0f;
        uint16_t sb = f32_to_bf16(s);
        if (bf16f(sb) < s) sb++;
        scales[n] = sb;
        const float d = bf16f(sb);
        int8_t *o = q + n * K;
        for (int64_t k = 0; k < K; k++) {
            float v = __builtin_rintf(bf16f(r[k]) / d);
            v = v < -127.0f ? -127.0f : v;
            v = v > 127.0f ? 127.0f : v;
            o[k] = (int8_t)v;
        }
    }
    return 0;
}
