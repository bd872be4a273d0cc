"""`keepwarm serve --grpc`: the gRPC API of ``worker/grpc/keepwarm.proto`` (service ``keepwarm.v1.Keepwarm``).

A ``grpc.aio`` server on its own event loop in a background thread, beside uvicorn's loop in the main thread
(``AsyncEngine.generate`` binds each request's output queue to the loop that calls it). Rules (docs/reliability.md):
- A request is read as /v1/completions' own model (``CompletionRequest``, keepwarm.worker.openai.protocol) through
  the HTTP route's helpers, so every limit is defined once and holds on both front ends; a bad one is
  INVALID_ARGUMENT, one line led by the gRPC field's path (``sampling_params.n: ...``, ``prompt_token_ids.3: ...``),
  an unknown model NOT_FOUND, a message over ``--max-request-body-mb`` RESOURCE_EXHAUSTED (from gRPC itself).
- Admission and the request budget are HTTP's (keepwarm.worker.http.budget, limits.Admission): a Generate holds one
  seat per sequence (``n``) until its stream ends; past the server's seats it is RESOURCE_EXHAUSTED.
- A client that cancels its stream cancels the handler, which aborts the request (its KV blocks are freed).
- ``--api-key``: Generate and Models need the ``authorization`` metadata ``Bearer <key>``, else UNAUTHENTICATED;
  Health stays open, as /health does. A request that fails inside the engine ends with INTERNAL; an engine that
  cannot go on with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc
import pydantic
from google.protobuf.message import DecodeError

from keepwarm.formats.version import __version__
from keepwarm.worker.grpc.grpc_gen import keepwarm_pb2 as pb
from keepwarm.worker.grpc.grpc_gen import keepwarm_pb2_grpc as pb_grpc
from keepwarm.worker.http import pipeline
from keepwarm.worker.http.limits import Seats, check_prompt_chars
from keepwarm.worker.http.state import ServerState
from keepwarm.worker.lora import LoRAAdapter
from keepwarm.worker.openai.protocol import APIError, CompletionRequest, bad_request, field_error, new_id
from keepwarm.worker.outputs import RequestOutput
from keepwarm.worker.sampling_params import SamplingParams

log = logging.getLogger("keepwarm.grpc")

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 500: grpc.StatusCode.INTERNAL, 503: grpc.StatusCode.UNAVAILABLE}


def _one_line(message: str) -> str:
    return " ".join(message.split())


# -- validation: the request as HTTP's CompletionRequest (one definition of every limit) --------------------------
def completion_request(request: pb.GenerateRequest) -> CompletionRequest:
    """The message as /v1/completions' body, validated by its model; APIError (400) naming the gRPC field.

    The sampling fields carry the model's names. An unset ``optional`` field, or a plain proto3 field at its zero
    value, is left out, so the model's default applies, as for a JSON body without it."""
    body: dict[str, Any] = {name: getattr(request, name) for name in ("model", "request_id")
                            if request.HasField(name)}
    kind = request.WhichOneof("input")
    if kind is None:
        raise bad_request("prompt: the request needs a prompt or prompt_token_ids", "prompt")
    body["prompt"] = request.prompt if kind == "prompt" else list(request.prompt_token_ids.ids)
    for f, value in request.sampling_params.ListFields():
        body[f.name] = value if isinstance(value, str | bytes | int | float) else list(value)
    try:
        return CompletionRequest.model_validate(body)
    except pydantic.ValidationError as e:
        raise _grpc_error(e.errors(), body) from None


def _grpc_error(errors: list[Any], body: dict[str, Any]) -> APIError:
    """pydantic's error (as HTTP picks it: protocol.field_error) as a 400 led by the gRPC path of the field."""
    loc, message = field_error(errors)
    top = str(loc[0]) if loc else "prompt"
    if top == "prompt":
        name = "prompt" if isinstance(body.get("prompt"), str) else "prompt_token_ids"
    else:
        name = top if top in ("model", "request_id") else f"sampling_params.{top}"
    path = ".".join([name, *map(str, loc[1:])])
    return bad_request(f"{path}: {message}", path)


def _prepare(state: ServerState, request: pb.GenerateRequest
             ) -> tuple[CompletionRequest, list[int], str | None, SamplingParams, LoRAAdapter | None]:
    """(the request, prompt token ids, prompt text, sampling params, LoRA adapter), or APIError as the HTTP
    route (routes/completions.py) would answer the same body, its message led by the gRPC field's path."""
    req = completion_request(request)
    field = "prompt" if isinstance(req.prompt, str) else "prompt_token_ids"
    try:
        lora = pipeline.resolve_model(state, req.model)
        state.budget.check_sequences(1, req.n)  # keepwarm.worker.http.budget, as HTTP
        if isinstance(req.prompt, str):
            text: str | None = req.prompt
            check_prompt_chars(len(req.prompt), state.engine.max_model_len, state.token_chars, "prompt")
            ids = state.tokenizer.encode(req.prompt)  # as /v1/completions tokenizes a string prompt
        else:
            text, ids = None, [int(t) for t in req.prompt]  # type: ignore[arg-type]  # the oneof's other member
            vocab = state.engine.model_config.vocab_size
            if any(t >= vocab for t in ids):
                raise bad_request(f"token ids must be in [0, {vocab})", "prompt")
        max_tokens = pipeline.check_length(state, len(ids), req.max_tokens)
        return req, ids, text, pipeline.request_params(req, max_tokens, req.logprobs), lora
    except APIError as e:
        raise _at_grpc_path(e, field) from None


def _at_grpc_path(e: APIError, prompt_field: str) -> APIError:
    """``e`` (raised by the HTTP route's helpers, ``param`` HTTP's name) with its message led by the gRPC path:
    the prompt is ``prompt_field`` (the helpers say prompt or messages), sampling fields are in sampling_params."""
    param = e.param or ""
    path = prompt_field if param in ("prompt", "messages") else param if param in ("model", "request_id") \
        else f"sampling_params.{param}" if param else ""
    message = e.message if not path or e.message.startswith(path) else f"{path}: {e.message}"
    return APIError(e.status, message, e.type, path or None, e.code)


# -- decoding: a string that is not UTF-8 is the client's error, named like any other ---------------------------
# GenerateRequest's string fields by number (sampling_params: its own, stop), for the wire walk below.
STRING_FIELDS: dict[int, Any] = {1: "model", 2: "prompt", 5: "request_id", 4: ("sampling_params", {10: "stop"})}


def decode_generate(data: bytes) -> pb.GenerateRequest | APIError:
    """The request, or (protobuf refused it: a string field that is not UTF-8, or bytes that are no message) the
    400 naming the field, which Generate answers with INVALID_ARGUMENT: never the UNKNOWN gRPC says for a
    deserializer's exception."""
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as e:
        where = _not_utf8(data, STRING_FIELDS)
        return bad_request(f"{where}: not valid UTF-8 text" if where else
                           f"not a keepwarm.v1.GenerateRequest: {_one_line(str(e))}", where)


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not byte & 0x80:
            return value, i


def _not_utf8(data: bytes, fields: dict[int, Any]) -> str | None:
    """The path of the first string field in ``data`` (protobuf's wire format; ``fields``: number -> name, or (name,
    its message's fields)) whose bytes are not UTF-8; None if every one is, or if the bytes are no message."""
    i = 0
    try:
        while i < len(data):
            key, i = _varint(data, i)
            wire, spec = key & 7, fields.get(key >> 3)
            if wire == 0:
                i = _varint(data, i)[1]
            elif wire in (1, 5):
                i += 8 if wire == 1 else 4
            elif wire == 2:
                n, i = _varint(data, i)
                chunk, i = data[i:i + n], i + n
                if isinstance(spec, str) and not _is_utf8(chunk):
                    return spec
                if isinstance(spec, tuple) and (inner := _not_utf8(chunk, spec[1])):
                    return f"{spec[0]}.{inner}"
            else:
                return None
    except IndexError:
        return None
    return None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def add_servicer(servicer: KeepwarmServicer, server: grpc.aio.Server) -> None:
    """``keepwarm_pb2_grpc.add_KeepwarmServicer_to_server`` with Generate's requests decoded by decode_generate."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=decode_generate,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            servicer.Health, request_deserializer=pb.HealthRequest.FromString,
            response_serializer=pb.HealthResponse.SerializeToString),
        "Models": grpc.unary_unary_rpc_method_handler(
            servicer.Models, request_deserializer=pb.ModelsRequest.FromString,
            response_serializer=pb.ModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("keepwarm.v1.Keepwarm", handlers),))
    server.add_registered_method_handlers("keepwarm.v1.Keepwarm", handlers)


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

    async def Generate(self, request: pb.GenerateRequest | APIError, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        state = self.state
        if isinstance(request, APIError):  # decode_generate could not read it
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return
        if state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
            return
        try:
            seats = state.admission.enter()  # as HTTP: one seat now, one per sequence once n is known
        except APIError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _one_line(e.message))
            return
        try:
            async for m in self._generate(request, context, seats):
                yield m
        finally:
            seats.release()

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, seats: Seats
                        ) -> AsyncIterator[pb.GenerateResponse]:
        state = self.state
        try:
            req, ids, text, params, lora = _prepare(state, request)
            seats.resize(req.n)
        except APIError as e:
            await context.abort(_CODES.get(e.status, grpc.StatusCode.INVALID_ARGUMENT), _one_line(e.message))
            return
        rid = req.request_id or new_id("cmpl")  # as HTTP: an empty id is none
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
        max_bytes = int(state.config.max_request_body_mb * (1 << 20))  # HTTP's body limit, for the same request
        server = grpc.aio.server(options=[("grpc.so_reuseport", reuse), ("grpc.max_receive_message_length", max_bytes)],
                                 interceptors=interceptors)
        add_servicer(KeepwarmServicer(state), server)
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
