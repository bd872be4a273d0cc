"""The engine beside an asyncio event loop: one thread steps the engine, coroutines stream its outputs.

Rule: the engine is not thread-safe, so only the engine thread touches its live state (requests, scheduler, KV
blocks, adapters). Coroutines hand it typed commands through a queue: ``_Add`` and ``_Abort`` for requests, and
``call(command)`` for an ``EngineCommand`` (``AddLoRA``, ``RemoveLoRA``, ``MarkUnloading``,
``LoRARequestsInFlight``) whose result or error comes back to the awaiting coroutine (``call_blocking`` for a plain
thread's: the supervisor link's ``ExportPrefixes`` and ``AdoptPrefixes``). Outputs come back through one
``asyncio.Queue`` per request, filled with ``loop.call_soon_threadsafe``. What coroutines may read, the engine
thread publishes as fresh immutable values: ``snapshot`` (figures, after every step) and ``adapters`` (name ->
``AdapterView``, after every command). Facts fixed when the engine was built (tokenizer, model config, context
length, model directory, where the weights came from) are read directly.

Torch releases the GIL inside its kernels, so HTTP keeps flowing while a step runs. A request whose consumer goes
away (client disconnect, cancelled task) is aborted and its KV blocks freed.

Failures (rule): a request the engine fails alone (``RequestOutput.error``) raises :class:`RequestFailed` in its
consumer; the others go on. If the engine itself dies (:class:`EngineDeadError` or anything else escaping a
step), every waiting consumer gets a ``RuntimeError``, :attr:`running` turns False and ``on_fatal`` is called once
(the server exits non-zero so its supervisor restarts it: never a process that answers 503 forever).

Bursts (rule): when the engine thread wakes from idle it first waits for one round trip through each front end's
event loop (a callback queued with ``call_soon_threadsafe``, at most ``_BURST_WAIT_S``), so requests that loop had
already accepted when the first one woke the engine are in the same first step, not the next one. Measured,
SmolLM2 on 2 cores, 8 streams sent at once: TTFT p50 233 -> 141 ms, every request now in one prefill step; a lone
request pays the round trip (TTFT at one stream 48-54 ms before, 43-49 after: noise).

Request ids (rule): the engine keys requests by an internal id this class makes (a counter), never by the client's
``request_id``, so two clients that pick the same id cannot collide, probe or block each other (vLLM keeps its own
internal id the same way).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from keepwarm.worker.engine import LLMEngine, RequestError, RequestFailed
from keepwarm.worker.lora import LoRAAdapter
from keepwarm.worker.outputs import RequestOutput
from keepwarm.worker.sampling_params import SamplingParams

_BURST_WAIT_S = 0.02  # the longest a wake-up from idle waits for a front end's event loop (see "Bursts")

log = logging.getLogger("keepwarm.worker")


@dataclass
class EngineSnapshot:
    """Figures copied out of the engine thread after every step (read by /metrics and /health)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    free_blocks: int = 0
    total_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    last_step_time: float = 0.0


@dataclass(frozen=True)
class AdapterView:
    """A loaded LoRA adapter as the event loop sees it. ``adapter`` travels with a request; the engine refuses it
    if it is no longer the adapter loaded under that name."""

    adapter: LoRAAdapter
    name: str
    path: str
    digest: str
    rank: int
    unloading: bool


# -- commands --------------------------------------------------------------------------------------------------------
class EngineCommand:
    """Something a coroutine asks the engine thread to do between steps (``AsyncEngine.call``)."""

    def run(self, engine: LLMEngine) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class AddLoRA(EngineCommand):
    adapter: LoRAAdapter

    def run(self, engine: LLMEngine) -> None:
        engine.add_lora(self.adapter)


@dataclass(frozen=True)
class RemoveLoRA(EngineCommand):
    name: str

    def run(self, engine: LLMEngine) -> LoRAAdapter:
        return engine.remove_lora(self.name)


@dataclass(frozen=True)
class MarkUnloading(EngineCommand):
    """Set (or clear) ``adapter.unloading``: new requests for it are refused while it is set. Returns False, and
    changes nothing, when ``adapter`` is not the one loaded under its name or is already in the state asked for."""

    adapter: LoRAAdapter
    unloading: bool

    def run(self, engine: LLMEngine) -> bool:
        if engine.loras.get(self.adapter.name) is not self.adapter or self.adapter.unloading == self.unloading:
            return False
        self.adapter.unloading = self.unloading
        return True


@dataclass(frozen=True)
class LoRARequestsInFlight(EngineCommand):
    name: str

    def run(self, engine: LLMEngine) -> int:
        return engine.lora_requests_in_flight(self.name)


@dataclass(frozen=True)
class EffectiveConfig(EngineCommand):
    """What the engine runs with, read from its live parts in its own thread (torch threads are per thread)."""

    def run(self, engine: LLMEngine) -> dict[str, Any]:
        return engine.effective_config()


@dataclass(frozen=True)
class ExportPrefixes(EngineCommand):
    """The cached full blocks into a memfd, for the worker a restart hands over to (keepwarm.worker.prefix_handover):
    ``(fd or None, Carried)``."""

    def run(self, engine: LLMEngine) -> Any:
        from keepwarm.worker.prefix_handover import export_prefixes

        return export_prefixes(engine)


@dataclass(frozen=True)
class AdoptPrefixes(EngineCommand):
    """Another worker's exported blocks into this pool (``Carried``); the caller closes ``fd``."""

    fd: int

    def run(self, engine: LLMEngine) -> Any:
        from keepwarm.worker.prefix_handover import adopt_prefixes

        return adopt_prefixes(engine, self.fd)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    cache_salt: str | None
    lora: Any


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    command: EngineCommand
    loop: asyncio.AbstractEventLoop | None  # None: ``future`` is a concurrent.futures.Future (``call_blocking``)
    future: Any


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """``AsyncEngine(factory)`` builds the engine *in* its thread: measured on CPU, an engine built in the main
    thread and stepped in another runs 1.6-1.8x slower per step (32 vs 19 ms on SmolLM2; OpenMP thread teams are
    per master thread), while one built and stepped in the same thread runs at full speed."""

    def __init__(self, engine_factory: Callable[[], LLMEngine],
                 on_fatal: Callable[[BaseException], None] | None = None,
                 warm_up: Callable[[LLMEngine], None] | None = None) -> None:
        self.engine: LLMEngine | None = None
        self.on_fatal = on_fatal
        # ``warm_up`` runs in the engine thread once the engine is built, after the constructor returned (the caller
        # builds its app meanwhile); ``warmed`` is set when it is over (``errored`` holds its failure).
        self._warm_up = warm_up
        self.warmed = threading.Event()
        self._ids = itertools.count()
        self._factory = engine_factory
        self._ready = threading.Event()
        self._commands: queue.Queue[_Add | _Abort | _Call] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._accepting = True
        self.snapshot = EngineSnapshot()
        self.adapters: dict[str, AdapterView] = {}  # replaced, never mutated: the event loop reads it
        self.errored: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="keepwarm-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.errored is not None:
            raise self.errored

    # -- coroutine side ----------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self.errored is None

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def stop_accepting(self) -> None:
        self._accepting = False

    async def call(self, command: EngineCommand) -> Any:
        """Run ``command`` in the engine thread (between steps) and return its result or raise its error."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._commands.put(_Call(command, loop, future))
        self._wake.set()
        return await future

    def call_blocking(self, command: EngineCommand, timeout: float) -> Any:
        """``call`` from a thread that is not an event loop's (the supervisor link's reader): TimeoutError after
        ``timeout``, RuntimeError when the engine is not running."""
        if not self.running:
            raise RuntimeError(f"the engine is not running: {self.errored}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(command, None, future))
        self._wake.set()
        return future.result(timeout)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None, cache_salt: str | None = None,
                       lora: Any = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's outputs (cumulative); raises RequestError for a request the engine refuses and
        RequestFailed for one that failed inside it. ``request_id`` is the caller's label (logs, outputs); the
        engine runs it under an internal id of its own, unique in this process."""
        if not self._accepting:
            raise RequestError("the server is shutting down")
        if not self.running:
            raise RuntimeError(f"the engine is not running: {self.errored}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        internal = f"{request_id}~{next(self._ids)}"
        with self._lock:
            self._streams[internal] = stream
        self._commands.put(_Add(internal, prompt_token_ids, params, prompt, cache_salt, lora))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    finished = True
                    raise RequestFailed(f"request {request_id} failed inside the engine: {item.error}")
                item.request_id = request_id
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(internal, None)
            if not finished:
                self.abort(internal)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout)

    # -- engine thread -----------------------------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _drain_commands(self, engine: LLMEngine) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                try:
                    engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, prompt=cmd.prompt,
                                       cache_salt=cmd.cache_salt, lora=cmd.lora)
                except (RequestError, ValueError) as e:
                    self._deliver(cmd.request_id, RequestError(str(e)))
            elif isinstance(cmd, _Call):
                self._run_call(engine, cmd)
            elif engine.abort_request(cmd.request_id):
                log.debug("aborted request %s", cmd.request_id)

    def _run_call(self, engine: LLMEngine, cmd: _Call) -> None:
        try:
            result = cmd.command.run(engine)
        except Exception as e:  # handed to the awaiting coroutine (or thread)
            self._publish_adapters(engine)  # before the caller resumes: it sees the command's effect
            if cmd.loop is None:
                cmd.future.set_exception(e)
            else:
                cmd.loop.call_soon_threadsafe(_set_exception, cmd.future, e)
            return
        self._publish_adapters(engine)
        if cmd.loop is None:
            cmd.future.set_result(result)
        else:
            cmd.loop.call_soon_threadsafe(_set_result, cmd.future, result)

    def _publish_adapters(self, engine: LLMEngine) -> None:
        self.adapters = {a.name: AdapterView(a, a.name, a.path, a.digest, a.rank, a.unloading)
                         for a in engine.loras.values()}

    def _run(self) -> None:
        try:
            self.engine = engine = self._factory()
        except BaseException as e:  # handed to the constructor's caller
            self.errored = e
            self._ready.set()
            return
        self._take_snapshot(engine)
        self._publish_adapters(engine)
        self._ready.set()
        try:
            if self._warm_up is not None:
                self._warm_up(engine)
                self._take_snapshot(engine)
        except BaseException as e:  # the caller waits on ``warmed`` and reports it (a worker that is not ready)
            self.errored = e
            return
        finally:
            self.warmed.set()
        try:
            while not self._stopped.is_set():
                self._drain_commands(engine)
                if not engine.has_unfinished_requests():
                    engine.check_health()  # a tensor-parallel rank gone while idle ends the engine too
                    self._take_snapshot(engine)
                    if self._wake.wait(timeout=0.5):
                        self._await_front_ends()
                    self._wake.clear()
                    continue
                for out in engine.step():
                    self._deliver(out.request_id, out)
                self._take_snapshot(engine)
        except BaseException as e:  # the engine died: fail every waiting request rather than hang them
            log.critical("the engine cannot go on: %s: %s", type(e).__name__, e, exc_info=e)
            self.errored = e
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._deliver(rid, RuntimeError(f"engine failed: {e}"))
            if self.on_fatal is not None:
                self.on_fatal(e)

    def _await_front_ends(self) -> None:
        """One round trip through each front end's event loop (see "Bursts"): what it already holds is handed over
        before the first step."""
        with self._lock:
            loops = {stream.loop for stream in self._streams.values()}
        for loop in loops:
            done = threading.Event()
            try:
                loop.call_soon_threadsafe(done.set)
            except RuntimeError:  # a closed loop (shutting down): nothing to wait for
                continue
            done.wait(_BURST_WAIT_S)

    def _take_snapshot(self, e: LLMEngine) -> None:
        bm = e.block_manager
        self.snapshot = EngineSnapshot(
            num_running=e.num_running, num_waiting=e.num_waiting, kv_cache_usage=bm.usage,
            free_blocks=bm.num_free_blocks, total_blocks=bm.num_blocks, prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits, num_preemptions=e.scheduler.num_preemptions,
            prompt_tokens=e.stats.prompt_tokens, generation_tokens=e.stats.generation_tokens, steps=e.stats.steps,
            finished=dict(e.stats.finished), last_step_time=time.monotonic())


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
