"""What a chat completion answers, as typed objects: the whole completion (``ChatCompletion``) or, streamed, its
chunks (``ChatChunk``). The chat route (keepwarm.worker.http.routes.chat) makes them; each front end serializes them
its own way: the chat route as OpenAI's JSON (``to_dict``: keys in OpenAI's order, the bytes it always sent),
/v1/responses as the Responses API's items and events (keepwarm.worker.openai.responses, from the fields). Nothing
parses text it produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from keepwarm.worker.openai.tool_calls import ToolCall


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def to_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass(frozen=True)
class ChatChoice:
    """One finished choice: the assistant's content and/or tool calls."""

    index: int
    content: str | None
    tool_calls: list[ToolCall]
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None

    def to_dict(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return {"index": self.index, "message": message, "logprobs": self.logprobs,
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}


@dataclass(frozen=True)
class ChatCompletion:
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [c.to_dict() for c in self.choices], "usage": self.usage.to_dict()}


@dataclass(frozen=True)
class ChatDelta:
    """What a chunk adds to a choice's message: the role (first chunk), content, or tool calls in OpenAI's shape
    (``ToolCall.to_openai(index)``, as keepwarm.worker.openai.tool_calls.ToolStreamer sends them)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.role is not None:
            out["role"] = self.role
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        return out


@dataclass(frozen=True)
class ChunkChoice:
    """One choice's part of a chunk; its last chunk (``last``) carries the finish and stop reasons."""

    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = {"index": self.index, "delta": self.delta.to_dict(), "logprobs": self.logprobs,
               "finish_reason": self.finish_reason}
        if self.last:
            out["stop_reason"] = self.stop_reason
        return out


@dataclass(frozen=True)
class ChatChunk:
    """One chunk of a streamed completion; ``usage`` on the last one (``include_usage``), or on every one
    (``continuous_usage_stats``)."""

    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                "model": self.model, "choices": [c.to_dict() for c in self.choices]}
        if self.usage is not None:
            body["usage"] = self.usage.to_dict()
        return body
