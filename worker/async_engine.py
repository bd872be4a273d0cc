"""The engine beside an asyncio event loop: one thread steps the engine, coroutines stream its outputs.

Rules (the why and the figures: docs/architecture.md, "Serving path"):
- Only the engine thread touches the engine's live state (requests, scheduler, KV blocks, adapters). Coroutines send
  typed commands through a queue (``_Add``, ``_Abort``; ``call(EngineCommand)``, or ``call_blocking`` from a plain
  thread, returns its result or error); outputs come back through one ``asyncio.Queue`` per request. Coroutines read
  only the fresh immutable values the thread publishes (``snapshot``, ``adapters``) and facts fixed at construction.
- A request whose consumer goes away is aborted and its KV blocks freed. One the engine fails alone raises
  :class:`RequestFailed` in its consumer; if the engine dies, every consumer gets a ``RuntimeError``, :attr:`running`
  turns False and ``on_fatal`` is called once (the server exits non-zero: never a process that answers 503 forever).
- Bursts: woken from idle, the thread first waits one round trip through each front end's loop (at most
  ``_BURST_WAIT_S``), so the requests that loop had already accepted are in the same first step.
- Statistics fold into cumulative histograms with vLLM's buckets, published in ``snapshot`` (/metrics loses nothing
  between scrapes). Requests are keyed by an internal counter, never the client's ``request_id`` (no collisions).
"""

from __future__ import annotations

import asyncio
import bisect
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
from keepwarm.worker.engine.stats import FinishedSequence, Observations
from keepwarm.worker.lora import LoRAAdapter
from keepwarm.worker.outputs import RequestOutput
from keepwarm.worker.prefix_handover import adopt_prefixes, export_prefixes
from keepwarm.worker.sampling_params import SamplingParams

_BURST_WAIT_S = 0.02  # the longest a wake-up from idle waits for a front end's event loop (see "Bursts")

log = logging.getLogger("keepwarm.worker")


# -- statistics: vLLM 0.32's histograms (vllm/v1/metrics/loggers.py, PrometheusStatLogger; buckets.py) ------------
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``max_value`` (the context length)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(frozen=True)
class Distribution:
    """A histogram as published: ``counts[i]`` values fell in bucket i, i.e. in ``(bounds[i-1], bounds[i]]``; the last
    count is above every bound (Prometheus's +Inf bucket)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0


class _Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self._frozen: Distribution | None = None

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value: Prometheus's "le"
        self.sum += value
        self._frozen = None

    def frozen(self) -> Distribution:
        if self._frozen is None:  # a copy only when something changed since the last snapshot
            self._frozen = Distribution(self.bounds, tuple(self.counts), self.sum)
        return self._frozen


class RequestStats:
    """vLLM's request histograms, fed with the engine's :class:`Observations` (engine thread only). Names are
    vLLM's; ``vllm:time_per_output_token_seconds`` is an older vLLM's name for the inter-token latency (the same
    observations): 0.32 no longer has it, vLLM's own dashboard still charts it."""

    def __init__(self, max_model_len: int) -> None:
        tokens = buckets_1_2_5(max_model_len)
        spec = {"vllm:request_prompt_tokens": tokens, "vllm:request_generation_tokens": tokens,
                "vllm:iteration_tokens_total": ITERATION_TOKENS_BUCKETS,
                "vllm:request_max_num_generation_tokens": tokens, "vllm:request_params_n": N_BUCKETS,
                "vllm:request_params_max_tokens": tokens, "vllm:time_to_first_token_seconds": TTFT_BUCKETS,
                "vllm:inter_token_latency_seconds": TOKEN_LATENCY_BUCKETS,
                "vllm:time_per_output_token_seconds": TOKEN_LATENCY_BUCKETS,
                "vllm:request_time_per_output_token_seconds": TOKEN_LATENCY_BUCKETS,
                "vllm:request_prefill_kv_computed_tokens": tokens,
                "vllm:request_num_preemptions": PREEMPTIONS_BUCKETS}
        for name in ("e2e_request_latency", "request_queue_time", "request_inference_time", "request_prefill_time",
                     "request_decode_time"):
            spec[f"vllm:{name}_seconds"] = REQUEST_LATENCY_BUCKETS
        self._h = {name: _Histogram(tuple(bounds)) for name, bounds in spec.items()}

    def record(self, obs: Observations) -> None:
        h = self._h
        for tokens in obs.iteration_tokens:
            h["vllm:iteration_tokens_total"].observe(tokens)
        for seconds in obs.time_to_first_token:
            h["vllm:time_to_first_token_seconds"].observe(seconds)
        for gap in obs.inter_token_latency:
            h["vllm:inter_token_latency_seconds"].observe(gap)
            h["vllm:time_per_output_token_seconds"].observe(gap)
        for n, longest in obs.requests:
            h["vllm:request_params_n"].observe(n)
            h["vllm:request_max_num_generation_tokens"].observe(longest)
        for f in obs.finished:
            self._finished(f)

    def _finished(self, f: FinishedSequence) -> None:
        """One ended sequence, as vLLM records a finished request: the phases it reached (queued: arrival to first
        scheduled; prefill: to its first token; decode: first to last token; inference: scheduled to last token)."""
        h = self._h
        h["vllm:e2e_request_latency_seconds"].observe(f.finished - f.arrival)
        h["vllm:request_prompt_tokens"].observe(f.prompt_tokens)
        h["vllm:request_generation_tokens"].observe(f.generation_tokens)
        h["vllm:request_prefill_kv_computed_tokens"].observe(f.prompt_tokens - f.cached_tokens)
        h["vllm:request_num_preemptions"].observe(f.num_preemptions)
        if f.max_tokens:
            h["vllm:request_params_max_tokens"].observe(f.max_tokens)
        if f.scheduled is None:
            return
        h["vllm:request_queue_time_seconds"].observe(f.scheduled - f.arrival)
        if f.first_token is None or f.last_token is None:
            return
        decode = f.last_token - f.first_token
        h["vllm:request_prefill_time_seconds"].observe(f.first_token - f.scheduled)
        h["vllm:request_decode_time_seconds"].observe(decode)
        h["vllm:request_inference_time_seconds"].observe(f.last_token - f.scheduled)
        # vLLM records 0 for a sequence of one token (no gap to average)
        tpot = decode / (f.generation_tokens - 1) if f.generation_tokens > 1 else 0.0
        h["vllm:request_time_per_output_token_seconds"].observe(tpot)

    def published(self) -> dict[str, Distribution]:
        return {name: hist.frozen() for name, hist in self._h.items()}


@dataclass(frozen=True)
class LoRAInfo:
    """vLLM's ``vllm:lora_requests_info``: adapter names with requests running / waiting (sorted, unique)."""

    max_loras: int
    running: tuple[str, ...]
    waiting: tuple[str, ...]


@dataclass
class EngineSnapshot:
    """Figures copied out of the engine thread after every step (read by /metrics and /health)."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_deferred: int = 0  # waiting because every LoRA slot is busy with other adapters (vLLM's "deferred")
    kv_cache_usage: float = 0.0
    free_blocks: int = 0
    total_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    steps: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    last_step_time: float = 0.0
    histograms: dict[str, Distribution] = field(default_factory=dict)
    lora: LoRAInfo | None = None  # None without --enable-lora
    cache_config: dict[str, str] = field(default_factory=dict)  # vLLM's cache_config_info labels keepwarm has


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
    ``(fd or None, CarriedPrefixes)``."""

    def run(self, engine: LLMEngine) -> Any:
        return export_prefixes(engine)


@dataclass(frozen=True)
class AdoptPrefixes(EngineCommand):
    """Another worker's exported blocks into this pool (``CarriedPrefixes``); the caller closes ``fd``."""

    fd: int

    def run(self, engine: LLMEngine) -> Any:
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
        self._stats: RequestStats | None = None  # built with the engine, in its thread
        self._cache_config: dict[str, str] = {}
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
        engine.stats.observations = Observations()  # read after every step (see "Statistics")
        self._stats = RequestStats(engine.max_model_len)
        self._cache_config = _cache_config(engine)
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
        bm, stats = e.block_manager, e.stats
        if stats.observations is not None and self._stats is not None:
            self._stats.record(stats.observations)
            stats.observations.clear()
        self.snapshot = EngineSnapshot(
            num_running=e.num_running, num_waiting=e.num_waiting, num_waiting_deferred=_lora_deferred(e),
            kv_cache_usage=bm.usage, free_blocks=bm.num_free_blocks, total_blocks=bm.num_blocks,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=e.scheduler.num_preemptions, prompt_tokens=stats.prompt_tokens,
            prompt_tokens_computed=stats.prompt_tokens_computed, prompt_tokens_cached=stats.prompt_tokens_cached,
            generation_tokens=stats.generation_tokens, steps=stats.steps, finished=dict(stats.finished),
            last_step_time=time.monotonic(), histograms=self._stats.published() if self._stats else {},
            lora=_lora_info(e), cache_config=self._cache_config)


def _lora_deferred(e: LLMEngine) -> int:
    """Waiting sequences the scheduler passes over because their adapter has no slot and every slot is busy
    (``LoRAManager.acquire`` would return None), as vLLM's "deferred" waiting reason counts them."""
    lm = e.lora_manager
    if lm is None or any(refs == 0 for refs in lm.slot_refs):
        return 0
    return len([seq for seq in e.scheduler.waiting
                if isinstance(seq.lora, LoRAAdapter) and lm.slot_of(seq.lora) < 0])


def _lora_info(e: LLMEngine) -> LoRAInfo | None:
    if e.lora_manager is None:
        return None

    def names(seqs: Any) -> tuple[str, ...]:
        return tuple(sorted({seq.lora.name for seq in seqs if seq.lora is not None}))

    return LoRAInfo(e.lora_manager.max_loras, names(e.scheduler.running), names(e.scheduler.waiting))


def _cache_config(e: LLMEngine) -> dict[str, str]:
    """The labels of vLLM's ``vllm:cache_config_info`` (its CacheConfig fields, str() as vLLM writes them) that
    keepwarm has a value for."""
    c = e.config
    return {"block_size": str(e.block_manager.block_size), "cache_dtype": c.kv_cache_dtype,
            "enable_prefix_caching": str(e.block_manager.enable_prefix_caching),
            "gpu_memory_utilization": str(c.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(c.kv_cache_memory_bytes), "num_gpu_blocks": str(e.block_manager.num_blocks),
            "num_gpu_blocks_override": str(c.num_gpu_blocks)}


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
