"""Gemma 2 and Gemma 3 (text): the Llama classes with Gemma's norms, MLP activation and residual wiring.

What differs from Llama, each matching transformers' op order so float32 results are bit-identical:
  - RMSNorm scales by ``1 + w`` and multiplies in float32 before casting back (Llama casts first);
  - every layer has four norms: input, post-attention, pre-feedforward and post-feedforward (the attention and
    MLP outputs are normed before they join the residual);
  - the MLP gate uses GeLU (tanh approximation), from ``hidden_act``;
  - embeddings are scaled by sqrt(hidden_size), rounded to the model's dtype first;
  - attention scale ``query_pre_attn_scalar ** -0.5``, soft-capped scores (Gemma 2), per-layer sliding windows,
    Gemma 3's per-head q/k norms and its local rope base for sliding layers (all in ``LlamaAttention``);
  - the final logits are soft-capped (Gemma 2: ``final_logit_softcapping``).
"""

from __future__ import annotations

import torch
from torch import nn

from keepwarm.formats.model_config import ModelConfig
from keepwarm.worker.models.layers import BoundModule
from keepwarm.worker.models.llama import (
    AttentionMetadata,
    KVCache,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
)


class GemmaRMSNorm(BoundModule):
    weight: torch.Tensor

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self._slot("weight", (hidden_size,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = LlamaAttention(config, layer_idx, norm_cls=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: None,
                cos_sin: dict[str, torch.Tensor], attn: AttentionMetadata, kv: KVCache) -> tuple[torch.Tensor, None]:
        h = self.self_attn(positions, self.input_layernorm(x), cos_sin, attn, kv)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h), None


class GemmaForCausalLM(LlamaForCausalLM):
    """Serves Gemma2ForCausalLM and Gemma3ForCausalLM checkpoints (text only)."""

    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        for layer in self.model.layers:
            x, _ = layer(positions, x, None, self.cos_sin, attn, kv)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
