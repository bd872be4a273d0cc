"""The oneDNN packed layout of a linear weight (``mkldnn_packed`` in keepwarm.formats.quant): how its bytes and
descriptor are made and how many bytes it takes, known from (shape, dtype) before any data is read.

This is a storage format (the daemon writes it, workers view it); the matmul over it, the availability probe and
the ``KEEPWARM_CPU_PACK`` switch live in keepwarm.kernels.cpu_packed. Torch only, no keepwarm imports but formats.

Batch hint: oneDNN's reorder takes the expected number of rows. It is 32, as vLLM's CPU ``create_onednn_mm``
uses: on an AMX CPU (Sapphire Rapids) a hint of 1 picks a format of its own whose matmuls are 20-35% slower at 1
and 8 rows and which, unlike every hint >= 2, is not bit-identical to ``F.linear`` at 100 rows; on CPUs without
AMX every hint gives the same format (measurements in keepwarm.kernels.cpu_packed). Images packed with the
earlier hint of 1 (``LEGACY_HINTS``) are still accepted: oneDNN computes with whatever format a weight carries.

Thread count: oneDNN also picks the blocked format from the calling thread's OpenMP thread count (SmolLM2's
[576, 576] and [960, 576] bf16 weights block differently at 16 threads than at 1-8), and the arena is planned
from :func:`packed_layout` in one thread and packed in others. So every pack runs under ``PACK_THREADS``
threads: the layout is a function of (shape, dtype, CPU) alone, whatever thread count the daemon runs with.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator

import torch

from keepwarm.formats.quant import QuantizationError

__all__ = ["BATCH_HINT", "LEGACY_HINTS", "PACK_THREADS", "pack", "packed_layout", "packed_nbytes"]

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


def pack(w: torch.Tensor, out: torch.Tensor | None = None, hint: int = BATCH_HINT) -> tuple[torch.Tensor, bytes]:
    """Pack a [N, K] CPU weight for oneDNN: (packed bytes as a uint8 tensor [nbytes], serialized descriptor).
    ``out`` (a contiguous CPU uint8 tensor of exactly the packed size, e.g. the arena's slice): the bytes are moved
    there, saving a copy, and ``out`` is returned.

    Always under ``PACK_THREADS`` threads, so the format does not depend on the caller's thread count."""
    if w.dim() != 2 or w.device.type != "cpu":
        raise QuantizationError(f"packing needs a 2-D CPU weight, got {tuple(w.shape)} on {w.device}")
    w = w.contiguous()
    with _pack_threads():
        pw = torch.ops.mkldnn._reorder_linear_weight(w, hint)
        desc = bytes(torch.ops.mkldnn._get_mkldnn_serialized_md(pw).numpy())
    n = int(torch.ops.mkldnn._nbytes(pw))
    if out is not None and (out.numel() != n or out.dtype != torch.uint8 or not out.is_contiguous()
                            or out.device.type != "cpu"):
        raise QuantizationError(f"packing a {tuple(w.shape)} weight: the destination holds {out.numel()} bytes, "
                                f"the packed weight {n}")
    raw = torch.empty(n, dtype=torch.uint8) if out is None else out
    ctypes.memmove(raw.data_ptr(), torch.ops.mkldnn.data_ptr(pw), n)  # releases the GIL, like a tensor copy
    return raw, desc


@functools.cache
def packed_layout(shape: tuple[int, int], dtype: torch.dtype, hint: int = BATCH_HINT) -> tuple[int, bytes]:
    """(nbytes, descriptor) of a packed ``dtype`` weight of ``shape``, known before any data is read.

    Packs zeros once per (shape, dtype, hint) under ``PACK_THREADS`` like every real pack: oneDNN then picks the
    blocked format from shape, dtype, hint and CPU alone (checked: zeros and random weights give the same
    descriptor), and the preload checks every real pack against this."""
    n, k = (int(s) for s in shape)
    raw, desc = pack(torch.zeros(n, k, dtype=dtype), hint=hint)
    return raw.numel(), desc


def packed_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes the packed weight takes in the arena (exact: see :func:`packed_layout`)."""
    n, k = shape
    return packed_layout((int(n), int(k)), dtype)[0]
