"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3): fused qkv / gate_up projections, paged attention.

The model knows nothing of the scheduler: each forward gets a flat batch of tokens, their positions and an
:class:`AttentionMetadata` saying where each token's K/V goes and which cached blocks each sequence reads.

The other families build on these classes rather than on flags here: ``gemma.py`` swaps the norms, the MLP and
the layer's residual wiring, ``moe.py`` swaps the MLP for routed experts. What every family shares lives here:
attention (with the layer's sliding window, optional per-head q/k norms, soft-capping), the rotary tables (one per
rope: a sliding layer may use its own base), weight binding, and the head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from keepwarm import kernels
from keepwarm.formats.model_config import ModelConfig, RopeConfig, rope_inv_freq
from keepwarm.worker.models.layers import (
    BoundModule,
    Embedding,
    Linear,
    RMSNorm,
    VocabParallelEmbedding,
    WeightBindError,
)
from keepwarm.worker.models.native_step import DecodeStep


@dataclass
class AttentionMetadata:
    """One step's flattened varlen batch (see ``kernels.paged_attention`` for the exact semantics)."""

    slot_mapping: torch.Tensor  # [T] int64, KV-cache slot of each token
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32, context length including this step's tokens
    query_start_loc: torch.Tensor  # [S+1] int32
    max_query_len: int
    # The above precomputed once per step for every layer's KV write and attention (kernels.plan_attention);
    # None where the kernels read the metadata themselves (Triton) or no plan was made.
    plan: Any = None
    # Per rotary table (the keys of LlamaForCausalLM.cos_sin): its rows at this step's positions, gathered once
    # for every layer (kernels.plan_rotary); None where no plan was made.
    rotary: dict[str, Any] | None = None


@dataclass
class KVCache:
    """Per-layer paged K/V pools ``[num_kv_heads, num_blocks, block_size, head_dim]`` with fp8 scales."""

    key: list[torch.Tensor]
    value: list[torch.Tensor]
    k_scales: list[float]
    v_scales: list[float]


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' ACT2FN entries the families use (config.ACTIVATIONS), shared with kernels.fused_moe."""
    return kernels.activation(name)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, norm_cls: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.window = config.window_of(layer_idx)
        self.softcap = config.attn_logit_softcap
        # Which rotary table this layer reads: Gemma 3's sliding layers have their own base frequency.
        self.rope = "local" if self.window is not None and config.rope_local is not None else "global"
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = norm_cls(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm_cls(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin: dict[str, torch.Tensor],
                attn: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:  # per head, before rotary (Qwen3, Gemma 3)
            q = self.q_norm(q.reshape(-1, self.head_dim)).reshape(T, self.q_size)
            k = self.k_norm(k.reshape(-1, self.head_dim)).reshape(T, self.kv_size)
        q, k = kernels.rotary_embedding(positions, q, k, self.head_dim, cos_sin[self.rope],
                                        plan=attn.rotary.get(self.rope) if attn.rotary else None)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        i = self.layer_idx
        kernels.write_kv_cache(k, v, kv.key[i], kv.value[i], attn.slot_mapping, kv.k_scales[i], kv.v_scales[i],
                               plan=attn.plan)
        o = kernels.paged_attention(q, kv.key[i], kv.value[i], attn.block_tables, attn.seq_lens,
                                    attn.query_start_loc, self.scale, kv.k_scales[i], kv.v_scales[i],
                                    max_query_len=attn.max_query_len, sliding_window=self.window,
                                    logit_softcap=self.softcap, plan=attn.plan)
        return self.o_proj(o.reshape(T, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        i = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * i, bias=config.mlp_bias)
        self.down_proj = Linear(i, config.hidden_size, bias=config.mlp_bias)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate).mul_(up))  # in place: the activation's output is a new tensor


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.make_mlp(config, layer_idx)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: dict[str, torch.Tensor], attn: AttentionMetadata, kv: KVCache,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, cos_sin, attn, kv)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layer_cls: type[nn.Module], norm_cls: type[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm_cls(config.hidden_size, config.rms_norm_eps)


def rope_tables(config: ModelConfig, max_position: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """The cos/sin tables the layers read: "global" (the model's rope) and, where sliding layers have their own
    rope, "local". longrope (Phi-3) stacks the short-factor table over ``[0, max_position)`` and the long-factor
    one over ``[max_position, 2 * max_position)``: the runner offsets a long-context sequence's positions."""
    def table(rope: RopeConfig | None, long: bool = False) -> torch.Tensor:
        inv_freq, scaling = rope_inv_freq(config, rope, long)
        return kernels.build_cos_sin_cache(config.rotary_dim, max_position, inv_freq, scaling)

    tables = {"global": table(None)}
    if config.rope.rope_type == "longrope":
        tables["global"] = torch.cat([tables["global"], table(None, long=True)])
    if config.rope_local is not None:
        tables["local"] = table(config.rope_local)
    return {k: v.to(device) for k, v in tables.items()}


class LlamaForCausalLM(nn.Module):
    """Serves the Llama family's checkpoints (``config.FAMILIES``); the base class of the other families."""

    layer_cls: type[nn.Module] = LlamaDecoderLayer
    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, max_position: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.layer_cls, self.norm_cls)
        self.lm_head = Embedding(config.vocab_size, config.hidden_size)  # [V, D], used as a projection
        self.max_position = max_position
        self.cos_sin = rope_tables(config, max_position, device)

    def make_tensor_parallel(self, vocab_start: int, vocab_rows: int,
                             reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """One tensor-parallel rank (before ``load_weights``): built from the rank's local config (its heads and
        MLP width), o_proj and down_proj become row-parallel, the embedding and head hold the rank's vocabulary
        rows (``compute_logits`` then gives this rank's logit columns)."""
        for layer in self.model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            assert isinstance(layer.self_attn, LlamaAttention) and isinstance(layer.mlp, LlamaMLP)
            layer.self_attn.o_proj.reduce = reduce
            layer.mlp.down_proj.reduce = reduce
        hidden = self.config.hidden_size
        self.model.embed_tokens = VocabParallelEmbedding(vocab_rows, hidden, vocab_start, reduce)
        self.lm_head = Embedding(vocab_rows, hidden)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Attach every weight (no copy); all slots must be filled. ``lm_head.weight`` is used when given, even
        for tied embeddings (the daemon may store a packed copy of the embedding for the projection); otherwise
        the head shares ``embed_tokens``."""
        for name, tensor in tensors.items():
            module_name, _, attr = name.rpartition(".")
            try:
                module = self.get_submodule(module_name)
            except AttributeError:
                raise WeightBindError(f"model has no module for weight {name!r}") from None
            if not isinstance(module, BoundModule):
                raise WeightBindError(f"model has no weight slot {name!r}")
            module.bind(attr, tensor)
        if "lm_head.weight" not in tensors and isinstance(self.lm_head, BoundModule):  # not a pipeline stage's stub
            object.__setattr__(self.lm_head, "weight", self.model.embed_tokens.weight)
        missing = [f"{m}.{a}" if m else a for m, mod in self.named_modules() if isinstance(mod, BoundModule)
                   for a, t in vars(mod).items() if isinstance(t, torch.Tensor) and t.is_meta]
        if missing:
            raise WeightBindError(f"checkpoint lacks weights: {', '.join(missing[:5])}"
                                  + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        step = DecodeStep.of(self, kv, _PLAIN) if x.device.type == "cpu" else None
        done = None if step is None else step.run(x, attn)
        if done is not None:  # every layer in one C call: a decode-only CPU step (native_step.py)
            x, residual = done
        else:
            residual = None
            for layer in self.model.layers:
                x, residual = layer(positions, x, residual, self.cos_sin, attn, kv)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # In the model's dtype, then float32 for sampling: the same rounding as transformers' generate. Through
        # kernels.linear so a packed head (PackedWeight) takes its fast path.
        return kernels.linear(hidden, self.lm_head.weight).float()


# The classes worker/models/native_step.py's C step computes exactly (a subclass changes the layer).
_PLAIN = (LlamaForCausalLM, LlamaDecoderLayer, LlamaAttention, LlamaMLP)
