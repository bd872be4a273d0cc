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
- a bfloat16 x bfloat16 matmul (`bf16_linear`, AVX2 + FMA) for CPUs where oneDNN has no bf16 matmul (no
  AVX512-BW, no AVX-NE-CONVERT: Zen 2/3, older Xeons), where torch's bf16 ``F.linear`` is a generic loop; called
  from kernels/reference.py's ``linear`` (`bf16_matmul_on`). float32 products and sums in one order per output
  element (not torch's order: bf16 outputs there differ from torch's in the last bit, where a float32 sum lands
  next to a rounding boundary), the same for every batch and thread count.

- int8, fp8 and int4 weight-only matmuls for bfloat16 x on CPUs without AVX512-BF16 (`q8_linear` for int8 and
  float8_e4m3fn codes, `q4_linear`; AVX2 + FMA), where torch's pack ops are compute-bound at one row and slower than
  the bf16 matmul (and fp8 had no fused op at all): int8 / fp8 convert codes in
  registers at one row and to bf16 for `kw_bgemm`'s blocks above (the same sums); int4 reads torch's CPU "halves"
  pack in place and folds each group's scale and zero into float32 sums. One summation order per output whatever
  the batch, like the bf16 one.
- on Intel CPUs with AMX (amx_tile, amx_bf16, avx512vbmi), the int8 / fp8 matmul above one row and an int4 one
  (`q4_amx_linear`) run on the tiles (``tdpbf16ps``): codes converted to bf16 once per call into an L1 scratch
  (exact), float32 sums in a fixed order per output whatever the batch; the vector loops above spent 2-4x bf16's
  time there, where oneDNN's bf16 matmul itself runs on the tiles (figures in kernels/quant.py). On where the CPU
  has them, Linux grants the tile state and ``KEEPWARM_CPU_AMX`` is not 0 (`amx_reason`, logged once);
  `amx_takes` says which calls take them.
- on AVX512-BF16 CPUs with AVX-512 VBMI but no AMX (Zen 4), the int4 matmul above a few rows (`q4_vec_linear`):
  the tile kernel's code scratch and group fold on the vector units (``vdpbf16ps``), where torch's int4 op spent
  1.2-2.6x bf16's time from 8 rows up.

Rules:
- Built lazily, at the first call that could use it, with ``cc -O3`` and explicit ``-m`` flags (never
  ``-march=native``: the cache key names the flags, the source and the compiler, not the CPU), into
  ``$KEEPWARM_HOME/cache/native/`` by an atomic rename, so concurrent workers never load a half-written file and a
  warm restart pays nothing. One build per machine: ``avx512`` (everything) where the CPU has AVX512-BF16, else
  ``avx2`` (``-DKW_ATTENTION_ONLY``: everything but the int8 / fp8 matmuls), else none.
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
- Threads: the callers pass torch's intra-op count. The work runs on torch's OpenMP team where the process has
  one OpenMP runtime (the library links libgomp.so.1, which resolves to torch's): right after a torch op that team
  is still spinning, where a pool of our own had to fight it for the 2 cores (decode steps 6-10% faster at 8 and 32
  streams, interleaved A/B). Else (``KEEPWARM_CPU_NATIVE_OPENMP=0``, two runtimes, no OpenMP in torch: logged) one
  pool of T-1 threads serves every kernel, a call at a time; a forked child always uses the pool.
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
from keepwarm.formats.quant import QuantizationError

__all__ = ["AMX_ENV_VAR", "ENV_VAR", "amx_calls", "amx_reason", "amx_takes", "attention_available", "attention_fits",
           "attention_plan", "attention_switched_on", "attention_unavailable_reason", "available", "avx2_quant_on",
           "bf16_fits", "bf16_linear", "bf16_matmul_on", "codes_to_bf16", "decode_attention", "fp8_linear", "glue_on",
           "int8_linear", "q4_amx_fits", "q4_amx_linear", "q4_fits", "q4_linear", "q4_vec_fits", "q4_vec_linear",
           "q8_fits", "q8_linear", "rms_norm", "rotary_neox", "rows_fit", "set_amx", "store_kv", "unavailable_reason"]

logger = logging.getLogger("keepwarm.kernels")

ENV_VAR = "KEEPWARM_CPU_NATIVE"
_SOURCE = Path(__file__).with_name("cpu_native.c")
# -ffp-contract=off: a product and a sum written apart stay apart (rounded where torch rounds); fma only as written
# -fopenmp: the library links libgomp.so.1, which the loader resolves to the one torch already loaded (see _openmp)
_COMMON = ("-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-fopenmp")
OPENMP_ENV_VAR = "KEEPWARM_CPU_NATIVE_OPENMP"
_LIBS = ("-lm",)  # after the source: a linker with --as-needed drops libraries named before their first use


@dataclass(frozen=True)
class _Variant:
    """One build of cpu_native.c: its -m flags, the /proc/cpuinfo flags they need, and whether it has the matmuls
    (the AVX2 build has everything else: ``-DKW_ATTENTION_ONLY``)."""

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
        lib.kw_amx_enable.restype, lib.kw_amx_enable.argtypes = ctypes.c_int, [ctypes.c_int]
        lib.kw_amx_calls.restype, lib.kw_amx_calls.argtypes = ctypes.c_long, []
        lib.kw_q4amx.restype = ctypes.c_int
        lib.kw_codes_bf16.restype = ctypes.c_int
        lib.kw_codes_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2
        lib.kw_q4amx.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int]
        lib.kw_q4vec.restype = ctypes.c_int
        lib.kw_q4vec.argtypes = lib.kw_q4amx.argtypes
        _amx_start(lib, have)
    fn = lib.kw_decode_attention
    fn.restype = ctypes.c_int
    # q, q_stride, kc, vc, out, plan, S, Hq, Hk, D, num_blocks, block_size, scale, softcap, nthreads
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 4, *[ctypes.c_int64] * 6, ctypes.c_float,
                   ctypes.c_float, ctypes.c_int]
    _declare_glue(lib)
    _openmp(lib)
    return lib, no_matmuls, ""


AMX_ENV_VAR = "KEEPWARM_CPU_AMX"
_amx_why = ["not built"]  # why the int8 / fp8 matmuls do not use AMX tiles ("" when they do)


def _amx_try(lib: ctypes.CDLL, have: set[str]) -> str:
    """Turn the tiles on in the library if the CPU has them and Linux grants the tile state; why not ("" when on)."""
    if not {"amx_tile", "amx_bf16", "avx512vbmi"} <= have:
        return "the CPU lacks amx_tile / amx_bf16 / avx512vbmi"
    return "" if lib.kw_amx_enable(1) == 0 else "Linux refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"


def _amx_start(lib: ctypes.CDLL, have: set[str]) -> None:
    """Turn the AMX tile path of the int8 / fp8 matmuls on where the CPU has it, Linux grants the tile state and
    ``KEEPWARM_CPU_AMX`` is not 0; say which in the log."""
    why = f"{AMX_ENV_VAR}=0" if os.environ.get(AMX_ENV_VAR, "1") == "0" else _amx_try(lib, have)
    _amx_why[0] = why
    if why:
        logger.info("native int8 / fp8 matmuls: vector path above one row, no AMX tiles (%s)", why)
    else:
        logger.info("native int8 / fp8 matmuls: AMX tiles (tdpbf16ps) above one row")


def amx_reason() -> str:
    """Why the int8 / fp8 matmuls do not use AMX tiles here ("" when they do)."""
    _load()
    return _amx_why[0]


def amx_takes(rows: int, k: int) -> bool:
    """Whether an int8 / fp8 matmul of ``rows`` rows of x over K = ``k`` runs on the AMX tiles (the C side's rule:
    tiles on, two rows or more, K a multiple of 32); at one row both paths are the same streaming loop."""
    return rows >= 2 and k % 32 == 0 and available() and not amx_reason()


def amx_calls() -> int:
    """How many int8 / fp8 matmuls of this process took the AMX tiles (tests check the path really ran)."""
    lib, no_matmuls, _ = _load()
    return 0 if lib is None or no_matmuls else int(lib.kw_amx_calls())


def set_amx(on: bool) -> bool:
    """Turn the tile path on or off in this process (A/B benchmarks, tests); returns whether it is on."""
    lib, no_matmuls, _ = _load()
    if lib is None or no_matmuls:
        return False
    if on:
        _amx_why[0] = _amx_try(lib, _cpu_flags())
    else:
        lib.kw_amx_enable(0)
        _amx_why[0] = "switched off in this process"
    return not _amx_why[0]


def _openmp(lib: ctypes.CDLL) -> None:
    """Run the kernels' threads on torch's OpenMP team when the process has exactly one OpenMP runtime (torch's
    libgomp, which this library then shares); else on the library's own pool, said in the log."""
    why = ""
    if os.environ.get(OPENMP_ENV_VAR, "1") == "0":
        why = f"{OPENMP_ENV_VAR}=0"
    elif not torch.backends.openmp.is_available():
        why = "torch is built without OpenMP"
    else:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError as exc:
            maps, why = "", f"/proc/self/maps unreadable ({exc})"
        runtimes = {line.split()[-1] for line in maps.splitlines()
                    if line.rsplit("/", 1)[-1].startswith(("libgomp", "libiomp"))}
        if not why and len(runtimes) != 1:
            why = f"{len(runtimes)} OpenMP runtimes loaded ({', '.join(sorted(runtimes))})"
    lib.kw_use_openmp(0 if why else 1)
    if why:
        logger.info("native CPU kernels: threads from their own pool, not torch's OpenMP team (%s)", why)


def _declare_glue(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kw_use_openmp.restype, lib.kw_use_openmp.argtypes = None, [ctypes.c_int]
    for name, args in (("kw_rms_norm", [p, i64, p, i64, p, p, p, i64, i64, ctypes.c_float]),
                       ("kw_rotary_neox", [p, i64, p, i64, p, p, i64, p, p, i64, i64, i64, i64]),
                       ("kw_store_kv", [p, i64, p, i64, p, p, p, i64, i64, i64, i64, i64]),
                       ("kw_bgemm", [p, p, p, i64, i64, i64, ctypes.c_int]),
                       ("kw_q8gemm", [p, p, p, p, i64, i64, i64, ctypes.c_int, ctypes.c_int]),
                       ("kw_q4gemm", [p, p, p, p, i64, i64, i64, i64, i64, ctypes.c_int]),
                       ("kw_quant_int8", [p, i64, i64, p, p])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, args


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


def codes_to_bf16(qweight: torch.Tensor) -> torch.Tensor:
    """An int8 or float8_e4m3fn weight [N, K] (contiguous) as bf16, exactly: int8 codes as integers, fp8 codes as
    value / 256 (the caller's scale takes the 256). Threads as the matmuls; for the widest calls (kernels/quant.py)."""
    lib, no_matmuls, _ = _load()
    if lib is None or no_matmuls or qweight.dim() != 2 or not qweight.is_contiguous() or qweight.dtype not in (
            torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"codes_to_bf16: a contiguous 2-D int8 / float8_e4m3fn weight on an AVX512-BF16 build, not "
                         f"{tuple(qweight.shape)} {qweight.dtype} ({no_matmuls or 'built'})")
    n, k = qweight.shape
    out = torch.empty((n, k), dtype=torch.bfloat16)
    rc = lib.kw_codes_bf16(qweight.data_ptr(), out.data_ptr(), n, k, int(qweight.dtype == torch.float8_e4m3fn),
                           torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"codes_to_bf16: the kernel refused N={n} K={k}")
    return out


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
                   base: torch.Tensor | None, float32_scores: bool = False) -> torch.Tensor:
    """One step's rows for :func:`decode_attention`, as the one int64 tensor the C kernel reads: table [S, W]
    block ids, where column c holds the block of positions base[s] + c * block_size onward; ctx [S] context
    lengths; lo [S] first visible positions (None: 0); base [S] (None: 0; a multiple of block_size).
    ``float32_scores``: scores and probabilities stay float32 (SDPA's roundings, for prefill rows), else they are
    rounded to bf16 as the torch decode path rounds them."""
    S, W = table.shape
    zeros = torch.zeros(S, dtype=torch.int64)
    head = torch.tensor([S, W, int(float32_scores)], dtype=torch.int64)
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


# -- a decode step's glue: RMSNorm (+ residual), neox rotary, KV store ---------------------------------------------
def glue_on() -> bool:
    """Whether :func:`rms_norm`, :func:`rotary_neox` and :func:`store_kv` can run: the switch is on and a build
    (either: the glue is AVX2 + FMA code) loaded. Its reason, when not, is the attention's (logged once)."""
    return attention_switched_on() and _load()[0] is not None and not _load()[2]


def rows_fit(x: torch.Tensor, multiple: int) -> bool:
    """x is a CPU bfloat16 [rows, n] whose rows are contiguous, n a multiple of ``multiple``: what the glue reads."""
    return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % multiple == 0
            and x.device.type == "cpu")


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual) * weight, x + residual) (residual None: (rms_norm(x) * weight, None)); x and
    residual satisfy :func:`rows_fit` (8), weight is a contiguous bfloat16 [n]. New tensors; inputs untouched."""
    lib = _load()[0]
    assert lib is not None
    T, H = x.shape
    out = torch.empty((T, H), dtype=torch.bfloat16)
    new = None if residual is None else torch.empty((T, H), dtype=torch.bfloat16)
    rc = lib.kw_rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                         0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(),
                         None if new is None else new.data_ptr(), T, H, eps)
    if rc != 0:
        raise ValueError(f"rms_norm: the kernel refused x {tuple(x.shape)}")
    return out, new


def rotary_neox(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary over whole heads: q [T, Hq * D], k [T, Hk * D] (:func:`rows_fit` (16)), cos and sin [T, D / 2]
    float32 with unit column stride and one row stride -> new contiguous q, k."""
    lib = _load()[0]
    assert lib is not None
    T = q.shape[0]
    qo, ko = torch.empty(q.shape, dtype=torch.bfloat16), torch.empty(k.shape, dtype=torch.bfloat16)
    rc = lib.kw_rotary_neox(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos.data_ptr(), sin.data_ptr(),
                            cos.stride(0), qo.data_ptr(), ko.data_ptr(), T, q.shape[1] // head_dim,
                            k.shape[1] // head_dim, head_dim)
    if rc != 0:
        raise ValueError(f"rotary_neox: the kernel refused q {tuple(q.shape)}, head_dim {head_dim}")
    return qo, ko


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``keepwarm.formats.quant``'s per-row int8 (codes, bfloat16 scales) of a contiguous CPU bfloat16 weight [N, K]
    in C, bit for bit, at several GB/s where torch's row blocks run at ~0.6; None where the library cannot run
    here (said once in the log) or is switched off: the caller then takes torch's path."""
    if not (w.dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous() and w.device.type == "cpu"):
        return None
    if not _usable(2, "int8 quantization at preload"):
        return None
    lib = _load()[0]
    assert lib is not None
    n, k = w.shape
    q = torch.empty((n, k), dtype=torch.int8)
    scales = torch.empty(n, dtype=torch.bfloat16)
    if lib.kw_quant_int8(w.data_ptr(), n, k, q.data_ptr(), scales.data_ptr()) != 0:
        raise QuantizationError(f"weight of shape {(n, k)} has non-finite values")
    return q, scales


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """key, value [T, Hk, D] bfloat16 (heads contiguous in a row) into the contiguous bfloat16 pools
    [Hk, num_blocks, block_size, D] at ``slots`` [T] int64 (-1: skipped). A slot out of range raises, and nothing
    is written."""
    lib = _load()[0]
    assert lib is not None
    hk, nb, bs, d = key_cache.shape
    rc = lib.kw_store_kv(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), key_cache.data_ptr(),
                         value_cache.data_ptr(), slots.data_ptr(), key.shape[0], hk, d, nb, bs)
    if rc != 0:
        raise ValueError(f"store_kv: a slot of {slots.tolist()} is outside the pools ({nb} blocks of {bs})")


# -- bf16 x bf16 matmul where oneDNN has none (AVX2 CPUs) ----------------------------------------------------------
@functools.cache
def _onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls here (AVX512-BW or AVX-NE-CONVERT): torch's bf16 linear is fast then."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def bf16_matmul_on() -> bool:
    """Whether :func:`bf16_linear` replaces torch's bfloat16 ``F.linear`` here: the switch is on, a build loaded,
    and oneDNN has no bf16 matmul on this CPU (torch then runs a generic loop; logged once when taken)."""
    if not glue_on() or _onednn_bf16():
        return False
    _log_bf16_once()
    return True


@functools.cache
def _log_bf16_once() -> None:
    logger.info("bfloat16 linear: keepwarm's AVX2 kernel (oneDNN has no bf16 matmul on this CPU; one float32 "
                "summation order per output, independent of the batch)")


def bf16_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [..., K] and weight [N, K] are CPU bfloat16, weight contiguous, K a multiple of 16."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous() and x.dim() >= 1
            and x.shape[-1] == weight.shape[1] and weight.shape[1] % 16 == 0 and x.numel() > 0)


def _split_x(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., k] as float32 [rows, k] (exact), converted once, not per weight row; each 16 values as their 8 even
    then 8 odd (the C splits 16 weights that way: one load, a shift and a mask)."""
    return x.reshape(-1, k // 16, 8, 2).transpose(-1, -2).float().contiguous().view(-1, k)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` in bfloat16 (:func:`bf16_fits` inputs): float32 products and sums, one fixed summation
    order per output element whatever the batch, rounded once. Callable wherever a build loaded (tests use it on
    every CPU); :func:`bf16_matmul_on` says where the model's linears take it."""
    lib = _load()[0]
    assert lib is not None, "bf16_linear called where no native build loaded"
    if not bf16_fits(x, weight):
        raise ValueError(f"bf16_linear: x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} "
                         f"{weight.dtype} do not fit (bfloat16, contiguous weight, K a multiple of 16)")
    n, k = weight.shape
    xf = _split_x(x, k)
    out = torch.empty((xf.shape[0], n), dtype=torch.bfloat16)
    rc = lib.kw_bgemm(xf.data_ptr(), weight.data_ptr(), out.data_ptr(), xf.shape[0], n, k, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"bf16_linear: the kernel refused M={xf.shape[0]} N={n} K={k}")
    return out.reshape(*x.shape[:-1], n)


# -- int8 / int4 weight-only matmuls for CPUs without AVX512-BF16 (AVX2 + FMA) ---------------------------------
def avx2_quant_on() -> bool:
    """Whether the int8 / int4 linears of bfloat16 models take :func:`q8_linear` / :func:`q4_linear`: a build
    loaded and the switch on (:func:`glue_on`), and the CPU lacks AVX512-BF16 (there :func:`int8_linear` and
    torch's int4 op were measured instead; these kernels were measured on AVX2 only)."""
    return glue_on() and bool(_load()[1])


def q8_fits(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> bool:
    """x [..., K] bfloat16, qweight int8 or float8_e4m3fn [N, K] contiguous, K a multiple of 16, all on the CPU;
    scales: one per row ([N]), or one for the tensor ([] or [1])."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and qweight.dtype in (torch.int8, torch.float8_e4m3fn)
            and qweight.device.type == "cpu" and qweight.dim() == 2 and qweight.is_contiguous()
            and x.numel() > 0 and x.shape[-1] == qweight.shape[1] and qweight.shape[1] % 16 == 0
            and scales.is_floating_point() and scales.numel() in (1, qweight.shape[0]))


def q8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(x @ qweight^T) * scales`` in bfloat16 (:func:`q8_fits` inputs: int8 or float8_e4m3fn codes), AVX2 + FMA:
    the codes exactly as float32, products and sums in float32 in kw_bgemm's order (one per output element whatever
    the batch), times the float32 scale, rounded once."""
    lib = _load()[0]
    assert lib is not None, "q8_linear called where no native build loaded"
    if not q8_fits(x, qweight, scales):
        raise ValueError(f"q8_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(qweight.shape)} {qweight.dtype}"
                         f" and scales {tuple(scales.shape)} {scales.dtype} do not fit")
    n, k = qweight.shape
    xf = _split_x(x, k)
    scale32 = scales.to(torch.float32).reshape(-1).expand(n).contiguous()
    out = torch.empty((xf.shape[0], n), dtype=torch.bfloat16)
    fp8 = int(qweight.dtype == torch.float8_e4m3fn)
    rc = lib.kw_q8gemm(xf.data_ptr(), qweight.data_ptr(), scale32.data_ptr(), out.data_ptr(), xf.shape[0], n, k, fp8,
                       torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"q8_linear: the kernel refused M={xf.shape[0]} N={n} K={k} (rc {rc})")
    return out.reshape(*x.shape[:-1], n)


def q4_fits(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
            block: int) -> bool:
    """x [..., K] bfloat16; qweight uint8 in torch's CPU int4 "halves" pack of `block` rows (N a multiple of it);
    scales_and_zeros bfloat16 [K / group_size, N, 2]; group_size a multiple of 8."""
    n2 = scales_and_zeros.shape[1] if scales_and_zeros.dim() == 3 else -1
    k = x.shape[-1] if x.dim() else -1
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() > 0 and qweight.dtype == torch.uint8
            and qweight.device.type == "cpu" and qweight.is_contiguous() and block in (16, 32, 48, 64)
            and group_size >= 8 and group_size % 8 == 0 and k % group_size == 0 and n2 > 0 and n2 % block == 0
            and qweight.numel() == n2 * k // 2 and scales_and_zeros.dtype == torch.bfloat16
            and tuple(scales_and_zeros.shape) == (k // group_size, n2, 2) and scales_and_zeros.is_contiguous())


def q4_linear(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
              block: int) -> torch.Tensor:
    """``x @ W^T`` in bfloat16 for an int4 weight in torch's CPU "halves" pack (:func:`q4_fits`), W = (code - 8) *
    scale + zero per group, AVX2 + FMA: per group ``scale * sum x (code - 8) + zero * sum x``, float32, one
    order per output element whatever the batch, rounded once."""
    lib = _load()[0]
    assert lib is not None, "q4_linear called where no native build loaded"
    if not q4_fits(x, qweight, scales_and_zeros, group_size, block):
        raise ValueError(f"q4_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(qweight.shape)} {qweight.dtype}, "
                         f"scales_and_zeros {tuple(scales_and_zeros.shape)} {scales_and_zeros.dtype}, groups of "
                         f"{group_size} and blocks of {block} do not fit")
    n, k = scales_and_zeros.shape[1], x.shape[-1]
    xf = x.reshape(-1, k).float().contiguous()
    out = torch.empty((xf.shape[0], n), dtype=torch.bfloat16)
    rc = lib.kw_q4gemm(xf.data_ptr(), qweight.data_ptr(), scales_and_zeros.data_ptr(), out.data_ptr(),
                       xf.shape[0], n, k, group_size, block, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"q4_linear: the kernel refused M={xf.shape[0]} N={n} K={k} (rc {rc})")
    return out.reshape(*x.shape[:-1], n)


def q4_amx_fits(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                block: int) -> bool:
    """:func:`q4_vec_fits` (K and the group a multiple of 32, blocks of 32 or 64 rows), with the AMX tiles on."""
    return not amx_reason() and q4_vec_fits(x, qweight, scales_and_zeros, group_size, block)


def q4_amx_linear(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                  block: int) -> torch.Tensor:
    """:func:`q4_linear` on the AMX tiles (:func:`q4_amx_fits`): x's bf16 rows times 16 + each code as bf16 (exact),
    float32 sums per group folded as ``scale * sum x (16 + c) + (zero - 24 scale) * sum x`` (the same weight, (c - 8)
    * scale + zero), one order per output whatever the batch, rounded once."""
    if not q4_amx_fits(x, qweight, scales_and_zeros, group_size, block):
        raise ValueError(f"q4_amx_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(qweight.shape)}, groups of "
                         f"{group_size} and blocks of {block} do not fit, or no AMX ({amx_reason() or 'on'})")
    return _q4_paired("kw_q4amx", x, qweight, scales_and_zeros, group_size, block)


@functools.cache
def _has_vbmi() -> bool:
    return "avx512vbmi" in _cpu_flags()


def q4_vec_fits(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                block: int) -> bool:
    """:func:`q4_fits`, with K and the group a multiple of 32 and blocks of 32 or 64 rows, on a CPU with AVX512-BF16
    and AVX-512 VBMI (the pack's byte permute), tiles or not."""
    return (available() and _has_vbmi() and block in (32, 64) and group_size % 32 == 0 and x.dim() > 0
            and x.shape[-1] % 32 == 0 and q4_fits(x, qweight, scales_and_zeros, group_size, block))


def q4_vec_linear(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                  block: int) -> torch.Tensor:
    """:func:`q4_amx_linear`'s product on the vector units (vdpbf16ps, :func:`q4_vec_fits`): the same (16 + code)
    bf16 pairs and fold, one order per output whatever the batch, rounded once."""
    if not q4_vec_fits(x, qweight, scales_and_zeros, group_size, block):
        raise ValueError(f"q4_vec_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(qweight.shape)}, groups of "
                         f"{group_size} and blocks of {block} do not fit, or this CPU lacks AVX512-BF16 / VBMI")
    return _q4_paired("kw_q4vec", x, qweight, scales_and_zeros, group_size, block)


def _q4_paired(fn: str, x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
               block: int) -> torch.Tensor:
    lib = _load()[0]
    assert lib is not None, f"{fn} called where no native build loaded"
    n, k = scales_and_zeros.shape[1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    out = torch.empty((x2.shape[0], n), dtype=torch.bfloat16)
    rc = getattr(lib, fn)(x2.data_ptr(), qweight.data_ptr(), scales_and_zeros.data_ptr(), out.data_ptr(),
                          x2.shape[0], n, k, group_size, block, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"{fn}: the kernel refused M={x2.shape[0]} N={n} K={k} (rc {rc})")
    return out.reshape(*x.shape[:-1], n)
