"""What keeps one request from stalling or exhausting the server (the front ends' side of isolation).

Rules (the limits and their defaults are listed in docs/reliability.md):
- a request body is bounded (``--max-request-body-mb``): 413 from Content-Length before anything is read, or as soon
  as the bytes read pass the limit; a client that stalls while sending (or stops reading a response) for
  ``--client-timeout`` seconds is answered 408 (or disconnected): :class:`ConnectionLimits`;
- the server holds at most ``max_num_seqs + --max-queued-requests`` sequences (prompts x ``n`` per request); one past
  that gets 429 before its prompts are tokenized (:class:`Admission`); what one request may cost: ``http.budget``;
- a prompt whose characters cannot fit in ``max_model_len`` tokens whatever the tokenizer does is refused before
  tokenizing: :func:`check_prompt_chars`;
- CPU-heavy per-request work (tokenization, chat-template rendering, logprob offsets) runs in one bounded thread
  pool (:func:`offload`), never on the event loop, so /health and other requests keep flowing;
- a non-streaming request whose client disconnects is aborted (:func:`until_disconnected`), like a stream;
- chat templates render sandboxed, bounded (worker.tokenizer); a request's own needs ``--trust-request-chat-template``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from keepwarm.worker.openai.protocol import APIError, bad_request

T = TypeVar("T")
log = logging.getLogger("keepwarm.server")

# Tokenizing is mostly native code that holds the GIL in stretches; more threads than cores buys nothing.
OFFLOAD_THREADS = max(2, min(8, os.cpu_count() or 2))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=OFFLOAD_THREADS, thread_name_prefix="keepwarm-offload")


async def offload(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in the offload pool and await its result (or its exception)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool(), functools.partial(fn, *args, **kwargs))


# -- request admission ---------------------------------------------------------------------------------------------
class Seats:
    """One request's hold on :class:`Admission`: one seat while its body is read, then one per sequence it runs
    (prompts x ``n``) once that is known (:meth:`resize`), until its response ends (:meth:`release`)."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.held = 0

    def resize(self, seats: int) -> None:
        """Hold ``seats`` in all (429 if the server has no room for them: nothing is held more then)."""
        self.admission.take(seats - self.held)
        self.held = seats

    def release(self) -> None:
        self.admission.take(-self.held)
        self.held = 0


class Admission:
    """Bounds the sequences a server holds: ``max_running`` run in the engine's batch, up to ``max_queued`` more
    wait; a request that would pass that is refused at once with 429 (vLLM's answer under overload), before its
    prompts are tokenized. A request counts its sequences (prompts x ``n``), not 1, so one request cannot take more
    than the requests of that many single-sequence clients would get.

    A request takes one seat before its body is read (:class:`AdmissionLimit`), so a flood of long prompts cannot
    pile up in the tokenizer either; once its size is known it holds one seat per sequence
    (``Seats.resize``), until its response ends (the ASGI call returns: the stream is done or the client left)."""

    def __init__(self, max_running: int, max_queued: int) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.active = 0
        self.refused = 0
        self._lock = threading.Lock()  # HTTP's loop and gRPC's (another thread) share the seats

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_queued

    def take(self, seats: int) -> None:
        """Hold ``seats`` more (negative: give them back); 429 if that passes the capacity."""
        with self._lock:
            if seats > 0 and self.active + seats > self.capacity:
                self.refused += 1
                raise APIError(429, f"the server holds {self.active} sequences ({self.max_running} running, "
                                    f"--max-queued-requests {self.max_queued} waiting) and this request needs "
                                    f"{seats} more; try again later", "RateLimitError", code="too_many_requests")
            self.active += seats

    def enter(self) -> Seats:
        """A new request's hold, with its first seat taken (429 when full)."""
        seats = Seats(self)
        seats.resize(1)
        return seats


# Where AdmissionLimit leaves a request's Seats in its ASGI scope (pipeline.admit reads it).
SEATS_KEY = "keepwarm.seats"


class AdmissionLimit:
    """ASGI middleware: requests to ``paths`` pass through ``admission`` (429 when it is full); their
    :class:`Seats` ride in the scope under ``SEATS_KEY`` and are released when the response ends."""

    def __init__(self, app: ASGIApp, admission: Admission, paths: frozenset[str]) -> None:
        self.app = app
        self.admission = admission
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in self.paths:
            return await self.app(scope, receive, send)
        try:
            seats = self.admission.enter()
        except APIError as e:
            return await JSONResponse(e.body(), status_code=e.status)(scope, receive, send)
        scope[SEATS_KEY] = seats
        try:
            await self.app(scope, receive, send)
        finally:
            seats.release()


# -- prompt length before tokenizing ---------------------------------------------------------------------------------
# Normalizers (NFC/NFKC) can merge a few characters into one before tokenizing: leave room for that.
NORMALIZATION_SLACK = 4


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of the vocabulary can stand for (its longest entry; byte-level BPE writes one
    character per byte, so this bounds decoded text too)."""
    known = getattr(tokenizer, "longest_token_chars", None)  # FastTokenizer's, computed once (a zygote preloads it)
    if isinstance(known, int):
        return known
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.get_vocab(with_added_tokens=True) if backend is not None else tokenizer.get_vocab()
    return max((len(t) for t in vocab), default=1)


def chars_bound(tokens: int, token_chars: int) -> int:
    """The most characters that could tokenize to ``tokens`` tokens or fewer, whatever the tokenizer does."""
    return tokens * token_chars * NORMALIZATION_SLACK


def check_prompt_chars(chars: int, max_model_len: int, token_chars: int, param: str) -> None:
    """Refuse (400) a prompt whose characters cannot fit in ``max_model_len`` tokens however it tokenizes, before
    the tokenizer spends time on it."""
    limit = chars_bound(max_model_len, token_chars)
    if chars > limit:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; a prompt of {chars} "
                          f"characters cannot fit (at most {limit} characters could)", param)


# -- the HTTP connection: body size, stalled clients, disconnects --------------------------------------------------
class ClientStalled(Exception):
    pass


def _error_response(status: int, message: str, type_: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, type_, code=code).body(), status_code=status)


class ConnectionLimits:
    """ASGI middleware for every HTTP request:

    - a body larger than ``max_body_bytes`` is refused with 413 as soon as that is known: from Content-Length
      before a byte is read, else when the bytes read pass the limit (nothing more is read);
    - a client that stalls for ``timeout`` seconds while sending its body gets 408; one that stops reading a
      response for that long is disconnected (its request is then aborted like any disconnect).

    When it answers for the app (413, 408), the app is told the client disconnected and whatever it sends after
    is dropped: the client gets exactly one response.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(int(length))(scope, receive, send)
        state = {"received": 0, "body_done": False, "answered": False}

        async def answer(response: JSONResponse) -> Message:
            state["answered"] = True
            await response(scope, receive, send)
            return {"type": "http.disconnect"}

        async def limited_receive() -> Message:
            if state["answered"]:
                return {"type": "http.disconnect"}
            if state["body_done"]:
                return await receive()  # after the body only a disconnect comes: wait as long as it takes
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except TimeoutError:
                return await answer(_error_response(408, f"the client sent nothing for {self.timeout:g}s",
                                                    "RequestTimeout"))
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > self.max_body_bytes:
                    return await answer(self._too_large(state["received"]))
                state["body_done"] = not message.get("more_body", False)
            return message

        async def watched_send(message: Message) -> None:
            if state["answered"]:
                return
            try:
                await asyncio.wait_for(send(message), self.timeout)
            except TimeoutError:
                raise ClientStalled from None

        try:
            await self.app(scope, limited_receive, watched_send)
        except ClientStalled:
            log.info("%s %s: the client stopped reading for %.0fs; disconnected", scope.get("method"),
                     scope.get("path"), self.timeout)

    def _too_large(self, size: int) -> JSONResponse:
        limit_mb = self.max_body_bytes / (1 << 20)
        return _error_response(413, f"the request body ({size} bytes or more) is larger than the server's limit of "
                                    f"{limit_mb:g} MiB (--max-request-body-mb)", "RequestTooLarge",
                               "request_too_large")


async def until_disconnected(receive: Receive) -> None:
    """Return when the client disconnects (an ``http.disconnect`` message); for a request whose body was read."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
