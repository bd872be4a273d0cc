"""The native decode step (kernels/csrc/step.c): every decoder layer of a decode-only CPU step in one C call.

Rules:
- A `NativeStep` is built once per model and KV cache from `StepLayer`s (the layers' weights, norms and pools) and
  `StepShape`; `make` returns it, or why it cannot run (one line: the op, the layer, the weight) and nothing else.
- Each linear runs the C kernel kernels/dispatch.py picks for the same rows (`kinds`): the step is then the torch
  path bit for bit. Where the dispatch picks a kernel C cannot call (ATen's int4 op at 1-4 rows), the step runs
  keepwarm's own int4 kernel on the same pack (`SUBSTITUTES`): the same weight, float32 sums in another order,
  within the bound tests/unit/kernels/test_cpu_step.py states; `NativeStep.exact(rows)` says which. Rows the
  dispatch sends to a kernel C cannot call at all (int8 groups above 40 rows: oneDNN) are refused (`run` -> None).
- SiLU uses the vector expf ATen's silu runs (Sleef's, looked up in libtorch_cpu): without it, no step.
- ``KEEPWARM_CPU_STEP=0`` switches the step off (the layers then run op by op); read when a step is made.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from keepwarm.formats.quant import LAYOUT_INT8_GROUP_U4

from . import cpu_native, dispatch, native_ops

__all__ = ["ENV_VAR", "MAX_ROWS", "NativeStep", "StepLayer", "StepShape", "exp8_address", "make", "silu_mul"]

ENV_VAR = "KEEPWARM_CPU_STEP"
MAX_ROWS = dispatch.Q8G_WIDE_ROWS  # above it the int8-group linears take oneDNN, which C cannot call

# dispatch's kernel names -> step.c's kinds (KW_Q8G ... KW_BGEMV512); INT8G_AMX: 4-bit codes only (U4_KINDS)
KINDS = {dispatch.INT8G_AVX2: 1, dispatch.INT8G_AVX512: 2, dispatch.INT4_AVX2: 3, dispatch.INT4_VEC: 4,
         dispatch.INT4_AMX: 5, dispatch.BF16_AVX2: 6, dispatch.INT8G_AMX: 2, dispatch.BF16_AVX512: 9}
# The int8-group kinds for the 4-bit pack (int8_group_u4): KW_Q8G_U4, KW_Q8G512_U4 (which takes the tiles from 2 rows).
U4_KINDS = {dispatch.INT8G_AVX2: 7, dispatch.INT8G_AVX512: 8, dispatch.INT8G_AMX: 8}
# A kernel C cannot call -> keepwarm's kernel on the same weight (another float32 summation order).
SUBSTITUTES = {dispatch.INT4_OP: (dispatch.INT4_VEC, dispatch.INT4_AVX2), dispatch.F_LINEAR: (dispatch.BF16_AVX2,)}


class _Lin(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("q", ctypes.c_void_p), ("s", ctypes.c_void_p), ("z", ctypes.c_void_p),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("gs", ctypes.c_int64), ("B", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("kc", ctypes.c_void_p),
                ("vc", ctypes.c_void_p), ("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin), ("down", _Lin)]


class _Model(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("L", "H", "Hq", "Hk", "D", "I", "num_blocks", "bs")] + \
               [(n, ctypes.c_float) for n in ("eps", "scale", "softcap", "unused")] + [("exp8", ctypes.c_void_p)]


@dataclass(frozen=True)
class StepShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float
    softcap: float | None


@dataclass(frozen=True)
class StepLayer:
    """One Llama-family layer: norms [H] bf16, linears (dense bf16 [N, K] or a kernels.quant.QuantizedWeight, no
    bias), the layer's bf16 K/V pools [Hk, num_blocks, block_size, D]."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: object
    o: object
    gate_up: object
    down: object
    key_cache: torch.Tensor
    value_cache: torch.Tensor


@functools.cache
def exp8_address() -> int | None:
    """The address of Sleef's 8-lane expf in libtorch_cpu (ATen's vectorized exp), or None where it is not there."""
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        fn = ctypes.CDLL(str(lib)).Sleef_expf8_u10
    except (OSError, AttributeError):
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.cache
def _entry(name: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    lib = cpu_native.library()
    assert lib is not None, f"{name} called where no build loaded"
    fn = getattr(lib, name)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.restype = ctypes.c_int
    fn.argtypes = [p, p, i64, i64, p] if name == "kw_silu_mul" else \
        [p, p, p, p, i64, p, p, i64, p, p, ctypes.c_int]
    return fn


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for ``g, u = gate_up.chunk(2, -1)`` (bf16 [T, 2I] contiguous, I % 8 == 0), rounded where
    ATen's silu and mul round: step.c's SiLU on its own, for tests."""
    addr = exp8_address()
    if addr is None or gate_up.dtype != torch.bfloat16 or gate_up.dim() != 2 or not gate_up.is_contiguous():
        raise ValueError(f"silu_mul: {tuple(gate_up.shape)} {gate_up.dtype} does not fit, or no Sleef expf here")
    t, i2 = gate_up.shape
    out = torch.empty((t, i2 // 2), dtype=torch.bfloat16)
    if _entry("kw_silu_mul")(gate_up.data_ptr(), out.data_ptr(), t, i2 // 2, addr) != 0:
        raise ValueError(f"silu_mul: the kernel refused {tuple(gate_up.shape)}")
    return out


def _kernel(weight: object, rows: int) -> tuple[str, bool] | str:
    """(the dispatch's kernel for `rows` rows of bf16 x, or its substitute; whether it is the dispatch's own), or
    why neither runs in C."""
    k = weight.meta.shape[1] if hasattr(weight, "meta") else weight.shape[1]  # type: ignore[attr-defined]
    x = torch.empty((rows, k), dtype=torch.bfloat16)
    if isinstance(weight, torch.Tensor):
        name = dispatch.select("linear", rows, x, weight, None)
    else:
        name = dispatch.select_linear(weight.meta.scheme, x, weight)  # type: ignore[attr-defined]
    if name in KINDS:
        return name, True
    for sub in SUBSTITUTES.get(name, ()):
        if _fits(sub, x, weight):
            return sub, False
    return f"its kernel at {rows} rows is {name}, which a C step cannot call"


def _fits(kernel: str, x: torch.Tensor, w: object) -> bool:
    if kernel == dispatch.BF16_AVX2:
        return isinstance(w, torch.Tensor) and native_ops.bf16_fits(x, w)
    p, m = w.parts, w.meta  # type: ignore[attr-defined]
    block = dispatch.int4_block(m.layout)
    if kernel == dispatch.INT4_VEC:
        return cpu_native.has_vbmi() and native_ops.q4_pairs_fits(x, p["qweight"], p["scales_and_zeros"],
                                                                   m.group_size, block)
    return native_ops.q4_fits(x, p["qweight"], p["scales_and_zeros"], m.group_size, block)


def _lin(weight: object, kernel: str) -> _Lin:
    if isinstance(weight, torch.Tensor):  # dense bf16 [N, K]
        n, k = weight.shape
        return _Lin(KINDS[kernel], weight.data_ptr(), None, None, n, k, 0, 0)
    p, m = weight.parts, weight.meta  # type: ignore[attr-defined]
    n, k = m.shape
    if m.scheme == "int8_group":
        kind = U4_KINDS[kernel] if m.layout == LAYOUT_INT8_GROUP_U4 else KINDS[kernel]
        return _Lin(kind, p["qweight"].data_ptr(), p["scales"].data_ptr(), p["zeros"].data_ptr(), n, k,
                    m.group_size, 0)
    return _Lin(KINDS[kernel], p["qweight"].data_ptr(), p["scales_and_zeros"].data_ptr(), None, n, k, m.group_size,
                dispatch.int4_block(m.layout))


_LINEARS = ("qkv", "o", "gate_up", "down")


class NativeStep:
    """A model's layers for kw_decode_step: `run` one decode-only step of `rows` <= MAX_ROWS rows."""

    def __init__(self, shape: StepShape, layers: Sequence[StepLayer], exp8: int) -> None:
        self.shape, self.layers = shape, tuple(layers)
        kc = layers[0].key_cache
        hk, nb, bs, d = kc.shape
        self._model = _Model(len(layers), shape.hidden, shape.heads, hk, d, shape.intermediate, nb, bs, shape.eps,
                             shape.scale, shape.softcap or 0.0, 0.0, exp8)
        self._arrays: dict[int, tuple[ctypes.Array[_Layer], bool] | str] = {}
        self._fn = _entry("kw_decode_step")

    def plan(self, rows: int) -> tuple[ctypes.Array[_Layer], bool] | str:
        """The layer array for `rows` rows and whether each kernel is the dispatch's own (the step then equals the
        torch path bit for bit), or why no step runs at this many rows; made once per row count."""
        got = self._arrays.get(rows)
        if got is None:
            got = self._arrays[rows] = self._make(rows)
        return got

    def _make(self, rows: int) -> tuple[ctypes.Array[_Layer], bool] | str:
        if rows > MAX_ROWS:
            return f"{rows} rows: above {MAX_ROWS} the int8-group linears take oneDNN"
        picked: dict[str, tuple[str, bool]] = {}  # every layer has the same layouts: pick once per linear
        array = (_Layer * len(self.layers))()
        for i, layer in enumerate(self.layers):
            lins = []
            for name in _LINEARS:
                w = getattr(layer, name)
                key = f"{name}:{_signature(w)}"
                if key not in picked:
                    got = _kernel(w, rows)
                    if isinstance(got, str):
                        return f"layer {i} {name}: {got}"
                    picked[key] = got
                lins.append(_lin(w, picked[key][0]))
            array[i] = _Layer(layer.in_norm.data_ptr(), layer.post_norm.data_ptr(), layer.key_cache.data_ptr(),
                              layer.value_cache.data_ptr(), *lins)
        return array, all(own for _, own in picked.values())

    def exact(self, rows: int) -> bool:
        """Whether a step of `rows` rows is the torch path's bit for bit (every kernel the dispatch's own)."""
        got = self.plan(rows)
        return not isinstance(got, str) and got[1]

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
            attention_plan: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer over x [T, H] bf16 (the embeddings; overwritten with the last MLP's output): (that output,
        the residual), or None where `plan` refuses T rows. cos, sin [T, D / 2] float32 with one row stride; slots
        [T] int64; attention_plan: native_ops.attention_plan's rows of the T decode sequences, in order."""
        got = self.plan(x.shape[0])
        if isinstance(got, str):
            return None
        res = torch.empty_like(x)
        rc = self._fn(ctypes.addressof(self._model), ctypes.addressof(got[0]), x.data_ptr(), res.data_ptr(),
                      x.shape[0], cos.data_ptr(), sin.data_ptr(), cos.stride(0), slots.data_ptr(),
                      attention_plan.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"kw_decode_step refused its operands (rc {rc}: {_op(rc)})")
        return x, res


def _signature(w: object) -> tuple[object, ...]:
    if isinstance(w, torch.Tensor):
        return ("dense", w.dtype, tuple(w.shape))
    m = w.meta  # type: ignore[attr-defined]
    return (m.scheme, m.layout, tuple(m.shape), m.group_size)


def _op(rc: int) -> str:
    if rc in (-1, -2):
        return "bad arguments" if rc == -1 else "no memory"
    layer, op = divmod(-rc - 10, 16)
    ops = ("?", "input norm", "qkv", "rotary", "KV store", "attention", "o", "post norm", "gate-up", "down")
    return f"layer {layer} {ops[op] if op < len(ops) else '?'}"


def make(shape: StepShape, layers: Sequence[StepLayer]) -> NativeStep | str:
    """A `NativeStep` for these layers, or why none runs here (one line)."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return f"{ENV_VAR}=0"
    if not cpu_native.glue_on():
        return "the C library is not built or switched off here"
    exp8 = exp8_address()
    if exp8 is None:
        return "libtorch_cpu has no Sleef_expf8_u10 (the expf of ATen's silu)"
    if not layers:
        return "no layers"
    for what, ok in _shape_checks(shape, layers):
        if not ok:
            return what
    return NativeStep(shape, layers, exp8)


def _shape_checks(shape: StepShape, layers: Sequence[StepLayer]) -> list[tuple[str, bool]]:
    bf16 = torch.bfloat16
    kc = layers[0].key_cache
    tensors = [t for ly in layers for t in (ly.in_norm, ly.post_norm, ly.key_cache, ly.value_cache)]
    return [
        ("hidden size not a multiple of 8", shape.hidden % 8 == 0),
        ("intermediate size not a multiple of 8", shape.intermediate % 8 == 0),
        ("head dim not a multiple of 16", shape.head_dim % 16 == 0),
        ("KV pools not bf16 [Hk, blocks, block_size, head_dim]",
         kc.dim() == 4 and kc.shape[3] == shape.head_dim and kc.shape[0] == shape.kv_heads),
        ("norms and KV pools: not contiguous bf16 CPU tensors (an fp8 KV cache?)",
         all(t.dtype == bf16 and t.is_contiguous() and t.device.type == "cpu" for t in tensors)),
        ("KV pools of different shapes", all(ly.key_cache.shape == kc.shape == ly.value_cache.shape
                                             for ly in layers)),
    ]
