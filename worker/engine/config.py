"""The engine's settings (``EngineConfig``: vLLM's names and meanings) and what is resolved from them before the
engine's parts are built: the device, the context length, the settings checked before anything loads, and what
every parallel rank loads.

Rule: a setting that needs no model is refused here with one line (``ModelConfigError``), before any weight is
read; what the engine actually runs with is read back from its live parts (``LLMEngine.effective_config``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from keepwarm.formats.model_config import ModelConfig, ModelConfigError
from keepwarm.weights.sharding import TensorParallelError
from keepwarm.worker.parallel.launch import Nodes
from keepwarm.worker.parallel.messages import Setup

BLOCK_SIZES = (8, 16, 32, 64, 128)


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

    @property
    def parallel(self) -> bool:
        """Ranks in other processes (tensor or pipeline parallel, or several nodes)."""
        return self.tensor_parallel_size != 1 or self.pipeline_parallel_size != 1 or self.nnodes != 1

    def nodes(self) -> Nodes:
        if self.nnodes == 1 and self.node_rank == 0:
            return Nodes()
        try:
            port = self.master_port if self.master_port is not None else int(os.environ.get("MASTER_PORT", 0))
        except ValueError:
            raise TensorParallelError(f"MASTER_PORT={os.environ['MASTER_PORT']!r} is not a port number") from None
        return Nodes(self.nnodes, self.node_rank, self.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1"),
                     port)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    limit = mc.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ModelConfigError(f"max_model_len {config.max_model_len} exceeds the model's limit of {limit} "
                               "(max_position_embeddings)")
    if config.max_model_len < 2:
        raise ModelConfigError("max_model_len must be at least 2")
    return config.max_model_len


def long_rope_after(mc: ModelConfig) -> int | None:
    """longrope: sequences longer than this use the long factors (None: the model has no longrope)."""
    return mc.rope.original_max_position_embeddings if mc.rope.rope_type == "longrope" else None


def check_cache_settings(config: EngineConfig) -> None:
    if config.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
        raise ModelConfigError(f"unknown kv_cache_dtype {config.kv_cache_dtype!r} (choose auto or fp8)")
    if config.block_size not in BLOCK_SIZES:
        raise ModelConfigError(f"block_size must be one of 8, 16, 32, 64, 128; got {config.block_size}")


def rank_setup(config: EngineConfig, model_dir: Path, device: torch.device, max_model_len: int,
               dtype: torch.dtype) -> Setup:
    """What every parallel rank loads: this engine's settings, resolved (``parallel/launch.py`` settles the
    ``daemon`` and ``threads`` fields)."""
    return Setup(str(model_dir), config.dtype, config.quantization, device.type, max_model_len, config.daemon,
                 config.runtime_dir, config.fingerprint, 1, config.seed,
                 config.max_loras if config.enable_lora else 0, config.max_lora_rank,
                 str(dtype).removeprefix("torch."), config.pipeline_parallel_size)
