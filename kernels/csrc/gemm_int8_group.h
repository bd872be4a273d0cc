/* The int8_group matmul's body, written once for a vector of LANES float32 lanes and included by its two files:
 * gemm_int8_group_avx2.c (LANES 8, kw_q8group) and gemm_int8_group_avx512.c (LANES 16, kw_q8group512). Each defines
 * first: VEC, LANES, XB (rows of x per register block), ENTRY (the entry point's name) and the vector operations
 * v_zero, v_set1, v_load, v_store_u (unaligned), v_load_a, v_store_a (aligned), v_add, v_mul, v_fma (a * b + c),
 * v_codes (LANES int8 codes as float32, exactly), v_widen (LANES bf16 as float32), v_hsum (the lanes added in
 * one fixed tree) and v_store_bf16 (LANES float32 stored as bf16, nearest even, a NaN as 0x7FC0); ENTRY_BF16 and
 * ENTRY_U4_BF16 name the weight-to-bf16 entry points. Prefetches (interleaved A/B, one thread): the next 8 rows
 * during an M == 1 block (0.64-0.82x the time of prefetching each row 256 bytes ahead), the next 4 rows during a
 * conversion (0.85-0.95x at M = 8).
 *
 *   out[m, n] = bf16( sum_k x[m, k] * (q[n, k] * s[n, g(k)])  +  sum_g z[n, g] * xs[m, g] )
 *
 * What it computes and in which order: gemm_int8_group_avx2.c's header. Threads split N in blocks of NB rows.
 *
 * Codes: int8 [N, K] (the int8_group layout), or unsigned 4-bit [N, K / 2] (int8_group_u4: GGUF Q4_K / Q2_K at
 * their own width): in each 32 columns, byte j holds column j in its low nibble and column 16 + j in its high one,
 * so LANES consecutive codes are LANES consecutive bytes and one shift: the same float32 codes, products and sums
 * as the int8 layout (the same bits), half the bytes. The file defines v_codes4(p, shift) too (LANES bytes from
 * p, each shifted right by shift and masked to its nibble, as float32). ENTRY_U4 / the u4 entry points take them.
 */
#ifndef GEMM_INT8_GROUP_H
#define GEMM_INT8_GROUP_H

#define NB 8  /* weight rows in lockstep at M == 1, and per block of a thread */
#define WB 4  /* M > 1: weight rows per register block (times XB rows of x) */
#define MC 48 /* rows of x per chunk: its float32 copy stays in L2 while every weight block of a thread passes */

typedef struct {
    const uint16_t *x, *s, *z;
    const int8_t *q;
    uint16_t *out;
    int64_t M, N, K, gs, G, Gp; /* Gp: G rounded up to LANES (the scratch rows' stride, zero beyond G) */
    int u4;                     /* codes: 0 int8 [N, K], 1 the 4-bit pack [N, K / 2] */
    atomic_int fail;
} g8_t;

/* bytes of one weight row's codes */
static inline int64_t g8_row_bytes(int64_t K, int u4) { return u4 ? K / 2 : K; }

/* LANES codes k .. k+LANES-1 of a row (k a multiple of LANES) as float32; u4 a constant where inlined */
static inline __attribute__((always_inline)) VEC g8_codes(const int8_t *row, int64_t k, int u4) {
    if (!u4) return v_codes(row + k);
    return v_codes4((const uint8_t *)row + (k >> 5) * 16 + (k & 15), (k & 16) ? 4 : 0);
}

/* bf16 [n] -> float32 [n], then zeros up to np (a multiple of LANES) */
static void g8_widen(const uint16_t *src, int64_t n, float *dst, int64_t np) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) v_store_u(dst + i, v_widen(src + i));
    for (; i < n; i++) dst[i] = bf16f(src[i]);
    for (; i < np; i++) dst[i] = 0.0f;
}

/* rows m0 .. m0+mr-1 of x as float32 [mr][K] and their group sums [mr][Gp] (LANES lanes, then v_hsum) */
static void g8_x(const g8_t *a, int64_t m0, int64_t mr, float *x32, float *xs) {
    const int64_t K = a->K, gs = a->gs;
    for (int64_t r = 0; r < mr; r++) {
        float *xr = x32 + r * K, *sr = xs + r * a->Gp;
        g8_widen(a->x + (m0 + r) * K, K, xr, K);
        for (int64_t g = 0; g < a->G; g++) {
            VEC acc = v_zero();
            for (int64_t k = g * gs; k < (g + 1) * gs; k += LANES) acc = v_add(acc, v_load(xr + k));
            sr[g] = v_hsum(acc);
        }
        for (int64_t g = a->G; g < a->Gp; g++) sr[g] = 0.0f;
    }
}

/* the zero term's lanes for one weight row (zf: its zeros as float32 [Gp]) and one row of x's group sums */
static inline VEC g8_zterm(const float *zf, const float *xs, int64_t Gp) {
    VEC t = v_zero();
    for (int64_t g = 0; g < Gp; g += LANES) t = v_fma(v_load(zf + g), v_load(xs + g), t);
    return t;
}

/* M == 1: rows n .. n+nr-1 (nr <= NB) in lockstep, each code times its scale in registers. sf, zf: the rows' scales
 * and zeros as float32 [nr][Gp]. Inlined with nr = NB and as is, and per code width, so the accumulators stay in
 * registers. */
static inline __attribute__((always_inline)) void g8_rows_1(const g8_t *a, int64_t n, int nr, int u4,
                                                            const float *sf, const float *zf, const float *x32,
                                                            const float *xs, uint16_t *out) {
    const int64_t K = a->K, gs = a->gs, Gp = a->Gp, rb = g8_row_bytes(K, u4);
    const int8_t *w = a->q + n * rb;
    VEC acc[NB];
    for (int i = 0; i < NB; i++) acc[i] = v_zero();
    for (int64_t g = 0, k = 0; g < a->G; g++) {
        /* the next block's rows (NB * rb bytes right after these) fetched over this block's groups */
        for (int64_t b = 0; b < g8_row_bytes(NB * gs, u4); b += 64)
            _mm_prefetch((const char *)(w + NB * rb + g * g8_row_bytes(NB * gs, u4) + b), _MM_HINT_T0);
        for (int64_t end = k + gs; k < end; k += LANES) {
            VEC xv = v_load(x32 + k);
            for (int i = 0; i < nr; i++)
                acc[i] = v_fma(xv, v_mul(g8_codes(w + i * rb, k, u4), v_set1(sf[i * Gp + g])), acc[i]);
        }
    }
    for (int i = 0; i < nr; i++) out[n + i] = f32_to_bf16(v_hsum(v_add(acc[i], g8_zterm(zf + i * Gp, xs, Gp))));
}

#ifdef V_U4_TABLE
/* g8_rows_1 for 4-bit codes where the file has a table lookup (V_U4_TABLE: LANES == 16): per 32 columns one load
 * per row, its low nibbles columns k..k+15, its high ones k+16..k+31, each code's q * s read from the row's table
 * of the 16 products (v_lookup4, the low 4 bits of each index): the same exact values, added in the same order as
 * g8_rows_1's, with no conversion, mask or multiply per code (measured in L2, a 1B's shapes: 1.7-1.9x). */
static inline __attribute__((always_inline)) void g8_rows_1_u4(const g8_t *a, int64_t n, int nr, const float *sf,
                                                               const float *zf, const float *x32, const float *xs,
                                                               uint16_t *out) {
    const int64_t K = a->K, gs = a->gs, Gp = a->Gp, rb = K / 2;
    const uint8_t *w = (const uint8_t *)a->q + n * rb;
    VEC acc[NB], lo[NB], hi[NB];
    for (int i = 0; i < NB; i++) acc[i] = lo[i] = hi[i] = v_zero(); /* the tables are set at k = 0 */
    for (int64_t k = 0; k < K; k += 32) {
        /* the next block's rows, NB * 16 bytes a step, fetched over this block */
        for (int64_t b = 0; b < NB * 16; b += 64)
            _mm_prefetch((const char *)(w + NB * rb + k / 2 * NB + b), _MM_HINT_T0);
        if (k % gs == 0)
            for (int i = 0; i < nr; i++) lo[i] = hi[i] = v_mul(v_iota16(), v_set1(sf[i * Gp + k / gs]));
        if (gs == 16) /* columns k+16.. are the next group */
            for (int i = 0; i < nr; i++) hi[i] = v_mul(v_iota16(), v_set1(sf[i * Gp + k / gs + 1]));
        VEC x0 = v_load(x32 + k), x1 = v_load(x32 + k + 16);
        for (int i = 0; i < nr; i++) {
            v_idx16 c = v_u4_load(w + i * rb + k / 2);
            acc[i] = v_fma(x0, v_lookup4(lo[i], c), acc[i]);
            acc[i] = v_fma(x1, v_lookup4(hi[i], v_u4_high(c)), acc[i]);
        }
    }
    for (int i = 0; i < nr; i++) out[n + i] = f32_to_bf16(v_hsum(v_add(acc[i], g8_zterm(zf + i * Gp, xs, Gp))));
}
#endif

static void g8_rows_1_any(const g8_t *a, int64_t n, int nr, const float *sf, const float *zf, const float *x32,
                          const float *xs, uint16_t *out) {
#ifdef V_U4_TABLE
    if (a->u4) {
        if (nr == NB)
            g8_rows_1_u4(a, n, NB, sf, zf, x32, xs, out);
        else
            g8_rows_1_u4(a, n, nr, sf, zf, x32, xs, out);
        return;
    }
#endif
    if (nr == NB && a->u4)
        g8_rows_1(a, n, NB, 1, sf, zf, x32, xs, out);
    else if (nr == NB)
        g8_rows_1(a, n, NB, 0, sf, zf, x32, xs, out);
    else
        g8_rows_1(a, n, nr, a->u4, sf, zf, x32, xs, out);
}

/* rows n .. n+nr-1 of q times their scales (sf [nr][Gp]) into w [nr][K] (exact) */
static void g8_convert(const g8_t *a, int64_t n, int nr, const float *sf, float *w) {
    const int64_t K = a->K, gs = a->gs, rb = g8_row_bytes(K, a->u4);
    for (int i = 0; i < nr; i++) {
        const int8_t *src = a->q + (n + i) * rb;
        for (int64_t g = 0, k = 0; g < a->G; g++) {
            VEC sb = v_set1(sf[i * a->Gp + g]);
            for (int64_t b = 0; b < g8_row_bytes(gs, a->u4); b += 64) /* the next WB rows, converted next */
                _mm_prefetch((const char *)(src + WB * rb + g8_row_bytes(k, a->u4) + b), _MM_HINT_T0);
            if (a->u4)
#ifdef V_U4_TABLE /* q * s from the group's table (g8_rows_1_u4's): the same values */
                for (VEC tab = v_mul(v_iota16(), sb); k < (g + 1) * gs; k += LANES) {
                    v_idx16 c = v_u4_load((const uint8_t *)src + (k >> 5) * 16);
                    v_store_a(w + i * K + k, v_lookup4(tab, (k & 16) ? v_u4_high(c) : c));
                }
#else
                for (int64_t end = k + gs; k < end; k += LANES)
                    v_store_a(w + i * K + k, v_mul(g8_codes(src, k, 1), sb));
#endif
            else
                for (int64_t end = k + gs; k < end; k += LANES)
                    v_store_a(w + i * K + k, v_mul(g8_codes(src, k, 0), sb));
        }
    }
}

/* chunk rows c .. c+xr-1 (xr <= XB; rows m0 + c ... of out) against the wr (<= WB) converted weight rows w, whose
 * outputs are columns n ...; inlined with constant wr and xr */
static inline __attribute__((always_inline)) void g8_block(const g8_t *a, int64_t n, int wr, const float *w,
                                                           const float *zf, int64_t m0, int64_t c, int xr,
                                                           const float *x32, const float *xs) {
    const int64_t K = a->K, Gp = a->Gp;
    const float *x0 = x32 + c * K;
    VEC acc[WB][XB];
    for (int i = 0; i < WB; i++)
        for (int j = 0; j < XB; j++) acc[i][j] = v_zero();
    for (int64_t k = 0; k < K; k += LANES) {
        VEC xv[XB];
        for (int j = 0; j < xr; j++) xv[j] = v_load(x0 + j * K + k);
        for (int i = 0; i < wr; i++) {
            VEC wv = v_load_a(w + i * K + k);
            for (int j = 0; j < xr; j++) acc[i][j] = v_fma(xv[j], wv, acc[i][j]);
        }
    }
    for (int i = 0; i < wr; i++)
        for (int j = 0; j < xr; j++)
            a->out[(m0 + c + j) * a->N + n + i] =
                f32_to_bf16(v_hsum(v_add(acc[i][j], g8_zterm(zf + i * Gp, xs + (c + j) * Gp, Gp))));
}

/* every row of the chunk (mr rows from m0) against wr (<= WB) weight rows from n, converted in w */
static void g8_chunk(const g8_t *a, int64_t n, int wr, const float *w, const float *zf, int64_t m0, int64_t mr,
                     const float *x32, const float *xs) {
    int64_t c = 0;
    if (wr == WB) {
        for (; c + XB <= mr; c += XB) g8_block(a, n, WB, w, zf, m0, c, XB, x32, xs);
        for (; c + 2 <= mr; c += 2) g8_block(a, n, WB, w, zf, m0, c, 2, x32, xs);
        if (c < mr) g8_block(a, n, WB, w, zf, m0, c, 1, x32, xs);
    } else {
        for (; c + XB <= mr; c += XB) g8_block(a, n, wr, w, zf, m0, c, XB, x32, xs);
        for (; c < mr; c++) g8_block(a, n, wr, w, zf, m0, c, 1, x32, xs);
    }
}

/* the scratch of a thread: x chunk [mc][K], its group sums [mc][Gp], WB converted rows [WB][K], the scales and
 * zeros of a block [NB][Gp] each; NULL without memory */
static float *g8_scratch(const g8_t *a, int64_t mc) {
    static __thread kw_buf scratch;
    return kw_scratch(&scratch, (size_t)((mc + WB) * a->K + (mc + 2 * NB) * a->Gp) * sizeof(float));
}

static void g8_slice(const void *arg, int t, int nthreads) {
    g8_t *a = (g8_t *)arg;
    const int64_t K = a->K, Gp = a->Gp;
    int64_t blocks = (a->N + NB - 1) / NB, per = (blocks + nthreads - 1) / nthreads;
    int64_t n0 = t * per * NB, n1 = (t + 1) * per * NB, mc = a->M < MC ? a->M : MC;
    if (n1 > a->N) n1 = a->N;
    if (n0 >= n1) return;
    float *x32 = g8_scratch(a, mc);
    if (!x32) {
        atomic_store(&a->fail, 1);
        return;
    }
    float *w = x32 + mc * K, *xs = w + WB * K, *sf = xs + mc * Gp, *zf = sf + NB * Gp;
    for (int64_t m0 = 0; m0 < a->M; m0 += mc) {
        int64_t mr = a->M - m0 < mc ? a->M - m0 : mc;
        g8_x(a, m0, mr, x32, xs);
        for (int64_t n = n0; n < n1; n += NB) {
            int nr = n1 - n < NB ? (int)(n1 - n) : NB;
            for (int i = 0; i < nr; i++) {
                g8_widen(a->s + (n + i) * a->G, a->G, sf + i * Gp, Gp);
                g8_widen(a->z + (n + i) * a->G, a->G, zf + i * Gp, Gp);
            }
            if (mr == 1) { /* one row of x: the codes in registers, one pass */
                g8_rows_1_any(a, n, nr, sf, zf, x32, xs, a->out + m0 * a->N);
                continue;
            }
            for (int b = 0; b < nr; b += WB) {
                int wr = nr - b < WB ? nr - b : WB;
                g8_convert(a, n + b, wr, sf + b * Gp, w);
                g8_chunk(a, n + b, wr, w, zf + b * Gp, m0, mr, x32, xs);
            }
        }
    }
}

/* the sizes every entry point takes (gs a multiple of 16 dividing K; the 4-bit pack: K % 32 == 0) */
static int g8_sizes_ok(int64_t N, int64_t K, int64_t gs, int u4) {
    return N >= 1 && gs >= 16 && gs % 16 == 0 && K >= gs && K % gs == 0 && !(u4 && K % 32);
}

/* the threads a call of N weight rows takes: tiny outputs are not worth a wake-up */
static int g8_threads(int64_t N, int nthreads) {
    nthreads = kw_threads(nthreads);
    return N < 32 * nthreads ? 1 : nthreads;
}

static int g8_entry(const uint16_t *x, const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out,
                    int64_t M, int64_t N, int64_t K, int64_t gs, int nthreads, int u4) {
    if (M < 1 || !g8_sizes_ok(N, K, gs, u4)) return -1;
    nthreads = g8_threads(N, nthreads);
    int64_t G = K / gs;
#ifdef G8_FIRST
    int rc = G8_FIRST(x, q, s, z, out, M, N, K, gs, nthreads, u4);
    if (rc != -1) return rc;
#endif
    g8_t a = {x, s, z, q, out, M, N, K, gs, G, (G + LANES - 1) / LANES * LANES, u4, 0};
    kw_run(g8_slice, &a, nthreads);
    return atomic_load(&a.fail) ? -2 : 0;
}

/* x: bf16 [M, K]; q: int8 [N, K] (ENTRY) or the 4-bit pack [N, K / 2] (ENTRY_U4, K % 32 == 0); s, z: bf16
 * [N, K / gs], gs a multiple of 16. 0, -1 on bad sizes, -2 when a thread's scratch could not be allocated.
 * Declared here, not in kw.h: kernels/native_ops.py binds them (and step.c). */
int ENTRY(const uint16_t *x, const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t M,
          int64_t N, int64_t K, int64_t gs, int nthreads);
int ENTRY_U4(const uint16_t *x, const uint8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t M,
             int64_t N, int64_t K, int64_t gs, int nthreads);

int ENTRY(const uint16_t *x, const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t M,
          int64_t N, int64_t K, int64_t gs, int nthreads) {
    return g8_entry(x, q, s, z, out, M, N, K, gs, nthreads, 0);
}

int ENTRY_U4(const uint16_t *x, const uint8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t M,
             int64_t N, int64_t K, int64_t gs, int nthreads) {
    return g8_entry(x, (const int8_t *)q, s, z, out, M, N, K, gs, nthreads, 1);
}

/* ---- the weight as bf16 [N, K] for the widest calls (then oneDNN's bf16 matmul): bf16(q * s + z), the float32
 * sum rounded once (q * s is exact, so the fused multiply-add is the reference's product then sum) and then to
 * nearest even bf16, as the reference's dequantize and cast ---- */
typedef struct {
    const int8_t *q;
    const uint16_t *s, *z;
    uint16_t *out;
    int64_t N, K, gs;
    int u4;
} g8d_t;

static void g8_bf16_slice(const void *arg, int t, int nthreads) {
    const g8d_t *d = (const g8d_t *)arg;
    const int64_t K = d->K, G = K / d->gs, per = (d->N + nthreads - 1) / nthreads;
    int64_t n1 = (t + 1) * per < d->N ? (t + 1) * per : d->N;
    for (int64_t n = t * per; n < n1; n++) {
        const int8_t *row = d->q + n * g8_row_bytes(K, d->u4);
        for (int64_t g = 0, k = 0; g < G; g++) {
            VEC s = v_set1(bf16f(d->s[n * G + g])), z = v_set1(bf16f(d->z[n * G + g]));
            for (int64_t end = k + d->gs; k < end; k += LANES)
                v_store_bf16(d->out + n * K + k, v_fma(d->u4 ? g8_codes(row, k, 1) : g8_codes(row, k, 0), s, z));
        }
    }
}

static int g8_bf16(const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t N, int64_t K,
                   int64_t gs, int nthreads, int u4) {
    if (!g8_sizes_ok(N, K, gs, u4)) return -1;
    nthreads = g8_threads(N, nthreads);
    g8d_t d = {q, s, z, out, N, K, gs, u4};
    kw_run(g8_bf16_slice, &d, nthreads);
    return 0;
}

/* q, s, z as for ENTRY (ENTRY_U4_BF16: q the 4-bit pack); out: bf16 [N, K]. 0, -1 on bad sizes. */
int ENTRY_BF16(const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t N, int64_t K, int64_t gs,
               int nthreads);
int ENTRY_U4_BF16(const uint8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t N, int64_t K,
                  int64_t gs, int nthreads);

int ENTRY_BF16(const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t N, int64_t K, int64_t gs,
               int nthreads) {
    return g8_bf16(q, s, z, out, N, K, gs, nthreads, 0);
}

int ENTRY_U4_BF16(const uint8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t N, int64_t K,
                  int64_t gs, int nthreads) {
    return g8_bf16((const int8_t *)q, s, z, out, N, K, gs, nthreads, 1);
}

#endif /* GEMM_INT8_GROUP_H */
