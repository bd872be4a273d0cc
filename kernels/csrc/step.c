/* A decode step's decoder layers in one call (AVX2 + FMA, every build): the Llama family's layer (RMSNorm with the
 * residual add, the fused qkv matmul, neox rotary, the KV store, paged decode attention, o, RMSNorm, gate-up, SiLU
 * times up, down) for every layer, where the torch path makes ~12 Python-level calls a layer, each a few
 * microseconds of dispatch on a 2-core CPU.
 *
 * Rules:
 * - Each op is the C entry point the torch backend's dispatch runs for the same rows (kw_rms_norm, kw_rotary_neox,
 *   kw_store_kv, kw_decode_attention, the matmul named by the weight's kind), called with the same operands and
 *   strides: the result is the torch path's bit for bit wherever the kinds are the dispatch's (the caller,
 *   kernels/cpu_step.py, says where they are not).
 * - SiLU times up rounds where ATen's bf16 silu and mul do: s = bf16(g / (1 + exp(-g))), out = bf16(s * up), with
 *   the vector expf ATen's silu runs (Sleef's, from libtorch_cpu; the caller passes it). I % 8 == 0.
 * - The layers' weights and the caches are described once (kw_layer); a call passes what changes per step. Scratch:
 *   kw_scratch buffers of the calling thread. Returns 0, -1 on bad arguments, -2 without memory, or
 *   -(10 + 16 * layer + op) when op (1 norm, 2 qkv, 3 rotary, 4 store, 5 attention, 6 o, 7 norm, 8 gate-up, 9 down)
 *   of that layer refused its operands.
 */
#include "kw_avx2.h"

int kw_q8group(const uint16_t *x, const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t M,
               int64_t N, int64_t K, int64_t gs, int nthreads);
int kw_q8group_u4(const uint16_t *x, const uint8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out, int64_t M,
                  int64_t N, int64_t K, int64_t gs, int nthreads);
/* The avx512 build's matmuls: NULL in the avx2 build (weak references). */
int kw_q8group512(const uint16_t *x, const int8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out,
                  int64_t M, int64_t N, int64_t K, int64_t gs, int nthreads) __attribute__((weak));
int kw_q8group512_u4(const uint16_t *x, const uint8_t *q, const uint16_t *s, const uint16_t *z, uint16_t *out,
                     int64_t M, int64_t N, int64_t K, int64_t gs, int nthreads) __attribute__((weak));
int kw_q4vec(const uint16_t *x, const uint8_t *q, const uint16_t *sz, uint16_t *out, int64_t M, int64_t N, int64_t K,
             int64_t gs, int64_t B, int nthreads) __attribute__((weak));
int kw_q4amx(const uint16_t *x, const uint8_t *q, const uint16_t *sz, uint16_t *out, int64_t M, int64_t N, int64_t K,
             int64_t gs, int64_t B, int nthreads) __attribute__((weak));
int kw_bgemv512(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K, int nthreads)
    __attribute__((weak));

/* A linear's kernel (kernels/cpu_step.py's KINDS). */
enum { KW_Q8G = 1, KW_Q8G512 = 2, KW_Q4GEMM = 3, KW_Q4VEC = 4, KW_Q4AMX = 5, KW_BGEMM = 6, KW_Q8G_U4 = 7,
       KW_Q8G512_U4 = 8, KW_BGEMV512 = 9 };

typedef struct {
    int64_t kind;                       /* KW_Q8G ... KW_BGEMV512: the matmul for this call's rows */
    const void *q;                      /* int8 codes [N, K], the 4-bit group pack [N, K / 2] (_U4), the int4 halves
                                           pack, or bf16 [N, K] (KW_BGEMM, KW_BGEMV512) */
    const uint16_t *s, *z;              /* int8 groups: scales, zeros [N, K / gs]; int4: scales_and_zeros */
    int64_t N, K, gs, B;                /* B: the int4 pack's block of rows */
} kw_lin;

typedef struct {
    const uint16_t *in_norm, *post_norm; /* [H] */
    uint16_t *kc, *vc;                   /* the layer's pools [Hk, num_blocks, bs, D] */
    kw_lin qkv, o, gate_up, down;
} kw_layer;

typedef struct {
    int64_t L, H, Hq, Hk, D, I, num_blocks, bs;
    float eps, scale, softcap, unused;
    __m256 (*exp8)(__m256); /* Sleef's 8-lane expf, as ATen's silu runs it */
} kw_model;

/* x float32 [n] from bf16 (the AVX2 kernels' operand), in a scratch of this call site; `split`: each 16 values as
 * their 8 even then 8 odd (kw_bgemm's order; n a multiple of 16). */
static const float *widen(const uint16_t *x, int64_t n, int split) {
    static __thread kw_buf b;
    float *f = kw_scratch(&b, (size_t)n * 4);
    if (f && !split)
        for (int64_t i = 0; i < n; i++) f[i] = bf16f(x[i]);
    if (f && split)
        for (int64_t i = 0; i < n; i += 16)
            for (int j = 0; j < 8; j++) {
                f[i + j] = bf16f(x[i + 2 * j]);
                f[i + 8 + j] = bf16f(x[i + 2 * j + 1]);
            }
    return f;
}

static int lin(const kw_lin *w, const uint16_t *x, uint16_t *out, int64_t M, int nt) {
    const float *xf;
    switch (w->kind) {
    case KW_Q8G:
        return kw_q8group(x, w->q, w->s, w->z, out, M, w->N, w->K, w->gs, nt);
    case KW_Q8G512:
        return kw_q8group512 ? kw_q8group512(x, w->q, w->s, w->z, out, M, w->N, w->K, w->gs, nt) : -1;
    case KW_Q8G_U4:
        return kw_q8group_u4(x, w->q, w->s, w->z, out, M, w->N, w->K, w->gs, nt);
    case KW_Q8G512_U4:
        return kw_q8group512_u4 ? kw_q8group512_u4(x, w->q, w->s, w->z, out, M, w->N, w->K, w->gs, nt) : -1;
    case KW_Q4VEC:
        return kw_q4vec ? kw_q4vec(x, w->q, w->s, out, M, w->N, w->K, w->gs, w->B, nt) : -1;
    case KW_Q4AMX:
        return kw_q4amx ? kw_q4amx(x, w->q, w->s, out, M, w->N, w->K, w->gs, w->B, nt) : -1;
    case KW_Q4GEMM:
        if (!(xf = widen(x, M * w->K, 0))) return -2;
        return kw_q4gemm(xf, w->q, w->s, out, M, w->N, w->K, w->gs, w->B, nt);
    case KW_BGEMM:
        if (w->K % 16) return -1;
        if (!(xf = widen(x, M * w->K, 1))) return -2;
        return kw_bgemm(xf, w->q, out, M, w->N, w->K, nt);
    case KW_BGEMV512:
        return kw_bgemv512 ? kw_bgemv512(x, w->q, out, M, w->N, w->K, nt) : -1;
    default:
        return -1;
    }
}

typedef __m256 (*exp8_fn)(__m256);

/* out [T, I] = bf16(bf16(silu(g)) * u) for g = gu[:, :I], u = gu[:, I:] (gu [T, 2I] contiguous), I % 8 == 0. */
static void silu_mul(exp8_fn exp8, const uint16_t *gu, uint16_t *out, int64_t T, int64_t I) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gu + t * 2 * I, *u = g + I;
        uint16_t *o = out + t * I;
        for (int64_t i = 0; i < I; i += 8) {
            __m256 gv = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(g + i))), 16));
            __m256 uv = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(u + i))), 16));
            __m256 s = bf16_round(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign)))));
            __m256i b = _mm256_srli_epi32(bf16_bits(_mm256_mul_ps(s, uv)), 16);
            _mm_storeu_si128((__m128i *)(o + i),
                             _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
        }
    }
}

typedef struct {
    uint16_t *h, *qkv, *qo, *ko, *ao, *gu, *act;
} bufs_t;

static int buffers(const kw_model *m, int64_t T, bufs_t *b) {
    static __thread kw_buf buf;
    const int64_t nqkv = (m->Hq + 2 * m->Hk) * m->D, hq = m->Hq * m->D, hk = m->Hk * m->D;
    int64_t sizes[7] = {m->H, nqkv, hq, hk, hq, 2 * m->I, m->I}, total = 0;
    for (int i = 0; i < 7; i++) total += (sizes[i] + 31) / 32 * 32; /* 64-byte aligned rows of each buffer */
    uint16_t *p = kw_scratch(&buf, (size_t)(total * T) * 2);
    if (!p) return -2;
    uint16_t **dst[7] = {&b->h, &b->qkv, &b->qo, &b->ko, &b->ao, &b->gu, &b->act};
    for (int i = 0; i < 7; i++) {
        *dst[i] = p;
        p += (sizes[i] + 31) / 32 * 32 * T;
    }
    return 0;
}

#define OP(layer, op, call)                                                                                         \
    do {                                                                                                            \
        int rc_ = (call);                                                                                           \
        if (rc_ == -2) return -2;                                                                                   \
        if (rc_ != 0) return -(10 + 16 * (int)(layer) + (op));                                                      \
    } while (0)

/* One layer: x [T, H] in (the last layer's output, or the embeddings for layer 0: then res is set to them), out. */
static int layer(const kw_model *m, const kw_layer *ly, int64_t l, uint16_t *x, uint16_t *res, int64_t T,
                 const float *cos, const float *sin, int64_t cs, const int64_t *slots, const int64_t *plan,
                 const bufs_t *b, int nt) {
    const int64_t H = m->H, D = m->D, nqkv = (m->Hq + 2 * m->Hk) * D, hq = m->Hq * D, hk = m->Hk * D;
    if (l == 0) {
        memcpy(res, x, (size_t)(T * H) * 2);
        OP(l, 1, kw_rms_norm(x, H, NULL, 0, ly->in_norm, b->h, NULL, T, H, m->eps));
    } else {
        OP(l, 1, kw_rms_norm(x, H, res, H, ly->in_norm, b->h, res, T, H, m->eps));
    }
    OP(l, 2, lin(&ly->qkv, b->h, b->qkv, T, nt));
    OP(l, 3, kw_rotary_neox(b->qkv, nqkv, b->qkv + hq, nqkv, cos, sin, cs, b->qo, b->ko, T, m->Hq, m->Hk, D));
    OP(l, 4, kw_store_kv(b->ko, hk, b->qkv + hq + hk, nqkv, ly->kc, ly->vc, slots, T, m->Hk, D, m->num_blocks,
                         m->bs));
    OP(l, 5, kw_decode_attention(b->qo, hq, ly->kc, ly->vc, b->ao, plan, T, m->Hq, m->Hk, D, m->num_blocks, m->bs,
                                 m->scale, m->softcap, nt));
    OP(l, 6, lin(&ly->o, b->ao, x, T, nt));
    OP(l, 7, kw_rms_norm(x, H, res, H, ly->post_norm, b->h, res, T, H, m->eps));
    OP(l, 8, lin(&ly->gate_up, b->h, b->gu, T, nt));
    silu_mul(m->exp8, b->gu, b->act, T, m->I);
    OP(l, 9, lin(&ly->down, b->act, x, T, nt));
    return 0;
}

/* silu_mul alone (tests): 0, or -1 on bad sizes. */
int kw_silu_mul(const uint16_t *gu, uint16_t *out, int64_t T, int64_t I, const void *exp8) {
    if (T < 0 || I < 8 || I % 8 || !exp8) return -1;
    exp8_fn f;
    memcpy(&f, &exp8, sizeof f);
    silu_mul(f, gu, out, T, I);
    return 0;
}

/* x [T, H] bf16: in, the embeddings of the step's T decode rows (one per sequence, in the plan's order); out, the
 * last layer's MLP output; res [T, H]: out, the residual (the final norm adds them). cos, sin [T, D / 2] float32
 * (row stride cs): the rows at the step's positions; slots [T]; plan: kw_decode_attention's. */
int kw_decode_step(const kw_model *m, const kw_layer *layers, uint16_t *x, uint16_t *res, int64_t T, const float *cos,
                   const float *sin, int64_t cs, const int64_t *slots, const int64_t *plan, int nthreads) {
    if (!m || !layers || T < 1 || m->L < 1 || m->I < 8 || m->I % 8 || !m->exp8) return -1;
    bufs_t b;
    if (buffers(m, T, &b)) return -2;
    for (int64_t l = 0; l < m->L; l++) {
        int rc = layer(m, layers + l, l, x, res, T, cos, sin, cs, slots, plan, &b, nthreads);
        if (rc) return rc;
    }
    return 0;
}
