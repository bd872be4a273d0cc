"""OpenAI-compatible request and response shapes (with vLLM's extra sampling fields), and OpenAI's error shape.

Validation lives here, at the boundary, so nothing the engine cannot run reaches it (rules; docs/reliability.md):
- every number has a range and is finite (``allow_inf_nan=False``); integers are strict (``true``/``false`` is not a
  token id or a count) and within 64 bits (``seed``: what ``torch.Generator.manual_seed`` takes, ``torch.long``);
- every string anywhere in the body is encodable as UTF-8: a lone surrogate (``"\\ud800"``) is refused, naming its path;
- lenient like vLLM about names: a request field this server does not know is accepted and ignored, with one
  warning per field name for the life of the process; a field it knows but cannot honour is a 400 naming it
  (``suffix``...). Admin bodies (LoRA load/unload) stay closed (``extra="forbid"``): a typo there must not
  silently mean the default;
- ``logit_bias`` has OpenAI's limits: decimal token-id keys, at most 300 (counted before any entry is checked), each
  bias in [-100, 100], ids in the served vocabulary (``check_logit_bias``, called by the routes);
- ``max_tokens: 0`` only with ``echo: true`` on /v1/completions (scoring a prompt, as OpenAI's legacy API and vLLM).
Errors surface as OpenAI's error JSON with HTTP 400 (the server maps pydantic's errors, naming the field).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from array import array
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from keepwarm.worker.sampling_params import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS_ENTRIES, SamplingParams

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _integral(value: Any) -> Any:
    """A JSON number without a fraction as the integer it is (JSON Schema's ``integer`` includes ``5.0``); anything
    else as it came, for StrictInt to judge (``true`` stays a boolean, ``5.5`` a float: both refused)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# On every integer field, after its constraints (inside them, pydantic would drop them from the schema): strict (no
# booleans, no strings), but 5.0 is 5.
INTEGRAL = BeforeValidator(_integral)
# Token ids and counts: strict ints, non-negative, within int64 (the vocabulary bound is checked by the server).
TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX), INTEGRAL]
Count = Annotated[StrictInt, Field(ge=0, le=INT64_MAX), INTEGRAL]
MAX_LOGPROBS = 20


class APIError(Exception):
    """An error returned as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


log = logging.getLogger("keepwarm.server")
_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    """Log ``message`` the first time ``key`` is seen in this process."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning("%s (logged once)", message)


def warn_unknown(names: list[str], where: str) -> None:
    for n in names:
        warn_once(f"{where}.{n}", f"{where}: ignoring the unknown request field {n!r}")


def _all_encodable(value: Any) -> bool:
    """Whether every string (key or value) in ``value`` is valid Unicode text. A list of only ints or only strings
    is checked in one C call (``array``, ``join``), so a body of millions of prompts or token ids costs neither
    a Python step nor an object per entry (issue 43)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return False
        elif isinstance(v, dict):
            if not _all_encodable(list(v)):
                return False
            stack.extend(v.values())
        elif isinstance(v, list):
            try:
                array("q", v)  # only ints: no string inside
                continue
            except (TypeError, OverflowError):
                pass
            try:
                "".join(v).encode("utf-8")  # only strings
                continue
            except TypeError:
                stack.extend(v)  # mixed: entry by entry
            except UnicodeEncodeError:
                return False
    return True


def unencodable_path(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (key or value) in ``value`` that is not valid Unicode text, or None."""
    if _all_encodable(value):
        return None
    stack = [(value, path)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                sub = f"{where}.{k}" if where else str(k)
                if isinstance(k, str):
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return where or "body"
                stack.append((x, sub))
        elif isinstance(v, list):
            stack.extend((x, f"{where}.{i}" if where else str(i)) for i, x in enumerate(v))
    return None


UNENCODABLE = "unencodable_string"


def _union_tag(part: Any) -> bool:
    """Whether a ``loc`` part is pydantic's name of a union member (``list[constrained-str]``), not a field's."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list")
                                      or any(c in part for c in "[-("))


def field_error(errors: list[Any]) -> tuple[list[str | int], str]:
    """pydantic's first error as (the field's path, without union tags or FastAPI's "body"; the message). For a
    union field (``prompt``, ``stop``), the error of the member the value has the shape of: the one that is not a
    type mismatch (``["ok", ""]`` fails ``str`` on its type, ``list[str]`` on the empty string)."""
    def path(e: Any) -> list[str | int]:
        return [x for x in e.get("loc", ()) if x != "body" and not _union_tag(x)]

    field = path(errors[0])[:1]
    first = next((e for e in errors if path(e)[:1] == field and not str(e.get("type")).endswith("_type")),
                 errors[0])
    return path(first), str(first.get("msg", "invalid value"))


def validation_error(errors: list[Any]) -> APIError:
    """The 400 for pydantic's error (``ValidationError.errors()``), one line: the message starts with the field's
    dotted path; ``param`` is the top-level field, or the whole path of a string that is not valid Unicode (it may
    sit deep in ``messages``). Every front end answers a body's validation through this."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return bad_request("the request body is not valid JSON")
    if first.get("type") == UNENCODABLE:
        return bad_request(str(first["msg"]), str(first["ctx"]["path"]))
    loc, message = field_error(errors) if errors else ([], "invalid value")
    return bad_request(" ".join(f"{'.'.join(map(str, loc)) or 'body'}: {message}".split()),
                       str(loc[0]) if loc else None)


class RequestBody(BaseModel):
    """Base of every OpenAI request body: finite numbers, encodable strings; unknown fields accepted and ignored,
    each name warned about once (vLLM's leniency)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        where = unencodable_path(data)
        if where is not None:
            # The message must stay encodable itself: it names the field, never quotes the bad string. The path
            # travels in the error's context: the 400's ``param`` (``validation_error``).
            raise PydanticCustomError(UNENCODABLE, "{path}: not valid Unicode text (a lone surrogate?)",
                                      {"path": where})
        return data

    @model_validator(mode="after")
    def _warn_extra(self) -> RequestBody:
        if self.model_extra:
            warn_unknown(sorted(self.model_extra), type(self).__name__)
        return self


class ClosedBody(RequestBody):
    """An admin body: unknown fields refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(RequestBody):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


Unit = Annotated[float, Field(ge=0.0, le=1.0)]
NonEmpty = Annotated[str, Field(min_length=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


# A token id as a JSON object key: decimal digits, no sign, no leading zero (what str(int) writes).
TokenKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,18})$")]
LogitBias = Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]


class _SamplingFields(RequestBody):
    """Fields shared by completions and chat; OpenAI's plus vLLM's extras, each with its range."""

    model: str | None = None
    n: Annotated[StrictInt, Field(ge=1, le=16), INTEGRAL] = 1
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: NonEmpty | list[NonEmpty] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX), INTEGRAL] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    user: str | None = None
    # OpenAI's: token id (a JSON key, so a string of digits) -> a bias added to its logit before sampling.
    logit_bias: Annotated[dict[TokenKey, LogitBias], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    # vLLM's extra sampling parameters
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT64_MAX), INTEGRAL] | None = None
    min_p: Unit | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Count = 0
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    request_id: Annotated[str, Field(max_length=256)] | None = None
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    # structured outputs: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_count_first(cls, v: Any) -> Any:
        # Before pydantic validates every entry: a body of a million keys is refused on its count alone.
        if isinstance(v, dict) and len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise PydanticCustomError("too_long", "logit_bias has {count} entries (limit {limit})",
                                      {"count": len(v), "limit": MAX_LOGIT_BIAS_ENTRIES})
        return v

    def check_logit_bias(self, vocab_size: int) -> None:
        """400 naming ``logit_bias`` when one of its token ids is outside the served model's vocabulary."""
        outside = sorted(int(k) for k in self.logit_bias or () if int(k) >= vocab_size)
        if outside:
            raise bad_request(f"logit_bias: token id(s) {outside[:10]} are outside the vocabulary (ids are in "
                              f"[0, {vocab_size}))", "logit_bias")

    def sampling(self, max_tokens: int | None, logprobs: int | None, default_max: int) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=default_max if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
        )


MaxTokens = Annotated[StrictInt, Field(ge=1, le=INT64_MAX), INTEGRAL]


class CompletionRequest(_SamplingFields):
    prompt: NonEmpty | Annotated[list[NonEmpty], Field(min_length=1)] | \
        Annotated[list[TokenId], Field(min_length=1)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    echo: StrictBool = False  # before max_tokens: its validator reads it
    # 0 only with echo (scoring the prompt: routes/completions.py); the schema states the rule (openapi.py).
    max_tokens: Annotated[StrictInt, Field(ge=0, le=INT64_MAX), INTEGRAL] | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    suffix: None = None  # not supported: only null is accepted
    best_of: Annotated[StrictInt, Field(ge=1, le=16), INTEGRAL] | None = None

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_with_echo(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v == 0 and not info.data.get("echo"):
            raise PydanticCustomError("greater_than_equal", "Input should be greater than or equal to 1 (0 only "
                                      "with echo: true, which scores the prompt without generating)", {"ge": 1})
        return v

    @property
    def scores_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt echoed (with its logprobs when asked), nothing generated."""
        return self.echo and self.max_tokens == 0


class ChatMessage(BaseModel):
    # Extra keys (tool_call_id, ...) pass through to the template; strings in them were checked by the request.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _tool_calls_are_objects(cls, data: Any) -> Any:
        # The renderer reads each call's "function" (tool_calls.template_messages): anything else was a 500.
        calls = data.get("tool_calls") if isinstance(data, dict) else None
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function", {}), dict | None) for c in calls)):
            raise ValueError('tool_calls must be a list of {"function": {...}} objects')
        return data


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    @field_validator("tool_choice")
    @classmethod
    def _named_choice_is_an_object(cls, v: Any) -> Any:
        # tool_calls.tool_mode reads tool_choice["function"]["name"]: a function that is no object was a 500.
        if isinstance(v, dict) and not isinstance(v.get("function"), dict | None):
            raise ValueError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
        return v


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRARequest(ClosedBody):
    lora_name: NonEmpty
    lora_path: NonEmpty


class UnloadLoRARequest(ClosedBody):
    lora_name: NonEmpty
    lora_int_id: Annotated[StrictInt, INTEGRAL] | None = None
