"""The native decode step for the Llama family: a decode-only CPU step's layers in one C call (kernels/cpu_step.py).

Rules:
- `DecodeStep.of(model, kv)` decides once per model and KV cache whether the model's layers can run as one C call
  (the exact Llama layer: no biases, q/k norms, sliding windows, LoRA or tensor parallelism; silu; bf16 weights
  the C kernels read; bf16 KV pools); why not is logged once and the layers run op by op.
- A step runs natively only where it computes what the layers compute: the torch backend, every row a decode row
  of its own sequence in order (no prefill chunk, no padding), the attention plan's C rows made, at most
  `cpu_step.MAX_ROWS` rows. Other steps run the layers op by op (each reason logged once, at debug: prefill steps
  are routine).
- Bit for bit the op-by-op path where `NativeStep.exact` (the linears' kernels are the dispatch's own); within
  tests/unit/kernels/test_cpu_step.py's bound otherwise (int4 at 1-4 rows on AVX-512: ATen's op there).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from keepwarm.kernels import cpu_step, registry
from keepwarm.kernels.cpu import AttentionPlan
from keepwarm.worker.models.layers import RMSNorm

__all__ = ["DecodeStep"]

logger = logging.getLogger("keepwarm.worker.models")


class DecodeStep:
    """A model's `cpu_step.NativeStep` for one KV cache, and the checks each step makes before running it."""

    def __init__(self, native: cpu_step.NativeStep, kv: Any, model: Any) -> None:
        self.native, self.kv = native, kv
        self.modules, self.cos_sin = model.model.layers, model.cos_sin  # what the step replaces (tests compare)

    @classmethod
    def of(cls, model: Any, kv: Any, plain: tuple[Any, ...]) -> DecodeStep | None:
        """The step for `model` over `kv` (built once per model and cache), None (logged once) where none runs.
        `plain`: the model, layer, attention and MLP classes step.c computes (llama.py's own)."""
        held = getattr(model, "_native_step", None)
        if held is not None and held[0] is kv:
            return held[1]
        why = _model_refusal(model, kv, plain)
        got = cpu_step.make(_shape(model), _layers(model, kv)) if why is None else why
        if isinstance(got, cpu_step.NativeStep) and isinstance(one := got.plan(1), str):
            got = one  # a linear no C kernel runs (a packed bf16 weight: oneDNN's)
        step = cls(got, kv, model) if isinstance(got, cpu_step.NativeStep) else None
        if step is None:
            _log_once("the decode step runs op by op: %s", str(got))
        else:
            logger.info("the decode step runs as one C call per step (kernels/csrc/step.c, %d layers)",
                        len(model.model.layers))
        object.__setattr__(model, "_native_step", (kv, step))
        return step

    def run(self, x: torch.Tensor, attn: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's output, the residual) for x [T, H] (the embeddings), or None: run the layers."""
        why = _step_refusal(x, attn)
        if why is not None:
            _log_once("a step ran op by op: %s", why, level=logging.DEBUG)
            return None
        plan = attn.plan
        rot = attn.rotary["global"]
        slots = attn.slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.long().contiguous()
        out = self.native.run(x.contiguous(), rot.cos, rot.sin, slots, plan.decode[None])
        if out is None:
            _log_once("a step ran op by op: %s", f"{x.shape[0]} rows: {self.native.plan(x.shape[0])}",
                      level=logging.DEBUG)
        return out


@functools.cache
def _log_once(fmt: str, why: str, level: int = logging.INFO) -> None:
    logger.log(level, fmt, why)


def _model_refusal(model: Any, kv: Any, plain: tuple[Any, ...]) -> str | None:
    """Why the model's layers are not the exact Llama layer step.c computes (one line), None when they are."""
    causal_lm, decoder_layer, attention, mlp = plain
    c = model.config
    if type(model) is not causal_lm:
        return f"{type(model).__name__} is not the plain Llama layer"
    if c.hidden_act != "silu" or c.qk_norm or c.qkv_bias or c.o_bias or c.mlp_bias:
        return "the layer has biases, q/k norms or an activation other than silu"
    if c.rotary_dim != c.head_dim or "local" in model.cos_sin:
        return "rotary over part of a head, or a second rotary table"
    if any(s != 1.0 for s in (*kv.k_scales, *kv.v_scales)):
        return "an fp8 KV cache"
    for i, layer in enumerate(model.model.layers):
        if not (type(layer) is decoder_layer and type(layer.self_attn) is attention
                and type(layer.mlp) is mlp and type(layer.input_layernorm) is RMSNorm
                and type(layer.post_attention_layernorm) is RMSNorm):
            return f"layer {i} is not the plain Llama layer"
        if layer.self_attn.window is not None:
            return f"layer {i} has a sliding window"
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if any(lin.lora is not None or lin.reduce is not None for lin in linears):
            return f"layer {i} has LoRA or tensor-parallel linears"
    if model.model.embed_tokens.weight.dtype != torch.bfloat16:
        return f"activations in {model.model.embed_tokens.weight.dtype}, not bfloat16"
    return None


def _shape(model: Any) -> cpu_step.StepShape:
    c = model.config
    a = model.model.layers[0].self_attn
    return cpu_step.StepShape(c.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, c.intermediate_size,
                              c.rms_norm_eps, a.scale, a.softcap)


def _layers(model: Any, kv: Any) -> list[cpu_step.StepLayer]:
    return [cpu_step.StepLayer(ly.input_layernorm.weight, ly.post_attention_layernorm.weight,
                               ly.self_attn.qkv_proj.weight, ly.self_attn.o_proj.weight, ly.mlp.gate_up_proj.weight,
                               ly.mlp.down_proj.weight, kv.key[i], kv.value[i])
            for i, ly in enumerate(model.model.layers)]


def _step_refusal(x: torch.Tensor, attn: Any) -> str | None:
    """Why this step's rows are not a decode-only batch the C step takes (one line), None when they are."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return f"activations {x.dtype} on {x.device.type}"
    if registry.select_backend("paged_attention", x.device) != "torch":
        return "the kernels' backend is not torch"
    plan = attn.plan
    if not isinstance(plan, AttentionPlan) or plan.decode is None or None not in plan.decode:
        return "no C attention rows in the step's plan (the C kernels switched off?)"
    ref = plan.ref
    if plan.prefill is not None or not ref.decode_only or len(ref.decodes) != x.shape[0]:
        return "prefill rows or padding in the step"
    if not attn.rotary or "global" not in attn.rotary:
        return "no rotary plan"
    return None
