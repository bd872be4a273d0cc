/* int4 weight-only matmul for bf16 x on Intel's AMX tiles, above a few rows: x is A (its bf16 rows as they lie),
 * the (16 + code) pairs of gemm_int4_vbmi.c's scratch are B, C = x w^T. Per group the tiles start from zero, and the
 * group's sums enter the float32 total as on the vector units: total = fma(scale, sum x (16 + c), total), then
 * fma(zero - 24 scale, sum x, total). One order per output whatever M.
 */
#include "kw_avx512.h"

/* tot[m][c] for x rows mb..mb+15 and block b's channels, over the groups of k0..k0+kc; cg: float [16][64] */
static void q4_tiles_amx(const q4amx_t *a, int64_t b, const uint32_t *s, int64_t k0, int64_t kc, int64_t mb,
                         float *cg, float *tot) {
    const int64_t K = a->K, B = a->B, bs = B * 4;
    const uint16_t *x = a->x + mb * K;
    const int64_t R = a->M - mb < 16 ? a->M - mb : 16; /* rows past M are the tiles' padding: not folded */
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
            __m512 sc, zf;
            q4_scale_zero(a, g, b * B + c, &sc, &zf);
            for (int64_t i = 0; i < R; i++) {
                float *t = tot + (mb + i) * B + c;
                __m512 v = _mm512_fmadd_ps(sc, _mm512_loadu_ps(cg + i * 64 + c), _mm512_loadu_ps(t));
                _mm512_storeu_ps(t, _mm512_fmadd_ps(zf, _mm512_set1_ps(a->xs[g * a->Mp + mb + i]), v));
            }
        }
    }
}

static void q4amx_slice(const void *arg, int t, int nthreads) {
    q4amx_t *a = (q4amx_t *)arg;
    int64_t b0, b1;
    uint32_t *s;
    float *cg, *tot;
    int rc = q4_slice_start(a, t, nthreads, a->Mp, &b0, &b1, &s, &cg, &tot);
    if (rc > 0) return;
    if (rc < 0) {
        atomic_store(&a->fail, 1);
        return;
    }
    tiles_on();
    for (int64_t b = b0; b < b1; b++) {
        memset(tot, 0, (size_t)(a->Mp * a->B) * 4);
        for (int64_t k0 = 0; k0 < a->K; k0 += QKC) {
            int64_t kc = a->K - k0 < QKC ? a->K - k0 : QKC;
            q4_pack_pairs(a, b, k0, kc, s);
            for (int64_t mb = 0; mb < a->Mp; mb += 16) q4_tiles_amx(a, b, s, k0, kc, mb, cg, tot);
        }
        for (int64_t m = 0; m < a->M; m++)
            for (int64_t c = 0; c < a->B; c++) a->out[m * a->N + b * a->B + c] = f32_to_bf16(tot[m * a->B + c]);
    }
    _tile_release();
}

/* out = x w^T for bf16 x [M, K] and an int4 weight in the halves pack (kw_q4gemm's), on the tiles (q4_run's
 * codes; -1 also without AMX). */
int kw_q4amx(const uint16_t *x, const uint8_t *q, const uint16_t *sz, uint16_t *out, int64_t M, int64_t N, int64_t K,
             int64_t gs, int64_t B, int nthreads) {
    if (!amx_on()) return -1;
    int rc = q4_run(q4amx_slice, x, q, sz, out, M, N, K, gs, B, nthreads);
    if (rc == 0) amx_counted();
    return rc;
}
