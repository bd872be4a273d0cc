/* keepwarm native CPU kernels: weight-only int8 and fp8 matmuls for bfloat16 activations (AVX512-BF16).
 *
 *   out[m, n] = bf16( scale[n] * sum_k x[m, k] * w[n, k] )     x: bf16 [M, K], w: int8 [N, K], scale: f32 [N]
 *
 * With fp8 set, w holds float8_e4m3fn codes and enters the sum as its value / 256 (the caller's scale is 256x).
 *
 * Rules:
 * - The weight is only read (it may be a read-only mapping of the daemon's arena); nothing is copied up front.
 * - int8 -> bf16 is exact (|q| <= 128 fits bf16's 8-bit significand), so is e4m3 -> bf16 (3-bit mantissa); products are summed in float32 by
 *   vdpbf16ps, the scale is applied in float32 and the result rounded to bf16 once (round to nearest even), so
 *   the only difference from the reference (dequantize, matmul) is the order of the float32 sums.
 * - M == 1 streams each weight row once, converting it in registers (decode is memory-bound).
 *   M > 1 converts NB rows once into a per-thread bf16 scratch and multiplies it with every row of x from there.
 * - Threads: the N range is split over `nthreads` (the caller passes torch's intra-op count); T-1 pool threads
 *   park on a condition variable between calls after a short spin. Calls from several threads take turns (one
 *   owns the pool at a time). A fork()ed child starts with no pool.
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 4        /* output channels per inner block */
#define MAXT 64
#define SPIN 2000

typedef struct {
    const uint16_t *x;
    const int8_t *w;
    const float *scale;
    uint16_t *out;
    int64_t M, N, K;
    int fp8; /* w holds float8_e4m3fn codes, not int8 */
} job_t;

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even (no NaN reaches here from finite inputs) */
    return (uint16_t)(u >> 16);
}

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
#define KB2 256     /* k pairs per scratch tile: 32 KiB of bf16 pairs, L1-sized */
#define MB 12       /* x rows per micro-kernel call: 24 accumulators + 2 weights + 1 broadcast */

/* scratch[k2][c] = bf16 pair (w[n+c][2(k0+k2)], w[n+c][2(k0+k2)+1]) for c < nc, 0 beyond. */
static void pack_tile(const int8_t *w, int64_t K, int64_t n, int nc, int64_t k0, int64_t kb2, int fp8,
                      uint32_t *scratch) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32((int)K));
    for (int h = 0; h < 2; h++) {
        int rows = nc - 16 * h;
        __mmask16 live = rows >= 16 ? 0xFFFF : rows <= 0 ? 0 : (__mmask16)((1u << rows) - 1u);
        const int8_t *base = w + (n + 16 * h) * K;
        for (int64_t k2 = 0; k2 < kb2; k2++) {
            int64_t off = 2 * (k0 + k2);
            __m512i g;
            if (off + 4 <= K) {
                g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx, base + off, 1);
            } else { /* the last pair of a row: read the 4 bytes ending there, never past the row's end */
                g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx, base + off - 2, 1);
                g = _mm512_srli_epi32(g, 16);
            }
            __m256i pairs = _mm512_cvtepi32_epi16(g); /* 16 x (w[c][off], w[c][off+1]) as 32 bytes */
            _mm512_storeu_si512(scratch + k2 * NT + 16 * h, (__m512i)cvt_bytes(pairs, fp8));
        }
    }
}

#define MICRO(R)                                                                                              \
    static void micro_##R(const uint16_t *x, int64_t K, const uint32_t *scratch, int64_t kb2, float *acc_out) { \
        __m512 acc[R][2];                                                                                     \
        _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {                                               \
            acc[r][0] = _mm512_loadu_ps(acc_out + r * NT);                                                     \
            acc[r][1] = _mm512_loadu_ps(acc_out + r * NT + 16);                                                \
        }                                                                                                     \
        for (int64_t k2 = 0; k2 < kb2; k2++) {                                                                \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(scratch + k2 * NT);                                    \
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(scratch + k2 * NT + 16);                               \
            _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {                                           \
                int32_t pair;                                                                                 \
                memcpy(&pair, x + r * K + 2 * k2, 4);                                                         \
                __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                                              \
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);                                              \
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);                                              \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {                                               \
            _mm512_storeu_ps(acc_out + r * NT, acc[r][0]);                                                     \
            _mm512_storeu_ps(acc_out + r * NT + 16, acc[r][1]);                                                \
        }                                                                                                     \
    }
MICRO(1) MICRO(2) MICRO(3) MICRO(4) MICRO(5) MICRO(6) MICRO(7) MICRO(8) MICRO(9) MICRO(10) MICRO(11) MICRO(12)
typedef void (*micro_fn)(const uint16_t *, int64_t, const uint32_t *, int64_t, float *);
static const micro_fn MICROS[MB + 1] = {NULL,     micro_1,  micro_2, micro_3, micro_4,  micro_5, micro_6,
                                        micro_7,  micro_8,  micro_9, micro_10, micro_11, micro_12};

/* M > 1 needs K even (pairs); the caller routes odd K to the M == 1 path row by row. */
static void gemm_rows(const job_t *j, int64_t n0, int64_t n1) {
    static __thread uint32_t *scratch;
    static __thread float *acc;
    static __thread int64_t acc_cap;
    const int64_t K = j->K, M = j->M, N = j->N, K2 = K / 2;
    if (!scratch) scratch = aligned_alloc(64, KB2 * NT * 4);
    if (acc_cap < M) {
        free(acc);
        acc = aligned_alloc(64, (size_t)M * NT * 4);
        acc_cap = acc ? M : 0;
    }
    if (!scratch || !acc) { /* no memory for the tiles: the same product row by row */
        for (int64_t m = 0; m < M; m++) {
            job_t row = {j->x + m * K, j->w, j->scale, j->out + m * N, 1, N, K, j->fp8};
            gemv_rows(&row, n0, n1);
        }
        return;
    }
    for (int64_t n = n0; n < n1; n += NT) {
        int nc = (int)(n1 - n < NT ? n1 - n : NT);
        memset(acc, 0, (size_t)M * NT * 4);
        for (int64_t k0 = 0; k0 < K2; k0 += KB2) {
            int64_t kb2 = K2 - k0 < KB2 ? K2 - k0 : KB2;
            pack_tile(j->w, K, n, nc, k0, kb2, j->fp8, scratch);
            for (int64_t m = 0; m < M; m += MB) {
                int r = (int)(M - m < MB ? M - m : MB);
                MICROS[r](j->x + m * K + 2 * k0, K, scratch, kb2, acc + m * NT);
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int c = 0; c < nc; c++) j->out[m * N + n + c] = f32_to_bf16(acc[m * NT + c] * j->scale[n + c]);
    }
}

static void run_slice(const job_t *j, int t, int nthreads) {
    /* slices aligned to whole blocks (NB rows, or NT-channel tiles) so only the last slice has a partial one */
    const int64_t align = j->M == 1 ? NB : NT;
    int64_t blocks = (j->N + align - 1) / align;
    int64_t b0 = blocks * t / nthreads, b1 = blocks * (t + 1) / nthreads;
    int64_t n0 = b0 * align, n1 = b1 * align < j->N ? b1 * align : j->N;
    if (n0 >= n1) return;
    if (j->M > 1 && j->K % 2 == 0 && j->K >= 4) {
        gemm_rows(j, n0, n1);
        return;
    }
    for (int64_t m = 0; m < j->M; m++) { /* M == 1, or odd K: row by row */
        job_t row = {j->x + m * j->K, j->w, j->scale, j->out + m * j->N, 1, j->N, j->K, j->fp8};
        gemv_rows(&row, n0, n1);
    }
}

/* ------------------------------------------------------------------ thread pool */
static pthread_mutex_t g_call = PTHREAD_MUTEX_INITIALIZER; /* one call at a time owns the pool */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static job_t g_job;
static atomic_int g_gen, g_done, g_nactive;
static int g_pool; /* pool threads started (T-1) */
static int g_born[MAXT]; /* the generation each pool thread was started at: its first job is the next one */
static int g_atfork;

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
        if (t < n) run_slice(&g_job, t, n);
        atomic_fetch_add_explicit(&g_done, 1, memory_order_release);
    }
    return NULL;
}

static void child_after_fork(void) {
    /* a forked child inherits none of the pool's threads: start afresh */
    g_pool = 0;
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

/* Returns 0 on success, -1 on bad arguments. Without pool threads it runs on the calling thread alone. */
int kw_gemm(const uint16_t *x, const int8_t *w, const float *scale, uint16_t *out, int64_t M, int64_t N,
            int64_t K, int fp8, int nthreads) {
    if (M < 1 || N < 1 || K < 1) return -1;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAXT) nthreads = MAXT;
    if (N < 4 * NB * nthreads) nthreads = 1; /* tiny outputs: not worth a wake-up */
    job_t j = {x, w, scale, out, M, N, K, fp8 != 0};
    if (nthreads == 1) {
        run_slice(&j, 0, 1);
        return 0;
    }
    pthread_mutex_lock(&g_call);
    if (!ensure_pool(nthreads - 1)) {
        pthread_mutex_unlock(&g_call);
        run_slice(&j, 0, 1);
        return 0;
    }
    g_job = j;
    atomic_store(&g_nactive, nthreads);
    atomic_store(&g_done, 0);
    pthread_mutex_lock(&g_mu);
    atomic_fetch_add_explicit(&g_gen, 1, memory_order_release);
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
    run_slice(&j, 0, nthreads);
    while (atomic_load_explicit(&g_done, memory_order_acquire) < g_pool) _mm_pause();
    pthread_mutex_unlock(&g_call);
    return 0;
}
