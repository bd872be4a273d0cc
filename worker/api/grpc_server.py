"""`keepwarm serve --grpc`: the gRPC API of ``worker/api/keepwarm.proto`` (service ``keepwarm.v1.Keepwarm``).

A ``grpc.aio`` server on its own event loop in a background thread, beside uvicorn's loop in the main thread.
``AsyncEngine.generate`` binds each request's output queue to the loop that calls it, so both loops share the one
engine. Requests are checked as the HTTP server checks them (same helpers, same messages); a bad one ends with
INVALID_ARGUMENT, an unknown model with NOT_FOUND. A client that cancels its stream cancels the handler, which
closes the engine's stream and so aborts the request (its KV blocks are freed).

With ``--api-key``, Generate and Models need the ``authorization`` metadata ``Bearer <key>`` (the header the
HTTP API takes), else UNAUTHENTICATED; Health stays open, as /health does. A request that fails inside the
engine ends with INTERNAL; an engine that cannot go on with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc

from keepwarm.formats.version import __version__
from keepwarm.worker.api import pipeline
from keepwarm.worker.api.grpc_gen import keepwarm_pb2 as pb
from keepwarm.worker.api.grpc_gen import keepwarm_pb2_grpc as pb_grpc
from keepwarm.worker.api.limits import check_prompt_chars
from keepwarm.worker.api.protocol import APIError, bad_request, new_id
from keepwarm.worker.api.state import ServerState
from keepwarm.worker.lora import LoRAAdapter
from keepwarm.worker.outputs import RequestOutput
from keepwarm.worker.sampling_params import SamplingParams

log = logging.getLogger("keepwarm.grpc")

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND, 500: grpc.StatusCode.INTERNAL,
          503: grpc.StatusCode.UNAVAILABLE}
DEFAULT_MAX_TOKENS = 16  # SamplingParams' and /v1/completions' default
MAX_N = 16  # as the HTTP API


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _sampling_params(sp: pb.SamplingParams, max_tokens: int) -> SamplingParams:
    """keepwarm's SamplingParams from the message; APIError (400) naming the field for a bad value."""
    def opt(name: str, default: Any) -> Any:
        return getattr(sp, name) if sp.HasField(name) else default

    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(sp, name)
        if not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number, got {value!r}", name)
    n = opt("n", 1)
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", "n")
    return pipeline.sampling_params(lambda: SamplingParams(
            n=n, temperature=opt("temperature", 1.0), top_p=opt("top_p", 1.0), top_k=opt("top_k", 0),
            min_p=opt("min_p", 0.0), seed=opt("seed", None), presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty, repetition_penalty=opt("repetition_penalty", 1.0),
            stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids),
            include_stop_str_in_output=sp.include_stop_str_in_output, ignore_eos=sp.ignore_eos,
            max_tokens=max_tokens, min_tokens=sp.min_tokens, logprobs=opt("logprobs", None),
            skip_special_tokens=opt("skip_special_tokens", True)))


def _prepare(state: ServerState, request: pb.GenerateRequest
             ) -> tuple[list[int], str | None, SamplingParams, LoRAAdapter | None]:
    """(prompt token ids, prompt text, sampling params, LoRA adapter), or APIError as the HTTP server would."""
    lora = pipeline.resolve_model(state, request.model if request.HasField("model") else None)
    kind = request.WhichOneof("input")
    if kind == "prompt":
        if not request.prompt:
            raise bad_request("the prompt is empty", "prompt")
        text: str | None = request.prompt
        check_prompt_chars(len(request.prompt), state.engine.max_model_len, state.token_chars, "prompt")
        ids = state.tokenizer.encode(request.prompt)  # as /v1/completions tokenizes a string prompt
    elif kind == "prompt_token_ids":
        text, ids = None, list(request.prompt_token_ids.ids)
        vocab = state.engine.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt_token_ids")
    else:
        raise bad_request("the request needs a prompt or prompt_token_ids", "prompt")
    sp = request.sampling_params
    max_tokens = pipeline.check_length(state, len(ids),
                                       sp.max_tokens if sp.HasField("max_tokens") else DEFAULT_MAX_TOKENS)
    return ids, text, _sampling_params(sp, max_tokens), lora


class GrpcServerError(ValueError):
    """The gRPC server cannot start (e.g. its port is taken); `keepwarm serve` prints it as a one-line error."""


class KeepwarmServicer(pb_grpc.KeepwarmServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        state = self.state
        info = state.weights_info()
        ok = state.async_engine.running and not state.draining
        status = pb.HealthResponse.SERVING if ok else pb.HealthResponse.NOT_SERVING
        return pb.HealthResponse(status=status, weights_source=info["source"] or "",
                                 fingerprint=info["fingerprint"] or "", attach_seconds=float(info["attach_seconds"]),
                                 model=state.model_name, version=__version__)

    async def Models(self, request: pb.ModelsRequest, context: grpc.aio.ServicerContext) -> pb.ModelsResponse:
        return pb.ModelsResponse(ids=self.state.served_names, max_model_len=self.state.engine.max_model_len)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        state = self.state
        if state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
            return
        try:
            ids, text, params, lora = _prepare(state, request)
        except APIError as e:
            await context.abort(_CODES.get(e.status, grpc.StatusCode.INVALID_ARGUMENT), _one_line(e.message))
            return
        rid = request.request_id if request.HasField("request_id") else new_id("cmpl")
        tracker = pipeline.DeltaTracker(params.stop)
        done: set[int] = set()
        try:
            outputs = state.async_engine.generate(rid, ids, params, prompt=text, lora=lora)
            # Closing `outputs` (normally, on an error, or when a cancelled client cancels this handler) aborts
            # the request in the engine if it has not finished.
            async with aclosing(outputs):
                async for out in outputs:
                    messages = self._messages(rid, out, params, tracker, done)
                    if out.finished:
                        pipeline.observe(state, out)
                        usage = pb.Usage(prompt_tokens=len(out.prompt_token_ids),
                                         completion_tokens=sum(len(c.token_ids) for c in out.outputs))
                        if not messages:
                            messages.append(pb.GenerateResponse(request_id=rid))
                        messages[-1].usage.CopyFrom(usage)
                    for m in messages:
                        yield m
        except pipeline.ENGINE_ERRORS as e:
            err = pipeline.engine_error(e)  # a refused request is the client's; a dead engine is UNAVAILABLE
            code = grpc.StatusCode.UNAVAILABLE if state.draining else _CODES[err.status]
            await context.abort(code, _one_line(err.message))

    @staticmethod
    def _messages(rid: str, out: RequestOutput, params: SamplingParams, tracker: pipeline.DeltaTracker,
                  done: set[int]) -> list[pb.GenerateResponse]:
        """One message per choice with something new; text near a possible stop string is held back, as in HTTP."""
        messages = []
        for c in out.outputs:
            if c.index in done:
                continue
            d = tracker.advance(c.index, c)
            new_ids = c.token_ids[d.token_start:]
            if not (d.text or new_ids or c.finished):
                continue
            m = pb.GenerateResponse(request_id=rid, index=c.index, text=d.text, token_ids=new_ids)
            if params.logprobs is not None and c.logprobs:
                m.logprobs.extend(pb.TokenLogprob(token_id=x.token_id, logprob=x.logprob,
                                                  top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in x.top])
                                  for x in c.logprobs[d.token_start:])
            if c.finished:
                m.finish_reason = c.finish_reason  # type: ignore[assignment]  # set once finished
                if isinstance(c.stop_reason, str):
                    m.stop_str = c.stop_reason
                elif isinstance(c.stop_reason, int):
                    m.stop_token_id = c.stop_reason
                done.add(c.index)
            messages.append(m)
        return messages


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC but Health without ``authorization: Bearer <key>`` metadata (UNAUTHENTICATED)."""

    OPEN = frozenset({"/keepwarm.v1.Keepwarm/Health"})

    def __init__(self, api_key: str) -> None:
        self._expected = f"Bearer {api_key}".encode()

        async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "Incorrect API key provided.")

        self._refusals = {
            False: grpc.unary_unary_rpc_method_handler(refuse),
            True: grpc.unary_stream_rpc_method_handler(refuse),
        }

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        if handler_call_details.method in self.OPEN:
            return await continuation(handler_call_details)
        given = next((v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"), "")
        given = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given, self._expected):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # UNIMPLEMENTED, as without a key
        return self._refusals[bool(handler.response_streaming)]


class GrpcServer:
    """A running ``grpc.aio`` server on its own event loop and thread; ``stop(grace)`` from any other thread."""

    def __init__(self, state: ServerState, host: str, port: int) -> None:
        self._loop = asyncio.new_event_loop()
        self._server: grpc.aio.Server | None = None
        self._stopped = False
        ready: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(state, host, port, ready), name="keepwarm-grpc",
                                        daemon=True)
        self._thread.start()
        self.port = ready.result()  # re-raises a failure to bind
        self.address = f"{_host(host)}:{self.port}"

    def _run(self, state: ServerState, host: str, port: int, ready: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start(state, host, port, ready))
        except BaseException as e:  # noqa: BLE001 - handed to the starting thread
            ready.set_exception(e)
        else:
            self._loop.run_forever()
        finally:
            try:
                tasks = asyncio.all_tasks(self._loop)
                for t in tasks:
                    t.cancel()
                self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                self._loop.close()

    async def _start(self, state: ServerState, host: str, port: int, ready: concurrent.futures.Future) -> None:
        # No SO_REUSEPORT: a port another process serves must fail to bind here rather than be shared silently.
        # Except under the supervisor (`serve --zygote`): its old and new worker share the port across a handoff
        # (restarts are serialised, so no more than those two), and the old one stops its gRPC server on Drain.
        interceptors = [ApiKeyInterceptor(state.config.api_key)] if state.config.api_key else []
        reuse = 1 if state.link is not None else 0
        server = grpc.aio.server(options=[("grpc.so_reuseport", reuse)], interceptors=interceptors)
        pb_grpc.add_KeepwarmServicer_to_server(KeepwarmServicer(state), server)
        try:
            bound = server.add_insecure_port(f"{_host(host)}:{port}")
        except RuntimeError:
            raise GrpcServerError(f"gRPC cannot listen on {_host(host)}:{port} (in use? choose another with "
                                  "--grpc-port)") from None
        await server.start()
        self._server = server
        ready.set_result(bound)

    def stop(self, grace: float | None = None) -> None:
        """Stop taking RPCs, give in-flight ones ``grace`` seconds (then cancel them), and end the thread."""
        if self._stopped:
            return
        self._stopped = True
        if self._server is not None and self._loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop)
            try:
                fut.result(timeout=(grace or 0) + 10)
            except Exception:  # noqa: BLE001 - shutting down regardless
                log.exception("gRPC server did not stop cleanly")
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def start_grpc_server(state: ServerState, host: str, port: int) -> GrpcServer:
    """Serve ``keepwarm.v1.Keepwarm`` on ``host:port`` (port 0: any free port, see ``.port``) until ``stop()``."""
    server = GrpcServer(state, host, port)
    print(f"  gRPC keepwarm.v1.Keepwarm on {server.address}", flush=True)
    return server
