"""Turns a scheduled batch into one flattened forward pass over the paged KV cache.

A step is first made into host tensors (``host_inputs``: a ``parallel.messages.Step``, the typed batch), then run
(``run``). Under tensor parallelism rank 0 broadcasts that ``Step`` before running it and every other rank runs the
same ``run`` on its shard; the logits are gathered to rank 0. Under pipeline parallelism (``stage``) rank 0 runs
the step as micro-batches through the stages (``parallel.pipeline``) and every other stage runs its layers of each.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from keepwarm import kernels
from keepwarm.formats.model_config import ModelConfig
from keepwarm.weights.sharding import Stage
from keepwarm.worker.cuda_graphs import CudaGraphRunner, graphs_supported
from keepwarm.worker.models.llama import AttentionMetadata, KVCache, LlamaForCausalLM
from keepwarm.worker.parallel.group import ParallelGroup
from keepwarm.worker.parallel.messages import Step
from keepwarm.worker.parallel.pipeline import irecv, isend, split_step, stage_forward

if TYPE_CHECKING:  # the engine package imports this module: at run time it would be half-built here
    from keepwarm.worker.engine.scheduler import ScheduledBatch

log = logging.getLogger("keepwarm.worker")

FP8_KV_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class CacheConfig:
    num_blocks: int
    block_size: int
    dtype: torch.dtype  # storage dtype of the pool (model dtype, or fp8 e4m3)


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elt = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_hidden_layers * block_size * model.num_key_value_heads * model.head_dim * elt


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zero-filled pool. On CPU an anonymous mapping: the kernel hands out zero pages on first touch, so a 1 GiB
    pool costs nothing at startup (torch.zeros would memset all of it) and only the blocks used take memory."""
    if device.type != "cpu" or not torch.Size(shape).numel():
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def allocate_kv_cache(model: ModelConfig, cache: CacheConfig, device: torch.device,
                      k_scales: list[float] | None = None, v_scales: list[float] | None = None,
                      layers: range | None = None) -> KVCache:
    """Every layer's pools, or (``layers``: a pipeline stage's) only those layers' (the others empty)."""
    shape = (model.num_key_value_heads, cache.num_blocks, cache.block_size, model.head_dim)
    # One allocation per layer and side keeps each layer's pool contiguous for the kernels.
    L = model.num_hidden_layers
    mine = range(L) if layers is None else layers
    none = (model.num_key_value_heads, 0, cache.block_size, model.head_dim)
    return KVCache(
        key=[_zeroed(shape if i in mine else none, cache.dtype, device) for i in range(L)],
        value=[_zeroed(shape if i in mine else none, cache.dtype, device) for i in range(L)],
        k_scales=list(k_scales or [1.0] * L),
        v_scales=list(v_scales or [1.0] * L),
    )


class ModelRunner:
    """Owns the model and the KV cache; ``execute`` runs one step and returns logits of the sampled rows."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int,
                 block_ids_of: callable, device: torch.device, lora_manager=None, enforce_eager: bool = False,
                 tp: ParallelGroup | None = None, vocab_size: int | None = None, stage: Stage | None = None,
                 act_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.lora_manager = lora_manager
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.block_ids_of = block_ids_of
        self.device = device
        self.tp = tp
        self.stage = stage  # this process's pipeline stage (tp is then the group of stages), or None
        self.act_dtype = act_dtype  # the activations a pipeline stage receives
        self.vocab_size = vocab_size or model.config.vocab_size
        # The sliding windows the layers use (None: full context): one attention plan per window and step.
        cfg = model.config
        self.windows = tuple(dict.fromkeys(cfg.window_of(i) for i in range(cfg.num_hidden_layers)))
        self.cuda_graphs = self._make_cuda_graphs(enforce_eager or tp is not None)

    def host_inputs(self, batch: ScheduledBatch, token_rows: list[int]) -> Step:
        """The step as host tensors: what the forward reads, nothing of the scheduler's objects."""
        ids: list[int] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            c = seq.num_computed_tokens
            ids.extend(seq.all_token_ids[c:c + n])
            starts.append(c)
            tables.append(self.block_ids_of(seq))
        q_lens = torch.tensor(batch.num_new_tokens, dtype=torch.int64)
        start = torch.tensor(starts, dtype=torch.int64)
        qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=qsl[1:])
        T = int(qsl[-1])
        seq_idx = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
        positions = torch.arange(T, dtype=torch.int64) - qsl[:-1][seq_idx] + start[seq_idx]
        rope_positions = positions
        if any(seq.rope_long for seq in batch.seqs):
            # longrope: the long-factor rotary table sits at [max_position, 2 * max_position) (llama.rope_tables).
            long = torch.tensor([seq.rope_long for seq in batch.seqs], dtype=torch.int64)
            rope_positions = positions + long[seq_idx] * self.model.max_position
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        slots = block_tables[seq_idx, positions // self.block_size] * self.block_size + positions % self.block_size
        # The model reads positions only for rotary: KV slots come from the true positions above.
        return Step(input_ids=torch.tensor(ids, dtype=torch.int64), positions=rope_positions, slot_mapping=slots,
                    block_tables=block_tables.to(torch.int32), seq_lens=(start + q_lens).to(torch.int32),
                    query_start_loc=qsl.to(torch.int32), max_query_len=int(q_lens.max()),
                    token_rows=torch.tensor(token_rows, dtype=torch.int64), lora_slots=self._lora_slots(batch))

    def _lora_slots(self, batch: ScheduledBatch) -> torch.Tensor:
        """Each sequence's LoRA slot, or an empty tensor when the whole batch is the base model."""
        slots = [seq.lora_slot for seq in batch.seqs] if self.lora_manager is not None else []
        return torch.tensor(slots if any(s >= 0 for s in slots) else [], dtype=torch.int64)

    def device_inputs(self, step: Step) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=step.slot_mapping.to(dev),
            block_tables=step.block_tables.to(dev),
            seq_lens=step.seq_lens.to(dev),
            query_start_loc=step.query_start_loc.to(dev),
            max_query_len=step.max_query_len,
        )
        attn.plan = kernels.plan_attention(attn.block_tables, attn.seq_lens, attn.query_start_loc, attn.slot_mapping,
                                           self.block_size, self.windows)
        # The model reads positions only for rotary: KV slots come from the true positions (host_inputs).
        rope_positions = step.positions.to(dev)
        attn.rotary = {name: kernels.plan_rotary(rope_positions, table) for name, table in self.model.cos_sin.items()}
        return step.input_ids.to(dev), rope_positions, attn

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, token_rows: list[int]) -> torch.Tensor:
        """Run the batch; return float32 logits of the flattened token rows ``token_rows`` (the last row of
        each sequence to sample, plus every row of a prefill chunk whose prompt logprobs were asked for)."""
        step = self.host_inputs(batch, token_rows)
        if self.stage is not None:
            return self._execute_pipelined(step)
        if self.tp is not None:
            self.tp.check()
            self.tp.send(step)
            self.tp.stats.steps += 1
        logits = self.run(step)
        assert logits is not None  # rank 0 (or no tensor parallelism) always gets the logits
        return logits

    @torch.inference_mode()
    def run(self, step: Step) -> torch.Tensor | None:
        """The forward of one step and the logits of its ``token_rows``: on rank 0 [R, vocab] float32; on
        another tensor-parallel rank None (its logit columns are gathered to rank 0)."""
        if self.stage is not None:
            self._run_stage(step)
            return None
        input_ids, positions, attn = self.device_inputs(step)
        if self.lora_manager is not None:
            self.lora_manager.set_batch(step.lora_slots, step.query_start_loc.diff(), self.device)
        try:
            hidden = self._forward(input_ids, positions, attn)
        finally:
            if self.lora_manager is not None:
                self.lora_manager.clear_batch()
        if not step.token_rows.numel():
            return torch.empty(0, self.vocab_size) if self.tp is None or self.tp.rank == 0 else None
        if step.token_rows.numel() != hidden.shape[0] or not torch.equal(
                step.token_rows, torch.arange(hidden.shape[0])):  # a decode batch samples every row: no gather
            hidden = hidden[step.token_rows.to(hidden.device)]
        logits = self.model.compute_logits(hidden)
        return logits if self.tp is None else self.tp.gather_logits(logits, self.vocab_size)

    # -- pipeline parallelism (worker/parallel/pipeline.py) --------------------------------------------------------
    def _execute_pipelined(self, step: Step) -> torch.Tensor:
        """Rank 0, stage 0: the step as micro-batches through the stages; the logits back in the step's order."""
        tp, stage = self.tp, self.stage
        assert tp is not None and stage is not None and stage.first
        micro = split_step(step, stage.stages)
        last_leader, nxt = (stage.stages - 1) * tp.tp_size, tp.rank + tp.tp_size
        # Every receive is posted first, so the last stage's sends never wait on this rank's forwards.
        recvs = [irecv((int(mb.token_rows.numel()), self.vocab_size), torch.float32, last_leader, self.device)
                 if mb.token_rows.numel() else None for mb, _ in micro]
        sends = []
        for mb, _ in micro:
            tp.check()
            tp.send(mb)
            tp.stats.steps += 1
            hidden, residual = self._stage_forward(mb)
            assert residual is not None
            sends += [isend(hidden, nxt), isend(residual, nxt)]  # not waited: this stage goes on to the next one
        out = torch.empty(step.token_rows.numel(), self.vocab_size, device=self.device)
        for (_, rows), posted in zip(micro, recvs, strict=True):
            if posted is not None:
                posted[1].wait()
                out[rows.to(self.device)] = posted[0]
        for work in sends:
            work.wait()
        return out

    def _run_stage(self, step: Step) -> None:
        """A rank other than 0 under pipeline parallelism: receive the hidden state and residual (the first stage:
        embed), run this stage's layers, send them on to the same tensor-parallel rank of the next stage (the last
        stage: gather the logit columns of the sampled rows to its first rank, which sends them to rank 0)."""
        stage, tp, dev = self.stage, self.tp, self.device
        assert stage is not None and tp is not None and self.act_dtype is not None
        hidden = residual = None
        if not stage.first:
            shape = (int(step.input_ids.shape[0]), self.model.config.hidden_size)
            (hidden, got_h), (residual, got_r) = (irecv(shape, self.act_dtype, tp.rank - tp.tp_size, dev)
                                                  for _ in range(2))
            got_h.wait()
            got_r.wait()
        hidden, res = self._stage_forward(step, hidden, residual)
        if not stage.last:
            assert res is not None
            for work in (isend(hidden, tp.rank + tp.tp_size), isend(res, tp.rank + tp.tp_size)):
                work.wait()
        elif step.token_rows.numel():
            local = self.model.compute_logits(hidden[step.token_rows.to(dev)])
            logits = tp.gather_logits(local, self.vocab_size) if tp.tp_size > 1 else local
            if logits is not None:  # this stage's first rank
                isend(logits, 0).wait()

    def _stage_forward(self, step: Step, hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's layers over one (micro-)step, with the step's LoRA slots set around them."""
        assert self.stage is not None
        input_ids, positions, attn = self.device_inputs(step)
        if self.lora_manager is not None:
            self.lora_manager.set_batch(step.lora_slots, step.query_start_loc.diff(), self.device)
        try:
            return stage_forward(self.model, self.stage, input_ids, positions, attn, self.kv_cache, hidden, residual)
        finally:
            if self.lora_manager is not None:
                self.lora_manager.clear_batch()

    # -- CUDA graphs (worker/cuda_graphs.py): decode-only batches replay a captured forward ---------------------------
    def _make_cuda_graphs(self, enforce_eager: bool):
        if enforce_eager or self.device.type != "cuda":
            return None
        reason = graphs_supported(self.device)
        if reason is not None:
            log.info("CUDA graphs off: %s", reason)
            return None
        return CudaGraphRunner(self.model, self.kv_cache, self.block_size, self.device)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        graphs = self.cuda_graphs
        lora_active = self.lora_manager is not None and self.lora_manager.token_slots is not None
        if graphs is not None and not lora_active and graphs.can_run(attn, input_ids.shape[0]):
            hidden = graphs.run(input_ids, positions, attn)
            if hidden is not None:
                return hidden
        return self.model(input_ids, positions, attn, self.kv_cache)
