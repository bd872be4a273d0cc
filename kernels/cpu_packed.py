"""Linear weights pre-packed for oneDNN, viewed in place in the daemon's arena (CPU, bfloat16).

Rules:
- The daemon packs at preload (``torch.ops.mkldnn._reorder_linear_weight``, `formats.packed`) and stores the packed
  bytes in the arena (one ``packed`` uint8 part) with oneDNN's serialized memory descriptor in the weight's
  ``QuantMeta``. A worker makes an mkldnn tensor over those bytes (a read-only mapping: oneDNN only reads a weight)
  through libtorch's exported AOTInductor C shim ``aoti_torch_create_tensor_from_blob_v2``; no copy is made.
- Only bfloat16 packs: it beats F.linear on every measured shape at 1 and 32 rows, bit for bit; float32 loses at one
  row and differs in the last bits; float16 cannot be packed on the CPUs measured (docs/kernels.md has the figures).
- Packs use the batch hint ``BATCH_HINT`` (32, as vLLM's CPU path) and ``formats.packed.PACK_THREADS`` threads:
  oneDNN picks the blocked format from the shape, dtype, CPU and the thread count; a packed weight computes what
  F.linear computes at the worker's thread count (docs/kernels.md).
- kernels/dispatch.py's table sends a packed weight here when x is a CPU tensor of its dtype. ``KEEPWARM_CPU_PACK=0``
  turns packing off (A/B, escape hatch), read on every :func:`packing_available`; the probe of this process is cached.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from keepwarm.formats.errors import QuantizationError
from keepwarm.formats.packed import BATCH_HINT, pack, packed_layout, packed_nbytes
from keepwarm.formats.quant import LAYOUT_MKLDNN_PACKED, QuantMeta

from . import dispatch, quant

__all__ = ["BATCH_HINT", "ENV_VAR", "PackedWeight", "linear_none", "pack", "packed_layout", "packed_nbytes",
           "packing_available"]

logger = logging.getLogger("keepwarm.kernels")

ENV_VAR = "KEEPWARM_CPU_PACK"
# Measured above: only bfloat16 beats F.linear on every shape at M=1 and M=32 (and matches it exactly).
_PACK_DTYPES = (torch.bfloat16,)
_LOGGED: set[tuple[str, torch.dtype]] = set()


# ---------------------------------------------------------------------------------------------- the C shim
class _Shim:
    """ctypes bindings to libtorch's ``aoti_torch_create_tensor_from_blob_v2`` and the codes it takes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        create = lib.aoti_torch_create_tensor_from_blob_v2
        create.restype = ctypes.c_int32
        create.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64),
                           ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                           ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32,
                           ctypes.POINTER(ctypes.c_uint8), ctypes.c_int64]
        self._create = create
        self._dtypes = {dt: self._code(lib, f"aoti_torch_dtype_{name}")
                        for dt, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16"),
                                         (torch.float32, "float32"))}
        self._cpu = self._code(lib, "aoti_torch_device_type_cpu")
        self._mkldnn = self._code(lib, "aoti_torch_layout__mkldnn")
        capsule_new = ctypes.pythonapi.PyCapsule_New
        capsule_new.restype = ctypes.py_object
        capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        self._capsule_new = capsule_new
        self._steal = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs

    @staticmethod
    def _code(lib: ctypes.CDLL, name: str) -> int:
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int32
        fn.argtypes = []
        return int(fn())

    def tensor_over(self, addr: int, shape: tuple[int, int], dtype: torch.dtype, descriptor: bytes) -> torch.Tensor:
        """An mkldnn tensor whose data is the memory at ``addr`` (not owned: the caller keeps it alive)."""
        n, k = shape
        sizes, strides = (ctypes.c_int64 * 2)(n, k), (ctypes.c_int64 * 2)(k, 1)
        md = (ctypes.c_uint8 * len(descriptor)).from_buffer_copy(descriptor)
        handle = ctypes.c_void_p()
        rc = self._create(addr, 2, sizes, strides, 0, self._dtypes[dtype], self._cpu, 0, ctypes.byref(handle),
                          self._mkldnn, md, len(descriptor))
        if rc != 0 or not handle.value:
            raise QuantizationError(f"cannot view a packed {dtype} weight {shape}: the C shim returned {rc}")
        # The Python tensor takes over the handle (the shim's heap-allocated at::Tensor), so nothing leaks.
        (t,) = self._steal([self._capsule_new(handle.value, None, None)])
        return t


@functools.cache
def _shim() -> _Shim | None:
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        if (lib_dir / name).exists():
            try:
                return _Shim(ctypes.CDLL(str(lib_dir / name)))
            except (OSError, AttributeError) as e:  # an old libtorch without the shim symbols
                logger.info("cpu packing: libtorch C shim unavailable: %s", e)
                return None
    return None


# ---------------------------------------------------------------------------------------------- availability
def onednn_version() -> str | None:
    """The oneDNN version torch was built with (``v3.12.0``), None where its build does not say."""
    m = re.search(r"(?:oneDNN|MKL-DNN) (v[\d.]+)", torch.__config__.show())
    return m.group(1) if m else None


def _disabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off")


@functools.cache
def _probe(dtype: torch.dtype) -> bool:
    """Whether this process can pack, view and multiply a ``dtype`` weight (a tiny end-to-end trial)."""
    if dtype not in _PACK_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    if _shim() is None:
        return False
    try:
        w = torch.randn(48, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
        raw, desc = pack(w)
        pw = PackedWeight(QuantMeta("none", LAYOUT_MKLDNN_PACKED, None, (48, 32), desc.hex()), raw, dtype)
        x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
        ok = torch.equal(_packed_linear(x, pw, None), F.linear(x, w))
    except (RuntimeError, QuantizationError) as e:
        logger.info("cpu packing unavailable for %s: %s", dtype, e)
        return False
    if not ok:
        logger.info("cpu packing disabled for %s: packed result differs from F.linear", dtype)
    return ok


_PROBE_LOCK = threading.Lock()  # one probe per dtype: the daemon's warm-up thread and its socket loop may both ask


def packing_available(dtype: torch.dtype) -> bool:
    """True when CPU linear weights of ``dtype`` are stored packed (off under ``KEEPWARM_CPU_PACK=0``)."""
    if _disabled_by_env():
        return False
    with _PROBE_LOCK:
        return _probe(dtype)


# ---------------------------------------------------------------------------------------------- the weight
class PackedWeight:
    """A [N, K] linear weight as an mkldnn tensor over packed bytes it does not own (e.g. the arena's read-only
    mapping); ``raw`` (the byte view) is kept so the memory outlives the tensor."""

    is_quantized_weight = True  # kernels.linear routes it to linear_<meta.scheme> = linear_none

    def __init__(self, meta: QuantMeta, raw: torch.Tensor, dtype: torch.dtype) -> None:
        if meta.layout != LAYOUT_MKLDNN_PACKED or not meta.descriptor:
            raise QuantizationError(f"PackedWeight needs layout {LAYOUT_MKLDNN_PACKED!r} with a descriptor")
        if raw.dtype != torch.uint8 or raw.dim() != 1 or not raw.is_contiguous() or raw.device.type != "cpu":
            raise QuantizationError("packed bytes must be a contiguous 1-D uint8 CPU tensor")
        shim = _shim()
        if shim is None:
            raise QuantizationError("cannot view packed weights: libtorch's C shim is unavailable")
        self.meta = meta
        self.raw = raw
        self.tensor = shim.tensor_over(raw.data_ptr(), meta.shape, dtype, bytes.fromhex(meta.descriptor))
        need = int(torch.ops.mkldnn._nbytes(self.tensor))
        if need != raw.numel() or torch.ops.mkldnn.data_ptr(self.tensor) != raw.data_ptr():
            raise QuantizationError(f"packed weight {meta.shape}: descriptor wants {need} bytes in place, "
                                    f"have {raw.numel()}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.meta.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] weight (oneDNN reorders it back: exact); the reference path."""
        return self.tensor.to_dense().to(dtype)

    def __repr__(self) -> str:
        return f"PackedWeight({str(self.dtype).removeprefix('torch.')}, shape={tuple(self.meta.shape)})"


# ---------------------------------------------------------------------------------------------- linear
def _packed_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.tensor, bias, "none", [], "")


def _log_once(path: str, x: torch.Tensor) -> None:
    if (path, x.dtype) not in _LOGGED:
        _LOGGED.add((path, x.dtype))
        logger.info("linear none: %s (%s, %s)", path, x.device.type, str(x.dtype).removeprefix("torch."))


def linear_none(x: torch.Tensor, w: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch backend of ``linear_none``: a PackedWeight runs oneDNN's packed matmul; others as before."""
    if not isinstance(w, PackedWeight):
        return quant.TORCH_IMPLS["none"](x, w, bias)
    if dispatch.select("linear_none", 0, x, w) == dispatch.MKLDNN_PACKED:
        _log_once(dispatch.MKLDNN_PACKED, x)
        return _packed_linear(x, w, bias)
    _log_once("reference to_dense+matmul", x)  # another dtype or device than the weight was packed for
    return F.linear(x, w.dequantize(x.dtype).to(x.device), bias)
