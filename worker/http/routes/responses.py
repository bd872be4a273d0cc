"""POST /v1/responses: OpenAI's Responses API, run through the chat route's completion (its typed objects, translated
by keepwarm.worker.openai.responses); with the response store on (``--enable-responses-store`` or
``VLLM_ENABLE_RESPONSES_API_STORE=1``), ``previous_response_id`` and GET /v1/responses/{response_id}. Without it,
that GET is a 404 naming the switch (no id can be found)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from keepwarm.worker.http import pipeline
from keepwarm.worker.http.routes.chat import ChatStream, chat_completion
from keepwarm.worker.http.state import ServerState
from keepwarm.worker.openai.chat_output import ChatCompletion
from keepwarm.worker.openai.protocol import APIError
from keepwarm.worker.openai.responses import (
    STORE_SWITCH,
    ResponsesRequest,
    ResponseStore,
    conversation_after,
    from_chat_completion,
    previous_conversation,
    stream_events,
    to_chat_request,
)


def router(state: ServerState) -> APIRouter:
    api = APIRouter()
    store = ResponseStore() if state.config.enable_responses_store else None

    @api.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Any:
        history = previous_conversation(store, req)
        result = await chat_completion(state, to_chat_request(req, history, store is not None), request)
        kept = store if req.store is not False else None  # OpenAI's default is to store
        if isinstance(result, ChatCompletion):
            response = from_chat_completion(req, result, kept is not None)
            if kept is not None:
                response["store"] = kept.put(response, conversation_after(history, req, response["output"]))
            return response
        req.model = req.model or state.model_name

        def keep(final: dict[str, Any]) -> bool:
            assert kept is not None
            return kept.put(final, conversation_after(history, req, final["output"]))

        return StreamingResponse(_events(req, result, keep if kept is not None else None),
                                 media_type="text/event-stream")

    @api.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Any:
        if store is None:
            raise APIError(404, f"Response with id '{response_id}' not found: the response store is off (start the "
                           f"server with {STORE_SWITCH})", "invalid_request_error", "response_id")
        stored = store.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error",
                           "response_id")
        return stored.response

    return api


async def _events(req: ResponsesRequest, chunks: ChatStream, keep: Callable[[dict[str, Any]], bool] | None
                  ) -> AsyncGenerator[str, None]:
    """The Responses events of the chat stream; a client that goes away closes this, which aborts the request."""
    async with aclosing(pipeline.until_error(chunks)) as items:
        async for event in stream_events(req, items, keep):
            yield event
