"""The one request pipeline every front end (the HTTP routers, gRPC) runs a generation request through.

Stages, in order: resolve the model name (base model or a LoRA adapter: 404 if unknown), check what the request may
cost (keepwarm.worker.http.budget: 400) and hold one admission seat per sequence (``admit``: 429), tokenize (bounded,
off the event loop; a chat's messages through its template: ``render_chat``), check the prompt length against the
context (400), build ``SamplingParams`` (400 naming the field), compile the request's output constraint if it has one
(``compile_structured``: cached, off the event loop, 400 naming the field), hand the request to the engine
(``start``), then either collect the final outputs (``collect``: aborts when the client goes away) or stream them as
deltas (``DeltaTracker``: per choice, the text not yet sent, holding back what a stop string may still cut).
Errors: validation raises ``APIError``; what the engine raises while serving (``ENGINE_ERRORS``) becomes one
``APIError`` through ``engine_error`` (mid-stream: the last item of ``until_error``), so a front end maps errors in
one place. The pipeline reads only what the engine fixed at construction (tokenizer, model config, context length, the
thread-safe grammar compiler) and the adapter table the engine thread publishes (``AsyncEngine.adapters``); it never
touches the engine's live state.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

from fastapi import Request

from keepwarm.worker.detokenizer import stop_hold_back, streamable_end
from keepwarm.worker.engine import RequestError, RequestFailed
from keepwarm.worker.http.limits import SEATS_KEY, Seats, check_prompt_chars, offload, until_disconnected
from keepwarm.worker.http.state import ServerState
from keepwarm.worker.lora import LoRAAdapter
from keepwarm.worker.openai import chat_render
from keepwarm.worker.openai.protocol import APIError, bad_request
from keepwarm.worker.outputs import CompletionOutput, RequestOutput
from keepwarm.worker.sampling_params import SamplingParams, SamplingParamsError
from keepwarm.worker.structured import GrammarError, StructuredOutputs

# What the engine raises for one request while serving it: refused (RequestError, a 400) or dead (503).
ENGINE_ERRORS = (RequestError, RuntimeError)

SSE_DONE = "data: [DONE]\n\n"
T = TypeVar("T")


class SamplingRequest(Protocol):
    def sampling(self, max_tokens: int | None, logprobs: int | None, default_max: int) -> SamplingParams: ...


def engine_error(e: Exception) -> APIError:
    """The API error for what the engine raised: a refused request is the client's (400), one that failed inside
    the engine alone is ours (500, the others went on), anything else means the engine is gone (503)."""
    if isinstance(e, RequestError):
        return bad_request(str(e))
    if isinstance(e, RequestFailed):
        return APIError(500, str(e), "InternalServerError")
    return APIError(503, f"the engine cannot serve: {e}", "ServiceUnavailable")


def resolve_model(state: ServerState, name: str | None) -> LoRAAdapter | None:
    """The LoRA adapter the request names (None for the base model); 404 in OpenAI's shape for an unknown model.

    The adapter object (not its name) travels with the request, so a concurrent unload + load under the same name
    cannot swap the weights a request runs with: the engine refuses a request whose adapter is no longer loaded."""
    if name is None or name in state.served_names:
        return None
    view = state.async_engine.adapters.get(name)
    if view is not None and not view.unloading:
        return view.adapter
    raise APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model", "model_not_found")


def admit(state: ServerState, request: Request, prompts: int, n: int) -> int:
    """Check the request's sequences against its budget (400), then hold one admission seat per sequence (429);
    the seats go back when its response ends (limits.AdmissionLimit). Returns the sequences."""
    sequences = state.budget.check_sequences(prompts, n)
    seats: Seats | None = request.scope.get(SEATS_KEY)
    if seats is not None:
        seats.resize(sequences)
    return sequences


async def render_chat(state: ServerState, req: Any) -> list[int]:
    """The prompt ids of a chat (or chat-shaped /tokenize, or /v1/responses) request, through the model's chat
    template (keepwarm.worker.openai.chat_render): the messages' characters bounded first, then rendered and
    tokenized off the event loop; 400 naming what is wrong."""
    chat_render.check_template(req, state.config.trust_request_chat_template)
    messages = chat_render.message_dicts(req.messages)
    check_prompt_chars(sum(len(m["content"]) for m in messages), state.engine.max_model_len, state.token_chars,
                       "messages")
    try:
        return await offload(chat_render.prompt_ids, state.tokenizer, req, messages)
    except Exception as e:  # jinja errors, time/size limits, missing template
        raise chat_render.template_error(e, req) from None


def check_length(state: ServerState, prompt_len: int, max_tokens: int | None) -> int:
    """The request's max_tokens (default: the rest of the context); 400 if the prompt and it do not fit."""
    limit = state.engine.max_model_len
    if prompt_len == 0:
        raise bad_request("the prompt is empty", "prompt")
    if max_tokens is None:
        max_tokens = limit - prompt_len
    if max_tokens < 1:
        if prompt_len >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your request has "
                              f"{prompt_len} input tokens. Please reduce the length of the input.", "messages")
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if prompt_len + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
                          "completion). Please reduce the length of the messages or completion.", "max_tokens")
    return max_tokens


def sampling_params(build: Callable[[], SamplingParams]) -> SamplingParams:
    """``build()``, with an invalid value as a 400 naming its field."""
    try:
        return build()
    except SamplingParamsError as e:
        raise bad_request(str(e), e.field) from None


def request_params(req: SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    return sampling_params(lambda: req.sampling(max_tokens, logprobs, max_tokens))


async def compile_structured(state: ServerState, spec: StructuredOutputs | None, params: SamplingParams) -> None:
    """Compile the request's constraint (cached) off the event loop; an invalid one is a 400 naming its field.

    The compiler only reads what the engine fixed at construction (tokenizer, vocabulary, EOS ids)."""
    if spec is None:
        return
    compiler = state.engine.grammar_compiler
    try:
        params.structured = await asyncio.to_thread(compiler.compile, spec)
    except GrammarError as e:
        raise bad_request(str(e), e.field) from None


def start(state: ServerState, prompts: list[list[int]], texts: list[str | None], params: SamplingParams,
          lora: LoRAAdapter | None, base_id: str) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Submit one engine request per prompt (``<base_id>-<i>``); their outputs interleaved as (i, output).

    Nothing runs until the result is iterated: the engine's refusal (ENGINE_ERRORS) is raised there. Closing the
    iterator aborts every request that has not finished."""
    engine = state.async_engine
    streams = [engine.generate(f"{base_id}-{i}", ids, params, prompt=text, lora=lora)
               for i, (ids, text) in enumerate(zip(prompts, texts, strict=True))]
    return _merge(streams)


async def collect(state: ServerState, request: Request, merged: AsyncGenerator[tuple[int, RequestOutput], None],
                  num: int) -> list[RequestOutput]:
    """Run to completion, aborting if the client goes away (499); the engine's error as an APIError."""
    finals: list[RequestOutput | None] = [None] * num

    async def consume() -> None:
        async with aclosing(merged):
            async for i, out in merged:
                if out.finished:
                    finals[i] = out

    # Racing the requests against the client's disconnect: the body has been read, so the next message the
    # client's side can produce is http.disconnect (Request.is_disconnected() only peeks and missed it: issue 17).
    task = asyncio.create_task(consume())
    gone = asyncio.create_task(until_disconnected(request.receive))
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        task.cancel()  # closes the merged streams: every unfinished request is aborted, its KV freed
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "client disconnected", "ClientDisconnected")
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    try:
        await task  # re-raises the engine's error, if any
    except ENGINE_ERRORS as e:
        raise engine_error(e) from None
    return cast(list[RequestOutput], finals)


async def _merge(streams: list[AsyncGenerator[RequestOutput, None]]
                 ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several requests' outputs as they come; closing this closes (aborts) them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async with aclosing(it):
                async for out in it:
                    await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# -- streaming ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Delta:
    """What is new in one choice since the last output: text from ``text_start``, tokens from ``token_start``."""

    first: bool  # the first output of this choice (front ends send a header chunk then)
    text: str
    text_start: int
    token_start: int
    token_end: int
    finished: bool


@dataclass
class DeltaTracker:
    """Per choice, how much text and how many tokens a stream has sent. Text within ``stop_hold_back`` characters
    of the end is withheld until the choice finishes: a stop string completed later is cut from the output."""

    stop: Sequence[str] | str | None  # as SamplingParams.stop
    _text: dict[Any, int] = field(default_factory=dict)
    _tokens: dict[Any, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.hold = stop_hold_back([self.stop] if isinstance(self.stop, str) else list(self.stop or ()))

    def advance(self, key: Any, c: CompletionOutput) -> Delta:
        first = key not in self._text
        st, sk = self._text.get(key, 0), self._tokens.get(key, 0)
        limit = streamable_end(c.text, st, c.finished, self.hold)
        self._text[key], self._tokens[key] = limit, len(c.token_ids)
        return Delta(first, c.text[st:limit], st, sk, len(c.token_ids), c.finished)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def until_error(chunks: AsyncGenerator[T, None]) -> AsyncGenerator[T | APIError, None]:
    """``chunks``, then, if the engine fails mid-stream, its error as the last item (a stream's status line has
    gone out already: each front end sends the error in its own shape). Closing this closes (aborts) ``chunks``."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk
    except ENGINE_ERRORS as e:
        yield engine_error(e)


async def sse_events(chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[str, None]:
    """Server-sent events for ``chunks``, then ``[DONE]``; an engine error mid-stream is sent as OpenAI's error
    object, then ``[DONE]``."""
    async with aclosing(until_error(chunks)) as items:  # a client that goes away closes this: the requests abort
        async for item in items:
            yield sse(item.body() if isinstance(item, APIError) else item)
    yield SSE_DONE
