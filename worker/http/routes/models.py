"""GET /v1/models: the served names of the base model, then every loaded adapter (not one being unloaded)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from keepwarm.worker.http.state import ServerState


def router(state: ServerState) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(state.started_at)
        max_len = state.engine.max_model_len
        data = [{"id": name, "object": "model", "created": created, "owned_by": "keepwarm",
                 "root": str(state.engine.model_dir), "parent": None, "max_model_len": max_len}
                for name in state.served_names]
        data += [{"id": a.name, "object": "model", "created": created, "owned_by": "keepwarm", "root": a.path,
                  "parent": state.model_name, "max_model_len": max_len}
                 for a in state.async_engine.adapters.values() if not a.unloading]
        return {"object": "list", "data": data}

    return api
