"""The engine's statistics: vLLM's counters, and what vLLM's request histograms take.

Rules: ``EngineStats`` holds the counters /metrics exposes. What the histograms take (first-token and inter-token
times, each ended sequence's timestamps, tokens per step, each ended request's n and longest output) is appended
to ``EngineStats.observations`` only once a reader has set it (the AsyncEngine, which folds and clears it after
every step), so an engine nobody reads (the offline LLM) keeps nothing per token. A request that fails alone
counts as vLLM's ``error`` reason, not ``abort``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from keepwarm.worker.engine.sequence import Sequence


@dataclass(frozen=True)
class FinishedSequence:
    """How one sequence went, for the request histograms (vLLM's FinishedRequestStats: vLLM runs ``n > 1`` as n
    child requests, keepwarm as n sequences). Times are ``time.monotonic()``; None where it never got that far."""

    reason: str  # stop | length | abort | error
    arrival: float
    scheduled: float | None
    first_token: float | None
    last_token: float | None
    finished: float
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache supplied
    max_tokens: int | None
    num_preemptions: int = 0  # times the scheduler preempted it (recomputed from scratch)


@dataclass
class Observations:
    """What the histograms of /metrics take from the engine, since the reader last cleared it."""

    iteration_tokens: list[int] = field(default_factory=list)  # per step that sampled (vLLM's count, see step)
    time_to_first_token: list[float] = field(default_factory=list)  # per sequence
    inter_token_latency: list[float] = field(default_factory=list)  # per output token after a sequence's first
    finished: list[FinishedSequence] = field(default_factory=list)
    requests: list[tuple[int, int]] = field(default_factory=list)  # (n, longest output) per request that ended

    def clear(self) -> None:
        for values in (self.iteration_tokens, self.time_to_first_token, self.inter_token_latency, self.finished,
                       self.requests):
            values.clear()


@dataclass
class EngineStats:
    """Counters the API's /metrics exposes (vLLM's metric set). ``observations`` is None until a reader (the
    AsyncEngine) sets one: an engine nobody reads (the offline LLM) keeps no per-token record."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0})
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens prefilled, counted when a sequence's first token comes
    prompt_tokens_cached: int = 0  # prompt tokens the prefix cache supplied instead
    observations: Observations | None = None

    def record_token(self, seq: Sequence, now: float) -> int:
        """Time ``seq``'s new token. Returns what it adds to the step's token count, as vLLM counts it: each
        generated token, and a prompt (less its cached tokens) in the step that completes its prefill."""
        obs = self.observations
        previous, seq.last_token_time = seq.last_token_time, now
        if seq.first_token_time is not None:
            if obs is not None and previous is not None:
                obs.inter_token_latency.append(now - previous)
            return 1
        seq.first_token_time = now
        cached = seq.num_cached_prompt_tokens
        computed = seq.num_prompt_tokens - cached
        self.prompt_tokens_computed += computed
        self.prompt_tokens_cached += cached
        if obs is not None:
            obs.time_to_first_token.append(now - seq.arrival_time)
        return computed + 1

    def sequence_finished(self, seq: Sequence, reason: str) -> None:
        """``seq`` ended; ``reason`` is what the metrics count it as."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if self.observations is not None:
            self.observations.finished.append(FinishedSequence(
                reason, seq.arrival_time, seq.scheduled_time, seq.first_token_time, seq.last_token_time,
                time.monotonic(), seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_prompt_tokens,
                seq.sampling_params.max_tokens, seq.num_preemptions))

    def request_ended(self, seqs: list[Sequence]) -> None:
        """Every sequence of a request has ended: its n and longest output."""
        if self.observations is not None:
            self.observations.requests.append((len(seqs), max(s.num_output_tokens for s in seqs)))
