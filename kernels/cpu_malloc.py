"""glibc malloc kept from handing large freed blocks back to the kernel, for CPU serving and the daemon's loads.

A step's big activations are allocated and freed every step; above glibc's mmap threshold each is fresh ``mmap``
pages, a page fault per 4 KiB (measured: 2.45-2.95 s vs 2.16-2.41 s for a 1B's 8-prompt prefill; docs/kernels.md).

Rules:
- Called once per process by a CPU engine, before the first step. ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` go
  to 1 GiB, so blocks below that come from the heap and the process keeps up to its peak activation memory for
  reuse (steady state reuses it every step anyway).
- The daemon does the same at start (a preload's oneDNN packs allocate each packed weight afresh); it then hands
  what its loads freed back with :func:`release_freed_memory` (``malloc_trim``) when a load ends, so between loads
  it holds its arenas, not their scratch.
- ``KEEPWARM_CPU_MALLOC=0`` leaves malloc as it is (A/B, escape hatch). Anything that cannot be set (not glibc,
  mallopt refuses) is said in the log, once, and serving goes on with the defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

__all__ = ["ENV_VAR", "keep_freed_memory", "release_freed_memory"]

logger = logging.getLogger("keepwarm.kernels")

ENV_VAR = "KEEPWARM_CPU_MALLOC"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
_THRESHOLD = 1 << 30


_KEPT = "malloc keeps freed blocks for reuse (mmap and trim thresholds 1 GiB)"


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, found once (``find_library`` runs ``ldconfig``); OSError where it cannot be loaded."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


@functools.cache
def keep_freed_memory() -> str:
    """Raise glibc's mmap and trim thresholds in this process; returns what was done (as logged)."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return f"malloc left as is ({ENV_VAR}=0)"
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError) as exc:
        done = f"malloc left as is (no glibc mallopt: {exc})"
        logger.warning("%s", done)
        return done
    mallopt.restype, mallopt.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, _THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _THRESHOLD) == 1
    if not ok:
        done = "malloc left as is (mallopt refused the thresholds)"
        logger.warning("%s", done)
        return done
    logger.info("%s", _KEPT)
    return _KEPT


def release_freed_memory() -> None:
    """Give the kernel back the heap's free pages (``malloc_trim(0)``); a no-op where malloc was left as it is."""
    if keep_freed_memory() != _KEPT:
        return
    trim = _libc().malloc_trim
    trim.restype, trim.argtypes = ctypes.c_int, [ctypes.c_size_t]
    trim(0)
