"""Load jobs: making a model resident off the socket loop, one thread per job.

One job type for both ways in: ``preload`` (read the checkpoint, quantize, pack into a new arena; for N
tensor-parallel ranks, N shard arenas in the same pass: :mod:`keepwarm.weights.shards`) and ``load_image`` (copy a
snapshot's arena image into a new arena and check its digest; nothing is re-quantized). The socket loop
creates a job, adds every request waiting on the same key to ``waiters``, forwards progress (``bytes_done``) and,
once ``done`` is set, makes ``result`` resident and answers the waiters (``error`` is their answer on failure).

Rules: a job thread touches only its own job and the arena files it creates; on failure (a refusal, a read or
write error such as ENOSPC, an exception in the quantizer, a corrupt image) every one of them is removed before
``done`` is set, so the failure leaves no status entry and nothing a restarted daemon would re-adopt. Only the
socket loop touches residency, leases and the job table.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keepwarm.daemon.image import ImageError, check_cpu_layouts, check_gaps_zero, fill_cpu, fill_cuda, image_size
from keepwarm.daemon.residency import Residency, Resident
from keepwarm.formats import paths
from keepwarm.formats.arena import ArenaManifest, CpuArenaFile, CudaArena, arena_digest_of, pwrite_all
from keepwarm.formats.errors import QuantizationError
from keepwarm.formats.layout import describe_sizes
from keepwarm.formats.model_config import ModelConfigError
from keepwarm.formats.wire import ProtocolError
from keepwarm.kernels.cpu_malloc import release_freed_memory
from keepwarm.weights.checkpoint import Checkpoint
from keepwarm.weights.loader import build_arena, plan_arena, resolve_dtype
from keepwarm.weights.portable import PortableError, from_portable, plan_machine
from keepwarm.weights.sharding import TensorParallelError
from keepwarm.weights.shards import build_shards

log = logging.getLogger("keepwarm.daemon")

JobKey = tuple[str, str, str, int, int]  # (model, quantization or "image:<fingerprint>", dtype, tp size, pp size)
Waiter = tuple[bytes, str, str, Any]  # (socket identity, request id, verb, args)


@dataclass
class LoadJob:
    key: JobKey
    kind: str  # "preload" | "image"
    what: str  # for logs and errors: "preload of <dir>", "loading the image <path>"
    quantization: str
    total_bytes: int  # bytes to read or copy (progress)
    arena_bytes: int  # size of the arena being built (memory budget)
    work: Callable[[LoadJob], list[Resident]]  # in the job's thread (one arena, or one per rank); records what
    # it creates in `created` and `created_files`
    started: float = field(default_factory=time.monotonic)
    bytes_done: int = 0
    waiters: list[Waiter] = field(default_factory=list)
    result: list[Resident] | None = None
    error: ProtocolError | None = None
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    created: tuple[CpuArenaFile | CudaArena | None, Path | None] = (None, None)  # (storage, temporary file)
    created_files: list[Path] = field(default_factory=list)  # shard arenas (and manifests) to remove on failure

    def add_bytes(self, n: int) -> None:
        with self.lock:
            self.bytes_done += n

    def start(self, thread_name: str, on_end: Callable[[], None]) -> None:
        threading.Thread(target=self._run, args=(on_end,), name=thread_name, daemon=True).start()

    def _run(self, on_end: Callable[[], None]) -> None:
        try:
            self.result = self.work(self)
        except ProtocolError as e:
            self.error = e
        except (ImageError, PortableError) as e:
            self.error = ProtocolError(e.code, e.message)
        except (QuantizationError, ModelConfigError, TensorParallelError) as e:  # one line, nothing resident
            log.info("%s refused: %s", self.what, e)
            self.error = ProtocolError(load_error_code(e), str(e))
        except Exception as e:
            log.error("%s failed: %s\n%s", self.what, e, traceback.format_exc())
            self.error = ProtocolError("load_failed", f"{self.what} failed: {e}")
        finally:
            if self.error is not None:  # remove what the failed job built
                storage, tmp = self.created
                if isinstance(storage, CpuArenaFile):
                    storage.close()
                    storage.unlink()
                if tmp is not None:
                    tmp.unlink(missing_ok=True)
                for f in self.created_files:
                    f.unlink(missing_ok=True)
            release_freed_memory()  # the load's scratch back to the kernel: between loads the daemon holds arenas
            self.done.set()
            on_end()


def load_error_code(e: Exception) -> str:
    """The protocol code of a refusal the checkpoint causes: its quantization, its model, or its sharding."""
    if isinstance(e, QuantizationError):
        return "bad_quantization"
    return "tensor_parallel" if isinstance(e, TensorParallelError) else "bad_model"


def preload_job(key: JobKey, ckpt: Checkpoint, dtype: str, arena_bytes: int, fingerprint: str | None,
                residency: Residency, device_name: str) -> LoadJob:
    """Read ``ckpt``, quantize and pack it into a new arena (``fingerprint``: what it must turn out to be)."""
    def work(job: LoadJob) -> list[Resident]:
        t0 = time.perf_counter()
        target = resolve_dtype(ckpt, dtype)
        planned, total = plan_arena(ckpt, job.quantization, target, residency.device.type)
        storage: CpuArenaFile | CudaArena
        if residency.device.type == "cpu":
            tmp = residency.arena_dir / f".building-{secrets.token_hex(6)}.arena"
            # build_arena writes every tensor with pwrite (ENOSPC on a full tmpfs) and reserves the pages of those it
            # reads straight into the mapping: no zeroing pass over the whole file first (0.23 s for 1 GB)
            storage = CpuArenaFile.create(tmp, total, reserve=False)
            job.created = (storage, tmp)
        else:
            storage = CudaArena.create(total, residency.device)
            job.created = (storage, None)
        manifest = build_arena(ckpt, job.quantization, dtype, storage.flat, device_name,
                               progress=job.add_bytes, threads=residency.threads, planned=planned,
                               arena_file=storage.path if isinstance(storage, CpuArenaFile) else None)
        if fingerprint and manifest.fingerprint != fingerprint:
            raise ProtocolError("fingerprint_mismatch", f"{ckpt.model_dir.name} on disk has fingerprint "
                                                        f"{manifest.fingerprint[:16]}, not {fingerprint[:16]}")
        mpath = None
        if isinstance(storage, CpuArenaFile):
            storage, mpath = residency.install_cpu_arena(storage, manifest)
            job.created = (storage, job.created[1])
        seconds = time.perf_counter() - t0
        log.info("preloaded %s (%s, %s): %.1f MB read, %.1f MB arena in %.2fs (%.2f GB/s), fingerprint %s",
                 ckpt.model_dir.name, job.quantization, manifest.dtype, job.total_bytes / 1e6,
                 manifest.total_bytes / 1e6, seconds, job.total_bytes / max(seconds, 1e-9) / 1e9,
                 manifest.fingerprint[:16])
        now = time.time()
        return [Resident(manifest, storage, "preload", now, seconds, now, mpath, source_bytes=job.total_bytes)]

    return LoadJob(key, "preload", f"preload of {ckpt.model_dir}", key[1], ckpt.nbytes, arena_bytes, work)


def shard_job(key: JobKey, ckpt: Checkpoint, dtype: str, arena_bytes: int, fingerprint: str | None,
              residency: Residency) -> LoadJob:
    """Read ``ckpt`` once and build one shard arena per pipeline stage and tensor-parallel rank (``key[3]`` ranks,
    ``key[4]`` stages); ``fingerprint``: what the whole model must turn out to be."""
    tp_size, pp_size = key[3], key[4]
    split = describe_sizes(tp_size, pp_size)

    def work(job: LoadJob) -> list[Resident]:
        t0 = time.perf_counter()
        built = build_shards(ckpt, job.quantization, dtype, tp_size, pp_size, residency.arena_dir, job.add_bytes,
                             residency.threads, on_created=job.created_files.extend)
        source = built[0][1].source_fingerprint
        if fingerprint and source != fingerprint:
            raise ProtocolError("fingerprint_mismatch", f"{ckpt.model_dir.name} on disk has fingerprint "
                                                        f"{source[:16]}, not {fingerprint[:16]}")
        seconds = time.perf_counter() - t0
        now = time.time()
        residents: list[Resident] = []
        for storage, manifest in built:
            storage, mpath = residency.install_cpu_arena(storage, manifest)
            job.created_files += [storage.path] + ([mpath] if mpath is not None else [])
            residents.append(Resident(manifest, storage, "preload", now, seconds, now, mpath,
                                      source_bytes=job.total_bytes if not residents else 0))
        log.info("preloaded %s (%s, %s) as %s: %.1f MB read, %.1f MB in %.2fs, fingerprint %s", ckpt.model_dir.name,
                 job.quantization, built[0][1].dtype, split, job.total_bytes / 1e6,
                 sum(m.total_bytes for _, m in built) / 1e6, seconds, source[:16])
        return residents

    return LoadJob(key, "preload", f"preload of {ckpt.model_dir} as {split}", key[1], ckpt.nbytes, arena_bytes, work)


def _check_image(image: Path, sha256: str | None, file_digest: str | None, arena_digest: str,
                 m: ArenaManifest) -> None:
    if sha256 is not None and file_digest != sha256:
        raise ProtocolError("bad_image", f"the image {image} is corrupt: it hashes to {file_digest}, not {sha256}")
    if arena_digest != m.arena_digest:
        raise ProtocolError("bad_image", f"the image {image} does not match its manifest's arena_digest (corrupt or "
                                         "not this model's image)")


def image_job(key: JobKey, manifest: ArenaManifest, image: Path, arena_bytes: int,
              residency: Residency, sha256: str | None = None, origin: str = "image") -> LoadJob:
    """Copy the arena image at ``image`` into a new arena and check it against ``manifest`` (and, given
    ``sha256``, the file against that digest), hashing each chunk as it lands: one pass over the bytes."""
    def work(job: LoadJob) -> list[Resident]:
        t0 = time.perf_counter()
        m = manifest
        storage: CpuArenaFile | CudaArena
        if residency.device.type == "cpu":
            paths.ensure_private_dir(residency.arena_dir)
            tmp = residency.arena_dir / f".image-{secrets.token_hex(6)}.arena"
            storage = CpuArenaFile.create(tmp, arena_bytes, reserve=False)  # fill_cpu writes every byte
            job.created = (storage, tmp)
            with ThreadPoolExecutor(max_workers=1) as pool:
                # the layout check may pack zero weights (1 s for the 1B where this CPU's layouts file lacks them)
                # while the image streams in; an image this CPU cannot use is refused as that, first
                layouts = pool.submit(check_cpu_layouts, m)
                try:
                    file_digest, arena_digest = fill_cpu(storage, image, arena_bytes, m, sha256 is not None,
                                                         job.add_bytes)
                finally:
                    layouts.result()
            _check_image(image, sha256, file_digest, arena_digest, m)
            check_gaps_zero(storage, m, arena_bytes, image)
            storage, mpath = residency.install_cpu_arena(storage, m)
            job.created = (storage, tmp)
        else:
            mpath = None
            storage = CudaArena.create(arena_bytes, residency.device)
            job.created = (storage, None)
            fill_cuda(storage, image, image_size(m, image), m, residency.threads, job.add_bytes, sha256)
        seconds = time.perf_counter() - t0
        log.info("loaded the image of %s (%s, %s): %.1f MB in %.2fs (%.2f GB/s), fingerprint %s", m.model_name,
                 m.quantization, m.dtype, arena_bytes / 1e6, seconds,
                 arena_bytes / max(seconds, 1e-9) / 1e9, m.fingerprint[:16])
        now = time.time()
        return [Resident(m, storage, origin, now, seconds, now, mpath, source_bytes=arena_bytes)]

    return LoadJob(key, "image", f"loading the image {image}", manifest.quantization, arena_bytes, arena_bytes, work)


def portable_job(key: JobKey, pm: ArenaManifest, image: Path, size: int, residency: Residency,
                 device_name: str) -> LoadJob:
    """Build this CPU's arena from a snapshot's portable layer at ``image`` (``pm``: its manifest): every weight
    re-packed into this machine's layout or copied (never re-quantized), while a second thread checks the layer's
    bytes against ``pm.arena_digest``; nothing is installed unless they match (keepwarm.weights.portable)."""
    def work(job: LoadJob) -> list[Resident]:
        t0 = time.perf_counter()
        steps = plan_machine(pm, residency.device)
        job.arena_bytes = max((e.offset + e.nbytes for s in steps for e in s.entries), default=0)
        paths.ensure_private_dir(residency.arena_dir)
        src = CpuArenaFile.open_readonly(image, size)
        tmp = residency.arena_dir / f".portable-{secrets.token_hex(6)}.arena"
        storage = CpuArenaFile.create(tmp, max(job.arena_bytes, 1), reserve=False)  # every part written by pwrite
        job.created = (storage, tmp)
        fd = os.open(tmp, os.O_WRONLY)
        try:
            with ThreadPoolExecutor(max_workers=1) as pool:
                check = pool.submit(arena_digest_of, src.flat, pm.tensors, 1, pm.arena_digest_scheme)
                m = from_portable(pm, src.flat, steps, lambda e, view: pwrite_all(fd, view, e.offset), device_name,
                                  residency.threads, job.add_bytes)
                digest = check.result()
            if digest != pm.arena_digest:
                raise ImageError("bad_image", f"the portable layer {image} does not match its manifest's "
                                              "arena_digest; nothing loaded")
            check_gaps_zero(src, pm, size, image)
        finally:
            os.close(fd)
            src.close()
        storage, mpath = residency.install_cpu_arena(storage, m)
        job.created = (storage, tmp)
        seconds = time.perf_counter() - t0
        repacked = sum(s.how != "copy" for s in steps)
        log.info("built the arena of %s (%s, %s) from its portable layer: %d weights re-packed for this machine, "
                 "none re-quantized, %.1f MB in %.2fs, fingerprint %s", m.model_name, m.quantization, m.dtype,
                 repacked, job.arena_bytes / 1e6, seconds, m.fingerprint[:16])
        now = time.time()
        return [Resident(m, storage, "portable", now, seconds, now, mpath, source_bytes=size)]

    return LoadJob(key, "image", f"building {pm.model_name} from the portable layer {image}", pm.quantization, size,
                   size, work)
