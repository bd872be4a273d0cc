"""Shard arenas: a preload for P pipeline stages of N tensor-parallel ranks builds P x N arenas in one pass.

Rules (the whole path: docs/architecture.md, "Tensor parallelism", loading from a CPU daemon):
- A plain tensor (kept, converted or packed; not quantized) is read straight from the file into each (stage, rank)
  slice (:mod:`keepwarm.weights.slices`: each byte once, hashed in file order), then converted and packed per slice.
- Any other tensor is read once and hashed as :func:`loader.build_arena` does, made into its arena form by the same
  code (:func:`loader.convert_tensor`), then cut for every rank of every stage that binds it (``sharding.stage_holds``)
  by :mod:`keepwarm.weights.sharding`; a weight packed for oneDNN is cut plain and each slice packed (exact, a third
  of the reorders). No whole-model copy exists at any time: a thread holds one tensor and its slices.
- A shard holds exactly what a worker cutting its part from the whole arena would bind (the same functions cut both:
  ``stage_tensors`` then ``shard_weights``), so tokens do not depend on which way a rank got its weights.
- Each shard is an arena like any other, its ``Layout`` and ``source_fingerprint`` in its manifest, its fingerprint
  :func:`formats.arena.shard_fingerprint` of the source's. CPU daemons only (a CUDA rank's device is not the daemon's).
  Offsets vary between builds (entries are written as tensors finish); ``arena_digest`` (in plan order) does not.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from keepwarm.formats.arena import (
    LAYOUT_VERSION,
    ArenaManifest,
    CpuArenaFile,
    TensorEntry,
    align,
    combine_digests,
    dtype_name,
    fingerprint_of,
    leaf_digest,
    shard_fingerprint,
)
from keepwarm.formats.layout import Layout
from keepwarm.formats.quant import LAYOUT_MKLDNN_PACKED, QuantMeta
from keepwarm.formats.version import __version__
from keepwarm.kernels.cpu_packed import PackedWeight, pack
from keepwarm.kernels.quant import QuantizedWeight
from keepwarm.weights.checkpoint import Checkpoint
from keepwarm.weights.loader import (
    PlannedTensor,
    Progress,
    convert_tensor,
    file_order,
    plan_arena,
    read_tensor,
    resolve_dtype,
    scratch,
)
from keepwarm.weights.sharding import (
    Shard,
    check_pipeline,
    check_supported,
    plan_cut,
    shard_weight,
    stage_holds,
    stage_of,
)
from keepwarm.weights.slices import read_slices, slice_shape

_LM_HEAD = "lm_head.weight"
_EMBED = "model.embed_tokens.weight"


def as_weight(parts: dict[str, torch.Tensor], meta: QuantMeta | None, dtype: torch.dtype) -> Any:
    """The object a worker binds for these arena parts (as ``worker.attach.model_tensors`` builds it)."""
    if meta is None:
        return parts[""]
    if meta.layout == LAYOUT_MKLDNN_PACKED:
        return PackedWeight(meta, parts["packed"], dtype)
    return QuantizedWeight.from_parts(meta, parts)


def as_parts(w: Any) -> tuple[dict[str, torch.Tensor], QuantMeta | None]:
    """The inverse of :func:`as_weight`: arena parts and QuantMeta of a weight."""
    if isinstance(w, PackedWeight):
        return {"packed": w.raw}, w.meta
    if isinstance(w, QuantizedWeight):
        return w.parts, w.meta
    return {"": w}, None


def _packed(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], QuantMeta]:
    """A plain [N, K] slice packed for oneDNN, as arena parts and QuantMeta (``sharding._cut_packed``'s result)."""
    raw, desc = pack(w)
    shape = (int(w.shape[0]), int(w.shape[1]))
    return {"packed": raw}, QuantMeta("none", LAYOUT_MKLDNN_PACKED, None, shape, desc.hex())


@dataclass
class ShardFile:
    """One rank's arena file while it is written: entries are appended at aligned offsets by several threads."""

    path: Path
    fd: int
    end: int = 0
    entries: dict[tuple[int, str, str], tuple[TensorEntry, str]] = field(default_factory=dict)  # (plan index,
    # weight, part) -> (entry, arena leaf digest)
    quant: dict[str, dict] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def write(self, index: int, name: str, parts: dict[str, torch.Tensor], meta: QuantMeta | None) -> None:
        for part, t in parts.items():
            raw = t.detach().contiguous().view(torch.uint8).reshape(-1)
            data = raw.numpy().data  # a memoryview of the tensor's bytes
            with self.lock:
                offset = self.end
                self.end = align(offset + len(data))
            written = os.pwrite(self.fd, data, offset) if len(data) else 0
            if written != len(data):
                raise OSError(f"short write to {self.path}: {written} of {len(data)} bytes")
            entry = TensorEntry(name, part, offset, len(data), dtype_name(t.dtype), tuple(t.shape))
            digest = leaf_digest(data)
            with self.lock:
                self.entries[(index, name, part)] = (entry, digest)
                if meta is not None:
                    self.quant[name] = meta.to_dict()

    def ordered(self) -> list[tuple[TensorEntry, str]]:
        """The entries in plan order (each weight's parts in the order they were written)."""
        return [self.entries[k] for k in sorted(self.entries, key=lambda k: (k[0], k[1], self.entries[k][0].offset))]


def build_shards(ckpt: Checkpoint, quantization: str, dtype: str, tp_size: int, pp_size: int, arena_dir: Path,
                 progress: Progress | None = None, threads: int = 4,
                 on_created: Callable[[list[Path]], None] | None = None,
                 ) -> list[tuple[CpuArenaFile, ArenaManifest]]:
    """Read ``ckpt`` once and write one arena per (pipeline stage, tensor-parallel rank) into ``arena_dir``
    (temporary names; the caller installs them), stage-major. ``on_created`` learns the files first, so a failure
    can remove them."""
    if tp_size > 1:
        check_supported(ckpt.config, tp_size)
    check_pipeline(ckpt.config, pp_size)
    target = resolve_dtype(ckpt, dtype)
    quantization = ckpt.resolve_quantization(quantization)
    planned, _ = plan_arena(ckpt, quantization, target, "cpu")
    layouts = [Layout(r, tp_size, st, pp_size) for st in range(pp_size) for r in range(tp_size)]
    stages = [stage_of(ckpt.config, pp_size, st) for st in range(pp_size)]
    # A tied head with no stored lm_head (not packed): the last stage takes the embedding's rows as its head.
    tied_head = pp_size > 1 and all(p.name != _LM_HEAD for p in planned)
    token = secrets.token_hex(6)
    files: list[ShardFile] = []
    try:
        for lay in layouts:
            path = arena_dir / f".building-{token}-pp{lay.pp_stage}-tp{lay.tp_rank}.arena"
            files.append(ShardFile(path, os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)))
        if on_created is not None:
            on_created([f.path for f in files])

        def destinations(name: str) -> list[tuple[ShardFile, Shard, str]]:
            out = []
            for f, lay in zip(files, layouts, strict=True):
                stage = stages[lay.pp_stage]
                names = [name] if stage_holds(name, stage) else []
                if tied_head and stage.last and name == _EMBED:
                    names.append(_LM_HEAD)
                out += [(f, Shard(lay.tp_rank, tp_size), n) for n in names]
            return out

        def process(item: tuple[int, PlannedTensor]) -> list[str]:
            index, p = item
            dests = destinations(p.name)
            if not p.quantized and not p.source.roles and dests:
                straight = _read_straight(p, dests, ckpt.config, target)
                if straight is not None:
                    for (f, _, name), (parts, meta) in zip(dests, straight[0], strict=True):
                        f.write(index, name, parts, meta)
                    if progress is not None and not p.derived:
                        progress(p.source.nbytes)
                    return straight[1]
            staging, digests = read_tensor(p)
            if p.packed:  # cut the plain weight, then pack each slice: what unpack, cut, re-pack gives, once
                dense = staging.view(p.source.dtype).view(p.source.shape).to(target)
                for f, shard, name in destinations(p.name):
                    f.write(index, name, *_packed(shard_weight(name, dense, ckpt.config, shard)))
            else:
                parts, meta = convert_tensor(ckpt, p, staging, quantization, target, "cpu")
                whole = as_weight(parts, meta, target)
                for f, shard, name in destinations(p.name):
                    f.write(index, name, *as_parts(shard_weight(name, whole, ckpt.config, shard)))
            if progress is not None and not p.derived:
                progress(p.source.nbytes)
            return digests

        order = file_order(planned)  # the disk streams (loader.file_order); results go back to plan order
        results: list[list[str]] = [[] for _ in planned]
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            for i, digests in zip(order, pool.map(process, [(i, planned[i]) for i in order]), strict=True):
                results[i] = digests
    finally:
        for f in files:
            os.close(f.fd)
    part_digests = [(p.source.name, d) for p, src in zip(planned, results, strict=True) if not p.derived for d in src]
    source = fingerprint_of(quantization, dtype_name(target), part_digests, ckpt.config_json)
    return [_finish(f, ckpt, quantization, target, source, lay) for f, lay in zip(files, layouts, strict=True)]


def _read_straight(p: PlannedTensor, dests: list[tuple[ShardFile, Shard, str]], config: Any, target: torch.dtype,
                   ) -> tuple[list[tuple[dict[str, torch.Tensor], QuantMeta | None]], list[str]] | None:
    """A plain tensor's slices read straight from the file for each destination (:mod:`keepwarm.weights.slices`),
    converted to ``target`` and packed where planned; with the source parts' sha256. None: read it whole."""
    cuts = [plan_cut(name, config, shard) for _, shard, name in dests]
    item = torch.empty((), dtype=p.source.dtype).element_size()
    need = sum(item * torch.Size(slice_shape(p.source, c)).numel() for c in cuts)
    got = read_slices(p.source, cuts, scratch(need))
    if got is None:
        return None
    slices, digests = got
    out: list[tuple[dict[str, torch.Tensor], QuantMeta | None]] = []
    for t in slices:
        t = t.to(target) if t.is_floating_point() else t
        out.append(_packed(t) if p.packed else ({"": t}, None))
    return out, digests


def _finish(f: ShardFile, ckpt: Checkpoint, quantization: str, target: torch.dtype, source: str, layout: Layout,
            ) -> tuple[CpuArenaFile, ArenaManifest]:
    ordered = f.ordered()
    total = f.end
    os.truncate(f.path, max(total, 1))  # the padding after the last entry (zeros)
    manifest = ArenaManifest(
        layout_version=LAYOUT_VERSION,
        fingerprint=shard_fingerprint(source, layout),
        arena_digest=combine_digests("arena", [d for _, d in ordered]),
        model=str(ckpt.model_dir),
        quantization=quantization,
        dtype=dtype_name(target),
        device="cpu",
        total_bytes=max((e.offset + e.nbytes for e, _ in ordered), default=0),
        tensors=tuple(e for e, _ in ordered),
        quant=f.quant,
        config_json=ckpt.config_json,
        generation_config_json=ckpt.generation_config_json,
        source_files=ckpt.signature(),
        keepwarm_version=__version__,
        tp_rank=layout.tp_rank,
        tp_size=layout.tp_size,
        source_fingerprint=source,
        pp_stage=layout.pp_stage,
        pp_size=layout.pp_size,
    )
    return CpuArenaFile.open_readonly(f.path, total), manifest
