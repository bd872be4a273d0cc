"""LoRA adapters: reading PEFT adapters, checking them against the model, and serving many in one batch.

Layout: for every layer and fused projection (qkv, o, gate_up, down) stacked buffers with one slot per active adapter
(``max_loras`` slots of rank ``max_lora_rank``): A as ``[groups * S * R, in]`` (q, k and v share their input, so their
A's stack into one matmul), B per output slice as ``[out, S * R]`` with the adapter's scaling folded in; smaller ranks
and untargeted modules are zero-padded. One slot index per token (-1 = base model) lets requests for different
adapters and the base model share a forward: two matmuls per projection (``kernels.lora_shrink`` / ``lora_expand``).

Rules: an adapter occupies a slot from the moment one of its requests is scheduled until its last running
request finishes or is preempted; a slot is rewritten only when its reference count is zero, so a request is
never served with another adapter's weights. Pickled adapter files are refused. Under tensor or pipeline
parallelism each rank's buffers hold its part (``shard``: ``weights.sharding.shard_lora``; ``layers``: a stage's own
layers) and rank 0 announces every slot write (``on_write``), so all ranks hold the same adapter in the same slot
before a step reads it (docs/architecture.md, "Tensor parallelism").
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load

from keepwarm import kernels
from keepwarm.formats.adapter import LoRAError, adapter_digest, read_adapter_dir
from keepwarm.formats.model_config import ModelConfig
from keepwarm.weights.sharding import Shard, local_config, shard_lora

# PEFT module name -> (module path inside a decoder layer, index of the output slice in the fused projection)
LORA_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0), "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's shape for choosing an adapter in the offline API."""

    lora_name: str
    lora_int_id: int
    lora_path: str


def module_dims(mc: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a PEFT target module in the checkpoint's model."""
    h, i = mc.hidden_size, mc.intermediate_size
    return {"q_proj": (h, mc.q_size), "k_proj": (h, mc.kv_size), "v_proj": (h, mc.kv_size), "o_proj": (mc.q_size, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
            "qkv_proj": (h, mc.q_size + 2 * mc.kv_size), "gate_up_proj": (h, 2 * i)}[module]


def fused_slices(mc: ModelConfig) -> dict[str, list[tuple[str, int, int]]]:
    """Fused module path -> [(PEFT module, output offset, output size)] in the order the fusion stacks them.
    Phi-3's checkpoint (and so its PEFT adapters) has qkv_proj and gate_up_proj already fused: one slice each."""
    h, i, q, kv = mc.hidden_size, mc.intermediate_size, mc.q_size, mc.kv_size
    if mc.architecture == "Phi3ForCausalLM":
        return {"self_attn.qkv_proj": [("qkv_proj", 0, q + 2 * kv)], "self_attn.o_proj": [("o_proj", 0, h)],
                "mlp.gate_up_proj": [("gate_up_proj", 0, 2 * i)], "mlp.down_proj": [("down_proj", 0, h)]}
    return {"self_attn.qkv_proj": [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)],
            "self_attn.o_proj": [("o_proj", 0, h)],
            "mlp.gate_up_proj": [("gate_proj", 0, i), ("up_proj", i, i)],
            "mlp.down_proj": [("down_proj", 0, h)]}


def lora_targets(mc: ModelConfig) -> tuple[str, ...]:
    """The PEFT module names an adapter for this model may target."""
    return tuple(m for slices in fused_slices(mc).values() for m, _, _ in slices)


@dataclass
class LoRAAdapter:
    name: str
    path: str
    digest: str  # sha256 over the adapter's files: also the prefix-cache salt
    rank: int
    scaling: float
    targets: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)  # -> (A [r,in], B [out,r])
    source: str = "disk"  # "disk", "daemon" or "rank 0" (a tensor-parallel rank's copy of rank 0's adapter)
    unloading: bool = False  # set while an unload waits for in-flight requests: new requests are refused
    storage: Any = field(default=None, repr=False)  # the daemon mapping the tensors view, kept alive

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def build_adapter(name: str, path: str, digest: str, config_text: str, tensors: dict[str, torch.Tensor],
                  mc: ModelConfig, max_lora_rank: int, source: str = "disk") -> LoRAAdapter:
    """Check a PEFT adapter against the model and the rank limit; raise :class:`LoRAError` naming the cause."""
    try:
        cfg = json.loads(config_text)
    except json.JSONDecodeError as e:
        raise LoRAError(f"adapter {name!r}: adapter_config.json is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"adapter {name!r}: adapter_config.json must hold an object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) == bad:
            raise LoRAError(f"adapter {name!r}: {key} is not supported")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"adapter {name!r}: modules_to_save is not supported (the adapter changes non-LoRA weights)")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAError(f"adapter {name!r}: bias={cfg.get('bias')!r} is not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise LoRAError(f"adapter {name!r}: rank_pattern/alpha_pattern are not supported")
    try:
        r = int(cfg["r"])
        alpha = float(cfg.get("lora_alpha", r))
    except (KeyError, TypeError, ValueError):
        raise LoRAError(f"adapter {name!r}: adapter_config.json lacks a valid r") from None
    if r < 1:
        raise LoRAError(f"adapter {name!r}: rank r={r} must be positive")
    if r > max_lora_rank:
        raise LoRAError(f"adapter {name!r} has rank {r}, above --max-lora-rank {max_lora_rank}")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    targets = lora_targets(mc)
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"adapter {name!r} targets module {_module_of(key)!r}, which the model lacks "
                            f"(supported: {', '.join(targets)})")
        layer, _, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in targets:
            raise LoRAError(f"adapter {name!r} targets module {module!r}, which the model lacks "
                            f"(supported: {', '.join(targets)})")
        if layer >= mc.num_hidden_layers:
            raise LoRAError(f"adapter {name!r} targets layer {layer}, but the model has {mc.num_hidden_layers} layers")
        pairs.setdefault((layer, module), {})[ab] = t
    if not pairs:
        raise LoRAError(f"adapter {name!r} holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} {module} lacks lora_{'A' if 'A' not in ab else 'B'}")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = module_dims(mc, module)
        if tuple(a.shape) != (r, fan_in) or tuple(b.shape) != (fan_out, r):
            raise LoRAError(f"adapter {name!r}: layer {layer} {module} has shapes A{tuple(a.shape)} "
                            f"B{tuple(b.shape)}; the model needs A({r}, {fan_in}) B({fan_out}, {r})")
        weights[(layer, module)] = (a, b)
    return LoRAAdapter(name, path, digest, r, scaling, frozenset(m for _, m in weights), weights, source)


def _module_of(key: str) -> str:
    """The module a PEFT weight key belongs to: 'lm_head' for base_model.model.lm_head.lora_A.weight, 'fc1' for
    base_model.model.model.layers.0.mlp.fc1.lora_A.weight."""
    parts = key.removeprefix("base_model.model.").split(".")
    if len(parts) > 4 and parts[0] == "model" and parts[1] == "layers":
        return parts[4] if parts[3] in ("self_attn", "mlp") else parts[3]
    return parts[1] if parts[0] == "model" and len(parts) > 1 else parts[0]


def load_adapter_from_disk(name: str, path: str, mc: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    config_text, weights_file = read_adapter_dir(path)
    data = weights_file.read_bytes()
    try:
        tensors = load(data)
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise LoRAError(f"adapter {name!r}: adapter_model.safetensors is unreadable: {e}") from None
    return build_adapter(name, str(Path(path).resolve()), adapter_digest(config_text, data), config_text, tensors,
                         mc, max_lora_rank, "disk")


class LoRALayer:
    """The LoRA part of one fused projection: stacked A for all its slices, and a stacked B per slice."""

    def __init__(self, manager: LoRAManager, fan_in: int, slices: list[tuple[str, int, int]],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.manager = manager
        S, R = manager.max_loras, manager.max_rank
        self.modules = [m for m, _, _ in slices]
        self.a = torch.zeros(len(slices) * S * R, fan_in, dtype=dtype, device=device)
        self.b = [torch.zeros(size, S * R, dtype=dtype, device=device) for _, _, size in slices]
        self.offsets = [off for _, off, _ in slices]

    def write_slot(self, slot: int, adapter: LoRAAdapter | None, layer: int) -> None:
        S, R = self.manager.max_loras, self.manager.max_rank
        for g, module in enumerate(self.modules):
            rows = slice((g * S + slot) * R, (g * S + slot + 1) * R)
            self.a[rows].zero_()
            self.b[g][:, slot * R:(slot + 1) * R].zero_()
            if adapter is None or (layer, module) not in adapter.weights:
                continue
            a, b = self.manager.pair(adapter, layer, module)
            r = a.shape[0]
            self.a[(g * S + slot) * R:(g * S + slot) * R + r].copy_(a)
            # Scaling folded into B, computed in float32 before the cast to the model dtype.
            self.b[g][:, slot * R:slot * R + r].copy_(b.float() * adapter.scaling)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        slots = self.manager.token_slots
        if slots is None:
            return y
        S, R = self.manager.max_loras, self.manager.max_rank
        buf = kernels.lora_shrink(x, self.a, slots, R, S)
        width = S * R
        for g, (b, off) in enumerate(zip(self.b, self.offsets, strict=True)):
            y = kernels.lora_expand(y, buf[:, g * width:(g + 1) * width], b, off)
        return y


class LoRAManager:
    """Adapter slots for one model: which adapter sits in which slot, with reference counts."""

    def __init__(self, model: torch.nn.Module, mc: ModelConfig, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device, shard: Shard | None = None,
                 layers: range | None = None) -> None:
        if max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        if max_lora_rank < 1:
            raise ValueError("max_lora_rank must be at least 1")
        self.max_loras = max_loras
        self.max_rank = max_lora_rank
        self.slot_adapter: list[LoRAAdapter | None] = [None] * max_loras
        self.slot_refs = [0] * max_loras
        self.token_slots: torch.Tensor | None = None  # set by the model runner around each forward
        self.layers: list[dict[str, LoRALayer]] = []
        self.mc, self.shard = mc, shard
        # Rank 0 under tensor parallelism: called on every slot write, to repeat it on the other ranks.
        self.on_write: Callable[[int, LoRAAdapter | None], None] | None = None
        local = mc if shard is None else local_config(mc, shard.world_size)  # this rank's widths
        slices = fused_slices(local)
        for i, layer in enumerate(cast(torch.nn.ModuleList, model.model.layers)):
            per_layer: dict[str, LoRALayer] = {}
            self.layers.append(per_layer)
            if layers is not None and i not in layers:
                continue  # another pipeline stage's layer
            for path, sl in slices.items():
                module = layer.get_submodule(path)
                fan_in = module_dims(local, sl[0][0])[0]
                lora = LoRALayer(self, fan_in, sl, dtype, device)
                object.__setattr__(module, "lora", lora)
                per_layer[path] = lora

    def pair(self, adapter: LoRAAdapter, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of ``adapter`` at (layer, module) as this rank holds them."""
        a, b = adapter.weights[(layer, module)]
        return (a, b) if self.shard is None else shard_lora(module, a, b, self.mc, self.shard)

    def slot_of(self, adapter: LoRAAdapter) -> int:
        for s, a in enumerate(self.slot_adapter):
            if a is adapter:
                return s
        return -1

    def acquire(self, adapter: LoRAAdapter) -> int | None:
        """A slot holding ``adapter`` (loading it into a free one if needed), or None when every slot is busy."""
        s = self.slot_of(adapter)
        if s < 0:
            free = [i for i in range(self.max_loras) if self.slot_refs[i] == 0]
            if not free:
                return None
            # Prefer an empty slot; else reuse the one whose adapter is idle (its weights are rewritten).
            s = next((i for i in free if self.slot_adapter[i] is None), free[0])
            self._write(s, adapter)
        self.slot_refs[s] += 1
        return s

    def release(self, slot: int) -> None:
        if slot >= 0:
            self.slot_refs[slot] -= 1
            assert self.slot_refs[slot] >= 0

    def evict(self, adapter: LoRAAdapter) -> None:
        """Clear ``adapter`` from its slot (only when no running request uses it)."""
        s = self.slot_of(adapter)
        if s >= 0:
            if self.slot_refs[s]:
                raise RuntimeError(f"adapter {adapter.name!r} is in use")
            self._write(s, None)

    def _write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        if self.on_write is not None:
            self.on_write(slot, adapter)
        self.write(slot, adapter)

    def write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put ``adapter`` (None: nothing) in ``slot``'s buffers; a rank other than 0 calls this as rank 0 says."""
        with torch.inference_mode():
            for layer_idx, per_layer in enumerate(self.layers):
                for lora in per_layer.values():
                    lora.write_slot(slot, adapter, layer_idx)
        self.slot_adapter[slot] = adapter

    def set_batch(self, slots: torch.Tensor, num_tokens: torch.Tensor, device: torch.device) -> None:
        """Each token's slot from each sequence's (``slots`` [S], -1: base model; empty or all -1: no LoRA) and
        token count (``num_tokens`` [S])."""
        if not slots.numel() or not bool((slots >= 0).any()):
            self.token_slots = None  # the whole batch is the base model: skip LoRA entirely
            return
        self.token_slots = torch.repeat_interleave(slots.to(torch.int64), num_tokens.to(torch.int64)).to(device)

    def clear_batch(self) -> None:
        self.token_slots = None


def parse_lora_modules(specs: Iterable[str]) -> list[tuple[str, str]]:
    """``--lora-modules name=path ...`` (vLLM's form; a JSON object {"name", "path"} is accepted too)."""
    out = []
    for spec in specs:
        spec = spec.strip()
        if spec.startswith("{"):
            try:
                d: dict[str, Any] = json.loads(spec)
                out.append((d["name"], d["path"]))
                continue
            except (json.JSONDecodeError, KeyError):
                raise LoRAError(f"--lora-modules: cannot parse {spec!r}") from None
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise LoRAError(f"--lora-modules entries are name=path, got {spec!r}")
        out.append((name, path))
    return out
