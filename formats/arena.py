"""The arena: one contiguous buffer per resident model, and the manifest that maps tensors into it.

Every tensor (plain weights, and each part of a quantized weight) sits at an offset aligned to ``ALIGN`` bytes, in
the order of the checkpoint's fusion plan. The manifest (JSON) names each tensor's offset, dtype and shape, the
quantization metadata, the model's config files, and two digests (in full: docs/architecture.md, "Data path"):
- ``fingerprint``: sha256 over the checkpoint's tensor bytes as read from disk (per-part digests, in plan
  order), the quantization scheme, the dtype and ``LAYOUT_VERSION``. It identifies *what* is resident.
- ``arena_digest``: a tree hash of the arena's own bytes, one leaf per entry (``arena_digest_scheme``: BLAKE3
  leaves now, sha256 in older arenas and images; both are checked, any other scheme is refused naming it), fed
  chunk by chunk as bytes are read or copied (:class:`ArenaHasher`), so no one re-reads an arena to hash it. A
  restarted daemon re-adopts an arena only when its bytes still hash to this.

CPU arenas are files in a 0700 tmpfs directory, mapped read-only by workers. CUDA arenas are one device
allocation exported as one IPC handle (see ``CudaArena``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from blake3 import blake3

from keepwarm.formats.layout import Layout

LAYOUT_VERSION = 1
ARENA_DIGEST_SCHEME = "blake3-tensors"  # what new arenas are hashed with (module docstring)
LEGACY_ARENA_DIGEST_SCHEME = "sha256-tensors"  # manifests written before the field existed
# 256 bytes: covers every dtype's alignment, AVX-512 loads and GPU coalescing, at negligible padding cost.
ALIGN = 256

_DTYPE_NAMES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int8: "int8",
    torch.uint8: "uint8", torch.int32: "int32", torch.int64: "int64", torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2", torch.bool: "bool", torch.float64: "float64", torch.int16: "int16",
}
_NAME_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    return _NAME_DTYPES[name]


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in the arena. ``weight`` is the model's weight name; ``part`` is "" for a plain tensor, else
    the part of a quantized weight (``qweight``, ``scales``, ...)."""

    weight: str
    part: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ArenaManifest:
    layout_version: int
    fingerprint: str
    arena_digest: str
    model: str  # the source directory, resolved
    quantization: str
    dtype: str
    device: str  # "cpu" or "cuda:<GPU UUID>"
    total_bytes: int
    tensors: tuple[TensorEntry, ...]
    quant: dict[str, dict[str, Any]]  # weight name -> QuantMeta as a dict
    config_json: str  # config.json as read, so a worker needs no access to the model directory for it
    generation_config_json: str | None
    source_files: tuple[tuple[str, int, int, int], ...]  # (file name, size, mtime_ns, inode): on-disk changes
    created_at: float = field(default_factory=time.time)
    keepwarm_version: str = ""
    arena_digest_scheme: str = ARENA_DIGEST_SCHEME
    # A shard holds tensor-parallel rank ``tp_rank``'s part (of ``tp_size``) of pipeline stage ``pp_stage``'s weights
    # (of ``pp_size``), by the rules of ``keepwarm.weights.sharding``; ``source_fingerprint`` is then the whole
    # model's fingerprint, and ``fingerprint`` is :func:`shard_fingerprint` of it. A whole arena: 0, 1, 0, 1, "".
    tp_rank: int = 0
    tp_size: int = 1
    source_fingerprint: str = ""
    pp_stage: int = 0
    pp_size: int = 1

    @property
    def model_name(self) -> str:
        return Path(self.model).name

    @property
    def layout(self) -> Layout:
        return Layout(self.tp_rank, self.tp_size, self.pp_stage, self.pp_size)

    @property
    def model_fingerprint(self) -> str:
        """The whole model's fingerprint: a shard's source, else the arena's own."""
        return self.source_fingerprint or self.fingerprint

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ArenaManifest:
        d = json.loads(text)
        if d.get("layout_version") != LAYOUT_VERSION:
            raise ValueError(f"arena layout version {d.get('layout_version')!r}, expected {LAYOUT_VERSION}")
        scheme = d.setdefault("arena_digest_scheme", LEGACY_ARENA_DIGEST_SCHEME)
        if scheme not in _LEAF_HASHES:
            raise ValueError(f"arena digest scheme {scheme!r}: this keepwarm checks {', '.join(_LEAF_HASHES)} "
                             "(upgrade keepwarm)")
        d["tensors"] = tuple(TensorEntry(**{**t, "shape": tuple(t["shape"])}) for t in d["tensors"])
        d["source_files"] = tuple(tuple(x) for x in d["source_files"])
        return cls(**d)

    def entries_by_weight(self) -> dict[str, list[TensorEntry]]:
        out: dict[str, list[TensorEntry]] = {}
        for t in self.tensors:
            out.setdefault(t.weight, []).append(t)
        return out


def source_signature(model_dir: Path, files: list[Path]) -> tuple[tuple[str, int, int, int], ...]:
    """Size, mtime and inode of every weight file and config.json: a cheap check that the checkpoint did not
    change since preload (a rewrite or a replacement changes mtime or inode). A GGUF `model_dir` is the file."""
    single = model_dir.suffix == ".gguf" and not model_dir.is_dir()
    base = model_dir.parent if single else model_dir
    names = sorted({f.name for f in files} | (set() if single else {"config.json"}))
    sig = []
    for name in names:
        st = (base / name).stat()
        sig.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sig)


def _blake3() -> Any:
    return blake3()  # one thread: entries and chunks are hashed on the caller's threads (it releases the GIL)


_LEAF_HASHES: dict[str, Callable[[], Any]] = {"blake3-tensors": _blake3, "sha256-tensors": hashlib.sha256}


def leaf_hasher(scheme: str = ARENA_DIGEST_SCHEME) -> Any:
    """A new hashlib-style hasher for one arena entry's bytes under ``scheme`` (update / hexdigest)."""
    try:
        return _LEAF_HASHES[scheme]()
    except KeyError:
        raise ValueError(f"arena digest scheme {scheme!r} is not one this keepwarm knows") from None


def leaf_digest(data: Any, scheme: str = ARENA_DIGEST_SCHEME) -> str:
    """One arena entry's leaf digest (hex) of ``data`` (a buffer: bytes, memoryview) under ``scheme``."""
    h = leaf_hasher(scheme)
    h.update(data)
    return h.hexdigest()


def combine_digests(label: str, digests: list[str]) -> str:
    h = hashlib.sha256(label.encode())
    for d in digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


# config.json keys that do not change what the model computes.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_model_name_or_path", "torch_dtype", "dtype",
                         "use_cache")


def canonical_config(config_json: str) -> str:
    cfg = json.loads(config_json)
    return json.dumps({k: v for k, v in cfg.items() if k not in _VOLATILE_CONFIG_KEYS}, sort_keys=True)


def fingerprint_of(quantization: str, dtype: str, part_digests: list[tuple[str, str]], config_json: str) -> str:
    """``part_digests``: (fused tensor name, sha256 of one source part's bytes), in plan order. The model's
    config (architecture, rope, ...) is part of it: identical weights under another config compute otherwise."""
    h = hashlib.sha256(f"keepwarm-arena-v{LAYOUT_VERSION}|{quantization}|{dtype}|".encode())
    h.update(canonical_config(config_json).encode())
    for name, digest in part_digests:
        h.update(name.encode() + b"\0" + bytes.fromhex(digest))
    return h.hexdigest()


def shard_fingerprint(model_fingerprint: str, layout: Layout) -> str:
    """The fingerprint of the ``layout`` part of the model whose fingerprint is ``model_fingerprint``."""
    text = f"keepwarm-shard-v{LAYOUT_VERSION}|{model_fingerprint}|{layout.tp_rank}/{layout.tp_size}"
    if layout.pp_size > 1:
        text += f"|stage {layout.pp_stage}/{layout.pp_size}"
    return hashlib.sha256(text.encode()).hexdigest()


def tensor_byte_view(flat: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    return flat[entry.offset:entry.offset + entry.nbytes]


def view_tensor(flat: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """A typed, shaped view of one entry inside the arena's flat uint8 buffer (no copy)."""
    raw = tensor_byte_view(flat, entry)
    return raw.view(dtype_from_name(entry.dtype)).view(entry.shape)


def arena_digest_of(flat: torch.Tensor, entries: tuple[TensorEntry, ...], threads: int = 4,
                    scheme: str = ARENA_DIGEST_SCHEME) -> str:
    """The arena digest of ``flat`` under ``scheme``, per entry (both hashes release the GIL, so entries hash in
    parallel)."""
    def one(e: TensorEntry) -> str:
        return leaf_digest(memoryview(tensor_byte_view(flat, e).numpy()), scheme)

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return combine_digests("arena", list(pool.map(one, entries)))


class ArenaHasher:
    """The arena digest of bytes arriving in order (a copy into the store, an image into an arena): each chunk's
    slices go to the leaf hash of every entry they cover while the chunk is in cache; nothing is read twice."""

    def __init__(self, entries: tuple[TensorEntry, ...], scheme: str = ARENA_DIGEST_SCHEME) -> None:
        self.entries = entries
        self.hashers = [leaf_hasher(scheme) for _ in entries]
        self.order = sorted(range(len(entries)), key=lambda i: entries[i].offset)
        self.next = 0  # in ``order``: entries before it are complete

    def feed(self, offset: int, chunk: memoryview) -> None:
        end = offset + len(chunk)
        j = self.next
        while j < len(self.order) and self.entries[self.order[j]].offset < end:
            i = self.order[j]
            e = self.entries[i]
            lo, hi = max(offset, e.offset), min(end, e.offset + e.nbytes)
            if hi > lo:
                self.hashers[i].update(chunk[lo - offset:hi - offset])
            j += 1
        while self.next < len(self.order) and sum(self._span(self.order[self.next])) <= end:
            self.next += 1

    def _span(self, i: int) -> tuple[int, int]:
        return self.entries[i].offset, self.entries[i].nbytes

    def hexdigest(self) -> str:
        return combine_digests("arena", [h.hexdigest() for h in self.hashers])


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd`` (a tmpfs arena file: no page faults, unlike a mapping's first
    write to each page)."""
    while data:
        n = os.pwrite(fd, data, offset)
        if n <= 0:  # no progress: an error, not a loop
            raise OSError(f"pwrite wrote nothing at offset {offset} ({len(data)} bytes left)")
        data, offset = data[n:], offset + n


# -- CPU storage ---------------------------------------------------------------------------------------------------
class CpuArenaFile:
    """An arena in a tmpfs file. The daemon writes it once through a shared writable mapping, then keeps only a
    read-only mapping; workers map it read-only (PROT_READ), so a stray write faults instead of corrupting it."""

    def __init__(self, path: Path, size: int, mapping: mmap.mmap, writable: bool) -> None:
        self.path = path
        self.size = size
        self._mmap = mapping
        self.writable = writable
        self.flat = _tensor_over(mapping, size)

    @classmethod
    def create(cls, path: Path, size: int, reserve: bool = True) -> CpuArenaFile:
        """A new arena file of ``size`` bytes, mapped writable. ``reserve``: allocate (and zero) its tmpfs pages now,
        so a full tmpfs fails here and not as a SIGBUS on a write through the mapping; a caller that fills every
        byte with ``pwrite`` (which fails with ENOSPC instead) passes False and skips the zeroing."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if reserve:
                os.posix_fallocate(fd, 0, max(size, 1))
            else:
                os.ftruncate(fd, max(size, 1))
            mapping = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return cls(path, size, mapping, writable=True)

    @classmethod
    def open_readonly(cls, path: Path, size: int, populate: bool = False) -> CpuArenaFile:
        """Map read-only. ``populate`` (the daemon) maps every page now: the daemon then holds each page, so a
        worker's mapping of it is shared (not private) memory in the worker's accounting (USS/PSS)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise ValueError(f"arena {path} has {actual} bytes, manifest says {size}")
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            mapping = mmap.mmap(fd, max(size, 1), flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(path, size, mapping, writable=False)

    def seal(self) -> CpuArenaFile:
        """Swap the writable mapping for a read-only one (the daemon's steady state)."""
        self._mmap.flush()
        sealed = CpuArenaFile.open_readonly(self.path, self.size, populate=True)
        self.close()
        return sealed

    def close(self) -> None:
        self.flat = None  # type: ignore[assignment]
        # BufferError: views are still exported (someone holds tensors); the mapping goes when they do.
        with contextlib.suppress(BufferError):
            self._mmap.close()

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


def _tensor_over(mapping: mmap.mmap, size: int) -> torch.Tensor:
    with warnings.catch_warnings():
        # torch warns that a read-only buffer yields a tensor it believes writable; PROT_READ enforces it.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8, count=size) if size else torch.empty(0, dtype=torch.uint8)


# -- CUDA storage --------------------------------------------------------------------------------------------------
def cuda_device_by_uuid(uuid: str | None) -> torch.device:
    """The CUDA device whose UUID is ``uuid`` (indices change with CUDA_VISIBLE_DEVICES; UUIDs do not)."""
    if uuid is None:
        return torch.device("cuda", torch.cuda.current_device())
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid.removeprefix("GPU-"):
            return torch.device("cuda", i)
    raise ValueError(f"no CUDA device with UUID {uuid}")


def cuda_uuid(device: torch.device) -> str:
    return "GPU-" + str(torch.cuda.get_device_properties(device).uuid)


class CudaArena:
    """One device allocation holding the whole arena, shared with workers through one CUDA IPC handle.

    The handle is ``storage._share_cuda_()``'s fields sent as plain data (bytes and ints, no pickle); the worker
    rebuilds the storage with ``torch.UntypedStorage._new_shared_cuda``. The daemon keeps ``flat`` alive for as
    long as the model is resident.
    """

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.size = flat.numel()

    @classmethod
    def create(cls, size: int, device: torch.device) -> CudaArena:
        return cls(torch.empty(max(size, 1), dtype=torch.uint8, device=device)[:size])

    def export_handle(self) -> dict[str, Any]:
        storage = self.flat.untyped_storage()
        (dev, handle, storage_size, storage_offset, ref_handle, ref_offset, event_handle,
         event_sync) = storage._share_cuda_()
        return {"device": int(dev), "uuid": cuda_uuid(self.flat.device), "handle": bytes(handle),
                "storage_size": int(storage_size), "storage_offset": int(storage_offset),
                "ref_counter_handle": bytes(ref_handle), "ref_counter_offset": int(ref_offset),
                "event_handle": bytes(event_handle) if event_handle else b"", "event_sync_required": bool(event_sync),
                "size": self.size}

    @staticmethod
    def import_handle(h: dict[str, Any]) -> torch.Tensor:
        torch.cuda._lazy_init()  # torch's own IPC rebuild does this first; in a worker this is the first CUDA call
        device = cuda_device_by_uuid(h["uuid"])
        with torch.cuda.device(device):
            storage = torch.UntypedStorage._new_shared_cuda(
                device.index, h["handle"], h["storage_size"], h["storage_offset"], h["ref_counter_handle"],
                h["ref_counter_offset"], h["event_handle"] or None, h["event_sync_required"])
        flat = torch.empty(0, dtype=torch.uint8, device=device)
        flat.set_(storage, 0, (storage.nbytes(),))
        return flat[: h["size"]]


def iter_manifest_files(directory: Path) -> Iterator[Path]:
    yield from sorted(directory.glob("*.json"))
