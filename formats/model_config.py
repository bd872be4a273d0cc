"""Model configuration read from a Hugging Face directory's config.json.

Families (``FAMILIES``: architecture -> the model code that serves it):
  llama   Llama, Mistral, Qwen2, Qwen3 (per-head q/k RMSNorm), Phi-3 (fused qkv / gate_up in the checkpoint)
  gemma   Gemma 2 and Gemma 3 text: (1 + w) RMSNorm, sandwich norms, GeGLU, scaled embeddings, soft-capping
  moe     Mixtral and Qwen3-MoE: top-k routed experts (renormalised or not)

Rules: every field the model code reads is explicit here (no reading config.json elsewhere); anything keepwarm
cannot run exactly is refused with a :class:`ModelConfigError` naming the field, never approximated. Sliding
windows are per layer (``layer_windows``); a window of ``w`` means a query at position p sees keys p-w+1..p, as in
transformers' masks.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from keepwarm.formats.gguf import gguf_config_json

FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama", "Phi3ForCausalLM": "llama",
    "Gemma2ForCausalLM": "gemma", "Gemma3ForCausalLM": "gemma",
    "MixtralForCausalLM": "moe", "Qwen3MoeForCausalLM": "moe",
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# hidden_act -> what the model code applies to the gate (transformers' ACT2FN names).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

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
    rope_type: str = "default"  # default | linear | llama3 | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    # longrope (Phi-3): per-dimension divisors of the frequencies, and the cos/sin scaling (None: from the lengths)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None


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
    hidden_act: str = "silu"
    # Per layer: the sliding window (None = full attention). Empty means no layer has one.
    layer_windows: tuple[int | None, ...] = ()
    # Rope of the sliding-window layers where it differs from ``rope`` (Gemma 3's local base frequency).
    rope_local: RopeConfig | None = None
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k before rotary
    # Gemma
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (else head_dim ** -0.5)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Mixture of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to one
    moe_layers: tuple[bool, ...] = ()  # per layer: routed experts (True) or a dense MLP

    @property
    def family(self) -> str:
        return FAMILIES[self.architecture]

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def is_moe_layer(self) -> tuple[bool, ...]:
        return self.moe_layers or (False,) * self.num_hidden_layers

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
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h
        experts = self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
        mlps = sum(experts if moe else 3 * h * i for moe in self.is_moe_layer)
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * attn + mlps + h + head


_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def _rope_config(cfg: dict, layer_type: str | None = None) -> RopeConfig:
    """transformers 5 keeps theta and scaling under ``rope_parameters`` (per layer type for Gemma 3); 4.x used
    ``rope_theta`` + ``rope_scaling`` (and ``rope_local_base_freq`` for Gemma 3's sliding layers)."""
    params = dict(cfg.get("rope_parameters") or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif any(isinstance(v, dict) for v in params.values()):
        params = dict(params.get("full_attention") or {})
    scaling = dict(cfg.get("rope_scaling") or {}) if layer_type != "sliding_attention" else {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if layer_type == "sliding_attention" and "rope_theta" not in params:
        theta = float(cfg.get("rope_local_base_freq", theta))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type == "su":  # Phi-3's earlier name for longrope
        rope_type = "longrope"
    if rope_type not in _ROPE_TYPES:
        raise ModelConfigError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(_ROPE_TYPES)})")
    orig = merged.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    attention_factor = merged.get("attention_factor")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor") or 1.0),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig or cfg.get("max_position_embeddings", 8192)),
        partial_rotary_factor=float(merged.get("partial_rotary_factor") or cfg.get("partial_rotary_factor")
                                    or 1.0),
        short_factor=tuple(float(f) for f in merged.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in merged.get("long_factor") or ()),
        attention_factor=float(attention_factor) if attention_factor is not None else None,
    )


def _layer_windows(cfg: dict, arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, from ``layer_types`` where the config has them (transformers 5), else from
    each family's older rule (Mistral: every layer; Qwen2/3: layers from ``max_window_layers`` on when
    ``use_sliding_window``; Gemma 2: even layers; Gemma 3: all but every ``sliding_window_pattern``-th)."""
    window = cfg.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and \
            not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return ()
    types = cfg.get("layer_types")
    if types is None:
        if arch == "Gemma2ForCausalLM":
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        elif arch == "Gemma3ForCausalLM":
            pattern = int(cfg.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        elif arch.startswith("Qwen"):
            first = int(cfg.get("max_window_layers", num_layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        else:
            types = ["sliding_attention"] * num_layers
    if len(types) != num_layers:
        raise ModelConfigError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted({t for t in types} - {"sliding_attention", "full_attention"})
    if unknown:
        raise ModelConfigError(f"unsupported layer_types {unknown} (supported: sliding_attention, full_attention)")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def _moe_fields(cfg: dict, arch: str, num_layers: int) -> dict:
    if arch == "MixtralForCausalLM":
        return dict(num_experts=int(cfg["num_local_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                    moe_layers=(True,) * num_layers)
    if arch == "Qwen3MoeForCausalLM":
        n = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step = int(cfg.get("decoder_sparse_step", 1))
        dense = set(cfg.get("mlp_only_layers") or [])
        layers = tuple(n > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        return dict(num_experts=n, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=layers)
    return {}


def _gemma_fields(cfg: dict, arch: str) -> dict:
    if not arch.startswith("Gemma"):
        return {}
    local = _rope_config(cfg, "sliding_attention") if arch == "Gemma3ForCausalLM" else None
    return dict(query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
                attn_logit_softcap=cfg.get("attn_logit_softcapping"),
                final_logit_softcap=cfg.get("final_logit_softcapping"),
                rope_local=local, qk_norm=arch == "Gemma3ForCausalLM")


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
    if model_dir.suffix == ".gguf" and model_dir.is_file():  # a llama.cpp file: its config is in its metadata
        return parse_model_config(gguf_config_json(model_dir), None, source=str(model_dir))
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
    is_gemma = arch.startswith("Gemma")
    act = (cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh") if is_gemma \
        else cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ModelConfigError(f"unsupported hidden_act {act!r} in {path} (supported: {', '.join(ACTIVATIONS)})")
    if cfg.get("use_bidirectional_attention"):
        raise ModelConfigError(f"unsupported use_bidirectional_attention in {path} (keepwarm serves causal models)")
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        windows = _layer_windows(cfg, arch, layers)
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        attention_bias = bool(cfg.get("attention_bias", False))
        default_tie = is_gemma
        extra = {**_gemma_fields(cfg, arch), **_moe_fields(cfg, arch, layers)}
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            extra["qk_norm"] = True
        return ModelConfig(
            architecture=arch,
            model_type=str(cfg.get("model_type", "")),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", default_tie)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope=_rope_config(cfg, "full_attention" if arch == "Gemma3ForCausalLM" else None),
            sliding_window=max((w for w in windows if w is not None), default=None),
            dtype=parse_dtype(dtype_name),
            eos_token_ids=_eos_ids(cfg, gen if isinstance(gen, dict) else None),
            bos_token_id=cfg.get("bos_token_id"),
            hidden_act=act,
            layer_windows=windows,
            **extra,
        )
    except KeyError as e:
        raise ModelConfigError(f"{path} lacks required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelConfigError):
            raise
        raise ModelConfigError(f"{path} has an invalid value: {e}") from None


def rope_inv_freq(config: ModelConfig, rope: RopeConfig | None = None, long: bool = False,
                  ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, computed the way transformers does for each rope type
    (``rope`` defaults to the model's; ``long`` picks longrope's long factors)."""
    rope = rope or config.rope
    dim = config.rotary_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if rope.rope_type == "longrope":
        return _longrope(config, rope, dim, long)
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


def _longrope(config: ModelConfig, rope: RopeConfig, dim: int, long: bool) -> tuple[torch.Tensor, float]:
    factors = rope.long_factor if long else rope.short_factor
    if len(factors) != dim // 2:
        raise ModelConfigError(f"longrope {'long' if long else 'short'}_factor has {len(factors)} entries, "
                               f"rotary dim {dim} needs {dim // 2}")
    orig = rope.original_max_position_embeddings
    factor = rope.factor if rope.factor != 1.0 else config.max_position_embeddings / orig
    scaling = rope.attention_factor
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta ** shape), scaling
