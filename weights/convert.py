"""Pre-quantized projections into keepwarm's arena layouts, exactly (no dequantize and re-quantize).

Rules:
- Each projection's codes are unpacked by its format's published packing rule and stored in the kernel-native layout
  they map to exactly (which source becomes which layout: docs/quantization.md, "Arena layouts"); its scales and
  zero points become that layout's scales and zeros, computed in float32 (exact for the integer zero points and the
  scales' own dtype) and stored in the activation dtype. Where that store rounds (e.g. fp16 scales in a bfloat16
  arena) it is logged once per weight kind, never silent.
- A fused weight (q|k|v, gate|up) is the projections' codes and scales concatenated along N; scales that cannot be
  concatenated as they are (per-tensor, or row blocks) are expanded to per row first, which is exact.
- Every size and shape is checked against the planned layout: a scale of the wrong shape is refused naming the
  tensor, never broadcast into a wrong answer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from keepwarm.formats.errors import QuantizationError
from keepwarm.formats.gguf import QUANT_TYPES, decode, unpermute_rows
from keepwarm.formats.quant import (
    FP8_DTYPE,
    LAYOUT_FP8,
    LAYOUT_FP8_BLOCK,
    LAYOUT_INT4_GIDX,
    LAYOUT_INT8,
    LAYOUT_INT8_GIDX,
    LAYOUT_INT8_GROUP,
    LAYOUT_INT8_GROUP_U4,
    QuantMeta,
    layout_parts,
    pack_int4,
    pack_u4_groups,
    plan,
)
from keepwarm.weights.prequant import SourceQuant

log = logging.getLogger("keepwarm.daemon")

# GGUF types whose blocks are torch's int4 groups of 32: (q - 8) * d + 0 and q * d + m = (q - 8) * d + (m + 8d).
# Q4_K's w = d*sc*q - dmin*m has a zero that does not fold into the tinygemm form without rounding, and IQ4's codes
# index a non-linear table: they go to int8 groups, which store the code and the offset as they are.
INT4_EXACT_TYPES = frozenset({"Q4_0", "Q4_1"})
# GGUF types whose stored codes are unsigned 4-bit (formats/gguf.py's decode: Q4_K q, Q2_K q): int8_group_u4.
U4_TYPES = frozenset({"Q4_K", "Q2_K"})
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of an int32 holds column AWQ_ORDER[i] of its 8
_INT4_ARENA_GROUPS = (128, 64, 32, 256)  # per-channel int4 becomes groups of the first of these dividing K
_ROUNDING_LOGGED: set[tuple[str, str]] = set()

Shape = tuple[int, int]


# ---------------------------------------------------------------------------------------------- shapes
def dense_shape(src: SourceQuant, tensors: Mapping[str, tuple[int, ...]], proj: str) -> Shape:
    """A projection's dense [N, K] from its source tensors' shapes (headers only)."""
    def need(name: str, dims: int) -> tuple[int, ...]:
        shape = tensors[name]
        if len(shape) != dims:
            raise QuantizationError(f"{proj}.{name} has shape {list(shape)}, expected {dims} dimensions")
        return shape

    per_int32 = 32 // src.bits
    if src.kind == "ct_pack":
        n, cols = need("weight_packed", 2)
        return n, cols * per_int32
    if src.kind == "gptq":
        rows, n = need("qweight", 2)
        return n, rows * per_int32
    if src.kind == "awq":
        k, cols = need("qweight", 2)
        return cols * per_int32, k
    n, k = need("weight", 2)
    return n, k


def _groups(k: int, src: SourceQuant) -> int:
    """Columns per scale in the source."""
    if src.strategy == "group":
        assert src.group_size is not None
        if k % src.group_size:
            raise QuantizationError(f"{src.method} group size {src.group_size} does not divide K={k}")
        return src.group_size
    if src.strategy == "block":
        assert src.block is not None
        return src.block[1]
    return k


def plan_weight(src: SourceQuant, shapes: Sequence[Shape], act_dtype: torch.dtype, device_type: str) -> QuantMeta:
    """The arena layout of a fused weight made of projections of `shapes` (headers only, nothing read)."""
    ks = {k for _, k in shapes}
    if len(ks) != 1:
        raise QuantizationError(f"fused projections have different K: {sorted(ks)}")
    (k,) = ks
    shape = (sum(n for n, _ in shapes), k)
    gs = _groups(k, src)
    if src.scheme == "fp8":
        if src.strategy == "tensor" and len(shapes) == 1:
            return QuantMeta("fp8", LAYOUT_FP8, None, shape)
        return QuantMeta("fp8_block", LAYOUT_FP8_BLOCK, gs, shape)
    if src.bits == 4:
        if src.g_idx:
            return QuantMeta("int4_gidx", LAYOUT_INT4_GIDX, gs, shape)
        if src.strategy == "channel":
            gs = next((g for g in _INT4_ARENA_GROUPS if k % g == 0), 0)
            if not gs:
                raise QuantizationError(f"{src.description}: K={k} is not a multiple of 32 (int4 arena groups)")
        return plan(shape, "int4", act_dtype, device_type, gs, fallback=False)
    if src.symmetric and src.strategy == "channel" and not src.g_idx and src.zero_offset == 0 and \
            src.kind != "gptq":
        return QuantMeta("int8", LAYOUT_INT8, None, shape)
    return QuantMeta("int8_group", LAYOUT_INT8_GIDX if src.g_idx else LAYOUT_INT8_GROUP, gs, shape)


def plan_gguf(types: Sequence[str], shapes: Sequence[Shape], act_dtype: torch.dtype, device_type: str,
              ) -> QuantMeta:
    """A fused GGUF weight's layout: torch's int4 groups of 32 when every projection is Q4_0 / Q4_1, else int8 groups
    of the smallest group size among its types (16 beside Q2_K / Q3_K / Q6_K, else 32): every type's codes fit int8
    as they are and a coarser scale repeats exactly; stored as 4-bit codes (int8_group_u4) when every projection's
    codes are unsigned 4-bit ones (Q4_K, Q2_K)."""
    ks = {k for _, k in shapes}
    if len(ks) != 1:
        raise QuantizationError(f"fused projections have different K: {sorted(ks)}")
    shape = (sum(n for n, _ in shapes), ks.pop())
    groups = {QUANT_TYPES[t][3] for t in types}
    if set(types) <= INT4_EXACT_TYPES:
        return plan(shape, "int4", act_dtype, device_type, 32, fallback=False)
    if set(types) <= U4_TYPES and shape[1] % 32 == 0:  # codes 0..15: the int8 kernels' math on half the bytes
        return QuantMeta("int8_group", LAYOUT_INT8_GROUP_U4, min(groups), shape)
    return QuantMeta("int8_group", LAYOUT_INT8_GROUP, min(groups), shape)


def convert_gguf(meta: QuantMeta, projections: Sequence[tuple[str, torch.Tensor, int]], shapes: Sequence[Shape],
                 act_dtype: torch.dtype, name: str) -> dict[str, torch.Tensor]:
    """The arena parts of a fused GGUF weight from its projections' (type, raw blocks, Q/K heads or 0)."""
    decoded = []
    for (type_name, raw, heads), (n, k) in zip(projections, shapes, strict=True):
        if raw.numel() % n:
            raise QuantizationError(f"{name}: {raw.numel()} bytes of {type_name} do not split into {n} rows")
        rows = raw.reshape(n, -1)
        if heads:
            rows = unpermute_rows(rows, heads)
        codes, scale, offset = decode(type_name, rows, (n, k))
        assert meta.group_size is not None
        if scale.shape[1] != k // meta.group_size:  # a coarser type beside a finer one: spread its groups
            rep = k // meta.group_size // scale.shape[1]
            scale, offset = scale.repeat_interleave(rep, dim=1), offset.repeat_interleave(rep, dim=1)
        decoded.append((codes, scale, offset))
    codes, scale, offset = (torch.cat(x) for x in zip(*decoded, strict=True))
    return _checked(meta, _int_parts(meta, codes, scale, offset, None, act_dtype, name), act_dtype, name)


# ---------------------------------------------------------------------------------------------- unpacking
def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """Unsigned codes from int32 words packing 32/bits values along `dim`, lowest bits first (value i of a word
    goes to position order[i] of its run, default i)."""
    per = 32 // bits
    mask = (1 << bits) - 1
    p = packed.to(torch.int64) & 0xFFFFFFFF  # the words as unsigned
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    moved = p.movedim(dim, -1)
    vals = (moved[..., None] >> shifts) & mask  # [..., words, per]
    if order is not None:
        inv = [0] * per
        for i, pos in enumerate(order):
            inv[pos] = i
        vals = vals[..., inv]
    return vals.reshape(*moved.shape[:-1], moved.shape[-1] * per).movedim(-1, dim)


def _part(t: Mapping[str, torch.Tensor], name: str, proj: str, shape: tuple[int, ...] | None = None,
          ) -> torch.Tensor:
    if name not in t:
        raise QuantizationError(f"{proj}.{name} is missing")
    x = t[name]
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise QuantizationError(f"{proj}.{name} has shape {list(x.shape)}, expected {list(shape)}")
    return x


def _scale_2d(s: torch.Tensor, rows: int, cols: int, proj: str, name: str) -> torch.Tensor:
    """A scale of [rows, cols] (a [rows] vector or a scalar accepted where cols or both are 1), float32."""
    if s.numel() == rows * cols and (s.dim() == 2 and tuple(s.shape) == (rows, cols) or
                                     s.dim() <= 1 and (cols == 1)):
        return s.float().reshape(rows, cols)
    raise QuantizationError(f"{proj}.{name} has shape {list(s.shape)}, expected {[rows, cols]}")


def _codes_and_params(src: SourceQuant, t: Mapping[str, torch.Tensor], shape: Shape, proj: str,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Integer formats: unsigned codes [N, K] (int64), scale [N, G] and offset [N, G] (float32, so
    w = code * scale + offset, offset = -zero point * scale: exact), and the group index [K] or None."""
    n, k = shape
    gs = _groups(k, src)
    g = k // gs
    mid = 1 << (src.bits - 1)
    per = 32 // src.bits
    g_idx = None
    if src.kind in ("ct_pack", "ct_int"):
        if src.kind == "ct_pack":
            words = _part(t, "weight_packed", proj, (n, -(-k // per)))
            codes = unpack_int32(words, src.bits, 1)[:, :k]
            if "weight_shape" in t and [int(v) for v in t["weight_shape"].reshape(-1)] != [n, k]:
                raise QuantizationError(f"{proj}.weight_shape = {t['weight_shape'].tolist()}, expected {[n, k]}")
        else:
            codes = _part(t, "weight", proj, (n, k)).to(torch.int64) + mid
        scale = _scale_2d(_part(t, "weight_scale", proj), n, g, proj, "weight_scale")
        if src.symmetric:
            zero = torch.full((n, g), float(mid))
        else:
            zp = _part(t, "weight_zero_point", proj)
            if src.kind == "ct_pack" and zp.dtype == torch.int32 and tuple(zp.shape) == (-(-n // per), g):
                zp = unpack_int32(zp, src.bits, 0)[:n] - mid  # packed along N, like the codes' offset
            zero = _scale_2d(zp.to(torch.float32), n, g, proj, "weight_zero_point") + mid
        if src.g_idx:
            g_idx = _part(t, "weight_g_idx", proj, (k,)).to(torch.int64)
    elif src.kind == "gptq":
        codes = unpack_int32(_part(t, "qweight", proj, (k // per, n)), src.bits, 0).t()
        scale = _part(t, "scales", proj, (g, n)).float().t()
        zeros = unpack_int32(_part(t, "qzeros", proj, (g, -(-n // per))), src.bits, 1)[:, :n]
        zero = (zeros + src.zero_offset).float().t()
        if src.g_idx:
            g_idx = _part(t, "g_idx", proj, (k,)).to(torch.int64)
    else:  # awq
        codes = unpack_int32(_part(t, "qweight", proj, (k, n // per)), 4, 1, AWQ_ORDER).t()
        scale = _part(t, "scales", proj, (g, n)).float().t()
        if src.symmetric:
            zero = torch.full((n, g), float(mid))
        else:
            zero = unpack_int32(_part(t, "qzeros", proj, (g, n // per)), 4, 1, AWQ_ORDER).float().t()
    if g_idx is not None and (int(g_idx.min()) < 0 or int(g_idx.max()) >= g):
        raise QuantizationError(f"{proj}: group index values outside [0, {g})")
    return codes.contiguous(), scale.contiguous(), (-zero * scale).contiguous(), g_idx


def _fp8_parts(src: SourceQuant, t: Mapping[str, torch.Tensor], shape: Shape, proj: str,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 codes [N, K] and float32 scales [N, ceil(K / columns per scale)] (rows expanded)."""
    n, k = shape
    q = _part(t, "weight", proj, (n, k))
    if q.dtype != FP8_DTYPE:
        raise QuantizationError(f"{proj}.weight is {str(q.dtype).removeprefix('torch.')}, expected float8_e4m3fn")
    name = "weight_scale_inv" if "weight_scale_inv" in t else "weight_scale"
    s = _part(t, name, proj)
    if src.strategy == "block":
        assert src.block is not None
        bn, bk = src.block
        rows, cols = -(-n // bn), -(-k // bk)
        s = _scale_2d(s, rows, cols, proj, name).repeat_interleave(bn, dim=0)[:n]
    elif src.strategy == "channel":
        s = _scale_2d(s, n, 1, proj, name)
    else:
        s = _scale_2d(s, 1, 1, proj, name).expand(n, 1)
    return q, s.contiguous()


def _check_folded(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, folded: torch.Tensor,
                  shift: float, name: str) -> None:
    """Logs when (u - shift) * s + folded differs from u * s + offset in float32 for any weight."""
    n, k = codes.shape
    g = scale.shape[1]
    c = codes.float().view(n, g, k // g)
    src = c * scale[..., None] + offset[..., None]
    got = (c - shift) * scale[..., None] + folded[..., None]
    bad = int((src != got).sum())
    if bad:
        log.warning("%s: %d of %d weights differ in the last float32 bit after folding the offset into a zero "
                    "(tinygemm's (q - %d) * scale + zero form)", name, bad, codes.numel(), int(shift))


def _store(x: torch.Tensor, dtype: torch.dtype, what: str, weight: str) -> torch.Tensor:
    """x (float32) in dtype; a rounding store is logged once per (what, dtype), never silent."""
    stored = x.to(dtype)
    key = (what, str(dtype))
    if key not in _ROUNDING_LOGGED and not torch.equal(stored.float(), x):
        _ROUNDING_LOGGED.add(key)
        log.warning("%s of %s rounded when stored as %s (first seen; the checkpoint's values do not fit the arena "
                    "dtype exactly)", what, weight, str(dtype).removeprefix("torch."))
    return stored


def convert_weight(src: SourceQuant, meta: QuantMeta, projections: Sequence[Mapping[str, torch.Tensor]],
                   shapes: Sequence[Shape], act_dtype: torch.dtype, name: str) -> dict[str, torch.Tensor]:
    """The arena parts of a fused weight from its projections' source tensors (CPU), for `meta`'s layout."""
    projs = [f"{name}[{i}]" for i in range(len(shapes))]
    if src.scheme == "fp8":
        qs, ss = zip(*(_fp8_parts(src, t, s, p) for t, s, p in zip(projections, shapes, projs, strict=True)),
                     strict=True)
        q, s = torch.cat(qs), torch.cat(ss)
        scale_part = {"scale": s[:1, 0]} if meta.layout == LAYOUT_FP8 else {"scales": s}
        parts = {"qweight": q, **scale_part}
    else:
        unpacked = [_codes_and_params(src, t, s, p) for t, s, p in zip(projections, shapes, projs, strict=True)]
        codes = torch.cat([u[0] for u in unpacked])
        scale = torch.cat([u[1] for u in unpacked])
        offset = torch.cat([u[2] for u in unpacked])
        g_idx = unpacked[0][3]
        if any(not torch.equal(u[3], g_idx) for u in unpacked[1:] if u[3] is not None and g_idx is not None):
            raise QuantizationError(f"{name}: fused projections have different group indices (act order); "
                                    f"keepwarm fuses them into one weight and needs one order")
        parts = _int_parts(meta, codes, scale, offset, g_idx, act_dtype, name)
    return _checked(meta, parts, act_dtype, name)


def _checked(meta: QuantMeta, parts: dict[str, torch.Tensor], act_dtype: torch.dtype, name: str,
             ) -> dict[str, torch.Tensor]:
    parts = {k: v.contiguous() for k, v in parts.items()}
    want = layout_parts(meta, act_dtype)
    got = {k: (v.dtype, tuple(v.shape)) for k, v in parts.items()}
    if got != want:
        raise QuantizationError(f"{name}: converted parts {got} do not match layout {want}")
    return parts


def _int_parts(meta: QuantMeta, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
               g_idx: torch.Tensor | None, act_dtype: torch.dtype, name: str) -> dict[str, torch.Tensor]:
    """The parts of `meta`'s integer layout from w = codes * scale + offset (codes unsigned, or signed within int8,
    per-group scale and offset; groups by g_idx when given, else contiguous and possibly larger than the layout's:
    then repeated)."""
    n, k = meta.shape
    if g_idx is None and meta.group_size is not None and scale.shape[1] != k // meta.group_size:
        rep = k // meta.group_size // scale.shape[1]  # a coarser source group spread over the layout's groups
        scale, offset = scale.repeat_interleave(rep, dim=1), offset.repeat_interleave(rep, dim=1)
    if meta.scheme in ("int4", "int4_gidx"):
        # w = u * s + o = (u - 8) * s + (o + 8 * s): the tinygemm convention; o + 8 * s is exact in float32 for
        # integer zero points, and checked (logged where a float offset such as Q4_1's m rounds) otherwise.
        z = offset + 8.0 * scale
        _check_folded(codes, scale, offset, z, 8.0, name)
        if meta.layout == LAYOUT_INT4_GIDX:
            c = codes.to(torch.uint8)
            assert g_idx is not None
            return {"qweight": c[:, 0::2] | (c[:, 1::2] << 4), "scales": _store(scale, act_dtype, "scales", name),
                    "zeros": _store(z, act_dtype, "zeros", name), "g_idx": g_idx.to(torch.int32)}
        return pack_int4(meta, codes.to(torch.uint8), _store(scale, act_dtype, "scales", name),
                         _store(z, act_dtype, "zeros", name))
    lo, hi = (int(x) for x in torch.aminmax(codes))
    if meta.layout == LAYOUT_INT8_GROUP_U4:  # 4-bit codes as they are: no shift, the offset unchanged
        if lo < 0 or hi > 15:
            raise QuantizationError(f"{name}: codes {lo}..{hi} do not fit {LAYOUT_INT8_GROUP_U4} (0..15)")
        return {"qweight": pack_u4_groups(codes), "scales": _store(scale, act_dtype, "scales", name),
                "zeros": _store(offset, act_dtype, "zeros", name)}
    # int8: q = u - shift; w = u * s + o = q * s + (o + shift * s). Codes that fit int8 as they are (every GGUF
    # type's) keep shift 0 and their offset unchanged: no rounding at all.
    shift = 128 if meta.layout == LAYOUT_INT8 or hi > 127 else 0
    if lo - shift < -128 or hi - shift > 127:
        raise QuantizationError(f"{name}: codes {lo}..{hi} do not fit int8")
    q = (codes - shift).to(torch.int8)
    zeros = offset + float(shift) * scale if shift else offset
    if shift:
        _check_folded(codes, scale, offset, zeros, float(shift), name)
    if meta.layout == LAYOUT_INT8:
        if bool(zeros.any()):
            raise QuantizationError(f"{name}: per-channel int8 with a zero point has no int8_channel layout")
        return {"qweight": q, "scales": _store(scale[:, 0], act_dtype, "scales", name)}
    parts = {"qweight": q, "scales": _store(scale, act_dtype, "scales", name),
             "zeros": _store(zeros, act_dtype, "zeros", name)}
    if meta.layout == LAYOUT_INT8_GIDX:
        assert g_idx is not None
        parts["g_idx"] = g_idx.to(torch.int32)
    return parts
