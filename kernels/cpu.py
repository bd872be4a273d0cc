"""The torch backend's dense ops: on the CPU the kernel kernels/dispatch.py picks, else kernels/reference.py.

Rules:
- Each op asks `dispatch.select` once per call and runs the C kernel it names (kernels/native_ops.py) or the
  reference; no other branch picks a kernel. Off the CPU the rules never fit, so the torch backend on CUDA is the
  reference.
- The attention plan (`plan_attention`) is the reference plan plus, on the CPU with the switch on when it is built
  (once per step), the same rows as the C kernel reads them: decode rows rounded where the torch decode path rounds,
  prefill rows as one-row queries with SDPA's roundings, so a decode row's output never depends on a prefill
  sharing its step.
- Quantized and packed linears: kernels/quant.py, kernels/cpu_packed.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_native, dispatch, native_ops, reference

__all__ = ["AttentionPlan", "fused_add_rms_norm", "linear", "paged_attention", "plan_attention", "rms_norm",
           "rotary_embedding", "write_kv_cache"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    kernel = dispatch.select("linear", dispatch.rows_of(x), x, weight, bias)
    if kernel == dispatch.BF16_AVX512:
        return native_ops.bf16_gemv(x, weight)
    if kernel == dispatch.BF16_AVX2:
        return native_ops.bf16_linear(x, weight)
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if dispatch.select("rms_norm", 0, x, weight) == dispatch.C_RMS_NORM:
        return native_ops.rms_norm(x, None, weight, eps)[0]  # only the order of the sum of squares differs
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    if dispatch.select("fused_add_rms_norm", 0, x, residual, weight) == dispatch.C_RMS_NORM:
        out, added = native_ops.rms_norm(x, residual, weight, eps)
        assert added is not None
        return out, added
    new_residual = x + residual.to(x.dtype)
    return rms_norm(new_residual, weight, eps), new_residual  # the sum's norm may still take the C kernel


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_dim: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool = True, plan: reference.RotaryPlan | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    if plan is None:
        plan = reference.plan_rotary(positions, cos_sin_cache)
    if dispatch.select("rotary_embedding", 0, query, key, plan.cos, plan.sin, head_dim, is_neox) == dispatch.C_ROTARY:
        return native_ops.rotary_neox(query, key, plan.cos, plan.sin, head_dim)  # the same rounding, one C call
    return reference.rotary_embedding(positions, query, key, head_dim, cos_sin_cache, is_neox, plan)


@dataclass(frozen=True)
class AttentionPlan:
    """One step's :class:`reference.AttentionPlan` (``ref``) and, where the C kernel runs, its rows for it
    (native_ops.attention_plan): per sliding window the decode rows (``decode``), the prefill chunks' query rows in
    order (``prefill_rows``) and per window those rows as one-row queries (``prefill``)."""

    ref: reference.AttentionPlan
    decode: dict[int | None, torch.Tensor] | None = None
    prefill_rows: torch.Tensor | None = None
    prefill: dict[int | None, torch.Tensor] | None = None


def _native_decode(g: reference.DecodeGather, block_size: int) -> torch.Tensor:
    """A decode gather's rows as the C kernel reads them: the same blocks, read in place."""
    base = None if g.first is None else g.first * block_size
    return native_ops.attention_plan(g.table, g.ctx, g.lo, base)


def _native_prefill(block_tables: torch.Tensor, plan: reference.AttentionPlan, block_size: int,
                    windows: tuple[int | None, ...]) -> dict[int | None, torch.Tensor]:
    """Per sliding window, the prefill chunks' rows as rows of the C kernel: row i of a chunk of q_len rows whose
    sequence has context n sits at position n - q_len + i, so it sees the keys up to that position (from position
    - window + 1 under a sliding window) through its sequence's block-table row: a chunk runs as q_len one-row
    queries, with SDPA's roundings (scores and probabilities in float32, only the output rounded). Only the first
    visible positions differ between windows."""
    starts, lens, prefills = plan.starts, plan.lens, plan.prefills
    q_lens = torch.tensor([starts[s + 1] - starts[s] for s in prefills], dtype=torch.long)
    seq = torch.repeat_interleave(torch.tensor(prefills, dtype=torch.long), q_lens)  # [Tp] each row's sequence
    first = torch.tensor([lens[s] for s in prefills], dtype=torch.long) - q_lens + 1  # first row's context
    offsets = torch.cumsum(q_lens, 0) - q_lens  # where each chunk starts among the prefill rows
    ctx = torch.repeat_interleave(first - offsets, q_lens) + torch.arange(int(q_lens.sum()))
    table = block_tables[:, :-(-max(lens[s] for s in prefills) // block_size)].long()[seq]
    return {w: native_ops.attention_plan(table, ctx, (ctx - w).clamp(min=0) if w else None, None,
                                         float32_scores=True) for w in windows}


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   slot_mapping: torch.Tensor | None, block_size: int,
                   windows: tuple[int | None, ...] = (None,)) -> AttentionPlan:
    """The step's :class:`AttentionPlan` for layers using the sliding ``windows`` (None: full context)."""
    ref = reference.plan_attention(block_tables, seq_lens, query_start_loc, slot_mapping, block_size, windows)
    # The switch is read here, once per step; whether a layer's call fits (and the build), at the call.
    if block_tables.device.type != "cpu" or not cpu_native.switched_on():
        return AttentionPlan(ref)
    decode = {w: _native_decode(g, block_size) for w, g in ref.gathers.items()} if ref.decodes else None
    prefills = ref.prefills
    if not prefills:
        return AttentionPlan(ref, decode)
    rows = torch.cat([torch.arange(ref.starts[s], ref.starts[s + 1]) for s in prefills])
    return AttentionPlan(ref, decode, rows, _native_prefill(block_tables, ref, block_size, windows))


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                   plan: AttentionPlan | None = None) -> None:
    if dispatch.select("write_kv_cache", 0, key, value, key_cache, value_cache) == dispatch.C_STORE_KV:
        slots = slot_mapping if slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() \
            else slot_mapping.long().contiguous()
        native_ops.store_kv(key, value, key_cache, value_cache, slots)  # bf16 pools: no scale
        return
    reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                             None if plan is None else plan.ref)


def _c_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: float,
                 v_scale: float) -> bool:
    return dispatch.select("paged_attention", 0, q, key_cache, value_cache, k_scale, v_scale) == dispatch.C_ATTENTION


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    k_scale: float = 1.0, v_scale: float = 1.0, max_query_len: int | None = None,
                    sliding_window: int | None = None, logit_softcap: float | None = None,
                    plan: AttentionPlan | None = None) -> torch.Tensor:
    """:func:`reference.paged_attention`, the rows the C kernel takes computed by it (decode rows, and prefill rows
    as one-row queries), the others by the reference."""
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, None, key_cache.shape[2], (sliding_window,))
    ref = plan.ref
    if plan.decode is None and plan.prefill is None:
        return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                         scale, k_scale, v_scale, max_query_len, sliding_window, logit_softcap, ref)
    reference.check_attention(query, key_cache, ref, sliding_window)
    every_row = ref.decode_only and query.shape[0] == len(ref.decodes)  # no padding rows after the sequences
    decoded = None
    if ref.decodes:
        q = query if every_row else query[ref.decode_rows]
        if plan.decode is not None and _c_attention(q, key_cache, value_cache, k_scale, v_scale):
            decoded = native_ops.decode_attention(q, key_cache, value_cache, plan.decode[sliding_window], scale,
                                                  logit_softcap)  # rounded where the torch decode path rounds
        else:
            decoded = reference.attend_decodes(q, key_cache, value_cache, ref.gathers[sliding_window], scale,
                                               k_scale, v_scale, logit_softcap)
        if every_row:
            return decoded
    native, rows = plan.prefill, plan.prefill_rows
    if native is not None and not _c_attention(query, key_cache, value_cache, k_scale, v_scale):
        native = None
    if native is not None:
        if sliding_window not in native:
            raise ValueError(f"the attention plan has no prefill rows for sliding_window={sliding_window}")
        assert rows is not None
        if decoded is None and len(rows) == query.shape[0]:  # the step is prefill chunks only, with no padding
            return native_ops.decode_attention(query, key_cache, value_cache, native[sliding_window], scale,
                                               logit_softcap)
    out = torch.zeros_like(query)  # rows not owned by any sequence (padding) stay zero
    if decoded is not None:
        out[ref.decode_rows] = decoded
    if native is not None:
        out[rows] = native_ops.decode_attention(query[rows], key_cache, value_cache, native[sliding_window], scale,
                                                logit_softcap)
        return out
    reference.attend_prefills(out, query, key_cache, value_cache, block_tables, ref, scale, k_scale, v_scale,
                              sliding_window, logit_softcap)
    return out
