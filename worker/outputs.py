"""Results returned to callers, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``.

One pair of classes, two logprob representations; the type parameter says which one an output holds:
- ``RequestOutput[TokenLogprob]``: what the engine makes (``LLMEngine.step``, ``AsyncLLMEngine``) and what the HTTP
  and gRPC routes read. One :class:`TokenLogprob` per position: the chosen token's id, logprob and 1-based rank,
  and the top-k as (token id, logprob) pairs, most likely first.
- ``RequestOutput[LogprobsOnePosition]``: what the offline ``LLM.generate`` / ``LLM.chat`` return, vLLM 0.32's
  shapes (one ``dict[int, Logprob]`` per position, decoded tokens from :class:`TokenText`), so that code written for
  ``vllm.LLM`` runs unchanged. :func:`to_vllm_output` converts at that boundary (the engine and the routes keep
  ``TokenLogprob``; nothing but the offline API sees the dicts).

vLLM's shapes in detail, and where keepwarm differs (``finished`` a property, ``metrics``, ``error``):
docs/vllm-compat.md, "Offline outputs".
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one sampled token and the top alternatives at that position."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


# One position's logprobs: TokenLogprob (the engine's; the default, so a bare ``RequestOutput`` is the engine's) or
# LogprobsOnePosition (the offline API's). The default (PEP 696) is for the type checker: typing's TypeVar takes
# one from Python 3.13, and typing_extensions is no runtime requirement.
if TYPE_CHECKING:
    from typing_extensions import TypeVar

    LP = TypeVar("LP", default=TokenLogprob)
else:
    LP = typing.TypeVar("LP")


@dataclass
class Logprob:
    """vLLM's ``Logprob``: one token's logprob at one position, its 1-based rank and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsOnePosition = dict[int, Logprob]
SampleLogprobs = list[LogprobsOnePosition]
PromptLogprobs = list[LogprobsOnePosition | None]
# A token's ``decoded_token`` at one position, given the chosen tokens of the positions before it (at most 4 are
# read, oldest first): the context completes the pieces of a multi-byte character.
TokenText = Callable[[int, list[int]], str | None]
CONTEXT = 4  # positions of context, as vLLM's (enough for any UTF-8 character)


@dataclass
class CompletionOutput(Generic[LP]):
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[LP] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0


@dataclass
class RequestOutput(Generic[LP]):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput[LP]]
    finished: bool = False
    prompt_logprobs: list[LP | None] | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # Set (with finished=True) when the request failed inside the engine; the other requests went on.
    error: str | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens if self.metrics else 0


def vllm_position(x: TokenLogprob, decode: TokenText, context: list[int]) -> LogprobsOnePosition:
    """One position as vLLM gives it: the chosen token first (its own rank), then the top-k ranked 1..k; a chosen
    token inside the top-k keeps its first place in the dict and takes the top-k's entry, as vLLM's does.
    ``context``: the chosen tokens of the positions before this one (for ``decode``)."""
    out = {x.token_id: Logprob(x.logprob, x.rank, decode(x.token_id, context))}
    for rank, (token_id, logprob) in enumerate(x.top, start=1):
        out[token_id] = Logprob(logprob, rank, decode(token_id, context))
    return out


def context_of(lps: Sequence[TokenLogprob | None], i: int) -> list[int]:
    """The context of position ``i``: the chosen tokens of the last :data:`CONTEXT` positions before it that have
    one (vLLM's window: a None among them, the first prompt position, shortens it)."""
    return [p.token_id for p in lps[max(0, i - CONTEXT):i] if p is not None]


def to_vllm_output(out: RequestOutput[TokenLogprob], decode: TokenText) -> RequestOutput[LogprobsOnePosition]:
    """``out`` with vLLM's logprob dicts in place of the engine's :class:`TokenLogprob` (everything else shared)."""
    completions: list[CompletionOutput[LogprobsOnePosition]] = [CompletionOutput(
        index=c.index, text=c.text, token_ids=c.token_ids, cumulative_logprob=c.cumulative_logprob,
        logprobs=None if c.logprobs is None else [vllm_position(x, decode, context_of(c.logprobs, i))
                                                  for i, x in enumerate(c.logprobs)],
        finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in out.outputs]
    plp = out.prompt_logprobs
    prompt = None if plp is None else [None if x is None else vllm_position(x, decode, context_of(plp, i))
                                       for i, x in enumerate(plp)]
    return RequestOutput(
        request_id=out.request_id, prompt=out.prompt, prompt_token_ids=out.prompt_token_ids, outputs=completions,
        finished=out.finished, prompt_logprobs=prompt, metrics=out.metrics, error=out.error)
