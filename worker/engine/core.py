"""The engine: requests in, tokens out, one scheduler step at a time.

``step()`` = schedule -> model runner forward -> sample -> append tokens, detokenize, check stops -> free
finished sequences. The offline ``LLM`` drives it in a loop; the API server drives it from a thread beside
its event loop.

Isolation (rules): an exception tied to one request (its sampling row, its detokenization, stop checks, prompt
logprobs, its output) fails that request alone: its sequences are aborted (KV blocks freed), one log line names
the request id, and ``step()`` returns a final output for it with ``error`` set; the other requests go on. An
exception in what the whole batch shares (scheduling, the forward pass) means the engine cannot go on: it is
raised as :class:`EngineDeadError` and the caller must stop using the engine (the server exits non-zero).

Statistics (rule): ``stats`` holds vLLM's counters; what vLLM's request histograms take (first-token and
inter-token times, each ended sequence's timestamps, tokens per step) is appended to ``stats.observations`` only
once a reader has set it (the AsyncEngine, which folds and clears it after every step), so an engine nobody reads
keeps nothing per token. A request that fails alone counts as vLLM's ``error`` reason, not ``abort``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from keepwarm.daemon.client import DaemonError, ensure_daemon
from keepwarm.daemon.sharding import Shard, TensorParallelError, check_pipeline, check_supported, local_config, stage_of
from keepwarm.formats.model_config import ModelConfigError, load_model_config, parse_dtype
from keepwarm.formats.paths import RuntimeDirError
from keepwarm.kernels.cpu_malloc import keep_freed_memory
from keepwarm.worker.block_manager import BlockManager
from keepwarm.worker.detokenizer import IncrementalDetokenizer, check_stop_strings
from keepwarm.worker.lora import LoRAAdapter, LoRAError, LoRAManager
from keepwarm.worker.model_loader import LoadedModel, load_model
from keepwarm.worker.model_runner import (
    FP8_KV_DTYPE,
    CacheConfig,
    ModelRunner,
    allocate_kv_cache,
    kv_bytes_per_block,
)
from keepwarm.worker.outputs import CompletionOutput, RequestMetrics, RequestOutput
from keepwarm.worker.parallel.group import Nodes, TensorParallelGroup
from keepwarm.worker.parallel.messages import CacheSpec, LoRASlot, Setup, lora_weights
from keepwarm.worker.sampler import Sampler
from keepwarm.worker.sampling_params import SamplingParams
from keepwarm.worker.scheduler import Scheduler, SchedulerConfig
from keepwarm.worker.sequence import Sequence, SequenceStatus, TokenLogprob
from keepwarm.worker.structured import GrammarCompiler, StructuredOutputs

log = logging.getLogger("keepwarm.worker")

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


class RequestError(ValueError):
    """A request the engine cannot take (e.g. longer than ``max_model_len``); maps to an HTTP 400."""


class RequestFailed(RuntimeError):
    """A request the engine took failed inside it (an internal error tied to that request alone); maps to a 500."""


class EngineDeadError(RuntimeError):
    """The engine failed in a step shared by every request and cannot go on."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings, with vLLM's names and meanings."""

    model: str
    tokenizer: str | None = None
    # vLLM's option: no tokenizer files are read; prompts are token ids and outputs carry ids only (text "").
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    seed: int = 0
    device: str = "auto"
    enforce_eager: bool = False
    # auto (the checkpoint's own, else none) | none | int8 | fp8 | int4 (weight-only, applied at preload)
    quantization: str = "auto"
    # True: attach to the daemon's arena (starting a daemon if none runs); "auto": attach if a daemon answers,
    # else load from disk and say so; False: load from disk.
    daemon: bool | str = "auto"
    runtime_dir: str | None = None  # the daemon's KEEPWARM_RUNTIME_DIR
    fingerprint: str | None = None  # attach only to an arena with exactly this fingerprint
    # LoRA (vLLM's meanings): adapters active in one batch, the largest rank accepted, adapters registered.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Tensor parallelism (worker/parallel): ranks, one process each (this one is rank 0), and the timeout of their
    # collectives (a rank stuck or gone fails the step instead of hanging it).
    tensor_parallel_size: int = 1
    # Pipeline parallelism (worker/parallel/pipeline.py): contiguous layer ranges, one process per stage.
    pipeline_parallel_size: int = 1
    distributed_timeout: float = 120.0
    # Ranks on several machines (torchrun's meanings; this engine is node 0): node 0's store address and port,
    # None = MASTER_ADDR / MASTER_PORT from the environment. One node: 127.0.0.1 and any free port.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    def nodes(self) -> Nodes:
        if self.nnodes == 1 and self.node_rank == 0:
            return Nodes()
        try:
            port = self.master_port if self.master_port is not None else int(os.environ.get("MASTER_PORT", 0))
        except ValueError:
            raise TensorParallelError(f"MASTER_PORT={os.environ['MASTER_PORT']!r} is not a port number") from None
        return Nodes(self.nnodes, self.node_rank, self.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1"),
                     port)


@dataclass(frozen=True)
class FinishedSequence:
    """How one sequence went, for the request histograms (vLLM's FinishedRequestStats: vLLM runs ``n > 1`` as n
    child requests, keepwarm as n sequences). Times are ``time.monotonic()``; None where it never got that far."""

    reason: str  # stop | length | abort | error
    arrival: float
    scheduled: float | None
    first_token: float | None
    last_token: float | None
    finished: float
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache supplied
    max_tokens: int | None
    num_preemptions: int = 0  # times the scheduler preempted it (recomputed from scratch)


@dataclass
class Observations:
    """What the histograms of /metrics take from the engine, since the reader last cleared it."""

    iteration_tokens: list[int] = field(default_factory=list)  # per step that sampled (vLLM's count, see step)
    time_to_first_token: list[float] = field(default_factory=list)  # per sequence
    inter_token_latency: list[float] = field(default_factory=list)  # per output token after a sequence's first
    finished: list[FinishedSequence] = field(default_factory=list)
    requests: list[tuple[int, int]] = field(default_factory=list)  # (n, longest output) per request that ended

    def clear(self) -> None:
        for values in (self.iteration_tokens, self.time_to_first_token, self.inter_token_latency, self.finished,
                       self.requests):
            values.clear()


@dataclass
class EngineStats:
    """Counters the API's /metrics exposes (vLLM's metric set). ``observations`` is None until a reader (the
    AsyncEngine) sets one: an engine nobody reads (the offline LLM) keeps no per-token record."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0})
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens prefilled, counted when a sequence's first token comes
    prompt_tokens_cached: int = 0  # prompt tokens the prefix cache supplied instead
    observations: Observations | None = None


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer | None]
    texts: list[str]
    metrics: RequestMetrics


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        # Where this engine's construction went, in seconds per phase (the worker's startup breakdown: /health,
        # the supervisor's Ready, `keepwarm bench restart`).
        self.startup_phases: dict[str, float] = {}
        t = time.perf_counter()
        self.device = _resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's big activations reuse pages, not fault in fresh ones (cpu_malloc.py)
        model_path = Path(config.model)
        self._model_dir = model_path.resolve() if model_path.exists() else model_path
        # The weights themselves are read only on a disk load: attaching by fingerprint needs just the config and
        # tokenizer (e.g. a snapshot restored on another machine, without the original checkpoint).
        mc = self.model_config = load_model_config(self._model_dir)
        self.dtype = mc.dtype if config.dtype == "auto" else parse_dtype(config.dtype)
        self.max_model_len = self._resolve_max_model_len(config, mc)
        # longrope: sequences longer than this use the long factors (None: the model has no longrope).
        self._long_rope_after = mc.rope.original_max_position_embeddings if mc.rope.rope_type == "longrope" \
            else None
        t = self._phase("model_config", t)
        self.tokenizer = None if config.skip_tokenizer_init else self._load_tokenizer(config.tokenizer or config.model)
        t = self._phase("tokenizer", t)
        torch.manual_seed(config.seed)
        if config.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ModelConfigError(f"unknown kv_cache_dtype {config.kv_cache_dtype!r} (choose auto or fp8)")
        if config.block_size not in (8, 16, 32, 64, 128):
            raise ModelConfigError(f"block_size must be one of 8, 16, 32, 64, 128; got {config.block_size}")

        self.tp: TensorParallelGroup | None = None
        if config.tensor_parallel_size != 1 or config.pipeline_parallel_size != 1 or config.nnodes != 1:
            self.loaded = self._start_tensor_parallel(loaded)
        else:
            self.loaded = loaded or load_model(
                self._model_dir, config.dtype, config.quantization, self.device, self.max_model_len, config.daemon,
                Path(config.runtime_dir) if config.runtime_dir else None, config.fingerprint)
        self.weights_source = self.loaded.source
        # A daemon attach says where its time went ("weights" is then the rest: the ping that found the daemon); a
        # disk load is one phase.
        attach_phases = self.loaded.phases if loaded is None else {}
        self.startup_phases.update(attach_phases)
        t = self._phase("weights", t, minus=sum(attach_phases.values()))
        try:
            self._build(config, mc, t)
        except BaseException:
            if self.tp is not None:
                self.tp.close()
                torch.set_num_threads(self._threads_before_tp)
            raise

    def _build(self, config: EngineConfig, mc, t: float) -> None:
        """The engine's parts around the loaded model: KV cache, blocks, LoRA, scheduler, runner, sampler."""
        kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else FP8_KV_DTYPE
        num_blocks = self._num_kv_blocks(kv_dtype)
        self.cache_config = CacheConfig(num_blocks, config.block_size, kv_dtype)
        kv_config = mc if self.tp is None else local_config(mc, self.tp.tp_size)  # this rank's KV heads
        if self.tp is not None:
            self.tp.send(CacheSpec(num_blocks, config.block_size, str(kv_dtype).removeprefix("torch.")))
            self.tp.serving = True
        pp = config.pipeline_parallel_size
        stage = stage_of(mc, pp, 0) if pp > 1 else None
        kv_cache = allocate_kv_cache(kv_config, self.cache_config, self.device,
                                     layers=stage.layers if stage is not None else None)
        t = self._phase("kv_pool", t)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.loras: dict[str, LoRAAdapter] = {}
        self.lora_manager = None
        if config.enable_lora:
            if mc.family == "moe":
                raise ModelConfigError(f"LoRA is not supported for {mc.architecture} (experts have no PEFT "
                                       "projections keepwarm maps; supported: the Llama and Gemma families)")
            shard = None if self.tp is None or self.tp.tp_size == 1 else Shard(0, self.tp.tp_size)
            self.lora_manager = LoRAManager(self.loaded.model, mc, config.max_loras, config.max_lora_rank,
                                            self.dtype, self.device, shard,
                                            stage.layers if stage is not None else None)
            if self.tp is not None:
                self.lora_manager.on_write = self._publish_lora_slot
        budget = config.max_num_batched_tokens or max(2048, config.block_size)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, budget, self.max_model_len),
                                   self.block_manager, self.lora_manager)
        self.runner = ModelRunner(self.loaded.model, kv_cache, config.block_size,
                                  self.block_manager.get_block_ids, self.device, self.lora_manager,
                                  enforce_eager=config.enforce_eager, tp=self.tp, vocab_size=mc.vocab_size,
                                  stage=stage)
        self.sampler = Sampler()
        # Structured outputs over this tokenizer and logits width; thread-safe, so front ends compile off the engine
        # thread. It indexes the vocabulary on first use.
        self.grammar_compiler = GrammarCompiler.for_tokenizer(self.tokenizer, self.model_config.vocab_size,
                                                              self.eos_token_ids)
        self.stats = EngineStats()
        self._requests: dict[str, _Request] = {}
        self._seq_to_request: dict[str, _Request] = {}
        self._phase("engine_rest", t)
        log.info("engine ready: %s on %s, dtype %s, max_model_len %d, %d KV blocks of %d (%s), weights from %s",
                 self._model_dir.name, self.device, self.dtype, self.max_model_len, num_blocks,
                 config.block_size, kv_dtype, self.weights_source)

    # -- setup -------------------------------------------------------------------------------------------------
    def _start_tensor_parallel(self, loaded: LoadedModel | None) -> LoadedModel:
        """Start ranks 1..N-1, have every rank load its shard or pipeline stage (this one too), and return this
        rank's model. Whatever tensor or pipeline parallelism cannot run is refused here, before a process starts."""
        config, mc, pp = self.config, self.model_config, self.config.pipeline_parallel_size
        n = config.tensor_parallel_size * pp
        check_pipeline(mc, pp)
        check_supported(mc, config.tensor_parallel_size)
        if loaded is not None:
            raise TensorParallelError("tensor parallelism loads its own shards: a preloaded model cannot be given")
        daemon = self._daemon_for_ranks()
        self._threads_before_tp = torch.get_num_threads()
        threads = max(1, self._threads_before_tp // n)  # the ranks share this process's cores; restored on close
        torch.set_num_threads(threads)
        self.tp = tp = TensorParallelGroup.launch(n, self.device, config.distributed_timeout, threads,
                                                  config.nodes())
        try:
            tp.send(Setup(str(self._model_dir), config.dtype, config.quantization, self.device.type,
                          self.max_model_len, daemon, config.runtime_dir, config.fingerprint, threads, config.seed,
                          config.max_loras if config.enable_lora else 0, config.max_lora_rank,
                          str(self.dtype).removeprefix("torch."), pp))
            tp.make_stage_groups(pp)
            error: BaseException | None = None
            loaded = None
            try:
                loaded = load_model(self._model_dir, config.dtype, config.quantization, self.device,
                                    self.max_model_len, daemon,
                                    Path(config.runtime_dir) if config.runtime_dir else None, config.fingerprint, tp)
            except Exception as e:  # noqa: BLE001 - every rank must still agree before this one raises
                error = e
            failed = tp.agree(error is None)
            if error is not None:
                raise error
            if failed or loaded is None:
                raise TensorParallelError(f"tensor-parallel rank(s) {failed} could not load {self._model_dir.name} "
                                          "(their error is in the log)")
        except BaseException:
            tp.dead = tp.dead or "tensor parallel: the start failed"  # no Shutdown message: stop the ranks now
            tp.close()
            self.tp = None
            torch.set_num_threads(self._threads_before_tp)
            raise
        log.info("%s parallel: rank 0 of %d, %d torch thread(s) per rank, %.1f MB of weights on this rank",
                 "pipeline" if pp > 1 else "tensor", n, threads, loaded.nbytes / 1e6)
        return loaded

    def _publish_lora_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Rank 0 writes a LoRA slot: the other ranks write the same adapter (their part of it) there too."""
        assert self.tp is not None
        self.tp.check()
        if adapter is None:
            self.tp.send(LoRASlot(slot, "", "", 0, 1.0, []))
            return
        self.tp.send(LoRASlot(slot, adapter.name, adapter.digest, adapter.rank, adapter.scaling,
                              lora_weights(adapter.weights)))

    def _daemon_for_ranks(self) -> bool | str:
        """The daemon setting every rank loads with: a daemon that must be started is started here, once, so the
        ranks do not race to start it; when that fails and a disk load is allowed, every rank loads from disk."""
        daemon = self.config.daemon
        if daemon is not True and daemon not in ("on", "start"):
            return daemon
        runtime_dir = Path(self.config.runtime_dir) if self.config.runtime_dir else None
        try:
            client, _ = ensure_daemon(runtime_dir, device="cuda" if self.device.type == "cuda" else "cpu")
            client.close()
            return True
        except (DaemonError, RuntimeDirError) as e:
            if daemon == "start":
                log.warning("tensor parallel: no daemon (%s); every rank loads from disk", getattr(e, "message", e))
                return False
            raise

    def check_health(self) -> None:
        """Raise EngineDeadError when the engine cannot go on though idle (a tensor-parallel rank is gone)."""
        if self.tp is not None and self.tp.dead is not None:
            raise EngineDeadError(self.tp.dead)
    def _phase(self, name: str, since: float, minus: float = 0.0) -> float:
        """Record ``name`` as the time since ``since`` (perf_counter), less ``minus``; returns now."""
        now = time.perf_counter()
        self.startup_phases[name] = max(0.0, now - since - minus)
        return now

    @staticmethod
    def _resolve_max_model_len(config: EngineConfig, mc) -> int:
        limit = mc.max_position_embeddings
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit:
            raise ModelConfigError(f"max_model_len {config.max_model_len} exceeds the model's limit of {limit} "
                                   "(max_position_embeddings)")
        if config.max_model_len < 2:
            raise ModelConfigError("max_model_len must be at least 2")
        return config.max_model_len

    @staticmethod
    def _load_tokenizer(path: str):
        from keepwarm.worker.tokenizer import load_tokenizer

        try:
            return load_tokenizer(path)
        except Exception as e:  # transformers raises many types; the message is what matters
            raise ModelConfigError(f"cannot load a tokenizer from {path!r}: {str(e).splitlines()[0]}") from None

    def _num_kv_blocks(self, kv_dtype: torch.dtype) -> int:
        c, mc = self.config, self.model_config
        if self.tp is not None:
            mc = local_config(mc, self.tp.tp_size)  # a rank's KV heads: every rank holds the same count
        per_block = kv_bytes_per_block(mc, c.block_size, kv_dtype)
        if c.num_gpu_blocks is not None:
            n = c.num_gpu_blocks
        elif c.kv_cache_memory_bytes is not None:
            n = c.kv_cache_memory_bytes // per_block
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            n = int(total * c.gpu_memory_utilization - (total - free)) // per_block
        else:
            wanted = -(-c.max_num_seqs * self.max_model_len // c.block_size)
            n = min(wanted, DEFAULT_CPU_KV_CACHE_BYTES // per_block)
        needed = -(-self.max_model_len // c.block_size)
        if n < needed:
            raise ModelConfigError(
                f"the KV cache holds {n} blocks ({n * c.block_size} tokens) but max_model_len "
                f"{self.max_model_len} needs {needed}; lower max_model_len or give the KV cache more memory")
        return n

    # -- requests ----------------------------------------------------------------------------------------------
    # -- LoRA adapters (call from the engine's thread) ---------------------------------------------------------
    def add_lora(self, adapter: LoRAAdapter) -> None:
        if self.lora_manager is None:
            raise LoRAError("LoRA is not enabled (--enable-lora)")
        if adapter.name in self.loras:
            raise LoRAError(f"an adapter named {adapter.name!r} is already loaded")
        limit = self.config.max_cpu_loras
        if limit is not None and len(self.loras) >= limit:
            raise LoRAError(f"{len(self.loras)} adapters are loaded, the --max-cpu-loras limit")
        self.loras[adapter.name] = adapter

    def lora_requests_in_flight(self, name: str) -> int:
        return sum(1 for s in self.scheduler.running + list(self.scheduler.waiting)
                   if s.lora is not None and s.lora.name == name)

    def remove_lora(self, name: str) -> LoRAAdapter:
        """Unregister an adapter; refuses (LoRAError) while requests for it are in flight."""
        adapter = self.loras.get(name)
        if adapter is None:
            raise LoRAError(f"no adapter named {name!r} is loaded")
        n = self.lora_requests_in_flight(name)
        if n:
            raise LoRAError(f"adapter {name!r} has {n} request(s) in flight")
        if self.lora_manager is not None:
            self.lora_manager.evict(adapter)
        del self.loras[name]
        return adapter

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, cache_salt: str | None = None,
                    lora: LoRAAdapter | str | None = None) -> None:
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if isinstance(lora, str):
            if lora not in self.loras:
                raise RequestError(f"no adapter named {lora!r} is loaded")
            lora = self.loras[lora]
        if lora is not None:
            if self.lora_manager is None:
                raise RequestError("LoRA is not enabled (--enable-lora)")
            if lora.unloading or self.loras.get(lora.name) is not lora:
                raise RequestError(f"adapter {lora.name!r} is being unloaded")
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= self.max_model_len:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                               f"has {n} tokens (at most {self.max_model_len - 1} leave room for one output token)")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if params.logit_bias and any(t < 0 or t >= vocab for t in params.logit_bias):  # refused before it runs
            raise RequestError(f"logit_bias token ids must be in [0, {vocab})")
        params.validate()
        if isinstance(params.structured, StructuredOutputs):
            # The offline API hands the spec; the HTTP front end compiles ahead, off the engine thread.
            params = dataclasses.replace(params, structured=self.grammar_compiler.compile(params.structured))
        if self.tokenizer is None and params.stop:
            raise RequestError("stop strings need a tokenizer (the engine runs with skip_tokenizer_init)")
        if not params.ignore_eos:
            params.eos_token_ids = self.eos_token_ids
        now = time.monotonic()
        seqs, detoks = [], []
        for i in range(params.n):
            p = params
            if params.n > 1:
                p = SamplingParams(**{**params.__dict__, "n": 1,
                                      "seed": None if params.seed is None else params.seed + i})
                p.eos_token_ids = params.eos_token_ids
            seq = Sequence(f"{request_id}#{i}", prompt_token_ids, p, cache_salt=cache_salt, arrival_time=now,
                           lora=lora)
            if self._long_rope_after is not None and n > self._long_rope_after:
                self._use_long_rope(seq)
            seqs.append(seq)
            detoks.append(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, p.skip_special_tokens)
                          if p.detokenize and self.tokenizer is not None else None)
        req = _Request(request_id, prompt, seqs, detoks, [""] * len(seqs), RequestMetrics(now))
        self._requests[request_id] = req
        for seq in seqs:
            self._seq_to_request[seq.seq_id] = req
            self.scheduler.add(seq)
        self.stats.prompt_tokens += n

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def abort_request(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
            self._seq_to_request.pop(seq.seq_id, None)
        self._request_ended(req)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        try:
            batch = self.scheduler.schedule()
        except Exception as e:
            raise EngineDeadError(f"scheduling failed: {type(e).__name__}: {e}") from e
        if not batch:
            return []
        self.stats.steps += 1
        scheduled_at = time.monotonic()
        for seq in batch.seqs:
            if seq.scheduled_time is None:
                seq.scheduled_time = scheduled_at
        token_rows, sample_index, sampled_seqs, prompt_rows = self._rows(batch)
        try:
            logits = self.runner.execute(batch, token_rows)
        except Exception as e:
            raise EngineDeadError(f"the forward pass failed: {type(e).__name__}: {e}") from e
        failed: dict[str, tuple[_Request, BaseException]] = {}
        if prompt_rows:
            self._record_prompt_logprobs(logits, prompt_rows, failed)
        self.scheduler.advance(batch)
        outputs: list[RequestOutput] = []
        if sampled_seqs:
            logits = logits[torch.tensor(sample_index)] if len(sample_index) != len(token_rows) else logits
            sampled = self._sample_isolated(logits, sampled_seqs, failed)
            touched: dict[str, _Request] = {}
            now = time.monotonic()
            step_tokens = 0
            for seq, (token, lp) in sampled:
                req = self._seq_to_request.get(seq.seq_id)
                if req is None or req.request_id in failed:
                    continue
                try:
                    seq.append_token(token, lp)
                    step_tokens += self._record_token(seq, now)
                    self.stats.generation_tokens += 1
                    touched[req.request_id] = req
                    self._process_token(req, seq, token)
                except Exception as e:  # noqa: BLE001 - this request's fault alone
                    failed[req.request_id] = (req, e)
            for rid, req in touched.items():
                if rid in failed:
                    continue
                try:
                    outputs.append(self._make_output(req))
                except Exception as e:  # noqa: BLE001
                    failed[rid] = (req, e)
            if step_tokens and self.stats.observations is not None:
                self.stats.observations.iteration_tokens.append(step_tokens)
        outputs += [self._fail_request(req, e) for req, e in failed.values()]
        return outputs

    def _record_token(self, seq: Sequence, now: float) -> int:
        """Time ``seq``'s new token for the metrics. Returns what it adds to the step's token count, as vLLM counts
        it: each generated token, and a prompt (less its cached tokens) in the step that completes its prefill."""
        obs = self.stats.observations
        previous, seq.last_token_time = seq.last_token_time, now
        if seq.first_token_time is not None:
            if obs is not None and previous is not None:
                obs.inter_token_latency.append(now - previous)
            return 1
        seq.first_token_time = now
        cached = seq.num_cached_prompt_tokens
        computed = seq.num_prompt_tokens - cached
        self.stats.prompt_tokens_computed += computed
        self.stats.prompt_tokens_cached += cached
        if obs is not None:
            obs.time_to_first_token.append(now - seq.arrival_time)
        return computed + 1

    def _rows(self, batch) -> tuple[list[int], list[int], list[Sequence], list[tuple[Sequence, int, int, int]]]:
        """Which flattened token rows need logits: each sequence's last row when it samples, and every prompt
        row of a chunk whose prompt logprobs were asked for."""
        token_rows: list[int] = []
        sample_index: list[int] = []  # into token_rows, one per sampling sequence
        sampled_seqs: list[Sequence] = []
        # (seq, first index into token_rows, first position, rows): prompt rows whose logprobs were asked for
        prompt_rows: list[tuple[Sequence, int, int, int]] = []
        row = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            c = seq.num_computed_tokens
            if seq.prompt_logprobs is not None and c + 1 < seq.num_prompt_tokens:
                last_pos = min(c + n, seq.num_prompt_tokens - 1)  # positions c..last_pos-1 predict prompt tokens
                prompt_rows.append((seq, len(token_rows), c, last_pos - c))
                token_rows.extend(range(row, row + last_pos - c))
            if c + n == seq.num_tokens:
                if token_rows and token_rows[-1] == row + n - 1:
                    sample_index.append(len(token_rows) - 1)
                else:
                    sample_index.append(len(token_rows))
                    token_rows.append(row + n - 1)
                sampled_seqs.append(seq)
            row += n
        return token_rows, sample_index, sampled_seqs, prompt_rows

    def _sample_isolated(self, logits: torch.Tensor, seqs: list[Sequence],
                         failed: dict[str, tuple[_Request, BaseException]],
                         ) -> list[tuple[Sequence, tuple[int, TokenLogprob | None]]]:
        """Sample the batch; if that raises, sample row by row so only the rows that fail lose their request."""
        try:
            out = self.sampler.sample(logits, seqs)
            return list(zip(seqs, zip(out.token_ids, out.logprobs, strict=True), strict=True))
        except Exception:  # noqa: BLE001 - find the row(s) at fault below
            pass
        results = []
        for i, seq in enumerate(seqs):
            try:
                one = self.sampler.sample(logits[i:i + 1], [seq])
            except Exception as e:  # noqa: BLE001
                req = self._seq_to_request.get(seq.seq_id)
                if req is not None:
                    failed.setdefault(req.request_id, (req, e))
                continue
            results.append((seq, (one.token_ids[0], one.logprobs[0])))
        return results

    def _fail_request(self, req: _Request, error: BaseException) -> RequestOutput:
        """End ``req`` alone after an internal error tied to it: abort its sequences (KV freed), say so once."""
        log.error("request %s failed inside the engine and was aborted: %s: %s", req.request_id,
                  type(error).__name__, error, exc_info=error)
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED, reason="error")  # vLLM's "error": a 500
            self._seq_to_request.pop(seq.seq_id, None)
        self._requests.pop(req.request_id, None)
        self._request_ended(req)
        req.metrics.finished_time = time.monotonic()
        outs = [CompletionOutput(index=i, text=req.texts[i], token_ids=list(seq.output_token_ids),
                                 finish_reason=SequenceStatus.FINISHED_ABORTED.value)
                for i, seq in enumerate(req.seqs)]
        return RequestOutput(req.request_id, req.prompt, list(req.seqs[0].prompt_token_ids), outs, True,
                             metrics=req.metrics, error=f"{type(error).__name__}: {error}")

    def _record_prompt_logprobs(self, logits: torch.Tensor, prompt_rows: list[tuple[Sequence, int, int, int]],
                                failed: dict[str, tuple[_Request, BaseException]]) -> None:
        for seq, first, start_pos, n in prompt_rows:
            try:
                self._prompt_logprobs_of(seq, logits[first:first + n], start_pos, n)
            except Exception as e:  # noqa: BLE001 - this request's fault alone
                req = self._seq_to_request.get(seq.seq_id)
                if req is not None:
                    failed.setdefault(req.request_id, (req, e))

    @staticmethod
    def _prompt_logprobs_of(seq: Sequence, logits: torch.Tensor, start_pos: int, n: int) -> None:
        lp = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(seq.prompt_token_ids[start_pos + 1:start_pos + 1 + n])
        chosen = lp.gather(1, targets[:, None])[:, 0]
        ranks = (lp > chosen[:, None]).sum(dim=-1) + 1
        k = seq.sampling_params.prompt_logprobs or 0
        top_vals, top_ids = lp.topk(k, dim=-1) if k else (None, None)
        for i in range(n):
            if start_pos + 1 + i < len(seq.prompt_logprobs):
                continue  # recomputed after a preemption: already recorded
            top = tuple(zip(top_ids[i].tolist(), top_vals[i].tolist(), strict=True)) if k else ()
            seq.prompt_logprobs.append(TokenLogprob(int(targets[i]), float(chosen[i]), int(ranks[i]), top))

    def _process_token(self, req: _Request, seq: Sequence, token: int) -> None:
        p = seq.sampling_params
        idx = req.seqs.index(seq)
        status = None
        if token in p.stop_token_ids and seq.num_output_tokens >= p.min_tokens:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        elif token in p.eos_token_ids and seq.num_output_tokens >= p.min_tokens:
            status = SequenceStatus.FINISHED_STOPPED
        grammar_done = False
        if status is None and seq.grammar is not None:
            if not seq.grammar.accept(token):  # the mask allows only what the grammar takes: an engine bug
                log.error("request %s: the grammar rejected sampled token %d (%s)", req.request_id, token,
                          seq.grammar.error)
            # Complete: the grammar takes nothing but EOS, which would not be part of the text anyway.
            grammar_done = seq.grammar.is_stopped
        detok = req.detoks[idx]
        if detok is not None and status is None:  # an EOS / stop token is not part of the text
            new_text = detok.step([token])
            req.texts[idx] = detok.output_text
            if p.stop and new_text and seq.num_output_tokens >= p.min_tokens:
                hit = check_stop_strings(detok.output_text, new_text, p.stop, p.include_stop_str_in_output)
                if hit is not None:
                    status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, hit.stop_str
                    req.texts[idx] = hit.text
        if status is None:
            out_of_tokens = p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens
            if grammar_done:
                status = SequenceStatus.FINISHED_STOPPED
            elif out_of_tokens or seq.num_tokens >= self.max_model_len:
                status = SequenceStatus.FINISHED_LENGTH
            if status is not None and detok is not None:
                detok.flush()  # text held back for an incomplete character is final now
                req.texts[idx] = detok.output_text
        if status is not None:
            self._finish(seq, status)
        elif self._long_rope_after is not None and not seq.rope_long and seq.num_tokens > self._long_rope_after:
            # transformers recomputes the whole cache with the long factors when a sequence first outgrows the
            # original context (Phi3ForCausalLM.prepare_inputs_for_generation): so do we, by recompute.
            self.scheduler.recompute(seq)
            self._use_long_rope(seq)

    @staticmethod
    def _use_long_rope(seq: Sequence) -> None:
        seq.rope_long = True
        seq.cache_salt = f"{seq.cache_salt or ''}longrope"  # blocks rotated with other factors are never shared

    def _finish(self, seq: Sequence, status: SequenceStatus, reason: str | None = None) -> None:
        """End ``seq``; ``reason`` (default: its status) is what the metrics count it as."""
        self.scheduler.finish(seq, status)
        self.sampler.forget(seq.seq_id)
        reason = reason or status.value
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        if self.stats.observations is not None:
            self.stats.observations.finished.append(FinishedSequence(
                reason, seq.arrival_time, seq.scheduled_time, seq.first_token_time, seq.last_token_time,
                time.monotonic(), seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_prompt_tokens,
                seq.sampling_params.max_tokens, seq.num_preemptions))

    def _request_ended(self, req: _Request) -> None:
        """Every sequence of ``req`` has ended: its n and longest output, for the metrics."""
        if self.stats.observations is not None:
            self.stats.observations.requests.append((len(req.seqs), max(s.num_output_tokens for s in req.seqs)))

    def _make_output(self, req: _Request) -> RequestOutput:
        finished = all(s.is_finished for s in req.seqs)
        first = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
        req.metrics.first_token_time = min(first) if first else None
        req.metrics.num_cached_tokens = req.seqs[0].num_cached_prompt_tokens
        outs = []
        for i, seq in enumerate(req.seqs):
            # Copies, like token_ids: the engine thread keeps appending to the sequence's own lists while a
            # front end reads this output.
            lps = list(seq.output_logprobs) if seq.sampling_params.logprobs is not None else None
            outs.append(CompletionOutput(
                index=i, text=req.texts[i], token_ids=list(seq.output_token_ids),
                cumulative_logprob=sum(x.logprob for x in lps) if lps else None, logprobs=lps,
                finish_reason=seq.status.value if seq.is_finished else None, stop_reason=seq.stop_reason))
        if finished:
            req.metrics.finished_time = time.monotonic()
            self._requests.pop(req.request_id, None)
            self._request_ended(req)
            for seq in req.seqs:
                self._seq_to_request.pop(seq.seq_id, None)
        return RequestOutput(req.request_id, req.prompt, list(req.seqs[0].prompt_token_ids), outs, finished,
                             metrics=req.metrics, prompt_logprobs=req.seqs[0].prompt_logprobs)

    def close(self) -> None:
        """Release the daemon lease (if attached) and stop the other tensor-parallel ranks. The engine is unusable
        afterwards."""
        self.loaded.close()
        if self.tp is not None:
            self.tp.close()
            torch.set_num_threads(self._threads_before_tp)

    # -- introspection -----------------------------------------------------------------------------------------
    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    @property
    def model_dir(self) -> Path:
        return self._model_dir

    def effective_config(self) -> dict:
        """What the engine actually runs with, read from its live parts (scheduler, block manager, KV pool, model
        weights, LoRA manager), never from ``self.config``: a setting that stops reaching them shows here."""
        lm = self.lora_manager
        layer0 = self.loaded.model.model.layers[0]
        weight = layer0.self_attn.qkv_proj.weight
        kv_pool = self.runner.kv_cache.key[0]
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantization": weight.meta.scheme if getattr(weight, "is_quantized_weight", False) else "none",
            "max_model_len": self.scheduler.config.max_model_len,
            "max_num_seqs": self.scheduler.config.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.config.max_num_batched_tokens,
            "block_size": self.block_manager.block_size,
            "num_kv_blocks": len(self.block_manager.pool.blocks),
            "kv_pool_block_size": kv_pool.shape[2],
            "kv_cache_dtype": str(kv_pool.dtype).removeprefix("torch."),
            "enable_prefix_caching": self.block_manager.enable_prefix_caching,
            "cuda_graphs": self.runner.cuda_graphs is not None,
            "seed": torch.initial_seed(),
            "threads": torch.get_num_threads(),
            "tokenizer": self.tokenizer.name_or_path,
            "weights_source": self.loaded.source,
            "fingerprint": self.loaded.fingerprint,
            "enable_lora": lm is not None,
            "max_loras": lm.max_loras if lm is not None else None,
            "max_lora_rank": lm.max_rank if lm is not None else None,
            "max_cpu_loras": self.config.max_cpu_loras,  # enforced in add_lora from the config itself
            "tensor_parallel_size": self.tp.tp_size if self.tp is not None else 1,
            "pipeline_parallel_size": self.tp.pp_size if self.tp is not None else 1,
            "tensor_parallel_pids": self.tp.rank_pids() if self.tp is not None else None,
        }
