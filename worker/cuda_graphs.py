"""CUDA graphs for decode steps: capture the model forward once per batch size, then replay it.

A small batch's decode step is dominated by kernel launches (~10 per layer), not by the GPU work; a graph replays
them with one launch. Rules (the buffers and padding in full: docs/gpu.md, "CUDA graphs"):
- Only decode-only batches (``max_query_len == 1``) are captured: their shapes depend on the batch size alone, so one
  graph per size serves every step. Batches with a prefill chunk, with LoRA adapters active (their slot index
  tensor is not a static buffer) or larger than the largest size run eagerly.
- Inputs live in static buffers sized for the largest graph; block tables are as wide as the longest context the
  model allows, so a graph never needs re-capturing as sequences grow. Padding rows write nothing to the KV cache
  (slot -1), read only valid blocks, and their output is dropped.
- Graphs are captured lazily, the first time a batch of a new padded size arrives, into one shared memory pool.
- Captured kernels must not sync with the host: graphs are used only where attention and the KV write dispatch to
  Triton (the torch references sync). A capture that fails anyway disables graphs for the runner, logged.
"""

from __future__ import annotations

import logging

import torch

from keepwarm import kernels
from keepwarm.worker.models.llama import AttentionMetadata, KVCache, LlamaForCausalLM

log = logging.getLogger("keepwarm.worker")

# Powers of two up to vLLM's default max_num_seqs: a batch pads to the next size, wasting < 2x on the (cheap,
# launch-bound) padded rows. Larger batches are compute-heavier and lose little by running eagerly.
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Kernels that must run host-sync free inside a graph; the torch reference versions of these are not.
_GRAPH_SAFE_KERNELS = ("paged_attention", "write_kv_cache", "fused_moe")


def graphs_supported(device: torch.device) -> str | None:
    """None when decode graphs can be captured on `device`; else the reason they cannot."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    for name in _GRAPH_SAFE_KERNELS:
        backend = kernels.select_backend(name, device)
        if backend != "triton":
            return f"kernel {name} runs on the {backend} backend, which syncs with the host"
    return None


class CudaGraphRunner:
    """Captured decode forwards of one model and KV cache, one per padded batch size."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, device: torch.device,
                 batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, max_position: int | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        max_position = max_position or model.max_position
        self.max_blocks = -(-max_position // block_size)
        n = self.batch_sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.disabled: str | None = None
        self.replays = 0

    def padded_size(self, n: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= n), None)

    def can_run(self, attn: AttentionMetadata, num_tokens: int) -> bool:
        """True for a decode-only batch that fits a graph size and the static block tables."""
        return (self.disabled is None and attn.max_query_len == 1 and num_tokens == attn.seq_lens.shape[0]
                and self.padded_size(num_tokens) is not None and attn.block_tables.shape[1] <= self.max_blocks)

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
                                 seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
                                 max_query_len=1)

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self._metadata(size), self.kv_cache)

    def capture(self, size: int) -> None:
        """Record the forward of `size` padding rows (which write nothing): warm up first, so Triton compiles
        and cuBLAS picks its kernels outside the capture."""
        self.slot_mapping[:size].fill_(-1)
        self.seq_lens[:size].fill_(1)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(size)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[size] = (graph, out)
        log.info("captured a CUDA graph for decode batches of %d", size)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor | None:
        """The hidden states of a decode batch (``can_run`` must hold), or None if capturing its graph failed
        (graphs are then disabled and the caller runs the batch eagerly)."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        assert size is not None
        if size not in self.graphs:
            try:
                self.capture(size)
            except Exception as e:  # e.g. an op that syncs with the host: stay correct, run eagerly from now on
                self.disabled = f"capture of batch size {size} failed: {type(e).__name__}: {e}"
                log.warning("CUDA graphs disabled: %s", self.disabled)
                return None
        graph, out = self.graphs[size]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(attn.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.block_tables[:n, :attn.block_tables.shape[1]].copy_(attn.block_tables)
        self.seq_lens[:n].copy_(attn.seq_lens)
        self.seq_lens[n:size].fill_(1)
        graph.replay()
        self.replays += 1
        return out[:n]  # a view of the graph's output: valid until the next replay of this size
