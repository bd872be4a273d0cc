"""Pipeline parallelism: contiguous layer ranges per stage, activations passed with torch.distributed send/recv.

Rules (``P`` stages of ``T`` tensor-parallel ranks, rank ``s * T + t`` is stage ``s``'s rank ``t``; the schedule in
full: docs/architecture.md, "Tensor parallelism", pipeline parallelism):
- Stage ``s`` holds layers ``stage_layers(L, P, s)`` (``keepwarm.weights.sharding``), cut over its ranks, with an
  all-reduce in its own process group. Its model keeps placeholders for the rest (``make_stage``) and binds only its
  own weights (``stage_tensors``: views into its arena, no copy); its KV cache holds its own layers.
- Stage 0 is rank 0 (the engine, its scheduler and sampler). Each step is split into up to ``P`` micro-batches by
  sequence (``split_step``); for each, rank 0 broadcasts its ``Step``, runs its layers and sends the hidden state and
  residual on without waiting (``isend``), so stage 0 runs micro-batch k + 1 while stage 1 runs micro-batch k.
- Every other stage receives, runs its layers and sends on (stage s's rank t to stage s + 1's rank t); the last
  gathers its ranks' logit columns and sends the float32 logits of the sampled rows to rank 0, which posted those
  receives before the first micro-batch.
- Activations cross as raw bytes in the model dtype, shaped by the ``Step`` every rank has: nothing else crosses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from keepwarm.weights.sharding import Stage
from keepwarm.worker.models.layers import BoundModule
from keepwarm.worker.models.llama import AttentionMetadata, KVCache, LlamaForCausalLM
from keepwarm.worker.parallel.messages import Step

_TENSOR_FIELDS = ("input_ids", "positions", "slot_mapping")  # per token


def make_stage(model: LlamaForCausalLM, stage: Stage) -> None:
    """Swap every part ``stage`` does not run for an empty module (before ``load_weights``: no weight slot)."""
    for i in range(len(model.model.layers)):
        if i not in stage.layers:
            model.model.layers[i] = nn.Module()
    if not stage.first:
        model.model.embed_tokens = nn.Module()  # type: ignore[assignment]  # a stub: this stage never embeds
    if not stage.last:
        model.model.norm = nn.Module()
        model.lm_head = nn.Module()  # type: ignore[assignment]  # a stub: this stage computes no logits
    assert all(isinstance(model.model.layers[i], nn.Module) for i in stage.layers)
    assert not stage.last or isinstance(model.lm_head, BoundModule)


def stage_forward(model: LlamaForCausalLM, stage: Stage, input_ids: torch.Tensor, positions: torch.Tensor,
                  attn: AttentionMetadata, kv: KVCache, hidden: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This stage's layers (``LlamaForCausalLM.forward`` cut at the stage's bounds): the first stage embeds, the
    last applies the final norm; returns (hidden, residual)."""
    x = model.model.embed_tokens(input_ids) if stage.first else hidden
    assert x is not None
    for i in stage.layers:
        x, residual = model.model.layers[i](positions, x, residual, model.cos_sin, attn, kv)
    if stage.last:
        x, _ = model.model.norm(x, residual)
    return x, residual


def split_step(step: Step, parts: int) -> list[tuple[Step, torch.Tensor]]:
    """Up to ``parts`` micro-batches of whole sequences, each with the indices into ``step.token_rows`` of its
    sampled rows (so rank 0 can put their logits back in the step's order)."""
    S = step.seq_lens.shape[0]
    parts = max(1, min(parts, S))
    qsl = step.query_start_loc.to(torch.int64)
    out = []
    for k in range(parts):
        a, b = k * S // parts, (k + 1) * S // parts
        lo, hi = int(qsl[a]), int(qsl[b])
        mine = ((step.token_rows >= lo) & (step.token_rows < hi)).nonzero().flatten()
        tokens = {f: getattr(step, f)[lo:hi] for f in _TENSOR_FIELDS}
        out.append((Step(**tokens, block_tables=step.block_tables[a:b],
                         seq_lens=step.seq_lens[a:b], query_start_loc=(qsl[a:b + 1] - lo).to(torch.int32),
                         max_query_len=int((qsl[a + 1:b + 1] - qsl[a:b]).max()),
                         token_rows=step.token_rows[mine] - lo,
                         lora_slots=step.lora_slots[a:b] if step.lora_slots.numel() else step.lora_slots), mine))
    return out


# -- the transfers (the default process group) --------------------------------------------------------------------
def isend(x: torch.Tensor, dst: int) -> Any:
    return dist.isend(x.contiguous().view(torch.uint8).flatten(), dst)


def irecv(shape: tuple[int, ...], dtype: torch.dtype, src: int, device: torch.device) -> tuple[torch.Tensor, Any]:
    """A posted receive: the tensor it fills and its work handle."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return out, dist.irecv(out.view(torch.uint8).flatten(), src)
