"""The portable form of an arena (a snapshot's portable layer) and the two exact ways between it and a machine's.

Rules (docs/snapshots.md, "Two layers"):
- Two layouts depend on the machine that built them, and only two: ``mkldnn_packed`` (oneDNN's blocked bf16
  format, a function of the CPU, torch and oneDNN) and ``int4_cpu_*`` (the nibble order of torch's CPU int4 pack).
  Their portable forms are the dense weight in the arena's dtype (part ``""``) and ``int4_canonical`` (two codes a
  byte, low nibble first; scales and zeros [N, K/gs]). Every other layout is portable as it is, byte for byte.
- A packing CPU stores a tied ``lm_head`` as a packed copy of the embedding: it is left out of the portable form
  when its numbers are the embedding's, and a packing machine derives it again (the preload's rule).
- Both directions are permutations of the same numbers: a machine arena made from the portable form re-packs and
  never re-quantizes, and machine -> portable -> the same machine gives back the arena's bytes (its arena_digest).
- The portable manifest's device is ``portable``, its ``arena_digest`` over the portable bytes (the same whichever
  machine made it); an arena with nothing machine-specific is its own portable form (same blob). Two machines whose
  platform descriptors have the same ``key`` build the same bytes from the same portable form.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform as _platform
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from keepwarm.formats.arena import (
    LAYOUT_VERSION,
    ArenaManifest,
    TensorEntry,
    align,
    combine_digests,
    dtype_from_name,
    dtype_name,
    leaf_digest,
    leaf_hasher,
    tensor_byte_view,
    view_tensor,
)
from keepwarm.formats.model_config import parse_model_config
from keepwarm.formats.packed import cpu_torch_key, packed_bytes, packed_layout
from keepwarm.formats.quant import (
    LAYOUT_INT4_CANONICAL,
    LAYOUT_MKLDNN_PACKED,
    PartsLayout,
    QuantMeta,
    cpu_int4_layout,
    is_quantized_target,
    layout_parts,
    pack_int4,
    repack_int4_canonical,
    unpack_int4,
)
from keepwarm.kernels.cpu_native import layout_isa_flags
from keepwarm.kernels.cpu_packed import PackedWeight, onednn_version, packing_available
from keepwarm.weights.checkpoint import tensor_bytes
from keepwarm.weights.loader import place

PORTABLE_DEVICE = "portable"
LM_HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"
class PortableError(Exception):
    """A portable layer that cannot be used (code as the daemon's protocol errors: ``bad_image``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# -- platforms ---------------------------------------------------------------------------------------------------------
def platform_descriptor(device: torch.device) -> dict[str, Any]:
    """What this machine's arena layouts depend on: for a CPU the ISA, torch and oneDNN (their hash in
    ``pack_key``) and torch's int4 pack order; for CUDA the compute capability and the arena layout version. ``key``
    hashes the fields that decide the bytes; ``name`` is for people (e.g. ``cpu-x86_64-amx``)."""
    d: dict[str, Any] = {"device": device.type, "layout_version": LAYOUT_VERSION, "torch": torch.__version__}
    if device.type == "cpu":
        flags = layout_isa_flags()
        packs = packing_available(torch.bfloat16)
        d.update(arch=_platform.machine(), isa=flags, onednn=onednn_version() or "unknown",
                 pack_key=cpu_torch_key() if packs else "none", int4_layout=cpu_int4_layout() or LAYOUT_INT4_CANONICAL)
        tier = next((t for t, f in (("amx", "amx_bf16"), ("avx512bf16", "avx512_bf16"), ("avx512", "avx512f"),
                                    ("avx2", "avx2")) if f in flags), "base")
        caps = [f"{env.split('_')[0].lower()}-{os.environ[env].lower()}" for env in ("ONEDNN_MAX_CPU_ISA",
                                                                               "ATEN_CPU_CAPABILITY")
                if os.environ.get(env)]  # ISA caps a machine runs under change its layouts: name them
        d["name"] = "-".join([f"cpu-{d['arch']}-{tier}", *caps])
        decides: tuple[str, ...] = ("device", "layout_version", "arch", "pack_key", "int4_layout")
    else:
        major, minor = torch.cuda.get_device_capability(device)
        d.update(capability=f"{major}.{minor}", gpu=torch.cuda.get_device_name(device))
        d["name"] = f"cuda-sm{major}{minor}"
        decides = ("device", "layout_version", "capability")
    d["key"] = hashlib.sha256(json.dumps({k: d[k] for k in decides}, sort_keys=True).encode()).hexdigest()[:24]
    return d


# -- machine -> portable -----------------------------------------------------------------------------------------------
def machine_specific(m: ArenaManifest) -> list[str]:
    """The weights of ``m`` in a layout that depends on the machine (see the module docstring)."""
    return [w for w, q in m.quant.items() if _specific(q.get("layout", ""))]


def _specific(layout: str) -> bool:
    return layout == LAYOUT_MKLDNN_PACKED or layout.startswith("int4_cpu_")


def _tied(m: ArenaManifest) -> bool:
    """Whether the model ties its head to the embedding, read as the preload reads it (a family's default too)."""
    return parse_model_config(m.config_json, None, source=m.model).tie_word_embeddings


def _portable_parts(m: ArenaManifest, flat: torch.Tensor, weight: str, entries: list[TensorEntry],
                    ) -> tuple[dict[str, torch.Tensor], QuantMeta | None]:
    """``weight``'s portable parts (name -> tensor, in the layout's part order) and QuantMeta (None: dense)."""
    dtype = dtype_from_name(m.dtype)
    meta = QuantMeta.from_dict(m.quant[weight])
    by_part = {e.part: e for e in entries}
    if meta.layout == LAYOUT_MKLDNN_PACKED:
        raw = tensor_byte_view(flat, by_part["packed"])
        dense = PackedWeight(meta, raw, dtype).dequantize(dtype)  # oneDNN's reorder back: exact
        return {"": dense.contiguous()}, None
    codes = unpack_int4(view_tensor(flat, by_part["qweight"]), meta.layout, meta.shape)
    sz = view_tensor(flat, by_part["scales_and_zeros"])  # [K/gs, N, 2]
    canonical = QuantMeta(meta.scheme, LAYOUT_INT4_CANONICAL, meta.group_size, meta.shape)
    parts = pack_int4(canonical, codes, sz[..., 0].t().contiguous(), sz[..., 1].t().contiguous())
    return {k: v.contiguous() for k, v in parts.items()}, canonical


def _drop_tied_head(m: ArenaManifest, flat: torch.Tensor, by_weight: dict[str, list[TensorEntry]]) -> bool:
    """True when ``lm_head`` is a packed copy of the embedding that a packing machine derives again."""
    if LM_HEAD not in by_weight or EMBED not in by_weight or not _tied(m):
        return False
    if m.quant.get(LM_HEAD, {}).get("layout") != LAYOUT_MKLDNN_PACKED or len(by_weight[EMBED]) != 1:
        return False
    (embed,) = by_weight[EMBED]
    head, _ = _portable_parts(m, flat, LM_HEAD, by_weight[LM_HEAD])
    return torch.equal(head[""].view(torch.uint8).reshape(-1), tensor_byte_view(flat, embed))


def to_portable(m: ArenaManifest, flat: torch.Tensor | None, out: Path | None) -> ArenaManifest:
    """The portable manifest of the arena ``m`` whose bytes ``flat`` holds (a CPU mapping). When ``m`` has nothing
    machine-specific the portable form is the arena itself (``out`` is not written); otherwise its bytes are written
    to ``out`` (:func:`portable_chunks`)."""
    if not machine_specific(m):
        return replace(m, device=PORTABLE_DEVICE)
    if out is None or flat is None:
        raise ValueError("to_portable: the arena has machine-specific layouts and no bytes or output file were given")
    made: list[ArenaManifest] = []
    with open(out, "wb") as f:
        for chunk in portable_chunks(m, flat, made):
            f.write(chunk)
        os.fsync(f.fileno())
    return made[0]


PIECE = 1 << 20  # the pieces portable_chunks yields: hashed and written while in cache


def portable_chunks(m: ArenaManifest, flat: torch.Tensor, made: list[ArenaManifest]) -> Iterator[memoryview]:
    """The portable form of the arena ``m`` (its bytes in ``flat``, a CPU mapping) as consecutive byte pieces,
    the zero padding between tensors included, made weight by weight as they are consumed (a snapshot's store
    hashes and writes them in one pass); once exhausted, its manifest is appended to ``made``."""
    by_weight = m.entries_by_weight()
    drop = _drop_tied_head(m, flat, by_weight)
    entries: list[TensorEntry] = []
    quant: dict[str, dict[str, Any]] = {}
    leaves: list[str] = []
    offset = written = 0
    for weight, group in by_weight.items():
        if weight == LM_HEAD and drop:
            continue
        if weight in m.quant and _specific(m.quant[weight].get("layout", "")):
            parts, meta = _portable_parts(m, flat, weight, group)
            if meta is not None:
                quant[weight] = meta.to_dict()
            items = [(part, t.view(torch.uint8).reshape(-1), dtype_name(t.dtype), tuple(t.shape))
                     for part, t in parts.items()]
        else:
            if weight in m.quant:
                quant[weight] = m.quant[weight]
            items = [(e.part, tensor_byte_view(flat, e), e.dtype, e.shape) for e in group]
        for part, raw, dt, shape in items:
            if offset > written:  # the padding before it
                yield memoryview(bytes(offset - written))
            view, leaf = tensor_bytes(raw), leaf_hasher(m.arena_digest_scheme)
            for at in range(0, len(view), PIECE):
                leaf.update(view[at:at + PIECE])
                yield view[at:at + PIECE]
            leaves.append(leaf.hexdigest())
            entries.append(TensorEntry(weight, part, offset, raw.numel(), dt, shape))
            written = offset + raw.numel()
            offset = align(written)
    if offset > written:  # the last tensor's padding too: the layer is total_bytes long
        yield memoryview(bytes(offset - written))
    made.append(replace(m, device=PORTABLE_DEVICE, tensors=tuple(entries), quant=quant, total_bytes=offset,
                        arena_digest=combine_digests("arena", leaves)))


# -- portable -> machine -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One weight of the machine arena: how it is made from the portable form (``how``: "copy", "pack",
    "int4" or "derive" for a tied lm_head packed from the embedding), where its parts go, its machine QuantMeta."""

    weight: str
    how: str
    source: tuple[TensorEntry, ...]
    entries: tuple[TensorEntry, ...]
    meta: QuantMeta | None


def needs_repack(pm: ArenaManifest, device: torch.device) -> bool:
    """False when this device's layout of ``pm`` is the portable one byte for byte (CUDA; a CPU that neither
    packs bf16 nor has torch's int4 pack): the portable image then loads as an image, with no conversion. Cheap:
    nothing is packed to learn a size."""
    return any(how != "copy" for _, how, _, _ in _choose(pm, device))


def _choose(pm: ArenaManifest, device: torch.device) -> list[tuple[str, str, tuple[TensorEntry, ...],
                                                                   QuantMeta | None]]:
    """(weight, how, its portable entries, its machine QuantMeta where known) in the preload's order."""
    dtype = dtype_from_name(pm.dtype)
    cpu = device.type == "cpu"
    packs = cpu and pm.quantization == "none" and packing_available(dtype)
    int4 = cpu_int4_layout() if cpu else None
    by_weight = pm.entries_by_weight()
    out: list[tuple[str, str, tuple[TensorEntry, ...], QuantMeta | None]] = []
    for weight, group in by_weight.items():
        q = pm.quant.get(weight)
        meta = QuantMeta.from_dict(q) if q is not None else None
        first = group[0]
        if (packs and meta is None and len(group) == 1 and len(first.shape) == 2 and first.dtype == pm.dtype
                and (is_quantized_target(weight) or weight == LM_HEAD)):
            out.append((weight, "pack", tuple(group), None))
        elif (int4 is not None and meta is not None and meta.scheme == "int4" and meta.layout == LAYOUT_INT4_CANONICAL
              and meta.shape[0] % 16 == 0):
            out.append((weight, "int4", tuple(group), QuantMeta(meta.scheme, int4, meta.group_size, meta.shape)))
        else:
            out.append((weight, "copy", tuple(group), meta))
    if packs and LM_HEAD not in by_weight and EMBED in by_weight and _tied(pm):
        out.append((LM_HEAD, "derive", tuple(by_weight[EMBED]), None))
    return out


def plan_machine(pm: ArenaManifest, device: torch.device) -> list[Step]:
    """Every weight's place in this device's arena made from the portable manifest ``pm``, in the preload's order
    (its tensor order; a derived lm_head last), so the arena's bytes and offsets are a preload's. May pack a zero
    weight per shape not in this CPU's layouts file (``formats.packed``): run it off the daemon's socket loop."""
    dtype = dtype_from_name(pm.dtype)
    steps, offset = [], 0
    for weight, how, source, meta in _choose(pm, device):
        layout: PartsLayout
        if how in ("pack", "derive"):
            shape = source[0].shape
            layout = {"packed": (torch.uint8, (packed_layout((int(shape[0]), int(shape[1])), dtype)[0],))}
        elif how == "int4":
            assert meta is not None
            layout = layout_parts(meta, dtype)
        else:
            layout = {e.part: (dtype_from_name(e.dtype), e.shape) for e in source}
        entries, offset = place(weight, layout, offset)
        steps.append(Step(weight, how, source, tuple(entries), meta))
    return steps


Write = Callable[[TensorEntry, memoryview], None]


def _make(step: Step, pm: ArenaManifest, src: torch.Tensor, write: Write) -> tuple[list[str], QuantMeta | None]:
    """Write ``step``'s parts (from the portable bytes ``src``) with ``write``: (their leaf digests, the meta)."""
    if step.how in ("pack", "derive"):
        w = view_tensor(src, step.source[0])
        with packed_bytes(w) as (view, desc):
            (e,) = step.entries
            if len(view) != e.nbytes:
                raise PortableError("incompatible_image", f"{step.weight}: oneDNN packed it in {len(view)} bytes, "
                                                          f"planned {e.nbytes}")
            write(e, view)
            digest = leaf_digest(view, pm.arena_digest_scheme)
        shape = tuple(int(s) for s in w.shape)
        return [digest], QuantMeta("none", LAYOUT_MKLDNN_PACKED, None, (shape[0], shape[1]), desc.hex())
    if step.how == "int4":
        assert step.meta is not None
        by_part = {e.part: e for e in step.source}
        qweight = repack_int4_canonical(view_tensor(src, by_part["qweight"]), step.meta.layout, step.meta.shape)
        parts = {"qweight": qweight, "scales_and_zeros": torch.stack(
            (view_tensor(src, by_part["scales"]).t(), view_tensor(src, by_part["zeros"]).t()), dim=-1)}
        out = []
        for e in step.entries:
            view = tensor_bytes(parts[e.part].contiguous())
            write(e, view)
            out.append(leaf_digest(view, pm.arena_digest_scheme))
        return out, step.meta
    out = []
    for s, e in zip(step.source, step.entries, strict=True):
        view = tensor_bytes(tensor_byte_view(src, s))
        write(e, view)
        out.append(leaf_digest(view, pm.arena_digest_scheme))
    return out, step.meta


def from_portable(pm: ArenaManifest, src: torch.Tensor, steps: list[Step], write: Write, device: str,
                  threads: int = 2, progress: Callable[[int], None] | None = None) -> ArenaManifest:
    """Build this machine's arena from the portable bytes ``src`` (already checked against ``pm``) by ``steps``
    (:func:`plan_machine`), each part handed to ``write``; returns the machine arena's manifest (same fingerprint,
    its own arena_digest)."""
    def one(step: Step) -> tuple[list[str], QuantMeta | None]:
        made = _make(step, pm, src, write)
        if progress is not None:
            progress(sum(e.nbytes for e in step.entries))
        return made

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        results = list(pool.map(one, steps))
    quant = {s.weight: meta.to_dict() for s, (_, meta) in zip(steps, results, strict=True) if meta is not None}
    entries = tuple(e for s in steps for e in s.entries)
    total = max((e.offset + e.nbytes for e in entries), default=0)
    return replace(pm, device=device, tensors=entries, quant=quant, total_bytes=total,
                   arena_digest=combine_digests("arena", [d for digests, _ in results for d in digests]))


def pm_of(text: str) -> ArenaManifest:
    """A portable manifest from JSON; refused unless its device is ``portable``."""
    pm = ArenaManifest.from_json(text)
    if pm.device != PORTABLE_DEVICE:
        raise PortableError("bad_image", f"the portable manifest of {pm.model_name} names device {pm.device!r}, not "
                                         f"{PORTABLE_DEVICE!r}")
    return pm
