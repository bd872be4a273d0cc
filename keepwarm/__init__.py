"""keepwarm: keep LLM weights warm in a daemon and serve them from short-lived workers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from keepwarm.formats.version import __version__

__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from keepwarm.worker.llm import LLM
    from keepwarm.worker.lora import LoRARequest
    from keepwarm.worker.sampling_params import SamplingParams


def __getattr__(name: str):
    # Lazy: `keepwarm --version` and the daemon must not pay for importing torch and transformers.
    if name == "LLM":
        from keepwarm.worker.llm import LLM

        return LLM
    if name == "LoRARequest":
        from keepwarm.worker.lora import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from keepwarm.worker.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'keepwarm' has no attribute {name!r}")
