"""POST /v1/responses: OpenAI's Responses API, run through the chat route (see api/responses.py); with the response
store on (``--enable-responses-store`` or ``VLLM_ENABLE_RESPONSES_API_STORE=1``), ``previous_response_id`` and
GET /v1/responses/{response_id}. Without it, that GET is a 404 naming the switch (no id can be found)."""

from __future__ import annotations

from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from keepwarm.worker.api.protocol import APIError, ChatCompletionRequest, validation_error
from keepwarm.worker.api.responses import (
    STORE_SWITCH,
    ResponsesRequest,
    ResponseStore,
    conversation_after,
    from_chat_completion,
    previous_conversation,
    stream_events,
    to_chat_request,
)
from keepwarm.worker.api.routes.chat import chat_completion
from keepwarm.worker.api.state import ServerState


def router(state: ServerState) -> APIRouter:
    api = APIRouter()
    store = ResponseStore() if state.config.enable_responses_store else None

    @api.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Any:
        history = previous_conversation(store, req)
        try:
            chat = ChatCompletionRequest(**to_chat_request(req, history, store is not None))
        except pydantic.ValidationError as e:  # what the input items became is checked as a chat request: a 400
            raise validation_error(e.errors()) from None
        result = await chat_completion(state, chat, request)
        kept = store if req.store is not False else None  # OpenAI's default is to store
        if not req.stream:
            response = from_chat_completion(req, result, kept is not None)
            if kept is not None:
                response["store"] = kept.put(response, conversation_after(history, req, response["output"]))
            return response
        req.model = req.model or state.model_name

        def keep(final: dict[str, Any]) -> bool:
            assert kept is not None
            return kept.put(final, conversation_after(history, req, final["output"]))

        return StreamingResponse(stream_events(req, result.body_iterator, keep if kept is not None else None),
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
