"""Which slice of each weight a tensor-parallel rank holds (vLLM's rules), cut from the full tensors at load.

Rules (``N`` ranks; each rule in full: docs/architecture.md, "Tensor parallelism"):
- Column-parallel, no communication: ``qkv_proj`` per component (q by heads, k and v by KV heads, each KV head
  replicated on ``N / Hk`` consecutive ranks when ``num_key_value_heads < N``), ``gate_up_proj`` per component.
- Row-parallel, one all-reduce after: ``o_proj`` and ``down_proj``; their bias kept whole and added once, after it.
- Vocab-parallel: ``embed_tokens`` and ``lm_head``, padded to a multiple of N (the zero padding rows are cut from
  the gathered logits). Norms are replicated. Anything else has no rule and is refused.
- Quantized layouts are cut along the same axis, exactly (int4 codes unpacked, cut and packed again; oneDNN-packed
  weights unpacked, cut, re-packed); a row-parallel cut must fall on a group boundary, else a one-line error names
  the weight, its shape and the group size. Layouts with a group index are refused.
- The result is a new tensor per weight (a copy): the full tensors can be dropped after the cut.
- Pipeline stages (``stage_of``, ``stage_tensors``): stage s of P holds layers ``stage_layers(L, P, s)``, stage 0 also
  the embedding, the last the final norm and head (a tied head takes the embedding's tensor); LoRA: ``shard_lora``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from keepwarm.formats.errors import QuantizationError
from keepwarm.formats.model_config import ModelConfig
from keepwarm.formats.packed import pack
from keepwarm.formats.quant import (
    LAYOUT_DENSE,
    LAYOUT_FP8,
    LAYOUT_FP8_BLOCK,
    LAYOUT_INT4_CANONICAL,
    LAYOUT_INT8,
    LAYOUT_INT8_GROUP,
    LAYOUT_INT8_GROUP_U4,
    LAYOUT_MKLDNN_PACKED,
    QuantMeta,
    pack_int4,
    pack_u4_groups,
    unpack_int4,
    unpack_u4_groups,
)
from keepwarm.kernels.cpu_packed import PackedWeight
from keepwarm.kernels.quant import QuantizedWeight

# The families whose decoder the tensor-parallel path is built and tested for (formats.model_config.FAMILIES).
SUPPORTED_FAMILIES = ("llama",)

_REPLICATED = re.compile(r"(?:model\.layers\.\d+\.(?:input_layernorm|post_attention_layernorm|self_attn\.q_norm|"
                         r"self_attn\.k_norm)|model\.norm)\.weight")
_LAYER = r"model\.layers\.\d+\."

Segments = list[tuple[int, int]]  # (start, length) along the cut axis


class TensorParallelError(ValueError):
    """A model or setting that tensor parallelism cannot run exactly; one line naming it."""


@dataclasses.dataclass(frozen=True)
class Shard:
    rank: int
    world_size: int

    def block(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal part of ``total``."""
        if total % self.world_size:
            raise TensorParallelError(f"tensor-parallel size {self.world_size} does not divide {what} ({total})")
        n = total // self.world_size
        return self.rank * n, n


def check_supported(config: ModelConfig, world_size: int) -> None:
    """Refuse (one line) what the tensor-parallel path cannot run exactly, before any process is started."""
    if world_size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be at least 1, got {world_size}")
    if config.family not in SUPPORTED_FAMILIES:
        raise TensorParallelError(f"tensor parallelism supports the Llama family (Llama, Mistral, Qwen2, Qwen3, "
                                  f"Phi-3); {config.architecture} is not supported yet")
    h, hk = config.num_attention_heads, config.num_key_value_heads
    if h % world_size:
        raise TensorParallelError(f"tensor-parallel size {world_size} does not divide num_attention_heads ({h})")
    if hk % world_size and world_size % hk:
        raise TensorParallelError(f"tensor-parallel size {world_size} and num_key_value_heads ({hk}): one must "
                                  "divide the other")
    if config.intermediate_size % world_size:
        raise TensorParallelError(f"tensor-parallel size {world_size} does not divide intermediate_size "
                                  f"({config.intermediate_size})")


def local_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config one rank's decoder is built with: its heads, KV heads and MLP width (vocabulary unchanged: the
    embedding and head are swapped for vocab-parallel ones)."""
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world_size,
                               num_key_value_heads=max(1, config.num_key_value_heads // world_size),
                               intermediate_size=config.intermediate_size // world_size)


def vocab_block(vocab_size: int, shard: Shard) -> tuple[int, int]:
    """(first id, rows) of this rank's vocabulary part, the vocabulary padded up to a multiple of N."""
    n = -(-vocab_size // shard.world_size)
    return shard.rank * n, n


def _qkv_segments(config: ModelConfig, shard: Shard) -> Segments:
    d, h, hk = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    q0, qn = shard.block(h, "num_attention_heads")
    local_kv = max(1, hk // shard.world_size)
    kv_rank = shard.rank // max(1, shard.world_size // hk)  # replicas of a KV head sit on consecutive ranks
    k0 = kv_rank * local_kv
    return [(q0 * d, qn * d), ((h + k0) * d, local_kv * d), ((h + hk + k0) * d, local_kv * d)]


def plan_cut(name: str, config: ModelConfig, shard: Shard) -> tuple[str, Segments] | None:
    """("rows" | "cols", segments) for a weight, or None when it is replicated; raises for a weight with no rule."""
    if _REPLICATED.fullmatch(name):
        return None
    if re.fullmatch(_LAYER + r"self_attn\.qkv_proj\.(?:weight|bias)", name):
        return "rows", _qkv_segments(config, shard)
    if re.fullmatch(_LAYER + r"mlp\.gate_up_proj\.(?:weight|bias)", name):
        i = config.intermediate_size
        s, n = shard.block(i, "intermediate_size")
        return "rows", [(s, n), (i + s, n)]
    if re.fullmatch(_LAYER + r"self_attn\.o_proj\.weight", name):
        return "cols", [shard.block(config.q_size, "the attention width")]
    if re.fullmatch(_LAYER + r"mlp\.down_proj\.weight", name):
        return "cols", [shard.block(config.intermediate_size, "intermediate_size")]
    if re.fullmatch(_LAYER + r"(?:self_attn\.o_proj|mlp\.down_proj)\.bias", name):
        return None  # row-parallel bias: added once after the all-reduce
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "vocab", [vocab_block(config.vocab_size, shard)]
    raise TensorParallelError(f"tensor parallelism has no sharding rule for weight {name!r}")


def shard_lora(module: str, a: torch.Tensor, b: torch.Tensor, config: ModelConfig, shard: Shard
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A [r, in], B [out, r]) of a PEFT module's LoRA pair (views where one segment suffices)."""
    d, h, hk, i = config.head_dim, config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if module in ("o_proj", "down_proj"):  # row-parallel: A by the input columns the rank's weight holds
        s, n = shard.block(config.q_size if module == "o_proj" else i, module)
        return a.narrow(1, s, n), b
    q, k, v = _qkv_segments(config, shard)
    rows: dict[str, Segments] = {
        "q_proj": [q], "k_proj": [(k[0] - h * d, k[1])], "v_proj": [(v[0] - (h + hk) * d, v[1])],
        "qkv_proj": [q, k, v],  # Phi-3's adapters target the fused projections
        "gate_proj": [shard.block(i, "intermediate_size")], "up_proj": [shard.block(i, "intermediate_size")]}
    if module == "gate_up_proj":
        s, n = shard.block(i, "intermediate_size")
        rows[module] = [(s, n), (i + s, n)]
    if module not in rows:
        raise TensorParallelError(f"tensor parallelism has no LoRA sharding rule for module {module!r}")
    segs = rows[module]
    return a, (b.narrow(0, *segs[0]) if len(segs) == 1 else _cut(b, 0, segs))


def _cut(t: torch.Tensor, axis: int, segs: Segments) -> torch.Tensor:
    return torch.cat([t.narrow(axis, s, n) for s, n in segs], dim=axis)


def _cut_vocab(t: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of ``t``, zero rows past its end (the padding of the last rank)."""
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    have = max(0, min(rows, t.shape[0] - start))
    if have:
        out[:have] = t[start:start + have]
    return out


def _group_segments(name: str, meta: QuantMeta, segs: Segments) -> Segments:
    """Column segments in units of quantization groups; a segment that would split a group is refused."""
    gs = meta.group_size
    assert gs is not None
    if any(s % gs or n % gs for s, n in segs):
        n_cols = segs[0][1]
        raise TensorParallelError(
            f"tensor parallelism cannot split {name} {list(meta.shape)} ({meta.scheme}, groups of {gs} along the "
            f"input): each rank would take {n_cols} columns, which cuts a group; use smaller groups (e.g. "
            "--quantization int4-g32) or another tensor-parallel size")
    return [(s // gs, n // gs) for s, n in segs]


def _cut_quantized(name: str, w: QuantizedWeight, kind: str, segs: Segments) -> QuantizedWeight:
    meta, p = w.meta, w.parts
    rows = kind == "rows"
    axis = 0 if rows else 1
    n, k = meta.shape
    size = sum(length for _, length in segs)
    shape = (size, k) if rows else (n, size)
    new_meta = dataclasses.replace(meta, shape=shape)
    lay = meta.layout
    if lay in (LAYOUT_DENSE, LAYOUT_INT8, LAYOUT_FP8):
        main = "weight" if lay == LAYOUT_DENSE else "qweight"
        parts = {main: _cut(p[main], axis, segs)}
        if lay == LAYOUT_INT8:
            parts["scales"] = _cut(p["scales"], 0, segs) if rows else p["scales"].clone()
        elif lay == LAYOUT_FP8:
            parts["scale"] = p["scale"].clone()
    elif lay in (LAYOUT_FP8_BLOCK, LAYOUT_INT8_GROUP, LAYOUT_INT8_GROUP_U4):
        gsegs = segs if rows else _group_segments(name, meta, segs)
        if lay == LAYOUT_INT8_GROUP_U4 and not rows:  # 4-bit codes: a column cut repacks its 32-column bytes
            if shape[1] % 32:
                raise TensorParallelError(f"tensor parallelism cannot cut {name} ({lay}) into {shape[1]} columns: "
                                          "not a multiple of 32")
            qweight = pack_u4_groups(_cut(unpack_u4_groups(p["qweight"]), axis, segs))
        else:  # rows (of any codes) and int8 / fp8 columns cut as they are
            qweight = _cut(p["qweight"], axis, segs)
        parts = {"qweight": qweight, **{part: _cut(p[part], axis, gsegs) for part in ("scales", "zeros") if part in p}}
    elif meta.scheme == "int4" and meta.layout != "int4_gidx":
        gsegs = segs if rows else _group_segments(name, meta, segs)
        codes = unpack_int4(p["qweight"], lay, meta.shape)
        if lay == LAYOUT_INT4_CANONICAL:
            scales, zeros = p["scales"], p["zeros"]
        else:
            scales, zeros = p["scales_and_zeros"][..., 0].t(), p["scales_and_zeros"][..., 1].t()
        try:
            parts = pack_int4(new_meta, _cut(codes, axis, segs), _cut(scales, axis, gsegs).contiguous(),
                              _cut(zeros, axis, gsegs).contiguous())
        except (QuantizationError, RuntimeError) as e:
            raise TensorParallelError(f"tensor parallelism cannot re-pack {name} as {list(shape)} ({lay}): "
                                      f"{str(e).splitlines()[0]}") from None
    else:
        raise TensorParallelError(f"tensor parallelism cannot shard {name} ({meta.scheme}, layout {lay}): not "
                                  "supported yet")
    try:
        return QuantizedWeight.from_parts(new_meta, {k_: v.contiguous() for k_, v in parts.items()})
    except QuantizationError as e:
        raise TensorParallelError(f"tensor parallelism: the shard of {name} does not fit its layout: {e}") from None


def _cut_packed(name: str, w: PackedWeight, kind: str, segs: Segments) -> PackedWeight:
    dense = w.dequantize(w.dtype)  # oneDNN reorders back exactly
    part = _cut(dense, 0 if kind == "rows" else 1, segs) if kind != "vocab" else _cut_vocab(dense, *segs[0])
    raw, desc = pack(part)
    meta = QuantMeta("none", LAYOUT_MKLDNN_PACKED, None, (int(part.shape[0]), int(part.shape[1])), desc.hex())
    return PackedWeight(meta, raw, w.dtype)


def shard_weight(name: str, w: Any, config: ModelConfig, shard: Shard) -> Any:
    """This rank's part of weight ``name`` (a tensor, QuantizedWeight or PackedWeight), as a new tensor."""
    cut = plan_cut(name, config, shard)
    if cut is None:
        return w.clone() if isinstance(w, torch.Tensor) else w
    kind, segs = cut
    if isinstance(w, PackedWeight):
        return _cut_packed(name, w, kind, segs)
    if isinstance(w, QuantizedWeight):
        if kind == "vocab":
            raise TensorParallelError(f"tensor parallelism cannot shard a quantized {name} ({w.meta.scheme})")
        return _cut_quantized(name, w, kind, segs)
    if not isinstance(w, torch.Tensor):
        raise TensorParallelError(f"tensor parallelism cannot shard {name} ({type(w).__name__})")
    if kind == "vocab":
        return _cut_vocab(w, *segs[0])
    if w.dim() == 1 and kind == "cols":
        return w.clone()
    return _cut(w, 0 if kind == "rows" else 1, segs)


def shard_weights(tensors: dict[str, Any], config: ModelConfig, shard: Shard) -> dict[str, Any]:
    """Every weight cut for ``shard`` (see the module rules); the input tensors are not modified."""
    return {name: shard_weight(name, w, config, shard) for name, w in tensors.items()}


# -- pipeline stages -------------------------------------------------------------------------------------------
def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The contiguous layers stage ``stage`` of ``stages`` runs."""
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def check_pipeline(config: ModelConfig, stages: int) -> None:
    """Refuse (one line) what pipeline parallelism cannot run, before any process is started."""
    if stages < 1:
        raise TensorParallelError(f"pipeline_parallel_size must be at least 1, got {stages}")
    if stages == 1:
        return
    if config.family not in SUPPORTED_FAMILIES:
        raise TensorParallelError(f"pipeline parallelism supports the Llama family (Llama, Mistral, Qwen2, Qwen3, "
                                  f"Phi-3); {config.architecture} is not supported yet")
    if config.num_hidden_layers < stages:
        raise TensorParallelError(f"pipeline-parallel size {stages} is more than the model's "
                                  f"{config.num_hidden_layers} layers")


@dataclasses.dataclass(frozen=True)
class Stage:
    """This process's place in the pipeline."""

    index: int
    stages: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1


def stage_of(config: ModelConfig, stages: int, index: int) -> Stage:
    return Stage(index, stages, stage_layers(config.num_hidden_layers, stages, index))


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" else None


def stage_holds(name: str, stage: Stage) -> bool:
    """Whether ``stage`` binds weight ``name``: its layers', the embedding on the first stage, the rest (final norm,
    head) on the last."""
    layer = _layer_of(name)
    if layer is not None:
        return layer in stage.layers
    return stage.first if name == "model.embed_tokens.weight" else stage.last


def stage_tensors(tensors: dict[str, Any], stage: Stage) -> dict[str, Any]:
    """The weights ``stage`` binds: its layers', the embedding on the first stage, the norm and head on the last
    (a tied head takes the embedding's tensor there)."""
    out = {name: w for name, w in tensors.items() if stage_holds(name, stage)}
    if stage.last and "lm_head.weight" not in tensors:
        out["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return out
