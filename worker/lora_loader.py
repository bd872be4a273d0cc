"""Where an adapter's bytes come from: the daemon (resident, shared memory) when the engine's weights do, else disk.

Rule: a rejected adapter leaves nothing resident. The daemon refuses what needs no model before writing anything;
what it made resident for this request and this worker then rejects (shapes, rank, target modules against the
model) it is asked to unload again, and so is one the caller fails to register (``open_adapter``'s undo). An
adapter that was resident before the request (another worker's) is never unloaded here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from keepwarm.daemon.client import DaemonClient, DaemonError
from keepwarm.formats.arena import CpuArenaFile
from keepwarm.weights.checkpoint import tensors_from_buffer
from keepwarm.worker.lora import LoRAAdapter, LoRAError, build_adapter, load_adapter_from_disk

log = logging.getLogger("keepwarm.worker")

Undo = Callable[[], None]


def _nothing() -> None:
    return None


def load_adapter(engine, name: str, path: str) -> LoRAAdapter:
    """Read and check an adapter for ``engine`` (raises LoRAError naming the cause; nothing stays resident)."""
    return open_adapter(engine, name, path)[0]


def register_adapter(engine, name: str, path: str) -> LoRAAdapter:
    """Load ``path``'s adapter and add it to ``engine`` under ``name``; if the engine refuses it (a duplicate name,
    ``--max-cpu-loras``), what this call made resident in the daemon is unloaded again."""
    adapter, undo = open_adapter(engine, name, path)
    try:
        engine.add_lora(adapter)
    except BaseException:
        undo()
        raise
    return adapter


def open_adapter(engine, name: str, path: str) -> tuple[LoRAAdapter, Undo]:
    """As :func:`load_adapter`, with an undo for a caller whose next step (registering the adapter) fails: it
    unloads the daemon's copy when this call made it resident, and does nothing otherwise."""
    cfg = engine.config
    if engine.weights_source == "daemon":
        attachment = engine.loaded.attachment
        return _from_daemon(name, path, engine.model_config, cfg.max_lora_rank,
                            attachment.runtime_dir if attachment is not None else None)
    adapter = load_adapter_from_disk(name, path, engine.model_config, cfg.max_lora_rank)
    log.info("adapter %s loaded from disk (%s, rank %d, %.1f MB)", name, path, adapter.rank, adapter.nbytes / 1e6)
    return adapter, _nothing


def _from_daemon(name: str, path: str, model_config, max_lora_rank: int,
                 runtime_dir: Path | None) -> tuple[LoRAAdapter, Undo]:
    """Get ``path``'s adapter from the daemon (it reads the files only if it does not hold them already), view it in
    shared memory and check it against the model; a rejection unloads what this call made resident."""
    try:
        with DaemonClient(runtime_dir) as client:
            reply = client.load_adapter(path)
    except DaemonError as e:
        raise LoRAError(e.message) from None
    undo = _nothing if reply.cached else lambda: _unload(runtime_dir, reply.digest, name)
    storage = None
    try:
        try:
            storage = CpuArenaFile.open_readonly(Path(reply.data_file), reply.size)
        except OSError as e:  # unloaded meanwhile (another worker's request rejected it)
            raise LoRAError(f"adapter {name!r}: the daemon's copy {reply.data_file} cannot be mapped: "
                            f"{e.strerror or e}") from None
        try:
            tensors = tensors_from_buffer(storage.flat)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise LoRAError(f"adapter {name!r}: adapter_model.safetensors is unreadable: {e}") from None
        adapter = build_adapter(name, reply.path, reply.digest, reply.config_json, tensors, model_config,
                                max_lora_rank, source="daemon")
    except BaseException:
        if storage is not None:
            storage.close()
        undo()
        raise
    adapter.storage = storage  # keeps the mapping alive while the adapter's tensors view it
    log.info("adapter %s attached from the daemon (%s, rank %d, digest %s%s)", name, reply.path, adapter.rank,
             adapter.digest[:16], ", already resident" if reply.cached else "")
    return adapter, undo


def _unload(runtime_dir: Path | None, digest: str, name: str) -> None:
    """Ask the daemon to drop the adapter of ``digest`` that a rejected request made resident. A daemon that cannot
    be reached is logged: the request's own error is what its caller hears."""
    try:
        with DaemonClient(runtime_dir) as client:
            client.request("unload_adapter", {"adapter": digest})
    except DaemonError as e:
        log.warning("adapter %s was rejected, but the daemon did not unload it (digest %s): %s", name, digest[:16],
                    e.message)
        return
    log.info("adapter %s rejected: the daemon's copy (digest %s) unloaded", name, digest[:16])
