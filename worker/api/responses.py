"""OpenAI's Responses API (``POST /v1/responses``), stateless, as a translation over the chat pipeline.

Rules:
- A Responses request becomes a chat request: ``instructions`` a system message; ``input`` a string (one user
  message) or items (messages with text parts, ``function_call`` and ``function_call_output`` items, which become
  assistant ``tool_calls`` and ``tool`` messages); ``tools`` (function tools only, flat Responses shape) and
  ``tool_choice``; ``text.format`` the ``response_format``; ``max_output_tokens`` the ``max_tokens``.
- Stateless: ``store`` is ignored with a warning (once), ``previous_response_id`` and ``conversation`` are a 400
  (nothing is kept to continue from); ``background: true`` is a 400 naming ``background`` (there is nothing to
  poll or cancel later: the answer comes in the request); built-in tools (web search, file search...) are a 400
  naming the type.
- The chat result becomes ``output`` items (a ``message`` with ``output_text``, then one ``function_call`` item
  per call); ``status`` is ``incomplete`` with ``max_output_tokens`` when the length limit ended it.
- Streaming sends OpenAI's event sequence (``response.created`` ... ``response.completed``), each with its
  ``sequence_number``, translated from the chat stream's chunks.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictInt

from keepwarm.worker.api.protocol import (
    INT64_MAX,
    INT64_MIN,
    INTEGRAL,
    MaxTokens,
    RequestBody,
    bad_request,
    warn_once,
)


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


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*msgs, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
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


def to_chat_request(req: ResponsesRequest) -> dict[str, Any]:
    """The chat request that computes this response (a 400 for what a stateless server cannot do)."""
    if req.previous_response_id is not None or req.conversation is not None:
        raise bad_request("this server is stateless: previous_response_id and conversation are not supported; "
                          "send the whole conversation as input", "previous_response_id")
    if req.background:
        raise bad_request("background: true is not supported: this server is stateless, so there is no response "
                          "to poll or cancel later; send background: false (or leave it out) to get the answer in "
                          "this request", "background")
    if req.store:
        warn_once("responses.store", "/v1/responses: store is ignored (this server is stateless: nothing is kept)")
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req), "stream": req.stream,
                            "tools": _tools(req.tools), "tool_choice": _tool_choice(req.tool_choice),
                            "parallel_tool_calls": req.parallel_tool_calls,
                            "response_format": _response_format(req.text), "max_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if not body["messages"]:
        raise bad_request("input is empty", "input")
    return {k: v for k, v in body.items() if v is not None}


def _envelope(req: ResponsesRequest, rid: str, created: int, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, incomplete: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": req.model,
            "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "temperature": req.temperature, "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}}, "store": False,
            "metadata": req.metadata or {}, "truncation": "disabled", "reasoning": None, "user": req.user}


def _usage(u: dict[str, int]) -> dict[str, Any]:
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _new("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": _new("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def from_chat_completion(req: ResponsesRequest, chat: dict[str, Any]) -> dict[str, Any]:
    choice = chat["choices"][0]
    msg = choice["message"]
    output = []
    if msg.get("content"):
        output.append(_message_item(msg["content"]))
    output += [_call_item(c) for c in msg.get("tool_calls") or []]
    incomplete = "max_output_tokens" if choice["finish_reason"] == "length" else None
    req.model = req.model or chat["model"]
    return _envelope(req, _new("resp"), chat["created"], "incomplete" if incomplete else "completed", output,
                     _usage(chat["usage"]), incomplete)


async def stream_events(req: ResponsesRequest, chat_sse: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
    """Translate the chat stream's server-sent chunks into the Responses API's events."""
    rid, created, seq = _new("resp"), int(time.time()), 0

    def event(kind: str, **data: Any) -> str:
        nonlocal seq
        body = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield event("response.created", response=_envelope(req, rid, created, "in_progress", [], None, None))
    yield event("response.in_progress", response=_envelope(req, rid, created, "in_progress", [], None, None))
    output: list[dict[str, Any]] = []
    msg_id, text, usage, finish = None, "", None, None
    async for raw in chat_sse:
        for line in (raw.decode() if isinstance(raw, bytes) else raw).splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                yield event("error", message=chunk["error"]["message"], code=chunk["error"].get("code"),
                            param=chunk["error"].get("param"))
                return
            usage = chunk.get("usage") or usage
            for ch in chunk.get("choices", []):
                finish = ch.get("finish_reason") or finish
                delta = ch.get("delta", {})
                if delta.get("content"):
                    if msg_id is None:
                        msg_id = _new("msg")
                        item = _message_item("", "in_progress", msg_id)
                        item["content"] = []
                        yield event("response.output_item.added", output_index=len(output), item=item)
                        yield event("response.content_part.added", item_id=msg_id, output_index=len(output),
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                    text += delta["content"]
                    yield event("response.output_text.delta", item_id=msg_id, output_index=len(output),
                                content_index=0, delta=delta["content"], logprobs=[])
                for call in delta.get("tool_calls") or []:
                    if msg_id is not None:
                        for e in _close_message(event, msg_id, len(output), text):
                            yield e
                        output.append(_message_item(text, item_id=msg_id))
                        msg_id = None
                    item = _call_item(call)
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
                      _usage(usage) if usage else None, incomplete)
    yield event("response.incomplete" if incomplete else "response.completed", response=final)


def _close_message(event: Callable[..., str], msg_id: str, index: int, text: str) -> list[str]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return [event("response.output_text.done", item_id=msg_id, output_index=index, content_index=0, text=text,
                  logprobs=[]),
            event("response.content_part.done", item_id=msg_id, output_index=index, content_index=0, part=part),
            event("response.output_item.done", output_index=index, item=_message_item(text, item_id=msg_id))]
