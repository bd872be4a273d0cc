"""Where an adapter's bytes come from: the daemon (resident, shared memory) when the engine's weights do, else disk."""

from __future__ import annotations

import logging

from keepwarm.worker.lora import LoRAAdapter, load_adapter_from_disk

log = logging.getLogger("keepwarm.worker")


def load_adapter(engine, name: str, path: str) -> LoRAAdapter:
    """Read and check an adapter for ``engine`` (raises LoRAError naming the cause)."""
    cfg = engine.config
    if engine.weights_source == "daemon":
        from keepwarm.worker.attach import attach_adapter

        return attach_adapter(name, path, engine.model_config, cfg.max_lora_rank, engine.dtype,
                              engine.loaded.attachment)
    adapter = load_adapter_from_disk(name, path, engine.model_config, cfg.max_lora_rank)
    log.info("adapter %s loaded from disk (%s, rank %d, %.1f MB)", name, path, adapter.rank, adapter.nbytes / 1e6)
    return adapter
