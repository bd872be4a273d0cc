"""POST /v1/chat/completions: messages through the model's chat template, one prompt, n choices."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from keepwarm.worker.api import pipeline
from keepwarm.worker.api.limits import check_prompt_chars, offload
from keepwarm.worker.api.protocol import ChatCompletionRequest, bad_request, new_id, now
from keepwarm.worker.api.state import ServerState
from keepwarm.worker.sequence import TokenLogprob


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = tokenizer.decode([tid])
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]}
                        for x in lps]}


def _check_supported(req: ChatCompletionRequest) -> None:
    if req.tools and req.tool_choice != "none":
        raise bad_request("tools are not supported by this server", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request("only response_format {\"type\": \"text\"} is supported", "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")


async def prompt_ids(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """The messages (text parts only) rendered by the chat template and tokenized, off the event loop; 400 naming
    what is wrong. A request's own template needs ``--trust-request-chat-template``; rendering is sandboxed and
    bounded in time and size (keepwarm.worker.tokenizer)."""
    if req.chat_template is not None and not state.config.trust_request_chat_template:
        raise bad_request("a request's own chat_template is refused unless the server runs with "
                          "--trust-request-chat-template", "chat_template")
    messages = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request("only text content parts are supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        messages.append({"role": m.role, "content": content or ""})
    check_prompt_chars(sum(len(m["content"]) for m in messages), state.engine.max_model_len, state.token_chars,
                       "messages")
    tok = state.tokenizer

    def render() -> list[int]:
        text = tok.apply_chat_template(messages, chat_template=req.chat_template, tokenize=False,
                                       add_generation_prompt=req.add_generation_prompt and
                                       not req.continue_final_message,
                                       continue_final_message=req.continue_final_message,
                                       **(req.chat_template_kwargs or {}))
        return tok.encode(text, add_special_tokens=False)

    try:
        return await offload(render)
    except Exception as e:  # jinja errors, time/size limits, missing template
        raise bad_request(f"cannot apply the chat template: {' '.join(str(e).split())}",
                          "chat_template" if req.chat_template is not None else "messages") from None


def router(state: ServerState) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        lora = pipeline.resolve_model(state, req.model)
        _check_supported(req)
        ids = await prompt_ids(state, req)
        max_tokens = pipeline.check_length(state, len(ids), req.max_completion_tokens if req.max_completion_tokens
                                           is not None else req.max_tokens)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = pipeline.request_params(req, max_tokens, logprobs)
        rid = req.request_id or new_id("chatcmpl")
        created = now()
        name = req.model or state.model_name
        merged = pipeline.start(state, [ids], [None], params, lora, rid)
        tok = state.tokenizer

        if not req.stream:
            (out,) = await pipeline.collect(state, request, merged, 1)
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": chat_logprobs(tok, c.logprobs) if req.logprobs and c.logprobs else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
            completion_tokens = sum(len(c.token_ids) for c in out.outputs)
            return {"id": rid, "object": "chat.completion", "created": created, "model": name, "choices": choices,
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                              "total_tokens": len(ids) + completion_tokens}}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
            body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                                    "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return body

        async def chunks() -> AsyncGenerator[dict[str, Any], None]:
            tracker = pipeline.DeltaTracker(params.stop)
            completion_tokens = 0
            async with aclosing(merged):
                async for _i, out in merged:
                    for c in out.outputs:
                        d = tracker.advance(c.index, c)
                        if d.first:
                            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}])
                        new_lps = (c.logprobs or [])[d.token_start:]
                        lp = chat_logprobs(tok, new_lps) if req.logprobs and new_lps else None
                        if d.text or lp:
                            yield chunk([{"index": c.index, "delta": {"content": d.text}, "logprobs": lp,
                                          "finish_reason": None}])
                        if c.finished:
                            yield chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
                    if out.finished:
                        pipeline.observe(state, out)
                        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
            if include_usage:
                yield chunk([], {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                                 "total_tokens": len(ids) + completion_tokens})

        return StreamingResponse(pipeline.sse_events(chunks()), media_type="text/event-stream")

    return api
