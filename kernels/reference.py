"""Plain-torch kernels: the numerical reference every backend is tested against, and nothing else.

Rules:
- Only torch ops: no C kernel, no switch, no device-specific branch; correct on every device and dtype.
- Rounds where transformers rounds (HF's op order, float32 softmax, bf16 scores on decode rows): the C kernels
  (kernels/cpu.py picks them) and the Triton kernels round at the same points.
- Vectorized over tokens; only prefill chunks of paged attention loop (per sequence).
- Model code goes through `keepwarm.kernels`; kernels/cpu.py falls back to these where no C kernel takes a call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

# Caches of these dtypes hold scaled values: stored = clamp(x / scale), read = stored * scale.
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF LlamaRMSNorm, bit for bit: F.rms_norm without a weight runs HF's op sequence (float32 upcast, pow(2),
    # mean, + eps, rsqrt, multiply, cast back) in one call instead of seven from Python; the weight multiplies
    # after the cast, in the model's dtype, as in HF (with a weight, F.rms_norm would multiply before the cast).
    normed = F.rms_norm(x, (x.shape[-1],), None, eps)
    # normed is always a new tensor (a multiply's result), so scaling it in place touches no input.
    return normed.mul_(weight) if weight.dtype == normed.dtype else weight * normed


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual.to(x.dtype)
    return rms_norm(new_residual, weight, eps), new_residual


def build_cos_sin_cache(
    rot_dim: int, max_position: int, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> torch.Tensor:
    """[max_position, rot_dim] float32: cat(cos(p * inv_freq), sin(p * inv_freq)) * attention_scaling."""
    if rot_dim % 2 or inv_freq.numel() != rot_dim // 2:
        raise ValueError(f"rot_dim={rot_dim} needs an even rot_dim and rot_dim // 2 inv_freq entries, "
                         f"got {inv_freq.numel()}")
    t = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    # Elementwise product, as HF computes freqs, so the table matches HF's cos/sin bit-for-bit.
    freqs = t[:, None] * inv_freq.float()[None, :]
    return torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)


@dataclass(frozen=True)
class RotaryPlan:
    """One step's rows of a cos/sin table (:func:`plan_rotary`), gathered once for every layer that reads it.

    ``cos``/``sin``: [T, rot_dim // 2] float32. ``cos2`` = cat(cos, cos) and ``sin2`` = cat(-sin, sin), both
    [T, 1, rot_dim]: with them the neox rotation is ``x * cos2 + roll(x, rot_dim // 2) * sin2``, which is HF's
    ``x * cos + rotate_half(x) * sin`` element for element (``x2 * -s`` is exactly ``-x2 * s``)."""

    cos: torch.Tensor
    sin: torch.Tensor
    cos2: torch.Tensor
    sin2: torch.Tensor


def plan_rotary(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> RotaryPlan:
    cos_sin = cos_sin_cache.index_select(0, positions.long()).float()
    cos, sin = cos_sin.chunk(2, dim=-1)
    return RotaryPlan(cos, sin, torch.cat((cos, cos), dim=-1)[:, None], torch.cat((-sin, sin), dim=-1)[:, None])


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, is_neox: bool
) -> torch.Tensor:
    """x: [T, H*head_dim] (or [T, H, head_dim]); cos/sin: [T, rot_dim // 2] float32."""
    h = x.reshape(x.shape[0], -1, head_dim).float()
    rot_dim = cos.shape[-1] * 2
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot = h[..., :rot_dim]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        # x1*cos - x2*sin is exactly HF's x1*cos + (-x2)*sin: IEEE a - b == a + (-b).
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if rot_dim < head_dim:
        out = torch.cat((out, h[..., rot_dim:]), dim=-1)
    return out.to(x.dtype).reshape(x.shape)


def _rotate_neox_full(q: torch.Tensor, k: torch.Tensor, head_dim: int, plan: RotaryPlan
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated over whole heads as one [T, Hq + Hk, head_dim] float32 tensor: cat into a float32 buffer,
    roll, three ops in place, the cast back (on CPU a decode step's rotary is op overhead, not arithmetic)."""
    T = q.shape[0]
    q3, k3 = q.reshape(T, -1, head_dim), k.reshape(T, -1, head_dim)
    h = torch.empty((T, q3.shape[1] + k3.shape[1], head_dim), dtype=torch.float32, device=q.device)
    torch.cat((q3, k3), dim=1, out=h)
    rolled = torch.roll(h, head_dim // 2, -1).mul_(plan.sin2)
    both = h.mul_(plan.cos2).add_(rolled).to(q.dtype)  # (x * cos) + (rotate_half(x) * sin), HF's order
    return both[:, :q3.shape[1]].reshape(q.shape), both[:, q3.shape[1]:].reshape(k.shape)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_dim: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    plan: RotaryPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``plan``: the step's rows of ``cos_sin_cache`` (plan_rotary at these positions); else gathered here."""
    if plan is None:
        plan = plan_rotary(positions, cos_sin_cache)
    cos, sin = plan.cos, plan.sin
    if cos.shape[-1] * 2 > head_dim:
        raise ValueError(f"rotary dim {cos.shape[-1] * 2} exceeds head_dim {head_dim}")
    if is_neox and cos.shape[-1] * 2 == head_dim and query.dtype == key.dtype:
        return _rotate_neox_full(query, key, head_dim, plan)
    if query.dtype != key.dtype:
        return _rotate(query, cos, sin, head_dim, is_neox), _rotate(key, cos, sin, head_dim, is_neox)
    # q and k rotated as one [T, Hq + Hk, head_dim] tensor: the same math per element in half the ops.
    T = query.shape[0]
    q = query.reshape(T, -1, head_dim)
    both = _rotate(torch.cat((q, key.reshape(T, -1, head_dim)), dim=1), cos, sin, head_dim, is_neox)
    return both[:, :q.shape[1]].reshape(query.shape), both[:, q.shape[1]:].reshape(key.shape)


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype in FP8_DTYPES:
        fmax = torch.finfo(dtype).max
        # Clamp explicitly: not every cast saturates (e4m3fn has no inf, so overflow can become NaN).
        return (x.float() / scale).clamp(-fmax, fmax).to(dtype)
    return x.to(dtype)


def _from_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache contents in the compute dtype (the query's): fp8 is dequantized with its per-layer scale."""
    if x.dtype in FP8_DTYPES:
        return x.to(dtype) * scale
    return x if x.dtype == dtype else x.to(dtype)


def _write_targets(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots to write and the rows they come from (None: every row); padding (slot -1) is dropped."""
    slots = slot_mapping.long()
    valid = slots >= 0
    if bool(valid.all()):
        return slots, None
    rows = valid.nonzero()[:, 0]
    return slots[rows], rows


def _store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache [Hk, NB, bs, D] at flat slots [n] <- x [Hk, n, D]. One index_copy_ into a flat view of a contiguous
    pool (3x faster than two-index assignment on CPU); (block, offset) indexing for a non-contiguous view."""
    hk, nb, bs, d = cache.shape
    if not cache.is_contiguous():
        cache[:, slots // bs, slots % bs] = x
        return
    if cache.dtype in FP8_DTYPES:  # index_copy_ has no float8 kernel: the same bytes as uint8
        cache, x = cache.view(torch.uint8), x.view(torch.uint8)
    cache.view(hk, nb * bs, d).index_copy_(1, slots, x)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    plan: AttentionPlan | None = None,
) -> None:
    """``plan`` (plan_attention): the step's slots with padding already dropped; else derived from slot_mapping."""
    # Drop padding before indexing: slot -1 would otherwise wrap around to the last slot of the pool.
    if plan is not None and plan.write_slots is not None:
        slots, rows = plan.write_slots, plan.write_rows
    else:
        slots, rows = _write_targets(slot_mapping)
    if rows is not None:
        key, value = key[rows], value[rows]
    _store(key_cache, slots, _to_cache(key, key_cache.dtype, k_scale).transpose(0, 1))
    _store(value_cache, slots, _to_cache(value, value_cache.dtype, v_scale).transpose(0, 1))


def _gather_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The blocks of ``table`` [S, nb] as [Hk, S, nb * block_size, D]: one copy, already in the layout the
    attention matmuls want. index_select, because advanced indexing on a large pool intermittently takes
    milliseconds on CPU (seen with torch 2.13: 3 ms vs 3 us for the same gather)."""
    hk, _, bs, d = cache.shape
    return cache.index_select(1, table.reshape(-1)).view(hk, table.shape[0], table.shape[1] * bs, d)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          causal: bool = False) -> torch.Tensor:
    """q: [B, Hq, Lq, D], k/v: [B, Hk, Lk, D]; mask True = attend. GQA via enable_gqa. In the inputs' dtype:
    torch's CPU flash kernel accumulates bf16/fp16 in float32 itself, so no upcast copy of K/V is needed."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def _softcap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's logit soft-capping, ``cap * tanh(s / cap)``, in transformers' op order."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor, scale: float,
                      k_scale: float, v_scale: float, softcap: float | None = None) -> torch.Tensor:
    """One query row per sequence: q [S, Hq, D], k/v [Hk, S, L, D] (gathered), masked [S, 1, L] (True: a key the
    row must not see) -> [S, Hq, D].

    Two batched matmuls with (kv head, sequence) as the batch and the query heads of one kv head as rows (GQA
    without repeating K/V); K is used transposed in place, so nothing is copied after the gather. Scores are
    computed in the model's dtype (float32 accumulation inside the matmul) and the softmax in float32. On CPU
    this is ~6x faster than SDPA's flash kernel with a mask for single-row queries.
    """
    S, Hq, D = q.shape
    Hk, _, L, _ = k.shape
    G = Hq // Hk
    dt = q.dtype
    # bmm over (kv head, sequence) flattened: what torch.matmul does with these 4-d operands, minus its expand and
    # reshape ops (q needs a copy only when S > 1; the gathered K/V are contiguous, so theirs are views).
    qg = q.reshape(S, Hk, G, D).transpose(0, 1).reshape(Hk * S, G, D)
    kt = _from_cache(k, k_scale, dt).reshape(Hk * S, L, D).transpose(1, 2)
    scores = torch.bmm(qg, kt).view(Hk, S, G, L).float().mul_(scale)
    scores = _softcap(scores, softcap)
    scores.masked_fill_(masked, float("-inf"))  # [S, 1, L] broadcasts over kv heads and query heads
    probs = torch.softmax(scores, dim=-1).to(dt).view(Hk * S, G, L)
    out = torch.bmm(probs, _from_cache(v, v_scale, dt).reshape(Hk * S, L, D))  # [Hk * S, G, D]
    return out.view(Hk, S, G, D).transpose(0, 1).reshape(S, Hq, D)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                      softcap: float | None) -> torch.Tensor:
    """Explicit attention for soft-capped scores (SDPA cannot cap): q [1, Hq, Lq, D], k/v [1, Hk, L, D],
    mask [Lq, L] True = attend -> [1, Hq, Lq, D]. Scores and softmax in float32, as transformers' eager path."""
    _, Hq, Lq, D = q.shape
    Hk = k.shape[1]
    qg = q[0].reshape(Hk, Hq // Hk, Lq, D)
    scores = _softcap(torch.matmul(qg, k[0, :, None].transpose(-1, -2)).float() * scale, softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v[0, :, None]).reshape(1, Hq, Lq, D)


@dataclass(frozen=True)
class DecodeGather:
    """What the decode rows of one step read under one sliding window: the blocks to gather and the keys to mask."""

    table: torch.Tensor  # [Sd, nb] int64 block ids (columns past a sequence's last block point at block 0)
    masked: torch.Tensor  # [Sd, 1, nb * block_size] bool: True where a gathered key is outside the row's context
    ctx: torch.Tensor  # [Sd] int64 context lengths
    # [Sd] int64 first visible positions and the block column each gather starts at; None without a window
    lo: torch.Tensor | None = None
    first: torch.Tensor | None = None


@dataclass(frozen=True)
class AttentionPlan:
    """One step's attention metadata in the form the torch kernels read, built once per step by
    :func:`plan_attention` and shared by every layer (rebuilding it per layer cost ~3% of a CPU decode step).

    It is derived from the step's AttentionMetadata and nothing else, so a kernel given the plan computes exactly
    what it computes without one."""

    starts: list[int]  # query_start_loc on the host
    lens: list[int]  # seq_lens on the host
    decodes: list[int]  # the sequences with one query row
    decode_rows: torch.Tensor  # [Sd] int64: their query rows
    decode_only: bool  # every sequence has one row and row s is sequence s's (the output needs no scatter)
    gathers: dict[int | None, DecodeGather]  # per sliding window (None: full context) the model's layers use
    # The KV slots written this step, [T'] int64 with padding (slot -1) dropped, and the rows they come from
    # (None: every row). write_slots is None when the plan was made without a slot_mapping.
    write_slots: torch.Tensor | None
    write_rows: torch.Tensor | None

    @property
    def prefills(self) -> list[int]:
        """The sequences with more than one query row (prefill chunks)."""
        return [s for s in range(len(self.lens)) if self.starts[s + 1] - self.starts[s] > 1]


def _decode_gather(block_tables: torch.Tensor, seq_lens: torch.Tensor, decodes: list[int], lens: list[int],
                   block_size: int, window: int | None) -> DecodeGather:
    """The decode rows' gather under ``window``: each sequence's gather starts at the block holding its first
    visible key (so a windowed batch reads at most ceil(window / block_size) + 1 blocks per sequence)."""
    device = block_tables.device
    seqs = torch.tensor(decodes, dtype=torch.long, device=device)
    ctx = seq_lens.to(device=device, dtype=torch.long)[seqs]
    lo_t = first = None
    if window:
        lo = [max(0, lens[s] - window) for s in decodes]  # each sequence's first visible position
        first = torch.tensor([p // block_size for p in lo], dtype=torch.long, device=device)
        num_blocks = max(-(-lens[s] // block_size) - p // block_size for s, p in zip(decodes, lo, strict=True))
        cols = first[:, None] + torch.arange(num_blocks, device=device)[None, :]  # [Sd, nb] table columns
        table = block_tables[seqs].long().gather(1, cols.clamp(max=block_tables.shape[1] - 1))
    else:
        num_blocks = -(-max(lens[s] for s in decodes) // block_size)
        cols = torch.arange(num_blocks, device=device)[None, :]
        table = block_tables[seqs, :num_blocks].long()
    # Columns past a sequence's last block may be garbage or past the table: point them at block 0 instead.
    table = torch.where(cols * block_size < ctx[:, None], table, 0)
    if window:
        lo_t = torch.tensor(lo, device=device)
        pos = (cols[:, :, None] * block_size + torch.arange(block_size, device=device)).reshape(len(decodes), -1)
        pos_ok = (pos < ctx[:, None]) & (pos >= lo_t[:, None])  # [Sd, L]
    else:
        pos_ok = torch.arange(num_blocks * block_size, device=device)[None, :] < ctx[:, None]
    return DecodeGather(table, ~pos_ok[:, None, :], ctx, lo_t, first)


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   slot_mapping: torch.Tensor | None, block_size: int,
                   windows: tuple[int | None, ...] = (None,)) -> AttentionPlan:
    """The :class:`AttentionPlan` of one step whose layers use the sliding ``windows`` (None: full context)."""
    if any(w is not None and w < 1 for w in windows):
        raise ValueError(f"sliding_window must be >= 1, got {windows}")
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    gathers = {w: _decode_gather(block_tables, seq_lens, decodes, lens, block_size, w) for w in windows} \
        if decodes else {}
    slots, rows = _write_targets(slot_mapping) if slot_mapping is not None else (None, None)
    return AttentionPlan(starts, lens, decodes,
                         torch.tensor([starts[s] for s in decodes], dtype=torch.long, device=block_tables.device),
                         len(decodes) == len(lens) and starts == list(range(len(lens) + 1)), gathers, slots, rows)


def check_attention(query: torch.Tensor, key_cache: torch.Tensor, plan: AttentionPlan,
                    sliding_window: int | None) -> None:
    """The checks every paged_attention makes before computing: GQA heads, and a gather for the window."""
    if query.shape[1] % key_cache.shape[0]:
        raise ValueError(f"{query.shape[1]} query heads is not a multiple of {key_cache.shape[0]} kv heads")
    if plan.decodes and sliding_window not in plan.gathers:
        raise ValueError(f"the attention plan has no gather for sliding_window={sliding_window}")


def attend_decodes(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, g: DecodeGather,
                   scale: float, k_scale: float, v_scale: float, softcap: float | None) -> torch.Tensor:
    """The decode rows q [Sd, Hq, D] against their gathered blocks (:class:`DecodeGather`) -> [Sd, Hq, D]."""
    return _decode_attention(q, _gather_blocks(key_cache, g.table), _gather_blocks(value_cache, g.table), g.masked,
                             scale, k_scale, v_scale, softcap)


def attend_prefills(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, plan: AttentionPlan, scale: float, k_scale: float, v_scale: float,
                    window: int | None, softcap: float | None) -> None:
    """Each prefill chunk's rows of ``out``, one sequence at a time (SDPA, or explicit attention when capped)."""
    starts, lens = plan.starts, plan.lens
    for s in plan.prefills:
        _paged_prefill(out, query, key_cache, value_cache, block_tables[s], starts[s], starts[s + 1], lens[s],
                       scale, k_scale, v_scale, window, softcap)


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
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened varlen batch over a paged KV cache.

    Sequence s owns query rows query_start_loc[s]:query_start_loc[s+1]; seq_lens[s] counts its whole context
    including those rows (already written), so row i sits at position seq_lens[s] - q_len + i. Position p lives at
    block_tables[s, p // block_size], offset p % block_size. Decodes (q_len 1) run as one padded batch; prefill
    chunks loop per sequence. Computes in the query's dtype (SDPA accumulates in float32). `max_query_len` is only
    a hint for grid-sizing backends. ``plan``: the step's :class:`AttentionPlan`, so 30 layers do not each rebuild
    it. ``sliding_window`` w: a row at position p sees keys p-w+1..p only; blocks wholly before every row's window
    are neither gathered nor read. ``logit_softcap`` c: scores become c * tanh(score / c) before the mask and
    softmax (Gemma 2). Unwritten cache slots (the tail of a last block) are masked out, so they may hold any finite
    value; the engine allocates its pools with zeros, so they never hold NaN.
    """
    del max_query_len
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, None, key_cache.shape[2], (sliding_window,))
    check_attention(query, key_cache, plan, sliding_window)
    every_row = plan.decode_only and query.shape[0] == len(plan.decodes)  # no padding rows after the sequences
    decoded = None
    if plan.decodes:
        decoded = attend_decodes(query if every_row else query[plan.decode_rows], key_cache, value_cache,
                                 plan.gathers[sliding_window], scale, k_scale, v_scale, logit_softcap)
        if every_row:
            return decoded
    out = torch.zeros_like(query)  # rows not owned by any sequence (padding) stay zero
    if decoded is not None:
        out[plan.decode_rows] = decoded
    attend_prefills(out, query, key_cache, value_cache, block_tables, plan, scale, k_scale, v_scale, sliding_window,
                    logit_softcap)
    return out


def _paged_prefill(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   table_row: torch.Tensor, q_start: int, q_end: int, ctx_len: int, scale: float, k_scale: float,
                   v_scale: float, window: int | None, softcap: float | None) -> None:
    """One prefill chunk (with its cached prefix) through SDPA, or explicit attention when soft-capped."""
    block_size = key_cache.shape[2]
    device = query.device
    q_len = q_end - q_start
    if ctx_len < q_len:
        raise ValueError(f"seq_len {ctx_len} < query length {q_len}")
    if window is not None and window >= ctx_len:
        window = None  # every row sees its whole context
    base = (max(0, ctx_len - q_len - window + 1) // block_size) * block_size if window else 0  # first key gathered
    table = table_row[base // block_size: -(-ctx_len // block_size)].long()
    k = _from_cache(_gather_blocks(key_cache, table[None])[:, :, :ctx_len - base], k_scale, query.dtype)
    v = _from_cache(_gather_blocks(value_cache, table[None])[:, :, :ctx_len - base], v_scale, query.dtype)
    q = query[q_start:q_end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [1, Hk, L, D]
    if ctx_len == q_len and window is None and softcap is None:
        # No cached prefix: SDPA's top-left aligned causal mask is the right one (and skips work).
        o = _sdpa(q, k, v, None, scale, causal=True)
    else:
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
        k_pos = torch.arange(base, ctx_len, device=device)[None, :]
        mask = k_pos <= q_pos  # [q_len, L]
        if window is not None:
            mask &= k_pos > q_pos - window
        o = _sdpa(q, k, v, mask, scale) if softcap is None else _masked_attention(q, k, v, mask, scale, softcap)
    out[q_start:q_end] = o[0].transpose(0, 1).to(out.dtype)


# -- batched LoRA (stacked layout) -------------------------------------------------------------------------------
def lora_shrink(x: torch.Tensor, a_stacked: torch.Tensor, token_slots: torch.Tensor, rank: int,
                num_slots: int) -> torch.Tensor:
    """x [T, K], a_stacked [G * S * R, K] (G groups, e.g. q/k/v sharing x; in each group slot s owns rows
    s*R:(s+1)*R), token_slots [T] (-1 = no adapter) -> [T, G * S * R], where token t keeps only its own slot's
    R columns of each group (the rest are zero).

    One matmul against every slot at once, then a mask: S times the minimal FLOPs, but S (max_loras) and R are
    small next to the base layer, and it replaces a gather of per-token A matrices or a loop over adapters.
    """
    full = torch.matmul(x, a_stacked.t())
    cols = (torch.arange(a_stacked.shape[0], device=x.device) // rank) % num_slots
    return full * (cols[None, :] == token_slots[:, None]).to(full.dtype)


def lora_expand(y: torch.Tensor, buf: torch.Tensor, b_stacked: torch.Tensor, offset: int) -> torch.Tensor:
    """y [T, N_total] += buf [T, S * R] @ b_stacked [N, S * R]^T into columns offset:offset+N (the scaling is
    folded into B). Returns y (updated in place when possible)."""
    n = b_stacked.shape[0]
    y[:, offset:offset + n] += torch.matmul(buf, b_stacked.t())
    return y


# -- mixture of experts ------------------------------------------------------------------------------------------
def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' ACT2FN entries the families use (keepwarm.formats.model_config.ACTIVATIONS)."""
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name != "silu":
        raise ValueError(f"unsupported activation {name!r} (supported: silu, gelu_pytorch_tanh)")
    return F.silu


@dataclass(eq=False)
class MoEWeights:
    """One MoE layer's experts: expert e is ``down[e](act(gate) * up)`` with ``gate, up = gate_up[e](x).chunk(2)``.
    Each weight is what ``kernels.linear`` takes (a dense [N, K] tensor or a QuantizedWeight), bias-free; the
    tuples are the model's own tensors (arena views), never copies. ``prepared`` is for backends that derive
    something from the weights once (the Triton backend's per-expert pointer tables), keyed by backend."""

    gate_up: tuple[Any, ...]
    down: tuple[Any, ...]
    prepared: dict[str, Any] = field(default_factory=dict)

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: MoEWeights,
              act: str, linear: Callable[[torch.Tensor, Any], torch.Tensor]) -> torch.Tensor:
    """x [T, H], topk_weights [T, k] (x's dtype), topk_ids [T, k] -> sum_j w[t, j] * expert_{ids[t, j]}(x[t]).

    Tokens are grouped by expert (a stable sort of the flat (token, slot) pairs) and each expert that received
    tokens runs one matmul pair over all of them through `linear` (the dispatcher: oneDNN-packed or quantized
    weights take their fast CPU paths); outputs are scaled by the routing weight in x's dtype and summed with
    ``index_add_`` in ascending expert order, the order transformers adds them, so float32 sums are bit-identical.
    """
    top_k = topk_ids.shape[1]
    out = torch.zeros_like(x)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens ascending
    counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
    tokens = order // top_k
    w = topk_weights.reshape(-1)[order]
    fn = activation(act)
    start = 0
    for e, n in enumerate(counts):
        if n:
            idx = tokens[start:start + n]
            gate, up = linear(x.index_select(0, idx), experts.gate_up[e]).chunk(2, dim=-1)
            y = linear(fn(gate) * up, experts.down[e]) * w[start:start + n, None]
            out.index_add_(0, idx, y)
        start += n
    return out
