"""Build the model on placeholders and attach its weights: from disk here, from the daemon's arena later."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from keepwarm.daemon.checkpoint import Checkpoint, load_fused_tensors
from keepwarm.worker.models.llama import LlamaForCausalLM

log = logging.getLogger("keepwarm.worker")


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    source: str  # "disk" | "daemon"
    seconds: float
    nbytes: int


def load_from_disk(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, max_position: int) -> LoadedModel:
    t0 = time.perf_counter()
    model = LlamaForCausalLM(ckpt.config, max_position=max_position, device=device)
    tensors = load_fused_tensors(ckpt, dtype=dtype)
    if device.type != "cpu":
        tensors = {k: v.to(device, non_blocking=True) for k, v in tensors.items()}
    model.load_weights(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    seconds = time.perf_counter() - t0
    log.info("loaded %s from disk: %.1f MB in %.2fs", ckpt.model_dir, nbytes / 1e6, seconds)
    return LoadedModel(model, "disk", seconds, nbytes)
