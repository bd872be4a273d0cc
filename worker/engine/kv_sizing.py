"""How many KV blocks the engine's pool holds, and of which dtype.

Rules (vLLM's flags, in this order): ``num_gpu_blocks`` if given; else ``kv_cache_memory_bytes`` worth of blocks;
else on CUDA ``gpu_memory_utilization`` of the device's memory less what is in use already; else (CPU) enough for
``max_num_seqs`` sequences of ``max_model_len`` tokens, at most ``DEFAULT_CPU_KV_CACHE_BYTES``. A pool that cannot
hold one sequence of ``max_model_len`` tokens is refused with one line. The dtype is the model's, or fp8
(``kv_cache_dtype``). Under tensor parallelism a block holds one rank's KV heads (the caller passes that rank's
model config) and every rank allocates the same number of blocks (rank 0 sizes, ``CacheSpec`` tells the others).
"""

from __future__ import annotations

import torch

from keepwarm.formats.model_config import ModelConfig, ModelConfigError
from keepwarm.worker.engine.config import EngineConfig
from keepwarm.worker.model_runner import FP8_KV_DTYPE, kv_bytes_per_block

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if config.kv_cache_dtype == "auto" else FP8_KV_DTYPE


def num_kv_blocks(config: EngineConfig, kv_config: ModelConfig, kv_dtype: torch.dtype, device: torch.device,
                  max_model_len: int) -> int:
    """The pool's block count; ``kv_config``: the model config of this rank's KV heads."""
    c = config
    per_block = kv_bytes_per_block(kv_config, c.block_size, kv_dtype)
    if c.num_gpu_blocks is not None:
        n = c.num_gpu_blocks
    elif c.kv_cache_memory_bytes is not None:
        n = c.kv_cache_memory_bytes // per_block
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        n = int(total * c.gpu_memory_utilization - (total - free)) // per_block
    else:
        wanted = -(-c.max_num_seqs * max_model_len // c.block_size)
        n = min(wanted, DEFAULT_CPU_KV_CACHE_BYTES // per_block)
    needed = -(-max_model_len // c.block_size)
    if n < needed:
        raise ModelConfigError(
            f"the KV cache holds {n} blocks ({n * c.block_size} tokens) but max_model_len "
            f"{max_model_len} needs {needed}; lower max_model_len or give the KV cache more memory")
    return n
