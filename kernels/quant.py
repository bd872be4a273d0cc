"""Quantized linear weights and their matmuls (`x @ dequant(W)^T + b`, output in x's dtype).

Rules:
- `QuantizedWeight` wraps the parts `keepwarm.formats.quant` produces (possibly read-only views into the daemon's
  shared memory: nothing here writes them).
- Each scheme has a plain-torch reference (`linear_reference`: dequantize in float32, cast to x's dtype, F.linear),
  correct for every layout and device, and a "torch" backend (`TORCH_IMPLS`, registered in `keepwarm.kernels`) that
  runs the path kernels/dispatch.py's table names (`PATHS`: ATen's weight-pack ops, keepwarm's C kernels, casts);
  every path computes the same product as the reference, up to float32 summation order and one rounding.
- Each (scheme, path, device, dtype) choice is logged once. Off the CPU every scheme takes the reference (a GPU
  backend registers its own kernels; the Triton backend has none for fp8_block, int8_group and int4_gidx).
- The measurements behind each path's rows: docs/kernels.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from keepwarm.formats.errors import QuantizationError
from keepwarm.formats.quant import (
    LAYOUT_INT4_CANONICAL,
    LAYOUT_INT4_GIDX,
    LAYOUT_INT8_GROUP_U4,
    WEIGHT_SCHEMES,
    QuantMeta,
    layout_parts,
    unpack_int4,
    unpack_u4_groups,
)

from . import cpu, dispatch, native_ops

__all__ = ["PATHS", "TORCH_IMPLS", "QuantizedWeight", "fp8_as_float16", "linear_reference"]

logger = logging.getLogger("keepwarm.kernels")

# (scheme, path, device type, dtype) already logged: the path choice is logged once, not per call.
_LOGGED: set[tuple[str, str, str, torch.dtype]] = set()


class QuantizedWeight:
    """A quantized [N, K] linear weight: `meta` plus its named part tensors (never written)."""

    is_quantized_weight = True

    def __init__(self, meta: QuantMeta, parts: Mapping[str, torch.Tensor]) -> None:
        self.meta = meta
        self.parts = dict(parts)

    @classmethod
    def from_parts(cls, meta: QuantMeta, parts: Mapping[str, torch.Tensor]) -> QuantizedWeight:
        """Checks the parts against the layout in `meta` (names, dtypes, shapes) before wrapping them."""
        want = layout_parts(meta, _act_dtype(parts))
        got = {name: (t.dtype, tuple(t.shape)) for name, t in parts.items()}
        if got != want:
            raise QuantizationError(f"{meta.scheme}/{meta.layout}: parts {got} do not match layout {want}")
        return cls(meta, parts)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.meta.shape)

    @property
    def device(self) -> torch.device:
        return next(iter(self.parts.values())).device

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.parts.values())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] weight in `dtype`, computed in float32; works for every layout on any device."""
        m, p = self.meta, self.parts
        if m.scheme == "none":
            return p["weight"].to(dtype)
        if m.scheme == "int8":
            w = p["qweight"].float().mul_(p["scales"].float()[:, None])
        elif m.scheme == "fp8":
            w = p["qweight"].float().mul_(p["scale"].float())
        elif m.scheme == "fp8_block":
            w = p["qweight"].float().mul_(_per_column(p["scales"].float(), m))
        elif m.scheme == "int8_group":
            q = unpack_u4_groups(p["qweight"]) if m.layout == LAYOUT_INT8_GROUP_U4 else p["qweight"]
            w = q.float().mul_(_per_column(p["scales"].float(), m, p.get("g_idx")))
            w = w.add_(_per_column(p["zeros"].float(), m, p.get("g_idx")))
        elif m.layout == LAYOUT_INT4_GIDX:
            g = p["g_idx"].long()
            w = unpack_int4(p["qweight"], m.layout, m.shape).float()
            w = w.sub_(8.0).mul_(p["scales"].float()[:, g]).add_(p["zeros"].float()[:, g])
        else:
            n, k = m.shape
            gs = m.group_size
            assert gs is not None
            if m.layout == LAYOUT_INT4_CANONICAL:
                scales, zeros = p["scales"].float(), p["zeros"].float()
            else:
                sz = p["scales_and_zeros"].float()  # [K/gs, N, 2]
                scales, zeros = sz[..., 0].t(), sz[..., 1].t()
            w = unpack_int4(p["qweight"], m.layout, m.shape).float().view(n, k // gs, gs)
            # In place: fresh multi-MB temporaries cost more than the arithmetic on a CPU.
            w = w.sub_(8.0).mul_(scales[..., None]).add_(zeros[..., None]).view(n, k)
        return w.to(dtype)

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.meta.scheme}, layout={self.meta.layout}, shape={tuple(self.meta.shape)})"


def _per_column(s: torch.Tensor, meta: QuantMeta, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Per-group values [N, G] spread to [N, K]: by the group index when there is one, else groups of group_size."""
    if g_idx is not None:
        return s[:, g_idx.long()]
    assert meta.group_size is not None
    return s.repeat_interleave(meta.group_size, dim=1)[:, :meta.shape[1]]


def _act_dtype(parts: Mapping[str, torch.Tensor]) -> torch.dtype:
    for name in ("weight", "scales", "scales_and_zeros"):
        if name in parts:
            return parts[name].dtype
    return torch.float32  # fp8: no part is in the activation dtype


def fp8_as_float16(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes re-read as float16, exactly q / 256 (NaN codes excepted; quantize never makes them)."""
    # e4m3's exponent|mantissa bits shifted left 7 land on float16's low 4 exponent bits and top 3 mantissa bits:
    # the same number with exponent bias 15 instead of 7, i.e. / 2^8; subnormals line up as well. The int8 sign
    # extension puts the sign in bit 15 and a stray copy in bit 14, which is cleared.
    return (q.view(torch.int8).to(torch.int16) << 7).bitwise_and_(~0x4000).view(torch.float16)


# ---------------------------------------------------------------------------------------------- paths
def _as_2d(x: torch.Tensor) -> torch.Tensor:
    # torch's weight-pack ops take a contiguous 2-D A.
    return x.reshape(-1, x.shape[-1]).contiguous()


def _add_bias(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        y = y.add_(bias.to(y.dtype))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def linear_reference(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch for every scheme and layout: dequantize to x's dtype, then F.linear."""
    return F.linear(x, w.dequantize(x.dtype).to(x.device), bias)


def _int8_op(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    scales = w.parts["scales"].to(x.dtype)  # the op wants x's dtype (a no-op when quantized for this dtype)
    return _add_bias(torch._weight_int8pack_mm(_as_2d(x), w.parts["qweight"], scales), x, bias)


def _int8_cast(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    q, scales = w.parts["qweight"].to(x.dtype), w.parts["scales"].to(x.dtype)  # int8 -> float is exact
    if x.dtype == torch.float16:
        # Scale the weight, not the output: x @ q^T can exceed float16's range before scaling.
        return F.linear(x, q.mul_(scales[:, None]), bias)
    # cpu.linear: bf16 on a CPU without oneDNN's bf16 matmul takes the AVX2 kernel, else F.linear
    return _add_bias(cpu.linear(x, q).mul_(scales), x, bias)


def _int8_native(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the native int8 path takes bfloat16 x, not {x.dtype}")
    return _add_bias(native_ops.int8_linear(_as_2d(x), w.parts["qweight"], w.parts["scales"]), x, bias)


def _fp8_native(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the native fp8 path takes bfloat16 x, not {x.dtype}")
    scale = dispatch.fp8_scale(w)
    if scale is None:
        raise ValueError(f"the native fp8 path takes one scale per tensor or row, not blocks of {w.meta.group_size}")
    return _add_bias(native_ops.fp8_linear(_as_2d(x), w.parts["qweight"], scale), x, bias)


def _codes_wide(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """int8 / fp8 (one scale per tensor or row) for hundreds of rows of bf16 x: the codes to bf16 once (C, exact),
    oneDNN's bf16 matmul, the scale on the [M, N] output in float32 (rounded twice, as the int8 cast path)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the wide int8 / fp8 path takes bfloat16 x, not {x.dtype}")
    fp8 = w.meta.scheme != "int8"
    scale = dispatch.fp8_scale(w) if fp8 else w.parts["scales"]
    if scale is None:
        raise ValueError(f"the wide fp8 path takes one scale per tensor or row, not blocks of {w.meta.group_size}")
    y = F.linear(x, native_ops.codes_to_bf16(w.parts["qweight"]))
    return _add_bias(y.float().mul_(scale.float() * (256.0 if fp8 else 1.0)).to(x.dtype), x, bias)


def _int8_avx2(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return _add_bias(native_ops.q8_linear(_as_2d(x), w.parts["qweight"], w.parts["scales"]), x, bias)


def _fp8_avx2(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    scale = dispatch.fp8_scale(w)
    if scale is None:
        raise ValueError(f"the AVX2 fp8 path takes one scale per tensor or row, not blocks of {w.meta.group_size}")
    return _add_bias(native_ops.q8_linear(_as_2d(x), w.parts["qweight"], scale), x, bias)


def _int4_c(kernel: str) -> Callable[..., torch.Tensor]:
    """The path of one of keepwarm's int4 C kernels on torch's "halves" pack (`native_ops.<kernel>`, looked up at
    each call), with the bias added after."""
    def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        assert w.meta.group_size is not None
        y = getattr(native_ops, kernel)(_as_2d(x), w.parts["qweight"], w.parts["scales_and_zeros"], w.meta.group_size,
                                        dispatch.int4_block(w.meta.layout))
        return _add_bias(y, x, bias)

    linear.__name__ = linear.__qualname__ = f"_int4_{kernel}"
    return linear


_int4_avx2, _int4_amx, _int4_vec = (_int4_c(k) for k in ("q4_linear", "q4_amx_linear", "q4_vec_linear"))


def _int8_group_c(kernel: str) -> Callable[..., torch.Tensor]:
    """The path of one of keepwarm's int8_group C kernels (`native_ops.<kernel>`, looked up at each call), with the
    bias added after."""
    def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        assert w.meta.group_size is not None
        p = w.parts
        y = getattr(native_ops, kernel)(_as_2d(x), p["qweight"], p["scales"], p["zeros"], w.meta.group_size)
        return _add_bias(y, x, bias)

    linear.__name__ = linear.__qualname__ = f"_int8_group_{kernel}"
    return linear


_int8_group_avx2, _int8_group_avx512 = (_int8_group_c(k) for k in ("q8g_linear", "q8g_avx512_linear"))


def _int8_group_wide(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Many rows of bf16 x: the reference's own bf16 weight (made in C, bit for bit), then F.linear: the reference's
    result, without its float32 temporaries."""
    if x.dtype != torch.bfloat16 or w.meta.group_size is None:
        raise ValueError(f"the wide int8_group path takes bfloat16 x and groups, not {x.dtype}, {w.meta.group_size}")
    p = w.parts
    return F.linear(x, native_ops.q8g_to_bf16(p["qweight"], p["scales"], p["zeros"], w.meta.group_size), bias)


def _int4_op(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    sz = w.parts["scales_and_zeros"].to(x.dtype)  # the op wants x's dtype
    y = torch._weight_int4pack_mm_for_cpu(_as_2d(x), w.parts["qweight"], w.meta.group_size, sz)
    return _add_bias(y, x, bias)


def _fp8_bits(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    w16 = fp8_as_float16(w.parts["qweight"])
    scale = w.parts["scale"].float() * 256.0  # undoes fp8_as_float16's / 256 (exact: a power of two)
    if x.dtype == torch.float16:
        # Scale x rather than the output: x @ (q/256)^T can exceed float16's range before scaling.
        return F.linear(x * scale.to(x.dtype), w16, bias)
    # Through float32: torch's float16 -> bfloat16 cast is 3x slower than float16 -> float32 -> bfloat16 here.
    y = F.linear(x, w16.float().to(x.dtype))
    # The scalar scale on the small [M, N] output, in float32 so a bfloat16 output is rounded only once more.
    y = y.mul_(scale) if x.dtype == torch.float32 else y.float().mul_(scale).to(x.dtype)
    return _add_bias(y, x, bias)


def _fp8_block_bits(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    w16 = fp8_as_float16(w.parts["qweight"])
    scales = w.parts["scales"].float() * 256.0  # undoes fp8_as_float16's / 256 (exact: a power of two)
    if w.meta.group_size is not None and w.meta.group_size >= w.meta.shape[1] and x.dtype != torch.float16:
        # Per channel: scale the small [M, N] output, in float32 (see _fp8_bits).
        y = F.linear(x, w16.float().to(x.dtype))
        y = y.mul_(scales[:, 0]) if x.dtype == torch.float32 else y.float().mul_(scales[:, 0]).to(x.dtype)
        return _add_bias(y, x, bias)
    return F.linear(x, w16.float().mul_(_per_column(scales, w.meta)).to(x.dtype), bias)


# scheme -> path name (dispatch's kernel names, as logged) -> implementation; each computes the reference's product.
D = dispatch
PATHS: dict[str, dict[str, Callable[..., torch.Tensor]]] = {
    "int8": {D.INT8_OP: _int8_op, D.INT8_CAST: _int8_cast, D.INT8_NATIVE: _int8_native, D.INT8_AVX2: _int8_avx2,
             D.INT8_AMX: _int8_native, D.CODES_WIDE: _codes_wide},
    "int4": {D.INT4_OP: _int4_op, D.INT4_AVX2: _int4_avx2, D.INT4_AMX: _int4_amx, D.INT4_VEC: _int4_vec},
    "fp8": {D.FP8_BITS: _fp8_bits, D.FP8_NATIVE: _fp8_native, D.FP8_AVX2: _fp8_avx2, D.FP8_AMX: _fp8_native,
            D.CODES_WIDE: _codes_wide},
    "fp8_block": {D.FP8_BLOCK_BITS: _fp8_block_bits, D.FP8_NATIVE: _fp8_native, D.FP8_AVX2: _fp8_avx2,
                  D.FP8_AMX: _fp8_native, D.CODES_WIDE: _codes_wide},
    "int8_group": {D.INT8G_AVX2: _int8_group_avx2, D.INT8G_AVX512: _int8_group_avx512, D.INT8G_WIDE: _int8_group_wide,
                   D.INT8G_AMX: _int8_group_avx512},  # the tiles: kw_q8group512's first choice from 2 rows
}


def select_path(scheme: str, x: torch.Tensor, w: QuantizedWeight) -> str:
    """The path name the torch backend takes for this input: kernels/dispatch.py's row for it."""
    return dispatch.select_linear(scheme, x, w)


def _run(scheme: str, x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    path = select_path(scheme, x, w)
    key = (scheme, path, x.device.type, x.dtype)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("linear %s: %s (%s, %s)", scheme, path, x.device.type, str(x.dtype).removeprefix("torch."))
    if path == dispatch.REFERENCE:
        return linear_reference(x, w, bias)
    return PATHS[scheme][path](x, w, bias)


def _torch_impl(scheme: str) -> Callable[..., torch.Tensor]:
    def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _run(scheme, x, w, bias)

    linear.__name__ = linear.__qualname__ = f"linear_{scheme}"
    return linear


# scheme -> the "torch" backend of kernel f"linear_{scheme}" (registered by keepwarm.kernels).
TORCH_IMPLS: dict[str, Callable[..., torch.Tensor]] = {s: _torch_impl(s) for s in WEIGHT_SCHEMES}
