"""What keeps one request from stalling or exhausting the server (the front ends' side of isolation).

Rules:
- CPU-heavy per-request work (tokenization, chat-template rendering, logprob offsets) runs in one bounded thread
  pool (:func:`offload`), never on the event loop, so /health and other requests keep flowing.
- Chat templates render sandboxed, time- and size-bounded (keepwarm.worker.tokenizer); a request's own
  ``chat_template`` is refused unless the server runs with ``--trust-request-chat-template`` (vLLM's flag).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# Tokenizing is mostly native code that holds the GIL in stretches; more threads than cores buys nothing.
OFFLOAD_THREADS = max(2, min(8, os.cpu_count() or 2))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=OFFLOAD_THREADS, thread_name_prefix="keepwarm-offload")


async def offload(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in the offload pool and await its result (or its exception)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool(), functools.partial(fn, *args, **kwargs))
