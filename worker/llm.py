"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from keepwarm.worker.engine import EngineConfig, LLMEngine
from keepwarm.worker.lora import LoRARequest
from keepwarm.worker.outputs import RequestOutput
from keepwarm.worker.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Generate from a Hugging Face model directory (the bundled SmolLM2 when ``model`` is None).

    Keyword arguments are :class:`EngineConfig` fields (vLLM's names): ``dtype``, ``max_model_len``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``, ``enable_prefix_caching``, ``num_gpu_blocks``,
    ``kv_cache_memory_bytes``, ``kv_cache_dtype``, ``seed``, ``device``.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model is None:
            from keepwarm.worker.default_model import default_model

            model = str(default_model())
        self.llm_engine = LLMEngine(EngineConfig(model=str(model), **kwargs))
        self._counter = itertools.count()

    @property
    def weights_source(self) -> str:
        """"daemon" (views into the daemon's arena) or "disk"."""
        return self.llm_engine.weights_source

    def close(self) -> None:
        """Detach from the daemon (drops the lease); a no-op for a disk load."""
        self.llm_engine.close()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def _tokenizer(self):
        if self.llm_engine.tokenizer is None:
            raise ValueError("text prompts need a tokenizer: this LLM was made with skip_tokenizer_init=True "
                             "(pass token ids)")
        return self.llm_engine.tokenizer

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._tokenizer().encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return self._encode(prompt["prompt"])
        return None, list(prompt)

    def _lora(self, request: LoRARequest | None):
        """The adapter for a LoRARequest, registered on first use (from the daemon when attached, else disk)."""
        if request is None:
            return None
        engine = self.llm_engine
        if request.lora_name not in engine.loras:
            from keepwarm.worker.lora_loader import register_adapter

            register_adapter(engine, request.lora_name, request.lora_path)
        return engine.loras[request.lora_name]

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Submit all prompts together, run the engine until they finish, return outputs in prompt order.

        ``lora_request``: one adapter for all prompts, or one per prompt (None = the base model); needs
        ``enable_lora=True``."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and
                                                 isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        loras = lora_request if isinstance(lora_request, list | tuple) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("give one LoRARequest, or one per prompt")
        adapters = [self._lora(r) for r in loras]
        engine = self.llm_engine
        ids = []
        for prompt, p, adapter in zip(prompts, params, adapters, strict=True):
            text, token_ids = self._encode(prompt)
            rid = str(next(self._counter))
            engine.add_request(rid, token_ids, p, prompt=text, lora=adapter)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in ids]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.encode_chat(c, chat_template, add_generation_prompt)} for c in convs]
        return self.generate(prompts, sampling_params)

    def encode_chat(self, messages: list[dict[str, str]], chat_template: str | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        tok = self._tokenizer()
        text = tok.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
        # The template already holds the special tokens; don't add a second BOS.
        return tok.encode(text, add_special_tokens=False)
