"""POST /v1/responses: OpenAI's Responses API, stateless, run through the chat route (see api/responses.py)."""

from __future__ import annotations

from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from keepwarm.worker.api.protocol import ChatCompletionRequest, validation_error
from keepwarm.worker.api.responses import ResponsesRequest, from_chat_completion, stream_events, to_chat_request
from keepwarm.worker.api.routes.chat import chat_completion
from keepwarm.worker.api.state import ServerState


def router(state: ServerState) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Any:
        try:
            chat = ChatCompletionRequest(**to_chat_request(req))
        except pydantic.ValidationError as e:  # what the input items became is checked as a chat request: a 400
            raise validation_error(e.errors()) from None
        result = await chat_completion(state, chat, request)
        if not req.stream:
            return from_chat_completion(req, result)
        req.model = req.model or state.model_name
        return StreamingResponse(stream_events(req, result.body_iterator), media_type="text/event-stream")

    return api
