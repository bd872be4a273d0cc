/* int8 per-row quantization of a bfloat16 weight (the daemon's preload; scalar code, built with the AVX2 flags so
 * the rounding and clamps compile to vector instructions).
 *
 * keepwarm.formats.quant's int8 formula, bit for bit: scale = amax|w| / 127 in float32 (1 for an all-zero row),
 * stored as bfloat16 rounded to nearest even and one step up where that rounded down (so no code clips); code =
 * round-half-even(w / stored) in float32, clamped to +-127. The row's max is taken on the bits (|bf16| orders as
 * its low 15 bits), which also finds a NaN or an infinity: then -1 and q / scales are not to be used. One thread:
 * the daemon's preload runs several tensors at once.
 */
#include "kw.h"

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
