"""Model configuration read from a Hugging Face directory's config.json (Llama, Mistral, Qwen2 families)."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


class ModelConfigError(ValueError):
    """A model directory that keepwarm cannot serve; the message is one line naming what is wrong."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).removeprefix("torch.")]
    except KeyError:
        raise ModelConfigError(f"unknown dtype {name!r}; choose one of float32, bfloat16, float16") from None


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs; built by :func:`load_model_config`."""

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    sliding_window: int | None
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    def num_parameters(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + L * per_layer + h + head


def _rope_config(cfg: dict) -> RopeConfig:
    # transformers 5 keeps theta and scaling under `rope_parameters`; 4.x used `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ModelConfigError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get(
            "original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))),
        partial_rotary_factor=float(merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
    )


def _eos_ids(cfg: dict, generation_config: dict | None) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if generation_config and generation_config.get("eos_token_id") is not None:
        eos = generation_config["eos_token_id"]
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate ``config.json``; raises :class:`ModelConfigError` with a one-line reason."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise ModelConfigError(f"model directory {str(model_dir)!r} does not exist")
    if not model_dir.is_dir():
        raise ModelConfigError(f"{str(model_dir)!r} is not a directory")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{str(model_dir)!r} is not a model directory: config.json is missing")
    gen_path = model_dir / "generation_config.json"
    gen_text = gen_path.read_text() if gen_path.is_file() else None
    return parse_model_config(path.read_text(), gen_text, source=str(path))


def parse_model_config(config_json: str, generation_config_json: str | None = None,
                       source: str = "config.json") -> ModelConfig:
    """Validate a config.json's text (as read from a model directory or carried in an arena manifest)."""
    path = source
    try:
        cfg = json.loads(config_json)
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{path} must hold a JSON object")
    gen = None
    if generation_config_json:
        with contextlib.suppress(json.JSONDecodeError):
            gen = json.loads(generation_config_json)
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"unsupported architecture {arch!r} in {path} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"unsupported hidden_act {act!r} in {path} (supported: silu)")
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        sliding = cfg.get("sliding_window")
        if is_qwen2 and not cfg.get("use_sliding_window", False):
            sliding = None
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return ModelConfig(
            architecture=arch,
            model_type=str(cfg.get("model_type", "")),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else bool(cfg.get("attention_bias", False)),
            o_bias=False if is_qwen2 else bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope=_rope_config(cfg),
            sliding_window=int(sliding) if sliding else None,
            dtype=parse_dtype(dtype_name),
            eos_token_ids=_eos_ids(cfg, gen if isinstance(gen, dict) else None),
            bos_token_id=cfg.get("bos_token_id"),
        )
    except KeyError as e:
        raise ModelConfigError(f"{path} lacks required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelConfigError):
            raise
        raise ModelConfigError(f"{path} has an invalid value: {e}") from None


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, computed the way transformers does for each rope type."""
    rope = config.rope
    dim = config.rotary_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / rope.factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, inv_freq_llama)
    return inv_freq, 1.0
