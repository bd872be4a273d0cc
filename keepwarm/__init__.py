"""keepwarm: keep LLM weights warm in a daemon and serve them from short-lived workers.

The offline API's names are vLLM's (``from vllm import LLM, SamplingParams`` becomes ``from keepwarm import ...``):
``LLM``, ``SamplingParams``, ``LoRARequest``, and the output types ``RequestOutput``, ``CompletionOutput`` and
``Logprob`` (vLLM's ``vllm.outputs`` / ``vllm.logprobs``; here all from ``keepwarm.worker.outputs``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from keepwarm.formats.version import __version__

__all__ = ["LLM", "CompletionOutput", "Logprob", "LoRARequest", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from keepwarm.worker.llm import LLM
    from keepwarm.worker.lora import LoRARequest
    from keepwarm.worker.outputs import CompletionOutput, Logprob, RequestOutput
    from keepwarm.worker.sampling_params import SamplingParams

# Lazy: `keepwarm --version` and the daemon must not pay for importing torch and transformers.
_LAZY = {"LLM": "keepwarm.worker.llm", "LoRARequest": "keepwarm.worker.lora",
         "SamplingParams": "keepwarm.worker.sampling_params", "CompletionOutput": "keepwarm.worker.outputs",
         "Logprob": "keepwarm.worker.outputs", "RequestOutput": "keepwarm.worker.outputs"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'keepwarm' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
