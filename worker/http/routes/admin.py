"""GET /health, GET|POST /ping, /version, /metrics (open even with --api-key, as in vLLM) and /keepwarm/config
(behind the key)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from keepwarm.formats.version import __version__
from keepwarm.worker.async_engine import EffectiveConfig
from keepwarm.worker.http.metrics import CONTENT_TYPE
from keepwarm.worker.http.state import ServerState


def router(state: ServerState) -> APIRouter:
    api = APIRouter()

    @api.get("/health")
    async def health() -> JSONResponse:
        """200 only while the engine thread runs, no fatal error happened and the server is not draining."""
        info = state.weights_info()
        engine = state.async_engine
        ok = engine.running and not state.draining and state.fatal is None
        status = "ok" if ok else ("engine stopped" if not engine.running or state.fatal is not None else "draining")
        error = engine.errored or state.fatal
        body = {"status": status,
                "engine": {"running": engine.running,
                           "error": None if error is None else f"{type(error).__name__}: {error}",
                           "requests_in_flight": engine.num_in_flight,
                           "seconds_since_step": round(max(0.0, time.monotonic() - engine.snapshot.last_step_time),
                                                       3)},
                "weights": info, "model": state.model_name, "version": __version__,
                "startup": {k: round(v, 4) for k, v in state.startup.items()}}
        if state.link is not None:  # `serve --zygote`: the supervisor's restarts (a cold fallback says so here)
            body["restarts"] = {**(state.restart_history() or {}), "worker_pid": os.getpid()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @api.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (and SageMaker's) liveness route: /health's status code, no body."""
        ok = state.async_engine.running and not state.draining
        return Response(status_code=200 if ok else 503)

    @api.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__, "torch": torch.__version__}

    @api.get("/metrics")
    async def metrics() -> Response:
        assert state.metrics is not None  # set by build_app
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @api.get("/keepwarm/config")
    async def effective_config() -> dict[str, Any]:
        cfg = state.config.to_dict()
        cfg.pop("api_key", None)  # never echo the secret
        adapters = [{"name": a.name, "path": a.path, "digest": a.digest, "rank": a.rank}
                    for a in state.async_engine.adapters.values()]
        # "engine": what the engine runs with, read from its live parts (not this server's config).
        engine = await state.async_engine.call(EffectiveConfig())
        budget = state.budget  # what one request may cost, the defaults resolved (keepwarm.worker.http.budget)
        limits = {"max_request_sequences": budget.max_sequences, "max_request_prompt_tokens": budget.max_prompt_tokens,
                  "admission_seats": state.admission.capacity}
        return {"config": cfg, "engine": engine, "weights": state.weights_info(),
                "model_dir": str(state.engine.model_dir), "adapters": adapters, "request_limits": limits}

    return api
