"""keepwarm.kernels: one dispatch point per kernel; model code calls these and nothing below them, but for the native
decode step (kernels/cpu_step.py, whole layers in one C call), which worker/models/native_step.py drives.

What it owns: the public kernel functions (each looks its implementation up in kernels/registry.py by name and device)
and the wiring of the backends into that registry. It may import formats only; nothing in kernels/ imports it.
- torch backend: kernels/cpu.py (dense ops), quant.py (``linear_<scheme>``), cpu_packed.py (oneDNN-packed weights),
  reference.py (LoRA, MoE); on the CPU they run the kernel kernels/dispatch.py's table picks (`describe`).
- triton backend: kernels/triton_*.py, imported only where it can run (see `_register_triton`).

KV cache layout (every backend): one pool per layer and side, ``[num_kv_heads, num_blocks, block_size, head_dim]``.
Head-major, so gathering a batch's blocks yields ``[Hk, S, L, D]``, which the attention matmuls use with no further
copy. Per-step plans: `plan_attention` / `plan_rotary` turn one step's metadata into what the torch kernels read,
once for all layers; derived from the metadata alone, so a kernel computes exactly the same with or without one.
Backends that read the metadata on the device get no plan (None).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from . import cpu, cpu_packed, quant, reference, registry
from .dispatch import describe
from .quant import QuantizedWeight
from .reference import MoEWeights, activation, build_cos_sin_cache
from .registry import (
    BACKENDS,
    ENV_VAR,
    KernelBackendError,
    get_impl,
    register,
    select_backend,
    set_backend,
)

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "KernelBackendError",
    "MoEWeights",
    "QuantizedWeight",
    "activation",
    "build_cos_sin_cache",
    "describe",
    "fused_add_rms_norm",
    "fused_moe",
    "get_impl",
    "linear",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "plan_attention",
    "plan_rotary",
    "register",
    "rms_norm",
    "rotary_embedding",
    "select_backend",
    "set_backend",
    "write_kv_cache",
]

logger = logging.getLogger("keepwarm.kernels")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: x [T, D], weight [D] -> [T, D]."""
    return get_impl("rms_norm", x.device)(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); inputs are not modified."""
    return get_impl("fused_add_rms_norm", x.device)(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_dim: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    plan: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates the first rot_dim dims of each head (rot_dim = cos_sin_cache.shape[1]); returns new q, k.
    ``plan``: the step's plan_rotary of ``cos_sin_cache`` at ``positions`` (None: gathered on each call)."""
    return get_impl("rotary_embedding", query.device)(positions, query, key, head_dim, cos_sin_cache, is_neox,
                                                      **_plan_kwargs(plan))


def plan_rotary(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> Any:
    """The rows of ``cos_sin_cache`` at ``positions``, gathered once per step for every layer's rotary_embedding
    (pass it as its ``plan``); None where rotary does not run on the torch backend (Triton reads the table)."""
    if select_backend("rotary_embedding", positions.device) != "torch":
        return None
    return reference.plan_rotary(positions, cos_sin_cache)


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   slot_mapping: torch.Tensor, block_size: int, windows: tuple[int | None, ...]) -> Any:
    """One step's attention metadata precomputed for every layer's write_kv_cache and paged_attention (pass it
    as their ``plan``), or None where those kernels do not run on the torch backend: the Triton kernels read the
    metadata on the device themselves. ``windows``: the sliding windows the model's layers use (None: full)."""
    device = block_tables.device
    if any(select_backend(k, device) != "torch" for k in ("write_kv_cache", "paged_attention")):
        return None
    return cpu.plan_attention(block_tables, seq_lens, query_start_loc, slot_mapping, block_size, windows)


def _plan_kwargs(plan: Any) -> dict[str, Any]:
    # Only the torch kernels take a plan (plan_attention / plan_rotary return None elsewhere), so other backends
    # never see it.
    return {} if plan is None else {"plan": plan}


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    plan: Any = None,
) -> None:
    """Stores key/value [T, Hk, D] at slot_mapping[T] (block * block_size + offset; -1 skips), in place."""
    get_impl("write_kv_cache", key.device)(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                                            **_plan_kwargs(plan))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    plan: Any = None,
) -> torch.Tensor:
    """Causal varlen attention over the paged cache; seq_lens include this step's (already written) tokens.
    ``sliding_window`` w: a row at position p sees keys p-w+1..p; ``logit_softcap`` c: scores c * tanh(s / c).
    ``plan``: the step's plan_attention (None: derived from the metadata on each call)."""
    return get_impl("paged_attention", query.device)(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale,
        max_query_len, sliding_window=sliding_window, logit_softcap=logit_softcap, **_plan_kwargs(plan),
    )


def lora_shrink(x: torch.Tensor, a_stacked: torch.Tensor, token_slots: torch.Tensor, rank: int,
                num_slots: int) -> torch.Tensor:
    """Per-token LoRA A: x [T, K] against stacked A [G * S * R, K] -> [T, G * S * R], zero outside each token's
    slot (token_slots [T], -1 = base model; G groups of S slots of rank R)."""
    return get_impl("lora_shrink", x.device)(x, a_stacked, token_slots, rank, num_slots)


def lora_expand(y: torch.Tensor, buf: torch.Tensor, b_stacked: torch.Tensor, offset: int) -> torch.Tensor:
    """y[:, offset:offset + N] += buf [T, S * R] @ stacked B [N, S * R]^T (per-slot scaling folded into B)."""
    return get_impl("lora_expand", y.device)(y, buf, b_stacked, offset)


def linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + b`` for a plain weight tensor [N, K]; a QuantizedWeight goes to kernel ``linear_<scheme>``."""
    if getattr(weight, "is_quantized_weight", False):
        return get_impl(f"linear_{weight.meta.scheme}", x.device)(x, weight, bias)
    return get_impl("linear", x.device)(x, weight, bias)


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: MoEWeights,
              act: str) -> torch.Tensor:
    """Routed experts: x [T, H], topk_weights [T, k] in x's dtype, topk_ids [T, k] -> [T, H], the sum over each
    token's k experts of weight * down(act(gate) * up), added in ascending expert order (transformers' order)."""
    return get_impl("fused_moe", x.device)(x, topk_weights, topk_ids, experts, act)


def _fused_moe_torch(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: MoEWeights,
                     act: str) -> torch.Tensor:
    # Each expert's matmuls through `linear`, so CPU weights keep their packed / quantized fast paths.
    return reference.fused_moe(x, topk_weights, topk_ids, experts, act, linear)


register("fused_moe", "torch", _fused_moe_torch)
for _name in ("linear", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "write_kv_cache", "paged_attention"):
    register(_name, "torch", getattr(cpu, _name))
for _name in ("lora_shrink", "lora_expand"):
    register(_name, "torch", getattr(reference, _name))
del _name
for _scheme, _fn in quant.TORCH_IMPLS.items():
    register(f"linear_{_scheme}", "torch", _fn)
del _scheme, _fn
# Weights pre-packed for oneDNN (CPU arenas, scheme "none") take the packed matmul; anything else as above.
register("linear_none", "torch", cpu_packed.linear_none)


# -- the triton backend (kernels/triton_*.py) ----------------------------------------------------------------------
# Imported only where it can run: a CUDA device, or Triton's CPU interpreter (TRITON_INTERPRET=1, which must be set
# before the import: it decides at decoration time whether the kernels are compiled or interpreted). Elsewhere
# `auto` never picks it, and importing triton would add ~0.2 s to every CPU worker's start.
def _register_triton() -> None:
    try:
        # deferred: these import triton, heavy and absent on CPU-only installs
        from . import triton_attention, triton_lora, triton_moe, triton_norm, triton_quant
    except Exception as e:  # triton missing, too old or broken: the torch backend serves, as on a CPU-only install
        logger.warning("triton backend unavailable: %s: %s", type(e).__name__, e)
        return
    for module in (triton_attention, triton_lora, triton_moe, triton_norm, triton_quant):
        for name, fn in module.IMPLS.items():
            register(name, "triton", fn)


if registry._TRITON_IMPORTABLE and (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()):
    _register_triton()
