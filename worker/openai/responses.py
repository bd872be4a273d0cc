"""OpenAI's Responses API (``POST /v1/responses``) as a translation over the chat pipeline, with vLLM's optional
response store (how each field, item and event maps: docs/vllm-compat.md, "The Responses API").

Rules:
- A Responses request becomes a chat request (``instructions`` a system message; ``input`` messages, with
  ``function_call`` and ``function_call_output`` items as assistant ``tool_calls`` and ``tool`` messages; function
  tools; ``text.format`` the ``response_format``); the chat's typed result objects
  (keepwarm.worker.openai.chat_output) become ``output`` items, and its stream's chunk objects OpenAI's events.
- Stateless unless the store is on (``--enable-responses-store`` or ``VLLM_ENABLE_RESPONSES_API_STORE=1``); then
  ``previous_response_id`` continues a stored conversation (an id not held: 404). With it off, ``store`` is ignored
  with one warning and ``previous_response_id`` is a 400 naming the switch.
- ``ResponseStore`` is bounded (``STORE_MAX_RESPONSES``, ``STORE_MAX_BYTES``, ``STORE_TTL_S``; the oldest go first),
  in memory, per worker. Refused with a 400 naming the field: ``conversation``, ``background: true`` (nothing to
  poll later), built-in tools. An engine error mid-stream is an ``error`` event, and nothing is kept.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import pydantic
from pydantic import Field, StrictBool, StrictInt

from keepwarm.worker.openai.chat_output import ChatChunk, ChatCompletion, Usage
from keepwarm.worker.openai.protocol import (
    INT64_MAX,
    INT64_MIN,
    INTEGRAL,
    APIError,
    ChatCompletionRequest,
    MaxTokens,
    RequestBody,
    bad_request,
    validation_error,
    warn_once,
)

log = logging.getLogger("keepwarm.server")

# The response store's bounds (docs/reliability.md, Limits): past either count, the oldest responses go first.
STORE_MAX_RESPONSES = 1000
STORE_MAX_BYTES = 64 << 20
STORE_TTL_S = 3600.0
STORE_SWITCH = "--enable-responses-store (or VLLM_ENABLE_RESPONSES_API_STORE=1)"


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Responses object, as it was returned
    conversation: list[dict[str, Any]]  # input items: its prefix, its input, its output (what continues from it)
    created: float  # the store's clock
    nbytes: int


class ResponseStore:
    """Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory, oldest first out past
    ``max_responses`` or ``max_bytes`` (each counted as its JSON's length), none older than ``ttl_s``. Used from
    the event loop only (no lock)."""

    def __init__(self, max_responses: int = STORE_MAX_RESPONSES, max_bytes: int = STORE_MAX_BYTES,
                 ttl_s: float = STORE_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_responses, self.max_bytes, self.ttl_s, self.clock = max_responses, max_bytes, ttl_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep ``response`` (under its ``id``); False when it alone is larger than the byte bound (not kept)."""
        nbytes = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        self._expire()
        if nbytes > self.max_bytes:
            warn_once("responses.store.too_big", f"/v1/responses: a response of {nbytes} bytes is larger than the "
                      f"store's {self.max_bytes} and is not kept")
            return False
        self._drop(response["id"])
        self._entries[response["id"]] = StoredResponse(response, conversation, self.clock(), nbytes)
        self.nbytes += nbytes
        while len(self._entries) > self.max_responses or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def _expire(self) -> None:
        """Drop what is older than the TTL: the oldest are first, so this stops at the first one kept."""
        horizon = self.clock() - self.ttl_s
        while self._entries and next(iter(self._entries.values())).created <= horizon:
            self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes


class ResponsesRequest(RequestBody):
    """Strict like every request body (finite numbers, strict ints and booleans); unknown fields warned once."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default="")
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: StrictBool | None = None
    user: str | None = None
    seed: Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX), INTEGRAL] | None = None


def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
                raise bad_request(f"{where}: only text content parts are supported", "input")
            if not isinstance(p.get("text", ""), str):
                raise bad_request(f"{where}: a text part's text must be a string", "input")
            parts.append(p.get("text", ""))
        return "".join(parts)
    raise bad_request(f"{where}: content must be a string or a list of text parts", "input")


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return req.input


def _messages(instructions: str | None, items: list[dict[str, Any]], history: int = 0) -> list[dict[str, Any]]:
    """Chat messages: the instructions as a system message, then each item; the first ``history`` items are a
    previous response's conversation, so an error's ``input[i]`` counts from the item after them."""
    msgs: list[dict[str, Any]] = []
    if instructions:
        msgs.append({"role": "system", "content": instructions})
    for i, item in enumerate(items, start=-history):
        kind = item.get("type", "message")
        if kind == "message":
            msgs.append({"role": item.get("role", "user"), "content": _text_of(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
                msgs[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise bad_request(f"input[{i}]: item type {kind!r} is not supported (message, function_call, "
                              "function_call_output)", "input")
    return msgs


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise bad_request(f"tools[{i}]: tool type {t.get('type')!r} is not supported (function tools only)",
                              "tools")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                        "schema": fmt.get("schema", {}),
                                                        "strict": fmt.get("strict")}}
    return {"type": fmt.get("type", "text")}


def previous_conversation(store: ResponseStore | None, req: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation ``previous_response_id`` continues (none without one); a 400 naming the switch when the
    store is off, a 404 for an id it does not hold (as vLLM: never stored, ``store: false``, or evicted)."""
    rid = req.previous_response_id
    if rid is None:
        return []
    if store is None:
        raise bad_request(f"previous_response_id needs the response store, which is off: start the server with "
                          f"{STORE_SWITCH}, or send the whole conversation as input", "previous_response_id")
    stored = store.get(rid)
    if stored is None:
        raise APIError(404, f"Response with id '{rid}' not found.", "invalid_request_error", "previous_response_id",
                       "previous_response_not_found")
    return stored.conversation


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]] | None = None,
                    store_on: bool = False) -> ChatCompletionRequest:
    """The chat request that computes this response: ``history`` (a previous response's conversation) before the
    input; a 400 for what this server cannot do, or for what the input items became (checked as a chat request)."""
    if req.conversation is not None:
        raise bad_request("conversation is not supported (nor is it by vLLM): continue with previous_response_id "
                          f"(needs {STORE_SWITCH}) or send the whole conversation as input", "conversation")
    if req.background:
        raise bad_request("background: true is not supported: a response runs within its request (stateless: "
                          "nothing runs on to poll or cancel later); send background: false (or leave it out) to "
                          "get the answer in this request", "background")
    if req.store and not store_on:
        warn_once("responses.store", f"/v1/responses: store is ignored: the response store is off ({STORE_SWITCH} "
                  "turns it on)")
    history = history or []
    messages = _messages(req.instructions, [*history, *input_items(req)], len(history))
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                            "tools": _tools(req.tools), "tool_choice": _tool_choice(req.tool_choice),
                            "parallel_tool_calls": req.parallel_tool_calls,
                            "response_format": _response_format(req.text), "max_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if not body["messages"]:
        raise bad_request("input is empty", "input")
    try:
        return ChatCompletionRequest(**{k: v for k, v in body.items() if v is not None})
    except pydantic.ValidationError as e:
        raise validation_error(e.errors()) from None


def _envelope(req: ResponsesRequest, rid: str, created: int, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, incomplete: str | None, store: bool = False) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": req.model,
            "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature, "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}}, "store": store,
            "metadata": req.metadata or {}, "truncation": "disabled", "reasoning": None, "user": req.user}


def _usage(u: Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _new("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": _new("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": "completed"}


def conversation_after(history: list[dict[str, Any]], req: ResponsesRequest, output: list[dict[str, Any]]
                       ) -> list[dict[str, Any]]:
    """What a request continuing from this response starts with: the previous conversation, this input, this
    output (output items are input items too: an assistant message, function calls)."""
    return [*history, *input_items(req), *output]


def from_chat_completion(req: ResponsesRequest, chat: ChatCompletion, store: bool = False) -> dict[str, Any]:
    """The Responses object of a finished chat completion (``store``: whether it is to be kept)."""
    choice = chat.choices[0]
    output = []
    if choice.content:
        output.append(_message_item(choice.content))
    output += [_call_item(c.id, c.name, c.arguments) for c in choice.tool_calls]
    incomplete = "max_output_tokens" if choice.finish_reason == "length" else None
    req.model = req.model or chat.model
    return _envelope(req, _new("resp"), chat.created, "incomplete" if incomplete else "completed", output,
                     _usage(chat.usage), incomplete, store)


async def stream_events(req: ResponsesRequest, chunks: AsyncIterator[ChatChunk | APIError],
                        keep: Callable[[dict[str, Any]], bool] | None = None) -> AsyncIterator[str]:
    """Translate the chat stream's chunks (and an engine error, as its last item) into the Responses API's events;
    ``keep`` (the store's) takes the final response before its event goes out, and says whether it kept it. A
    stream that ends in an error or is abandoned keeps nothing."""
    rid, created, seq = _new("resp"), int(time.time()), 0
    store = keep is not None

    def event(kind: str, **data: Any) -> str:
        nonlocal seq
        body = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield event("response.created", response=_envelope(req, rid, created, "in_progress", [], None, None, store))
    yield event("response.in_progress", response=_envelope(req, rid, created, "in_progress", [], None, None, store))
    output: list[dict[str, Any]] = []
    msg_id, text, usage, finish = None, "", None, None
    async for chunk in chunks:
        if isinstance(chunk, APIError):
            yield event("error", message=chunk.message, code=chunk.code, param=chunk.param)
            return
        usage = chunk.usage or usage
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            delta = ch.delta
            if delta.content:
                if msg_id is None:
                    msg_id = _new("msg")
                    item = _message_item("", "in_progress", msg_id)
                    item["content"] = []
                    yield event("response.output_item.added", output_index=len(output), item=item)
                    yield event("response.content_part.added", item_id=msg_id, output_index=len(output),
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                text += delta.content
                yield event("response.output_text.delta", item_id=msg_id, output_index=len(output),
                            content_index=0, delta=delta.content, logprobs=[])
            for call in delta.tool_calls or []:
                if msg_id is not None:
                    for e in _close_message(event, msg_id, len(output), text):
                        yield e
                    output.append(_message_item(text, item_id=msg_id))
                    msg_id = None
                item = _call_item(call["id"], call["function"]["name"], call["function"]["arguments"])
                yield event("response.output_item.added", output_index=len(output),
                            item={**item, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=len(output), delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=len(output), name=item["name"], arguments=item["arguments"])
                yield event("response.output_item.done", output_index=len(output), item=item)
                output.append(item)
    if msg_id is not None:
        for e in _close_message(event, msg_id, len(output), text):
            yield e
        output.append(_message_item(text, item_id=msg_id))
    incomplete = "max_output_tokens" if finish == "length" else None
    final = _envelope(req, rid, created, "incomplete" if incomplete else "completed", output,
                      _usage(usage) if usage else None, incomplete, store)
    if keep is not None:
        final["store"] = keep(final)
    yield event("response.incomplete" if incomplete else "response.completed", response=final)


def _close_message(event: Callable[..., str], msg_id: str, index: int, text: str) -> list[str]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return [event("response.output_text.done", item_id=msg_id, output_index=index, content_index=0, text=text,
                  logprobs=[]),
            event("response.content_part.done", item_id=msg_id, output_index=index, content_index=0, part=part),
            event("response.output_item.done", output_index=index, item=_message_item(text, item_id=msg_id))]
