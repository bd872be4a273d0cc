"""Weight-only quantization of the fused linear weights at preload time (torch only, no model code).

Schemes (every dequantization is computed in float32, then cast): ``none`` (the weight as is); ``int8`` (symmetric,
one scale per output channel, q in [-127, 127]); ``fp8`` (e4m3fn, one float32 scale per tensor, amax / 448);
``int4`` (asymmetric, one (scale, zero) per group along K, q in [0, 15], torch's tinygemm convention
w ~ (q - 8) * scale + zero; groups of 128 where 128 divides K, else 64, else 32; ``int4-g64`` / ``int4-g32`` ask
for smaller groups: better quality, more scale bytes).

Rules:
- The parts a weight is stored as (``quantized_layout``) are known from the shape alone, before any data is read,
  so the daemon can lay out its arena first. Each layout (``QuantMeta.layout``) and its parts: docs/quantization.md,
  "Arena layouts".
- The CPU int4 pack order depends on the process's ATen CPU capability: probed once and named in the layout, so a
  process whose torch packs differently still dequantizes the weight (``unpack_int4``), without the fast op.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from keepwarm.formats.errors import QuantizationError
from keepwarm.formats.packed import packed_nbytes

SCHEMES = ("none", "int8", "fp8", "int4")
# int4 with a smaller preferred group (the largest of it, 64, 32 that divides K): a scheme of its own, so the
# fingerprint and the daemon's resident key tell them apart.
INT4_GROUP_SCHEMES = {"int4-g64": 64, "int4-g32": 32}
# Kernel families a weight can have besides SCHEMES: layouts only pre-quantized checkpoints produce.
WEIGHT_SCHEMES = (*SCHEMES, "fp8_block", "int8_group", "int4_gidx")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch._weight_int4pack_mm_for_cpu accepts
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

LAYOUT_DENSE = "dense"
LAYOUT_INT8 = "int8_channel"
LAYOUT_FP8 = "fp8_tensor"
LAYOUT_INT4_CANONICAL = "int4_canonical"
LAYOUT_MKLDNN_PACKED = "mkldnn_packed"
LAYOUT_FP8_BLOCK = "fp8_block"
LAYOUT_INT8_GROUP = "int8_group"
LAYOUT_INT8_GIDX = "int8_gidx"
# int8_group with unsigned 4-bit codes (GGUF Q4_K, Q2_K): [N, K / 2], in each 32 columns byte j = column j (low
# nibble) and column 16 + j (high), so the int8_group kernels read LANES consecutive codes from consecutive bytes.
LAYOUT_INT8_GROUP_U4 = "int8_group_u4"
LAYOUT_INT4_GIDX = "int4_gidx"
_SCHEME_LAYOUTS = {"none": (LAYOUT_DENSE,), "int8": (LAYOUT_INT8,), "fp8": (LAYOUT_FP8,),
                   "fp8_block": (LAYOUT_FP8_BLOCK,),
                   "int8_group": (LAYOUT_INT8_GROUP, LAYOUT_INT8_GIDX, LAYOUT_INT8_GROUP_U4),
                   "int4_gidx": (LAYOUT_INT4_GIDX,)}
_INT4_CPU_RE = re.compile(r"int4_cpu_(pairs|halves)(16|32|64)")

# Fused linear weights as planned by weights/checkpoint.py; embeddings, norms, lm_head and biases stay dense.
# Experts (mlp.experts.E.gate_up_proj / down_proj) are linears like any other; the MoE router (mlp.gate) stays dense.
_TARGET_RE = re.compile(
    r"(?:.*\.)?(?:self_attn\.(?:qkv_proj|o_proj)|mlp\.(?:experts\.\d+\.)?(?:gate_up_proj|down_proj))\.weight")

PartsLayout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


@dataclass(frozen=True)
class QuantMeta:
    """What a quantized weight is: goes into the daemon's JSON manifest next to its parts."""

    scheme: str
    layout: str
    group_size: int | None  # int4, int4_gidx, int8_group, fp8_block: columns per scale
    shape: tuple[int, int]  # the dense weight's [N, K]
    # mkldnn_packed only: oneDNN's serialized memory descriptor (hex); a worker needs it to view the bytes.
    descriptor: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"scheme": self.scheme, "layout": self.layout, "group_size": self.group_size,
                             "shape": list(self.shape)}
        if self.descriptor is not None:  # only where set: other layouts' manifests stay as they were
            d["descriptor"] = self.descriptor
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantMeta:
        try:
            n, k = (int(v) for v in d["shape"])
            gs = d.get("group_size")
            desc = d.get("descriptor")
            if d["scheme"] not in WEIGHT_SCHEMES:
                raise ValueError(f"unknown scheme {d['scheme']!r}")
            meta = cls(str(d["scheme"]), str(d["layout"]), None if gs is None else int(gs), (n, k),
                       None if desc is None else bytes.fromhex(desc).hex())
        except (KeyError, TypeError, ValueError) as e:
            raise QuantizationError(f"bad quantization metadata {d!r}: {e}") from None
        if meta.layout == LAYOUT_MKLDNN_PACKED:
            # Its size is oneDNN's to say (and needs the activation dtype): check only what the dict itself holds.
            if meta.scheme != "none" or not meta.descriptor:
                raise QuantizationError(f"layout {LAYOUT_MKLDNN_PACKED!r} needs scheme 'none' and a descriptor")
        else:
            layout_parts(meta, torch.float32)  # rejects unknown layouts / scheme-layout mismatches
        return meta


def validate_scheme(name: str) -> str:
    if name not in SCHEMES and name not in INT4_GROUP_SCHEMES:
        raise QuantizationError(f"unknown quantization {name!r} (choose none, int8, fp8, int4, int4-g64 or int4-g32)")
    return name


def is_quantized_target(name: str) -> bool:
    """True for the fused linear weights quantization applies to (q/k/v, o, gate/up, down)."""
    return _TARGET_RE.fullmatch(name) is not None


# ---------------------------------------------------------------------------------------------- int4 packing
def unpack_int4(qweight: torch.Tensor, layout: str, shape: tuple[int, int]) -> torch.Tensor:
    """The 4-bit codes [N, K] (uint8, 0..15) of an int4 `qweight` in `layout`; plain torch, any device."""
    n, k = shape
    if layout in (LAYOUT_INT4_CANONICAL, LAYOUT_INT4_GIDX):
        return torch.stack((qweight & 15, qweight >> 4), dim=-1).reshape(n, k)
    m = _INT4_CPU_RE.fullmatch(layout)
    if m is None:
        raise QuantizationError(f"unknown int4 layout {layout!r}")
    mode, block = m.group(1), int(m.group(2))
    # torch's CPU pack: row blocks of `block` (the last one may be shorter), each stored k-major with the
    # block's rows as nibbles: "pairs" = rows 2j, 2j+1 in byte j (low, high); "halves" = rows j, j + block/2.
    # A short last block is always stored as pairs.
    flat = qweight.reshape(-1)
    nb = n // block
    nf = nb * block
    full = flat[: nf * k // 2].view(nb, k, block // 2)
    lo, hi = full & 15, full >> 4
    rows = torch.stack((lo, hi), dim=-1).reshape(nb, k, block) if mode == "pairs" else torch.cat((lo, hi), dim=-1)
    out = [rows.permute(0, 2, 1).reshape(nf, k)]
    if n > nf:
        rest = flat[nf * k // 2:].view(k, (n - nf) // 2)
        out.append(torch.stack((rest & 15, rest >> 4), dim=-1).reshape(k, n - nf).t())
    return torch.cat(out).contiguous()


def pack_u4_groups(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit codes [N, K] (0..15, K % 32 == 0) -> the int8_group_u4 bytes [N, K / 2]."""
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n, k // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_u4_groups(qweight: torch.Tensor) -> torch.Tensor:
    """The int8_group_u4 bytes [N, K / 2] -> their codes [N, K] (uint8, 0..15); plain torch, any device."""
    n, half = qweight.shape
    b = qweight.view(n, half // 16, 1, 16)
    return torch.cat((b & 15, b >> 4), dim=2).reshape(n, half * 2)


def _nibble_pairs(lo_rows: torch.Tensor, hi_rows: torch.Tensor) -> torch.Tensor:
    """Canonical bytes of the rows whose codes go to the low / high nibbles ([..., R, K/2] each) -> their CPU pack
    [..., K, R]: column k = 2m takes both rows' low nibbles, k = 2m + 1 both high ones."""
    even = (lo_rows & 15) | (hi_rows << 4)
    odd = (lo_rows >> 4) | (hi_rows & 0xF0)
    return torch.stack((even.transpose(-1, -2), odd.transpose(-1, -2)), dim=-2).flatten(-3, -2)


def repack_int4_canonical(qweight: torch.Tensor, layout: str, shape: tuple[int, int]) -> torch.Tensor:
    """An ``int4_canonical`` qweight [N, K/2] in the CPU ``layout`` (the bytes torch's CPU int4 pack makes of the
    same codes), straight from byte to byte: no codes tensor, no int32 (the 1B's int4 arena: 1.75 -> 0.59 s)."""
    n, k = shape
    m = _INT4_CPU_RE.fullmatch(layout)
    if m is None:
        raise QuantizationError(f"unknown int4 layout {layout!r}")
    mode, block = m.group(1), int(m.group(2))
    nb = n // block
    nf = nb * block
    rows = qweight[:nf].view(nb, block, k // 2)
    lo, hi = (rows[:, 0::2], rows[:, 1::2]) if mode == "pairs" else (rows[:, :block // 2], rows[:, block // 2:])
    out = [_nibble_pairs(lo, hi).reshape(-1)]
    if n > nf:  # a short last block is always stored as pairs
        tail = qweight[nf:]
        out.append(_nibble_pairs(tail[0::2], tail[1::2]).reshape(-1))
    return torch.cat(out) if len(out) > 1 else out[0].contiguous()


@functools.cache
def cpu_int4_layout() -> str | None:
    """The layout this process's torch._convert_weight_to_int4pack_for_cpu produces; None if not recognised."""
    if not hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
        return None
    # 144 rows: two full 64-blocks plus a short one, so block size and both pack modes are told apart.
    n, k = 144, 4
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    try:
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
    except RuntimeError:
        return None
    matches = [name for name in (f"int4_cpu_{m}{b}" for m in ("halves", "pairs") for b in (64, 32, 16))
               if torch.equal(unpack_int4(packed, name, (n, k)).to(torch.int32), codes)]
    return matches[0] if len(matches) == 1 else None


# ---------------------------------------------------------------------------------------------- planning
def _group_size(k: int, requested: int, fallback: bool = True) -> int:
    if requested not in INT4_GROUP_SIZES:
        raise QuantizationError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {requested}")
    # The requested size, else (when we quantize, not for a checkpoint's own groups) the largest smaller one of
    # 64/32 that divides K.
    for gs in (requested, *(g for g in (64, 32) if g < requested and fallback)):
        if k % gs == 0:
            return gs
    raise QuantizationError(f"int4 needs K divisible by {requested}, 64 or 32; got K={k}")


def plan(shape: tuple[int, int], scheme: str, act_dtype: torch.dtype, device_type: str = "cpu",
         group_size: int = 128, fallback: bool = True) -> QuantMeta:
    """The QuantMeta `quantize` will produce for a weight of `shape`; raises QuantizationError if unsupported."""
    validate_scheme(scheme)
    if scheme in INT4_GROUP_SCHEMES:
        scheme, group_size = "int4", INT4_GROUP_SCHEMES[scheme]
    if act_dtype not in ACT_DTYPES:
        raise QuantizationError(f"activation dtype must be float32, bfloat16 or float16, got {act_dtype}")
    if len(shape) != 2 or min(shape) <= 0:
        raise QuantizationError(f"quantization needs a 2-D weight [N, K], got shape {tuple(shape)}")
    n, k = int(shape[0]), int(shape[1])
    if scheme == "none":
        return QuantMeta(scheme, LAYOUT_DENSE, None, (n, k))
    if scheme == "int8":
        return QuantMeta(scheme, LAYOUT_INT8, None, (n, k))
    if scheme == "fp8":
        return QuantMeta(scheme, LAYOUT_FP8, None, (n, k))
    gs = _group_size(k, group_size, fallback)
    layout = cpu_int4_layout() if device_type == "cpu" else None
    if layout is None:
        return QuantMeta(scheme, LAYOUT_INT4_CANONICAL, gs, (n, k))
    if n % 16:
        # torch's CPU int4 pack refuses it; say so now rather than at the first matmul.
        raise QuantizationError(f"int4 on cpu needs N (output features) divisible by 16; got N={n}")
    return QuantMeta(scheme, layout, gs, (n, k))


def layout_parts(meta: QuantMeta, act_dtype: torch.dtype) -> PartsLayout:
    """Part name -> (dtype, shape) of a weight described by `meta` (act_dtype: dtype of the scales)."""
    n, k = meta.shape
    lay = meta.layout
    if lay == LAYOUT_MKLDNN_PACKED and meta.scheme == "none":
        return {"packed": (torch.uint8, (packed_nbytes((n, k), act_dtype),))}
    expected = _SCHEME_LAYOUTS.get(meta.scheme)
    if expected is not None and lay not in expected:
        raise QuantizationError(f"scheme {meta.scheme!r} has layout {' or '.join(expected)}, not {lay!r}")
    if meta.scheme == "int4" and not (lay == LAYOUT_INT4_CANONICAL or _INT4_CPU_RE.fullmatch(lay)):
        raise QuantizationError(f"unknown layout {lay!r} for scheme 'int4'")
    if lay == LAYOUT_DENSE:
        return {"weight": (act_dtype, (n, k))}
    if lay == LAYOUT_INT8:
        return {"qweight": (torch.int8, (n, k)), "scales": (act_dtype, (n,))}
    if lay == LAYOUT_FP8:
        return {"qweight": (FP8_DTYPE, (n, k)), "scale": (torch.float32, (1,))}
    gs = meta.group_size
    if lay == LAYOUT_FP8_BLOCK:
        if not gs:
            raise QuantizationError(f"fp8_block needs a positive group size, got {gs}")
        return {"qweight": (FP8_DTYPE, (n, k)), "scales": (torch.float32, (n, -(-k // gs)))}
    if not gs or k % gs or k % 2:
        raise QuantizationError(f"int4 group size {gs} does not divide K={k}")
    if lay != LAYOUT_INT4_CANONICAL and n % 16:
        raise QuantizationError(f"int4 on cpu needs N (output features) divisible by 16; got N={n}")
    if lay == LAYOUT_INT8_GROUP_U4 and k % 32:
        raise QuantizationError(f"{lay} needs K (input features) divisible by 32; got K={k}")
    if lay in (LAYOUT_INT8_GROUP, LAYOUT_INT8_GIDX, LAYOUT_INT8_GROUP_U4, LAYOUT_INT4_CANONICAL, LAYOUT_INT4_GIDX):
        codes = (torch.int8, (n, k)) if lay in (LAYOUT_INT8_GROUP, LAYOUT_INT8_GIDX) else (torch.uint8, (n, k // 2))
        parts: PartsLayout = {"qweight": codes, "scales": (act_dtype, (n, k // gs)), "zeros": (act_dtype, (n, k // gs))}
        if lay in (LAYOUT_INT8_GIDX, LAYOUT_INT4_GIDX):
            parts["g_idx"] = (torch.int32, (k,))
        return parts
    return {"qweight": (torch.uint8, (n, k // 2)), "scales_and_zeros": (act_dtype, (k // gs, n, 2))}


def quantized_layout(shape: tuple[int, int], scheme: str, act_dtype: torch.dtype, device_type: str = "cpu",
                     group_size: int = 128) -> PartsLayout:
    """The parts (name -> (dtype, shape)) `quantize` returns for this weight, computed without its data."""
    return layout_parts(plan(shape, scheme, act_dtype, device_type, group_size), act_dtype)


# ---------------------------------------------------------------------------------------------- quantize
def _store(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`scale` in `dtype`, rounded up where rounding to nearest went down, so q never has to clip."""
    stored = scale.to(dtype)
    low = stored.float() < scale
    if bool(low.any()):
        stored = torch.where(low, torch.nextafter(stored, torch.full_like(stored, float("inf"))), stored)
    return stored


_BLOCK_BYTES = 256 << 10  # float32 bytes of a row block: it stays in cache while divided, rounded and clamped


def _int8_channel(w: torch.Tensor, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 codes and scales: scale = amax / 127 (stored in ``act_dtype``, see ``_store``), code =
    round(w / scale) in float32. On the CPU rows go in blocks through one float32 buffer: the whole weight in
    float32, a fresh allocation per op, ran at 0.1 GB/s of bf16 on the 1B's [11264, 2048] (page faults), blocks at
    0.6 GB/s, the same codes."""
    n, k = w.shape
    amax = w.abs().amax(dim=1).float()  # exact in w's own dtype; a NaN or an infinity in a row makes it non-finite
    if not bool(torch.isfinite(amax).all()):
        raise QuantizationError(f"weight of shape {tuple(w.shape)} has non-finite values")
    scales = _store(torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)), act_dtype)
    divisor = scales.float()[:, None]
    q = torch.empty(n, k, dtype=torch.int8, device=w.device)
    rows = max(1, _BLOCK_BYTES // (4 * max(k, 1))) if w.device.type == "cpu" else max(n, 1)
    buf = torch.empty(min(rows, n), k, dtype=torch.float32, device=w.device)
    for r in range(0, n, rows):
        block = buf[:min(n, r + rows) - r]
        block.copy_(w[r:r + rows]).div_(divisor[r:r + rows]).round_().clamp_(-127, 127)
        q[r:r + rows].copy_(block)
    return q, scales


Int8Rows = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor] | None"]


def quantize(w: torch.Tensor, scheme: str, act_dtype: torch.dtype, device_type: str = "cpu",
             group_size: int = 128, int8_rows: Int8Rows | None = None) -> tuple[QuantMeta, dict[str, torch.Tensor]]:
    """Quantize a dense weight [N, K]; returns its meta and exactly the contiguous parts of `quantized_layout`.
    ``int8_rows``: a faster implementation of int8's (codes, scales) for bfloat16 weights and scales, giving the same
    bits or None where it cannot run (the daemon passes the native kernel's; formats cannot import kernels)."""
    if w.dim() != 2:
        raise QuantizationError(f"quantization needs a 2-D weight [N, K], got shape {tuple(w.shape)}")
    meta = plan(tuple(w.shape), scheme, act_dtype, device_type, group_size)
    if scheme == "none":
        return meta, {"weight": w.to(act_dtype).contiguous()}
    if not w.is_floating_point():
        raise QuantizationError(f"cannot quantize a {w.dtype} weight")
    if device_type == "cpu":
        w = w.cpu()
    if scheme == "int8":
        made = int8_rows(w) if int8_rows is not None and w.dtype == act_dtype == torch.bfloat16 else None
        q, scales = made if made is not None else _int8_channel(w, act_dtype)
        parts = {"qweight": q, "scales": scales}
        _check_parts(meta, parts, act_dtype)
        return meta, parts
    w32 = w.float()
    if not bool(torch.isfinite(w32).all()):
        raise QuantizationError(f"weight of shape {tuple(w.shape)} has non-finite values")
    n, k = meta.shape

    if scheme == "fp8":
        amax = float(w32.abs().max())
        scale = torch.tensor([amax / FP8_MAX if amax > 0 else 1.0], dtype=torch.float32, device=w.device)
        q = (w32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        parts = {"qweight": q, "scale": scale}
    else:
        gs = meta.group_size
        assert gs is not None
        wg = w32.view(n, k // gs, gs)
        lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
        span = hi - lo
        scales = _store(torch.where(span > 0, span / 15.0, torch.ones_like(span)), act_dtype)
        # Constant groups get zero = the value itself (q = 8), so they dequantize exactly.
        zeros = torch.where(span > 0, lo + 8.0 * scales.float(), lo).to(act_dtype)
        # Codes from the stored (rounded) scale and zero: the best codes for what will be dequantized.
        q = torch.round((wg - zeros.float()[..., None]) / scales.float()[..., None]) + 8.0
        parts = pack_int4(meta, q.clamp_(0, 15).to(torch.uint8).view(n, k), scales, zeros)
    parts = {name: t.contiguous() for name, t in parts.items()}
    _check_parts(meta, parts, act_dtype)
    return meta, parts


def pack_int4(meta: QuantMeta, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              ) -> dict[str, torch.Tensor]:
    """The parts of an int4 weight in `meta`'s layout from its codes [N, K] (uint8, 0..15) and per-group scales and
    zeros [N, K/gs] (w = (code - 8) * scale + zero)."""
    if meta.layout == LAYOUT_INT4_CANONICAL:
        return {"qweight": codes[:, 0::2] | (codes[:, 1::2] << 4), "scales": scales, "zeros": zeros}
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)  # inner_k_tiles: unused
    return {"qweight": packed, "scales_and_zeros": torch.stack((scales.t(), zeros.t()), dim=-1)}


def _check_parts(meta: QuantMeta, parts: dict[str, torch.Tensor], act_dtype: torch.dtype) -> None:
    want = layout_parts(meta, act_dtype)
    got = {name: (t.dtype, tuple(t.shape)) for name, t in parts.items()}
    if got != want:
        raise QuantizationError(f"{meta.scheme}/{meta.layout}: parts {got} do not match layout {want}")
