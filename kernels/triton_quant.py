"""Triton weight-only quantized matmuls: ``y = x @ dequant(W)^T + b`` for int8 (W8A16), int4 (W4A16) and fp8.

One kernel, the dequantization in its K loop (the weight is read from memory in its packed form once per
output tile, which is the point at decode, where these matmuls are weight-bandwidth bound). Each weight
element is dequantized exactly as `QuantizedWeight.dequantize` does (float32 math, then rounded to x's dtype),
so the result is the torch reference's up to the float32 summation order:
  int8  qweight int8 [N, K], scales [N]                       w = q * scale[n]
  fp8   qweight float8_e4m3fn [N, K], scale float32 [1]       w = q * scale (codes decoded from their bits)
  int4  canonical layout only: qweight uint8 [N, K/2] (low nibble = even k), scales/zeros [N, K/gs]
                                                              w = (q - 8) * scale[n, k // gs] + zero[n, k // gs]
Other layouts (a CPU-packed int4 weight on a CUDA device cannot happen through the daemon) fall back to the
torch reference.

Grid: (N / BLOCK_N, M / BLOCK_M) output tiles, each looping over K. Tile shapes by M (not tuned on a GPU here):
  M <= 16   decode: BLOCK_M 16 (tl.dot's minimum), BLOCK_N 32 so that even a 4096-wide output has 128 programs
            to spread over the SMs, BLOCK_K 128 (each program streams long contiguous runs of weight rows);
  M <= 64   BLOCK_M 64, BLOCK_N 64, BLOCK_K 64;
  larger    BLOCK_M 128, BLOCK_N 128, BLOCK_K 64, 8 warps, 3 stages: Triton's matmul tutorial tile for big GEMMs;
  float32   true float32 products (no tensor cores; Triton's FMA dot keeps operand rows in registers): 16x32x32
            or 32x64x32, small enough not to spill (checked by compiling for sm_80 and sm_90).
For int4 BLOCK_K is capped at the group size, so a K tile never straddles two groups (one scale/zero per column).

FP8 on Hopper: `torch._scaled_mm` with per-token activation scales (W8A8: x is quantized to fp8 per row, the
per-tensor weight scale broadcast per column) uses fp8 tensor cores, twice bfloat16's rate. It changes the
numbers (x is rounded to 3 mantissa bits), so it is only taken where it should pay: bfloat16 activations,
compute capability 9.x, M >= FP8_SCALED_MM_MIN_ROWS, K and N multiples of 16. The threshold is a guess, NOT
MEASURED HERE: below it the matmul is weight-bandwidth bound, both paths read the same fp8 weight bytes, and the
weight-only kernel saves the activation quantization and keeps x exact. ``KEEPWARM_FP8_MATMUL=auto|triton|
scaled_mm`` overrides the choice (read per call, for A/B runs on a GPU).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from keepwarm.formats.quant import LAYOUT_INT4_CANONICAL

from . import triton_common as tc

logger = logging.getLogger("keepwarm.kernels")

KIND_INT8, KIND_FP8, KIND_INT4 = 0, 1, 2
FP8_MATMUL_ENV = "KEEPWARM_FP8_MATMUL"
FP8_SCALED_MM_MIN_ROWS = 128  # not measured here: see the module docstring
_FP8_MAX = 448.0
_LOGGED: set[str] = set()


@triton.jit
def _wq_linear_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg, stride_ym, stride_yn,
    KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    X_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    if KIND == 0:
        col_scale = tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
    if KIND == 1:
        tensor_scale = tl.load(s_ptr).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        if KIND == 2:
            # Byte k // 2 holds k's code: the low nibble for even k, the high one for odd k.
            packed = tl.load(q_ptr + rn64[None, :] * stride_qn + (kk // 2)[:, None] * stride_qk, mask=w_mask,
                             other=0)
            code = (packed.to(tl.int32) >> ((kk % 2) * 4)[:, None]) & 15
            g = k0 // GROUP_SIZE  # BLOCK_K divides GROUP_SIZE: the whole tile is in group g
            sc = tl.load(s_ptr + rn * stride_sn + g * stride_sg, mask=n_ok, other=0.0).to(tl.float32)
            zr = tl.load(z_ptr + rn * stride_zn + g * stride_zg, mask=n_ok, other=0.0).to(tl.float32)
            w = (code.to(tl.float32) - 8.0) * sc[None, :] + zr[None, :]
        else:
            raw = tl.load(q_ptr + rn64[None, :] * stride_qn + kk[:, None] * stride_qk, mask=w_mask, other=0)
            if KIND == 0:  # noqa: SIM108 (a static branch on a constexpr, kept as a plain if for Triton)
                w = raw.to(tl.float32) * col_scale[None, :]
            else:
                w = tc.fp8_to_f32(raw, 1) * tensor_scale
        w = tc.round_as(w, X_DTYPE)  # the dequantized weight in x's dtype, as the reference has it
        acc += tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :] * stride_yn
    tl.store(y, tc.to_dtype(acc, X_DTYPE), mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int, n: int, kind: int, group_size: int, fp32: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); reasons in the module docstring."""
    if fp32:  # true float32 products: Triton's FMA dot, whose operands live in registers
        bm, bn, bk, warps, stages = (16, 32, 32, 4, 3) if m <= 16 else (32, 64, 32, 4, 3)
    elif m <= 16:
        bm, bn, bk, warps, stages = 16, 32 if n <= 8192 else 64, 128, 4, 3
    elif m <= 64:
        bm, bn, bk, warps, stages = 64, 64, 64, 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    if kind == KIND_INT4:
        bk = min(bk, group_size)
    return bm, bn, bk, warps, stages


def _launch(x: torch.Tensor, w, bias: torch.Tensor | None, kind: int) -> torch.Tensor:
    n, k = w.meta.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    p = w.parts
    gs = w.meta.group_size or 0
    if kind == KIND_INT4:
        q, s, z = p["qweight"], p["scales"], p["zeros"]
    elif kind == KIND_INT8:
        q, s, z = p["qweight"], p["scales"], p["scales"]
    else:
        q = p["qweight"].view(torch.uint8)  # decoded from its bits in the kernel (any arch, and the interpreter)
        s = z = p["scale"]
    s_strides = (s.stride(0), s.stride(1) if s.dim() > 1 else 0)
    z_strides = (z.stride(0), z.stride(1) if z.dim() > 1 else 0)
    dot = tc.dot_dtype(x.dtype)
    bm, bn, bk, warps, stages = _tiles(m, n, kind, gs, x.dtype == torch.float32)
    _wq_linear_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        x2, q, s, z, bias if bias is not None else y, y, m, n, k,
        *x2.stride(), *q.stride(), *s_strides, *z_strides, *y.stride(),
        KIND=kind, GROUP_SIZE=max(gs, 1), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        X_DTYPE=tc.tl_dtype(x.dtype), DOT_DTYPE=dot, PRECISION=tc.dot_precision(dot), num_warps=warps,
        num_stages=stages,
    )
    return y.reshape(*x.shape[:-1], n)


def linear_int8(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _launch(x, w, bias, KIND_INT8)


def linear_int4(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    if w.meta.layout != LAYOUT_INT4_CANONICAL:
        from .quant import linear_reference

        return linear_reference(x, w, bias)
    return _launch(x, w, bias, KIND_INT4)


# ---------------------------------------------------------------------------------------------- fp8
def fp8_path(x: torch.Tensor, w, capability: tuple[int, int] | None = None) -> str:
    """"scaled_mm" or "triton" for this call (see the module docstring); `capability` is for tests."""
    mode = os.environ.get(FP8_MATMUL_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "triton", "scaled_mm"):
        raise ValueError(f"{FP8_MATMUL_ENV}={mode!r} is not one of auto, triton, scaled_mm")
    n, k = w.meta.shape
    usable = (x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0 and hasattr(torch, "_scaled_mm")
              and (capability is not None or x.device.type == "cuda"))
    if mode == "triton" or not usable:
        return "triton"
    if mode == "scaled_mm":
        return "scaled_mm"
    cap = capability or torch.cuda.get_device_capability(x.device)
    rows = x.numel() // max(k, 1)
    return "scaled_mm" if cap[0] == 9 and rows >= FP8_SCALED_MM_MIN_ROWS else "triton"


def fp8_scaled_mm(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 through torch._scaled_mm: x quantized to e4m3 per row (scale = row amax / 448), rowwise scales."""
    n, k = w.meta.shape
    x2 = x.reshape(-1, k)
    xf = x2.float()
    x_scale = (xf.abs().amax(dim=1, keepdim=True) / _FP8_MAX).clamp_(min=1e-12)  # [M, 1]; an all-zero row -> 0s
    xq = (xf / x_scale).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    # Rowwise scaling wants scale_b as [1, N] float32; the per-tensor weight scale, broadcast (no host sync).
    w_scale = w.parts["scale"].float().reshape(1, 1).expand(1, n).contiguous()
    y = torch._scaled_mm(xq, w.parts["qweight"].t(), scale_a=x_scale, scale_b=w_scale,
                         bias=bias.to(torch.bfloat16) if bias is not None else None, out_dtype=torch.bfloat16)
    return y.reshape(*x.shape[:-1], n)


def linear_fp8(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    path = fp8_path(x, w)
    if path not in _LOGGED:
        _LOGGED.add(path)
        logger.info("linear fp8: %s (%s)", "torch._scaled_mm, per-token activation scales" if path == "scaled_mm"
                    else "triton weight-only kernel", str(x.dtype).removeprefix("torch."))
    if path == "scaled_mm":
        return fp8_scaled_mm(x, w, bias)
    return _launch(x, w, bias, KIND_FP8)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dense weights stay on cuBLAS (F.linear): a hand-written Triton GEMM is not expected to beat it. Registered
    so that KEEPWARM_KERNELS=triton can run a whole model."""
    return F.linear(x, weight, bias)


IMPLS = {"linear": linear, "linear_int8": linear_int8, "linear_int4": linear_int4, "linear_fp8": linear_fp8}
