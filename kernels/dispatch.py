"""The CPU dispatch table: (op, instruction set, rows) -> kernel, with why; the one place a CPU kernel is chosen.

Rules:
- The torch backend's CPU path (kernels/cpu.py, quant.py, cpu_packed.py) asks `select` which kernel computes a call.
  `RULES` are tried in order for the call's op: the first whose rows regime holds the call's rows, whose `fits`
  takes its tensors (dtype, layout, contiguity: cheap, so a float32 model never builds the C library), whose
  machine condition holds and whose instruction sets include `isa()` wins; none: the op's torch path (`DEFAULTS`).
- `isa()` is read on each call: ``KEEPWARM_CPU_NATIVE=0`` and `cpu_native.set_amx` change it at once.
- Every kernel computes what kernels/reference.py computes, up to the order of float32 sums
  (tests/unit/kernels/test_cpu_*.py).
- `describe()` is this machine's table (`keepwarm kernels` prints it); the first CPU call logs it in one line.
- Off the CPU (and for float64 x) every quantized linear takes the reference. The measurements behind each row's
  thresholds: docs/kernels.md.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from keepwarm.formats.quant import LAYOUT_INT8_GROUP, LAYOUT_INT8_GROUP_U4, LAYOUT_MKLDNN_PACKED, cpu_int4_layout

from . import cpu_native, native_ops

__all__ = ["DEFAULTS", "RULES", "Rule", "Table", "amx_takes", "avx2_quant_on", "describe", "fp8_scale", "int4_block",
           "isa", "rows_of", "select", "select_linear"]

logger = logging.getLogger("keepwarm.kernels.dispatch")

# Instruction-set levels, best first: what the C library runs with here (`isa`).
AMX, AVX512_VBMI, AVX512, AVX2, NONE = "amx", "avx512-vbmi", "avx512", "avx2", "none"
_AVX512S = frozenset({AMX, AVX512_VBMI, AVX512})
_BUILT = _AVX512S | {AVX2}
ANY = (0, None)

# Kernel names, as logged (quant.PATHS and kernels/cpu.py map them to functions).
INT8_OP = "torch._weight_int8pack_mm"
INT8_CAST = "int8->dtype cast + matmul, per-channel scale"
INT8_NATIVE = "keepwarm C kernel (AVX512-BF16)"
INT8_AMX = "keepwarm C kernel, int8 (AMX tiles)"
INT8_AVX2 = "keepwarm C kernel, int8 (AVX2)"
INT4_OP = "torch._weight_int4pack_mm_for_cpu"
INT4_AMX = "keepwarm C kernel, int4 (AMX tiles)"
INT4_VEC = "keepwarm C kernel, int4 (AVX512-BF16)"
INT4_AVX2 = "keepwarm C kernel, int4 (AVX2)"
FP8_BITS = "fp8 bits->float16 + matmul, scalar scale"
FP8_BLOCK_BITS = "fp8 bits->float16 + matmul, channel/block scales"
FP8_NATIVE = "keepwarm C kernel, fp8 (AVX512-BF16)"
FP8_AMX = "keepwarm C kernel, fp8 (AMX tiles)"
FP8_AVX2 = "keepwarm C kernel, fp8 (AVX2)"
CODES_WIDE = "codes->bf16 (C) + oneDNN bf16 matmul, scale on the output"
INT8G_AVX2 = "keepwarm C kernel, int8 groups (AVX2)"
INT8G_AVX512 = "keepwarm C kernel, int8 groups (AVX-512)"
INT8G_WIDE = "int8 groups->bf16 (C) + oneDNN bf16 matmul"
INT8G_AMX = "keepwarm C kernel, int8 groups (AMX tiles)"
REFERENCE = "reference dequantize+matmul"
MKLDNN_PACKED = "mkldnn packed"
F_LINEAR = "F.linear"
BF16_AVX2 = "keepwarm C kernel, bf16 (AVX2)"
BF16_AVX512 = "keepwarm C kernel, bf16 few rows (AVX-512)"
TORCH = "torch ops (kernels/reference.py)"
C_RMS_NORM = "keepwarm C rms_norm (AVX2)"
C_ROTARY = "keepwarm C neox rotary (AVX2)"
C_STORE_KV = "keepwarm C KV store"
C_ATTENTION = "keepwarm C decode attention (AVX2)"

_FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows of x above which an int8_group linear makes the bf16 weight and runs oneDNN's matmul (where oneDNN has one).
Q8G_WIDE_ROWS = 40
# Rows of x up to which int8_group weights the tiles take stay on them before the wide path (1B shapes, 2 threads: the
# tiles 0.20-0.90x its time at 41-64 rows but one shape, 1.07x; 0.44-1.54x at 128).
Q8G_TILE_ROWS = 64
_INT4_HALVES_RE = re.compile(r"int4_cpu_halves(\d+)")


# ---------------------------------------------------------------------------------------------- this machine
def isa() -> str:
    """The instruction set the C kernels run with here, now (`AMX` ... `NONE`); builds the library on first use."""
    if not cpu_native.switched_on():
        return NONE
    level = cpu_native.level()
    if level == NONE:
        cpu_native.log_unavailable("every op")
    return level


@functools.cache
def _simd() -> bool:
    """ATen's int8 / int4 weight-pack ops are vectorized for bfloat16 here (capability AVX2 or AVX512)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def _onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls here (AVX512-BW or AVX-NE-CONVERT): torch's bf16 linear is fast then."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _aten_vectorized() -> bool:  # looked up at each call, so tests can replace _simd
    return _simd()


def _no_onednn_bf16() -> bool:
    return not _onednn_bf16()


def amx_takes(rows: int, k: int) -> bool:
    """Whether an int8 / fp8 matmul of ``rows`` rows over K = ``k`` runs on the AMX tiles (the C side's rule: tiles
    on, two rows or more, K a multiple of 32); at one row both paths are the same streaming loop."""
    return rows >= 2 and k % 32 == 0 and isa() == AMX


def avx2_quant_on() -> bool:
    """Whether the AVX2 int8 / fp8 / int4 kernels serve bfloat16 x here (a build without AVX512-BF16, switch on)."""
    return isa() == AVX2


# ---------------------------------------------------------------------------------------------- what a call is
@functools.cache
def int4_block(layout: str) -> int:
    """Rows per block of an int4 "halves" CPU layout; 0 for any other layout. Cached: asked on every int4 call."""
    m = _INT4_HALVES_RE.fullmatch(layout)
    return int(m.group(1)) if m else 0


def fp8_scale(w: Any) -> torch.Tensor | None:
    """fp8's float32 scale for a per-tensor or per-row weight (what the fused kernels take); None for blocks."""
    if w.meta.scheme == "fp8":
        return w.parts["scale"]
    if w.meta.group_size is not None and w.meta.group_size >= w.meta.shape[1]:
        return w.parts["scales"][:, 0]
    return None


def _bf16(x: torch.Tensor, w: Any) -> bool:
    return x.dtype == torch.bfloat16


def _native(x: torch.Tensor, w: Any) -> bool:  # what the AVX512-BF16 int8 / fp8 kernel takes
    return x.dtype == torch.bfloat16 and w.parts["qweight"].is_contiguous()


def _native_k32(x: torch.Tensor, w: Any) -> bool:  # ... and the tiles (K a multiple of 32)
    return _native(x, w) and x.shape[-1] % 32 == 0


def _fp8_native(x: torch.Tensor, w: Any) -> bool:
    return _native(x, w) and fp8_scale(w) is not None


def _fp8_native_k32(x: torch.Tensor, w: Any) -> bool:
    return _native_k32(x, w) and fp8_scale(w) is not None


def _q8_int8(x: torch.Tensor, w: Any) -> bool:
    return native_ops.q8_fits(x, w.parts["qweight"], w.parts["scales"])


def _q8_fp8(x: torch.Tensor, w: Any) -> bool:
    scale = fp8_scale(w)
    return scale is not None and native_ops.q8_fits(x, w.parts["qweight"], scale)


_Q8G_LAYOUTS = (LAYOUT_INT8_GROUP, LAYOUT_INT8_GROUP_U4)


def _q8g(x: torch.Tensor, w: Any) -> bool:  # int8_group without g_idx, bf16 x (float32 x: the reference)
    p = w.parts
    return w.meta.layout in _Q8G_LAYOUTS and native_ops.q8g_fits(x, p["qweight"], p["scales"], p["zeros"],
                                                                 w.meta.group_size or 0)


def _q8g_tiles(x: torch.Tensor, w: Any) -> bool:  # what gemm_int8_group_amx.c takes (from 2 rows)
    k = x.shape[-1] if x.dim() else 0
    step = {LAYOUT_INT8_GROUP_U4: 128, LAYOUT_INT8_GROUP: 64}.get(w.meta.layout)
    return step is not None and w.meta.group_size in (16, 32) and k % step == 0 and _q8g(x, w)


def _q4(x: torch.Tensor, w: Any) -> bool:
    block = int4_block(w.meta.layout)
    return bool(block) and native_ops.q4_fits(x, w.parts["qweight"], w.parts["scales_and_zeros"],
                                              w.meta.group_size or 0, block)


def _q4_pairs(x: torch.Tensor, w: Any) -> bool:
    block = int4_block(w.meta.layout)
    return bool(block) and native_ops.q4_pairs_fits(x, w.parts["qweight"], w.parts["scales_and_zeros"],
                                                    w.meta.group_size or 0, block)


def _int4_op(x: torch.Tensor, w: Any) -> bool:
    # The packed order is per CPU capability: only a weight packed as this process packs can use the op.
    return x.dtype == torch.bfloat16 and w.meta.layout == cpu_int4_layout()


def _packed(x: torch.Tensor, w: Any) -> bool:  # a packed weight is on the CPU (cpu_packed.PackedWeight)
    return w.meta.layout == LAYOUT_MKLDNN_PACKED and x.dtype == w.dtype and x.device.type == "cpu"


def _bf16_dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return bias is None and native_ops.bf16_fits(x, weight)


def _bf16_few(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return bias is None and native_ops.bgemv_fits(x, weight)


def _norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (native_ops.rows_fit(x, 8) and weight.dtype == torch.bfloat16 and weight.is_contiguous()
            and weight.shape == (x.shape[1],))


def _add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    return (residual.dtype == x.dtype and residual.shape == x.shape and native_ops.rows_fit(residual, 8)
            and _norm(x, weight))


def _rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
            is_neox: bool) -> bool:
    return (is_neox and cos.shape[-1] * 2 == head_dim and query.dtype == key.dtype
            and native_ops.rows_fit(query, 16) and native_ops.rows_fit(key, 16) and head_dim % 16 == 0
            and cos.stride(1) == 1 and sin.stride(1) == 1 and cos.stride(0) == sin.stride(0)
            and cos.shape[0] == query.shape[0])


def _store(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    bf16 = torch.bfloat16
    if not (key.dtype == value.dtype == key_cache.dtype == value_cache.dtype == bf16 and key.dim() == 3
            and key.shape == value.shape and key_cache.shape == value_cache.shape and key.device.type == "cpu"):
        return False
    d = key.shape[2]
    return (key.stride()[1:] == (d, 1) and value.stride()[1:] == (d, 1) and key_cache.shape[::3] == key.shape[1:]
            and key_cache.is_contiguous() and value_cache.is_contiguous())


# ---------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True, slots=True)
class Rule:
    """One row: `op` calls of `rows` (lo, hi; hi None: no bound) that `fits` takes run `kernel` where `isa()` is one
    of `isa` (None: any machine) and `when` (a fact of the machine beyond its ISA, None: always) holds."""

    op: str
    isa: frozenset[str] | None
    rows: tuple[int, int | None]
    kernel: str
    takes: str  # what `fits` checks, in words
    why: str
    fits: Callable[..., bool]
    when: Callable[[], bool] | None = None


def _linear_rules() -> tuple[Rule, ...]:
    avx2, amx, avx512, vbmi = frozenset({AVX2}), frozenset({AMX}), _AVX512S, frozenset({AVX512_VBMI})
    int8_wide = "above 512 rows: the codes to bf16 once, then oneDNN's bf16 matmul (prefill chunks)"
    tiles = "the tiles from two rows: 1.2-1.6x bf16's time, where the vector loops took 2-4x"
    return (
        Rule("linear", avx512, (1, native_ops.BGEMV_ROWS), BF16_AVX512, "bf16 x and weight, K % 32 == 0, no bias",
             "8 weight rows side by side: 1.3x oneDNN's read rate from memory, 1.2-3.2x its speed in the caches",
             _bf16_few),
        Rule("linear", _BUILT, ANY, BF16_AVX2, "bf16 x and weight, K % 16 == 0, no bias",
             "oneDNN has no bf16 matmul on this CPU: torch's is a generic loop, ~4x slower", _bf16_dense,
             _no_onednn_bf16),
        Rule("linear_none", None, ANY, MKLDNN_PACKED, "a weight packed at preload, x in its dtype",
             "oneDNN's packed matmul: 1.7-3.7x faster than F.linear, the same bits", _packed),
        Rule("linear_int8", avx2, ANY, INT8_AVX2, "bf16 x, K % 16 == 0", "codes converted in registers: "
             "0.78x bf16's time at 1 row where the op took 0.9x", _q8_int8),
        Rule("linear_int8", avx512, (1, 4), INT8_OP, "bf16 x", "ATen's op wins up to 4 rows", _native,
             _aten_vectorized),
        Rule("linear_int8", amx, (513, None), CODES_WIDE, "bf16 x, K % 32 == 0", int8_wide, _native_k32),
        Rule("linear_int8", amx, (2, 512), INT8_AMX, "bf16 x, K % 32 == 0", tiles, _native_k32),
        Rule("linear_int8", avx512, ANY, INT8_NATIVE, "bf16 x", "codes converted in registers (1 row) or per tile",
             _native),
        Rule("linear_int8", None, (1, 8), INT8_OP, "bf16 x", "vectorized for bf16 only; wins at few rows", _bf16,
             _aten_vectorized),
        Rule("linear_int4", avx2, ANY, INT4_AVX2, "bf16 x, torch's halves pack", "torch's pack read in place: "
             "0.41x bf16's time at 1 row", _q4),
        Rule("linear_int4", amx, (5, None), INT4_AMX, "bf16 x, halves of 32/64 rows, K and group % 32 == 0",
             "above 4 rows: 0.86-0.94x bf16's time where the op took 1.1-4x", _q4_pairs),
        Rule("linear_int4", vbmi, (5, None), INT4_VEC, "bf16 x, halves of 32/64 rows, K and group % 32 == 0",
             "above 4 rows: 1.1-1.3x bf16's time where the op took 1.2-2.6x", _q4_pairs),
        Rule("linear_int4", None, ANY, INT4_OP, "bf16 x, packed by this process's ATen", "vectorized for bf16; "
             "a scalar loop otherwise (slower than the reference)", _int4_op, _aten_vectorized),
        Rule("linear_fp8", avx2, ANY, FP8_AVX2, "bf16 x, K % 16 == 0", "no fused fp8 op in torch", _q8_fp8),
        Rule("linear_fp8", amx, (513, None), CODES_WIDE, "bf16 x, K % 32 == 0", int8_wide, _native_k32),
        Rule("linear_fp8", amx, (2, 512), FP8_AMX, "bf16 x, K % 32 == 0", tiles, _native_k32),
        Rule("linear_fp8", avx512, ANY, FP8_NATIVE, "bf16 x", "no fused fp8 op in torch", _native),
        Rule("linear_fp8_block", avx2, ANY, FP8_AVX2, "bf16 x, one scale per row", "no fused fp8 op", _q8_fp8),
        Rule("linear_fp8_block", amx, (513, None), CODES_WIDE, "bf16 x, one scale per row, K % 32 == 0", int8_wide,
             _fp8_native_k32),
        Rule("linear_fp8_block", amx, (2, 512), FP8_AMX, "bf16 x, one scale per row, K % 32 == 0", tiles,
             _fp8_native_k32),
        Rule("linear_fp8_block", avx512, ANY, FP8_NATIVE, "bf16 x, one scale per row", "no fused fp8 op",
             _fp8_native),
        *_int8_group_rules(),
    )


def _int8_group_rules() -> tuple[Rule, ...]:
    """GGUF Q8_0 / Q5_K / Q6_K / Q4_K weights (the int8_group layout, no g_idx) for bf16 x; float32 x and groups
    not a multiple of 16 keep the reference (dequantize per call, then matmul). Figures: SmolLM2's shapes, one
    thread, against oneDNN's packed bf16 matmul (docs/kernels.md)."""
    takes = "bf16 x (float32 x: the reference), no g_idx, group % 16 == 0"
    tiles = "bf16 x, groups of 16 / 32, K % 64 == 0 (4-bit codes: K % 128 == 0)"
    return (
        Rule("linear_int8_group", frozenset({AMX}), (2, Q8G_TILE_ROWS), INT8G_AMX, tiles,
             "group sums on the tiles: 0.44-0.65x the 16-lane kernel's time at 8 rows, 0.39-0.55x at 16-32 (1B)",
             _q8g_tiles),
        Rule("linear_int8_group", _BUILT, (Q8G_WIDE_ROWS + 1, None), INT8G_WIDE, takes,
             "the reference's bf16 weight (C, its bits) + oneDNN: 3.1x bf16's time at 48 rows, the kernel 3.3-3.9x",
             _q8g, _onednn_bf16),
        Rule("linear_int8_group", _AVX512S, ANY, INT8G_AVX512, takes,
             "16 lanes: 0.60-0.68x bf16's time at 1 row, 1.20-1.33x at 8 (AVX2 kernel 0.70-0.75x, 1.60-1.78x)", _q8g),
        Rule("linear_int8_group", _BUILT, ANY, INT8G_AVX2, takes,
             "codes x scales in registers, one pass: 0.70-0.75x bf16's time at 1 row; the reference 8.6-35x", _q8g),
    )


def _glue_rules() -> tuple[Rule, ...]:
    why = "one C call where 5-12 small torch ops cost their dispatch; torch's roundings"
    return (
        Rule("rms_norm", _BUILT, ANY, C_RMS_NORM, "bf16 rows, H % 8 == 0", why, _norm),
        Rule("fused_add_rms_norm", _BUILT, ANY, C_RMS_NORM, "bf16 rows and residual, H % 8 == 0", why, _add_norm),
        Rule("rotary_embedding", _BUILT, ANY, C_ROTARY, "neox over whole heads, bf16, D % 16 == 0", why, _rotary),
        Rule("write_kv_cache", _BUILT, ANY, C_STORE_KV, "bf16 rows and pools (no KV scale)", why, _store),
        Rule("paged_attention", _BUILT, ANY, C_ATTENTION, "bf16 q and caches (no fp8 KV), D % 16 == 0",
             "reads K/V in place where torch copies each context out twice per layer", native_ops.attention_fits),
    )


RULES: tuple[Rule, ...] = (*_linear_rules(), *_glue_rules())
# The op's torch path, where no rule takes a call.
DEFAULTS: dict[str, str] = {
    "linear": F_LINEAR, "linear_none": REFERENCE, "linear_int8": INT8_CAST, "linear_int4": REFERENCE,
    "linear_fp8": FP8_BITS, "linear_fp8_block": FP8_BLOCK_BITS, "linear_int8_group": REFERENCE,
    "linear_int4_gidx": REFERENCE, "rms_norm": TORCH, "fused_add_rms_norm": TORCH, "rotary_embedding": TORCH,
    "write_kv_cache": TORCH, "paged_attention": TORCH,
}
_BY_OP: dict[str, tuple[Rule, ...]] = {op: tuple(r for r in RULES if r.op == op) for op in DEFAULTS}
_LINEAR_OPS = {op.removeprefix("linear_"): op for op in DEFAULTS if op.startswith("linear_")}
# ops whose rules all take any rows: select_linear does not count them
_ANY_ROWS = frozenset(op for op in DEFAULTS if all(r.rows == ANY for r in _BY_OP[op]))
_ISA_ROWS = frozenset(op for op in DEFAULTS if any(r.isa is not None for r in _BY_OP[op]))
_logged = [False]  # the table logged (at the first CPU call)


def select(op: str, rows: int, *args: Any) -> str:
    """The kernel that computes this call of `op` (`rows` rows of x; `args` as the op's rules' `fits` take them)."""
    # A decode step asks ~300 times: the ISA read at most once, and before the fits once the library is built (an
    # instruction set rules out a row for less than its fits cost); before that only a call a row fits builds it.
    level = isa() if op in _ISA_ROWS and cpu_native.loaded() else None
    kernel = DEFAULTS[op]
    for rule in _BY_OP[op]:
        lo, hi = rule.rows
        if rows < lo or (hi is not None and rows > hi) or (level is not None and rule.isa is not None
                                                            and level not in rule.isa) or not rule.fits(*args):
            continue
        if rule.when is not None and not rule.when():
            continue
        if rule.isa is not None:
            if level is None:
                level = isa()
            if level not in rule.isa:
                continue
        kernel = rule.kernel
        break
    if not _logged[0]:
        _log_table()
    return kernel


def rows_of(x: torch.Tensor) -> int:
    """The rows of x [..., K] a matmul sees (0 for a scalar or K == 0): `select`'s `rows` for a linear."""
    return x.numel() // max(x.shape[-1], 1) if x.dim() else 0


def select_linear(scheme: str, x: torch.Tensor, w: Any) -> str:
    """The kernel of ``linear_<scheme>`` for x and a quantized (or packed) weight: the reference off the CPU."""
    if x.device.type != "cpu" or w.device.type != "cpu" or x.dtype not in _FAST_DTYPES:
        return REFERENCE
    op = _LINEAR_OPS[scheme]
    return select(op, 0 if op in _ANY_ROWS else rows_of(x), x, w)


# ---------------------------------------------------------------------------------------------- describing it
@dataclass(frozen=True)
class Table:
    """This machine's table: its instruction set, the library's state, and the rules that can fire here in order
    (op, rows, what the call must be, kernel, why), each op closed by its torch path."""

    isa: str
    notes: tuple[str, ...]
    rows: tuple[tuple[str, str, str, str, str], ...]

    def lines(self) -> list[str]:
        rows = [("op", "rows", "takes", "kernel", "why"), *self.rows]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        out = [f"CPU kernels here: {self.isa} ({'; '.join(self.notes)}); the first row that takes a call wins"]
        out += ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4] for r in rows]
        return out

    def summary(self) -> str:
        by_op: dict[str, list[str]] = {}
        for op, rows, _, kernel, _ in self.rows:
            by_op.setdefault(op, []).append(f"{rows}: {_SHORT.get(kernel, kernel)}")
        return f"CPU kernels ({self.isa}; {'; '.join(self.notes)}): " + " | ".join(
            f"{op} [{', '.join(ks)}]" for op, ks in by_op.items())


# Kernel names in the one-line summary.
_SHORT = {INT8_OP: "aten op", INT4_OP: "aten op", INT8_CAST: "cast+matmul", FP8_BITS: "fp16 bits+matmul",
          FP8_BLOCK_BITS: "fp16 bits+matmul", INT8_NATIVE: "C avx512", FP8_NATIVE: "C avx512", INT4_VEC: "C avx512",
          INT8_AMX: "C amx", FP8_AMX: "C amx", INT4_AMX: "C amx", INT8_AVX2: "C avx2", FP8_AVX2: "C avx2",
          INT4_AVX2: "C avx2", BF16_AVX2: "C avx2", BF16_AVX512: "C avx512", CODES_WIDE: "codes->bf16+oneDNN",
          REFERENCE: "reference", MKLDNN_PACKED: "oneDNN packed", TORCH: "torch", C_RMS_NORM: "C", C_ROTARY: "C",
          C_STORE_KV: "C", C_ATTENTION: "C", INT8G_AVX2: "C avx2", INT8G_AVX512: "C avx512",
          INT8G_WIDE: "groups->bf16+oneDNN", INT8G_AMX: "C amx"}


def _expected_isa() -> str:
    """The instruction set the CPU's flags promise, before any build (the switch and a failed build aside)."""
    flags = cpu_native.cpu_flags()
    variant = cpu_native.variant_for(flags)
    if variant != "avx512":
        return AVX2 if variant else NONE
    if {"amx_tile", "amx_bf16"} <= flags and cpu_native.has_vbmi():
        return AMX
    return AVX512_VBMI if cpu_native.has_vbmi() else AVX512


def _rows_text(rows: tuple[int, int | None]) -> str:
    lo, hi = rows
    return "any" if rows == ANY else f"{lo}+" if hi is None else f"{lo}" if lo == hi else f"{lo}-{hi}"


def describe(build: bool = True) -> Table:
    """The rules that can fire on this machine. ``build=False`` never starts the library's build: an instruction set
    not yet known is given as the CPU's flags promise it."""
    if build or cpu_native.loaded():
        level, variant = isa(), cpu_native.variant_name() or "none"
        notes = [f"library: {variant} build"]
        if variant == "avx512":
            notes.append(f"AMX: {cpu_native.amx_reason() or 'on'}")
        if variant:
            notes.append(f"threads: {cpu_native.threads_reason() or 'torch OpenMP team'}")
    else:
        level = _expected_isa()
        notes = [f"library: {cpu_native.variant_for(cpu_native.cpu_flags()) or 'no'} build expected, not built yet"]
    if not cpu_native.switched_on():
        notes.append(f"{cpu_native.ENV_VAR}=0")
    rows = [(r.op, _rows_text(r.rows), r.takes, r.kernel, r.why) for op in DEFAULTS for r in _BY_OP[op]
            if (r.isa is None or level in r.isa) and (r.when is None or r.when())]
    rows += [(op, "any", "otherwise", DEFAULTS[op], "torch's own path") for op in DEFAULTS]
    order = list(DEFAULTS)
    rows.sort(key=lambda r: order.index(r[0]))  # stable: each op's rules in table order, then its default
    return Table(level, tuple(notes), tuple(rows))


def _log_table() -> None:
    _logged[0] = True
    logger.info("%s", describe(build=False).summary())
