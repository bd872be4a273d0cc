/* The int8_group matmul (int8 codes, or the 4-bit pack: GGUF Q4_K / Q2_K) for bf16 x on Intel's AMX tiles, 2 rows
 * of x and more, where the tiles are on, the group is 16 or 32 and K % 64 == 0 (4-bit codes: K % 128 == 0)
 * (gemm_int8_group.h's g8_entry asks here first; one row and other shapes take its vector kernel).
 *
 *   out[m, n] = bf16(t),  t = 0;  per group g in k order:  t = fma(s, S, t);  t = fma(z', xs[m, g], t)
 *   S = the tiles' sum over the group of x[m, k] c[n, k]  (tdpbf16ps; xs: x_group_sums)
 *   int8 codes: c = q, z' = z;  4-bit codes: c = 16 + q, z' = z - 16 s
 *
 * Why: the vector kernel multiplies every x by its q * s, so above one row it is bound by those float32 fused
 * multiply-adds (M per weight: 8 rows, L2-resident, 7.7 G weights/s). Here the tiles make each group's sums of x c
 * (every code exact in bf16: int8 ones through float32; 16 + q is 0x4180 | q << 3, as the int4 kernels build theirs)
 * and the scale enters once per group and output. A 1B's shapes from memory (20 layers, 2 threads): 4-bit codes
 * (564 MB) 8 rows 0.44-0.49x the vector kernel's time, 16 rows 0.39-0.43x, 32 rows 0.39x; int8 codes (1014 MB)
 * 2 rows 0.87x, 8 rows 0.65x, 16 rows 0.55x, 32 rows 0.49x.
 *
 * Its order differs from the vector kernel's, so a row's bits differ between one row (vector) and two or more (here)
 * and within tests/unit/kernels/test_cpu_int8_group.py's bound of the true product; any two calls of 2 rows or more
 * give a row the same bits (one order per output whatever the batch from 2 rows, or the threads), as the int8 and
 * int4 tile paths. One row on the tiles would keep every M's bits alike, but vdpbf16ps does not round as tdpbf16ps
 * (measured: ~65% of float32 sums differ in the last bit with x over 2^-12 .. 2^12), so one row needs tiles of one
 * row: 1.1-1.2x the vector kernel's time, where one row decides single-stream decode (measured, not kept).
 *
 * The weights are B, in pairs: per 128 k, 16 weight rows' code bytes (64 a row for 4-bit codes, two halves of 64
 * for int8) are loaded and transposed as 16 x 16 dwords (block_dwords); vpmultishiftqb + one mask build the
 * (16 + code) pair vectors of the 16 rows, or two bytes' sign-extension, conversion and top halves the int8 ones
 * (a 4 KiB L1 scratch of B tiles); x is A (its rows as they lie up to 16 rows, else padded to a multiple of 16), C = rows of x
 * x 16 weight rows, two groups in flight; each group's C stored and folded on 16 lanes.
 */
#include <string.h>

#include "kw_avx512.h"

typedef struct {
    const uint16_t *s, *z;
    const uint8_t *q;
    uint16_t *out;
    const uint16_t *xa; /* x, or (M > 16) its rows padded to Mp, bf16 [Mp][K] */
    const float *xs;    /* [G][Mp]: x_group_sums */
    int64_t M, Mp, tr, N, K, gs, G; /* tr: the tiles' rows of x (M up to 16, else 16) */
    int gs_log2, u4; /* u4: 4-bit codes [N][K / 2]; else int8 [N][K] */
    atomic_int fail;
} g8t_t;

/* The 64 code bytes p .. p + 63 of nr rows rb apart (zeros beyond): 128 4-bit codes or 64 int8 ones a row,
 * transposed into v (64-byte aligned): v[j] lane r = dword j of row r, stored so that the pairs below read them from
 * L1 instead of 16 live registers */
static inline __attribute__((always_inline)) void block_dwords(const uint8_t *p, int64_t rb, int nr, __m512i *v) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = i < nr ? _mm512_loadu_si512(p + i * rb) : _mm512_setzero_si512();
    transpose16(r);
    for (int j = 0; j < 16; j++) _mm512_store_si512(v + j, r[j]);
}

/* vpmultishiftqb's controls: output byte i of a qword takes the 8 bits from bit ctl[i] of its qword (mod 64), so
 * for each lane's dword (b0, b1, b2, b3), word h (bytes 2h, 2h+1), low (L) or high (H) nibbles: byte 0 gets the
 * first byte's nibble at bits 3-6, byte 2 the second's (bytes 1 and 3 are masked off) */
typedef struct {
    __m512i ctl[4], m78, c41; /* ctl[2 * h + high] */
} u4_consts;

static inline u4_consts u4_consts_make(void) {
    u4_consts c;
    for (int h = 0; h < 2; h++)
        for (int hi = 0; hi < 2; hi++) {
            uint8_t b[64];
            for (int i = 0; i < 64; i++) {
                const int dw = i / 4 % 2, byte = i % 4, src = 16 * h + (byte >= 2 ? 8 : 0); /* source byte's bit */
                b[i] = (uint8_t)((32 * dw + src + (hi ? 1 : -3) + 64) % 64);
            }
            c.ctl[2 * h + hi] = _mm512_loadu_si512(b);
        }
    c.m78 = _mm512_set1_epi32(0x00780078);
    c.c41 = _mm512_set1_epi32(0x41804180);
    return c;
}

/* Pair p (k = 32 s + 2p, 2p+1 of the 128) of the 16 rows: a 32-k sub-block s's 16 bytes hold columns j (low
 * nibble) and 16 + j (high) in byte j, so pair p < 8 is the low nibbles of word 8 s + p, pair 8 + p the high ones,
 * word w being half w % 2 of dword w / 2; (16 + c, 16 + c') as bf16 = 0x4180 | c << 3 in each half */
static inline __attribute__((always_inline)) __m512i u4_pair(const __m512i *v, const u4_consts *c, int s, int p) {
    const int w = 8 * s + p % 8;
    __m512i sh = _mm512_multishift_epi64_epi8(c->ctl[2 * (w % 2) + (p >= 8)], _mm512_load_si512(v + w / 2));
    return _mm512_ternarylogic_epi32(sh, c->m78, c->c41, 0xEA); /* (sh & m78) | c41 */
}

/* group g's fold into t (16 lanes, sz: g8t_scales's): t = fma(s, S, t), then fma(z - 16 s, xs, t) for 4-bit codes
 * (S = sum x (16 + q)), fma(z, xs, t) for int8 codes (S = sum x q) */
static inline __m512 g8t_fold(__m512 t, const uint32_t *sz, int64_t g, __m512 S, __m512 xs, int u4) {
    __m512i v = _mm512_load_si512(sz + g * 16);
    __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    __m512 zf = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
    t = _mm512_fmadd_ps(sc, S, t);
    return _mm512_fmadd_ps(u4 ? _mm512_fnmadd_ps(_mm512_set1_ps(16.0f), sc, zf) : zf, xs, t);
}

/* Chunks ahead that a block's chunk at k0 prefetches: the 16 rows' lines PF_AHEAD chunks on, past the rows' end
 * the next block's first chunks. Measured on a 1B's Q4_K shapes read from memory (20 layers, 2 threads): 8 rows
 * 1, 4, 8 within the noise (52-61 ms); one row through this loop (vdpbf16ps then): 2-8 within 5%, the next block in
 * order instead or each row's line one block ahead 15-20% slower. */
#define PF_AHEAD 4

static inline __attribute__((always_inline)) void g8t_prefetch(const uint8_t *blk, int64_t rb, int64_t off) {
    const uint8_t *base = off >= rb ? blk + 15 * rb : blk; /* row r of the next block at off - rb */
    for (int r = 0; r < 16; r++) _mm_prefetch((const char *)(base + r * rb + off), _MM_HINT_T0);
}

/* int8 code d's byte b (0..3) of each dword as float32 (exact) */
#define I8_BYTE(d, b) _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(d, 24 - 8 * (b)), 24))

/* bytes (b, b + 1) of each dword of d as a bf16 pair: exact (integers under 2^8), so a float's top half */
static inline __m512i i8_pair(__m512i d, const int b) {
    __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(I8_BYTE(d, b)), 16);
    return _mm512_ternarylogic_epi32(_mm512_castps_si512(I8_BYTE(d, b + 1)), _mm512_set1_epi32((int)0xFFFF0000u), lo,
                                     0xEA); /* (hi & mask) | lo */
}

/* the 64 pair vectors of k0 .. k0+127: w[P] = the 16 rows' codes (k0 + 2P, k0 + 2P + 1) as bf16 pairs (4 KiB, L1):
 * 4-bit codes as 16 + code (a 32-k sub-block s's 16 bytes hold columns j (low nibble) and 16 + j (high) in byte j:
 * P = 16 s + p), int8 codes as themselves (two 64-byte halves, dword j of half h: P = 32 h + 2 j, 2 j + 1) */
static void g8t_pairs(const g8t_t *a, const u4_consts *c, int64_t n0, int nr, int64_t k0, __m512i *w) {
    __m512i dd[16] __attribute__((aligned(64)));
    if (a->u4) {
        const int64_t rb = a->K / 2;
        g8t_prefetch(a->q + n0 * rb, rb, k0 / 2 + 64 * PF_AHEAD);
        block_dwords(a->q + n0 * rb + k0 / 2, rb, nr, dd);
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++)
#pragma GCC unroll 16
            for (int p = 0; p < 16; p++) _mm512_store_si512(w + 16 * s + p, u4_pair(dd, c, s, p));
        return;
    }
    const int64_t rb = a->K;
    for (int h = 0; h < 2 && k0 + 64 * h < a->K; h++) { /* K % 128 == 64: the last chunk is one half */
        g8t_prefetch(a->q + n0 * rb, rb, k0 + 64 * h + 128 * PF_AHEAD);
        block_dwords(a->q + n0 * rb + k0 + 64 * h, rb, nr, dd);
        for (int j = 0; j < 16; j++) {
            __m512i d = _mm512_load_si512(dd + j);
            _mm512_store_si512(w + 32 * h + 2 * j, i8_pair(d, 0));
            _mm512_store_si512(w + 32 * h + 2 * j + 1, i8_pair(d, 2));
        }
    }
}

/* one group's sums of the tiles' rows of x (A, tile Ai, from xr) by the pairs (B, tile Bi) into tile Ci */
#define G8T_GROUP(Ci, Ai, Bi, k)                                                                                   \
    do {                                                                                                           \
        _tile_zero(Ci);                                                                                            \
        _tile_loadd(Ai, xr + (k), xstride);                                                                       \
        _tile_loadd(Bi, w + ((k) - k0) / 2, 64);                                                                   \
        _tile_dpbf16ps(Ci, Ai, Bi);                                                                                \
    } while (0)

/* rows mb .. mb + 15 of x (the tiles' a->tr rows; R of them real) over the chunk k0's groups, two in flight; each
 * row's 16 outputs (this block's weight rows) folded into tot[m] */
static void g8t_slab(const g8t_t *a, int64_t k0, int64_t mb, const __m512i *w, const uint32_t *sz, float *cg,
                     float *tot) {
    const uint16_t *xr = a->xa + mb * a->K;
    const int64_t gs = a->gs, xstride = a->K * 2 /* bytes between x's rows */, R = a->M - mb < 16 ? a->M - mb : 16;
    for (int64_t k = k0; k < k0 + 128 && k < a->K; k += 2 * gs) {
        G8T_GROUP(0, 1, 2, k);
        G8T_GROUP(3, 4, 5, k + gs);
        _tile_stored(0, cg, 64);
        _tile_stored(3, cg + 256, 64);
        for (int h = 0; h < 2; h++) {
            const int64_t g = (k >> a->gs_log2) + h;
            for (int64_t i = 0; i < R; i++) {
                float *ti = tot + (mb + i) * 16;
                __m512 S = _mm512_load_ps(cg + h * 256 + i * 16), xg = _mm512_set1_ps(a->xs[g * a->Mp + mb + i]);
                _mm512_store_ps(ti, g8t_fold(_mm512_load_ps(ti), sz, g, S, xg, a->u4));
            }
        }
    }
}

/* this thread's tiles: C (0, 3) tr rows x 16 floats; A (1, 4) tr rows x gs bf16; B (2, 5) gs / 2 pairs x 16 */
static void g8t_tiles_on(int64_t tr, int64_t gs) {
    const uint8_t r = (uint8_t)tr, h = (uint8_t)(gs / 2);
    const uint16_t ab = (uint16_t)(gs * 2);
    const uint8_t rows[8] = {r, r, h, r, r, h, 0, 0};
    const uint16_t colsb[8] = {64, ab, 64, 64, ab, 64, 0, 0};
    tiles_shape(rows, colsb);
}

/* The block's scales and zeros (bf16 [16 rows][G] each from row n0) as sz[g][r] = (s, z) of row r, group g, one
 * dword (zero beyond nr rows): 16 groups at a time interleaved and transposed, one transposition for both */
static void g8t_scales(const uint16_t *s, const uint16_t *z, int64_t G, int nr, uint32_t *sz) {
    for (int64_t g0 = 0; g0 < G; g0 += 16) {
        const __mmask16 m = G - g0 >= 16 ? 0xFFFF : (__mmask16)((1u << (G - g0)) - 1);
        __m512i r[16];
        for (int i = 0; i < 16; i++) {
            __m512i sv = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, s + i * G + g0));
            __m512i zv = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, z + i * G + g0));
            r[i] = i < nr ? _mm512_or_si512(sv, _mm512_slli_epi32(zv, 16)) : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int j = 0; j < 16 && g0 + j < G; j++) _mm512_store_si512(sz + (g0 + j) * 16, r[j]);
    }
}

static void g8t_slice(const void *arg, int t, int nthreads) {
    static __thread kw_buf fb;
    g8t_t *a = (g8t_t *)arg;
    const int64_t blocks = (a->N + 15) / 16, per = (blocks + nthreads - 1) / nthreads, G = a->G;
    const int64_t b0 = t * per, b1 = (t + 1) * per < blocks ? (t + 1) * per : blocks;
    if (b0 >= b1) return;
    uint32_t *sz = kw_scratch(&fb, (size_t)(16 * G + 16 * a->Mp + 512 + 64 * 16) * 4);
    if (!sz) {
        atomic_store(&a->fail, 1);
        return;
    }
    float *tot = (float *)(sz + 16 * G), *cg = tot + 16 * a->Mp;
    __m512i *w = (__m512i *)(cg + 512);
    const u4_consts c = u4_consts_make();
    g8t_tiles_on(a->tr, a->gs);
    for (int64_t b = b0; b < b1; b++) {
        const int64_t n0 = b * 16;
        const int nr = a->N - n0 < 16 ? (int)(a->N - n0) : 16;
        for (int64_t o = 0; o < 32 * G; o += 64) { /* the next block's scales and zeros (2 x 16 rows x G bf16) */
            _mm_prefetch((const char *)(a->s + (n0 + 16) * G) + o, _MM_HINT_T0);
            _mm_prefetch((const char *)(a->z + (n0 + 16) * G) + o, _MM_HINT_T0);
        }
        g8t_scales(a->s + n0 * G, a->z + n0 * G, G, nr, sz);
        memset(tot, 0, (size_t)(16 * a->M) * 4);
        for (int64_t k0 = 0; k0 < a->K; k0 += 128) {
            g8t_pairs(a, &c, n0, nr, k0, w);
            for (int64_t mb = 0; mb < a->M; mb += 16) g8t_slab(a, k0, mb, w, sz, cg, tot);
        }
        for (int64_t m = 0; m < a->M; m++)
            for (int i = 0; i < nr; i++) a->out[m * a->N + n0 + i] = f32_to_bf16(tot[m * 16 + i]);
    }
    _tile_release();
}

int g8_tiles(const uint16_t *x, const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t M,
             int64_t N, int64_t K, int64_t gs, int nthreads, int u4) {
    static __thread kw_buf xsb;
    if (M < 2 || !amx_on() || K % (u4 ? 128 : 64) || (gs != 16 && gs != 32)) return -1;
    const int64_t G = K / gs;
    g8t_t a = {s, z, (const uint8_t *)q, out, x, NULL, M, M, M, N, K, gs, G, gs == 16 ? 4 : 5, u4, 0};
    if (M <= 16) { /* the tiles as many rows as x: x as it lies */
        float *xs = kw_scratch(&xsb, (size_t)(G * M) * 4);
        if (!xs) return -2;
        x_group_sums(x, M, M, K, gs, xs);
        a.xs = xs;
    } else { /* 16-row tiles over x padded to a multiple of 16 */
        uint16_t *xp;
        float *xs;
        if (x_prep(x, M, K, gs, &xp, &xs, &a.Mp)) return -2;
        a.xa = xp, a.xs = xs, a.tr = 16;
    }
    amx_counted();
    kw_run(g8t_slice, &a, nthreads);
    return atomic_load(&a.fail) ? -2 : 0;
}
