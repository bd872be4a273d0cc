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

from keepwarm.worker.http import pipeline
from keepwarm.worker.http.state import ServerState
from keepwarm.worker.openai.chat_output import (
    ChatChoice,
    ChatChunk,
    ChatCompletion,
    ChatDelta,
    ChunkChoice,
    Usage,
)
from keepwarm.worker.openai.protocol import ChatCompletionRequest, bad_request, new_id, now
from keepwarm.worker.openai.structured_fields import structured_spec
from keepwarm.worker.openai.tool_calls import ToolMode, ToolStreamer, functions, parse_output, tool_grammar, tool_mode
from keepwarm.worker.outputs import CompletionOutput, TokenLogprob
from keepwarm.worker.structured import StructuredOutputs

ChatStream = AsyncGenerator[ChatChunk, None]


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = tokenizer.decode([tid])
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]}
                        for x in lps]}


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
        result = await chat_completion(state, req, request)
        if isinstance(result, ChatCompletion):
            return result.to_dict()
        return StreamingResponse(pipeline.sse_events(_dicts(result)), media_type="text/event-stream")

    return api


async def _dicts(chunks: ChatStream) -> AsyncGenerator[dict[str, Any], None]:
    async with aclosing(chunks):
        async for chunk in chunks:
            yield chunk.to_dict()


async def chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request
                          ) -> ChatCompletion | ChatStream:
    """The chat completion, or its stream of chunks (nothing runs until it is iterated; closing it aborts the
    request), as typed objects that the chat route and /v1/responses each serialize."""
    lora = pipeline.resolve_model(state, req.model)
    req.check_logit_bias(state.engine.model_config.vocab_size)
    pipeline.admit(state, request, 1, req.n)
    mode, spec = _constraint(state, req)
    known = set(functions(req.tools))
    ids = await pipeline.render_chat(state, req)
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
            choices.append(ChatChoice(c.index, parsed.content, parsed.calls,
                                      chat_logprobs(tok, c.logprobs) if req.logprobs and c.logprobs else None,
                                      finish_reason(c, bool(parsed.calls)), c.stop_reason))
        return ChatCompletion(rid, created, name, choices,
                              Usage(len(ids), sum(len(c.token_ids) for c in out.outputs)))

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
    completion_tokens = 0

    def chunk(choices: list[ChunkChoice], final: bool = False) -> ChatChunk:
        # continuous_usage_stats: usage on every chunk
        usage = Usage(len(ids), completion_tokens) if final or continuous else None
        return ChatChunk(rid, created, name, choices, usage)

    async def chunks() -> ChatStream:
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
                        yield chunk([ChunkChoice(c.index, ChatDelta(role="assistant", content=""))])
                    # Content and tool-call deltas from the text streamable so far.
                    deltas = streamers[c.index].step(c.text[:d.text_start + len(d.text)], c.finished)
                    new_lps = (c.logprobs or [])[d.token_start:]
                    lp = chat_logprobs(tok, new_lps) if req.logprobs and new_lps else None
                    if lp and not deltas:
                        deltas = [{}]
                    for j, delta in enumerate(deltas):
                        called[c.index] = called.get(c.index, False) or "tool_calls" in delta
                        yield chunk([ChunkChoice(c.index, ChatDelta(**delta), lp if j == 0 else None)])
                    if c.finished:
                        reason = finish_reason(c, called.get(c.index, False))
                        yield chunk([ChunkChoice(c.index, ChatDelta(), None, reason, c.stop_reason, last=True)])
        if include_usage:
            yield chunk([], final=True)

    return chunks()
