"""`keepwarm serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn) over the async engine.

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (all streamable as server-sent
events), GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET|POST /ping, GET /version, GET /metrics,
GET /keepwarm/config (the effective config). With ``--api-key`` every
/v1 route needs ``Authorization: Bearer <key>``; /health, /metrics, /version stay open, as in vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from keepwarm.formats.version import __version__
from keepwarm.worker.api.chat_render import render_chat
from keepwarm.worker.api.config import ServerConfig
from keepwarm.worker.api.metrics import CONTENT_TYPE, ServerMetrics
from keepwarm.worker.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRARequest,
    TokenizeRequest,
    UnloadLoRARequest,
    bad_request,
    new_id,
    now,
)
from keepwarm.worker.api.responses import ResponsesRequest, from_chat_completion, stream_events, to_chat_request
from keepwarm.worker.api.structured_fields import structured_spec
from keepwarm.worker.api.tool_calls import ToolStreamer, functions, parse_output, tool_grammar, tool_mode
from keepwarm.worker.async_engine import AsyncEngine
from keepwarm.worker.detokenizer import stop_hold_back, streamable_end
from keepwarm.worker.engine import LLMEngine, RequestError
from keepwarm.worker.outputs import CompletionOutput, RequestOutput
from keepwarm.worker.sampling_params import SamplingParams, SamplingParamsError
from keepwarm.worker.sequence import TokenLogprob
from keepwarm.worker.structured import GrammarError, StructuredOutputs

log = logging.getLogger("keepwarm.server")

SWITCH_INTERVAL_S = 0.0005


@dataclass
class ServerState:
    config: ServerConfig
    engine: LLMEngine
    async_engine: AsyncEngine
    served_names: list[str]
    started_at: float = field(default_factory=time.time)
    draining: bool = False
    metrics: ServerMetrics | None = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    def weights_info(self) -> dict[str, Any]:
        loaded = self.engine.loaded
        return {"source": loaded.source, "attach_seconds": loaded.seconds, "bytes": loaded.nbytes,
                "fingerprint": loaded.fingerprint, "fallback_reason": loaded.fallback_reason}


# -- helpers ---------------------------------------------------------------------------------------------------------
def _resolve_model(state: ServerState, name: str | None):
    """The LoRA adapter the request names (None for the base model); 404 in OpenAI's shape for an unknown model.

    The adapter object (not its name) travels with the request, so a concurrent unload + load under the same name
    cannot swap the weights a request runs with: the engine refuses a request whose adapter is no longer loaded."""
    if name is None or name in state.served_names:
        return None
    adapter = state.engine.loras.get(name)
    if adapter is not None and not adapter.unloading:
        return adapter
    raise APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model", "model_not_found")


def _check_length(state: ServerState, prompt_len: int, max_tokens: int | None) -> int:
    limit = state.engine.max_model_len
    if prompt_len == 0:
        raise bad_request("the prompt is empty", "prompt")
    if max_tokens is None:
        max_tokens = limit - prompt_len
    if max_tokens < 1:
        if prompt_len >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your request has "
                              f"{prompt_len} input tokens. Please reduce the length of the input.", "messages")
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if prompt_len + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
                          "completion). Please reduce the length of the messages or completion.", "max_tokens")
    return max_tokens


def _params(req: Any, max_tokens: int, logprobs: int | None) -> SamplingParams:
    try:
        return req.sampling(max_tokens, logprobs, max_tokens)
    except SamplingParamsError as e:
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from None


def _completion_logprobs(tokenizer, lps: list[TokenLogprob], text_offset0: int) -> dict[str, Any]:
    tokens = [tokenizer.decode([x.token_id]) for x in lps]
    offsets, pos = [], text_offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in x.top} for x in lps],
            "text_offset": offsets}


def _join_logprobs(prompt: dict[str, Any] | None, output: dict[str, Any]) -> dict[str, Any]:
    """Echo: the prompt's logprobs (first token: None, as vLLM) followed by the output's."""
    if prompt is None:
        return output
    return {k: prompt[k] + output[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _vllm_prompt_logprobs(tokenizer, lps: list[TokenLogprob | None] | None) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, {token id: {logprob, rank, decoded_token}} (None first)."""
    if lps is None:
        return None
    out: list[dict | None] = []
    for x in lps:
        if x is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": lp, "rank": r + 1, "decoded_token": tokenizer.decode([t])}
                 for r, (t, lp) in enumerate(x.top)}
        entry[str(x.token_id)] = {"logprob": x.logprob, "rank": x.rank,
                                  "decoded_token": tokenizer.decode([x.token_id])}
        out.append(entry)
    return out


def _chat_logprobs(tokenizer, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = tokenizer.decode([tid])
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]}
                        for x in lps]}


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come; closing this closes (aborts) them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(it):
                async for out in it:
                    await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# -- the app ---------------------------------------------------------------------------------------------------------
def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        # Shutdown: HTTP has stopped accepting and drained (or timed out). Requests from other front ends (gRPC
        # streams) get the rest of the shutdown timeout; then release the engine and the weights' lease.
        deadline = time.monotonic() + state.config.shutdown_timeout
        while state.async_engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        state.async_engine.shutdown()
        state.engine.close()

    app = FastAPI(title="keepwarm", version=__version__, lifespan=lifespan)
    app.state.keepwarm = state
    state.metrics = ServerMetrics(lambda: state.async_engine.snapshot, state.model_name, state.weights_info)
    api_key = state.config.api_key

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            if header != f"Bearer {api_key}":
                return JSONResponse(APIError(401, "Incorrect API key provided.", "authentication_error",
                                             code="invalid_api_key").body(), status_code=401)
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        if first.get("type") == "json_invalid":
            msg, param = "the request body is not valid JSON", None
        else:
            msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
            param = loc[0] if loc else None
        return JSONResponse(bad_request(msg, param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException):
        kind = {404: "NotFoundError", 405: "MethodNotAllowed"}.get(e.status_code, "invalid_request_error")
        return JSONResponse(APIError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, e: Exception):
        log.exception("internal error")
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", "InternalServerError").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        info = state.weights_info()
        ok = state.async_engine.running and not state.draining
        body = {"status": "ok" if ok else ("draining" if state.draining else "engine stopped"),
                "weights": info, "model": state.model_name, "version": __version__}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/version")
    async def version():
        return {"version": __version__, "torch": torch.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/keepwarm/config")
    async def effective_config():
        cfg = state.config.to_dict()
        cfg.pop("api_key", None)  # never echo the secret
        adapters = [{"name": a.name, "path": a.path, "digest": a.digest, "rank": a.rank}
                    for a in list(state.engine.loras.values())]
        return {"config": cfg, "weights": state.weights_info(), "model_dir": str(state.engine.model_dir),
                "adapters": adapters}

    @app.get("/v1/models")
    async def models():
        created = int(state.started_at)
        data = [{"id": name, "object": "model", "created": created, "owned_by": "keepwarm",
                 "root": str(state.engine.model_dir), "parent": None, "max_model_len": state.engine.max_model_len}
                for name in state.served_names]
        data += [{"id": a.name, "object": "model", "created": created, "owned_by": "keepwarm", "root": a.path,
                  "parent": state.model_name, "max_model_len": state.engine.max_model_len}
                 for a in list(state.engine.loras.values()) if not a.unloading]
        return {"object": "list", "data": data}

    def runtime_updates() -> None:
        if not state.config.enable_lora:
            raise bad_request("LoRA is not enabled (--enable-lora)")
        if not state.config.enable_lora_runtime_updates:
            raise bad_request("runtime LoRA updates are disabled (--enable-lora-runtime-updates)")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRARequest):
        runtime_updates()
        name, path = req.lora_name, req.lora_path
        if not name or not path:
            raise bad_request("lora_name and lora_path are required", "lora_name" if not name else "lora_path")
        if name in state.served_names:
            raise bad_request(f"{name!r} is the base model's name", "lora_name")
        if name in state.engine.loras:
            raise bad_request(f"an adapter named {name!r} is already loaded", "lora_name")
        from keepwarm.worker.lora import LoRAError
        from keepwarm.worker.lora_loader import load_adapter

        try:
            adapter = await asyncio.to_thread(load_adapter, state.engine, name, path)
            await state.async_engine.call(lambda engine: engine.add_lora(adapter))
        except LoRAError as e:
            raise bad_request(str(e), "lora_path") from None
        log.info("adapter %s loaded from %s at run time", name, path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRARequest):
        runtime_updates()
        name = req.lora_name
        adapter = state.engine.loras.get(name)
        if adapter is None or adapter.unloading:
            raise APIError(404, f"no adapter named {name!r} is loaded", "NotFoundError", "lora_name")
        from keepwarm.worker.lora import LoRAError

        adapter.unloading = True  # new requests for it are refused from now on
        deadline = time.monotonic() + state.config.shutdown_timeout
        try:
            while await state.async_engine.call(lambda engine: engine.lora_requests_in_flight(name)):
                if time.monotonic() > deadline:
                    adapter.unloading = False
                    raise APIError(409, f"adapter {name!r} still has requests in flight after "
                                        f"{state.config.shutdown_timeout:.0f}s; not unloaded", "ConflictError")
                await asyncio.sleep(0.05)
            await state.async_engine.call(lambda engine: engine.remove_lora(name))
        except LoRAError as e:
            adapter.unloading = False
            raise bad_request(str(e), "lora_name") from None
        log.info("adapter %s unloaded at run time", name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    async def run_requests(request: Request, prompts: list[list[int]], texts: list[str | None],
                           params: SamplingParams, lora, base_id: str):
        engine = state.async_engine
        streams = [engine.generate(f"{base_id}-{i}", ids, params, prompt=text, lora=lora)
                   for i, (ids, text) in enumerate(zip(prompts, texts, strict=True))]
        return _merge(streams)

    def _observe(out: RequestOutput) -> None:
        m = out.metrics
        if m is not None and m.finished_time is not None:
            n = max((len(c.token_ids) for c in out.outputs), default=0)
            state.metrics.observe_request(m.arrival_time, m.first_token_time, m.finished_time, n)

    async def collect(request: Request, merged: AsyncIterator[tuple[int, RequestOutput]],
                      num: int) -> list[RequestOutput]:
        """Run to completion, aborting if the client goes away."""
        finals: list[RequestOutput | None] = [None] * num

        async def consume() -> None:
            async with aclosing(merged):
                async for i, out in merged:
                    if out.finished:
                        finals[i] = out
                        _observe(out)

        task = asyncio.create_task(consume())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(499, "client disconnected", "ClientDisconnected")
        await task  # re-raises the engine's error, if any
        return finals  # type: ignore[return-value]

    def engine_errors(e: Exception) -> APIError:
        if isinstance(e, RequestError):
            return bad_request(str(e))
        return APIError(503, f"the engine cannot serve: {e}", "ServiceUnavailable")

    # -- completions -----------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        salt = _resolve_model(state, req.model)
        if req.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of is not supported (it must equal n)", "best_of")
        tok = state.tokenizer
        p = req.prompt
        if isinstance(p, str):
            prompts, texts = [tok.encode(p)], [p]
        elif p and all(isinstance(x, str) for x in p):
            prompts, texts = [tok.encode(x) for x in p], list(p)
        elif p and all(isinstance(x, int) for x in p):
            prompts, texts = [list(p)], [None]
        elif p and all(isinstance(x, list) for x in p):
            prompts, texts = [list(x) for x in p], [None] * len(p)
        else:
            raise bad_request("prompt must be a string, a list of strings, or token ids", "prompt")
        vocab = state.engine.model_config.vocab_size
        for ids in prompts:
            if any(t < 0 or t >= vocab for t in ids):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        max_tokens = min(_check_length(state, len(ids), req.max_tokens) for ids in prompts)
        params = _params(req, max_tokens, req.logprobs)
        if req.echo and req.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = req.logprobs  # the echoed prompt's tokens carry logprobs too (as vLLM)
        await compile_structured(structured_spec(req), params)
        rid = req.request_id or new_id("cmpl")
        created = now()
        name = req.model or state.model_name
        try:
            merged = await run_requests(request, prompts, texts, params, salt, rid)
        except (RequestError, RuntimeError) as e:
            raise engine_errors(e) from None

        def choice_logprobs(c: CompletionOutput, start: int, end: int, offset0: int) -> dict | None:
            if req.logprobs is None or c.logprobs is None:
                return None
            return _completion_logprobs(tok, c.logprobs[start:end], offset0)

        def echo_logprobs(out: RequestOutput) -> dict | None:
            if req.logprobs is None or out.prompt_logprobs is None:
                return None
            first = tok.decode([out.prompt_token_ids[0]])  # no logprob: nothing comes before it
            rest = _completion_logprobs(tok, out.prompt_logprobs[1:], len(first))
            return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
                    "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}

        if not req.stream:
            try:
                finals = await collect(request, merged, len(prompts))
            except (RequestError, RuntimeError) as e:
                raise engine_errors(e) from None
            choices, prompt_tokens, completion_tokens = [], 0, 0
            for i, out in enumerate(finals):
                prompt_tokens += len(out.prompt_token_ids)
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    prompt_text = texts[i] or tok.decode(out.prompt_token_ids)
                    text = prompt_text + c.text if req.echo else c.text
                    lps = choice_logprobs(c, 0, len(c.token_ids), len(prompt_text) if req.echo else 0)
                    if req.echo and lps is not None:
                        lps = _join_logprobs(echo_logprobs(out), lps)
                    choice = {"index": i * req.n + c.index, "text": text, "logprobs": lps,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    if req.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = _vllm_prompt_logprobs(tok, out.prompt_logprobs)
                    choices.append(choice)
            return {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices,
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}}

        hold = stop_hold_back(params.stop)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def stream() -> AsyncIterator[str]:
            sent_text: dict[int, int] = {}
            sent_tokens: dict[int, int] = {}
            usage = {"prompt": 0, "completion": 0}
            try:
                async with aclosing(merged):
                    async for i, out in merged:
                        for c in out.outputs:
                            idx = i * req.n + c.index
                            if idx not in sent_text:
                                sent_text[idx], sent_tokens[idx] = 0, 0
                                if req.echo:
                                    yield _sse({"id": rid, "object": "text_completion", "created": created,
                                                "model": name, "choices": [{"index": idx, "text": texts[i] or
                                                                            tok.decode(out.prompt_token_ids),
                                                                            "logprobs": echo_logprobs(out),
                                                                            "finish_reason": None}]})
                            limit = streamable_end(c.text, sent_text[idx], c.finished, hold)
                            delta = c.text[sent_text[idx]:limit]
                            lp = choice_logprobs(c, sent_tokens[idx], len(c.token_ids), sent_text[idx])
                            if delta or c.finished or lp:
                                yield _sse({"id": rid, "object": "text_completion", "created": created,
                                            "model": name, "choices": [{
                                                "index": idx, "text": delta, "logprobs": lp,
                                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
                            sent_text[idx], sent_tokens[idx] = limit, len(c.token_ids)
                        if out.finished:
                            _observe(out)
                            usage["prompt"] += len(out.prompt_token_ids)
                            usage["completion"] += sum(len(c.token_ids) for c in out.outputs)
            except (RequestError, RuntimeError) as e:
                yield _sse(engine_errors(e).body())
                yield "data: [DONE]\n\n"
                return
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                            "choices": [], "usage": {"prompt_tokens": usage["prompt"],
                                                     "completion_tokens": usage["completion"],
                                                     "total_tokens": usage["prompt"] + usage["completion"]}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    # -- chat ------------------------------------------------------------------------------------------------
    async def compile_structured(spec: StructuredOutputs | None, params: SamplingParams) -> None:
        """Compile the request's constraint (cached) off the event loop; an invalid one is a 400 naming its field."""
        if spec is None:
            return
        try:
            params.structured = await asyncio.to_thread(lambda: state.engine.grammar_compiler.compile(spec))
        except GrammarError as e:
            raise bad_request(str(e), e.field) from None

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        salt = _resolve_model(state, req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        mode = tool_mode(req.tools, req.tool_choice, state.config.tool_call_parser,
                         state.config.enable_auto_tool_choice)
        known = set(functions(req.tools))
        spec = structured_spec(req)
        forced = tool_grammar(mode, req.tools, req.parallel_tool_calls)
        if forced is not None and spec is not None:
            raise bad_request(f"{spec.field} cannot be combined with a required or named tool_choice",
                              spec.field)
        spec = forced or spec
        tok = state.tokenizer
        ids = render_chat(tok, req)
        max_tokens = _check_length(state, len(ids), req.max_completion_tokens if req.max_completion_tokens
                                   is not None else req.max_tokens)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _params(req, max_tokens, logprobs)
        await compile_structured(spec, params)
        rid = req.request_id or new_id("chatcmpl")
        created = now()
        name = req.model or state.model_name
        try:
            merged = await run_requests(request, [ids], [None], params, salt, rid)
        except (RequestError, RuntimeError) as e:
            raise engine_errors(e) from None

        def finish_reason(c: CompletionOutput, called: bool) -> str | None:
            # OpenAI: "tool_calls" when the model chose to call (auto / required); a named choice ends in "stop".
            return "tool_calls" if called and c.finish_reason == "stop" and mode.kind != "named" else \
                c.finish_reason

        if not req.stream:
            try:
                (out,) = await collect(request, merged, 1)
            except (RequestError, RuntimeError) as e:
                raise engine_errors(e) from None
            choices = []
            for c in out.outputs:
                parsed = parse_output(mode, c.text, known)
                message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
                if parsed.calls:
                    message["tool_calls"] = [call.to_openai() for call in parsed.calls]
                choices.append({"index": c.index, "message": message,
                                "logprobs": _chat_logprobs(tok, c.logprobs) if req.logprobs and c.logprobs
                                else None,
                                "finish_reason": finish_reason(c, bool(parsed.calls)),
                                "stop_reason": c.stop_reason})
            completion_tokens = sum(len(c.token_ids) for c in out.outputs)
            return {"id": rid, "object": "chat.completion", "created": created, "model": name, "choices": choices,
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                              "total_tokens": len(ids) + completion_tokens}}

        hold = stop_hold_back(params.stop)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)

        async def stream() -> AsyncIterator[str]:
            completion_tokens = 0

            def usage() -> dict[str, int]:
                return {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                        "total_tokens": len(ids) + completion_tokens}

            def chunk(choices: list[dict], final_usage: dict | None = None) -> str:
                body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                        "choices": choices}
                if final_usage is not None or continuous:
                    body["usage"] = final_usage if final_usage is not None else usage()
                return _sse(body)

            sent_text: dict[int, int] = {}
            sent_tokens: dict[int, int] = {}
            streamers: dict[int, ToolStreamer] = {}
            called: dict[int, bool] = {}
            try:
                async with aclosing(merged):
                    async for _i, out in merged:
                        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
                        for c in out.outputs:
                            if c.index not in sent_text:
                                sent_text[c.index], sent_tokens[c.index] = 0, 0
                                streamers[c.index] = ToolStreamer(mode, known)
                                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}])
                            limit = streamable_end(c.text, sent_text[c.index], c.finished, hold)
                            deltas = streamers[c.index].step(c.text[:limit], c.finished)
                            new_lps = (c.logprobs or [])[sent_tokens[c.index]:]
                            lp = _chat_logprobs(tok, new_lps) if req.logprobs and new_lps else None
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
                            sent_text[c.index], sent_tokens[c.index] = limit, len(c.token_ids)
                        if out.finished:
                            _observe(out)
            except (RequestError, RuntimeError) as e:
                yield _sse(engine_errors(e).body())
                yield "data: [DONE]\n\n"
                return
            if include_usage:
                yield chunk([], usage())
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    # -- Responses API, tokenizer endpoints, ping -------------------------------------------------------------
    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request):
        chat_req = ChatCompletionRequest(**to_chat_request(req))
        result = await chat(chat_req, request)
        if not req.stream:
            return from_chat_completion(req, result)
        req.model = req.model or state.model_name
        return StreamingResponse(stream_events(req, result.body_iterator), media_type="text/event-stream")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        _resolve_model(state, req.model)
        tok = state.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            ids = render_chat(tok, req)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids,
                                "token_strs": None}
        if req.return_token_strs:
            body["token_strs"] = [tok.convert_ids_to_tokens(t) for t in ids]
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        _resolve_model(state, req.model)
        vocab = state.engine.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """vLLM's (and SageMaker's) liveness route: /health's status code, no body."""
        ok = state.async_engine.running and not state.draining
        return Response(status_code=200 if ok else 503)

    return app


# -- running it ------------------------------------------------------------------------------------------------------
def systemd_socket() -> socket.socket | None:
    """The listening socket systemd passes (socket activation: LISTEN_PID is us, LISTEN_FDS >= 1, fd 3)."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    try:
        n = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return None
    if n < 1:
        return None
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)  # not inherited by children
    sock = socket.socket(fileno=3)
    sock.set_inheritable(False)  # e.g. a daemon the engine starts must not hold the listening socket
    sock.setblocking(False)
    return sock


def _listen_backlog() -> int:
    """The backlog to re-``listen()`` an inherited socket with: the kernel's maximum (``net.core.somaxconn``).

    asyncio calls ``listen()`` again on a socket it is given, which replaces the queue length systemd set
    (``Backlog=``); asking for the maximum never shrinks it, so connections that arrive while the server restarts
    keep waiting in the kernel's queue.
    """
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return int(f.read())
    except (OSError, ValueError):
        return socket.SOMAXCONN


def create_engine(config: ServerConfig) -> LLMEngine:
    from pathlib import Path

    from keepwarm.worker.engine import EngineConfig

    model = config.model
    if model is None:
        from keepwarm.worker.default_model import default_model

        model = str(default_model())
    engine_config = EngineConfig(
        model=model, tokenizer=config.tokenizer, dtype=config.dtype, max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
        num_gpu_blocks=config.num_gpu_blocks_override, kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization, kv_cache_dtype=config.kv_cache_dtype,
        seed=config.seed, device=config.device, enforce_eager=config.enforce_eager,
        quantization=config.quantization, daemon="start" if config.daemon else False,
        runtime_dir=str(Path(config.runtime_dir)) if config.runtime_dir else None, fingerprint=config.fingerprint,
        enable_lora=config.enable_lora, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras)
    engine = LLMEngine(engine_config)
    if config.lora_modules and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if config.enable_lora:
        from keepwarm.worker.lora import parse_lora_modules
        from keepwarm.worker.lora_loader import load_adapter

        for name, path in parse_lora_modules(config.lora_modules):
            engine.add_lora(load_adapter(engine, name, path))
    return engine


def serve(config: ServerConfig, process_start: float | None = None) -> int:
    """Load or attach, then serve until SIGTERM/SIGINT; drains in-flight requests for ``shutdown_timeout``."""
    import uvicorn

    from keepwarm.worker.api.tool_calls import PARSERS

    if config.tool_call_parser is not None and config.tool_call_parser not in PARSERS:
        raise ValueError(f"--tool-call-parser {config.tool_call_parser!r} is not one of {', '.join(PARSERS)}")
    if config.enable_auto_tool_choice and config.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if config.threads:
        torch.set_num_threads(config.threads)
    # The engine thread and the event loop hand the GIL back and forth every token; Python's default 5 ms switch
    # interval would add up to 5 ms of waiting per hand-off (measured: 32 vs 19 ms per token at concurrency 1).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    t0 = time.perf_counter()
    # Take systemd's socket (and drop LISTEN_*) before anything can start a child process.
    inherited = systemd_socket()
    async_engine = AsyncEngine(lambda: create_engine(config))
    names = config.served_model_name or [config.model or "SmolLM2-135M-Instruct"]
    state = ServerState(config, async_engine.engine, async_engine, names)
    app = build_app(state)
    grpc_server = None
    if config.grpc:
        from keepwarm.worker.api.grpc_server import start_grpc_server

        grpc_server = start_grpc_server(state, config.host, config.grpc_port)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
                               timeout_graceful_shutdown=config.shutdown_timeout, access_log=False,
                               **({"backlog": _listen_backlog()} if inherited else {}))

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not state.draining:
                log.info("signal %d: draining (up to %.0fs)", sig, config.shutdown_timeout)
            state.draining = True
            state.async_engine.stop_accepting()
            super().handle_exit(sig, frame)

    server = _Server(uv_config)
    info = state.weights_info()
    where = f"systemd socket fd 3 ({inherited.getsockname()})" if inherited else \
        f"http://{config.host}:{config.port}"
    source = (f"weights from the daemon, attached in {info['attach_seconds'] * 1e3:.0f} ms" if info["source"] ==
              "daemon" else f"weights from disk in {info['attach_seconds']:.2f}s "
                            f"({info['fallback_reason'] or 'daemon disabled'})")
    started = (time.perf_counter() - t0) if process_start is None else (time.time() - process_start)
    print(f"keepwarm {__version__} serving {names[0]} on {where}; {source}; ready {started:.2f}s after start",
          flush=True)
    if not inherited:
        print(f"  try: curl http://{config.host}:{config.port}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{names[0]}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}}'",
              flush=True)
    # uvicorn re-raises the signal it caught once it has shut down, under the handler that was installed
    # before it; make that one a no-op so a drained SIGTERM ends in exit status 0, not death by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[inherited] if inherited else None)
    finally:
        if grpc_server is not None:
            grpc_server.stop(grace=1.0)
    return 0
