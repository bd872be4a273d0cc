/* bf16 decode attention over the paged KV cache (AVX2 + FMA, every build).
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
 * Work: one (sequence, kv head) pair is one unit: its G query heads share each K/V row read; units are split over
 * the threads by their key count, so long and short sequences balance. Every block id and length of the plan is
 * checked against the cache before anything is read (check_plan).
 */
#include <math.h>
#include <stdlib.h>

#include "kw_avx2.h"

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
    nthreads = kw_threads(nthreads);
    if (nthreads > S * Hk) nthreads = (int)(S * Hk);
    if (work < ATTN_MIN_WORK * nthreads) nthreads = 1; /* a few hundred keys: not worth a wake-up */
    a.scratch_per_thread = scratch_bytes(Hq / Hk, D, longest);
    a.scratch = aligned_alloc(64, (size_t)(a.scratch_per_thread * nthreads));
    if (!a.scratch) return -2;
    kw_run(attn_slice, &a, nthreads);
    free(a.scratch);
    return 0;
}
