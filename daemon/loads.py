"""The daemon's loads in flight: one job per key, the requests waiting on it, their progress and their outcome.

Rules:
- One job per key (model, quantization or image, dtype, split) however many requests ask for it; a request whose
  arena is resident is answered at once, any other waits on the job that builds it (``LoadJob.waiters``).
- What can be refused without reading a tensor is refused before a job starts: the model's config and
  quantization, the tensor-parallel and pipeline split, the image's device and size, the memory budget.
- A job thread ends by writing to ``wake_fd``, waking the socket loop; the loop then takes ``finished()``: the
  job's arenas made resident and, for each waiter, its own (stage, rank)'s arena or the job's error.
Touched only by the socket loop; job threads touch their own job (keepwarm.daemon.jobs).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from keepwarm.daemon.image import ImageError, check_device, image_size
from keepwarm.daemon.jobs import (
    JobKey,
    LoadJob,
    Waiter,
    image_job,
    load_error_code,
    portable_job,
    preload_job,
    shard_job,
)
from keepwarm.daemon.protocol import event
from keepwarm.daemon.residency import WHOLE, Residency, Resident
from keepwarm.formats.arena import ArenaManifest, dtype_name
from keepwarm.formats.errors import QuantizationError
from keepwarm.formats.layout import Layout, describe_sizes
from keepwarm.formats.model_config import ModelConfigError
from keepwarm.formats.wire import ProtocolError
from keepwarm.weights.checkpoint import Checkpoint
from keepwarm.weights.loader import plan_arena, resolve_dtype
from keepwarm.weights.portable import needs_repack
from keepwarm.weights.sharding import TensorParallelError, check_pipeline, check_supported

ModelKey = tuple[str, str, str]  # (model directory, quantization, dtype), resolved


def resolve_model(model: str, quantization: str, dtype: str) -> tuple[Checkpoint, ModelKey]:
    """The checkpoint and its resident key; ProtocolError ``bad_quantization`` / ``bad_model`` naming why not."""
    try:
        ckpt = Checkpoint(model)
        quantization = ckpt.resolve_quantization(quantization)
        target = resolve_dtype(ckpt, dtype)
    except (QuantizationError, ModelConfigError) as e:
        code = "bad_quantization" if isinstance(e, QuantizationError) else "bad_model"
        raise ProtocolError(code, str(e)) from None
    return ckpt, (str(ckpt.model_dir), quantization, dtype_name(target))


def waiter_arena(made: list[Resident], args: Any) -> Resident:
    """The arena a waiter asked for: a shard job's waiters each get their (stage, rank)'s, a preload's the first."""
    if len(made) == 1:
        return made[0]
    want = (getattr(args, "pp_stage", 0), getattr(args, "tp_rank", 0))
    return next(x for x in made if (x.manifest.pp_stage, x.manifest.tp_rank) == want)


class Loads:
    """The load jobs by key, on one daemon's residency."""

    def __init__(self, residency: Residency, device_name: str) -> None:
        self.residency = residency
        self.device = residency.device
        self.device_name = device_name
        self.jobs: dict[JobKey, LoadJob] = {}
        # A job thread writes a byte here when it ends, waking the socket loop at once.
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)

    def building_bytes(self) -> int:
        """The arenas jobs are building (the memory budget counts them)."""
        return sum(j.arena_bytes for j in self.jobs.values())

    def load_or_wait(self, waiter: Waiter, model: str, quantization: str, dtype: str, fingerprint: str | None,
                     layout: Layout = WHOLE) -> Resident | None:
        """The resident arena (a split ``layout``: that shard), or None: ``waiter`` waits on the job building it."""
        if fingerprint:
            r = self.residency.find(("", "", ""), fingerprint, layout)
            if r is not None:
                return r
        try:
            ckpt, model_key = resolve_model(model, quantization, dtype)
        except ProtocolError as e:  # e.g. a restored snapshot's directory: the weights exist only as its arenas
            other = self._resident_layouts(fingerprint) if fingerprint else ""
            if e.code != "bad_model" or not other or not fingerprint:
                raise
            wanted = "one arena" if layout.whole else f"the shard of {layout}"
            raise ProtocolError("tensor_parallel", f"{Path(model).name} (fingerprint {fingerprint[:16]}) is "
                                                   f"resident as {other}, not as {wanted}, and its checkpoint cannot "
                                                   f"be read to cut that ({e.message}); serve it with the "
                                                   "tensor-parallel size it was preloaded or snapshotted with"
                                ) from None
        r = self.residency.find(model_key, fingerprint, layout)
        if r is not None:
            return r
        key: JobKey = (*model_key, *layout.sizes)
        job = self.jobs.get(key)
        if job is None:
            try:
                _, total = plan_arena(ckpt, key[1], resolve_dtype(ckpt, dtype), self.device.type)
                if layout.tp_size > 1:
                    check_supported(ckpt.config, layout.tp_size)
                check_pipeline(ckpt.config, layout.pp_size)
            except (QuantizationError, ModelConfigError, TensorParallelError) as e:
                raise ProtocolError(load_error_code(e), str(e)) from None
            self.residency.make_room(total, ckpt.model_dir.name)
            if not layout.whole:
                job = shard_job(key, ckpt, dtype, total, fingerprint, self.residency)
            else:
                job = preload_job(key, ckpt, dtype, total, fingerprint, self.residency, self.device_name)
            self._start(key, job, f"preload-{ckpt.model_dir.name}")
        job.waiters.append(waiter)
        return None

    def _resident_layouts(self, fingerprint: str) -> str:
        """How the model of ``fingerprint`` is resident ("one arena", "2 tensor-parallel shards"), or ""."""
        sizes = sorted({r.manifest.layout.sizes for r in self.residency.residents.values()
                        if r.manifest.model_fingerprint == fingerprint})
        return " and ".join(describe_sizes(*n) for n in sizes)

    def load_image(self, waiter: Waiter, manifest: ArenaManifest, image: Path, sha256: str | None,
                   portable: bool = False) -> None:
        """Start (or join) the job that copies ``image`` into a new arena; ``waiter`` waits on it. A ``portable``
        image is re-packed into this machine's layout (``portable_job``), or copied as an image where the portable
        layout is this machine's."""
        repack = portable and needs_repack(manifest, self.device)
        if portable and not repack:
            manifest = replace(manifest, device=self.device_name)
        try:
            if not repack:
                check_device(manifest, self.device)  # the CPU layouts are checked in the job's thread
            size = image_size(manifest, image)
        except ImageError as e:
            raise ProtocolError(e.code, e.message) from None
        key = (manifest.model, f"image:{manifest.fingerprint}", manifest.dtype, 1, 1)
        job = self.jobs.get(key)
        if job is None:
            arena_bytes = size if self.device.type == "cpu" else manifest.total_bytes
            self.residency.room_plan(arena_bytes, manifest.model_name)  # refuse now if it can never fit
            origin = "portable" if portable else "image"
            job = (portable_job(key, manifest, image, size, self.residency, self.device_name) if repack else
                   image_job(key, manifest, image, arena_bytes, self.residency, sha256, origin))
            self._start(key, job, f"image-{manifest.fingerprint[:12]}")
        job.waiters.append(waiter)

    def _start(self, key: JobKey, job: LoadJob, thread_name: str) -> None:
        self.jobs[key] = job
        job.start(thread_name, self._ended)

    def _ended(self) -> None:
        """Called by a job thread as it ends: wake the socket loop to answer its waiters at once."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def woken(self) -> None:
        """Empty the wake pipe (the loop was woken; ``finished`` says what ended)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_fd, 4096)

    def finished(self) -> list[tuple[Waiter, list[Resident], ProtocolError | None]]:
        """Every waiter of every job that ended, with the arenas made resident from it or the job's error."""
        out = []
        for key, job in list(self.jobs.items()):
            if not job.done.is_set():
                continue
            del self.jobs[key]
            made: list[Resident] = []
            try:
                for i, r in enumerate(job.result or []):
                    if job.kind == "image":
                        made.append(self.residency.add_image(r, job.arena_bytes))
                    else:
                        made.append(self.residency.add_preloaded(r, job.total_bytes, count=i == 0))
            except ProtocolError as e:  # the image no longer fits the budget (its arena is dropped)
                job.error = e
            out += [(waiter, made, job.error) for waiter in job.waiters]
        return out

    def progress(self) -> list[tuple[bytes, dict[str, Any]]]:
        """A progress event for every waiter: (its socket identity, the event)."""
        out = []
        for job in self.jobs.values():
            elapsed = round(time.monotonic() - job.started, 3)
            out += [(identity, event(rid, "progress", model=job.key[0], bytes_done=job.bytes_done,
                                     bytes_total=job.total_bytes, seconds=elapsed))
                    for identity, rid, _verb, _args in job.waiters]
        return out

    def loading(self) -> list[dict[str, Any]]:
        """The jobs as ``status`` shows them."""
        return [{"model": j.key[0], "quantization": j.quantization, "bytes_done": j.bytes_done,
                 "bytes_total": j.total_bytes} for j in self.jobs.values()]

    def wait_all(self) -> None:
        for job in self.jobs.values():
            job.done.wait()
