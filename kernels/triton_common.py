"""Shared pieces of the Triton backend: in-kernel dtype helpers and host-side launch helpers.

Rules:
- Every Triton kernel here loads, upcasts to float32, computes in float32 and rounds once when storing (or when
  feeding a matmul): what the torch reference does.
- Triton's CPU interpreter (TRITON_INTERPRET=1, the tests) stores bfloat16 as raw uint16 and has no float8
  arithmetic, so bfloat16 rounding is integer ops (`round_as`), float8 is uint8 bits (`fp8_to_f32` /
  `f32_to_fp8`), and interpreted bfloat16 matmul operands go to `tl.dot` as float32 (`dot_dtype`): the same values,
  so only the summation order differs from the GPU.
- Whether a function is compiled or interpreted is fixed when it is decorated (TRITON_INTERPRET is read at import):
  the interpreter tests load private copies of these modules with the variable set. More: docs/kernels.md.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# float8 kinds, as a constexpr: 0 = not float8, 1 = e4m3fn (torch.float8_e4m3fn), 2 = e5m2.
FP8_NONE, FP8_E4M3, FP8_E5M2 = 0, 1, 2
_FP8_KINDS = {torch.float8_e4m3fn: FP8_E4M3, torch.float8_e5m2: FP8_E5M2}
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def round_as(x, DTYPE: tl.constexpr):
    """float32 `x` rounded to DTYPE's precision (round to nearest even, like a hardware cast), still float32."""
    if DTYPE == tl.bfloat16:  # noqa: SIM300 (a constexpr on the left: its __eq__ unwraps; tl.dtype's would not)
        bits = x.to(tl.uint32, bitcast=True)
        # Round the low 16 bits away, ties to even; a carry moves into the exponent as it should (max -> inf).
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded)  # NaN stays NaN (its payload could carry into the sign bit)
    elif DTYPE == tl.float16:  # noqa: SIM300
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def to_dtype(x, DTYPE: tl.constexpr):
    """float32 `x` cast to DTYPE with round-to-nearest-even on the GPU and under the interpreter alike."""
    return round_as(x, DTYPE).to(DTYPE)


@triton.jit
def fp8_to_f32(bits, FP8_KIND: tl.constexpr):
    """float8 codes (uint8 bits) -> float32 values, exactly, with integer ops (any GPU arch, and the interpreter).
    e4m3fn's two NaN codes come out as +-480; nothing here writes them (the writers clamp to +-448).

    e5m2 is float16 with the low byte cut off. e4m3fn's exponent|mantissa shifted left 7 lands on float16's low
    exponent bits: the same number with bias 15 instead of 7, i.e. divided by 2**8, subnormals included."""
    b = bits.to(tl.uint16)
    if FP8_KIND == 2:
        return (b << 8).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def f32_to_fp8(x, FP8_KIND: tl.constexpr):
    """float32 (already clamped to the format's finite range) -> float8 codes (uint8), round to nearest even.

    Integer ops only, so it is bit-identical to torch's cast on every GPU arch and in the interpreter."""
    MAN = 4 - FP8_KIND  # mantissa bits: e4m3 3, e5m2 2
    BIAS = 8 * FP8_KIND - 1  # exponent bias: e4m3 7, e5m2 15
    SHIFT = 23 - MAN
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    e = (a >> 23) - 127
    # Normal range: round the float32 mantissa to MAN bits (a carry bumps the exponent), then rebias.
    normal = ((a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MAN)
    # Subnormal range: the value in units of the smallest subnormal, 2**(1 - BIAS - MAN), rounded half to even.
    # Shifts of 25 or more leave 0 for any 24-bit mantissa, so the clamp keeps the shift defined.
    m = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum(tl.maximum((24 - BIAS - MAN) - e, 1), 25)
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(e >= 1 - BIAS, normal, q)
    code = tl.where(x != x, 0x7F, code)  # NaN -> NaN code (never written by callers that clamp)
    return (code | sign).to(tl.uint8)


# ---------------------------------------------------------------------------------------------- host side
# Decided at decoration time, like every kernel of the backend (see the module docstring).
INTERPRETED = not isinstance(round_as, triton.runtime.JITFunction)


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"the triton kernels take float32, bfloat16 or float16 activations, not {dtype}") from None


def fp8_kind(dtype: torch.dtype) -> int:
    return _FP8_KINDS.get(dtype, FP8_NONE)


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The operand dtype for tl.dot on `dtype` data: the dtype itself, except bfloat16 under the interpreter."""
    if dtype == torch.bfloat16 and INTERPRETED:
        return tl.float32
    return tl_dtype(dtype)


def dot_precision(dot: tl.dtype) -> str:
    """float32 operands use true float32 products ("ieee"), not TF32: the torch reference does (TF32 would cost
    ~1e-3 relative error); the flag is ignored for 16-bit operands."""
    return "ieee" if dot == tl.float32 else "tf32"


def next_pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(int(n)))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, cached (host-only: safe during CUDA graph capture)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (cached: host-only, so it is safe during CUDA graph capture);
    0 on CPU (the interpreter), where occupancy heuristics do not apply."""
    if device.type != "cuda":
        return 0
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def native_fp8(device: torch.device) -> bool:
    """Whether kernels for `device` may use the hardware's float8 conversions (Triton's float8e4nv/e5m2 casts,
    sm_89 and later); else they decode the bits with integer ops (`fp8_to_f32`). Never under the interpreter (no
    float8 arithmetic there). A CPU device outside the interpreter is the compile check's stand-in: the target
    Triton compiles for decides."""
    if INTERPRETED:
        return False
    if device.type == "cuda":
        return capability(device) >= (8, 9)
    target = triton.runtime.driver.active.get_current_target()
    return isinstance(target.arch, int) and target.arch >= 89
