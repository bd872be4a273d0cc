"""Per-request sampling parameters, with vLLM's names, defaults and validation.

Rules: every value has vLLM's range (a SamplingParamsError naming the field, an HTTP 400); ``seed`` (and
``seed + n - 1``) within ``[SEED_MIN, SEED_MAX]``; stop conditions bounded (``MAX_STOP_STRINGS`` strings of at
most ``MAX_STOP_STRING_CHARS`` characters, ``MAX_STOP_TOKEN_IDS`` ids), since the engine checks them on every
token; ``logit_bias`` has OpenAI's limits (at most ``MAX_LOGIT_BIAS_ENTRIES`` token ids, each bias finite and in
``[-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]``; vLLM clamps a bias past them, keepwarm refuses it as OpenAI does), its
keys taken as ints the way vLLM takes them (``{"50256": -100}`` from JSON); an error message quotes at most 100
characters of the value it refuses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keepwarm.worker.structured import CompiledGrammar, StructuredOutputs

# torch.Generator.manual_seed's range (vLLM's seed bounds); choice i of an n>1 request samples with seed + i.
# Every bit of a seed counts: distinct seeds give distinct streams (keepwarm.worker.sampler.seeded_generator).
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
# Stop conditions are checked on every token of the engine thread, so their number and length are bounded.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# OpenAI's logit_bias limits: the sampler adds each row's entries on every step.
MAX_LOGIT_BIAS_ENTRIES = 300
LOGIT_BIAS_LIMIT = 100.0


class SamplingParamsError(ValueError):
    """An invalid sampling value; the message names the field, and so does ``field`` (an HTTP 400's param)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class SamplingParams:
    """How to sample one request. Defaults follow vLLM (e.g. ``max_tokens=16``).

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k. ``logprobs=k`` returns the
    log-probability of the chosen token plus the ``k`` most likely ones (raw model distribution).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Log-probability of every prompt token given the ones before it (plus the top-k alternatives); the first
    # prompt token has none. Such a request skips prefix-cache hits, as in vLLM, since cached tokens are not
    # recomputed.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    # Token id -> a value added to its logit before sampling (after the logprobs are taken: they stay the model's,
    # as vLLM's default logprobs_mode). Keys may come as strings of ints (JSON object keys).
    logit_bias: dict[int, float] | None = None
    # Constrained decoding (structured outputs, forced tool calls): the grammar every sequence of the request
    # follows (each with its own matcher); None samples freely. A StructuredOutputs spec is compiled by the
    # engine's add_request (cached); the HTTP front end passes it compiled.
    structured: StructuredOutputs | CompiledGrammar | None = field(default=None, repr=False, compare=False)
    # Filled by the engine: the model's EOS ids (from generation_config/config), unless ignore_eos.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = _int_keys(self.logit_bias)
        self.validate()

    def validate(self) -> None:
        def bad(name: str, rule: str) -> SamplingParamsError:
            got = repr(getattr(self, name))
            return SamplingParamsError(f"{name} must be {rule}, got {got if len(got) <= 100 else got[:100] + '...'}",
                                       name)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise bad(name, "a finite number")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1)):
            raise bad("seed", f"an integer in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}]")
        if self.temperature < 0:
            raise bad("temperature", "non-negative")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "-1, 0 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "> 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", "between 0 and max_tokens")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "an integer in [0, 20]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", "an integer in [0, 20]")
        self._validate_stops(bad)
        self._validate_logit_bias()

    def _validate_stops(self, bad: Callable[[str, str], SamplingParamsError]) -> None:
        stop, ids = list(self.stop or ()), list(self.stop_token_ids or ())  # lists since __post_init__
        if len(stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(f"stop has {len(stop)} strings (limit {MAX_STOP_STRINGS})", "stop")
        if any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", "a list of non-empty strings")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise SamplingParamsError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long",
                                      "stop")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(f"stop_token_ids has {len(ids)} ids (limit {MAX_STOP_TOKEN_IDS})",
                                      "stop_token_ids")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative integers")

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise SamplingParamsError("logit_bias must be a mapping of token ids to biases", "logit_bias")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamsError(f"logit_bias has {len(bias)} entries (limit {MAX_LOGIT_BIAS_ENTRIES})",
                                      "logit_bias")
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise SamplingParamsError(f"logit_bias keys must be token ids (non-negative integers), got "
                                          f"{_quoted(token)}", "logit_bias")
            # The range check also refuses NaN and the infinities (every comparison with NaN is False).
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise SamplingParamsError(f"logit_bias[{token}] must be a number in [{-LOGIT_BIAS_LIMIT:g}, "
                                          f"{LOGIT_BIAS_LIMIT:g}], got {_quoted(value)}", "logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0


def _quoted(value: Any) -> str:
    """``repr(value)``, at most 100 characters (Python refuses to print an int of more than 4300 digits)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an {type(value).__name__} too long to print"
    return text if len(text) <= 100 else text[:100] + "..."


def _int_keys(bias: Any) -> Any:
    """``logit_bias`` with keys that are strings of decimal digits as the ints they spell (vLLM's ``int(token)``);
    an empty mapping as None. Anything else stays as it came, for ``validate`` to refuse (a key of more than 20
    digits too: past int64, and ``int()`` refuses thousands of digits with an error of its own)."""
    if not isinstance(bias, dict):
        return bias
    if not bias:
        return None
    return {int(k) if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 20 else k: v
            for k, v in bias.items()}
