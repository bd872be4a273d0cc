"""Triton paged attention over the head-major KV cache, and the KV-cache write.

Rules:
- Same signatures and semantics as `kernels/reference.py` (cache layout ``[num_kv_heads, num_blocks, block_size,
  head_dim]``; slot -1 skips a write; fp8 caches hold ``clamp(x / scale)``).
- Nothing here syncs with the host: grids and workspace sizes come from tensor shapes and the ``max_query_len``
  hint only, so both kernels run inside a CUDA graph.
- One attention kernel for a mixed batch of prefill chunks (with their cached prefix) and decodes: a program owns
  one kv head and a tile of query tokens of one sequence with all its GQA heads; online softmax in float32;
  positions past a sequence are never read; sliding windows skip blocks before every row's window; split-KV
  (flash-decoding) when too few programs fill the GPU, with a split count fixed by the grid, not the lengths.
- float8 caches convert unscaled (exact) to float16, k_scale folded into the softmax scale, v_scale applied once.
The design in full (grid, tiles, fp8, windows, split-KV): docs/kernels.md, "Paged attention".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_common as tc

_LOG2E = 1.4426950408889634
# Rows (token, head pairs) per program in mixed batches: 64 rows x 128 dims, the usual flash-attention tile, with 8
# warps (at 4 the float32 accumulator, Q and the scores need ~200 registers per thread on sm_90 and spill on
# sm_80); decode tiles use 16, tl.dot's minimum, with 4 warps (8 when decoding float8 or with float32 math, which
# otherwise spill). float32 models use true float32 products (no tensor cores: Triton's FMA dot holds whole operand
# rows in registers), so their tiles are halved as well. (Register counts from compiling for sm_80 and sm_90 with
# Triton's ptxas: tests/support/triton_compile_check.py; no GPU run here.)
_ROWS_MIXED = 64
_ROWS_MIXED_FP32 = 32
_ROWS_DECODE = 16
# KV positions per inner step: 64 keeps a bfloat16 K or V tile at 16 KB for head_dim 128; head_dim 256, or float32,
# halves it.
_BLOCK_N = 64
_BLOCK_N_SMALL = 32
# Split-KV: aim for 4 programs per SM: a decode program keeps only one K and one V tile in flight, and one or two
# per SM left an H200 at 33% of copy bandwidth for batch 1 x 32768 (16 slices, 128 programs; gpu-check, see
# docs/gpu.md). Never split below 256 positions per slice, so a slice's K/V reads (>= 256 * head_dim * 2 * 2
# bytes) dwarf its partial's write and re-read (~head_dim * 4 bytes per row); at most 64 slices (the combine step
# reads 64 x head_dim floats per row: 32 KB, one program).
_PROGRAMS_PER_SM = 4
_MIN_SPLIT_LEN = 256
_MAX_SPLITS = 64


@triton.jit
def _prefill_tile(tile, num_seqs, query_start_loc_ptr, BLOCK_Q: tl.constexpr):
    """(sequence, query tile within it) of program `tile`: the last sequence whose first tile index
    (query_start_loc[s] // BLOCK_Q + s) is <= tile; sequence -1 for a padding tile past every sequence."""
    # lo/hi start as tensors: Triton refuses a loop-carried variable that starts as a constexpr (num_seqs == 1 is
    # specialized).
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    return seq, tile - (tl.load(query_start_loc_ptr + tl.maximum(seq, 0)) // BLOCK_Q + seq)


@triton.jit
def _dot_query(q, qk_scale, F16_KV: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """q in the MMA's dtype, and the softmax scale that goes with it."""
    if F16_KV:
        # float8 K/V go to the MMA as float16 (DOT_DTYPE): exact, and one conversion instruction per two values
        # (float8 -> bfloat16 takes a detour through float32). q goes to float16 as well, scaled by a power of
        # two so that it cannot overflow (exact; undone in the softmax scale).
        qf = q.to(tl.float32)
        qmax = tl.max(tl.max(tl.abs(qf), 1), 0)
        shift = tl.maximum(((qmax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 141, 0)  # qmax < 2**15 after
        q = (qf * ((127 - shift) << 23).to(tl.float32, bitcast=True)).to(DOT_DTYPE)
        qk_scale = qk_scale * ((127 + shift) << 23).to(tl.float32, bitcast=True)
    else:
        q = q.to(DOT_DTYPE)
    return q, qk_scale


@triton.jit
def _softcap_log2(s, softcap):
    """softcap * tanh(x / softcap) of base-2 scores (qk_scale carries log2(e)): capped in natural log, back to base
    2."""
    x = s * (1.0 / 1.4426950408889634) / softcap
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * 1.4426950408889634


@triton.jit
def _kv_tile(ptrs, mask, FP8_KIND: tl.constexpr, NATIVE_FP8: tl.constexpr, KV_CAST: tl.constexpr,
             Q_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One K or V tile in the MMA's dtype: float8 as its unscaled codes (the scale is applied by the caller), a
    cache of another float dtype rounded to q's dtype first (as the reference does)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if FP8_KIND != 0:
        x = _fp8_codes(x, FP8_KIND, NATIVE_FP8, DOT_DTYPE)
    elif KV_CAST:
        x = tc.round_as(x.to(tl.float32), Q_DTYPE)
    return x.to(DOT_DTYPE)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, num_seqs, num_splits, qk_scale, k_scale, v_scale, window, softcap,
    stride_qt, stride_qh, stride_qd, stride_kh, stride_kb, stride_ks, stride_kd, stride_vh, stride_vb, stride_vs,
    stride_vd, stride_bt_s, stride_bt_b, stride_ot, stride_oh, stride_od, stride_ps, stride_pt, stride_ph, stride_pd,
    stride_ms, stride_mt, stride_mh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DECODE: tl.constexpr, SPLIT: tl.constexpr,
    FP8_KIND: tl.constexpr, KV_CAST: tl.constexpr, Q_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr, NATIVE_FP8: tl.constexpr, F16_KV: tl.constexpr, SOFTCAP: tl.constexpr,
):
    ROWS: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        seq = tile
        q_tile = 0
    else:
        seq, q_tile = _prefill_tile(tile, num_seqs, query_start_loc_ptr, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + tl.maximum(seq, 0))
    q_len = tl.load(query_start_loc_ptr + tl.maximum(seq, 0) + 1) - q_start
    first = q_tile * BLOCK_Q
    if (seq >= 0) & (first < q_len):
        ctx_len = tl.load(seq_lens_ptr + seq)
        r = tl.arange(0, ROWS)
        tok = first + r // GROUP_PAD  # token index within the sequence's query rows
        g = r % GROUP_PAD
        row_ok = (tok < q_len) & (g < GROUP)
        head = kv_head * GROUP + g
        q_pos = ctx_len - q_len + tok  # the row's absolute position: it sees positions <= q_pos
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        row = q_start + tok
        q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q, qk_scale = _dot_query(q, qk_scale, F16_KV, DOT_DTYPE)

        kv_end = ctx_len - q_len + tl.minimum(first + BLOCK_Q, q_len)  # the tile's last row sees < kv_end
        if SPLIT:
            chunk = tl.cdiv(tl.cdiv(ctx_len, num_splits), BLOCK_N) * BLOCK_N
            kv_lo = split * chunk
            kv_hi = tl.minimum(kv_lo + chunk, kv_end)
        else:
            kv_lo = 0
            kv_hi = kv_end
        if window > 0:  # nothing before the tile's first row's window is visible to any of its rows
            kv_lo = tl.maximum(kv_lo, ctx_len - q_len + first - window + 1)

        # Finite start (not -inf): a row with nothing to see in this slice keeps m=-1e30, l=0, acc=0, no NaN.
        m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
        v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
        for start in range(kv_lo, kv_hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_ok = pos < kv_hi
            block = tl.load(table + (pos // BLOCK_SIZE) * stride_bt_b, mask=pos_ok, other=0).to(tl.int64)
            off = pos % BLOCK_SIZE
            kv_mask = pos_ok[:, None] & d_ok[None, :]
            # fp8: the raw codes, exact in q's dtype; k_scale is folded into qk_scale.
            k = _kv_tile(k_base + block[:, None] * stride_kb + off[:, None] * stride_ks + d[None, :] * stride_kd,
                         kv_mask, FP8_KIND, NATIVE_FP8, KV_CAST, Q_DTYPE, DOT_DTYPE)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [ROWS, BLOCK_N]
            if SOFTCAP:
                s = _softcap_log2(s, softcap)
            seen = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
            if window > 0:
                seen = seen & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            # fp8: v_scale is applied to the accumulator once, after the loop.
            v = _kv_tile(v_base + block[:, None] * stride_vb + off[:, None] * stride_vs + d[None, :] * stride_vd,
                         kv_mask, FP8_KIND, NATIVE_FP8, KV_CAST, Q_DTYPE, DOT_DTYPE)
            # Probabilities rounded to the model dtype before P @ V, as the reference does.
            if F16_KV:  # noqa: SIM108 (a static branch on a constexpr, kept as a plain if for Triton)
                p = p.to(DOT_DTYPE)  # float16 holds probabilities more precisely than bfloat16
            else:
                p = tc.round_as(p, Q_DTYPE).to(DOT_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new

        if FP8_KIND != 0:
            acc = acc * v_scale
        if SPLIT:
            pa = part_acc_ptr + split * stride_ps + row[:, None] * stride_pt + head[:, None] * stride_ph
            tl.store(pa + d[None, :] * stride_pd, acc, mask=row_ok[:, None] & d_ok[None, :])
            pm = part_ml_ptr + split * stride_ms + row * stride_mt + head * stride_mh
            tl.store(pm, m_i, mask=row_ok)
            tl.store(pm + 1, l_i, mask=row_ok)
        else:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            dst = out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
            tl.store(dst, tc.to_dtype(o, Q_DTYPE), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _fp8_codes(bits, FP8_KIND: tl.constexpr, NATIVE: tl.constexpr, DTYPE: tl.constexpr):
    """float8 codes (uint8 bits) as DTYPE values, unscaled: exact for bfloat16, float16 and float32. NATIVE uses
    the hardware conversion (sm_89+); else the integer decode (older archs, the interpreter)."""
    if NATIVE:
        if FP8_KIND == 2:
            return bits.to(tl.float8e5, bitcast=True).to(DTYPE)
        else:
            return bits.to(tl.float8e4nv, bitcast=True).to(DTYPE)
    else:
        return tc.fp8_to_f32(bits, FP8_KIND).to(DTYPE)


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, query_start_loc_ptr, num_seqs, num_splits,
    stride_ps, stride_pt, stride_ph, stride_pd, stride_ms, stride_mt, stride_mh,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr, OUT_DTYPE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    # Rows outside every sequence (padding) were never written: they keep the zeros of the output.
    if (t >= tl.load(query_start_loc_ptr)) & (t < tl.load(query_start_loc_ptr + num_seqs)):
        sp = tl.arange(0, SPLITS_PAD)
        sp_ok = sp < num_splits
        pm = part_ml_ptr + sp * stride_ms + t * stride_mt + h * stride_mh
        m = tl.load(pm, mask=sp_ok, other=-1.0e30)
        ls = tl.load(pm + 1, mask=sp_ok, other=0.0)
        w = tl.exp2(m - tl.max(m, 0))  # every m is finite (an empty slice keeps -1e30): no NaN
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        acc = tl.load(part_acc_ptr + sp[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :] * stride_pd,
                      mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
        o = tl.sum(acc * w[:, None], 0) / tl.sum(ls * w, 0)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + d * stride_od, tc.to_dtype(o, OUT_DTYPE), mask=d_ok)


def _num_splits(device: torch.device, programs: int, max_context: int) -> int:
    sms = tc.sm_count(device)
    if sms == 0:
        return 1  # interpreter / CPU: no occupancy to gain
    want = (_PROGRAMS_PER_SM * sms) // max(programs, 1)
    return max(1, min(want, triton.cdiv(max_context, _MIN_SPLIT_LEN), _MAX_SPLITS))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """See `kernels.reference.paged_attention`. ``max_query_len`` (a host int, never read from the device) picks
    the decode grid when it is 1; None means "unknown" and takes the mixed grid. ``num_splits`` overrides the
    split-KV heuristic (tests)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    num_seqs = seq_lens.shape[0]
    out = torch.zeros_like(query)  # rows not owned by any sequence (padding) stay zero, as in the reference
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    group_pad = tc.next_pow2(group)
    block_d = tc.next_pow2(head_dim, 16)
    decode = max_query_len == 1
    dot = tc.dot_dtype(query.dtype)
    fp32 = query.dtype == torch.float32
    fp8 = tc.fp8_kind(key_cache.dtype)
    rows = _ROWS_DECODE if decode else _ROWS_MIXED_FP32 if fp32 else _ROWS_MIXED
    block_q = max(1, rows // group_pad)
    block_n = _BLOCK_N if block_d <= 128 and not fp32 else _BLOCK_N_SMALL
    native_fp8 = bool(fp8) and tc.native_fp8(query.device)
    f16_kv = native_fp8 and query.dtype in (torch.bfloat16, torch.float16)
    # float8 decoded with integer ops needs the registers of 8 warps; the hardware conversion does not.
    warps = 4 if decode and not fp32 and (not fp8 or native_fp8) else 8
    tiles = num_seqs if decode else num_tokens // block_q + num_seqs
    if num_splits is None:
        num_splits = _num_splits(query.device, tiles * num_kv_heads, block_tables.shape[1] * block_size)
    split = num_splits > 1
    if fp8:  # read as raw bits: the kernels decode float8 themselves (any GPU arch, and the interpreter)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    if split:
        part_acc = torch.empty(num_splits, num_tokens, num_q_heads, head_dim, dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty(num_splits, num_tokens, num_q_heads, 2, dtype=torch.float32, device=query.device)
    else:  # never touched (SPLIT is a constexpr); a placeholder for the pointer and stride arguments
        part_acc = part_ml = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=query.device)
    _paged_attention_kernel[(tiles, num_kv_heads, num_splits)](
        query, key_cache, value_cache, out, part_acc, part_ml,
        block_tables, seq_lens, query_start_loc,
        num_seqs, num_splits, scale * _LOG2E * (float(k_scale) if fp8 else 1.0), float(k_scale), float(v_scale),
        int(sliding_window or 0), float(logit_softcap or 0.0),
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(), *out.stride(),
        *part_acc.stride(), *part_ml.stride()[:3],
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_N=block_n, DECODE=decode, SPLIT=split, FP8_KIND=fp8,
        KV_CAST=not fp8 and key_cache.dtype != query.dtype, Q_DTYPE=tc.tl_dtype(query.dtype),
        DOT_DTYPE=tl.float16 if f16_kv else dot,
        PRECISION=tc.dot_precision(dot), NATIVE_FP8=native_fp8, F16_KV=f16_kv, SOFTCAP=logit_softcap is not None,
        num_warps=warps,
    )
    if split:
        # Grid: one program per (token row, query head): it reads that row's NUM_SPLITS partials (a few KB) and
        # writes head_dim outputs; 1 warp covers head_dim <= 64, 4 warps larger heads.
        _combine_splits_kernel[(num_tokens, num_q_heads)](
            part_acc, part_ml, out, query_start_loc, num_seqs, num_splits,
            *part_acc.stride(), *part_ml.stride()[:3], *out.stride(),
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS_PAD=tc.next_pow2(num_splits),
            OUT_DTYPE=tc.tl_dtype(query.dtype), num_warps=1 if block_d <= 64 else 4,
        )
    return out


# ---------------------------------------------------------------------------------------------- KV-cache write
@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale, num_kv_heads,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kch, stride_kcb, stride_kcs, stride_kcd, stride_vch, stride_vcb, stride_vcs, stride_vcd,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP8_KIND: tl.constexpr, FP8_MAX: tl.constexpr, CAST: tl.constexpr, CACHE_DTYPE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # -1: padding, skipped (it must not wrap around to the pool's last slot)
        block = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, HEADS_PAD)
        d = tl.arange(0, BLOCK_D)
        mask = (h < num_kv_heads)[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
        if FP8_KIND != 0:
            # clamp(x / scale) as the reference: a true division (div_rn, not the approximate '/'), then an
            # explicit clamp, since e4m3fn has no inf and an overflowing cast would produce NaN.
            k = tl.minimum(tl.maximum(tl.math.div_rn(k.to(tl.float32), k_scale), -FP8_MAX), FP8_MAX)
            v = tl.minimum(tl.maximum(tl.math.div_rn(v.to(tl.float32), v_scale), -FP8_MAX), FP8_MAX)
            k = tc.f32_to_fp8(k, FP8_KIND)
            v = tc.f32_to_fp8(v, FP8_KIND)
        elif CAST:
            k = tc.to_dtype(k.to(tl.float32), CACHE_DTYPE)
            v = tc.to_dtype(v.to(tl.float32), CACHE_DTYPE)
        kc = k_cache_ptr + block * stride_kcb + off * stride_kcs
        vc = v_cache_ptr + block * stride_vcb + off * stride_vcs
        tl.store(kc + h[:, None].to(tl.int64) * stride_kch + d[None, :] * stride_kcd, k, mask=mask)
        tl.store(vc + h[:, None].to(tl.int64) * stride_vch + d[None, :] * stride_vcd, v, mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """See `kernels.reference.write_kv_cache`. Grid: one program per token, all its kv heads at once (one slot
    lookup, Hk * head_dim elements: 1024 for Llama-8B, a few vector loads per thread)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = key_cache.shape[2]
    fp8 = tc.fp8_kind(key_cache.dtype)
    fp8_max = float(torch.finfo(key_cache.dtype).max) if fp8 else 0.0
    if fp8:  # written as raw bits: the kernel encodes float8 itself (bit-identical to torch's cast)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    cast = not fp8 and key.dtype != key_cache.dtype
    heads_pad = tc.next_pow2(num_kv_heads)
    block_d = tc.next_pow2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, float(k_scale), float(v_scale), num_kv_heads,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        HEAD_DIM=head_dim, BLOCK_D=block_d, HEADS_PAD=heads_pad, BLOCK_SIZE=block_size, FP8_KIND=fp8,
        FP8_MAX=fp8_max, CAST=cast, CACHE_DTYPE=tc.tl_dtype(key_cache.dtype) if cast else tl.float32,
        num_warps=4 if heads_pad * block_d >= 1024 else 1,  # 4 warps x 32 threads x 8 elements; small rows: 1
    )


IMPLS = {"paged_attention": paged_attention, "write_kv_cache": write_kv_cache}
