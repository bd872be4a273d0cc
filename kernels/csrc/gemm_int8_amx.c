/* The int8 / fp8 matmul on Intel's AMX tiles (amx-tile + amx-bf16), M > 1 and K % 32 == 0: the same sums as the
 * vector path (gemm_int8_avx512.c) on the tiles (tdpbf16ps), and the tile state both tile kernels share.
 *
 * The roles are swapped so the weight needs no pair reordering: A = 16 weight rows x 32 k, converted from their
 * codes straight into an L1 scratch in row order (each row contiguous, as stored); B = x's bf16 pairs transposed in
 * 16-row blocks (amx_pairs, once per call by the calling thread); C = out^T, 16 channels x 16 rows of x. Each output
 * is a float32 sum over k in a fixed order that does not depend on M or on the other rows, scaled in float32 and
 * rounded to bf16 once. Tile rules: every thread loads its config at the start of a slice (oneDNN may have used the
 * tiles on the same thread in between) and releases them at the end. Python turns the tiles on (kw_amx_enable) only
 * where /proc/cpuinfo lists amx_tile, amx_bf16 and avx512vbmi; until then nothing here runs a tile instruction.
 */
#include <sys/syscall.h>
#include <unistd.h>

#include "kw_avx512.h"

#define AKB 512        /* k per A scratch: 32 rows x 512 bf16 = 32 KiB */
#define AMX_MIN_ROWS 2 /* rows of x from which kw_gemm takes the tiles */
static int g_amx;               /* kw_amx_enable() succeeded: the kernels may run tile instructions */
static atomic_long g_amx_calls; /* kw_gemm / kw_q4amx calls that took the tiles (tests ask) */
long kw_amx_calls(void) { return atomic_load(&g_amx_calls); }
int amx_on(void) { return g_amx; }
void amx_counted(void) { atomic_fetch_add(&g_amx_calls, 1); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* This thread's tiles t < 8 as rows[t] rows x colsb[t] bytes; loaded at the start of each slice, released
 * (_tile_release) at its end. */
void tiles_shape(const uint8_t rows[8], const uint16_t colsb[8]) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = rows[t];
        cfg.colsb[t] = colsb[t];
    }
    /* GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of cfg, so out of line it dropped the other
     * stores (ldtilecfg then faulted): this empty asm reads all of cfg first. */
    __asm__ volatile("" : : "m"(cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* all eight as 16 rows x 64 bytes (the int8 and int4 kernels' one shape) */
void tiles_on(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    tiles_shape(rows, colsb);
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
static void tiles_amx(const job_t *j, const uint16_t *a, int64_t k0, int64_t kb, int64_t mb, int two, float *acc) {
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

void gemm_rows_amx(const job_t *j, int64_t n0, int64_t n1) {
    static __thread kw_buf a_b, acc_b;
    const int64_t K = j->K, M = j->M, N = j->N, Mp = j->Mp;
    uint16_t *a = kw_scratch(&a_b, (size_t)NT * AKB * 2);
    float *acc = kw_scratch(&acc_b, (size_t)Mp * NT * 4);
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

const uint32_t *amx_pairs(const uint16_t *x, int64_t M, int64_t K, int64_t Mp) {
    static __thread kw_buf xt_b;
    if (!g_amx || M < AMX_MIN_ROWS || K % 32) return NULL;
    uint32_t *xt = kw_scratch(&xt_b, (size_t)(Mp * K / 2 * 4));
    if (!xt) return NULL; /* no memory: the vector path */
    transpose_pairs(x, M, K, Mp, xt);
    amx_counted();
    return xt;
}
