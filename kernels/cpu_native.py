"""keepwarm's own CPU kernels in C (`cpu_native.c`), built once per machine with the system C compiler.

What:
- weight-only int8 and fp8 matmuls for bfloat16 activations on AVX512-BF16 CPUs (`int8_linear`, `fp8_linear`).
  torch's ``_weight_int8pack_mm`` re-reads and converts the weight for every row of x, its cast path re-lays the
  whole weight out per call, and torch has no fused CPU op for fp8 weights at all (they were dequantized per
  call). The C kernel converts in registers, one row of x at a time for decode and, for more rows, once per tile
  into a scratch it multiplies every row of x with (figures in kernels/quant.py and docs/quantization.md).
- bfloat16 decode attention over the paged KV cache (`decode_attention`, AVX2 + FMA), called from
  kernels/reference.py's ``paged_attention`` for the decode rows: it reads each sequence's K/V rows where they lie
  in the cache, where the torch path copies every sequence's whole context out of the pool twice per layer
  (``index_select``) before two small ``bmm``. It rounds where the torch path rounds (score to bf16, then scale,
  softcap, float32 softmax, probabilities to bf16, float32 sums to a bf16 output); only the order of float32 sums
  and exp's last ulp differ (docs/benchmarks.md, issue 15's third pass, has the measured difference).

Rules:
- Built lazily, at the first call that could use it, with ``cc -O3`` and explicit ``-m`` flags (never
  ``-march=native``: the cache key names the flags, the source and the compiler, not the CPU), into
  ``$KEEPWARM_HOME/cache/native/`` by an atomic rename, so concurrent workers never load a half-written file and a
  warm restart pays nothing. One build per machine: ``avx512`` (everything) where the CPU has AVX512-BF16, else
  ``avx2`` (``-DKW_ATTENTION_ONLY``: the attention alone), else none.
- The matmuls run for contiguous bfloat16 x and int8 / fp8 weights with one scale per tensor or per output
  channel (`available`); the attention for bfloat16 q and bfloat16 caches with no KV scale (not fp8), head dim a
  multiple of 16, contiguous caches (`attention_fits`). Anything else, a missing compiler or a failed build, takes
  the torch path; the reason is logged once (``keepwarm.kernels``), and a matmul's path choice is logged like
  every other (``kernels.quant``). float32 models never reach the C code, so their outputs are torch's exactly.
- ``KEEPWARM_CPU_NATIVE=0`` turns both off (A/B benchmarks, escape hatch); read on every call of
  :func:`available` / :func:`attention_available`, and for the attention in the engine when a step's attention
  plan is built (:func:`attention_switched_on`), not in each layer.
- Weights and caches are only read: a weight may be a read-only view into the daemon's shared memory. The C code
  checks every block id and length of an attention plan against the cache before it reads (a bad plan raises).
- Threads: the callers pass torch's intra-op count; one pool of T-1 threads serves both kernels, a call at a time.
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
from dataclasses import dataclass
from pathlib import Path

import torch

from keepwarm.formats.paths import keepwarm_home

__all__ = ["ENV_VAR", "attention_available", "attention_fits", "attention_plan", "attention_switched_on",
           "attention_unavailable_reason", "available", "decode_attention", "fp8_linear", "int8_linear",
           "unavailable_reason"]

logger = logging.getLogger("keepwarm.kernels")

ENV_VAR = "KEEPWARM_CPU_NATIVE"
_SOURCE = Path(__file__).with_name("cpu_native.c")
_COMMON = ("-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread")
_LIBS = ("-lm",)  # after the source: a linker with --as-needed drops libraries named before their first use


@dataclass(frozen=True)
class _Variant:
    """One build of cpu_native.c: its -m flags, the /proc/cpuinfo flags they need, and whether it has the matmuls
    (the AVX2 build is the decode attention alone: ``-DKW_ATTENTION_ONLY``)."""

    name: str
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    matmuls: bool


# The first whose CPU flags are all present is built.
_VARIANTS = (
    _Variant("avx512", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"),
             ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma"), True),
    _Variant("avx2", ("-mavx2", "-mfma", "-DKW_ATTENTION_ONLY"), ("avx2", "fma"), False),
)


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


def _build(cc: str, variant: _Variant) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    flags = (*_COMMON, *variant.flags)
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags + _LIBS).encode() + version.encode()).hexdigest()[:16]
    target = keepwarm_home() / "cache" / "native" / f"cpu_native-{variant.name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, str(_SOURCE), "-o", tmp, *_LIBS], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"{cc} exited {done.returncode}: {last}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str, str]:
    """(library, why the matmuls cannot run, why the attention cannot) with "" for "they can". Cached: the probe
    and the build happen once."""
    have = _cpu_flags()
    variant = next((v for v in _VARIANTS if all(f in have for f in v.cpu_flags)), None)
    lacks = ", ".join(f for f in _VARIANTS[0].cpu_flags if f not in have)
    no_matmuls = f"the CPU lacks {lacks}" if lacks else ""
    if variant is None:
        return None, no_matmuls, f"the CPU lacks {', '.join(f for f in _VARIANTS[-1].cpu_flags if f not in have)}"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc) on PATH", "no C compiler (cc) on PATH"
    try:
        lib = ctypes.CDLL(str(_build(cc, variant)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"build failed: {exc}", f"build failed: {exc}"
    if variant.matmuls:
        fn = lib.kw_gemm
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int]
    fn = lib.kw_decode_attention
    fn.restype = ctypes.c_int
    # q, q_stride, kc, vc, out, plan, S, Hq, Hk, D, num_blocks, block_size, scale, softcap, nthreads
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 4, *[ctypes.c_int64] * 6, ctypes.c_float,
                   ctypes.c_float, ctypes.c_int]
    return lib, no_matmuls, ""


@functools.cache
def _log_unavailable(reason: str, what: str) -> None:
    logger.warning("native CPU kernels unavailable (%s): %s take torch's slower paths", reason, what)


def _reason(which: int) -> str:
    """``_load()``'s reason at ``which`` (1: the matmuls, 2: the attention), or the off switch's."""
    if not attention_switched_on():
        return f"{ENV_VAR}=0"
    _, no_matmuls, no_attention = _load()
    return no_matmuls if which == 1 else no_attention


def _usable(which: int, what: str) -> bool:
    reason = _reason(which)
    if reason and not reason.startswith(ENV_VAR):
        _log_unavailable(reason, what)
    return not reason


def unavailable_reason() -> str:
    """Why the native matmuls cannot run here ("" when they can)."""
    return _reason(1)


def available() -> bool:
    """Whether the int8 / fp8 matmuls can run (AVX512-BF16)."""
    return _usable(1, "int8 and fp8 matmuls")


def attention_unavailable_reason() -> str:
    """Why the native decode attention cannot run here ("" when it can: AVX2 and FMA suffice)."""
    return _reason(2)


def attention_available() -> bool:
    return _usable(2, "bfloat16 decode attention")


def _gemm(x2d: torch.Tensor, qweight: torch.Tensor, scale32: torch.Tensor, fp8: bool, what: str) -> torch.Tensor:
    lib, no_matmuls, _ = _load()
    assert lib is not None and not no_matmuls, f"{what} called where available() is False"
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


# -- decode attention over the paged KV cache -------------------------------------------------------------------
def attention_plan(table: torch.Tensor, ctx: torch.Tensor, lo: torch.Tensor | None,
                   base: torch.Tensor | None) -> torch.Tensor:
    """One step's decode rows for :func:`decode_attention`, as the one int64 tensor the C kernel reads:
    table [S, W] block ids, where column c holds the block of positions base[s] + c * block_size onward; ctx [S]
    context lengths; lo [S] first visible positions (None: 0); base [S] (None: 0; a multiple of block_size)."""
    S, W = table.shape
    zeros = torch.zeros(S, dtype=torch.int64)
    head = torch.tensor([S, W, 0], dtype=torch.int64)
    parts = (head, ctx, zeros if lo is None else lo, zeros if base is None else base, table.reshape(-1))
    return torch.cat([p.to(torch.int64) for p in parts])


def attention_switched_on() -> bool:
    """``KEEPWARM_CPU_NATIVE`` is not 0: read when a step's attention plan is built (reference.plan_attention),
    so the 30 layers of a step do not each read the environment."""
    return os.environ.get(ENV_VAR, "1") != "0"


def attention_fits(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: float,
                   v_scale: float) -> bool:
    """Whether :func:`decode_attention` computes this call: bfloat16 q and caches (unscaled: no fp8 KV), head dim
    a multiple of 16, caches contiguous, each row of q's heads contiguous, and the library built. Cheap checks
    first: float32 models never get to the build. (The switch is the plan's: :func:`attention_switched_on`.)"""
    bf16 = torch.bfloat16
    if q.dtype != bf16 or key_cache.dtype != bf16 or value_cache.dtype != bf16 or k_scale != 1.0 or v_scale != 1.0:
        return False
    _, head_stride, col_stride = q.stride()
    d = q.shape[2]
    if not (col_stride == 1 and head_stride == d and d % 16 == 0 and key_cache.shape == value_cache.shape
            and d == key_cache.shape[3] and key_cache.is_contiguous() and value_cache.is_contiguous()
            and q.device.type == "cpu"):
        return False
    reason = _load()[2]
    if reason:
        _log_unavailable(reason, "bfloat16 decode attention")
    return not reason


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: torch.Tensor,
                     scale: float, softcap: float | None) -> torch.Tensor:
    """One query row per sequence, q [S, Hq, D] bf16, against its keys and values read in place from the paged
    caches [Hk, num_blocks, block_size, D] -> [S, Hq, D] bf16; ``plan`` from :func:`attention_plan`. The caller
    checked :func:`attention_fits`. Rounds where kernels/reference.py's ``_decode_attention`` rounds."""
    lib = _load()[0]
    assert lib is not None, "decode_attention called where attention_available() is False"
    S, Hq, D = q.shape
    Hk, num_blocks, block_size, _ = key_cache.shape
    out = torch.empty((S, Hq, D), dtype=torch.bfloat16)
    rc = lib.kw_decode_attention(q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
                                 out.data_ptr(), plan.data_ptr(), S, Hq, Hk, D, num_blocks, block_size, scale,
                                 softcap or 0.0, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"decode_attention: the kernel refused q {tuple(q.shape)}, cache {tuple(key_cache.shape)} "
                         f"and its plan (rc {rc}: a block id or length out of range, or no memory)")
    return out
