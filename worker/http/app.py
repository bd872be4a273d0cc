"""The FastAPI app: the routers of ``keepwarm.worker.http.routes``, API-key auth, OpenAI-shaped errors, shutdown.

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (all streamable as server-sent
events), GET /v1/responses/{id} (with the response store), GET /v1/models, POST /tokenize, /detokenize, POST
/v1/load_lora_adapter, /v1/unload_lora_adapter, GET /health, GET|POST /ping, GET /version, GET /metrics, GET
/keepwarm/config (the effective config). With ``--api-key`` every route needs ``Authorization: Bearer <key>``
(the /v1 API, /tokenize, /detokenize, /keepwarm/config, the docs and /openapi.json) except /health, /ping,
/metrics and /version, which stay open, as in vLLM. Every error, whatever raised it, is OpenAI's error JSON; a
405 carries the router's ``Allow`` (the path's methods). The connection limits, the admission bound and the
schema's truth are in keepwarm.worker.http.limits and keepwarm.worker.http.openapi; the per-request budget in
keepwarm.worker.http.budget.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from keepwarm.formats.version import __version__
from keepwarm.worker.http import openapi
from keepwarm.worker.http.limits import AdmissionLimit, ConnectionLimits
from keepwarm.worker.http.metrics import ServerMetrics
from keepwarm.worker.http.routes import adapters, admin, chat, completions, models, responses, tokenize
from keepwarm.worker.http.state import ServerState
from keepwarm.worker.openai.protocol import APIError
from keepwarm.worker.openai.protocol import validation_error as protocol_validation_error

log = logging.getLogger("keepwarm.server")


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
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
    state.metrics = ServerMetrics(lambda: state.async_engine.snapshot, state.model_name, state.weights_info,
                                  state.restart_history, admission_refused=lambda: state.admission.refused)
    _add_auth(app, state.config.api_key)
    _add_error_handlers(app)
    for resource in (admin, models, adapters, completions, chat, responses, tokenize):
        app.include_router(resource.router(state))
    # Outermost last: a body is bounded and a stalled client timed out before admission counts it.
    app.add_middleware(AdmissionLimit, admission=state.admission, paths=GENERATION_PATHS)
    app.add_middleware(ConnectionLimits, max_body_bytes=int(state.config.max_request_body_mb * (1 << 20)),
                       timeout=state.config.client_timeout)
    if state.link is not None:
        app.add_middleware(CloseWhenHandingOver, state=state)
    openapi.install(app, openapi.facts_of(state))
    return app


GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


class ApiKeyMiddleware:
    """``--api-key``: every route but OPEN_PATHS needs ``Authorization: Bearer <key>`` (compared in constant time).
    Plain ASGI, not ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware wraps ``receive``, so a handler
    never saw its client disconnect (a plain completion whose client left ran to its length)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"] not in OPEN_PATHS
                and not hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""), self.expected)):
            response = JSONResponse(APIError(401, "Incorrect API key provided.", "authentication_error",
                                             code="invalid_api_key").body(), status_code=401)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class CloseWhenHandingOver:
    """Under the supervisor, once this worker hands over (``state.handing_over``), every response says
    ``Connection: close``: a client that reuses a kept-alive connection to this worker gets its answer here and then
    connects afresh, to the new worker. Closing idle connections ourselves instead would race with a client sending
    on one at that moment (the request would be lost: the failure this avoids)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and self.state.handing_over:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)


def _add_auth(app: FastAPI, api_key: str | None) -> None:
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(protocol_validation_error(list(e.errors())).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "NotFoundError", 405: "MethodNotAllowed"}.get(e.status_code, "invalid_request_error")
        # The router's headers go out with the error: a 405's Allow (RFC 9110) names the path's methods (sorted:
        # the router joins a set).
        headers = dict(e.headers or {})
        if "Allow" in headers:
            headers["Allow"] = ", ".join(sorted(m.strip() for m in headers["Allow"].split(",")))
        return JSONResponse(APIError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code,
                            headers=headers)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", "InternalServerError").body(),
                            status_code=500)
