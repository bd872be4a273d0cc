"""The OpenAPI schema the server publishes (/openapi.json), made to tell the truth.

FastAPI's generated schema claims things the server never does: a 422 on every route (keepwarm answers a bad
request with 400 in OpenAI's error shape), JSON for /metrics (Prometheus text) and for streamed completions
(server-sent events), and no 401/404/413/429/500/503 at all. :func:`install` replaces ``app.openapi`` with a
builder that fixes each operation after FastAPI generated it (rules):

- no 422 anywhere; every error status a route can answer is listed with the error schema;
- each 200 has the media types the route really sends, with a schema of what it sends (JSON bodies are described
  by the pydantic models below; schemathesis checks real responses against them in tests/test_schema_fuzz.py);
- request bodies keep the request models' schemas (strict ints and booleans, ranges): what the schema allows,
  the server accepts.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, TypeAdapter


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
    """OpenAI's Responses object (stateless: ``store`` is always false)."""

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
# path -> method -> (200 content, error statuses)
ROUTES: dict[str, dict[str, tuple[dict[str, Any], tuple[int, ...]]]] = {
    "/v1/completions": {"post": ({"application/json": CompletionResponse, **SSE}, GENERATE_ERRORS)},
    "/v1/chat/completions": {"post": ({"application/json": ChatCompletionResponse, **SSE}, GENERATE_ERRORS)},
    "/v1/responses": {"post": ({"application/json": ResponseObject, **SSE}, GENERATE_ERRORS)},
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


def fix_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Rewrite FastAPI's generated schema in place (see the module docstring) and return it."""
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


def install(app: FastAPI) -> None:
    """Serve the fixed schema at /openapi.json (built once, on first request)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = fix_schema(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
