"""keepwarm's C kernels (kernels/csrc/) as one library, built on first use with the system C compiler, and its switches.

Rules:
- Built lazily, at the first call that could use it: each source file (`SOURCES`) compiled with the common flags and
  only its own ``-m`` flags (never ``-march=native``: the cache key names the flags, the sources and the compiler,
  not the CPU), the objects linked into ``$KEEPWARM_HOME/cache/native/`` by an atomic rename, so concurrent workers
  never load a half-written file and a warm restart pays nothing. One build per machine (`_VARIANTS`): ``avx512``
  (every file) where the CPU has AVX512-BF16, else ``avx2`` (the AVX2 + FMA files), else none. AMX and VBMI code is
  in the avx512 build and runs only where the CPU has it (`set_amx`, kernels/dispatch.py).
- A missing compiler or a failed build leaves the torch paths; `reasons` says why (kernels/dispatch.py logs it).
  ``KEEPWARM_CPU_NATIVE=0`` turns every C kernel off (A/B benchmarks, escape hatch), read on each dispatch.
- Threads run on torch's OpenMP team where the process has one OpenMP runtime (the library links libgomp.so.1, which
  resolves to torch's), else on the library's own pool (``KEEPWARM_CPU_NATIVE_OPENMP=0``, two runtimes, no OpenMP in
  torch: logged); a forked child always uses the pool (kernels/csrc/pool.c). Entry points: kernels/native_ops.py.
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
from typing import Any

import torch

from keepwarm.formats.paths import keepwarm_home

__all__ = ["AMX_ENV_VAR", "COMMON_FLAGS", "CSRC", "ENV_VAR", "OPENMP_ENV_VAR", "SOURCES", "amx_calls", "amx_reason",
           "available", "build", "compile_objects", "compiler", "cpu_flags", "glue_on", "has_vbmi", "level",
           "library", "loaded", "log_unavailable", "reasons", "set_amx", "switched_on", "threads_reason",
           "variant_for", "variant_name", "variants"]

logger = logging.getLogger("keepwarm.kernels")

ENV_VAR = "KEEPWARM_CPU_NATIVE"
AMX_ENV_VAR = "KEEPWARM_CPU_AMX"
OPENMP_ENV_VAR = "KEEPWARM_CPU_NATIVE_OPENMP"
CSRC = Path(__file__).with_name("csrc")
# -ffp-contract=off: a product and a sum written apart stay apart (rounded where torch rounds); fma only as written.
# -fopenmp: the library links libgomp.so.1, which the loader resolves to the one torch already loaded (_openmp).
# No -Werror here: a newer compiler's new warning must not turn the kernels off on a user's machine; `make
# test-sanitizers` builds every file with -Werror (tests/native/sanitize.py).
COMMON_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-pthread", "-ffp-contract=off", "-fopenmp", "-Wall", "-Wextra")
_LINK = ("-shared", "-fPIC", "-pthread", "-fopenmp")
_LIBS = ("-lm",)  # after the objects: a linker with --as-needed drops libraries named before their first use
_AVX2 = ("-mavx2", "-mfma")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma")
_VBMI = (*_AVX512, "-mavx512vbmi")
_AMX = (*_VBMI, "-mamx-tile", "-mamx-bf16")
# source file -> its -m flags; the avx2 build takes the files whose flags are AVX2's or none.
SOURCES: dict[str, tuple[str, ...]] = {
    "pool.c": (), "quantize.c": _AVX2, "glue.c": _AVX2, "attention.c": _AVX2, "step.c": _AVX2,
    "gemm_bf16_avx2.c": _AVX2,
    "gemm_int8_avx2.c": _AVX2, "gemm_int8_group_avx2.c": _AVX2, "gemm_int4_avx2.c": _AVX2,
    "gemm_bf16_avx512.c": _AVX512, "gemm_int8_avx512.c": _AVX512, "gemm_int8_group_avx512.c": _AVX512,
    "gemm_int8_group_amx.c": _AMX, "gemm_int8_amx.c": _AMX,
    "gemm_int4_vbmi.c": _VBMI, "gemm_int4_amx.c": _AMX,
}


@dataclass(frozen=True)
class _Variant:
    """One build: the /proc/cpuinfo flags it needs and its files (the avx2 build has no int8 / fp8 / paired-int4
    matmuls of AVX512-BF16)."""

    name: str
    cpu_flags: tuple[str, ...]
    files: tuple[str, ...]


# The first whose CPU flags are all present is built.
_VARIANTS = (
    _Variant("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma"), tuple(SOURCES)),
    _Variant("avx2", ("avx2", "fma"), tuple(f for f, flags in SOURCES.items() if flags in ((), _AVX2))),
)


# The flags oneDNN's and torch's CPU kernels dispatch on: they decide the blocked layout of packed bfloat16 weights
# (mkldnn_packed) and which int4 pack torch produces (a snapshot records them: its identity, its platforms).
LAYOUT_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                    "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16",
                    "amx_int8", "amx_fp16",
                    # aarch64
                    "asimd", "sve", "sve2", "bf16", "i8mm", "asimddp")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's flags as /proc/cpuinfo lists them (``flags``; ``Features`` on aarch64; empty where it cannot be
    read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def layout_isa_flags() -> list[str]:
    """Of LAYOUT_ISA_FLAGS, those this CPU has, in that order."""
    have = cpu_flags()
    return [f for f in LAYOUT_ISA_FLAGS if f in have]


def has_vbmi() -> bool:
    """The CPU has AVX-512 VBMI (the paired int4 kernels' byte permute)."""
    return "avx512vbmi" in cpu_flags()


def variants() -> dict[str, tuple[str, ...]]:
    """Each build's name and files, in the order they are tried (tests/native/sanitize.py builds them too)."""
    return {v.name: v.files for v in _VARIANTS}


def variant_for(flags: frozenset[str]) -> str:
    """The build a CPU with these /proc/cpuinfo flags gets ("" for none)."""
    return next((v.name for v in _VARIANTS if all(f in flags for f in v.cpu_flags)), "")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_objects(cc: str, files: tuple[str, ...], extra: tuple[str, ...], objdir: Path) -> list[Path]:
    """Each file compiled with the common flags, `extra` and its own, at once (two cores halve the first start's
    wait); RuntimeError naming the first that failed."""
    objs = [objdir / f"{f}.o" for f in files]
    jobs = [subprocess.Popen([cc, *COMMON_FLAGS, *extra, *SOURCES[f], "-c", str(CSRC / f), "-o", str(obj)],
                             stderr=subprocess.PIPE, text=True) for f, obj in zip(files, objs, strict=True)]
    failed = ""
    for f, job in zip(files, jobs, strict=True):
        err = job.communicate()[1]
        if job.returncode != 0 and not failed:
            failed = f"{cc} exited {job.returncode} on {f}: {(err.strip().splitlines() or ['no message'])[-1]}"
    if failed:
        raise RuntimeError(failed)
    return objs


def build(cc: str, files: tuple[str, ...], target: Path, extra: tuple[str, ...] = ()) -> Path:
    """Compile `files` and link them into `target` by an atomic rename (objects in a temporary folder beside it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        objs = compile_objects(cc, files, extra, work)
        tmp = work / "lib.so"
        done = subprocess.run([cc, *_LINK, *extra, *map(str, objs), "-o", str(tmp), *_LIBS], capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"{cc} exited {done.returncode} linking: {last}")
        os.replace(tmp, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _cached_build(cc: str, variant: _Variant) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    h = hashlib.sha256(version.encode() + " ".join((*COMMON_FLAGS, *_LINK, *_LIBS)).encode())
    for f in sorted(p.name for p in CSRC.iterdir() if p.suffix in (".c", ".h")):
        h.update(f.encode() + " ".join(SOURCES.get(f, ())).encode() + (CSRC / f).read_bytes())
    target = keepwarm_home() / "cache" / "native" / f"cpu_native-{variant.name}-{h.hexdigest()[:16]}.so"
    return target if target.exists() else build(cc, variant.files, target)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str, str, str]:
    """(library, why the AVX512-BF16 matmuls cannot run, why nothing can, the build's name) with "" for "they can".
    Cached: the probe and the build happen once."""
    have = cpu_flags()
    variant = next((v for v in _VARIANTS if all(f in have for f in v.cpu_flags)), None)
    lacks = ", ".join(f for f in _VARIANTS[0].cpu_flags if f not in have)
    no_matmuls = f"the CPU lacks {lacks}" if lacks else ""
    if variant is None:
        return None, no_matmuls, f"the CPU lacks {', '.join(f for f in _VARIANTS[-1].cpu_flags if f not in have)}", ""
    cc = compiler()
    if cc is None:
        return None, "no C compiler (cc) on PATH", "no C compiler (cc) on PATH", ""
    try:
        lib = ctypes.CDLL(str(_cached_build(cc, variant)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"build failed: {exc}", f"build failed: {exc}", ""
    _declare(lib, variant.name == "avx512")
    if variant.name == "avx512":
        _amx_start(lib, have)
    _openmp(lib)
    return lib, no_matmuls, "", variant.name


def _declare(lib: ctypes.CDLL, matmuls: bool) -> None:
    """The entry points' C signatures (kernels/csrc/kw.h)."""
    p, i64, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    q4 = [p] * 4 + [i64] * 5 + [i]
    sigs: dict[str, list[Any]] = {
        "kw_decode_attention": [p, i64, p, p, p, p, *[i64] * 6, f, f, i],
        "kw_rms_norm": [p, i64, p, i64, p, p, p, i64, i64, f],
        "kw_rotary_neox": [p, i64, p, i64, p, p, i64, p, p, i64, i64, i64, i64],
        "kw_store_kv": [p, i64, p, i64, p, p, p, i64, i64, i64, i64, i64],
        "kw_bgemm": [p, p, p, i64, i64, i64, i],
        "kw_q8gemm": [p, p, p, p, i64, i64, i64, i, i],
        "kw_q4gemm": [p, p, p, p, i64, i64, i64, i64, i64, i],
        "kw_quant_int8": [p, i64, i64, p, p],
    }
    if matmuls:
        sigs.update({"kw_gemm": [p] * 4 + [i64] * 3 + [i, i], "kw_bgemv512": [p, p, p, i64, i64, i64, i],
                     "kw_codes_bf16": [p, p, i64, i64, i, i],
                     "kw_amx_enable": [i], "kw_q4amx": q4, "kw_q4vec": q4})
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, args
    if matmuls:
        lib.kw_amx_calls.restype, lib.kw_amx_calls.argtypes = ctypes.c_long, []
    lib.kw_use_openmp.restype, lib.kw_use_openmp.argtypes = None, [ctypes.c_int]


_amx_why = ["not built"]  # why the matmuls do not use AMX tiles ("" when they do)


def _amx_try(lib: ctypes.CDLL, have: frozenset[str]) -> str:
    """Turn the tiles on in the library if the CPU has them and Linux grants the tile state; why not ("" when on)."""
    if not {"amx_tile", "amx_bf16", "avx512vbmi"} <= have:
        return "the CPU lacks amx_tile / amx_bf16 / avx512vbmi"
    return "" if lib.kw_amx_enable(1) == 0 else "Linux refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"


def _amx_start(lib: ctypes.CDLL, have: frozenset[str]) -> None:
    _amx_why[0] = f"{AMX_ENV_VAR}=0" if os.environ.get(AMX_ENV_VAR, "1") == "0" else _amx_try(lib, have)
    _level[0] = None


def amx_reason() -> str:
    """Why the matmuls do not use AMX tiles here ("" when they do)."""
    _load()
    return _amx_why[0]


def amx_calls() -> int:
    """How many int8 / fp8 / int4 matmuls of this process took the AMX tiles (tests check the path really ran)."""
    lib, no_matmuls, _, _ = _load()
    return 0 if lib is None or no_matmuls else int(lib.kw_amx_calls())


def set_amx(on: bool) -> bool:
    """Turn the tile path on or off in this process (A/B benchmarks, tests); returns whether it is on."""
    lib, no_matmuls, _, _ = _load()
    if lib is None or no_matmuls:
        return False
    if on:
        _amx_why[0] = _amx_try(lib, cpu_flags())
    else:
        lib.kw_amx_enable(0)
        _amx_why[0] = "switched off in this process"
    _level[0] = None
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
    _threads_why[0] = why
    if why:
        logger.info("native CPU kernels: threads from their own pool, not torch's OpenMP team (%s)", why)


_threads_why = [""]  # why the kernels' threads are the library's own pool ("" when torch's OpenMP team)


def threads_reason() -> str:
    """Why the kernels run on their own pool rather than torch's OpenMP team ("" when on torch's team)."""
    _load()
    return _threads_why[0]


def switched_on() -> bool:
    """``KEEPWARM_CPU_NATIVE`` is not 0 (read on each call)."""
    return os.environ.get(ENV_VAR, "1") != "0"


def _reason(which: int) -> str:
    """Why the AVX512-BF16 matmuls (1) or every kernel (2) cannot run here ("" when they can), the switch first."""
    if not switched_on():
        return f"{ENV_VAR}=0"
    _, no_matmuls, no_c, _ = _load()
    return no_matmuls if which == 1 else no_c


def reasons() -> tuple[str, str]:
    """(why the AVX512-BF16 matmuls cannot run, why no C kernel can), "" for "they can"; builds on the first call."""
    if not switched_on():
        return f"{ENV_VAR}=0", f"{ENV_VAR}=0"
    loaded = _load()
    return loaded[1], loaded[2]


def log_unavailable(what: str) -> None:
    """Say once per reason (not the switch's) that `what` takes torch's slower path here."""
    reason = _reason(2)
    if reason and not reason.startswith(ENV_VAR):
        _warn_once(reason, what)


@functools.cache
def _warn_once(reason: str, what: str) -> None:
    logger.warning("native CPU kernels unavailable (%s): %s take torch's slower paths", reason, what)


def available() -> bool:
    """Whether the AVX512-BF16 matmuls can run (the avx512 build loaded, the switch on)."""
    return not _reason(1)


def glue_on() -> bool:
    """Whether any C kernel can run: the switch on and a build (either) loaded."""
    return not _reason(2)


def loaded() -> bool:
    """Whether the build was already tried in this process (describing the table never starts one)."""
    return _level[0] is not None or _load.cache_info().currsize > 0


def variant_name() -> str:
    """The build loaded here ("avx512", "avx2"), "" when none."""
    return _load()[3]


_level: list[str | None] = [None]  # level()'s answer until set_amx changes it


def level() -> str:
    """What the loaded library runs here, whatever the switch: "amx", "avx512-vbmi", "avx512" (AVX512-BF16 build;
    tiles on, VBMI), "avx2" (the AVX2 build), "none" (no build). Cached: asked on every dispatch."""
    known = _level[0]
    if known is None:
        lib, no_matmuls, _, _ = _load()
        known = "none" if lib is None else "avx2" if no_matmuls else "amx" if not _amx_why[0] \
            else "avx512-vbmi" if has_vbmi() else "avx512"
        _level[0] = known
    return known


def library() -> ctypes.CDLL | None:
    """The loaded library (None where none builds), whatever the switch: kernels/native_ops.py calls it."""
    return _load()[0]
