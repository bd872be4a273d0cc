"""Input processing: a prompt's token ids and its SamplingParams become a request's sequences.

Rules:
- Whatever a request gets wrong is refused here (:class:`RequestError`, an HTTP 400) before anything of it enters
  the engine: an empty prompt or one that leaves no room for an output token, token ids or ``logit_bias`` ids
  outside the vocabulary, params that do not validate, stop strings without a tokenizer, an adapter that is not
  registered or is being unloaded.
- A structured-output spec is compiled here (the offline API's); the HTTP front end compiles ahead, off the engine
  thread, with the same ``grammar_compiler`` (thread-safe; it indexes the vocabulary on first use).
- EOS ids are the model config's and the tokenizer's, unless ``ignore_eos``.
- ``n > 1`` becomes n sequences ``<request id>#<i>``, choice i seeded ``seed + i``; each gets its own incremental
  detokenizer when there is a tokenizer and the request wants text.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from keepwarm.formats.model_config import ModelConfig, ModelConfigError
from keepwarm.worker.detokenizer import IncrementalDetokenizer
from keepwarm.worker.engine.errors import RequestError
from keepwarm.worker.engine.lora_registry import LoRARegistry
from keepwarm.worker.engine.output import RequestState
from keepwarm.worker.engine.sequence import Sequence
from keepwarm.worker.lora import LoRAAdapter
from keepwarm.worker.outputs import RequestMetrics
from keepwarm.worker.sampling_params import SamplingParams
from keepwarm.worker.structured import GrammarCompiler, StructuredOutputs
from keepwarm.worker.tokenizer import load_tokenizer


def open_tokenizer(path: str) -> Any:
    """The served tokenizer (``worker/tokenizer.py``); a failure is one line naming the path."""
    try:
        return load_tokenizer(path)
    except Exception as e:  # transformers raises many types; the message is what matters
        raise ModelConfigError(f"cannot load a tokenizer from {path!r}: {str(e).splitlines()[0]}") from None


class InputProcessor:
    """Turns requests into sequences for one model, tokenizer and context length (module docstring)."""

    def __init__(self, tokenizer: Any, model_config: ModelConfig, max_model_len: int, long_rope_after: int | None,
                 loras: LoRARegistry) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.long_rope_after = long_rope_after
        self.loras = loras
        self.grammar_compiler = GrammarCompiler.for_tokenizer(tokenizer, model_config.vocab_size, self.eos_token_ids)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def process(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None,
                cache_salt: str | None, lora: LoRAAdapter | str | None) -> RequestState:
        adapter = self.loras.resolve(lora)
        params = self._checked(prompt_token_ids, params)
        now = time.monotonic()
        seqs: list[Sequence] = []
        detoks: list[IncrementalDetokenizer | None] = []
        for i in range(params.n):
            p = params
            if params.n > 1:
                p = SamplingParams(**{**params.__dict__, "n": 1,
                                      "seed": None if params.seed is None else params.seed + i})
                p.eos_token_ids = params.eos_token_ids
            seq = Sequence(f"{request_id}#{i}", prompt_token_ids, p, cache_salt=cache_salt, arrival_time=now,
                           lora=adapter)
            if self.long_rope_after is not None and len(prompt_token_ids) > self.long_rope_after:
                seq.use_long_rope()
            seqs.append(seq)
            detoks.append(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, p.skip_special_tokens)
                          if p.detokenize and self.tokenizer is not None else None)
        return RequestState(request_id, prompt, seqs, detoks, [""] * len(seqs), RequestMetrics(now))

    def _checked(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """``params`` validated, its spec compiled and its EOS ids set; refuses what the engine cannot take."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= self.max_model_len:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                               f"has {n} tokens (at most {self.max_model_len - 1} leave room for one output token)")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if params.logit_bias and any(t < 0 or t >= vocab for t in params.logit_bias):  # refused before it runs
            raise RequestError(f"logit_bias token ids must be in [0, {vocab})")
        params.validate()
        if isinstance(params.structured, StructuredOutputs):
            params = dataclasses.replace(params, structured=self.grammar_compiler.compile(params.structured))
        if self.tokenizer is None and params.stop:
            raise RequestError("stop strings need a tokenizer (the engine runs with skip_tokenizer_init)")
        if not params.ignore_eos:
            params.eos_token_ids = self.eos_token_ids
        return params
