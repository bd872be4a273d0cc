"""The oneDNN packed layout of a linear weight (``mkldnn_packed`` in keepwarm.formats.quant): how its bytes and
descriptor are made and how many bytes it takes, known from (shape, dtype) before any data is read.

This is a storage format (the daemon writes it, workers view it); the matmul over it, the availability probe and
the ``KEEPWARM_CPU_PACK`` switch live in keepwarm.kernels.cpu_packed. Torch only, no keepwarm imports but formats.

Batch hint: oneDNN's reorder takes the expected number of rows; it is 1 because decode dominates serving (the
measurements are in keepwarm.kernels.cpu_packed).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from keepwarm.formats.quant import QuantizationError

__all__ = ["BATCH_HINT", "pack", "packed_layout", "packed_nbytes"]

BATCH_HINT = 1


def pack(w: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    """Pack a [N, K] CPU weight for oneDNN: (packed bytes as a uint8 tensor [nbytes], serialized descriptor)."""
    if w.dim() != 2 or w.device.type != "cpu":
        raise QuantizationError(f"packing needs a 2-D CPU weight, got {tuple(w.shape)} on {w.device}")
    pw = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), BATCH_HINT)
    n = int(torch.ops.mkldnn._nbytes(pw))
    raw = torch.empty(n, dtype=torch.uint8)
    ctypes.memmove(raw.data_ptr(), torch.ops.mkldnn.data_ptr(pw), n)  # releases the GIL, like a tensor copy
    return raw, bytes(torch.ops.mkldnn._get_mkldnn_serialized_md(pw).numpy())


@functools.cache
def packed_layout(shape: tuple[int, int], dtype: torch.dtype) -> tuple[int, bytes]:
    """(nbytes, descriptor) of a packed ``dtype`` weight of ``shape``, known before any data is read.

    Packs zeros once per (shape, dtype): oneDNN picks the blocked format from shape, dtype and CPU alone (checked:
    zeros and random weights give the same descriptor), and the preload checks every real pack against this."""
    n, k = (int(s) for s in shape)
    raw, desc = pack(torch.zeros(n, k, dtype=dtype))
    return raw.numel(), desc


def packed_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes the packed weight takes in the arena (exact: see :func:`packed_layout`)."""
    n, k = shape
    return packed_layout((int(n), int(k)), dtype)[0]
