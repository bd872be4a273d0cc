"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's run-time LoRA updates.

Needs ``--enable-lora --enable-lora-runtime-updates``. A load that is refused (400), by the adapter's checks or by
the engine, leaves nothing resident: no adapter in the engine, no daemon copy that this request made
(``lora_loader.open_adapter``). An unload first marks the adapter unloading in the engine thread (new requests
naming it get a 404 from then on), waits up to ``shutdown_timeout`` for its requests in flight, then removes it; if
they do not finish, the mark is taken back and the answer is a 409.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter
from fastapi.responses import Response

from keepwarm.formats.adapter import LoRAError
from keepwarm.worker.async_engine import AddLoRA, LoRARequestsInFlight, MarkUnloading, RemoveLoRA
from keepwarm.worker.http.state import ServerState
from keepwarm.worker.lora_loader import open_adapter
from keepwarm.worker.openai.protocol import APIError, LoadLoRARequest, UnloadLoRARequest, bad_request

log = logging.getLogger("keepwarm.server")


def router(state: ServerState) -> APIRouter:
    api = APIRouter()
    engine = state.async_engine

    def runtime_updates() -> None:
        if not state.config.enable_lora:
            raise bad_request("LoRA is not enabled (--enable-lora)")
        if not state.config.enable_lora_runtime_updates:
            raise bad_request("runtime LoRA updates are disabled (--enable-lora-runtime-updates)")

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRARequest) -> Response:
        runtime_updates()
        name, path = req.lora_name, req.lora_path
        if not name or not path:
            raise bad_request("lora_name and lora_path are required", "lora_name" if not name else "lora_path")
        if name in state.served_names:
            raise bad_request(f"{name!r} is the base model's name", "lora_name")
        if name in engine.adapters:
            raise bad_request(f"an adapter named {name!r} is already loaded", "lora_name")
        try:
            adapter, undo = await asyncio.to_thread(open_adapter, state.engine, name, path)
        except LoRAError as e:
            raise bad_request(str(e), "lora_path") from None
        try:
            await engine.call(AddLoRA(adapter))
        except Exception as e:  # refused by the engine (--max-cpu-loras, a name taken meanwhile): nothing stays
            await asyncio.to_thread(undo)
            if isinstance(e, LoRAError):
                raise bad_request(str(e), "lora_path") from None
            raise
        log.info("adapter %s loaded from %s at run time", name, path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRARequest) -> Response:
        runtime_updates()
        name = req.lora_name
        view = engine.adapters.get(name)
        # MarkUnloading is False when another unload got there first (or the adapter is gone): as vLLM, a 404.
        if view is None or view.unloading or not await engine.call(MarkUnloading(view.adapter, True)):
            raise APIError(404, f"no adapter named {name!r} is loaded", "NotFoundError", "lora_name")
        deadline = time.monotonic() + state.config.shutdown_timeout
        try:
            while await engine.call(LoRARequestsInFlight(name)):
                if time.monotonic() > deadline:
                    await engine.call(MarkUnloading(view.adapter, False))
                    raise APIError(409, f"adapter {name!r} still has requests in flight after "
                                        f"{state.config.shutdown_timeout:.0f}s; not unloaded", "ConflictError")
                await asyncio.sleep(0.05)
            await engine.call(RemoveLoRA(name))
        except LoRAError as e:
            await engine.call(MarkUnloading(view.adapter, False))
            raise bad_request(str(e), "lora_name") from None
        log.info("adapter %s unloaded at run time", name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    return api
