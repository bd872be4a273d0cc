"""Mixture-of-experts decoders (Mixtral, Qwen3-MoE): the Llama layer with routed experts in place of the MLP.

Routing follows transformers: router logits ``x @ gate^T``, softmax in float32 over all experts, the top-k
experts per token, their weights renormalised to sum to one when ``norm_topk_prob`` (always for Mixtral), and
rounded back to the activation dtype. Each expert is a plain gate/up + down MLP whose fused weights are ordinary
:class:`Linear` slots (``mlp.experts.E.gate_up_proj`` / ``down_proj``), so the daemon's arena, quantization
(int8 / int4 / fp8) and the CPU's oneDNN packing apply to experts exactly as to dense layers.

The experts run through ``kernels.fused_moe`` (one dispatch per layer): on the CPU tokens grouped by expert, one
matmul pair per expert, summed in transformers' order (float32 sums bit-identical); on CUDA two grouped-GEMM
launches over the arena's expert weights in place (docs/kernels.md, "Fused MoE"). Qwen3-MoE layers listed in
``mlp_only_layers`` (or off the ``decoder_sparse_step``) keep a dense MLP. Shared experts (Qwen2-MoE) are part of
neither family and are not implemented.
"""

from __future__ import annotations

import torch
from torch import nn

from keepwarm import kernels
from keepwarm.formats.model_config import ModelConfig, ModelConfigError
from keepwarm.worker.models.layers import Linear
from keepwarm.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class MoEBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.mlp_bias:  # neither family has expert biases; the fused kernels take none
            raise ModelConfigError("mlp_bias = true is not supported for mixture-of-experts layers")
        self.act = config.hidden_act
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.renormalize = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        mlps = tuple(LlamaMLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.experts = nn.ModuleList(mlps)
        self._mlps = mlps  # the same modules, typed (ModuleList indexing is not)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def weights(self) -> kernels.MoEWeights:
        """The experts' bound weights for ``kernels.fused_moe``, built once after binding (a backend caches what
        it derives from them there); rebuilt if the first expert was rebound since."""
        cached: kernels.MoEWeights | None = getattr(self, "_weights", None)
        first = self._mlps[0]
        if cached is None or cached.gate_up[0] is not first.gate_up_proj.weight \
                or cached.down[0] is not first.down_proj.weight:
            cached = kernels.MoEWeights(tuple(e.gate_up_proj.weight for e in self._mlps),
                                        tuple(e.down_proj.weight for e in self._mlps))
            self._weights = cached
        return cached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        return kernels.fused_moe(x, weights, ids, self.weights(), self.act)


class MoEDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return MoEBlock(config) if config.is_moe_layer[layer_idx] else LlamaMLP(config)


class MoEForCausalLM(LlamaForCausalLM):
    """Serves MixtralForCausalLM and Qwen3MoeForCausalLM checkpoints."""

    layer_cls = MoEDecoderLayer
