"""keepwarm.kernels: one dispatch point per kernel.

The backend comes from env var KEEPWARM_KERNELS, read and checked once (at the first dispatch), and from then on
only `set_backend` changes it: a process picks its kernels at start (workers inherit the variable), and code that
must switch in-process (tests, benchmarks) says so with `set_backend`, never by editing os.environ:
  auto   (default) triton when the input is on CUDA, triton is importable and the kernel has a triton impl;
         torch otherwise.
  torch  always the plain-torch reference (`kernels/reference.py`).
  triton always triton; a kernel without a triton impl raises KernelBackendError.

Backends plug in through `register(name, backend, fn)`: a `kernels/triton_*.py` module registers its
functions at import, and gets imported at the bottom of this file (guarded, so CPU-only installs skip it);
model code never changes when a backend is added.

KV cache layout (every backend): one pool per layer and side, ``[num_kv_heads, num_blocks, block_size, head_dim]``.
Head-major, so that gathering a batch's blocks yields ``[Hk, S, L, D]``, which the attention matmuls use with no
further copy (on CPU the copies, not the math, dominated decode attention in the block-major layout).

Per-step plans: `plan_attention` turns one step's attention metadata into what the torch write_kv_cache and
paged_attention read (host lengths, gather tables, masks, write slots), once for all layers; it is derived from the
metadata alone, so a kernel computes exactly the same with or without it. Backends that read the metadata on the
device get no plan (plan_attention returns None for them). `plan_rotary` does the same for rotary: a table's rows at
the step's positions, gathered once instead of in every layer.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from . import cpu_packed, quant, reference
from .quant import QuantizedWeight
from .reference import MoEWeights, activation, build_cos_sin_cache

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "KernelBackendError",
    "MoEWeights",
    "QuantizedWeight",
    "activation",
    "build_cos_sin_cache",
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

ENV_VAR = "KEEPWARM_KERNELS"
BACKENDS = ("torch", "triton")
_MODES = ("auto", *BACKENDS)
# Checked once: find_spec walks sys.path, too slow for every kernel call.
_TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None

# kernel name -> backend -> implementation.
_IMPLS: dict[str, dict[str, Callable[..., Any]]] = {}
# The checked mode; None until the first dispatch reads KEEPWARM_KERNELS (or `set_backend` sets it).
_mode_now: str | None = None
# (kernel, backend) pairs already logged, so each choice is logged once rather than per call.
_LOGGED: set[tuple[str, str]] = set()
# (kernel, device type) -> the implementation get_impl chose: a decode step dispatches ~300 kernels, and choosing
# anew each time cost ~1 us apiece. Emptied by whatever can change a choice: register and set_backend.
_RESOLVED: dict[tuple[str, str], Callable[..., Any]] = {}


class KernelBackendError(RuntimeError):
    """The requested backend has no implementation of a kernel."""


def register(name: str, backend: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make `fn` the `backend` implementation of kernel `name` (replacing any previous one)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    _IMPLS.setdefault(name, {})[backend] = fn
    _RESOLVED.clear()
    return fn


def _checked(raw: str | None, source: str) -> str:
    mode = (raw or "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{source}={mode!r} is not one of {_MODES}")
    return mode


def _mode() -> str:
    global _mode_now
    if _mode_now is None:
        _mode_now = _checked(os.environ.get(ENV_VAR), ENV_VAR)
    return _mode_now


def set_backend(mode: str | None) -> str | None:
    """Select the kernel mode ('auto', 'torch' or 'triton') for this process; None re-reads KEEPWARM_KERNELS at
    the next dispatch. Returns the previous setting (None if the environment had not been read yet), so callers
    can restore it."""
    global _mode_now
    previous = _mode_now
    _mode_now = None if mode is None else _checked(mode, "kernel backend")
    _RESOLVED.clear()
    return previous


def select_backend(name: str, device: torch.device) -> str:
    """The backend that `name` runs on for inputs on `device` under the current KEEPWARM_KERNELS."""
    impls = _IMPLS.get(name)
    if not impls:
        raise KeyError(f"no kernel named {name!r}; known: {sorted(_IMPLS)}")
    mode = _mode()
    if mode == "auto":
        use_triton = device.type == "cuda" and _TRITON_IMPORTABLE and "triton" in impls
        mode = "triton" if use_triton else "torch"
    if mode not in impls:
        raise KernelBackendError(
            f"{ENV_VAR} selects the {mode!r} backend, but kernel {name!r} has no {mode} implementation "
            f"(available: {sorted(impls)}); set {ENV_VAR}=auto to fall back per kernel"
        )
    return mode


def get_impl(name: str, device: torch.device) -> Callable[..., Any]:
    fn = _RESOLVED.get((name, device.type))
    if fn is not None:
        return fn
    backend = select_backend(name, device)
    if (name, backend) not in _LOGGED:
        _LOGGED.add((name, backend))
        logger.info("kernel %s: %s backend (device %s)", name, backend, device)
    fn = _RESOLVED[(name, device.type)] = _IMPLS[name][backend]
    return fn


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
    return reference.plan_attention(block_tables, seq_lens, query_start_loc, slot_mapping, block_size, windows)


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
for _name in ("lora_shrink", "lora_expand", "linear", "rms_norm", "fused_add_rms_norm", "rotary_embedding",
              "write_kv_cache", "paged_attention"):
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
        from . import triton_attention, triton_lora, triton_moe, triton_norm, triton_quant
    except Exception as e:  # triton missing, too old or broken: the torch backend serves, as on a CPU-only install
        logger.warning("triton backend unavailable: %s: %s", type(e).__name__, e)
        return
    for module in (triton_attention, triton_lora, triton_moe, triton_norm, triton_quant):
        for name, fn in module.IMPLS.items():
            register(name, "triton", fn)


if _TRITON_IMPORTABLE and (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()):
    _register_triton()
