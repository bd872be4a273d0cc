"""Which model class serves a config: one per family (``config.FAMILIES``)."""

from __future__ import annotations

import torch

from keepwarm.formats.model_config import ModelConfig
from keepwarm.worker.models.gemma import GemmaForCausalLM
from keepwarm.worker.models.llama import LlamaForCausalLM
from keepwarm.worker.models.moe import MoEForCausalLM

_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM, "gemma": GemmaForCausalLM, "moe": MoEForCausalLM,
}


def build_model(config: ModelConfig, max_position: int, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """The family's model on weight placeholders (``load_weights`` attaches them)."""
    return _CLASSES[config.family](config, max_position=max_position, device=device)
