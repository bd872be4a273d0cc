"""The worker side of the daemon: attach to a resident arena, view its tensors (no copy), keep the lease alive."""

from __future__ import annotations

import logging
import threading
import time
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
from keepwarm.formats.quant import LAYOUT_MKLDNN_PACKED, QuantMeta
from keepwarm.kernels.cpu_packed import PackedWeight
from keepwarm.kernels.quant import QuantizedWeight
from keepwarm.worker.lora import LoRAAdapter

log = logging.getLogger("keepwarm.worker")


@dataclass
class Attachment:
    """Weights viewed in place in the daemon's arena, held under a lease that a background thread renews."""

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


def attach_weights(model: str, quantization: str = "none", dtype: str = "auto", fingerprint: str | None = None,
                   runtime_dir: Path | None = None, preload: bool = True, on_event: ProgressCallback | None = None,
                   keep_lease: bool = True) -> Attachment:
    """Ask the daemon for ``model`` (preloading it if needed) and build views into its arena."""
    t0 = time.perf_counter()
    with DaemonClient(runtime_dir) as client:
        reply = client.attach(model, quantization, dtype, fingerprint, preload=preload, on_event=on_event)
    manifest = ArenaManifest.from_json(reply["manifest"])
    arena = reply["arena"]
    storage: CpuArenaFile | torch.Tensor
    if arena["kind"] == "cpu":
        storage = CpuArenaFile.open_readonly(Path(arena["path"]), arena["size"])
        flat = storage.flat
    else:
        flat = storage = CudaArena.import_handle(arena)
    tensors = model_tensors(manifest, flat)
    seconds = time.perf_counter() - t0
    att = Attachment(manifest, tensors, reply["lease_id"], reply.get("origin", "?"), seconds,
                     cached="progress" not in str(reply), storage=storage, runtime_dir=runtime_dir)
    if keep_lease:
        att.keeper = LeaseKeeper(att, runtime_dir, float(reply.get("lease_ttl", 15.0)), quantization, dtype)
        att.keeper.start()
    log.info("attached %s from the daemon (lease %s, fingerprint %s, %.1f MB) in %.3fs", manifest.model_name,
             att.lease_id, manifest.fingerprint[:16], manifest.total_bytes / 1e6, seconds)
    return att


class LeaseKeeper(threading.Thread):
    """Renews the lease every ``ttl / 3`` seconds. When the daemon answers ``unknown_lease`` (it restarted, or
    dropped us), it attaches again by fingerprint to get a new lease. A CPU arena we view stays valid either way (a
    mapped tmpfs file outlives its creator); a CUDA arena does not survive its daemon, so a CUDA worker whose
    daemon died must be restarted."""

    def __init__(self, att: Attachment, runtime_dir: Path | None, ttl: float, quantization: str, dtype: str) -> None:
        super().__init__(name="keepwarm-lease", daemon=True)
        self.att = att
        self.runtime_dir = runtime_dir
        self.interval = max(0.2, ttl / 3)
        self.quantization = quantization
        self.dtype = dtype
        self._stopped = threading.Event()
        self.renewals = 0
        self.reattaches = 0

    def run(self) -> None:
        client = DaemonClient(self.runtime_dir, timeout=max(1.0, self.interval))
        try:
            while not self._stopped.wait(self.interval):
                try:
                    client.heartbeat(self.att.lease_id)
                    self.renewals += 1
                except DaemonError as e:
                    if e.code == "unknown_lease":
                        self._reattach(client)
                    else:
                        log.warning("lease %s: cannot renew: %s", self.att.lease_id, e.message)
        finally:
            client.close()

    def _reattach(self, client: DaemonClient) -> None:
        try:
            reply = client.attach(self.att.manifest.model, self.quantization, self.dtype,
                                  fingerprint=self.att.fingerprint, preload=False)
        except DaemonError as e:
            log.warning("lease %s lost and re-attach failed (%s); the weights stay mapped", self.att.lease_id,
                        e.message)
            return
        log.info("lease %s lost (daemon restarted?); re-attached with lease %s", self.att.lease_id,
                 reply["lease_id"])
        self.att.lease_id = reply["lease_id"]
        self.reattaches += 1

    def stop(self, detach: bool = True) -> None:
        self._stopped.set()
        self.join(timeout=5)
        if detach:
            try:
                with DaemonClient(self.runtime_dir, timeout=2.0) as client:
                    client.detach(self.att.lease_id)
            except DaemonError as e:
                log.info("detach of lease %s: %s", self.att.lease_id, e.message)


def attach_adapter(name: str, path: str, model_config, max_lora_rank: int, dtype: torch.dtype,
                   attachment: Attachment | None) -> LoRAAdapter:
    """Get ``path``'s adapter from the daemon (it reads the files only if it does not hold them already), view it
    in shared memory and check it against the model. Raises LoRAError naming the cause."""
    from keepwarm.daemon.checkpoint import tensors_from_buffer
    from keepwarm.worker.lora import LoRAError, build_adapter

    runtime_dir = attachment.runtime_dir if attachment is not None else None
    try:
        with DaemonClient(runtime_dir) as client:
            reply = client.request("load_adapter", {"path": str(path)})
    except DaemonError as e:
        raise LoRAError(e.message) from None
    storage = CpuArenaFile.open_readonly(Path(reply["data_file"]), reply["size"])
    try:
        tensors = tensors_from_buffer(storage.flat)
    except ValueError as e:
        raise LoRAError(f"adapter {name!r}: {e}") from None
    adapter = build_adapter(name, reply["path"], reply["digest"], reply["config_json"], tensors, model_config,
                            max_lora_rank, source="daemon")
    adapter.storage = storage  # keeps the mapping alive while the adapter's tensors view it
    log.info("adapter %s attached from the daemon (%s, rank %d, digest %s%s)", name, reply["path"], adapter.rank,
             adapter.digest[:16], ", already resident" if reply["cached"] else "")
    return adapter
