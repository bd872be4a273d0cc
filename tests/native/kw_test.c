/* keepwarm's C kernels (kernels/csrc/) on their own, for the sanitizer builds (tests/native/sanitize.py runs it
 * linked against ASan+UBSan and TSan objects, and against the plain -O3 -Werror ones):
 * - the thread pool: every slice of every call runs exactly once, with calls from several threads at once, on
 *   torch-free OpenMP and (unless --tsan: libgomp is not instrumented) across fork();
 * - the scratch helper: grows, keeps, 64-byte aligned;
 * - each GEMM family against a scalar float64 reference (within one bf16 rounding plus float32 summation error),
 *   and its bits unchanged by the thread count; the AVX512-BF16 / VBMI / AMX kernels where the build has them and
 *   the CPU runs them;
 * - the decode attention against a scalar reference, and a plan reading outside the cache refused;
 * - the glue (RMSNorm, rotary, KV store) and the int8 quantization against scalar references;
 * - the int8-group kernels on 4-bit codes (int8_group_u4): the int8 codes' bits;
 * - the native decode step (step.c): two layers of int8-group and bf16 weights equal, bit for bit, the same entry
 *   points called one by one, at 1 and 2 threads; a weight of no known kind refused with its layer and op.
 * Exits 1 on the first mismatch (with what and where), 0 when everything matched.
 */
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <immintrin.h>

#include "kw.h"

static int g_tsan;
static atomic_int g_checks; /* counted from the pool test's caller threads too */

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kw_test: FAIL: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

#define CHECK(cond, ...)                 \
    do {                                 \
        atomic_fetch_add(&g_checks, 1);  \
        if (!(cond)) fail(__VA_ARGS__);  \
    } while (0)

/* ---- data ---- */
static uint64_t g_rng = 88172645463325252ull;
static uint32_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 11);
}
static float unif(void) { return (float)(rnd() % 2000001) / 1000000.0f - 1.0f; } /* [-1, 1] */
static uint16_t bfr(float scale) { return f32_to_bf16(unif() * scale); }

static void *xalloc(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) fail("out of memory");
    memset(p, 0, bytes);
    return p;
}

/* float8_e4m3fn code -> its value (NaN codes are never made here) */
static double e4m3(uint8_t c) {
    int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
    return s ? -v : v;
}
static uint8_t fp8_code(void) {
    uint8_t c;
    do c = (uint8_t)rnd(); while ((c & 0x7F) == 0x7F);
    return c;
}

/* got (bf16) within one bf16 rounding of want plus float32 summation error relative to mag = sum |terms| */
static void close_bf16(const char *what, uint16_t got, double want, double mag, int64_t i) {
    double g = bf16f(got), err = fabs(g - want);
    CHECK(err <= fabs(want) * 0x1p-8 + 1e-5 * mag + 1e-30, "%s[%ld]: got %.9g, want %.9g (sum |terms| %.3g)", what,
          (long)i, g, want, mag);
}

static void same_bits(const char *what, const uint16_t *a, const uint16_t *b, int64_t n) {
    for (int64_t i = 0; i < n; i++) CHECK(a[i] == b[i], "%s: element %ld differs between thread counts", what, (long)i);
}

static int cpu_has(const char *flag) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[8192];
    int found = 0;
    size_t n = strlen(flag);
    while (f && !found && fgets(line, sizeof line, f)) {
        if (strncmp(line, "flags", 5)) continue;
        for (char *p = strstr(line, flag); p && !found; p = strstr(p + 1, flag))
            found = (p[-1] == ' ' || p[-1] == '\t') && (p[n] == ' ' || p[n] == '\n');
        break;
    }
    if (f) fclose(f);
    return found;
}

/* ---- the pool ---- */
typedef struct {
    atomic_int hits[MAXT];
    atomic_int bad;
} pool_job;

static void count_slice(const void *arg, int t, int n) {
    pool_job *j = (pool_job *)arg;
    if (t < 0 || t >= n || n > MAXT) atomic_store(&j->bad, 1);
    else atomic_fetch_add(&j->hits[t], 1);
}

static int g_openmp_now;

static void pool_once(int nthreads) {
    pool_job j;
    memset(&j, 0, sizeof j);
    kw_run(count_slice, &j, nthreads);
    CHECK(!atomic_load(&j.bad), "pool: a slice index out of range");
    for (int t = 0; t < MAXT; t++) {
        int want = t < nthreads ? 1 : 0, got = atomic_load(&j.hits[t]);
        /* an OpenMP team may be smaller than asked: slices past it never run (the kernels split by the team's
         * size), but none runs twice */
        CHECK(got == want || (g_openmp_now && want && !got && t > 0), "pool: slice %d of %d ran %d times", t,
              nthreads, got);
    }
}

static void *pool_caller(void *arg) {
    (void)arg;
    for (int i = 0; i < 200; i++) pool_once(1 + i % 4);
    return NULL;
}

static void test_pool(int openmp) {
    kw_use_openmp(openmp);
    g_openmp_now = openmp;
    for (int n = 1; n <= 8; n++)
        for (int i = 0; i < 50; i++) pool_once(n);
    pthread_t th[3];
    for (int i = 0; i < 3; i++) pthread_create(&th[i], NULL, pool_caller, NULL);
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    kw_use_openmp(0);
    g_openmp_now = 0;
}

static void test_fork(void) {
    pool_once(3); /* the pool's threads exist */
    pid_t pid = fork();
    if (pid == 0) { /* the child has none of them: it must start its own, not wait for the parent's forever */
        pool_once(3);
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "pool: the forked child failed (status %d)", status);
}

static void test_scratch(void) {
    static kw_buf b;
    char *p = kw_scratch(&b, 100);
    CHECK(p && ((uintptr_t)p % 64) == 0 && b.cap == 100, "scratch: 100 bytes, 64-byte aligned");
    memset(p, 1, 100);
    CHECK(kw_scratch(&b, 80) == p, "scratch: a smaller ask keeps the buffer");
    p = kw_scratch(&b, 5000);
    CHECK(p && ((uintptr_t)p % 64) == 0 && b.cap == 5000, "scratch: grown to 5000 bytes");
    memset(p, 2, 5000);
}

/* ---- AVX2 matmuls ---- */
static float *split_x(const uint16_t *x, int64_t M, int64_t K) { /* kw_bgemm's x: each 16 as 8 even, 8 odd */
    float *xs = xalloc((size_t)(M * K) * 4);
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 16)
            for (int i = 0; i < 8; i++) {
                xs[m * K + k + i] = bf16f(x[m * K + k + 2 * i]);
                xs[m * K + k + 8 + i] = bf16f(x[m * K + k + 2 * i + 1]);
            }
    return xs;
}

/* sum_k x[k] w[k] in double, and sum |x w| (close_bf16's magnitude): bf16 rows of K */
static double dot_bf16(const uint16_t *x, const uint16_t *w, int64_t K, double *mag) {
    double s = 0, m = 0;
    for (int64_t k = 0; k < K; k++) {
        double t = (double)bf16f(x[k]) * bf16f(w[k]);
        s += t, m += fabs(t);
    }
    *mag = m;
    return s;
}

static void test_bgemm(int64_t M, int64_t N, int64_t K) {
    uint16_t *x = xalloc((size_t)(M * K) * 2), *w = xalloc((size_t)(N * K) * 2);
    uint16_t *o1 = xalloc((size_t)(M * N) * 2), *o3 = xalloc((size_t)(M * N) * 2);
    for (int64_t i = 0; i < M * K; i++) x[i] = bfr(2.0f);
    for (int64_t i = 0; i < N * K; i++) w[i] = bfr(0.5f);
    float *xs = split_x(x, M, K);
    CHECK(kw_bgemm(xs, w, o1, M, N, K, 1) == 0 && kw_bgemm(xs, w, o3, M, N, K, 3) == 0, "bgemm refused");
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double mag, s = dot_bf16(x + m * K, w + n * K, K, &mag);
            close_bf16("bgemm", o1[m * N + n], s, mag, m * N + n);
        }
    same_bits("bgemm", o1, o3, M * N);
    CHECK(kw_bgemm(xs, w, o1, M, N, 8, 1) == -1, "bgemm took K = 8");
    free(x), free(w), free(o1), free(o3), free(xs);
}

static void test_q8gemm(int64_t M, int64_t N, int64_t K, int fp8) {
    uint16_t *x = xalloc((size_t)(M * K) * 2), *o1 = xalloc((size_t)(M * N) * 2), *o2 = xalloc((size_t)(M * N) * 2);
    int8_t *q = xalloc((size_t)(N * K));
    float *s = xalloc((size_t)N * 4);
    for (int64_t i = 0; i < M * K; i++) x[i] = bfr(1.0f);
    for (int64_t i = 0; i < N * K; i++) q[i] = fp8 ? (int8_t)fp8_code() : (int8_t)(rnd() % 256 - 128);
    for (int64_t n = 0; n < N; n++) s[n] = 0.001f + (float)(rnd() % 1000) * 1e-5f;
    float *xs = split_x(x, M, K);
    CHECK(kw_q8gemm(xs, q, s, o1, M, N, K, fp8, 1) == 0 && kw_q8gemm(xs, q, s, o2, M, N, K, fp8, 2) == 0,
          "q8gemm refused");
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double sum = 0, mag = 0;
            for (int64_t k = 0; k < K; k++) {
                double c = fp8 ? e4m3((uint8_t)q[n * K + k]) : q[n * K + k];
                double t = bf16f(x[m * K + k]) * c * s[n];
                sum += t, mag += fabs(t);
            }
            close_bf16(fp8 ? "q8gemm fp8" : "q8gemm int8", o1[m * N + n], sum, mag, m * N + n);
        }
    same_bits("q8gemm", o1, o2, M * N);
    free(x), free(o1), free(o2), free(q), free(s), free(xs);
}

/* an int4 weight in torch's CPU "halves" pack of B rows, with bf16 (scale, zero) per group; w64: float64 [N][K] */
typedef struct {
    uint8_t *q;
    uint16_t *sz;
    double *w;
} q4w;

static q4w make_q4(int64_t N, int64_t K, int64_t gs, int64_t B) {
    q4w r = {xalloc((size_t)(N * K / 2)), xalloc((size_t)(K / gs * N * 2) * 2), xalloc((size_t)(N * K) * 8)};
    const int64_t H = B / 2;
    for (int64_t g = 0; g < K / gs; g++)
        for (int64_t n = 0; n < N; n++) {
            r.sz[(g * N + n) * 2] = f32_to_bf16(0.0001f + (float)(rnd() % 100) * 0.0002f);
            r.sz[(g * N + n) * 2 + 1] = bfr(0.01f);
        }
    for (int64_t b = 0; b < N / B; b++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < H; j++) {
                uint8_t lo = (uint8_t)(rnd() % 16), hi = (uint8_t)(rnd() % 16);
                r.q[(b * K + k) * H + j] = (uint8_t)(lo | hi << 4);
                int64_t g = k / gs, n0 = b * B + j, n1 = n0 + H;
                r.w[n0 * K + k] = (lo - 8.0) * bf16f(r.sz[(g * N + n0) * 2]) + bf16f(r.sz[(g * N + n0) * 2 + 1]);
                r.w[n1 * K + k] = (hi - 8.0) * bf16f(r.sz[(g * N + n1) * 2]) + bf16f(r.sz[(g * N + n1) * 2 + 1]);
            }
    return r;
}

typedef int (*q4_entry)(const uint16_t *, const uint8_t *, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int);

/* entry NULL: kw_q4gemm (float32 x); else a paired kernel (bf16 x) */
static void test_q4(const char *what, q4_entry entry, int64_t M, int64_t N, int64_t K, int64_t gs, int64_t B) {
    q4w w = make_q4(N, K, gs, B);
    uint16_t *x = xalloc((size_t)(M * K) * 2), *o1 = xalloc((size_t)(M * N) * 2), *o2 = xalloc((size_t)(M * N) * 2);
    float *xf = xalloc((size_t)(M * K) * 4);
    for (int64_t i = 0; i < M * K; i++) x[i] = bfr(1.0f), xf[i] = bf16f(x[i]);
    int rc1 = entry ? entry(x, w.q, w.sz, o1, M, N, K, gs, B, 1) : kw_q4gemm(xf, w.q, w.sz, o1, M, N, K, gs, B, 1);
    int rc2 = entry ? entry(x, w.q, w.sz, o2, M, N, K, gs, B, 3) : kw_q4gemm(xf, w.q, w.sz, o2, M, N, K, gs, B, 3);
    CHECK(rc1 == 0 && rc2 == 0, "%s refused M=%ld N=%ld K=%ld gs=%ld B=%ld", what, (long)M, (long)N, (long)K,
          (long)gs, (long)B);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double s = 0, mag = 0;
            for (int64_t k = 0; k < K; k++) {
                double t = xf[m * K + k] * w.w[n * K + k];
                s += t, mag += fabs(t) + fabs(xf[m * K + k]) * 24 * fabs(bf16f(w.sz[((k / gs) * N + n) * 2]));
            }
            close_bf16(what, o1[m * N + n], s, mag, m * N + n);
        }
    same_bits(what, o1, o2, M * N);
    free(w.q), free(w.sz), free(w.w), free(x), free(o1), free(o2), free(xf);
}

/* ---- AVX512-BF16 matmuls (the avx512 build) ---- */
#ifdef KW_TEST_AVX512
static void test_gemm(int64_t M, int64_t N, int64_t K, int fp8) {
    uint16_t *x = xalloc((size_t)(M * K) * 2), *o1 = xalloc((size_t)(M * N) * 2), *o2 = xalloc((size_t)(M * N) * 2);
    int8_t *q = xalloc((size_t)(N * K));
    float *s = xalloc((size_t)N * 4);
    for (int64_t i = 0; i < M * K; i++) x[i] = bfr(1.0f);
    for (int64_t i = 0; i < N * K; i++) q[i] = fp8 ? (int8_t)fp8_code() : (int8_t)(rnd() % 256 - 128);
    for (int64_t n = 0; n < N; n++) s[n] = (0.001f + (float)(rnd() % 1000) * 1e-5f) * (fp8 ? 256.0f : 1.0f);
    CHECK(kw_gemm(x, q, s, o1, M, N, K, fp8, 1) == 0 && kw_gemm(x, q, s, o2, M, N, K, fp8, 2) == 0, "gemm refused");
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double sum = 0, mag = 0;
            for (int64_t k = 0; k < K; k++) {
                double c = fp8 ? e4m3((uint8_t)q[n * K + k]) / 256.0 : q[n * K + k];
                double t = bf16f(x[m * K + k]) * c * s[n];
                sum += t, mag += fabs(t);
            }
            close_bf16(fp8 ? "gemm fp8" : "gemm int8", o1[m * N + n], sum, mag, m * N + n);
        }
    same_bits("gemm", o1, o2, M * N);
    uint16_t *codes = xalloc((size_t)(N * K) * 2);
    CHECK(kw_codes_bf16(q, codes, N, K, fp8, 2) == 0, "codes_bf16 refused");
    for (int64_t i = 0; i < N * K; i++) {
        double c = fp8 ? e4m3((uint8_t)q[i]) / 256.0 : q[i];
        CHECK(bf16f(codes[i]) == c, "codes_bf16[%ld]: %g, want %g", (long)i, bf16f(codes[i]), c);
    }
    free(x), free(o1), free(o2), free(q), free(s), free(codes);
}

static void test_bgemv512(int64_t N, int64_t K) { /* 1-4 rows: each row alone equals its batch's row */
    uint16_t *x = xalloc((size_t)(4 * K) * 2), *w = xalloc((size_t)(N * K) * 2);
    uint16_t *o4 = xalloc((size_t)(4 * N) * 2), *o1 = xalloc((size_t)(4 * N) * 2);
    for (int64_t i = 0; i < 4 * K; i++) x[i] = bfr(2.0f);
    for (int64_t i = 0; i < N * K; i++) w[i] = bfr(0.5f);
    for (int64_t M = 1; M <= 4; M++) {
        CHECK(kw_bgemv512(x, w, o4, M, N, K, 2) == 0, "bgemv512 refused M=%ld", (long)M);
        for (int64_t m = 0; m < M; m++) {
            CHECK(kw_bgemv512(x + m * K, w, o1 + m * N, 1, N, K, 1) == 0, "bgemv512 refused one row");
            for (int64_t n = 0; n < N; n++) {
                double mag, s = dot_bf16(x + m * K, w + n * K, K, &mag);
                close_bf16("bgemv512", o4[m * N + n], s, mag, m * N + n);
            }
        }
        same_bits("bgemv512", o4, o1, M * N);
    }
    CHECK(kw_bgemv512(x, w, o4, 5, N, K, 1) == -1 && kw_bgemv512(x, w, o4, 1, N, 48, 1) == -1,
          "bgemv512 took 5 rows or K = 48");
    free(x), free(w), free(o4), free(o1);
}

static void test_avx512(void) {
    test_bgemv512(1, 32);
    test_bgemv512(13, 64);
    test_bgemv512(200, 576); /* 8-row and 4-row blocks, tails, two threads' 32-output chunks */
    static const int64_t shapes[][3] = {{1, 37, 45}, {1, 256, 64}, {3, 40, 2}, {2, 33, 66}, {13, 40, 130},
                                        {29, 70, 1001}, {40, 64, 512}, {5, 100, 1152}};
    for (int amx = 0; amx < 2; amx++) {
        if (amx && !(cpu_has("amx_tile") && cpu_has("amx_bf16") && cpu_has("avx512vbmi") && kw_amx_enable(1) == 0)) {
            printf("kw_test: AMX tiles not here: the tile paths untested\n");
            break;
        }
        long before = kw_amx_calls();
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
            for (int fp8 = 0; fp8 < 2; fp8++) test_gemm(shapes[i][0], shapes[i][1], shapes[i][2], fp8);
        if (amx) CHECK(kw_amx_calls() > before, "AMX on, yet no call took the tiles");
        if (cpu_has("avx512vbmi")) {
            q4_entry entry = amx ? kw_q4amx : kw_q4vec;
            const char *what = amx ? "q4amx" : "q4vec";
            test_q4(what, entry, 2, 64, 64, 32, 32);
            test_q4(what, entry, 17, 128, 256, 64, 64);
            test_q4(what, entry, 33, 96, 544, 32, 32);
            CHECK(entry(NULL, NULL, NULL, NULL, 2, 64, 48, 16, 32, 1) == -1, "%s took K = 48", what);
        }
    }
    kw_amx_enable(0);
}
#endif

/* ---- attention ---- */
static void test_attention(int f32, float softcap, int window) {
    const int64_t S = 3, Hq = 6, Hk = 2, D = 32, bs = 8, nb = 24, W = 6, G = Hq / Hk;
    uint16_t *kc = xalloc((size_t)(Hk * nb * bs * D) * 2), *vc = xalloc((size_t)(Hk * nb * bs * D) * 2);
    uint16_t *q = xalloc((size_t)(S * Hq * D) * 2), *out = xalloc((size_t)(S * Hq * D) * 2);
    uint16_t *out2 = xalloc((size_t)(S * Hq * D) * 2);
    for (int64_t i = 0; i < Hk * nb * bs * D; i++) kc[i] = bfr(1.0f), vc[i] = bfr(1.0f);
    for (int64_t i = 0; i < S * Hq * D; i++) q[i] = bfr(1.0f);
    int64_t plan[3 + 3 * 3 + 3 * 6], ctx[3] = {1, 20, 48};
    plan[0] = S, plan[1] = W, plan[2] = f32;
    for (int64_t s = 0; s < S; s++) {
        plan[3 + s] = ctx[s];
        plan[3 + S + s] = window && ctx[s] > window ? ctx[s] - window : 0;
        plan[3 + 2 * S + s] = 0;
        for (int64_t c = 0; c < W; c++) plan[3 + 3 * S + s * W + c] = (s * 7 + c * 5) % nb; /* shuffled blocks */
    }
    CHECK(kw_decode_attention(q, Hq * D, kc, vc, out, plan, S, Hq, Hk, D, nb, bs, 0.2f, softcap, 1) == 0 &&
              kw_decode_attention(q, Hq * D, kc, vc, out2, plan, S, Hq, Hk, D, nb, bs, 0.2f, softcap, 3) == 0,
          "attention refused");
    same_bits("attention", out, out2, S * Hq * D);
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = 0; h < Hq; h++) {
            int64_t lo = plan[3 + S + s], L = ctx[s] - lo;
            double *p = xalloc((size_t)L * 8), mx = -INFINITY, sum = 0;
            for (int64_t i = 0; i < L; i++) {
                int64_t pos = lo + i, row = (h / G * nb + plan[3 + 3 * S + s * W + pos / bs]) * bs + pos % bs;
                float dot = 0; /* float32, as the kernel: its order differs, so compare loosely */
                for (int64_t d = 0; d < D; d++) dot += bf16f(q[(s * Hq + h) * D + d]) * bf16f(kc[row * D + d]);
                double sc = (f32 ? dot : bf16f(f32_to_bf16(dot))) * 0.2;
                p[i] = softcap != 0.0f ? tanh(sc / softcap) * softcap : sc;
                mx = p[i] > mx ? p[i] : mx;
            }
            for (int64_t i = 0; i < L; i++) p[i] = exp(p[i] - mx), sum += p[i];
            for (int64_t d = 0; d < D; d++) {
                double o = 0;
                for (int64_t i = 0; i < L; i++) {
                    int64_t pos = lo + i, row = (h / G * nb + plan[3 + 3 * S + s * W + pos / bs]) * bs + pos % bs;
                    o += p[i] / sum * bf16f(vc[row * D + d]);
                }
                double got = bf16f(out[(s * Hq + h) * D + d]);
                CHECK(fabs(got - o) <= (f32 ? 0.01 : 0.03) + fabs(o) * 0x1p-7, "attention s%ld h%ld d%ld: %g, want %g",
                      (long)s, (long)h, (long)d, got, o);
            }
            free(p);
        }
    plan[3 + 3 * S + 2 * W + 5] = nb; /* a block id past the cache: refused before any read */
    CHECK(kw_decode_attention(q, Hq * D, kc, vc, out, plan, S, Hq, Hk, D, nb, bs, 0.2f, softcap, 1) == -1,
          "attention took a block id past the cache");
    free(kc), free(vc), free(q), free(out), free(out2);
}

/* ---- glue and quantization ---- */
static void test_rms_norm(int64_t T, int64_t H, int residual) {
    uint16_t *x = xalloc((size_t)(T * H) * 2), *r = xalloc((size_t)(T * H) * 2), *w = xalloc((size_t)H * 2);
    uint16_t *out = xalloc((size_t)(T * H) * 2), *nr = xalloc((size_t)(T * H) * 2);
    for (int64_t i = 0; i < T * H; i++) x[i] = bfr(3.0f), r[i] = bfr(1.0f);
    for (int64_t i = 0; i < H; i++) w[i] = bfr(2.0f);
    CHECK(kw_rms_norm(x, H, residual ? r : NULL, H, w, out, residual ? nr : NULL, T, H, 1e-5f) == 0, "rms refused");
    for (int64_t t = 0; t < T; t++) {
        double ss = 0;
        for (int64_t i = 0; i < H; i++) {
            double v = bf16f(x[t * H + i]);
            if (residual) {
                uint16_t sum = f32_to_bf16(bf16f(x[t * H + i]) + bf16f(r[t * H + i]));
                CHECK(nr[t * H + i] == sum, "rms residual[%ld]", (long)(t * H + i));
                v = bf16f(sum);
            }
            ss += v * v;
        }
        double inv = 1.0 / sqrt(ss / H + 1e-5);
        for (int64_t i = 0; i < H; i++) {
            double v = residual ? bf16f(nr[t * H + i]) : bf16f(x[t * H + i]);
            double want = v * inv * bf16f(w[i]), got = bf16f(out[t * H + i]);
            /* two bf16 roundings (y, then y * w) and the float32 sum's order */
            CHECK(fabs(got - want) <= fabs(want) * 0x1p-6 + 1e-30, "rms_norm[%ld]: %g, want %g", (long)(t * H + i),
                  got, want);
        }
    }
    CHECK(kw_rms_norm(x, H, NULL, 0, w, out, NULL, T, 12, 1e-5f) == -1, "rms took H = 12");
    free(x), free(r), free(w), free(out), free(nr);
}

static void test_rotary(void) {
    const int64_t T = 3, Hq = 4, Hk = 2, D = 32, half = D / 2;
    uint16_t *q = xalloc((size_t)(T * Hq * D) * 2), *k = xalloc((size_t)(T * Hk * D) * 2);
    uint16_t *qo = xalloc((size_t)(T * Hq * D) * 2), *ko = xalloc((size_t)(T * Hk * D) * 2);
    float *cs = xalloc((size_t)(T * half) * 4), *sn = xalloc((size_t)(T * half) * 4);
    for (int64_t i = 0; i < T * Hq * D; i++) q[i] = bfr(2.0f);
    for (int64_t i = 0; i < T * Hk * D; i++) k[i] = bfr(2.0f);
    for (int64_t i = 0; i < T * half; i++) cs[i] = cosf((float)i * 0.37f), sn[i] = sinf((float)i * 0.37f);
    CHECK(kw_rotary_neox(q, Hq * D, k, Hk * D, cs, sn, half, qo, ko, T, Hq, Hk, D) == 0, "rotary refused");
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hq + Hk; h++) {
            const uint16_t *src = h < Hq ? q + (t * Hq + h) * D : k + (t * Hk + h - Hq) * D;
            const uint16_t *dst = h < Hq ? qo + (t * Hq + h) * D : ko + (t * Hk + h - Hq) * D;
            for (int64_t i = 0; i < half; i++) { /* each product rounded to float32, then the sum (no fma) */
                volatile float a = bf16f(src[i]) * cs[t * half + i], b = bf16f(src[half + i]) * sn[t * half + i];
                volatile float c = bf16f(src[half + i]) * cs[t * half + i], d = bf16f(src[i]) * sn[t * half + i];
                CHECK(dst[i] == f32_to_bf16(a - b) && dst[half + i] == f32_to_bf16(c + d), "rotary t%ld h%ld i%ld",
                      (long)t, (long)h, (long)i);
            }
        }
    free(q), free(k), free(qo), free(ko), free(cs), free(sn);
}

static void test_store_kv(void) {
    const int64_t T = 5, Hk = 2, D = 16, nb = 4, bs = 4, total = nb * bs;
    uint16_t *k = xalloc((size_t)(T * Hk * D) * 2), *v = xalloc((size_t)(T * Hk * D) * 2);
    uint16_t *kc = xalloc((size_t)(Hk * total * D) * 2), *vc = xalloc((size_t)(Hk * total * D) * 2);
    for (int64_t i = 0; i < T * Hk * D; i++) k[i] = bfr(1.0f), v[i] = bfr(1.0f);
    int64_t slots[5] = {3, -1, 15, 0, 9};
    CHECK(kw_store_kv(k, Hk * D, v, Hk * D, kc, vc, slots, T, Hk, D, nb, bs) == 0, "store_kv refused");
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hk && slots[t] >= 0; h++)
            CHECK(!memcmp(kc + (h * total + slots[t]) * D, k + (t * Hk + h) * D, D * 2) &&
                      !memcmp(vc + (h * total + slots[t]) * D, v + (t * Hk + h) * D, D * 2),
                  "store_kv row %ld head %ld", (long)t, (long)h);
    memset(kc, 0, (size_t)(Hk * total * D) * 2);
    int64_t bad[5] = {3, -1, 16, 0, 9};
    CHECK(kw_store_kv(k, Hk * D, v, Hk * D, kc, vc, bad, T, Hk, D, nb, bs) == -1, "store_kv took slot 16");
    for (int64_t i = 0; i < Hk * total * D; i++) CHECK(kc[i] == 0, "store_kv wrote before refusing");
    free(k), free(v), free(kc), free(vc);
}

static void test_quant_int8(void) {
    const int64_t N = 9, K = 70;
    uint16_t *w = xalloc((size_t)(N * K) * 2), *sc = xalloc((size_t)N * 2);
    int8_t *q = xalloc((size_t)(N * K));
    for (int64_t i = 0; i < N * K; i++) w[i] = bfr(4.0f);
    for (int64_t k = 0; k < K; k++) w[2 * K + k] = 0; /* an all-zero row: scale 1 */
    CHECK(kw_quant_int8(w, N, K, q, sc) == 0, "quant_int8 refused");
    for (int64_t n = 0; n < N; n++) {
        float amax = 0;
        for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(bf16f(w[n * K + k])));
        float s = amax > 0 ? amax / 127.0f : 1.0f;
        uint16_t sb = f32_to_bf16(s);
        if (bf16f(sb) < s) sb++;
        CHECK(sc[n] == sb, "quant_int8 scale %ld", (long)n);
        for (int64_t k = 0; k < K; k++) {
            float c = rintf(bf16f(w[n * K + k]) / bf16f(sb));
            c = c < -127 ? -127 : c > 127 ? 127 : c;
            CHECK(q[n * K + k] == (int8_t)c, "quant_int8 code %ld,%ld", (long)n, (long)k);
        }
    }
    w[5] = 0x7F80; /* +inf */
    CHECK(kw_quant_int8(w, N, K, q, sc) == -1, "quant_int8 took an infinity");
    free(w), free(sc), free(q);
}

/* ---- the native decode step (step.c's structs, as kernels/cpu_step.py declares them) ---- */
int kw_q8group(const uint16_t *x, const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t M,
               int64_t N, int64_t K, int64_t gs, int nthreads);
int kw_q8group_u4(const uint16_t *x, const uint8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out,
                  int64_t M, int64_t N, int64_t K, int64_t gs, int nthreads);
int kw_q8group512(const uint16_t *x, const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out,
                  int64_t M, int64_t N, int64_t K, int64_t gs, int nthreads) __attribute__((weak));
int kw_q8group512_u4(const uint16_t *x, const uint8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out,
                     int64_t M, int64_t N, int64_t K, int64_t gs, int nthreads) __attribute__((weak));
int kw_silu_mul(const uint16_t *gu, uint16_t *out, int64_t T, int64_t I, const void *exp8);

/* int8_group_u4: 4-bit codes (byte j of each 32 columns = columns j and 16 + j) give the bits of the same codes as
 * int8, at M = 1 (the table path on AVX-512), 2 and 9 rows, groups of 16 and 32, both builds' entry points. */
static void test_q8group_u4(void) {
    static const int64_t cases[][4] = {{1, 19, 96, 16}, {1, 40, 256, 32}, {2, 24, 64, 32}, {9, 17, 160, 16}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int64_t M = cases[c][0], N = cases[c][1], K = cases[c][2], gs = cases[c][3], G = K / gs;
        uint16_t *x = xalloc((size_t)(M * K) * 2), *s = xalloc((size_t)(N * G) * 2), *z = xalloc((size_t)(N * G) * 2);
        int8_t *q = xalloc((size_t)(N * K));
        uint8_t *p = xalloc((size_t)(N * K / 2));
        uint16_t *o8 = xalloc((size_t)(M * N) * 2), *o4 = xalloc((size_t)(M * N) * 2);
        for (int64_t i = 0; i < M * K; i++) x[i] = bfr(4.0f);
        for (int64_t i = 0; i < N * G; i++) s[i] = bfr(0.05f), z[i] = bfr(0.1f);
        for (int64_t i = 0; i < N * K; i++) q[i] = (int8_t)(rnd() % 16);
        for (int64_t n = 0; n < N; n++)
            for (int64_t k = 0; k < K; k += 32)
                for (int j = 0; j < 16; j++)
                    p[n * K / 2 + k / 2 + j] = (uint8_t)(q[n * K + k + j] | q[n * K + k + 16 + j] << 4);
        for (int b = 0; b < 2; b++) {
            if (b && !(kw_q8group512 && kw_q8group512_u4 && cpu_has("avx512_bf16"))) break;
            for (int nt = 1; nt <= 2; nt++) {
                int r8 = b ? kw_q8group512(x, q, s, z, o8, M, N, K, gs, nt)
                           : kw_q8group(x, q, s, z, o8, M, N, K, gs, nt);
                int r4 = b ? kw_q8group512_u4(x, p, s, z, o4, M, N, K, gs, nt)
                           : kw_q8group_u4(x, p, s, z, o4, M, N, K, gs, nt);
                CHECK(r8 == 0 && r4 == 0, "q8group%s_u4 refused M=%ld N=%ld K=%ld", b ? "512" : "", (long)M, (long)N,
                      (long)K);
                same_bits(b ? "q8group512_u4" : "q8group_u4", o4, o8, M * N);
            }
        }
        CHECK(kw_q8group_u4(x, p, s, z, o4, M, N, 48, 16, 1) == -1, "q8group_u4 took K = 48");
        free(x), free(s), free(z), free(q), free(p), free(o8), free(o4);
    }
}
#ifdef KW_TEST_AVX512
/* int8_group on the AMX tiles (gemm_int8_group_amx.c), int8 codes and the 4-bit pack: taken (counted) from 2 rows,
 * groups of 16 and 32, K % 64 == 0 (4-bit: K % 128); each row of a batch (tiles of 16 rows over padded x) has the bits
 * of the same row in a batch of two (tiles of 2 rows), weight rows past a 16-row block (N = 37, 200: the tail block
 * reads no row past N), K % 128 == 64 (int8: a last half chunk), each output within close_bf16 of the double sum. */
static void test_q8group_tiles(void) {
    if (!(kw_q8group512 && kw_q8group512_u4 && cpu_has("amx_tile") && cpu_has("amx_bf16") && cpu_has("avx512vbmi") &&
          kw_amx_enable(1) == 0)) {
        printf("kw_test: AMX tiles not here: the int8_group tile path untested\n");
        return;
    }
    static const int64_t cases[][5] = {{6, 37, 256, 16, 1}, {18, 200, 384, 32, 1}, {5, 37, 192, 32, 0},
                                       {17, 40, 256, 16, 0}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int64_t M = cases[c][0], N = cases[c][1], K = cases[c][2], gs = cases[c][3], G = K / gs;
        const int u4 = (int)cases[c][4];
        uint16_t *x = xalloc((size_t)(M * K) * 2), *s = xalloc((size_t)(N * G) * 2), *z = xalloc((size_t)(N * G) * 2);
        uint8_t *p = xalloc((size_t)(N * K));
        uint16_t *ob = xalloc((size_t)(M * N) * 2), *o2 = xalloc((size_t)(2 * N) * 2);
        for (int64_t i = 0; i < M * K; i++) x[i] = bfr(4.0f);
        for (int64_t i = 0; i < N * G; i++) s[i] = bfr(0.05f), z[i] = bfr(0.1f);
        for (int64_t i = 0; i < N * K; i++) p[i] = (uint8_t)rnd();
#define Q8G(xx, out, m, nt)                                                                                        \
    (u4 ? kw_q8group512_u4(xx, p, s, z, out, m, N, K, gs, nt)                                                        \
        : kw_q8group512(xx, (const int8_t *)p, s, z, out, m, N, K, gs, nt))
        long before = kw_amx_calls();
        CHECK(Q8G(x, ob, M, 2) == 0, "q8group512 (tiles) refused");
        CHECK(kw_amx_calls() == before + 1, "q8group512 u4=%d M=%ld K=%ld gs=%ld did not take the tiles", u4, (long)M,
              (long)K, (long)gs);
        for (int64_t m = 0; m + 2 <= M; m += 2) {
            CHECK(Q8G(x + m * K, o2, 2, 1) == 0, "q8group512 2 rows refused");
            same_bits("q8group512 tiles: rows in a batch of two", o2, ob + m * N, 2 * N);
            for (int64_t n = 0; n < 2 * N; n++) {
                const int64_t row = n / N, col = n % N;
                double sum = 0, mag = 0;
                for (int64_t k = 0; k < K; k++) {
                    const uint8_t b = u4 ? p[col * K / 2 + k / 32 * 16 + k % 16] : p[col * K + k];
                    const int code = !u4 ? (int8_t)b : k % 32 < 16 ? b & 15 : b >> 4;
                    const double w = code * (double)bf16f(s[col * G + k / gs]) + bf16f(z[col * G + k / gs]);
                    sum += bf16f(x[(m + row) * K + k]) * w, mag += fabs(bf16f(x[(m + row) * K + k]) * w);
                }
                close_bf16("q8group512 tiles", o2[n], sum, mag, (m + row) * N + col);
            }
        }
#undef Q8G
        free(x), free(s), free(z), free(p), free(ob), free(o2);
    }
    kw_amx_enable(0);
}
#endif

typedef struct {
    int64_t kind;
    const void *q;
    const uint16_t *s, *z;
    int64_t N, K, gs, B;
} st_lin;
typedef struct {
    const uint16_t *in_norm, *post_norm;
    uint16_t *kc, *vc;
    st_lin qkv, o, gate_up, down;
} st_layer;
typedef struct {
    int64_t L, H, Hq, Hk, D, I, num_blocks, bs;
    float eps, scale, softcap, unused;
    const void *exp8;
} st_model;
int kw_decode_step(const st_model *m, const st_layer *layers, uint16_t *x, uint16_t *res, int64_t T,
                   const float *cos, const float *sin, int64_t cs, const int64_t *slots, const int64_t *plan,
                   int nthreads);

__attribute__((target("avx2"))) static __m256 exp8_scalar(__m256 v) { /* any expf: both sides use the same */
    float f[8];
    _mm256_storeu_ps(f, v);
    for (int i = 0; i < 8; i++) f[i] = expf(f[i]);
    return _mm256_loadu_ps(f);
}

static uint16_t *bf16s(int64_t n, float scale) {
    uint16_t *p = xalloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++) p[i] = bfr(scale);
    return p;
}

static st_lin step_lin(int64_t kind, int64_t N, int64_t K) { /* kind 1: int8 groups of 32; 6: bf16 */
    st_lin w = {kind, NULL, NULL, NULL, N, K, 32, 0};
    if (kind == 6) {
        w.q = bf16s(N * K, 0.1f);
        return w;
    }
    int8_t *q = xalloc((size_t)(N * K));
    for (int64_t i = 0; i < N * K; i++) q[i] = (int8_t)(rnd() % 255 - 127);
    w.q = q, w.s = bf16s(N * K / 32, 0.002f), w.z = bf16s(N * K / 32, 0.01f);
    return w;
}

/* the step's composition, entry point by entry point (step.c's layer(), written apart) */
static void step_by_ops(const st_model *m, const st_layer *ly, uint16_t *x, uint16_t *res, int64_t T,
                        const float *cos, const float *sin, const int64_t *slots, const int64_t *plan) {
    const int64_t H = m->H, D = m->D, nq = (m->Hq + 2 * m->Hk) * D, hq = m->Hq * D, hk = m->Hk * D;
    uint16_t *h = xalloc((size_t)(T * H) * 2), *qkv = xalloc((size_t)(T * nq) * 2), *qo = xalloc((size_t)(T * hq) * 2);
    uint16_t *ko = xalloc((size_t)(T * hk) * 2), *ao = xalloc((size_t)(T * hq) * 2);
    uint16_t *gu = xalloc((size_t)(T * 2 * m->I) * 2), *act = xalloc((size_t)(T * m->I) * 2);
    float *xf = xalloc((size_t)(T * 2 * m->I) * 4);
    for (int64_t l = 0; l < m->L; l++, ly++) {
        const st_lin *lins[4] = {&ly->qkv, &ly->o, &ly->gate_up, &ly->down};
        uint16_t *ins[4] = {h, ao, h, act}, *outs[4] = {qkv, x, gu, x};
        for (int j = 0; j < 4; j++) {
            if (j == 0) {
                if (l == 0) memcpy(res, x, (size_t)(T * H) * 2);
                kw_rms_norm(x, H, l ? res : NULL, H, ly->in_norm, h, l ? res : NULL, T, H, m->eps);
            }
            if (j == 1) {
                kw_rotary_neox(qkv, nq, qkv + hq, nq, cos, sin, D, qo, ko, T, m->Hq, m->Hk, D);
                kw_store_kv(ko, hk, qkv + hq + hk, nq, ly->kc, ly->vc, slots, T, m->Hk, D, m->num_blocks, m->bs);
                kw_decode_attention(qo, hq, ly->kc, ly->vc, ao, plan, T, m->Hq, m->Hk, D, m->num_blocks, m->bs,
                                    m->scale, 0.0f, 1);
            }
            if (j == 2) kw_rms_norm(x, H, res, H, ly->post_norm, h, res, T, H, m->eps);
            if (j == 3) kw_silu_mul(gu, act, T, m->I, m->exp8);
            const st_lin *w = lins[j];
            if (w->kind == 1) {
                kw_q8group(ins[j], w->q, w->s, w->z, outs[j], T, w->N, w->K, w->gs, 1);
            } else {
                for (int64_t i = 0; i < T * w->K; i += 16) /* kw_bgemm's split x */
                    for (int k = 0; k < 8; k++)
                        xf[i + k] = bf16f(ins[j][i + 2 * k]), xf[i + 8 + k] = bf16f(ins[j][i + 2 * k + 1]);
                kw_bgemm(xf, w->q, outs[j], T, w->N, w->K, 1);
            }
        }
    }
    free(h), free(qkv), free(qo), free(ko), free(ao), free(gu), free(act), free(xf);
}

static void test_step(void) {
    const int64_t L = 2, H = 64, Hq = 4, Hk = 2, D = 16, I = 96, nb = 4, bs = 4, T = 2, pool = Hk * nb * bs * D;
    st_model m = {L, H, Hq, Hk, D, I, nb, bs, 1e-5f, 0.25f, 0.0f, 0.0f, (const void *)exp8_scalar};
    st_layer ly[2];
    uint16_t *pools[3][4]; /* the step at 1 and 2 threads, the composition: each its own K/V pools */
    for (int64_t l = 0; l < L; l++) {
        int64_t kind = l == 0 ? 1 : 6;
        ly[l] = (st_layer){bf16s(H, 1.0f), bf16s(H, 1.0f), NULL, NULL, step_lin(kind, (Hq + 2 * Hk) * D, H),
                           step_lin(kind, H, Hq * D), step_lin(kind, 2 * I, H), step_lin(kind, H, I)};
        uint16_t *k0 = bf16s(pool, 1.0f), *v0 = bf16s(pool, 1.0f);
        for (int c = 0; c < 3; c++) {
            pools[c][2 * l] = xalloc((size_t)pool * 2), pools[c][2 * l + 1] = xalloc((size_t)pool * 2);
            memcpy(pools[c][2 * l], k0, (size_t)pool * 2), memcpy(pools[c][2 * l + 1], v0, (size_t)pool * 2);
        }
        free(k0), free(v0);
    }
    /* sequence 0: 3 positions in block 2 (this step's at slot 10); sequence 1: 6 in blocks 0, 3 (slot 13) */
    int64_t plan[3 + 3 * 2 + 2 * 2] = {T, 2, 0, 3, 6, 0, 0, 0, 0, 2, 0, 0, 3}, slots[2] = {10, 13};
    float *cs = xalloc((size_t)(T * D) * 4);
    for (int64_t i = 0; i < T * D; i++) cs[i] = unif();
    uint16_t *x0 = bf16s(T * H, 1.0f), *x[3], *res[3];
    for (int c = 0; c < 3; c++) {
        x[c] = xalloc((size_t)(T * H) * 2), res[c] = xalloc((size_t)(T * H) * 2);
        memcpy(x[c], x0, (size_t)(T * H) * 2);
    }
    for (int c = 0; c < 3; c++) {
        for (int64_t l = 0; l < L; l++) ly[l].kc = pools[c][2 * l], ly[l].vc = pools[c][2 * l + 1];
        if (c < 2)
            CHECK(kw_decode_step(&m, ly, x[c], res[c], T, cs, cs + D / 2, D, slots, plan, c + 1) == 0,
                  "step refused (%d threads)", c + 1);
        else
            step_by_ops(&m, ly, x[c], res[c], T, cs, cs + D / 2, slots, plan);
    }
    for (int c = 0; c < 2; c++) {
        same_bits("step: output vs the entry points one by one", x[c], x[2], T * H);
        same_bits("step: residual vs the entry points one by one", res[c], res[2], T * H);
        for (int64_t l = 0; l < L; l++) same_bits("step: K pool", pools[c][2 * l], pools[2][2 * l], pool);
    }
    ly[1].qkv.kind = 99;
    CHECK(kw_decode_step(&m, ly, x[0], res[0], T, cs, cs + D / 2, D, slots, plan, 1) == -(10 + 16 + 2),
          "step: a weight of no known kind not refused as layer 1's qkv");
    for (int c = 0; c < 3; c++) {
        free(x[c]), free(res[c]);
        for (int i = 0; i < 4; i++) free(pools[c][i]);
    }
    for (int64_t l = 0; l < L; l++) {
        const st_lin *ws[4] = {&ly[l].qkv, &ly[l].o, &ly[l].gate_up, &ly[l].down};
        for (int j = 0; j < 4; j++) free((void *)ws[j]->q), free((void *)ws[j]->s), free((void *)ws[j]->z);
        free((void *)ly[l].in_norm), free((void *)ly[l].post_norm);
    }
    free(cs), free(x0);
}

int main(int argc, char **argv) {
    g_tsan = argc > 1 && !strcmp(argv[1], "--tsan");
    test_scratch();
    test_pool(0);
    if (!g_tsan) { /* libgomp is not built with TSan (its team would be all false reports), nor forks under it */
        test_pool(1);
        test_fork();
    }
    static const int64_t mm[][3] = {{1, 8, 16}, {2, 40, 48}, {3, 13, 64}, {9, 64, 576}, {33, 40, 160}};
    for (size_t i = 0; i < sizeof mm / sizeof mm[0]; i++) {
        test_bgemm(mm[i][0], mm[i][1], mm[i][2]);
        test_q8gemm(mm[i][0], mm[i][1], mm[i][2], 0);
        test_q8gemm(mm[i][0], mm[i][1], mm[i][2], 1);
    }
    test_q4("q4gemm", NULL, 1, 64, 128, 32, 32);
    test_q4("q4gemm", NULL, 1, 128, 128, 64, 64);
    test_q4("q4gemm", NULL, 3, 48, 64, 16, 16);
    test_q4("q4gemm", NULL, 7, 96, 96, 8, 48);
    test_q4("q4gemm", NULL, 20, 128, 512, 128, 32);
#ifdef KW_TEST_AVX512
    if (cpu_has("avx512_bf16")) test_avx512();
#endif
    for (int f32 = 0; f32 < 2; f32++) {
        test_attention(f32, 0.0f, 0);
        test_attention(f32, 30.0f, 0);
        test_attention(f32, 0.0f, 11);
    }
    test_rms_norm(1, 576, 0);
    test_rms_norm(3, 2048, 1);
    test_rms_norm(2, 40, 1);
    test_rotary();
    test_store_kv();
    test_quant_int8();
    test_q8group_u4();
#ifdef KW_TEST_AVX512
    test_q8group_tiles();
#endif
    test_step();
    printf("kw_test: %d checks passed%s\n", atomic_load(&g_checks), g_tsan ? " (TSan: pool, no OpenMP / fork)" : "");
    return 0;
}
