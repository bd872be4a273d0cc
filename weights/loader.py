"""Preload: read a checkpoint, fuse, quantize and pack it into an arena, fingerprinting the bytes as read.

Rules (why, with the measurements: docs/architecture.md, "Data path"):
- A few threads work at once (``preadv``, the hashes and the packing ops release the GIL), on tensors in the order of
  their bytes in the files (:func:`file_order`). Each byte is read once (1 MiB reads, ``checkpoint.read_into``) and
  hashed while in cache: sha256 for the fingerprint, the arena's leaf hash for what lands in the arena.
- A plain tensor already in the arena dtype is read straight into its arena slice (its pages reserved just before,
  so a full tmpfs is ENOSPC); others go through a reused per-thread scratch buffer, are converted, quantized or
  packed, and written into a CPU arena's file with ``pwrite``. The file is not allocated up front.
- Quantization "none" on a CPU that packs (:func:`keepwarm.kernels.cpu_packed.packing_available`): the linear weights
  and ``lm_head.weight`` are stored ``mkldnn_packed``; a tied head is a packed copy of the embedding (which stays
  plain), counted neither in the fingerprint nor in progress: both stay functions of the checkpoint.
- A pre-quantized checkpoint's projections are converted by :mod:`keepwarm.weights.convert`, never re-quantized
  (activation quantization logged as run weight-only); a tied GGUF head in bf16 on the CPU is its quantized embedding.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from keepwarm.formats.arena import (
    LAYOUT_VERSION,
    ArenaManifest,
    TensorEntry,
    align,
    combine_digests,
    dtype_name,
    fingerprint_of,
    leaf_digest,
    leaf_hasher,
    pwrite_all,
    source_signature,
)
from keepwarm.formats.model_config import parse_dtype
from keepwarm.formats.packed import packed_bytes
from keepwarm.formats.quant import (
    LAYOUT_MKLDNN_PACKED,
    PartsLayout,
    QuantMeta,
    is_quantized_target,
    layout_parts,
    quantize,
    quantized_layout,
)
from keepwarm.formats.version import __version__
from keepwarm.kernels.cpu_packed import pack, packed_layout, packed_nbytes, packing_available
from keepwarm.kernels.native_ops import quantize_int8
from keepwarm.weights.checkpoint import Checkpoint, FusedTensor, read_into, tensor_bytes

log = logging.getLogger("keepwarm.daemon")

Progress = Callable[[int], None]  # called with the number of source bytes just processed


@dataclass
class PlannedTensor:
    source: FusedTensor
    quantized: bool
    entries: list[TensorEntry]
    packed: bool = False  # stored for oneDNN (kernels/cpu_packed.py): one "packed" uint8 entry
    derived: bool = False  # made from another planned tensor's source (tied lm_head): not fingerprinted again
    meta: QuantMeta | None = None  # a pre-quantized projection's arena layout

    @property
    def name(self) -> str:
        return self.entries[0].weight


_LM_HEAD = "lm_head.weight"
_EMBED = "model.embed_tokens.weight"


def _packs(name: str, t: FusedTensor) -> bool:
    return (is_quantized_target(name) or name == _LM_HEAD) and len(t.shape) == 2 and t.dtype.is_floating_point


def resolve_dtype(ckpt: Checkpoint, dtype: str) -> torch.dtype:
    return ckpt.config.dtype if dtype in ("auto", "", None) else parse_dtype(dtype)


def plan_arena(ckpt: Checkpoint, quantization: str, dtype: torch.dtype, device_type: str = "cpu",
               ) -> tuple[list[PlannedTensor], int]:
    """Every tensor's place in the arena, from the checkpoint's headers alone (nothing is read)."""
    quantization = ckpt.resolve_quantization(quantization)
    packing = quantization == "none" and device_type == "cpu" and packing_available(dtype)
    sources: list[tuple[str, FusedTensor, bool]] = [(t.name, t, False) for t in ckpt.tensors]
    head = _derived_head(ckpt, packing, dtype, device_type)
    if head is not None:
        sources.append((_LM_HEAD, head, True))
    planned: list[PlannedTensor] = []
    offset = 0
    for name, t, derived in sources:
        quantized = quantization != "none" and is_quantized_target(name) and len(t.shape) == 2
        packed = packing and _packs(name, t)
        meta = None
        if t.roles:
            meta = ckpt.plan_quantized(t, dtype, device_type, name)
            layout = layout_parts(meta, dtype) if meta is not None else {"": (dtype, t.shape)}
            quantized = True
        elif quantized:
            layout = quantized_layout(t.shape, quantization, dtype, device_type)
        elif packed:
            layout = {"packed": (torch.uint8, (packed_nbytes(t.shape, dtype),))}
        elif t.dtype.is_floating_point:
            layout = {"": (dtype, t.shape)}
        else:
            layout = {"": (t.dtype, t.shape)}
        entries, offset = place(name, layout, offset)
        planned.append(PlannedTensor(t, quantized, entries, packed, derived, meta))
    return planned, offset


def _derived_head(ckpt: Checkpoint, packing: bool, dtype: torch.dtype, device_type: str) -> FusedTensor | None:
    """The embedding a tied ``lm_head`` is stored from, or None (the model then multiplies by the embedding): a
    packed copy on a packing CPU; for a GGUF file in bfloat16 on the CPU, the file's own quantized token_embd blocks
    converted as a projection (exact where the dense bf16 embedding rounds them; 1/2 to 1/4 of its bytes a step)."""
    if not ckpt.config.tie_word_embeddings or any(t.name == _LM_HEAD for t in ckpt.tensors):
        return None
    embed = next((t for t in ckpt.tensors if t.name == _EMBED), None)
    if embed is None:
        return None
    if packing:
        return embed
    gguf_head = (device_type == "cpu" and dtype == torch.bfloat16 and embed.roles
                 and ckpt.plan_quantized(embed, dtype, device_type, _LM_HEAD) is not None)
    return embed if gguf_head else None


def place(weight: str, layout: PartsLayout, offset: int) -> tuple[list[TensorEntry], int]:
    """``weight``'s parts (name -> dtype and shape) laid out in an arena from ``offset``, each aligned: (their
    entries, the offset after them)."""
    entries = []
    for part, (pdtype, shape) in layout.items():
        n = torch.empty((), dtype=pdtype).element_size()
        for s in shape:
            n *= s
        entries.append(TensorEntry(weight, part, offset, n, dtype_name(pdtype), tuple(shape)))
        offset = align(offset + n)
    return entries, offset


_THREAD = threading.local()


def scratch(n: int) -> torch.Tensor:
    """A per-thread scratch buffer of ``n`` bytes, reused across tensors: a fresh large allocation page-faults all
    of its pages again. Whatever is made from it is copied into the arena before the thread's next tensor."""
    buf = getattr(_THREAD, "staging", None)
    if buf is None or buf.numel() < n:
        buf = _THREAD.staging = torch.empty(n, dtype=torch.uint8)
    return buf[:n]


def _read_hashed(t: FusedTensor, dest: memoryview, leaf: Any = None) -> list[str]:
    """Read every part of ``t`` into ``dest`` back to back; return each part's sha256 (the fingerprint's). With
    ``leaf`` (an arena leaf hasher), every byte also goes to it while in cache: then it hashes ``dest``."""
    digests, off = [], 0
    for part in t.parts:
        h = hashlib.sha256()

        def both(b: memoryview, h: Any = h) -> None:
            h.update(b)
            leaf.update(b)

        read_into(part, dest[off:off + part.nbytes], on_bytes=h.update if leaf is None else both)
        digests.append(h.hexdigest())
        off += part.nbytes
    return digests


def read_tensor(p: PlannedTensor) -> tuple[torch.Tensor, list[str]]:
    """``p``'s source bytes in this thread's scratch buffer, and each source part's sha256 (read once). A derived
    tensor's bytes are not fingerprinted (its source's are), so they are read without hashing."""
    staging = scratch(p.source.nbytes)
    if p.derived:
        dest, off = tensor_bytes(staging), 0
        for part in p.source.parts:
            read_into(part, dest[off:off + part.nbytes])
            off += part.nbytes
        return staging, []
    return staging, _read_hashed(p.source, tensor_bytes(staging))


def file_order(planned: list[PlannedTensor]) -> list[int]:
    """Indices of ``planned`` in the order their bytes lie in the checkpoint's files. The plan follows the
    checkpoint's index, which jumps about a file; reading in file order keeps the kernel's readahead streaming
    (SmolLM2 with the page cache dropped, one thread, no hashing: 0.29 s in plan order, 0.20 s in file order, as
    ``cat``). A derived tensor sorts right after its source, whose bytes are then still in the page cache."""
    def position(i: int) -> tuple[str, int, int]:
        first = planned[i].source.parts[0]
        return str(first.file), first.offset, int(planned[i].derived)
    return sorted(range(len(planned)), key=position)


def convert_tensor(ckpt: Checkpoint, p: PlannedTensor, staging: torch.Tensor, quantization: str,
                   target: torch.dtype, device_type: str, out: torch.Tensor | None = None,
                   ) -> tuple[dict[str, torch.Tensor], QuantMeta | None]:
    """``p``'s arena parts made from its source bytes in ``staging`` (converted, quantized or packed; ``out``: where a
    packed weight goes), and its QuantMeta (None for a plain tensor). A part may be a view of ``staging``."""
    t = p.source
    if t.roles:
        return ckpt.convert_quantized(t, p.meta, staging, target), p.meta
    w = staging.view(t.dtype).view(t.shape)
    if p.quantized:
        meta, parts = quantize(w, quantization, target, device_type, int8_rows=quantize_int8)
        return parts, meta
    if p.packed:
        raw, desc = pack(w.to(target), out=out)
        return {"packed": raw}, packed_meta(p, desc, raw.numel(), target)
    return {"": w.to(target) if w.is_floating_point() else w}, None


def packed_meta(p: PlannedTensor, desc: bytes, nbytes: int, target: torch.dtype) -> QuantMeta:
    """The QuantMeta of ``p`` packed as ``desc``, which must be the planned layout: the arena was sized from the
    layout known before reading (a data-dependent format, or a stale layouts file, would break that)."""
    shape = tuple(p.source.shape)
    if desc != packed_layout(shape, target)[1] or nbytes != p.entries[0].nbytes:
        raise RuntimeError(f"{p.name}: oneDNN packed it in another format than planned")
    return QuantMeta("none", LAYOUT_MKLDNN_PACKED, None, (shape[0], shape[1]), desc.hex())


def write_packed(p: PlannedTensor, staging: torch.Tensor, target: torch.dtype, fd: int) -> tuple[str, QuantMeta]:
    """Pack ``p``'s weight (its source bytes in ``staging``), hash the packed bytes and ``pwrite`` them into the
    arena file ``fd`` straight from oneDNN's buffer: (the arena leaf digest, the QuantMeta)."""
    w = staging.view(p.source.dtype).view(p.source.shape).to(target)
    with packed_bytes(w) as (view, desc):
        meta = packed_meta(p, desc, len(view), target)
        digest = leaf_digest(view)
        pwrite_all(fd, view, p.entries[0].offset)
    return digest, meta


def build_arena(ckpt: Checkpoint, quantization: str, dtype: str, flat: torch.Tensor, device: str,
                progress: Progress | None = None, threads: int = 4,
                planned: list[PlannedTensor] | None = None, arena_file: Path | None = None,
                device_type: str | None = None) -> ArenaManifest:
    """Fill ``flat`` (the arena's uint8 buffer, CPU or CUDA, sized by :func:`plan_arena`) and return its manifest.
    ``arena_file``: the tmpfs file ``flat`` maps, into which converted, quantized and packed tensors are written with
    ``pwrite`` (see the module docstring). ``device_type``: the layouts of another device than ``flat``'s (a CUDA
    arena's, built in host memory: how the tests make a CUDA image without a GPU)."""
    target = resolve_dtype(ckpt, dtype)
    quantization = ckpt.resolve_quantization(quantization)
    device_type = device_type or flat.device.type
    if planned is None:
        planned, total = plan_arena(ckpt, quantization, target, device_type)
        if total > flat.numel():
            raise ValueError(f"arena of {flat.numel()} bytes is too small for {total}")
    quant_meta: dict[str, dict] = {}
    lock = threading.Lock()
    on_cpu = flat.device.type == "cpu"
    if ckpt.quant is not None:
        log.info("%s: %s read as is into the arena (no re-quantization)", ckpt.model_dir.name, ckpt.quant.description)
        if ckpt.quant.activation_note:
            log.info("%s: %s", ckpt.model_dir.name, ckpt.quant.activation_note)

    def process(p: PlannedTensor) -> tuple[list[str], list[str]]:
        t = p.source
        if not p.quantized and not p.packed and on_cpu and p.entries[0].dtype == dtype_name(t.dtype):
            e = p.entries[0]
            if fd is not None:  # the only bytes written through the mapping: their pages first (ENOSPC, not EFAULT)
                os.posix_fallocate(fd, e.offset, max(e.nbytes, 1))
            dest = tensor_bytes(flat[e.offset:e.offset + e.nbytes])
            leaf = leaf_hasher()  # the entry's arena leaf, fed as the parts are read straight into their place
            src_digests = _read_hashed(t, dest, leaf)
            arena_digests = [leaf.hexdigest()]
        elif p.packed and fd is not None:
            staging, src_digests = read_tensor(p)
            digest, packed = write_packed(p, staging, target, fd)
            with lock:
                quant_meta[p.name] = packed.to_dict()
            arena_digests = [digest]
        else:
            staging, src_digests = read_tensor(p)
            e = p.entries[0]
            out = flat[e.offset:e.offset + e.nbytes] if p.packed and on_cpu else None
            parts, meta = convert_tensor(ckpt, p, staging, quantization, target, device_type, out)
            if meta is not None:
                with lock:
                    quant_meta[p.name] = meta.to_dict()
            arena_digests = []
            for e in p.entries:
                raw = parts[e.part].contiguous().view(torch.uint8).reshape(-1)
                if raw.numel() != e.nbytes:
                    raise RuntimeError(f"{p.name}{'.' + e.part if e.part else ''}: {raw.numel()} bytes, "
                                       f"planned {e.nbytes}")
                arena_digests.append(leaf_digest(memoryview(raw.numpy())))
                dest_t = flat[e.offset:e.offset + e.nbytes]
                if fd is not None:
                    pwrite_all(fd, memoryview(raw.numpy()), e.offset)
                elif raw.data_ptr() != dest_t.data_ptr():  # a packed weight is already in its place
                    dest_t.copy_(raw, non_blocking=not on_cpu)
        if progress is not None and not p.derived:
            progress(t.nbytes)
        return src_digests, arena_digests

    order = file_order(planned)
    results: list[tuple[list[str], list[str]]] = [([], [])] * len(planned)
    fd = os.open(arena_file, os.O_WRONLY) if arena_file is not None and on_cpu else None
    try:
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            for i, result in zip(order, pool.map(lambda i: process(planned[i]), order), strict=True):
                results[i] = result
    finally:
        if fd is not None:
            os.close(fd)
    if not on_cpu:
        torch.cuda.synchronize(flat.device)
    part_digests = [(p.source.name, d) for p, (src, _) in zip(planned, results, strict=True) if not p.derived
                    for d in src]
    entries = tuple(e for p in planned for e in p.entries)
    arena_digest = combine_digests("arena", [d for _, arena in results for d in arena])
    config_json = ckpt.config_json
    return ArenaManifest(
        layout_version=LAYOUT_VERSION,
        fingerprint=fingerprint_of(quantization, dtype_name(target), part_digests, config_json),
        arena_digest=arena_digest,
        model=str(ckpt.model_dir),
        quantization=quantization,
        dtype=dtype_name(target),
        device=device,
        total_bytes=max((e.offset + e.nbytes for e in entries), default=0),
        tensors=entries,
        quant=quant_meta,
        config_json=config_json,
        generation_config_json=ckpt.generation_config_json,
        source_files=ckpt.signature(),
        keepwarm_version=__version__,
    )


def warm_up() -> float:
    """Run once what a CPU daemon's first preload would otherwise pay for inside it (0.1-0.25 s on a 2-core Zen 4):
    the bf16 packing probe (oneDNN's first bf16 reorder and matmul), the native kernels' library (int8
    quantization) and the hashes' code. Nothing is kept but those caches, so no arena depends on it having run.
    Returns the seconds it took."""
    t0 = time.perf_counter()
    w = torch.ones(64, 64, dtype=torch.bfloat16)
    packing_available(torch.bfloat16)
    quantize_int8(w)
    hashlib.sha256(tensor_bytes(w)).hexdigest()
    leaf_digest(tensor_bytes(w))
    return time.perf_counter() - t0


def checkpoint_changed(manifest: ArenaManifest) -> bool:
    """True when the model's files no longer have the size/mtime recorded at preload (or are gone)."""
    try:
        ckpt_dir = Path(manifest.model)
        return source_signature(ckpt_dir, [ckpt_dir / n for n, *_ in manifest.source_files]) != \
            manifest.source_files
    except OSError:
        return True
