"""The oneDNN packed layout of a linear weight (``mkldnn_packed`` in keepwarm.formats.quant): how its bytes and
descriptor are made and how many bytes it takes, known from (shape, dtype) before any data is read.

This is a storage format (the daemon writes it, workers view it); the matmul over it, the availability probe and
the ``KEEPWARM_CPU_PACK`` switch live in keepwarm.kernels.cpu_packed. Torch only, no keepwarm imports but formats.
Rules (measured in docs/kernels.md, "oneDNN-packed bf16 weights"; the layout cache: docs/architecture.md):
- ``BATCH_HINT`` is 32, as vLLM's CPU ``create_onednn_mm`` (on AMX a hint of 1 packs a slower format that is not
  bit-identical to ``F.linear``); images packed with the earlier hint of 1 (``LEGACY_HINTS``) are still accepted.
- Every pack runs under ``PACK_THREADS`` threads: oneDNN also picks the format from the calling thread's OpenMP
  thread count, so the layout is a function of (shape, dtype, CPU) alone, whatever threads the daemon runs with.
- Layouts found (each costs a pack of a zero weight) are kept in ``$KEEPWARM_HOME/cache/packed/<key>.json``, the key
  a hash of all oneDNN picks a format from. A stale entry cannot give wrong numbers: every real pack is checked
  against its planned layout (a mismatch fails the preload, naming the weight) and carries its own descriptor.
  Written by an atomic rename; a home that cannot be written keeps the layouts in memory (logged once).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from keepwarm.formats.errors import QuantizationError
from keepwarm.formats.paths import keepwarm_home

log = logging.getLogger("keepwarm.formats")

__all__ = ["BATCH_HINT", "LEGACY_HINTS", "PACK_THREADS", "pack", "packed_bytes", "packed_layout", "packed_nbytes"]

BATCH_HINT = 32
# Hints earlier versions packed with: their formats are still valid (see the module docstring).
LEGACY_HINTS = (1,)
# The thread count every pack runs under (see the module docstring): 1-8 threads give the same format here.
PACK_THREADS = 1
_PACK_LOCK = threading.Lock()  # torch's thread count is process-wide: packs take turns setting it


@contextlib.contextmanager
def _pack_threads() -> Iterator[None]:
    """Run the block under ``PACK_THREADS`` torch/OpenMP threads, then restore the caller's count."""
    with _PACK_LOCK:
        before = torch.get_num_threads()
        torch.set_num_threads(PACK_THREADS)
        try:
            yield
        finally:
            torch.set_num_threads(before)


@contextlib.contextmanager
def _reordered(w: torch.Tensor, hint: int) -> Iterator[tuple[int, int, bytes]]:
    """(address, nbytes, descriptor) of ``w`` packed in oneDNN's own buffer, valid inside the block."""
    if w.dim() != 2 or w.device.type != "cpu":
        raise QuantizationError(f"packing needs a 2-D CPU weight, got {tuple(w.shape)} on {w.device}")
    w = w.contiguous()
    with _pack_threads():
        pw = torch.ops.mkldnn._reorder_linear_weight(w, hint)
        desc = bytes(torch.ops.mkldnn._get_mkldnn_serialized_md(pw).numpy())
    try:
        yield torch.ops.mkldnn.data_ptr(pw), int(torch.ops.mkldnn._nbytes(pw)), desc
    finally:
        del pw


@contextlib.contextmanager
def packed_bytes(w: torch.Tensor, hint: int = BATCH_HINT) -> Iterator[tuple[memoryview, bytes]]:
    """Pack a [N, K] CPU weight for oneDNN; yield (a read-only view of the packed bytes in oneDNN's own buffer, the
    serialized descriptor), valid inside the block. The daemon hashes the view and ``pwrite``s it into the arena
    file: no copy through a mapping, whose first write to each 4 KiB page faults.

    Always under ``PACK_THREADS`` threads, so the format does not depend on the caller's thread count."""
    with _reordered(w, hint) as (address, n, desc):
        view = memoryview((ctypes.c_char * n).from_address(address)).cast("B").toreadonly()
        try:
            yield view, desc
        finally:
            view.release()


def pack(w: torch.Tensor, out: torch.Tensor | None = None, hint: int = BATCH_HINT) -> tuple[torch.Tensor, bytes]:
    """Pack a [N, K] CPU weight for oneDNN: (packed bytes as a uint8 tensor [nbytes], serialized descriptor).
    ``out`` (a contiguous CPU uint8 tensor of exactly the packed size, e.g. the arena's slice): the bytes are moved
    there, saving a copy, and ``out`` is returned. Under ``PACK_THREADS`` threads (see :func:`packed_bytes`)."""
    with _reordered(w, hint) as (address, n, desc):
        if out is not None and (out.numel() != n or out.dtype != torch.uint8 or not out.is_contiguous()
                                or out.device.type != "cpu"):
            raise QuantizationError(f"packing a {tuple(w.shape)} weight: the destination holds {out.numel()} bytes, "
                                    f"the packed weight {n}")
        raw = torch.empty(n, dtype=torch.uint8) if out is None else out
        ctypes.memmove(raw.data_ptr(), address, n)  # releases the GIL, like a tensor copy
    return raw, desc


@functools.cache
def packed_layout(shape: tuple[int, int], dtype: torch.dtype, hint: int = BATCH_HINT) -> tuple[int, bytes]:
    """(nbytes, descriptor) of a packed ``dtype`` weight of ``shape``, known before any data is read.

    Packs zeros once per (shape, dtype, hint) under ``PACK_THREADS`` like every real pack: oneDNN then picks the
    blocked format from shape, dtype, hint and CPU alone (checked: zeros and random weights give the same
    descriptor), and the preload checks every real pack against this."""
    n, k = (int(s) for s in shape)
    key = f"{n}x{k}:{str(dtype).removeprefix('torch.')}:{hint}"
    cache = _layout_cache()
    known = cache.get(key)
    if known is not None:
        return known
    raw, desc = pack(torch.zeros(n, k, dtype=dtype), hint=hint)
    cache.put(key, (raw.numel(), desc))
    return raw.numel(), desc


_ONEDNN_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_CPU_ISA_HINTS", "DNNL_CPU_ISA_HINTS",
               "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE")


def cpu_torch_key() -> str:
    """What oneDNN picks a packed format from, besides shape, dtype and hint, hashed: this CPU (vendor, family,
    model, stepping, flags, cache sizes), torch's build, oneDNN's ISA environment and ``PACK_THREADS``."""
    fields = []
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        wanted = ("vendor_id", "cpu family", "model", "stepping", "flags", "Features", "CPU implementer", "CPU part")
        fields += [ln.strip() for ln in first.splitlines() if ln.split(":")[0].strip() in wanted]
    except OSError:
        fields.append("no /proc/cpuinfo")
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        with contextlib.suppress(OSError):
            fields.append(" ".join([index.name] + [(index / f).read_text().strip() for f in ("level", "type", "size")]))
    fields += [torch.__version__, str(getattr(torch.version, "git_version", "")), f"threads {PACK_THREADS}"]
    fields += [f"{v}={os.environ[v]}" for v in _ONEDNN_ENV if v in os.environ]
    return hashlib.sha256("\n".join(fields).encode()).hexdigest()[:24]


class _LayoutCache:
    """``packed_layout``'s answers for this CPU and torch, in memory and in one JSON file (see the docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._known: dict[str, tuple[int, bytes]] = self._read()
        self._unwritable = False

    def _read(self) -> dict[str, tuple[int, bytes]]:
        try:
            raw = json.loads(self.path.read_text())
            return {k: (int(n), bytes.fromhex(d)) for k, (n, d) in raw.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError) as e:  # unreadable or not ours: probe again, rewrite it
            log.warning("packed layouts cache %s unreadable (%s): layouts are probed again", self.path, e)
            return {}

    def get(self, key: str) -> tuple[int, bytes] | None:
        with self._lock:
            return self._known.get(key)

    def put(self, key: str, layout: tuple[int, bytes]) -> None:
        with self._lock:
            self._known[key] = layout
            if self._unwritable:
                return
            merged = {**self._read(), **self._known}  # another process may have added some meanwhile
            text = json.dumps({k: [n, d.hex()] for k, (n, d) in sorted(merged.items())}, indent=0)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(text)
                os.replace(tmp, self.path)
            except OSError as e:
                self._unwritable = True
                tmp.unlink(missing_ok=True)
                log.warning("packed layouts cache %s not written (%s): layouts stay in memory", self.path, e)


@functools.cache
def _layout_cache() -> _LayoutCache:
    return _LayoutCache(keepwarm_home() / "cache" / "packed" / f"{cpu_torch_key()}.json")


def packed_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes the packed weight takes in the arena (exact: see :func:`packed_layout`)."""
    n, k = shape
    return packed_layout((int(n), int(k)), dtype)[0]
