"""keepwarm's own CPU kernels in C (`cpu_native.c`), built once per machine with the system C compiler.

What: weight-only int8 and fp8 matmuls for bfloat16 activations on AVX512-BF16 CPUs (`int8_linear`,
`fp8_linear`). torch's ``_weight_int8pack_mm`` re-reads and converts the weight for every row of x, its cast
path re-lays the whole weight out per call, and torch has no fused CPU op for fp8 weights at all (they were
dequantized per call). The C kernel converts in registers, one row of x at a time for decode and, for more rows,
once per tile into a scratch it multiplies every row of x with (figures in kernels/quant.py and
docs/quantization.md).

Rules:
- Built lazily, at the first call that could use it, with ``cc -O3`` and explicit ``-mavx512*`` flags (never
  ``-march=native``: the cache key names the flags, the source and the compiler, not the CPU), into
  ``$KEEPWARM_HOME/cache/native/`` by an atomic rename, so concurrent workers never load a half-written file and a
  warm restart pays nothing.
- Used only where the CPU has every instruction the flags allow (``/proc/cpuinfo``) and for contiguous bfloat16 x
  and int8 / fp8 weights with one scale per tensor or per output channel. Anything else, a missing compiler or a
  failed build, takes the torch path; the reason is logged once (``keepwarm.kernels``), and the path choice is
  logged like every other (``kernels.quant``).
- ``KEEPWARM_CPU_NATIVE=0`` turns it off (A/B benchmarks, escape hatch); read on every call of
  :func:`available`.
- The weight is only read: it may be a read-only view into the daemon's shared memory.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from keepwarm.formats.paths import keepwarm_home

__all__ = ["ENV_VAR", "available", "fp8_linear", "int8_linear", "unavailable_reason"]

logger = logging.getLogger("keepwarm.kernels")

ENV_VAR = "KEEPWARM_CPU_NATIVE"
_SOURCE = Path(__file__).with_name("cpu_native.c")
_FLAGS = ("-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread", "-mavx512f", "-mavx512bw", "-mavx512vl",
          "-mavx512bf16", "-mfma")
# /proc/cpuinfo flag names for the -m flags above.
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + version.encode()).hexdigest()[:16]
    target = keepwarm_home() / "cache" / "native" / f"cpu_native-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"{cc} exited {done.returncode}: {last}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") when usable, else (None, why not). Cached: the probe and the build happen once."""
    missing = [f for f in _CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return None, f"the CPU lacks {', '.join(missing)}"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc) on PATH"
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"build failed: {exc}"
    fn = lib.kw_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int]
    return lib, ""


@functools.cache
def _log_unavailable(reason: str) -> None:
    logger.warning("native CPU kernels unavailable (%s): int8 and fp8 matmuls take torch's slower paths", reason)


def unavailable_reason() -> str:
    """Why the native kernels cannot run here ("" when they can)."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return f"{ENV_VAR}=0"
    return _load()[1]


def available() -> bool:
    reason = unavailable_reason()
    if reason and not reason.startswith(ENV_VAR):
        _log_unavailable(reason)
    return not reason


def _gemm(x2d: torch.Tensor, qweight: torch.Tensor, scale32: torch.Tensor, fp8: bool, what: str) -> torch.Tensor:
    lib = _load()[0]
    assert lib is not None, f"{what} called where available() is False"
    m, k = x2d.shape
    n = qweight.shape[0]
    if qweight.dim() != 2 or qweight.shape[1] != k or x2d.dtype != torch.bfloat16 or scale32.shape != (n,):
        raise ValueError(f"{what}: x {tuple(x2d.shape)} {x2d.dtype}, weight {tuple(qweight.shape)} and scale "
                         f"{tuple(scale32.shape)} do not fit (x must be bfloat16)")
    if not (x2d.is_contiguous() and qweight.is_contiguous()):
        raise ValueError(f"{what}: x and weight must be contiguous")
    out = torch.empty((m, n), dtype=torch.bfloat16)
    rc = lib.kw_gemm(x2d.data_ptr(), qweight.data_ptr(), scale32.data_ptr(), out.data_ptr(), m, n, k, int(fp8),
                     torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"{what}: the kernel refused M={m} N={n} K={k}")
    return out


def int8_linear(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(x2d @ qweight^T) * scales`` in bfloat16: x2d bf16 [M, K] and qweight int8 [N, K], both contiguous."""
    if qweight.dtype != torch.int8:
        raise ValueError(f"int8_linear: the weight is {qweight.dtype}, not int8")
    return _gemm(x2d, qweight, scales.to(torch.float32).contiguous(), False, "int8_linear")


def fp8_linear(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(x2d @ qweight^T) * scales`` in bfloat16 for float8_e4m3fn codes [N, K]; scales: one, or one per row."""
    if qweight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear: the weight is {qweight.dtype}, not float8_e4m3fn")
    n = qweight.shape[0]
    # The kernel reads each code as its value / 256 (exact): the 256 goes into the scale (a power of two: exact).
    scale32 = (scales.to(torch.float32).reshape(-1) * 256.0).expand(n).contiguous()
    return _gemm(x2d, qweight.view(torch.int8), scale32, True, "fp8_linear")
