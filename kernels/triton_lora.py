"""Triton batched LoRA over the stacked layout of `worker/lora.py` (semantics of `kernels.reference`).

Rules:
- lora_shrink: x [T, K] against A [G * S * R, K] -> [T, G * S * R], token t keeping only the R columns of its own
  slot in each group (-1: all zeros). A program computes its tokens' block for one (group, slot) and skips the K
  loop when no token of its tile uses the slot: ~1x the minimal FLOPs instead of the reference's S x.
- lora_expand: y[:, offset:offset + N] += buf [T, S * R] @ B [N, S * R]^T, in place, y read and written once.
- Both accumulate in float32 and round once (the reference rounds the product, then the sum).
Grids and tile sizes: docs/kernels.md, "Batched LoRA".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_common as tc

_BLOCK_K = 64


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, slot_ptr, out_ptr, T, K, R, num_slots,
    stride_xt, stride_xk, stride_ar, stride_ak, stride_ot, stride_oc,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    OUT_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_t = tl.program_id(0)
    gs = tl.program_id(1)  # group * num_slots + slot: A's row block and out's column block are both gs * R
    slot = gs % num_slots
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = rt < T
    mine = (tl.load(slot_ptr + rt, mask=t_ok, other=-1) == slot) & t_ok
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    rows = gs * R + rr
    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    if tl.max(mine.to(tl.int32), 0) > 0:  # some token of this tile uses this slot
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            xa = tl.load(x_ptr + rt[:, None].to(tl.int64) * stride_xt + kk[None, :] * stride_xk,
                         mask=mine[:, None] & k_ok[None, :], other=0.0)
            aa = tl.load(a_ptr + rows[None, :].to(tl.int64) * stride_ar + kk[:, None] * stride_ak,
                         mask=r_ok[None, :] & k_ok[:, None], other=0.0)
            acc += tl.dot(xa.to(DOT_DTYPE), aa.to(DOT_DTYPE), input_precision=PRECISION)
    acc = tl.where(mine[:, None], acc, 0.0)
    dst = out_ptr + rt[:, None].to(tl.int64) * stride_ot + rows[None, :] * stride_oc
    tl.store(dst, tc.to_dtype(acc, OUT_DTYPE), mask=t_ok[:, None] & r_ok[None, :])


def lora_shrink(x: torch.Tensor, a_stacked: torch.Tensor, token_slots: torch.Tensor, rank: int,
                num_slots: int) -> torch.Tensor:
    num_tokens, k = x.shape
    cols = a_stacked.shape[0]
    out = torch.empty(num_tokens, cols, dtype=torch.promote_types(x.dtype, a_stacked.dtype), device=x.device)
    if num_tokens == 0 or cols == 0:
        return out
    if cols % (rank * num_slots):
        raise ValueError(f"stacked A has {cols} rows, not a multiple of slots x rank = {num_slots} x {rank}")
    block_t = 16
    dot = tc.dot_dtype(out.dtype)
    _lora_shrink_kernel[(triton.cdiv(num_tokens, block_t), cols // rank)](
        x, a_stacked, token_slots, out, num_tokens, k, rank, num_slots,
        *x.stride(), *a_stacked.stride(), *out.stride(),
        BLOCK_T=block_t, BLOCK_R=tc.next_pow2(rank, 16), BLOCK_K=_BLOCK_K, OUT_DTYPE=tc.tl_dtype(out.dtype),
        DOT_DTYPE=dot, PRECISION=tc.dot_precision(dot), num_warps=4,
    )
    return out


@triton.jit
def _lora_expand_kernel(
    y_ptr, buf_ptr, b_ptr, T, N, K, offset,
    stride_yt, stride_yn, stride_bt, stride_bk, stride_bn, stride_bkk,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    Y_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = rt < T
    n_ok = rn < N
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(buf_ptr + rt[:, None].to(tl.int64) * stride_bt + kk[None, :] * stride_bk,
                    mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rn[None, :].to(tl.int64) * stride_bn + kk[:, None] * stride_bkk,
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=PRECISION)
    y = y_ptr + rt[:, None].to(tl.int64) * stride_yt + (offset + rn[None, :]) * stride_yn
    mask = t_ok[:, None] & n_ok[None, :]
    acc += tl.load(y, mask=mask, other=0.0).to(tl.float32)
    tl.store(y, tc.to_dtype(acc, Y_DTYPE), mask=mask)


def lora_expand(y: torch.Tensor, buf: torch.Tensor, b_stacked: torch.Tensor, offset: int) -> torch.Tensor:
    num_tokens = y.shape[0]
    n, k = b_stacked.shape
    if buf.shape != (num_tokens, k):
        raise ValueError(f"buf has shape {tuple(buf.shape)}, expected {(num_tokens, k)}")
    if num_tokens == 0 or n == 0:
        return y
    dot = tc.dot_dtype(buf.dtype if buf.dtype == b_stacked.dtype else torch.float32)
    fp32 = y.dtype == torch.float32  # true float32 products (Triton's FMA dot): smaller tiles, or it spills
    block_t = 16 if num_tokens <= 16 or fp32 else 64
    block_n = 32 if fp32 else 64
    _lora_expand_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(n, block_n))](
        y, buf, b_stacked, num_tokens, n, k, offset,
        *y.stride(), *buf.stride(), *b_stacked.stride(),
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=min(_BLOCK_K, tc.next_pow2(k, 16)), Y_DTYPE=tc.tl_dtype(y.dtype),
        DOT_DTYPE=dot, PRECISION=tc.dot_precision(dot), num_warps=4,
    )
    return y


IMPLS = {"lora_shrink": lora_shrink, "lora_expand": lora_expand}
