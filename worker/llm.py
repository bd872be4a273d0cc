"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

What ``generate`` and ``chat`` return is vLLM's shape, so that code written for ``vllm.LLM`` runs unchanged: a
``RequestOutput`` whose ``outputs[i].logprobs`` (per generated token) and ``prompt_logprobs`` (per prompt token,
None first) are ``dict[int, Logprob]`` with ``.logprob``, ``.rank`` (1-based) and ``.decoded_token``. The engine
and the HTTP/gRPC routes keep their own :class:`~keepwarm.worker.outputs.TokenLogprob`; the conversion happens
here, at the offline boundary, once a request has finished (``worker/outputs.py`` states the shapes' rules).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from keepwarm.worker.default_model import default_model
from keepwarm.worker.engine import EngineConfig, LLMEngine
from keepwarm.worker.lora import LoRARequest
from keepwarm.worker.lora_loader import register_adapter
from keepwarm.worker.outputs import LogprobsOnePosition, RequestOutput, TokenText, to_vllm_output
from keepwarm.worker.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]
VLLMOutput = RequestOutput[LogprobsOnePosition]
REPLACEMENT = "\ufffd"  # what decode gives for the bytes of an incomplete UTF-8 character


def space_marker(tokenizer: Any) -> str | None:
    """The replacement character of a Metaspace pre-tokenizer (SentencePiece-style vocabularies: ``\u2581``), whose
    leading copies ``decode`` drops from a token decoded alone; None for the others (byte-level BPE keeps its
    spaces). Read from the tokenizer's ``tokenizer.json``, as vLLM's ``get_leading_space_marker`` does."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except (AttributeError, TypeError, ValueError):
        return None
    for p in [pre, *(pre.get("pretokenizers") or [])]:
        if isinstance(p, dict) and p.get("type") == "Metaspace":
            return str(p.get("replacement", "\u2581"))
    return None


def completed_text(tokenizer: Any, token_id: int, context: Seq[int]) -> str:
    """The text a byte-fallback token completes, or "" while its character is still incomplete (vLLM's
    ``_correct_decoded_token``): decoded after the last 1, 2, ... of the chosen tokens before it (``context``,
    oldest first, at most 4), the first decode that no longer ends in U+FFFD gives the text past the context's own
    complete part."""
    for n in range(1, len(context) + 1):
        ctx = list(context[-n:])
        full = tokenizer.decode([*ctx, token_id])
        if full.endswith(REPLACEMENT):
            continue
        clean_end = len(ctx)  # context tokens that are themselves pieces of this character count as its text
        while clean_end > 0 and tokenizer.decode([ctx[clean_end - 1]]).endswith(REPLACEMENT):
            clean_end -= 1
        prefix = tokenizer.decode(ctx[:clean_end]) if clean_end else ""
        # past the prefix; where normalization made them differ, past their common start
        return full[len(os.path.commonprefix([prefix, full])):]
    return ""


def token_decoder(tokenizer: Any, marker: Callable[[], str | None]) -> TokenText:
    """``Logprob.decoded_token`` as vLLM 0.32 makes it: the token decoded on its own, with the leading spaces its
    SentencePiece piece stands for put back (``marker()``, the caller's cached :func:`space_marker`); a text that
    ends in U+FFFD (a piece of a multi-byte character) is replaced by :func:`completed_text` over the chosen
    tokens before it. None for every token without a tokenizer. The lone decode is memoized: a token repeats
    across positions and top-k lists."""
    if tokenizer is None:
        return lambda token_id, context: None
    cache: dict[int, str] = {}

    def alone(token_id: int) -> str:
        text = cache.get(token_id)
        if text is None:
            text = tokenizer.decode([token_id]) or ""
            sp = marker()
            if sp:
                raw = tokenizer.convert_ids_to_tokens(token_id) or ""
                missing = (len(raw) - len(raw.lstrip(sp))) - (len(text) - len(text.lstrip(" ")))
                text = " " * missing + text if missing > 0 else text
            cache[token_id] = text
        return text

    def decode(token_id: int, context: Seq[int]) -> str:
        text = alone(token_id)
        return completed_text(tokenizer, token_id, context) if text.endswith(REPLACEMENT) else text

    return decode


class LLM:
    """Generate from a Hugging Face model directory (the bundled SmolLM2 when ``model`` is None).

    Keyword arguments are :class:`EngineConfig` fields (vLLM's names): ``dtype``, ``max_model_len``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``, ``enable_prefix_caching``, ``num_gpu_blocks``,
    ``kv_cache_memory_bytes``, ``kv_cache_dtype``, ``seed``, ``device``.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model is None:
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

    @functools.cached_property
    def _space_marker(self) -> str | None:
        """Read once, when a first logprob needs decoding (serializing a large vocabulary takes a while)."""
        return space_marker(self.llm_engine.tokenizer)

    def _decoder(self) -> TokenText:
        return token_decoder(self.llm_engine.tokenizer, lambda: self._space_marker)

    def _lora(self, request: LoRARequest | None):
        """The adapter for a LoRARequest, registered on first use (from the daemon when attached, else disk)."""
        if request is None:
            return None
        engine = self.llm_engine
        if request.lora_name not in engine.loras:
            register_adapter(engine, request.lora_name, request.lora_path)
        return engine.loras[request.lora_name]

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 use_tqdm: bool = True) -> list[VLLMOutput]:
        """Submit all prompts together, run the engine until they finish, return outputs in prompt order, in
        vLLM's shapes (logprobs as ``dict[int, Logprob]``; see the module docstring).

        ``lora_request``: one adapter for all prompts, or one per prompt (None = the base model); needs
        ``enable_lora=True``. ``use_tqdm`` is vLLM's and taken for its code's sake: keepwarm shows no bar."""
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
        decode = self._decoder()
        return [to_vllm_output(final[r], decode) for r in ids]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True,
             lora_request: LoRARequest | None = None) -> list[VLLMOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.encode_chat(c, chat_template, add_generation_prompt)} for c in convs]
        return self.generate(prompts, sampling_params, lora_request, use_tqdm)

    def encode_chat(self, messages: list[dict[str, str]], chat_template: str | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        tok = self._tokenizer()
        text = tok.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
        # The template already holds the special tokens; don't add a second BOS.
        return tok.encode(text, add_special_tokens=False)
