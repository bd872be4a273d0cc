"""The LoRA adapters registered with one engine, by name, and the slot manager that serves them.

Rules (vLLM's meanings; call from the engine's thread only):
- An adapter is registered (``add``) before a request names it, by name or as the object; at most
  ``max_cpu_loras`` are registered; a name is registered once.
- A request may not name an adapter being unloaded (``unloading``) or one no longer registered.
- ``remove`` refuses while a request for the adapter is in flight (waiting or running); otherwise its slot is
  cleared and it is unregistered.
- Under tensor or pipeline parallelism rank 0 alone keeps the registry: every slot it writes is sent to the other
  ranks (``LoRASlot``), which write their part of the same adapter into the same slot before a step reads it.
"""

from __future__ import annotations

import torch

from keepwarm.formats.model_config import ModelConfig, ModelConfigError
from keepwarm.weights.sharding import Shard, Stage
from keepwarm.worker.engine.config import EngineConfig
from keepwarm.worker.engine.errors import RequestError
from keepwarm.worker.engine.scheduler import Scheduler
from keepwarm.worker.lora import LoRAAdapter, LoRAError, LoRAManager
from keepwarm.worker.models.llama import LlamaForCausalLM
from keepwarm.worker.parallel.group import ParallelGroup
from keepwarm.worker.parallel.messages import LoRASlot, lora_weights


def lora_manager_for(config: EngineConfig, mc: ModelConfig, model: LlamaForCausalLM, dtype: torch.dtype,
                     device: torch.device, tp: ParallelGroup | None, stage: Stage | None) -> LoRAManager | None:
    """The slot manager of this rank's model (its shard, its stage's layers), or None without ``enable_lora``."""
    if not config.enable_lora:
        return None
    if mc.family == "moe":
        raise ModelConfigError(f"LoRA is not supported for {mc.architecture} (experts have no PEFT "
                               "projections keepwarm maps; supported: the Llama and Gemma families)")
    shard = None if tp is None or tp.tp_size == 1 else Shard(0, tp.tp_size)
    manager = LoRAManager(model, mc, config.max_loras, config.max_lora_rank, dtype, device, shard,
                          stage.layers if stage is not None else None)
    if tp is not None:
        manager.on_write = lambda slot, adapter: publish_slot(tp, slot, adapter)
    return manager


def publish_slot(tp: ParallelGroup, slot: int, adapter: LoRAAdapter | None) -> None:
    """Rank 0 writes a LoRA slot: the other ranks write the same adapter (their part of it) there too."""
    tp.check()
    if adapter is None:
        tp.send(LoRASlot(slot, "", "", 0, 1.0, []))
        return
    tp.send(LoRASlot(slot, adapter.name, adapter.digest, adapter.rank, adapter.scaling,
                     lora_weights(adapter.weights)))


class LoRARegistry:
    """Name -> adapter for one engine (see the module docstring)."""

    def __init__(self, manager: LoRAManager | None, scheduler: Scheduler, max_cpu_loras: int | None) -> None:
        self.manager = manager
        self.scheduler = scheduler
        self.max_cpu_loras = max_cpu_loras
        self.adapters: dict[str, LoRAAdapter] = {}

    def add(self, adapter: LoRAAdapter) -> None:
        if self.manager is None:
            raise LoRAError("LoRA is not enabled (--enable-lora)")
        if adapter.name in self.adapters:
            raise LoRAError(f"an adapter named {adapter.name!r} is already loaded")
        limit = self.max_cpu_loras
        if limit is not None and len(self.adapters) >= limit:
            raise LoRAError(f"{len(self.adapters)} adapters are loaded, the --max-cpu-loras limit")
        self.adapters[adapter.name] = adapter

    def in_flight(self, name: str) -> int:
        """Requests (their sequences) for adapter ``name`` waiting or running."""
        return sum(1 for s in self.scheduler.running + list(self.scheduler.waiting)
                   if s.lora is not None and getattr(s.lora, "name", None) == name)

    def remove(self, name: str) -> LoRAAdapter:
        """Unregister an adapter; refuses (LoRAError) while requests for it are in flight."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoRAError(f"no adapter named {name!r} is loaded")
        n = self.in_flight(name)
        if n:
            raise LoRAError(f"adapter {name!r} has {n} request(s) in flight")
        if self.manager is not None:
            self.manager.evict(adapter)
        del self.adapters[name]
        return adapter

    def resolve(self, lora: LoRAAdapter | str | None) -> LoRAAdapter | None:
        """The registered adapter a request names; refuses (RequestError) one it may not use."""
        if isinstance(lora, str):
            if lora not in self.adapters:
                raise RequestError(f"no adapter named {lora!r} is loaded")
            lora = self.adapters[lora]
        if lora is not None:
            if self.manager is None:
                raise RequestError("LoRA is not enabled (--enable-lora)")
            if lora.unloading or self.adapters.get(lora.name) is not lora:
                raise RequestError(f"adapter {lora.name!r} is being unloaded")
        return lora
