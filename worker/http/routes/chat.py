"""POST /v1/chat/completions: messages through the model's chat template, one prompt, n choices.

Tools and structured outputs: the tool mode (tool_calls.py) and the output constraint (structured_fields.py)
are decided before the prompt is built; a required or named tool choice, or a response format, is compiled into
the request's grammar (cached, off the event loop); the finished text becomes content and/or ``tool_calls``, and a
stream sends content and tool-call deltas as ToolStreamer releases them."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from keepwarm.worker.api import pipeline
from keepwarm.worker.api.chat_render import render_chat
from keepwarm.worker.api.protocol import ChatCompletionRequest, bad_request, new_id, now
from keepwarm.worker.api.state import ServerState
from keepwarm.worker.api.structured_fields import structured_spec
from keepwarm.worker.api.tool_calls import ToolMode, ToolStreamer, functions, parse_output, tool_grammar, tool_mode
from keepwarm.worker.outputs import CompletionOutput
from keepwarm.worker.sequence import TokenLogprob
from keepwarm.worker.structured import StructuredOutputs


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = tokenizer.decode([tid])
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]}
                        for x in lps]}


async def prompt_ids(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """The messages rendered by the chat template (tools, tool calls and results included) and tokenized, off the
    event loop and bounded (chat_render)."""
    return await render_chat(state, req)


def _constraint(state: ServerState, req: ChatCompletionRequest) -> tuple[ToolMode, StructuredOutputs | None]:
    """The request's tool mode and the one constraint it decodes under (a forced tool choice or a format)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    mode = tool_mode(req.tools, req.tool_choice, state.config.tool_call_parser,
                     state.config.enable_auto_tool_choice)
    spec = structured_spec(req)
    forced = tool_grammar(mode, req.tools, req.parallel_tool_calls)
    if forced is not None and spec is not None:
        raise bad_request(f"{spec.field} cannot be combined with a required or named tool_choice", spec.field)
    return mode, forced or spec


def router(state: ServerState) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        return await chat_completion(state, req, request)

    return api


async def chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request) -> Any:
    """The chat completion (a dict) or its stream (a StreamingResponse); /v1/responses runs through it too."""
    lora = pipeline.resolve_model(state, req.model)
    req.check_logit_bias(state.engine.model_config.vocab_size)
    pipeline.admit(state, request, 1, req.n)
    mode, spec = _constraint(state, req)
    known = set(functions(req.tools))
    ids = await prompt_ids(state, req)
    max_tokens = pipeline.check_length(state, len(ids), req.max_completion_tokens if req.max_completion_tokens
                                       is not None else req.max_tokens)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = pipeline.request_params(req, max_tokens, logprobs)
    await pipeline.compile_structured(state, spec, params)
    rid = req.request_id or new_id("chatcmpl")
    created = now()
    name = req.model or state.model_name
    merged = pipeline.start(state, [ids], [None], params, lora, rid)
    tok = state.tokenizer

    def finish_reason(c: CompletionOutput, called: bool) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call (auto / required); a named choice ends in "stop".
        if called and c.finish_reason == "stop" and mode.kind != "named":
            return "tool_calls"
        return c.finish_reason

    if not req.stream:
        (out,) = await pipeline.collect(state, request, merged, 1)
        choices = []
        for c in out.outputs:
            parsed = parse_output(mode, c.text, known)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.calls:
                message["tool_calls"] = [call.to_openai() for call in parsed.calls]
            choices.append({"index": c.index, "message": message,
                            "logprobs": chat_logprobs(tok, c.logprobs) if req.logprobs and c.logprobs
                            else None,
                            "finish_reason": finish_reason(c, bool(parsed.calls)),
                            "stop_reason": c.stop_reason})
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return {"id": rid, "object": "chat.completion", "created": created, "model": name, "choices": choices,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(ids) + completion_tokens}}

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
    completion_tokens = 0

    def usage() -> dict[str, int]:
        return {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                "total_tokens": len(ids) + completion_tokens}

    def chunk(choices: list[dict], final_usage: dict | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                                "choices": choices}
        if final_usage is not None or continuous:  # continuous_usage_stats: usage on every chunk
            body["usage"] = final_usage if final_usage is not None else usage()
        return body

    async def chunks() -> AsyncGenerator[dict[str, Any], None]:
        nonlocal completion_tokens
        tracker = pipeline.DeltaTracker(params.stop)
        streamers: dict[int, ToolStreamer] = {}
        called: dict[int, bool] = {}
        async with aclosing(merged):
            async for _i, out in merged:
                completion_tokens = sum(len(c.token_ids) for c in out.outputs)
                for c in out.outputs:
                    d = tracker.advance(c.index, c)
                    if d.first:
                        streamers[c.index] = ToolStreamer(mode, known)
                        yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                    # Content and tool-call deltas from the text streamable so far.
                    deltas = streamers[c.index].step(c.text[:d.text_start + len(d.text)], c.finished)
                    new_lps = (c.logprobs or [])[d.token_start:]
                    lp = chat_logprobs(tok, new_lps) if req.logprobs and new_lps else None
                    if lp and not deltas:
                        deltas = [{}]
                    for j, delta in enumerate(deltas):
                        called[c.index] = called.get(c.index, False) or "tool_calls" in delta
                        yield chunk([{"index": c.index, "delta": delta, "logprobs": lp if j == 0 else None,
                                      "finish_reason": None}])
                    if c.finished:
                        yield chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                      "finish_reason": finish_reason(c, called.get(c.index, False)),
                                      "stop_reason": c.stop_reason}])
        if include_usage:
            yield chunk([], usage())

    return StreamingResponse(pipeline.sse_events(chunks()), media_type="text/event-stream")
