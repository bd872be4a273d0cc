"""Arena images: a packed arena as bytes in a file (a snapshot's blob), loaded back without re-quantizing.

An image is the arena file exactly as the daemon held it (``<fingerprint>.arena``) plus its manifest. Loading one
copies the bytes into a new arena and checks them against the manifest's ``arena_digest``; the original
checkpoint is never read. Some layouts depend on the machine that built them, so an image is refused where the
bytes would not mean the same thing:

- a CPU image on a CUDA daemon or the other way round (layouts differ per device type);
- ``mkldnn_packed`` weights (bfloat16 on CPU): oneDNN's blocked format depends on the CPU's ISA; the image's
  serialized descriptors must equal what oneDNN picks here for the same shapes;
- ``int4_cpu_*`` weights: the nibble order torch's CPU int4 pack produces here must be the image's.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from keepwarm.formats.arena import (
    ArenaHasher,
    ArenaManifest,
    CpuArenaFile,
    CudaArena,
    arena_digest_of,
    dtype_from_name,
    pwrite_all,
)
from keepwarm.formats.errors import QuantizationError
from keepwarm.formats.packed import BATCH_HINT, LEGACY_HINTS, packed_layout
from keepwarm.formats.quant import LAYOUT_MKLDNN_PACKED, QuantMeta, cpu_int4_layout

CHUNK = 1 << 20  # still in cache when hashed (see snapshot/store.py's CHUNK)


class ImageError(Exception):
    """An image this daemon cannot hold; ``code`` is the protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def image_device_type(manifest: ArenaManifest) -> str:
    return "cpu" if manifest.device == "cpu" else manifest.device.split(":", 1)[0]


def check_compatible(manifest: ArenaManifest, device: torch.device) -> None:
    """Raise ImageError (code ``incompatible_image``) when this machine cannot use the image's bytes as they are."""
    check_device(manifest, device)
    if device.type == "cpu":
        check_cpu_layouts(manifest)


def check_device(manifest: ArenaManifest, device: torch.device) -> None:
    kind = image_device_type(manifest)
    if kind != device.type:
        raise ImageError("incompatible_image", f"the image of {manifest.model_name} is a {kind} arena "
                                               f"({manifest.device}); this daemon keeps {device.type} arenas")


def check_cpu_layouts(manifest: ArenaManifest) -> None:
    """The CPU-specific layouts (oneDNN packing, torch's int4 pack) must be what this CPU and torch produce. May
    pack a zero weight per distinct shape and hint not yet in this CPU's layouts file (as planning a preload does,
    ``keepwarm.formats.packed``; the legacy hints only for a descriptor the current one does not give): run it off
    the daemon's socket loop."""
    dtype = dtype_from_name(manifest.dtype)
    known: dict[tuple[tuple[int, int], int], str] = {}  # (shape, hint) -> this CPU's descriptor

    def descriptor(shape: tuple[int, int], hint: int) -> str:
        if (shape, hint) not in known:
            try:
                known[shape, hint] = packed_layout(shape, dtype, hint)[1].hex()
            except Exception as e:  # oneDNN / shim missing, bf16 unsupported on this CPU
                raise ImageError("incompatible_image",
                                 f"the image holds oneDNN-packed {manifest.dtype} weights, which this CPU cannot "
                                 f"use ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
        return known[shape, hint]

    for weight, q in manifest.quant.items():
        try:
            meta = QuantMeta.from_dict(q)
        except QuantizationError as e:
            raise ImageError("incompatible_image", f"{weight}: {e}") from None
        if meta.layout == LAYOUT_MKLDNN_PACKED:
            if not any(meta.descriptor == descriptor(meta.shape, hint) for hint in (BATCH_HINT, *LEGACY_HINTS)):
                raise ImageError("incompatible_image",
                                 f"{weight}: the image's oneDNN packed layout differs from this CPU's (it was packed "
                                 f"on a CPU with other instruction sets); preload the model from its checkpoint here")
        elif meta.layout.startswith("int4_cpu_") and meta.layout != cpu_int4_layout():
            raise ImageError("incompatible_image", f"{weight}: the image's CPU int4 layout {meta.layout} is not this "
                                                   f"torch's ({cpu_int4_layout()})")


def image_size(manifest: ArenaManifest, path: Path) -> int:
    """The image file's size, after checking it is a regular file that holds every tensor of the manifest."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ImageError("bad_image", f"cannot read the image {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ImageError("bad_image", f"the image {path} is not a regular file")
    if st.st_size < manifest.total_bytes:
        raise ImageError("bad_image", f"the image {path} has {st.st_size} bytes; its manifest needs "
                                      f"{manifest.total_bytes}")
    return max(st.st_size, 1)


RING = 8  # chunks in flight: a buffer is read into again only once its chunk is hashed


def fill_cpu(storage: CpuArenaFile, path: Path, size: int, manifest: ArenaManifest, file_digest: bool = False,
             progress: Callable[[int], None] | None = None) -> tuple[str | None, str]:
    """Copy ``size`` bytes of the image into a CPU arena in one pass, as `cp` does: each chunk is read into one of
    RING small buffers (here), written into the arena's file (``pwrite``, a second thread: through the mapping,
    every page would first be faulted in) and, while it is in cache, fed to the arena digest (a third) and, with
    ``file_digest``, to the file's sha256 (a fourth), so the read from disk never waits for the writes or the
    hashes. Returns (the file's sha256 or None, the arena digest)."""
    hasher = ArenaHasher(manifest.tensors, manifest.arena_digest_scheme)
    h = hashlib.sha256() if file_digest else None
    bufs = [memoryview(bytearray(CHUNK)) for _ in range(RING)]
    fed: list[list[Future]] = [[] for _ in range(RING)]
    fd = os.open(storage.path, os.O_WRONLY)
    try:
        with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(max_workers=1) as writer, \
                ThreadPoolExecutor(max_workers=1) as pool, ThreadPoolExecutor(max_workers=1) as sha:
            # the whole file asynchronously now: the disk streams while the chunks already read are hashed
            os.posix_fadvise(f.fileno(), 0, size, os.POSIX_FADV_WILLNEED)
            off, slot = 0, 0
            while off < size:
                for prev in fed[slot]:  # the buffer's last chunk written and hashed: it may be read into again
                    prev.result()
                chunk = bufs[slot][:min(CHUNK, size - off)]
                n = f.readinto(chunk)
                if not n:
                    raise ImageError("bad_image", f"the image {path} ended after {off} of {size} bytes")
                fed[slot] = [writer.submit(pwrite_all, fd, chunk[:n], off), pool.submit(hasher.feed, off, chunk[:n])]
                if h is not None:
                    fed[slot].append(sha.submit(h.update, chunk[:n]))
                off, slot = off + n, (slot + 1) % RING
                if progress is not None:
                    progress(n)
            for futs in fed:
                for fut in futs:
                    fut.result()
    finally:
        os.close(fd)
    return (h.hexdigest() if h is not None else None), hasher.hexdigest()


def gaps(manifest: ArenaManifest, size: int) -> list[tuple[int, int]]:
    """The byte ranges of [0, size) no tensor of the manifest covers (alignment padding, zero in every arena the
    daemon builds: the tmpfs file starts zeroed and only tensors are written)."""
    out, at = [], 0
    for e in sorted(manifest.tensors, key=lambda t: t.offset):
        if e.offset > at:
            out.append((at, min(e.offset, size)))
        at = max(at, e.offset + e.nbytes)
    if at < size:
        out.append((at, size))
    return [(lo, hi) for lo, hi in out if hi > lo]


def check_gaps_zero(storage: CpuArenaFile, manifest: ArenaManifest, size: int, path: Path) -> None:
    """Raise ImageError (``bad_image``) unless every byte of ``storage`` (the image's bytes) between tensors is
    zero. With the arena digest over every tensor byte this pins the whole image: it is then the blob the snapshot
    names, without a second sha256 over it (on 2 cores that hash made a 2 GB restore 1.4x slower)."""
    for lo, hi in gaps(manifest, size):
        if bool(storage.flat[lo:hi].any()):
            raise ImageError("bad_image", f"the image {path} is corrupt: a byte between its tensors is not zero "
                                          f"(in {lo}..{hi})")


def fill_cuda(storage: CudaArena, path: Path, size: int, manifest: ArenaManifest, threads: int,
              progress: Callable[[int], None] | None = None, sha256: str | None = None) -> None:
    """Check the image's bytes in host memory against ``arena_digest`` (and the file against ``sha256``, a
    separate pass here), then copy them to the device."""
    src = CpuArenaFile.open_readonly(path, size)
    try:
        if sha256 is not None:
            got = hashlib.sha256(memoryview(src.flat.numpy())).hexdigest()
            if got != sha256:
                raise ImageError("bad_image", f"the image {path} is corrupt: it hashes to {got}, not {sha256}")
        if arena_digest_of(src.flat, manifest.tensors, threads, manifest.arena_digest_scheme) != manifest.arena_digest:
            raise ImageError("bad_image", f"the image {path} does not match its manifest's arena_digest")
        check_gaps_zero(src, manifest, manifest.total_bytes, path)  # as on the CPU: the two pin the image
        for off in range(0, manifest.total_bytes, CHUNK):
            end = min(off + CHUNK, manifest.total_bytes)
            storage.flat[off:end].copy_(src.flat[off:end])
            if progress is not None:
                progress(end - off)
        torch.cuda.synchronize(storage.flat.device)
    finally:
        src.close()
