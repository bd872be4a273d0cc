"""Request state: token ids, progress through the KV cache, status and sampled output."""

from __future__ import annotations

import enum
import time

from keepwarm.worker.outputs import TokenLogprob
from keepwarm.worker.sampling_params import SamplingParams
from keepwarm.worker.structured import CompiledGrammar, GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


class Sequence:
    """One request's state as the scheduler, block manager and model runner see it.

    ``num_computed_tokens`` counts tokens whose KV is in the cache; the scheduler advances it and resets it to
    0 on preemption (recompute). ``block_hash_extra`` (the cache salt and the LoRA adapter's content digest) is
    mixed into prefix-cache block hashes, so requests with different salts or adapters never share KV blocks.
    """

    def __init__(self, seq_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 cache_salt: str | None = None, arrival_time: float | None = None, lora: object | None = None,
                 ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.seq_id = seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[TokenLogprob] = []
        # prompt_logprobs[i] for prompt token i (None for i = 0), filled as prefill chunks run.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)
        self.sampling_params = sampling_params
        # Where this sequence stands in its grammar (constrained decoding); None when it samples freely.
        structured = sampling_params.structured
        self.grammar: GrammarMatcher | None = None
        if isinstance(structured, CompiledGrammar):
            self.grammar = structured.matcher()
        elif structured is not None:  # the input processor compiles a spec before it makes sequences
            raise TypeError("SamplingParams.structured must be compiled (GrammarCompiler.compile) before a "
                            "Sequence is made")
        self.cache_salt = cache_salt
        self.lora = lora  # a LoRAAdapter, or None for the base model
        self.lora_slot = -1  # its slot while scheduled (LoRAManager), -1 otherwise
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_prompt_tokens = 0  # prefix-cache hit at first schedule (for metrics)
        self.num_preemptions = 0
        # longrope (Phi-3): computed with the long factors (the runner offsets its rotary positions)
        self.rope_long = False
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        # For metrics (time.monotonic()): first scheduled (a preemption does not reset it), latest token sampled.
        self.scheduled_time: float | None = None
        self.last_token_time: float | None = None
        self.stop_reason: int | str | None = None
        self._all_token_ids = list(prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def block_hash_extra(self) -> tuple | None:
        """What keys this sequence's prefix-cache blocks besides their tokens: ``(salt,)``, or ``(salt, digest)``
        for a LoRA request. Separate fields, so that no cache salt can stand for an adapter's identity."""
        digest = getattr(self.lora, "digest", None)
        if digest is None:
            return None if self.cache_salt is None else (self.cache_salt,)
        return (self.cache_salt, digest)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def use_long_rope(self) -> None:
        """From now on computed with longrope's long factors; its blocks, rotated with other factors than a short
        sequence's, are keyed apart so they are never shared."""
        self.rope_long = True
        self.cache_salt = f"{self.cache_salt or ''}longrope"

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
