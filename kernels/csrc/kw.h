/* keepwarm's native CPU kernels: what every source file shares (no instruction-set code here).
 *
 * Rules (every file):
 * - Weights, caches and x are only read (a weight may be a read-only mapping of the daemon's arena).
 * - Built with -ffp-contract=off: a product and a sum written apart stay apart (rounded where torch rounds).
 * - Entry points (kw_*) check their sizes and return 0, -1 on bad arguments, -2 without memory; nothing else
 *   is exported from the library (KW_INTERNAL: hidden).
 * - Threads: an entry point splits its work into slices run by kw_run (pool.c): on torch's OpenMP team where
 *   Python has seen one OpenMP runtime in the process (kw_use_openmp), else on a pool of T-1 threads of ours.
 * - Per-thread scratch comes from kw_scratch: one buffer per call site and thread, grown as needed, kept.
 * The files, by concern and instruction set, are listed in kernels/cpu_native.py (each with its own -m flags).
 */
#ifndef KW_H
#define KW_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KW_INTERNAL __attribute__((visibility("hidden")))
#define MAXT 64 /* threads per call at most */

/* float32 -> bf16, round to nearest even; NaN -> 0x7FC0, as torch's conversion. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* bf16 -> float32, exactly. */
static inline float bf16f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- pool.c: the thread pool and the scratch buffers ---- */
typedef void (*kw_slice_fn)(const void *arg, int t, int nthreads); /* slice t of nthreads of one call */

/* Runs fn's slices 0..nthreads-1 (slice 0 on the calling thread) and returns when every one is done. */
KW_INTERNAL void kw_run(kw_slice_fn fn, const void *arg, int nthreads);
/* nthreads clamped to 1..MAXT. */
KW_INTERNAL int kw_threads(int nthreads);

/* One scratch buffer of a call site, per thread (declare it `static __thread kw_buf`): 64-byte aligned, grown
 * to `bytes` when smaller (its contents then lost), kept between calls; NULL without memory. */
typedef struct {
    void *p;
    size_t cap;
} kw_buf;
KW_INTERNAL void *kw_scratch(kw_buf *b, size_t bytes);

/* ---- the entry points (Python binds them in kernels/cpu_native.py; tests/native/kw_test.c calls them) ---- */
void kw_use_openmp(int on);
/* AVX2 + FMA (every build) */
int kw_decode_attention(const uint16_t *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc, uint16_t *out,
                        const int64_t *plan, int64_t S, int64_t Hq, int64_t Hk, int64_t D, int64_t num_blocks,
                        int64_t bs, float scale, float softcap, int nthreads);
int kw_rms_norm(const uint16_t *x, int64_t xs, const uint16_t *res, int64_t rs, const uint16_t *w, uint16_t *out,
                uint16_t *newres, int64_t T, int64_t H, float eps);
int kw_rotary_neox(const uint16_t *q, int64_t qs, const uint16_t *k, int64_t ks, const float *cos, const float *sin,
                   int64_t cs, uint16_t *qo, uint16_t *ko, int64_t T, int64_t Hq, int64_t Hk, int64_t D);
int kw_store_kv(const uint16_t *k, int64_t ks, const uint16_t *v, int64_t vs, uint16_t *kc, uint16_t *vc,
                const int64_t *slots, int64_t T, int64_t Hk, int64_t D, int64_t num_blocks, int64_t bs);
int kw_bgemm(const float *x, const uint16_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K, int nthreads);
int kw_q8gemm(const float *x, const int8_t *q, const float *s, uint16_t *out, int64_t M, int64_t N, int64_t K,
              int fp8, int nthreads);
int kw_q4gemm(const float *x, const uint8_t *q, const uint16_t *sz, uint16_t *out, int64_t M, int64_t N, int64_t K,
              int64_t gs, int64_t B, int nthreads);
int kw_quant_int8(const uint16_t *w, int64_t N, int64_t K, int8_t *q, uint16_t *scales);
/* AVX512-BF16 (the avx512 build only); AMX and VBMI where the CPU has them */
int kw_gemm(const uint16_t *x, const int8_t *w, const float *scale, uint16_t *out, int64_t M, int64_t N, int64_t K,
            int fp8, int nthreads);
int kw_bgemv512(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K, int nthreads);
int kw_codes_bf16(const int8_t *w, uint16_t *out, int64_t N, int64_t K, int fp8, int nthreads);
int kw_amx_enable(int on);
long kw_amx_calls(void);
int kw_q4amx(const uint16_t *x, const uint8_t *q, const uint16_t *sz, uint16_t *out, int64_t M, int64_t N, int64_t K,
             int64_t gs, int64_t B, int nthreads);
int kw_q4vec(const uint16_t *x, const uint8_t *q, const uint16_t *sz, uint16_t *out, int64_t M, int64_t N, int64_t K,
             int64_t gs, int64_t B, int nthreads);

#endif /* KW_H */
