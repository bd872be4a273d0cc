# mypy: disable-error-code="no-untyped-def"
# (the @triton.jit kernels: Triton reads parameter annotations as its own, so their launch args stay untyped)
"""Triton fused mixture-of-experts: the routed experts of one layer in two grouped-GEMM launches.

Rules:
- vLLM's fused_moe design (sort, pad, one program per block of an expert's tokens), exact against the reference
  (``kernels/reference.py``: group by expert, one matmul pair per expert, ``index_add_`` in ascending expert
  order): each token's slots are added in ascending expert order, rounding where the reference rounds.
- No host sync: the block count is bounded by T alone, so CUDA graphs can capture the launches.
- Weights are read where they live (per-expert pointer tables, built once per layer and cached in
  `MoEWeights.prepared`); quantized experts are dequantized per tile exactly as the reference's ``dequantize``.
- Anything else (another int4 layout such as the CPU pack, mixed layouts across experts, an activation other than
  silu) takes the torch backend's fused_moe, logged once.
The stages (align, gate_up, down, sum) and layouts: docs/kernels.md, "Fused MoE".
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import triton
import triton.language as tl

from . import registry
from . import triton_common as tc
from .reference import MoEWeights

logger = logging.getLogger("keepwarm.kernels")

KIND_DENSE, KIND_INT8, KIND_FP8, KIND_INT4 = 0, 1, 2, 3
_SCHEME_KINDS = {"int8": KIND_INT8, "fp8": KIND_FP8, "int4": KIND_INT4}
_TL_ELEMENT = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
               torch.int8: tl.int8, torch.uint8: tl.uint8}
_LOGGED: set[str] = set()


@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, rn, kk, n_ok, k_ok, stride_wn, stride_wk, stride_sn, stride_sg,
                 stride_zn, stride_zg, KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """W[rn, kk]^T as a [BLOCK_K, BLOCK_N] matmul operand: dequantized in float32 as the reference does, rounded
    to the activation dtype (exact for dense weights already in it)."""
    mask = k_ok[:, None] & n_ok[None, :]
    rows = rn.to(tl.int64)[None, :]
    if KIND == 0:
        w = tl.load(w_ptr + rows * stride_wn + kk[:, None] * stride_wk, mask=mask, other=0.0)
        return w.to(DOT_DTYPE)
    if KIND == 3:  # int4: byte k // 2 holds k's code in its low (even k) or high (odd k) nibble
        b = tl.load(w_ptr + rows * stride_wn + (kk // 2)[:, None] * stride_wk, mask=mask, other=0).to(tl.int32)
        q = tl.where((kk % 2 == 0)[:, None], b & 15, (b >> 4) & 15).to(tl.float32)
        g = (kk // GROUP_SIZE)[:, None]
        s = tl.load(s_ptr + rows * stride_sn + g * stride_sg, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rows * stride_zn + g * stride_zg, mask=mask, other=0.0).to(tl.float32)
        w = (q - 8.0) * s + z
    else:
        raw = tl.load(w_ptr + rows * stride_wn + kk[:, None] * stride_wk, mask=mask, other=0)
        if KIND == 2:
            if NATIVE_FP8:  # noqa: SIM108 (a static branch on a constexpr). The hardware's e4m3 conversion, sm_89+
                q = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:  # integer decode: older archs and the interpreter
                q = tc.fp8_to_f32(raw, 1)
        else:
            q = raw.to(tl.float32)
        # Per output channel (a per-tensor fp8 scale comes with stride 0).
        w = q * tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return tc.round_as(w, OUT_DTYPE).to(DOT_DTYPE)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_tab, s_tab, z_tab, c_ptr, rw_ptr, sorted_ptr, block_expert_ptr, N, K, num_pairs,
    stride_am, stride_ak, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, KIND: tl.constexpr,
    GROUP_SIZE: tl.constexpr, W_ELT: tl.constexpr, S_ELT: tl.constexpr, Z_ELT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, NATIVE_FP8: tl.constexpr,
):
    """One [BLOCK_M pairs, BLOCK_N] tile of one expert. GATED: rows rn and N + rn of the expert's gate_up weight
    (gate and up), stored as act(gate) * up; else one weight, times the pair's routing weight if MUL_WEIGHT."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:  # past the last expert's blocks
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs  # padding rows hold the sentinel num_pairs
    a_rows = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_am
    w_ptr = tl.load(w_tab + e).to(tl.pointer_type(W_ELT))
    s_ptr = tl.load(s_tab + e).to(tl.pointer_type(S_ELT))
    z_ptr = tl.load(z_tab + e).to(tl.pointer_type(Z_ELT))
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(a_rows + kk[None, :] * stride_ak, mask=valid[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        w = _weight_tile(w_ptr, s_ptr, z_ptr, rn, kk, n_ok, k_ok, stride_wn, stride_wk, stride_sn, stride_sg,
                         stride_zn, stride_zg, KIND, GROUP_SIZE, OUT_DTYPE, DOT_DTYPE, NATIVE_FP8)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            wu = _weight_tile(w_ptr, s_ptr, z_ptr, rn + N, kk, n_ok, k_ok, stride_wn, stride_wk, stride_sn,
                              stride_sg, stride_zn, stride_zg, KIND, GROUP_SIZE, OUT_DTYPE, DOT_DTYPE, NATIVE_FP8)
            acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
    h = tc.round_as(acc, OUT_DTYPE)  # the matmul's output in x's dtype, as the reference's linear returns it
    if GATED:  # silu(gate) * up, each op rounded to x's dtype as torch computes it on tensors of that dtype
        h = tc.round_as(h / (1.0 + tl.exp(-h)), OUT_DTYPE) * tc.round_as(acc_up, OUT_DTYPE)
    if MUL_WEIGHT:
        h = h * tl.load(rw_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    c = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c, tc.to_dtype(h, OUT_DTYPE), mask=valid[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------- host side
def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [num_blocks * block_m], block_expert [num_blocks]) for flat (token, slot) pair ids
    t * k + j: pairs grouped by expert (pair ids ascending within an expert), each group padded with the sentinel
    T * k to a multiple of block_m; block_expert -1 for the unused blocks at the end. Sync-free torch ops."""
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    dest = pad_end[expert] - padded[expert] + torch.arange(pairs, device=device) - start[expert]
    num_blocks = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)
    sorted_ids = torch.full((num_blocks * block_m,), pairs, dtype=torch.long, device=device)
    sorted_ids.scatter_(0, dest, order)
    block_expert = torch.searchsorted(pad_end, torch.arange(num_blocks, device=device) * block_m, right=True)
    return sorted_ids, torch.where(block_expert < num_experts, block_expert, -1)


class _Part:
    """One projection of every expert: pointer tables and the strides / dtypes the experts share."""

    def __init__(self, weights: tuple[Any, ...], device: torch.device) -> None:
        first = weights[0]
        scheme = first.meta.scheme if getattr(first, "is_quantized_weight", False) else "none"
        if scheme == "none" and not isinstance(first, torch.Tensor):
            raise _Unsupported(f"{scheme} weights in a packed layout")
        if scheme == "int4" and first.meta.layout != "int4_canonical":
            raise _Unsupported(f"int4 layout {first.meta.layout}")
        if scheme not in ("none", *_SCHEME_KINDS):
            raise _Unsupported(f"scheme {scheme}")
        self.kind = _SCHEME_KINDS.get(scheme, KIND_DENSE)
        self.shape = tuple(first.shape)
        self.group_size = (first.meta.group_size or 1) if self.kind == KIND_INT4 else 1
        names = {KIND_DENSE: ("weight", None, None), KIND_INT8: ("qweight", "scales", None),
                 KIND_FP8: ("qweight", "scale", None), KIND_INT4: ("qweight", "scales", "zeros")}[self.kind]
        tensors = [[self._tensor(w, name) if name else self._tensor(w, names[0]) for name in names] for w in weights]
        self.tables, self.strides, self.elts = [], [], []
        for i in range(3):
            col = [t[i] for t in tensors]
            t0 = col[0]
            if any(t.dtype != t0.dtype or t.stride() != t0.stride() or t.shape != t0.shape or t.device != device
                   for t in col):
                raise _Unsupported("experts whose weights differ in dtype, shape, stride or device")
            self.tables.append(torch.tensor([t.data_ptr() for t in col], dtype=torch.int64, device=device))
            stride = tuple(t0.stride()) if t0.dim() == 2 else ((0 if t0.numel() == 1 else t0.stride(0)), 0)
            self.strides.append(stride)
            self.elts.append(_TL_ELEMENT[torch.uint8 if t0.dtype == torch.float8_e4m3fn else t0.dtype])
        self.weight_dtype = tensors[0][0].dtype

    @staticmethod
    def _tensor(w: Any, name: str) -> torch.Tensor:
        t = w if isinstance(w, torch.Tensor) else w.parts[name]
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class _Unsupported(Exception):
    pass


def _prepared(experts: MoEWeights, device: torch.device) -> tuple[_Part, _Part]:
    key = f"triton:{device}"
    if key not in experts.prepared:
        experts.prepared[key] = (_Part(experts.gate_up, device), _Part(experts.down, device))
    return experts.prepared[key]


def _tiles(pairs: int, fp32: bool, kind: int, gated: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps): 16-row blocks while few pairs per expert (decode), else 64 with 8 warps;
    float32 (Triton's FMA dot, true float32 products, operands in registers) 16 x 32 x 32; int4's gate_up with K
    tiles of 32. Each other choice tried spilled registers on sm_90 somewhere (gate_up keeps two accumulators and
    a dequantized tile live), which tests/support/triton_compile_check.py checks. Not tuned on a GPU yet."""
    if fp32 or tc.INTERPRETED:
        return (16, 32, 32, 4)
    bk = 32 if kind == KIND_INT4 and gated else 64
    return (16, 64, bk, 4) if pairs <= 256 else (64, 64, bk, 8)


def _launch(a: torch.Tensor, part: _Part, out: torch.Tensor, rw: torch.Tensor, sorted_ids: torch.Tensor,
            block_expert: torch.Tensor, n: int, k: int, num_pairs: int, a_row_div: int, gated: bool,
            block_m: int) -> None:
    _, bn, bk, warps = _tiles(num_pairs, a.dtype == torch.float32, part.kind, gated)
    bm = block_m  # the alignment's block size: the same for both launches
    dot = tc.dot_dtype(a.dtype)
    (swn, swk), (ssn, ssg), (szn, szg) = part.strides
    grid = (block_expert.numel(), triton.cdiv(n, bn))
    _moe_gemm_kernel[grid](
        a, *part.tables, out, rw, sorted_ids, block_expert, n, k, num_pairs, *a.stride(), swn, swk, ssn, ssg,
        szn, szg, *out.stride(), A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=not gated, KIND=part.kind,
        GROUP_SIZE=part.group_size, W_ELT=part.elts[0], S_ELT=part.elts[1], Z_ELT=part.elts[2], BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, OUT_DTYPE=tc.tl_dtype(a.dtype), DOT_DTYPE=dot, PRECISION=tc.dot_precision(dot),
        NATIVE_FP8=tc.native_fp8(a.device), num_warps=warps,
    )


def _fallback(reason: str, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              experts: MoEWeights, act: str) -> torch.Tensor:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.warning("fused_moe: triton kernel does not take %s; running the torch reference", reason)
    # the torch backend's fused_moe: the reference, each expert's matmuls through the dispatcher's linear
    return registry.impl("fused_moe", "torch")(x, topk_weights, topk_ids, experts, act)


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: MoEWeights,
              act: str) -> torch.Tensor:
    """``kernels.fused_moe`` on Triton (see the module docstring)."""
    if act != "silu":
        return _fallback(f"activation {act}", x, topk_weights, topk_ids, experts, act)
    try:
        gate_up, down = _prepared(experts, x.device)
    except _Unsupported as e:
        return _fallback(str(e), x, topk_weights, topk_ids, experts, act)
    if gate_up.kind == KIND_DENSE and gate_up.weight_dtype != x.dtype:
        return _fallback(f"{gate_up.weight_dtype} weights for {x.dtype} activations", x, topk_weights, topk_ids,
                         experts, act)
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = gate_up.shape[0] // 2
    out = torch.zeros_like(x)
    if t == 0:
        return out
    # Each token's slots in ascending expert order: the order the sum below (and the reference) adds them.
    ids, perm = torch.sort(topk_ids, dim=-1)
    rw = topk_weights.gather(1, perm).reshape(-1)
    pairs = t * top_k
    block_m = _tiles(pairs, x.dtype == torch.float32, gate_up.kind, True)[0]
    sorted_ids, block_expert = align_block_size(ids, experts.num_experts, block_m)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _launch(x, gate_up, h, rw, sorted_ids, block_expert, inter, hidden, pairs, top_k, True, block_m)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _launch(h, down, y, rw, sorted_ids, block_expert, hidden, inter, pairs, 1, False, block_m)
    y = y.view(t, top_k, hidden)
    for j in range(top_k):
        out += y[:, j]
    return out


IMPLS = {"fused_moe": fused_moe}
