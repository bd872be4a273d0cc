"""Triton RMSNorm (plain, and fused with the residual add) and rotary embedding (neox and GPT-J, partial).

Semantics of `kernels/reference.py`, float32 math, one rounding per output:
  rms_norm            weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), in the dtype torch would promote to
  fused_add_rms_norm  h = (x + residual.to(x.dtype)) in x's dtype; returns (rms_norm(h), h); inputs untouched
  rotary_embedding    rotates the first rot_dim dims of each head of q and k (rot_dim = cos_sin_cache.shape[1]),
                      returns new tensors of the inputs' shape and dtype

Grids: one program per token (row). A row is at most a few thousand elements (hidden 4096-8192 for norms,
heads * head_dim for rotary), so a program holds it whole in registers: one read and one write of the row, and
the reduction needs no second pass. Inputs may be strided views (the model's q/k are slices of the fused qkv
output), so every access goes through strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_common as tc


def _row_warps(block: int) -> int:
    # ~256 elements per warp (8 per thread: a 16-byte vector of bfloat16), between 1 and 16 warps.
    return min(16, max(1, block // 256))


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, D, eps,
    stride_xt, stride_xd, stride_rt, stride_rd, stride_ot, stride_rot,
    BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr, X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    x = tl.load(x_ptr + t * stride_xt + d * stride_xd, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tc.round_as(tl.load(res_ptr + t * stride_rt + d * stride_rd, mask=ok, other=0.0).to(tl.float32),
                        X_DTYPE)  # residual.to(x.dtype)
        x = tc.round_as(x + r, X_DTYPE)  # the sum in x's dtype, as torch computes it
        tl.store(res_out_ptr + t * stride_rot + d, x.to(X_DTYPE), mask=ok)
    inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / D + eps)
    h = tc.round_as(x * inv, X_DTYPE)  # .to(x.dtype) before the weight, as HF's LlamaRMSNorm
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + d, tc.to_dtype(w * h, OUT_DTYPE), mask=ok)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dim() != 2:
        raise ValueError(f"rms_norm takes x [T, D], got shape {tuple(x.shape)}")
    num_tokens, dim = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if num_tokens == 0:
        return out, res_out
    block = tc.next_pow2(dim)
    r = residual if residual is not None else x
    _rms_norm_kernel[(num_tokens,)](
        x, r, weight, out, res_out if res_out is not None else out, dim, float(eps),
        *x.stride(), *r.stride(), out.stride(0), (res_out if res_out is not None else out).stride(0),
        BLOCK_D=block, HAS_RESIDUAL=residual is not None, X_DTYPE=tc.tl_dtype(x.dtype),
        OUT_DTYPE=tc.tl_dtype(out.dtype), num_warps=_row_warps(block),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    out, res = _norm(x, residual, weight, eps)
    assert res is not None
    return out, res


# ---------------------------------------------------------------------------------------------- rotary
@triton.jit
def _rotate_heads(x_ptr, out_ptr, t, cos, sin, j, j_ok, num_heads, stride_xt, stride_xe, stride_ot,
                  HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HEADS_PAD: tl.constexpr, PASS_PAD: tl.constexpr,
                  IS_NEOX: tl.constexpr, DTYPE: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)
    h_ok = h < num_heads
    if IS_NEOX:  # halves: (j, j + half)
        i1 = j
        i2 = j + HALF
    else:  # GPT-J: interleaved pairs (2j, 2j + 1)
        i1 = 2 * j
        i2 = 2 * j + 1
    base = h[:, None] * HEAD_DIM
    mask = h_ok[:, None] & j_ok[None, :]
    x_row = x_ptr + t * stride_xt
    x1 = tl.load(x_row + (base + i1[None, :]) * stride_xe, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (base + i2[None, :]) * stride_xe, mask=mask, other=0.0).to(tl.float32)
    o_row = out_ptr + t * stride_ot
    tl.store(o_row + base + i1[None, :], tc.to_dtype(x1 * cos[None, :] - x2 * sin[None, :], DTYPE), mask=mask)
    tl.store(o_row + base + i2[None, :], tc.to_dtype(x2 * cos[None, :] + x1 * sin[None, :], DTYPE), mask=mask)
    if PASS_PAD > 0:  # partial rotary: dims rot_dim.. head_dim are copied
        e = 2 * HALF + tl.arange(0, PASS_PAD)
        pmask = h_ok[:, None] & (e < HEAD_DIM)[None, :]
        rest = tl.load(x_row + (base + e[None, :]) * stride_xe, mask=pmask, other=0.0)
        tl.store(o_row + base + e[None, :], rest, mask=pmask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cache_ptr, num_q_heads, num_kv_heads,
    stride_qt, stride_qe, stride_kt, stride_ke, stride_qot, stride_kot, stride_cache,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr, PASS_PAD: tl.constexpr, IS_NEOX: tl.constexpr, DTYPE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    j_ok = j < HALF
    cos = tl.load(cache_ptr + p * stride_cache + j, mask=j_ok, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + p * stride_cache + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, t, cos, sin, j, j_ok, num_q_heads, stride_qt, stride_qe, stride_qot,
                  HEAD_DIM, HALF, Q_HEADS_PAD, PASS_PAD, IS_NEOX, DTYPE)
    _rotate_heads(k_ptr, k_out_ptr, t, cos, sin, j, j_ok, num_kv_heads, stride_kt, stride_ke, stride_kot,
                  HEAD_DIM, HALF, K_HEADS_PAD, PASS_PAD, IS_NEOX, DTYPE)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_dim: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `kernels.reference.rotary_embedding`. Grid: one program per token, all q and k heads of it (the
    token's cos/sin row is loaded once)."""
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim > head_dim:
        raise ValueError(f"rotary dim {rot_dim} exceeds head_dim {head_dim}")
    if query.dtype != key.dtype:
        raise TypeError(f"query is {query.dtype} but key is {key.dtype}")
    num_tokens = query.shape[0]
    q2, k2 = query.reshape(num_tokens, -1), key.reshape(num_tokens, -1)  # views for [T, H, D] or [T, H*D]
    q_out = torch.empty(q2.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(k2.shape, dtype=key.dtype, device=key.device)
    if num_tokens:
        half = rot_dim // 2
        hq, hk = q2.shape[1] // head_dim, k2.shape[1] // head_dim
        block = tc.next_pow2(hq * head_dim)
        _rotary_kernel[(num_tokens,)](
            positions, q2, k2, q_out, k_out, cos_sin_cache, hq, hk,
            *q2.stride(), *k2.stride(), q_out.stride(0), k_out.stride(0), cos_sin_cache.stride(0),
            HEAD_DIM=head_dim, HALF=half, HALF_PAD=tc.next_pow2(half), Q_HEADS_PAD=tc.next_pow2(hq),
            K_HEADS_PAD=tc.next_pow2(hk), PASS_PAD=0 if rot_dim == head_dim else tc.next_pow2(head_dim - rot_dim),
            IS_NEOX=bool(is_neox), DTYPE=tc.tl_dtype(query.dtype), num_warps=_row_warps(block),
        )
    return q_out.view(query.shape), k_out.view(key.shape)


IMPLS = {"rms_norm": rms_norm, "fused_add_rms_norm": fused_add_rms_norm, "rotary_embedding": rotary_embedding}
