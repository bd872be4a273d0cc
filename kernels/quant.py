"""Quantized linear weights and their matmuls (`x @ dequant(W)^T + b`, output in x's dtype).

`QuantizedWeight` wraps the parts `keepwarm.formats.quant` produces (possibly read-only views into the daemon's
shared memory: nothing here writes them). Each scheme has a plain-torch reference (`linear_reference`: dequantize
in float32, cast to x's dtype, F.linear), correct for every layout and device, and a "torch" backend
(`TORCH_IMPLS`, registered in `keepwarm.kernels`) that picks the fastest measured path (`PATHS`) on CPU:

  int8  torch._weight_int8pack_mm is vectorized only for bfloat16 x on AVX2/AVX512 and wins only for few rows
        (AVX512, [1536, 576]: 19 us vs 97 us at M=1, 189 vs 152 at M=32, 1.6 ms vs 0.6 ms at M=256); for float32
        and float16 it is a scalar loop (0.3 ms at M=1, 9.7 ms at M=32). Above 4 rows of bfloat16, keepwarm's C
        kernel (`kernels.cpu_native`, AVX512-BF16) where it builds: one 1B layer's four matmuls, 2 cores, ms:
        M=8 9.0 (op) / 13.2 (C), M=32 33.7 / 20.5 / 49 (cast), M=128 127 / 50 / 74, M=512 495 / 167 / 184,
        against 4.2 / 10.3 / 36 / 144 for the bfloat16 oneDNN matmul; since its weight tiles are transposed in
        registers, not gathered (Zen 4, against bf16's time): M=6 1.52x (op 1.64x), M=8 1.31x (op 1.66x), M=32 1.27x
        (op 2.8x), so it is taken from 5 rows. Otherwise: cast the int8 codes to x's
        dtype (exact), matmul (for bfloat16 on a CPU where oneDNN has no bf16 matmul: keepwarm's AVX2 one,
        `cpu_native.bf16_linear`), scale the [M, N] output per channel.
        On CPUs without AVX512-BF16 (AVX2), bfloat16 x takes keepwarm's AVX2 int8 kernel at every M
        (`cpu_native.q8_linear`; one 1B layer, 2 cores, Zen 3: M=1 0.78x bf16's time, M=32 1.08x; the op 0.9x and
        1.8x; docs/quantization.md).
        With AMX tiles (Intel, `cpu_native.amx_takes`): the op up to 4 rows, then the C kernel on the tiles (one 1B
        layer against bf16's time: M=2 op 0.90x / tiles 1.20x, M=4 1.12 / 1.24, M=6 1.72 / 1.25, M=32 5.0 / 1.58);
        above 512 rows the codes go to bf16 once per call (C, exact) for oneDNN's bf16 matmul, the scale on the
        output (one 1B layer, ms, tiles / that / bf16: M=512 57.7 / 58.1 / 27.0, M=2048 326 / 151 / 109).
  int4  On CPUs without AVX512-BF16, bfloat16 x takes keepwarm's AVX2 int4 kernel (`cpu_native.q4_linear`, torch's
        "halves" CPU pack read in place; one 1B layer: M=1 0.41x bf16's time, M=32 1.07x; the op 0.6-0.8x, 1.5x).
        With AMX tiles, above 4 rows: keepwarm's int4 tile kernel (`cpu_native.q4_amx_linear`, the same pack read in
        place; one 1B layer against bf16's time: M=6 op 1.13x / tiles 0.86x, M=32 3.97 / 0.94; M=1 op 0.47x).
        Without the tiles on AVX512-BF16 with VBMI (Zen 4), above 4 rows: the same kernel's pack and fold on the
        vector units (`cpu_native.q4_vec_linear`; one 1B layer on a Zen 4 against bf16's time: M=6 op 1.45x / C
        1.16x, M=8 1.23 / 1.08, M=32 2.12 / 1.24, M=256 2.59 / 1.27; M=4 0.70 / 1.00).
        Elsewhere torch._weight_int4pack_mm_for_cpu, when the weight was packed in this process's CPU layout, for
        bfloat16 on AVX2/AVX512 (21 us vs 0.49 ms for the reference at M=1, 167 us vs 0.48 ms at M=32). Elsewhere
        it is a scalar loop (~0.65 ms per row) that loses to the reference even at M=1 (0.40 ms).
  fp8   On CPUs without AVX512-BF16, bfloat16 x with one scale per tensor or row takes keepwarm's AVX2 kernel (the
        int8 one with e4m3 codes built into float32 exactly, `cpu_native.q8_linear`). Otherwise:
        no fused CPU op for weight-only fp8 (torch._scaled_mm would quantize x too, and is slower), and torch's
        fp8 -> float cast is a slow scalar loop (1.2 ms for 0.9M weights). For bfloat16 x, keepwarm's C kernel
        (the int8 kernel with the codes converted in registers, same float16 bit trick; on the AMX tiles from 2
        rows: M=8 1.46x bf16's time against 2.14x without). Otherwise the codes are
        re-read as float16 with integer ops (exact, q / 256), then matmul and one scalar scale (0.15-0.24 ms vs
        1.25-1.3 ms).
  fp8_block   (pre-quantized fp8 per channel / block) per channel and bfloat16 x: the C kernel. Otherwise the same
        float16 re-read; per channel the scale is applied to the [M, N] output, per block to the weight before the
        matmul.
  int8_group, int4_gidx   (pre-quantized groups with zero points or a group index) the reference, on every device:
        no fused op takes their layout (logged once per path, like every choice here).
Off CPU every scheme takes the reference (a GPU backend registers its own kernels; the Triton backend has none for
fp8_block, int8_group and int4_gidx, so those take this reference on CUDA too, logged by keepwarm.kernels).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from keepwarm.formats.quant import (
    LAYOUT_INT4_CANONICAL,
    LAYOUT_INT4_GIDX,
    WEIGHT_SCHEMES,
    QuantizationError,
    QuantMeta,
    cpu_int4_layout,
    layout_parts,
    unpack_int4,
)

from . import cpu_native, reference

__all__ = ["PATHS", "TORCH_IMPLS", "QuantizedWeight", "fp8_as_float16", "linear_reference"]

logger = logging.getLogger("keepwarm.kernels")

_FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Capabilities whose ATen int8/int4 weight-pack kernels are vectorized for bfloat16 (measured: AVX512, AVX2).
_SIMD_CAPABILITIES = ("AVX2", "AVX512")
# Above this many rows the int8 op loses to cast + matmul (AVX512: even at M=16; AVX2: before M=32).
_INT8_OP_MAX_ROWS = 8
# With keepwarm's C kernels (AVX512-BF16, on the tiles or not): torch's int8 / int4 ops up to 4 rows, the C kernel
# above (one 1B layer on a Zen 4, time against bf16's: M=4 op 0.99x / C 1.27x, M=6 1.64 / 1.52; docs/quantization.md)
_AMX_OP_MAX_ROWS = 4
_AMX_MAX_ROWS = 512  # ... and int8 / fp8 above 512 rows: the codes to bf16 once, then oneDNN (prefill chunks)
_INT4_HALVES_RE = re.compile(r"int4_cpu_halves(\d+)")
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
            w = p["qweight"].float().mul_(_per_column(p["scales"].float(), m, p.get("g_idx")))
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
    # reference.linear: bf16 on a CPU without oneDNN's bf16 matmul takes the AVX2 kernel, else F.linear
    return _add_bias(reference.linear(x, q).mul_(scales), x, bias)


def _int8_native(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the native int8 path takes bfloat16 x, not {x.dtype}")
    return _add_bias(cpu_native.int8_linear(_as_2d(x), w.parts["qweight"], w.parts["scales"]), x, bias)


def _fp8_native(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the native fp8 path takes bfloat16 x, not {x.dtype}")
    scale = _fp8_scale(w)
    if scale is None:
        raise ValueError(f"the native fp8 path takes one scale per tensor or row, not blocks of {w.meta.group_size}")
    return _add_bias(cpu_native.fp8_linear(_as_2d(x), w.parts["qweight"], scale), x, bias)


def _codes_wide(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """int8 / fp8 (one scale per tensor or row) for hundreds of rows of bf16 x: the codes to bf16 once (C, exact),
    oneDNN's bf16 matmul, the scale on the [M, N] output in float32 (rounded twice, as the int8 cast path)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the wide int8 / fp8 path takes bfloat16 x, not {x.dtype}")
    fp8 = w.meta.scheme != "int8"
    scale = _fp8_scale(w) if fp8 else w.parts["scales"]
    if scale is None:
        raise ValueError(f"the wide fp8 path takes one scale per tensor or row, not blocks of {w.meta.group_size}")
    y = F.linear(x, cpu_native.codes_to_bf16(w.parts["qweight"]))
    return _add_bias(y.float().mul_(scale.float() * (256.0 if fp8 else 1.0)).to(x.dtype), x, bias)


def _int8_avx2(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return _add_bias(cpu_native.q8_linear(_as_2d(x), w.parts["qweight"], w.parts["scales"]), x, bias)


def _fp8_scale(w: QuantizedWeight) -> torch.Tensor | None:
    """fp8's float32 scale for a per-tensor or per-row weight (what the fused kernels take); None for blocks."""
    if w.meta.scheme == "fp8":
        return w.parts["scale"]
    if w.meta.group_size is not None and w.meta.group_size >= w.meta.shape[1]:
        return w.parts["scales"][:, 0]
    return None


def _fp8_avx2(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    scale = _fp8_scale(w)
    if scale is None:
        raise ValueError(f"the AVX2 fp8 path takes one scale per tensor or row, not blocks of {w.meta.group_size}")
    return _add_bias(cpu_native.q8_linear(_as_2d(x), w.parts["qweight"], scale), x, bias)


@functools.cache
def _int4_block(layout: str) -> int:
    """Rows per block of an int4 "halves" CPU layout; 0 for any other layout. Cached: asked on every int4 call."""
    m = _INT4_HALVES_RE.fullmatch(layout)
    return int(m.group(1)) if m else 0


def _int4_c(kernel: str) -> Callable[..., torch.Tensor]:
    """The path of one of keepwarm's int4 C kernels on torch's "halves" pack (`cpu_native.<kernel>`, looked up at
    each call), with the bias added after."""
    def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        assert w.meta.group_size is not None
        y = getattr(cpu_native, kernel)(_as_2d(x), w.parts["qweight"], w.parts["scales_and_zeros"], w.meta.group_size,
                                        _int4_block(w.meta.layout))
        return _add_bias(y, x, bias)

    linear.__name__ = linear.__qualname__ = f"_int4_{kernel}"
    return linear


_int4_avx2, _int4_amx, _int4_vec = (_int4_c(k) for k in ("q4_linear", "q4_amx_linear", "q4_vec_linear"))


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


_INT8_NATIVE = "keepwarm C kernel (AVX512-BF16)"
_INT8_AVX2 = "keepwarm C kernel, int8 (AVX2)"
_INT4_AVX2 = "keepwarm C kernel, int4 (AVX2)"
_FP8_AVX2 = "keepwarm C kernel, fp8 (AVX2)"
_FP8_NATIVE = "keepwarm C kernel, fp8 (AVX512-BF16)"
_INT8_AMX = "keepwarm C kernel, int8 (AMX tiles)"
_FP8_AMX = "keepwarm C kernel, fp8 (AMX tiles)"
_INT4_AMX = "keepwarm C kernel, int4 (AMX tiles)"
_INT4_VEC = "keepwarm C kernel, int4 (AVX512-BF16)"
_CODES_WIDE = "codes->bf16 (C) + oneDNN bf16 matmul, scale on the output"


# scheme -> path name (as logged) -> implementation; every path computes the same product as the reference.
PATHS: dict[str, dict[str, Callable[..., torch.Tensor]]] = {
    "int8": {"torch._weight_int8pack_mm": _int8_op, "int8->dtype cast + matmul, per-channel scale": _int8_cast,
             _INT8_NATIVE: _int8_native, _INT8_AVX2: _int8_avx2, _INT8_AMX: _int8_native, _CODES_WIDE: _codes_wide},
    "int4": {"torch._weight_int4pack_mm_for_cpu": _int4_op, _INT4_AVX2: _int4_avx2, _INT4_AMX: _int4_amx,
             _INT4_VEC: _int4_vec},
    "fp8": {"fp8 bits->float16 + matmul, scalar scale": _fp8_bits, _FP8_NATIVE: _fp8_native, _FP8_AVX2: _fp8_avx2,
            _FP8_AMX: _fp8_native, _CODES_WIDE: _codes_wide},
    "fp8_block": {"fp8 bits->float16 + matmul, channel/block scales": _fp8_block_bits, _FP8_NATIVE: _fp8_native,
                  _FP8_AVX2: _fp8_avx2, _FP8_AMX: _fp8_native, _CODES_WIDE: _codes_wide},
}
_REFERENCE = "reference dequantize+matmul"


@functools.cache
def _simd() -> bool:
    return torch.backends.cpu.get_cpu_capability() in _SIMD_CAPABILITIES


def _native_fits(x: torch.Tensor, w: QuantizedWeight) -> bool:
    return x.dtype == torch.bfloat16 and w.parts["qweight"].is_contiguous() and cpu_native.available()


def select_path(scheme: str, x: torch.Tensor, w: QuantizedWeight) -> str:
    """The path name the torch backend takes for this input (see the module docstring for the measurements)."""
    if scheme == "none" or x.device.type != "cpu" or w.device.type != "cpu" or x.dtype not in _FAST_DTYPES:
        return _REFERENCE
    rows = x.numel() // max(x.shape[-1], 1)
    vectorized = x.dtype == torch.bfloat16 and _simd()
    if scheme == "int8":
        if cpu_native.avx2_quant_on() and cpu_native.q8_fits(x, w.parts["qweight"], w.parts["scales"]):
            return _INT8_AVX2
        native = _native_fits(x, w)
        tiles = native and cpu_native.amx_takes(rows, x.shape[-1])
        if vectorized and rows <= (_AMX_OP_MAX_ROWS if native else _INT8_OP_MAX_ROWS):
            return "torch._weight_int8pack_mm"
        if native:
            return _CODES_WIDE if tiles and rows > _AMX_MAX_ROWS else _INT8_AMX if tiles else _INT8_NATIVE
        return "int8->dtype cast + matmul, per-channel scale"
    if scheme == "int4":
        return _int4_path(x, w, rows, vectorized)
    native = scheme in ("fp8", "fp8_block") and _native_fits(x, w)
    if scheme in ("fp8", "fp8_block") and not native and cpu_native.avx2_quant_on():
        scale = _fp8_scale(w)
        if scale is not None and cpu_native.q8_fits(x, w.parts["qweight"], scale):
            return _FP8_AVX2
    tiles = native and cpu_native.amx_takes(rows, x.shape[-1])
    fused = _CODES_WIDE if tiles and rows > _AMX_MAX_ROWS else _FP8_AMX if tiles else _FP8_NATIVE
    if scheme == "fp8":
        return fused if native else "fp8 bits->float16 + matmul, scalar scale"
    if scheme == "fp8_block":
        per_channel = w.meta.group_size is not None and w.meta.group_size >= w.meta.shape[1]
        return fused if native and per_channel else "fp8 bits->float16 + matmul, channel/block scales"
    return _REFERENCE


def _int4_path(x: torch.Tensor, w: QuantizedWeight, rows: int, vectorized: bool) -> str:
    block, gs = _int4_block(w.meta.layout), w.meta.group_size or 0
    if block and cpu_native.avx2_quant_on() and cpu_native.q4_fits(x, w.parts["qweight"],
                                                                   w.parts["scales_and_zeros"], gs, block):
        return _INT4_AVX2
    if (block and rows > _AMX_OP_MAX_ROWS
            and cpu_native.q4_amx_fits(x, w.parts["qweight"], w.parts["scales_and_zeros"], gs, block)):
        return _INT4_AMX
    if (block and rows > _AMX_OP_MAX_ROWS
            and cpu_native.q4_vec_fits(x, w.parts["qweight"], w.parts["scales_and_zeros"], gs, block)):
        return _INT4_VEC
    # The packed order is per CPU capability: only a weight packed as this process packs can use the op.
    use_op = vectorized and w.meta.layout == cpu_int4_layout()
    return "torch._weight_int4pack_mm_for_cpu" if use_op else _REFERENCE


def _run(scheme: str, x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    path = select_path(scheme, x, w)
    key = (scheme, path, x.device.type, x.dtype)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("linear %s: %s (%s, %s)", scheme, path, x.device.type, str(x.dtype).removeprefix("torch."))
    if path == _REFERENCE:
        return linear_reference(x, w, bias)
    return PATHS[scheme][path](x, w, bias)


def _torch_impl(scheme: str) -> Callable[..., torch.Tensor]:
    def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _run(scheme, x, w, bias)

    linear.__name__ = linear.__qualname__ = f"linear_{scheme}"
    return linear


# scheme -> the "torch" backend of kernel f"linear_{scheme}" (registered by keepwarm.kernels).
TORCH_IMPLS: dict[str, Callable[..., torch.Tensor]] = {s: _torch_impl(s) for s in WEIGHT_SCHEMES}
