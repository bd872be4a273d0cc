"""The OpenAPI schema the server publishes (/openapi.json), made to tell the truth.

FastAPI's generated schema claims a 422 on every route (keepwarm answers 400 in OpenAI's error shape), JSON for
/metrics and for streams, and no 401/404/413/429/500/503. :func:`install` replaces ``app.openapi`` with a builder
that fixes each operation after FastAPI made it. Rules (each in full: docs/reliability.md, "The OpenAPI schema"):
- no 422 anywhere; every error status a route can answer is listed with the error schema;
- each 200 has the media types the route really sends, with a schema of what it sends;
- request bodies keep the request models' schemas plus what the routes check beyond them (``route_rules``): what the
  schema allows, the server accepts, but for what no JSON Schema can state (a prompt's length in tokens, one field
  compared with another); integer bounds stay integers;
- what depends on this server's flags and model is stated for it (``ServerFacts``: vocabulary, context length, a
  request's ``chat_template``, the LoRA admin routes, the response store).
tests/e2e/test_schema_fuzz.py holds both directions with schemathesis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, TypeAdapter

from keepwarm.worker.sampling_params import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS_ENTRIES

INT64_MAX = (1 << 63) - 1


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for every 4xx and 5xx."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    # None for an echoed prompt's first token (nothing comes before it).
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int | None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None  # vLLM's, when asked for


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None when the whole answer is tool calls
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ResponseObject(_Open):
    """OpenAI's Responses object (``store`` true when the server's response store kept it)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Open):
    status: Literal["ok", "draining", "engine stopped"]


class Version(_Open):
    version: str


class EffectiveConfig(_Open):
    config: dict[str, Any]


# One server-sent event (what schemathesis checks each streamed event against): ``data`` is a JSON chunk or
# ``[DONE]``; the chunks are the completion/chat shapes with ``delta``s, documented in docs/reliability.md.
SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                        "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                                       "id": {"type": "string"}}}}}
TEXT = {"text/plain": {"schema": {"type": "string"}}}
ERRORS = {
    400: "Invalid request (OpenAI's invalid_request_error)",
    401: "Missing or wrong API key (only with --api-key)",
    404: "Unknown model or adapter",
    405: "Method not allowed",
    413: "Request body larger than --max-request-body-mb",
    429: "More requests queued than --max-queued-requests",
    500: "The request failed inside the server (the others go on)",
    503: "The server is draining or its engine stopped",
}
GENERATE_ERRORS = (400, 401, 404, 413, 429, 500, 503)
RESPONSE_PATH = "/v1/responses/{response_id}"  # a stored response (routes/responses.py)
# path -> method -> (200 content, error statuses)
ROUTES: dict[str, dict[str, tuple[dict[str, Any], tuple[int, ...]]]] = {
    "/v1/completions": {"post": ({"application/json": CompletionResponse, **SSE}, GENERATE_ERRORS)},
    "/v1/chat/completions": {"post": ({"application/json": ChatCompletionResponse, **SSE}, GENERATE_ERRORS)},
    "/v1/responses": {"post": ({"application/json": ResponseObject, **SSE}, GENERATE_ERRORS)},
    RESPONSE_PATH: {"get": ({"application/json": ResponseObject}, (401, 404))},
    "/tokenize": {"post": ({"application/json": TokenizeResponse}, (400, 401, 404, 413, 500))},
    "/detokenize": {"post": ({"application/json": DetokenizeResponse}, (400, 401, 404, 413, 500))},
    "/v1/models": {"get": ({"application/json": ModelList}, (401,))},
    "/v1/load_lora_adapter": {"post": (TEXT, (400, 401, 413, 500))},
    "/v1/unload_lora_adapter": {"post": (TEXT, (400, 401, 404, 409, 413, 500))},
    "/health": {"get": ({"application/json": Health}, (503,))},
    # /ping answers with a status and no body: 200 live, 503 draining or stopped (see BARE).
    "/ping": {"get": ({}, ()), "post": ({}, ())},
    "/version": {"get": ({"application/json": Version}, ())},
    "/metrics": {"get": ({"text/plain": {"schema": {"type": "string"}}}, ())},
    "/keepwarm/config": {"get": ({"application/json": EffectiveConfig}, (401,))},
}
ERRORS[409] = "The adapter still has requests in flight"
# path -> method -> statuses answered with no body at all
BARE: dict[str, dict[str, tuple[int, ...]]] = {"/ping": {"get": (503,), "post": (503,)}}


def _schema_ref(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = TypeAdapter(model).json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components.setdefault(model.__name__, schema)
    return {"$ref": f"#/components/schemas/{model.__name__}"}


@dataclass(frozen=True)
class ServerFacts:
    """What the schema says that depends on the server's flags and model."""

    vocab_size: int
    max_model_len: int
    trust_request_chat_template: bool = False
    lora_runtime_updates: bool = False
    auto_tool_choice: bool = False  # --enable-auto-tool-choice with a --tool-call-parser
    responses_store: bool = False  # --enable-responses-store (or VLLM_ENABLE_RESPONSES_API_STORE=1)


def facts_of(state: Any) -> ServerFacts:
    """The facts of a running server (its ``ServerState``)."""
    c = state.config
    return ServerFacts(vocab_size=state.engine.model_config.vocab_size, max_model_len=state.engine.max_model_len,
                       trust_request_chat_template=c.trust_request_chat_template,
                       lora_runtime_updates=c.enable_lora and c.enable_lora_runtime_updates,
                       auto_tool_choice=c.enable_auto_tool_choice and c.tool_call_parser is not None,
                       responses_store=c.enable_responses_store)


# component -> properties whose integers are token ids of the served model (the routes check the vocabulary)
TOKEN_ID_FIELDS = {"CompletionRequest": ("prompt",), "DetokenizeRequest": ("tokens",)}
# properties bounded by the context: a prompt takes at least one token, so fewer than max_model_len remain
CONTEXT_BOUND_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens")
LORA_ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def _integer_bounds(node: Any) -> None:
    """Every integer schema's bounds back to integers (2^63 is int64's maximum, rounded up as a float)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(node.get(key), float):
                    node[key] = min(int(node[key]), INT64_MAX)
        for value in node.values():
            _integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _integer_bounds(value)


def _cap_integers(node: Any, maximum: int) -> None:
    """Every integer schema under ``node`` at most ``maximum``."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = min(node.get("maximum", maximum), maximum)
        for value in node.values():
            _cap_integers(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _cap_integers(value, maximum)


# -- what the routes check beyond the request models, stated for the fuzzer and for clients -------------------------
NULL: dict[str, Any] = {"type": "null"}
STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
              "structured_outputs")
NON_EMPTY = {"type": "string", "minLength": 1}
TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"enum": ["text", "input_text", "output_text"]}, "text": {"type": "string"}}}
RESPONSE_FORMAT = {"type": "object", "anyOf": [  # structured_fields._response_format
    {"properties": {"type": {"enum": ["text", "json_object"]}}},
    {"required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "properties": {"schema": {"type": "object"}}}}}]}
SO_KINDS = {"json": {"type": ["object", "boolean", "string"]}, "regex": NON_EMPTY, "grammar": NON_EMPTY,
            "choice": {"type": "array", "minItems": 1, "items": NON_EMPTY}, "json_object": {"type": "boolean"}}
SO_UNSET = {"json_object": {"enum": [None, False]}}  # false is as good as absent there
STRUCTURED_OUTPUTS = {"type": "object", "additionalProperties": False, "properties": {  # _structured_outputs
    **{k: {"anyOf": [v, NULL]} for k, v in SO_KINDS.items()},
    **{k: {"type": "boolean"} for k in ("disable_any_whitespace", "disable_fallback",
                                        "disable_additional_properties")},
    "whitespace_pattern": {"type": ["string", "null"]}},
    "anyOf": [{"properties": {o: SO_UNSET.get(o, NULL) for o in SO_KINDS if o != k}} for k in SO_KINDS]}


TOOLS_GIVEN = {"type": "array", "minItems": 1}  # a bare minItems would let null through


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, NULL]}


def _at_most_one(props: tuple[str, ...]) -> dict[str, Any]:
    """At most one of ``props`` is set (not null): one branch per prop that may be."""
    return {"anyOf": [{"properties": {o: NULL for o in props if o != p}} for p in props]}


def _structured_or_scoring(structured: tuple[str, ...]) -> dict[str, Any]:
    """Completions: at most one of ``structured`` with ``max_tokens`` at least 1 (or null); or, to score a prompt
    (``max_tokens: 0`` takes ``echo: true``, protocol.CompletionRequest), echo with none of them. One rule, not
    two: a rule of its own would double the branches a generator multiplies out (see ``route_rules``)."""
    at_least_one = _nullable({"type": "integer", "minimum": 1})
    free = [{"properties": {**b["properties"], "max_tokens": at_least_one}} for b in _at_most_one(structured)["anyOf"]]
    scoring = {"required": ["echo"], "properties": {**{f: NULL for f in structured}, "echo": {"const": True}}}
    return {"anyOf": [*free, scoring]}


def _null_unless(prop: str, other: str, value: Any) -> dict[str, Any]:
    """``prop`` is null unless ``other`` is ``value``."""
    return {"anyOf": [{"properties": {prop: NULL}}, {"required": [other], "properties": {other: {"const": value}}}]}


def _tool_modes(named: dict[str, Any], structured: tuple[str, ...], auto: bool) -> dict[str, Any]:
    """tool_calls.tool_mode with structured_spec, in one rule: "none" takes any tools, and no choice with no tools is
    none, each with at most one structured output; "required" or a named function needs tools and no structured
    output; "auto" (also no choice with tools) only where the server enables it. That a named function is among
    the tools is the one part no schema states."""
    free: list[dict[str, Any]] = [
        {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "none"}}},
        {"properties": {"tool_choice": NULL, "tools": {"anyOf": [NULL, {"type": "array", "maxItems": 0}]}}}]
    if auto:
        free.append({"required": ["tools"], "properties": {"tool_choice": {"anyOf": [{"const": "auto"}, NULL]},
                                                           "tools": TOOLS_GIVEN}})
    forced = {"required": ["tool_choice", "tools"], "properties": {
        "tool_choice": {"anyOf": [{"const": "required"}, named]}, "tools": TOOLS_GIVEN,
        **{f: NULL for f in structured}}}
    one = _at_most_one(structured)["anyOf"]
    return {"anyOf": [*({**m, "properties": {**m["properties"], **o["properties"]}} for m in free for o in one),
                      forced]}


def _chat_tools(auto: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(property schemas, rule) of chat's tools and tool_choice."""
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                    "properties": {"name": {"type": "string"}}}}}
    tool = {"type": "object", "required": ["function"], "properties": {  # tool_calls.functions
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"],
                     "properties": {"name": NON_EMPTY, "parameters": {"type": "object"}}}}}
    choices = ["none", "required", *(["auto"] if auto else [])]
    return ({"tools": _nullable({"type": "array", "items": tool}),
             "tool_choice": {"anyOf": [{"enum": choices}, named, NULL]}},
            _tool_modes(named, STRUCTURED, auto))  # with structured_fields.structured_spec


def decimal_below(n: int) -> str:
    """A regular expression (unanchored) for the integers in [0, n), n >= 1, in decimal without leading zeros: the
    token-id keys of ``logit_bias`` for a vocabulary of n (protocol.TokenKey's form, check_logit_bias's bound)."""
    top = str(n - 1)
    width = len(top)
    parts = []
    if width > 1:  # every shorter number
        parts.append("[0-9]" if width == 2 else f"0|[1-9][0-9]{{0,{width - 2}}}")
    for i, digit in enumerate(top):  # as wide: top's first i digits, a smaller digit, then any digits
        low, high = (1 if i == 0 and width > 1 else 0), int(digit) - 1
        if high >= low:
            rest = width - i - 1
            parts.append(top[:i] + (str(low) if high == low else f"[{low}-{high}]")
                         + ("[0-9]" + (f"{{{rest}}}" if rest > 1 else "") if rest else ""))
    parts.append(top)
    return "(" + "|".join(parts) + ")"


def _logit_bias(vocab_size: int) -> dict[str, Any]:
    """``logit_bias`` as the server takes it: every key a token id of this vocabulary (pydantic's schema has
    ``patternProperties``, which lets any other key through), at most 300, each bias in [-100, 100]."""
    return _nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
                      "propertyNames": {"pattern": f"^{decimal_below(vocab_size)}$"},
                      "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_LIMIT,
                                               "maximum": LOGIT_BIAS_LIMIT}})


def _responses_rules(auto: bool, store: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(property schemas, rules) of /v1/responses (keepwarm.worker.openai.responses: it becomes a chat request)."""
    named = {"type": "object", "required": ["type", "name"],
             "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}
    tool = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function"}, "name": NON_EMPTY, "parameters": {"type": "object"}}}
    message = {"type": "object", "required": ["content"], "properties": {
        "type": {"const": "message"}, "role": {"enum": ["system", "user", "assistant", "developer", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {**TEXT_PART, "required": ["type"]}}]}}}
    call = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function_call"}, "name": NON_EMPTY, "arguments": {"type": "string"},
        "call_id": {"type": "string"}}}
    output = {"type": "object", "required": ["type"], "properties": {"type": {"const": "function_call_output"},
                                                                     "call_id": {"type": "string"}}}
    fmt = {"type": "object", "anyOf": [{"properties": {"type": {"enum": ["text", "json_object"]}}},
                                       {"required": ["type"], "properties": {"type": {"const": "json_schema"},
                                                                             "schema": {"type": "object"}}}]}
    text = _nullable({"type": "object", "properties": {"format": _nullable(fmt)}})
    props = {"input": {"anyOf": [{"type": "string"},
                                 {"type": "array", "minItems": 1, "items": {"anyOf": [message, call, output]}}]},
             "tools": _nullable({"type": "array", "items": tool}),
             "tool_choice": {"anyOf": [{"enum": ["none", "required", *(["auto"] if auto else [])]}, named, NULL]},
             "text": text, "conversation": NULL, "background": {"enum": [False, None]},  # refused
             # an id the store does not hold is a 404 (as vLLM), which a client expects of an id
             "previous_response_id": {"type": ["string", "null"]} if store else NULL}
    return props, [_tool_modes(named, ("text",), auto)]


def route_rules(facts: ServerFacts) -> dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """component -> (property schemas that replace the model's, rules added to its ``allOf``): each the schema of a
    check a route makes beyond pydantic's (named beside it).

    Each rule is an ``anyOf``, and a generator multiplies them out: past a few dozen branches over chat's forty
    properties schemathesis gives up on the operation. So three rules are stated narrower than the server is (what
    the schema allows is still accepted): ``best_of`` null or 1 (the server takes any value equal to ``n``); in
    chat, ``stream_options`` and ``top_logprobs`` both null unless ``stream`` and ``logprobs`` are both true; and
    in completions, ``max_tokens: 0`` (with ``echo``) only with no structured output (the server takes one there,
    and has no output for it to shape)."""
    auto = facts.auto_tool_choice
    structured = {"response_format": _nullable(RESPONSE_FORMAT), "structured_outputs": _nullable(STRUCTURED_OUTPUTS)}
    tool_props, tool_rule = _chat_tools(auto)
    # completions: best_of must equal n (n defaults to 1)
    best_of = {"anyOf": [{"properties": {"best_of": NULL}},
                         {"properties": {"best_of": {"const": 1}, "n": {"const": 1}}}]}
    bias = {"logit_bias": _logit_bias(facts.vocab_size)}
    # _SamplingFields.sampling: stream_options only with stream; chat._constraint: top_logprobs only with logprobs
    streamed = {"anyOf": [{"properties": {"stream_options": NULL, "top_logprobs": NULL}},
                          {"required": ["stream", "logprobs"],
                           "properties": {"stream": {"const": True}, "logprobs": {"const": True}}}]}
    return {
        "CompletionRequest": ({**structured, **bias}, [_null_unless("stream_options", "stream", True),
                                                       _structured_or_scoring(STRUCTURED), best_of]),
        "ChatCompletionRequest": ({**structured, **tool_props, **bias}, [streamed, tool_rule]),
        # chat_render.message_dicts: text parts only; tool_calls.template_messages: calls are objects
        "ChatMessage": ({"content": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}, NULL]},
                         "tool_calls": _nullable({"type": "array", "items": {"type": "object", "properties": {
                             "function": {"type": ["object", "null"]}}}})}, []),
        # tokenize: exactly one of prompt and messages
        "TokenizeRequest": ({}, [{"oneOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                                            {"required": ["messages"],
                                             "properties": {"messages": {"type": "array"}}}]}]),
        "ResponsesRequest": _responses_rules(auto, facts.responses_store),
    }


def state_facts(schema: dict[str, Any], facts: ServerFacts) -> None:
    """Rewrite the request schemas for this server (see ``ServerFacts``)."""
    components = schema.get("components", {}).get("schemas", {})
    for name, fields in TOKEN_ID_FIELDS.items():
        for field in fields:
            _cap_integers(components.get(name, {}).get("properties", {}).get(field), facts.vocab_size - 1)
    for body in components.values():
        props = body.get("properties", {})
        for field in CONTEXT_BOUND_FIELDS:
            if field in props:
                _cap_integers(props[field], facts.max_model_len - 1)
        if "chat_template" in props and not facts.trust_request_chat_template:
            props["chat_template"] = {"type": "null", "description": "refused unless the server runs with "
                                                                     "--trust-request-chat-template"}
    if not facts.lora_runtime_updates:
        for path in LORA_ADMIN_PATHS:
            schema.get("paths", {}).pop(path, None)
    if not facts.responses_store:  # without the store every id is unknown (routes/responses.py says why)
        schema.get("paths", {}).pop(RESPONSE_PATH, None)
    for name, (props, rules) in route_rules(facts).items():
        body = components.get(name)
        if body is not None:
            body.setdefault("properties", {}).update(props)
            if rules:  # an empty allOf is not a schema
                body.setdefault("allOf", []).extend(rules)


def fix_schema(schema: dict[str, Any], facts: ServerFacts | None = None) -> dict[str, Any]:
    """Rewrite FastAPI's generated schema in place (see the module docstring) and return it."""
    _integer_bounds(schema)
    if facts is not None:
        state_facts(schema, facts)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    error_ref = _schema_ref(ErrorResponse, components)
    for path, methods in schema.get("paths", {}).items():
        for method, op in methods.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            spec = ROUTES.get(path, {}).get(method)
            if spec is None:
                continue
            content, errors = spec
            ok = {}
            for media, body in content.items():
                ok[media] = {"schema": _schema_ref(body, components)} if isinstance(body, type) else body
            responses["200"] = {"description": "Successful Response", "content": ok} if ok else \
                {"description": "Successful Response (no body)"}
            for status in BARE.get(path, {}).get(method, ()):
                responses[str(status)] = {"description": ERRORS[status] + " (no body)"}
            for status in errors:
                responses[str(status)] = {"description": ERRORS[status],
                                          "content": {"application/json": {"schema": error_ref}}}
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema


def install(app: FastAPI, facts: ServerFacts | None = None) -> None:
    """Serve the fixed schema at /openapi.json (built once, on first request), stating ``facts`` when given."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = fix_schema(generate(), facts)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
