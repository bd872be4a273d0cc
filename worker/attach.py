"""The worker side of the daemon: attach to a resident arena, view its tensors (no copy), keep the lease alive."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from keepwarm.daemon.client import DaemonClient, DaemonError, ProgressCallback
from keepwarm.formats.arena import (
    ArenaManifest,
    CpuArenaFile,
    CudaArena,
    dtype_from_name,
    tensor_byte_view,
    view_tensor,
)
from keepwarm.formats.layout import Layout
from keepwarm.formats.quant import LAYOUT_MKLDNN_PACKED, QuantMeta
from keepwarm.kernels.cpu_packed import PackedWeight
from keepwarm.kernels.quant import QuantizedWeight

log = logging.getLogger("keepwarm.worker")


@dataclass
class Attachment:
    """Weights viewed in place in the daemon's arena, held under a lease that a keeper process renews."""

    manifest: ArenaManifest
    tensors: dict[str, Any]
    lease_id: str
    origin: str  # how the daemon got the arena: "preload", "adopted" or "image"
    seconds: float  # request sent -> tensors viewable
    cached: bool  # the model was already resident
    storage: CpuArenaFile | torch.Tensor = field(repr=False)
    keeper: LeaseKeeper | None = field(default=None, repr=False)
    runtime_dir: Path | None = None

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.stop(detach=True)
            self.keeper = None


def model_tensors(manifest: ArenaManifest, flat: torch.Tensor) -> dict[str, Any]:
    """Weight name -> tensor view, or ``QuantizedWeight`` / ``PackedWeight`` over views, for
    ``LlamaForCausalLM.load_weights``. Nothing here writes ``flat`` (it may be a read-only mapping)."""
    out: dict[str, Any] = {}
    for weight, entries in manifest.entries_by_weight().items():
        if weight in manifest.quant:
            meta = QuantMeta.from_dict(manifest.quant[weight])
            if meta.layout == LAYOUT_MKLDNN_PACKED:
                (entry,) = entries
                # The byte view holds the arena's storage: the mapping outlives the mkldnn tensor made over it.
                out[weight] = PackedWeight(meta, tensor_byte_view(flat, entry), dtype_from_name(manifest.dtype))
                continue
            parts = {e.part: view_tensor(flat, e) for e in entries}
            out[weight] = QuantizedWeight.from_parts(meta, parts)
        else:
            (entry,) = entries
            out[weight] = view_tensor(flat, entry)
    return out


def attach_weights(model: str, quantization: str = "auto", dtype: str = "auto", fingerprint: str | None = None,
                   runtime_dir: Path | None = None, preload: bool = True, on_event: ProgressCallback | None = None,
                   keep_lease: bool = True, layout: Layout | None = None) -> Attachment:
    """Ask the daemon for ``model`` (preloading it if needed) and build views into its arena (a split ``layout``:
    into that (pipeline stage, tensor-parallel rank)'s shard arena)."""
    t0 = time.perf_counter()
    with DaemonClient(runtime_dir) as client:
        reply = client.attach(model, quantization, dtype, fingerprint, preload=preload, on_event=on_event,
                              layout=layout)
    manifest = ArenaManifest.from_json(reply.manifest)
    arena = reply.arena
    storage: CpuArenaFile | torch.Tensor
    if arena["kind"] == "cpu":
        storage = CpuArenaFile.open_readonly(Path(arena["path"]), arena["size"])
        flat = storage.flat
    else:
        flat = storage = CudaArena.import_handle(arena)
    tensors = model_tensors(manifest, flat)
    seconds = time.perf_counter() - t0
    att = Attachment(manifest, tensors, reply.lease_id, reply.origin, seconds, cached=reply.cached,
                     storage=storage, runtime_dir=runtime_dir)
    if keep_lease:
        att.keeper = LeaseKeeper(att, runtime_dir, reply.lease_ttl, quantization, dtype)
        att.keeper.start()
        # An attachment dropped without close() (an LLM never closed) stops its keeper and detaches when it is
        # collected, as the lease thread's end did before: a keeper is a process, not to be left behind.
        weakref.finalize(att, att.keeper.stop, True)
    if arena["kind"] == "cpu":  # after the keeper's start: a fork waits for the mapping lock the populate holds
        populate_in_background(flat)
    log.info("attached %s from the daemon (lease %s, fingerprint %s, %.1f MB) in %.3fs", manifest.model_name,
             att.lease_id, manifest.fingerprint[:16], manifest.total_bytes / 1e6, seconds)
    return att


MADV_POPULATE_READ = 22  # Linux 5.14+
POPULATE_STEP = 32 << 20  # a multiple of the page size


def populate_in_background(flat: torch.Tensor) -> None:
    """Map every page of the arena into this process from a thread, while the worker builds its model and app.

    A fresh process faults each page of the mapping on first touch; on the 2.2 GB 1B that is ~0.2 s of page faults
    inside the warm-up's first forward (measured: touching every page 0.20 s; MADV_POPULATE_READ 0.17 s, then
    0.01 s). Done here, it runs on another core beside the setup (ctypes drops the GIL), in 32 MiB steps: the call
    holds the process's mapping lock, which a fork or an allocation's mmap waits for. A kernel without
    MADV_POPULATE_READ just leaves the pages to fault in as before."""
    if flat.numel() == 0:
        return

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        base, size, step = flat.data_ptr(), flat.numel(), POPULATE_STEP
        for offset in range(0, size, step):
            if libc.madvise(ctypes.c_void_p(base + offset), ctypes.c_size_t(min(step, size - offset)),
                            MADV_POPULATE_READ):
                log.debug("arena populate: madvise failed (errno %d); pages fault in on first use",
                          ctypes.get_errno())
                return

    threading.Thread(target=run, name="keepwarm-populate", daemon=True).start()


class LeaseKeeper:
    """Keeps the lease renewed from a child process (``keepwarm.worker.lease_keeper``: a thread here could be
    starved by native code holding the GIL). It re-attaches by fingerprint when the daemon answers
    ``unknown_lease`` (it restarted, or dropped us); a reader thread mirrors the keeper's events here
    (``renewals``, ``reattaches``, ``att.lease_id``). A CPU arena we view stays valid either way (a mapped tmpfs
    file outlives its creator); a CUDA arena does not survive its daemon, so a CUDA worker whose daemon died must
    be restarted."""

    def __init__(self, att: Attachment, runtime_dir: Path | None, ttl: float, quantization: str, dtype: str) -> None:
        # Weak: the keeper must not keep its attachment alive (see the finalizer in attach()).
        self._att = weakref.ref(att)
        self.model = att.manifest.model
        self.fingerprint = att.fingerprint
        self.lease_id = att.lease_id
        self.runtime_dir = runtime_dir
        self.ttl = ttl
        self.interval = max(0.2, ttl / 3)
        self.quantization = quantization
        self.dtype = dtype
        self.renewals = 0
        self.reattaches = 0
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "keepwarm.worker.lease_keeper", str(self.runtime_dir or ""), self.lease_id,
               str(os.getpid()), repr(self.ttl), self.model, self.quantization, self.dtype, self.fingerprint]
        # Its own session: a Ctrl-C meant for the worker must not end the keeper before the worker detaches.
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                      close_fds=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, name="keepwarm-lease", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            event, _, rest = line.strip().partition(" ")
            if event == "renewed":
                self.renewals += 1
            elif event == "lease":
                log.info("lease %s lost (daemon restarted?); re-attached with lease %s", self.lease_id, rest)
                self.lease_id = rest
                att = self._att()
                if att is not None:
                    att.lease_id = rest
                self.reattaches += 1
            elif event == "warn":
                log.warning("%s", rest)

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, detach: bool = True) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is not None:  # the keeper is gone (killed?): detach from here
            log.warning("lease keeper of %s exited (%s) before the worker", self.lease_id, proc.returncode)
            if detach:
                try:
                    with DaemonClient(self.runtime_dir, timeout=2.0) as client:
                        client.detach(self.lease_id)
                except DaemonError as e:
                    log.info("detach of lease %s: %s", self.lease_id, e.message)
            return
        try:
            assert proc.stdin is not None
            proc.stdin.write("stop detach\n" if detach else "stop keep\n")
            proc.stdin.close()
        except (BrokenPipeError, ValueError, OSError):
            pass
        try:
            proc.wait(timeout=5 + self.interval)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
