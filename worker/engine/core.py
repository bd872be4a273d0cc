"""The engine core: requests in, tokens out, one scheduler step at a time.

``step()`` = schedule -> execute (the model runner's forward; logits of the rows that need them) -> sample ->
advance (the scheduler's progress; each token to ``output.py``: text, stops, outputs). The rest is delegated:
``input.py`` makes a request's sequences, ``kv_sizing.py`` sizes the KV pool, ``lora_registry.py`` keeps the
adapters, ``parallel/launch.py`` starts the other ranks. The offline ``LLM`` drives the engine in a loop; the API
server drives it from a thread beside its event loop (``async_engine.py``).

Isolation (rules): an exception tied to one request (its sampling row, its detokenization, stop checks, prompt
logprobs, its output) fails that request alone: its sequences are aborted (KV blocks freed), one log line names
the request id, and ``step()`` returns a final output for it with ``error`` set; the other requests go on. An
exception in what the whole batch shares (scheduling, the forward pass) means the engine cannot go on: it is
raised as :class:`EngineDeadError` and the caller must stop using the engine (the server exits non-zero).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from keepwarm.formats.model_config import ModelConfig, load_model_config, parse_dtype
from keepwarm.kernels.cpu_malloc import keep_freed_memory
from keepwarm.weights.sharding import local_config, stage_of
from keepwarm.worker.engine.block_manager import BlockManager
from keepwarm.worker.engine.config import (
    EngineConfig,
    check_cache_settings,
    long_rope_after,
    rank_setup,
    resolve_device,
    resolve_max_model_len,
)
from keepwarm.worker.engine.errors import EngineDeadError, RequestError
from keepwarm.worker.engine.input import InputProcessor, open_tokenizer
from keepwarm.worker.engine.kv_sizing import kv_cache_dtype, num_kv_blocks
from keepwarm.worker.engine.lora_registry import LoRARegistry, lora_manager_for
from keepwarm.worker.engine.output import Failures, OutputProcessor, PromptRows
from keepwarm.worker.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from keepwarm.worker.engine.sequence import Sequence
from keepwarm.worker.engine.stats import EngineStats
from keepwarm.worker.lora import LoRAAdapter
from keepwarm.worker.model_loader import LoadedModel, load_model
from keepwarm.worker.model_runner import CacheConfig, ModelRunner, allocate_kv_cache
from keepwarm.worker.outputs import RequestOutput, TokenLogprob
from keepwarm.worker.parallel.group import ParallelGroup
from keepwarm.worker.parallel.launch import start_engine_ranks
from keepwarm.worker.parallel.messages import CacheSpec
from keepwarm.worker.sampler import Sampler
from keepwarm.worker.sampling_params import SamplingParams

log = logging.getLogger("keepwarm.worker")


@dataclass
class LogitRows:
    """Which flattened token rows of a step need logits: each sequence's last row when it samples, and every prompt
    row of a chunk whose prompt logprobs were asked for."""

    token_rows: list[int] = field(default_factory=list)
    sample_index: list[int] = field(default_factory=list)  # into token_rows, one per sampling sequence
    sampled_seqs: list[Sequence] = field(default_factory=list)
    prompt: PromptRows = field(default_factory=list)


def logit_rows(batch: ScheduledBatch) -> LogitRows:
    rows = LogitRows()
    row = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        c = seq.num_computed_tokens
        if seq.prompt_logprobs is not None and c + 1 < seq.num_prompt_tokens:
            last_pos = min(c + n, seq.num_prompt_tokens - 1)  # positions c..last_pos-1 predict prompt tokens
            rows.prompt.append((seq, len(rows.token_rows), c, last_pos - c))
            rows.token_rows.extend(range(row, row + last_pos - c))
        if c + n == seq.num_tokens:
            if rows.token_rows and rows.token_rows[-1] == row + n - 1:
                rows.sample_index.append(len(rows.token_rows) - 1)
            else:
                rows.sample_index.append(len(rows.token_rows))
                rows.token_rows.append(row + n - 1)
            rows.sampled_seqs.append(seq)
        row += n
    return rows


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        # Where this engine's construction went, in seconds per phase (the worker's startup breakdown: /health,
        # the supervisor's Ready, `keepwarm bench restart`).
        self.startup_phases: dict[str, float] = {}
        t = time.perf_counter()
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's big activations reuse pages, not fault in fresh ones (cpu_malloc.py)
        model_path = Path(config.model)
        self._model_dir = model_path.resolve() if model_path.exists() else model_path
        # The weights themselves are read only on a disk load: attaching by fingerprint needs just the config and
        # tokenizer (e.g. a snapshot restored on another machine, without the original checkpoint).
        mc = self.model_config = load_model_config(self._model_dir)
        self.dtype = mc.dtype if config.dtype == "auto" else parse_dtype(config.dtype)
        self.max_model_len = resolve_max_model_len(config, mc)
        t = self._phase("model_config", t)
        self.tokenizer: Any = None if config.skip_tokenizer_init else open_tokenizer(config.tokenizer or config.model)
        t = self._phase("tokenizer", t)
        torch.manual_seed(config.seed)
        check_cache_settings(config)
        self.tp: ParallelGroup | None = None
        if config.parallel:
            self.tp, self.loaded = start_engine_ranks(
                rank_setup(config, self._model_dir, self.device, self.max_model_len, self.dtype), self.device, mc,
                config.tensor_parallel_size, config.distributed_timeout, config.nodes(), loaded)
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
            raise

    def _build(self, config: EngineConfig, mc: ModelConfig, t: float) -> None:
        """The engine's parts around the loaded model: KV pool, blocks, LoRA, scheduler, runner, sampler, the input
        and output processors."""
        kv_config = mc if self.tp is None else local_config(mc, self.tp.tp_size)  # this rank's KV heads
        kv_dtype = kv_cache_dtype(config, self.dtype)
        num_blocks = num_kv_blocks(config, kv_config, kv_dtype, self.device, self.max_model_len)
        self.cache_config = CacheConfig(num_blocks, config.block_size, kv_dtype)
        if self.tp is not None:
            self.tp.send(CacheSpec(num_blocks, config.block_size, str(kv_dtype).removeprefix("torch.")))
            self.tp.serving = True
        pp = config.pipeline_parallel_size
        stage = stage_of(mc, pp, 0) if pp > 1 else None
        kv_cache = allocate_kv_cache(kv_config, self.cache_config, self.device,
                                     layers=stage.layers if stage is not None else None)
        t = self._phase("kv_pool", t)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.lora_manager = lora_manager_for(config, mc, self.loaded.model, self.dtype, self.device, self.tp, stage)
        budget = config.max_num_batched_tokens or max(2048, config.block_size)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, budget, self.max_model_len),
                                   self.block_manager, self.lora_manager)
        self.runner = ModelRunner(self.loaded.model, kv_cache, config.block_size,
                                  self.block_manager.get_block_ids, self.device, self.lora_manager,
                                  enforce_eager=config.enforce_eager, tp=self.tp, vocab_size=mc.vocab_size,
                                  stage=stage)
        self.sampler = Sampler()
        self.stats = EngineStats()
        self.lora_registry = LoRARegistry(self.lora_manager, self.scheduler, config.max_cpu_loras)
        long_rope = long_rope_after(mc)
        self.input_processor = InputProcessor(self.tokenizer, mc, self.max_model_len, long_rope, self.lora_registry)
        # The front ends compile structured-output specs with it, off the engine thread.
        self.grammar_compiler = self.input_processor.grammar_compiler
        self.output_processor = OutputProcessor(self.scheduler, self.sampler, self.stats, self.max_model_len,
                                                long_rope)
        self._phase("engine_rest", t)
        log.info("engine ready: %s on %s, dtype %s, max_model_len %d, %d KV blocks of %d (%s), weights from %s",
                 self._model_dir.name, self.device, self.dtype, self.max_model_len, num_blocks,
                 config.block_size, kv_dtype, self.weights_source)

    def _phase(self, name: str, since: float, minus: float = 0.0) -> float:
        """Record ``name`` as the time since ``since`` (perf_counter), less ``minus``; returns now."""
        now = time.perf_counter()
        self.startup_phases[name] = max(0.0, now - since - minus)
        return now

    # -- requests ----------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, cache_salt: str | None = None,
                    lora: LoRAAdapter | str | None = None) -> None:
        if request_id in self.output_processor.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        req = self.input_processor.process(request_id, prompt_token_ids, params, prompt, cache_salt, lora)
        self.output_processor.add(req)
        for seq in req.seqs:
            self.scheduler.add(seq)
        self.stats.prompt_tokens += len(prompt_token_ids)

    def abort_request(self, request_id: str) -> bool:
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- LoRA adapters (call from the engine's thread) ---------------------------------------------------------
    @property
    def loras(self) -> dict[str, LoRAAdapter]:
        return self.lora_registry.adapters

    def add_lora(self, adapter: LoRAAdapter) -> None:
        self.lora_registry.add(adapter)

    def remove_lora(self, name: str) -> LoRAAdapter:
        """Unregister an adapter; refuses (LoRAError) while requests for it are in flight."""
        return self.lora_registry.remove(name)

    def lora_requests_in_flight(self, name: str) -> int:
        return self.lora_registry.in_flight(name)

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
        rows = logit_rows(batch)
        try:
            logits = self.runner.execute(batch, rows.token_rows)
        except Exception as e:
            raise EngineDeadError(f"the forward pass failed: {type(e).__name__}: {e}") from e
        failed: Failures = {}
        if rows.prompt:
            self.output_processor.record_prompt_logprobs(logits, rows.prompt, failed)
        self.scheduler.advance(batch)
        outputs: list[RequestOutput] = []
        if rows.sampled_seqs:
            if len(rows.sample_index) != len(rows.token_rows):
                logits = logits[torch.tensor(rows.sample_index)]
            sampled = self._sample_isolated(logits, rows.sampled_seqs, failed)
            outputs = self.output_processor.process(sampled, failed)
        return outputs + [self.output_processor.fail_request(req, e) for req, e in failed.values()]

    def _sample_isolated(self, logits: torch.Tensor, seqs: list[Sequence], failed: Failures,
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
                self.output_processor.blame(failed, seq, e)
                continue
            results.append((seq, (one.token_ids[0], one.logprobs[0])))
        return results

    # -- health and shutdown -----------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise EngineDeadError when the engine cannot go on though idle (a tensor-parallel rank is gone)."""
        if self.tp is not None and self.tp.dead is not None:
            raise EngineDeadError(self.tp.dead)

    def close(self) -> None:
        """Release the daemon lease (if attached) and stop the other parallel ranks. The engine is unusable
        afterwards."""
        self.loaded.close()
        if self.tp is not None:
            self.tp.close()

    # -- introspection -----------------------------------------------------------------------------------------
    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    @property
    def model_dir(self) -> Path:
        return self._model_dir

    def effective_config(self) -> dict[str, Any]:
        """What the engine actually runs with, read from its live parts (scheduler, block manager, KV pool, model
        weights, LoRA manager), never from ``self.config``: a setting that stops reaching them shows here."""
        lm = self.lora_manager
        layer0: Any = self.loaded.model.model.layers[0]
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
            "max_cpu_loras": self.lora_registry.max_cpu_loras,
            "tensor_parallel_size": self.tp.tp_size if self.tp is not None else 1,
            "pipeline_parallel_size": self.tp.pp_size if self.tp is not None else 1,
            "tensor_parallel_pids": self.tp.rank_pids() if self.tp is not None else None,
        }
