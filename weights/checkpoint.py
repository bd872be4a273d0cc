"""Read a Hugging Face checkpoint's safetensors (or a llama.cpp GGUF file) and plan the fused tensors the model
code uses.

We parse the safetensors header ourselves so that bytes can be read straight from the file into their final
place (a fused tensor's slice, or later the daemon's arena) with ``readinto``: no second copy in host memory.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from keepwarm.formats.arena import source_signature
from keepwarm.formats.errors import QuantizationError
from keepwarm.formats.gguf import PLAIN_TYPES, dequantize_dense, is_gguf, read_gguf, unpermute_rows
from keepwarm.formats.model_config import ModelConfig, ModelConfigError, load_model_config, parse_model_config
from keepwarm.formats.quant import QuantMeta, is_quantized_target
from keepwarm.weights.convert import convert_gguf, convert_weight, dense_shape, plan_gguf, plan_weight
from keepwarm.weights.prequant import GGUF_SOURCE, SourceQuant, detect, resolve_quantization

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

# Tensor name suffixes that only quantized checkpoints have (compressed-tensors, fp8, GPTQ, AWQ).
_QUANTIZED_TENSOR_SUFFIXES = frozenset({"weight_packed", "weight_scale", "weight_scale_inv", "weight_zero_point",
                                        "weight_g_idx", "qweight", "qzeros", "scales", "g_idx"})

# 1 MiB reads: the chunk is still in cache when it is hashed (measured here: 8-64 MiB pieces read, hash and
# write 2-5x slower than 1 MiB ones, the bytes having left the cache); POSIX_FADV_WILLNEED on each part keeps the
# disk busy meanwhile.
_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class SourceTensor:
    """One tensor inside one safetensors file: where its bytes are."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class FusedTensor:
    """A tensor the model code uses, made of source tensors concatenated along dim 0 (one part if unfused).

    A pre-quantized projection weight (``roles`` non-empty) is instead all its projections' source tensors (codes,
    scales, zero points, ...) read back to back; ``roles[i]`` names part i as "<projection index>.<suffix>",
    ``dense_shapes`` are the projections' dense [N, K] and ``shape`` the fused one."""

    name: str
    parts: tuple[SourceTensor, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    roles: tuple[str, ...] = ()
    dense_shapes: tuple[tuple[int, int], ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def read_safetensors_header(path: Path) -> dict[str, SourceTensor]:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ModelConfigError(f"{path} is not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 << 20:
                raise ModelConfigError(f"{path} is not a safetensors file (header size {n})")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelConfigError(f"{path} is not a safetensors file (bad header)") from None
    data_start = 8 + n
    size = path.stat().st_size
    out: dict[str, SourceTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ModelConfigError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        if data_start + end > size:
            raise ModelConfigError(f"{path}: tensor {name!r} extends past the end of the file (truncated?)")
        out[name] = SourceTensor(name, path, dtype, tuple(info["shape"]), data_start + begin, end - begin)
    return out


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise ModelConfigError(f"{index} is malformed (no weight_map)") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelConfigError(f"{model_dir}: shard(s) named in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = sorted(model_dir.glob("*.bin")) + sorted(model_dir.glob("*.pt"))
        hint = " (only pickled .bin/.pt weights found; keepwarm never loads pickle)" if bins else ""
        raise ModelConfigError(f"{str(model_dir)!r} has no *.safetensors weights{hint}")
    return files


class Checkpoint:
    """A model directory (or a .gguf file): its config, its source tensors, and the fused tensors the model code
    needs. ``model_dir`` is the path the user named; ``config_json`` the config as keepwarm reads it."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir).resolve() if Path(model_dir).exists() else Path(model_dir)
        self.gguf_types: dict[str, str] = {}  # GGUF only: quantized tensor name -> ggml type name
        self._gguf_shapes: dict[str, tuple[int, int]] = {}
        if is_gguf(self.model_dir):
            self._init_gguf()
        else:
            self.config: ModelConfig = load_model_config(self.model_dir)
            self.config_json = (self.model_dir / "config.json").read_text()
            gen = self.model_dir / "generation_config.json"
            self.generation_config_json = gen.read_text() if gen.is_file() else None
            # What config.json's quantization_config says (None: a plain checkpoint); refuses what cannot run
            # exactly.
            self.quant: SourceQuant | None = detect(json.loads(self.config_json))
            self.files = _safetensors_files(self.model_dir)
            self.sources: dict[str, SourceTensor] = {}
            for f in self.files:
                self.sources.update(read_safetensors_header(f))
            if self.quant is None:
                self._refuse_stray_quantized_tensors()
        self.tensors: list[FusedTensor] = self._plan()

    def _init_gguf(self) -> None:
        cfg, tensors = read_gguf(self.model_dir)
        self.config_json = json.dumps(cfg, indent=1, sort_keys=True)
        self.generation_config_json = None
        self.config = parse_model_config(self.config_json, None, source=str(self.model_dir))
        self.quant = GGUF_SOURCE
        self.files = [self.model_dir]
        self.sources = {}
        for name, t in tensors.items():
            # A plain projection goes the quantized ones' way too: llama.cpp permuted Q and K rows (undone at
            # conversion), and a fused weight is converted from its projections as one
            if t.type_name in PLAIN_TYPES and not (is_quantized_target(_fused_name(name)) and len(t.shape) == 2):
                self.sources[name] = SourceTensor(name, self.model_dir, PLAIN_TYPES[t.type_name], t.shape, t.offset,
                                                  t.nbytes)
            else:
                self.sources[name] = SourceTensor(name, self.model_dir, torch.uint8, (t.nbytes,), t.offset, t.nbytes)
                self.gguf_types[name] = t.type_name
                self._gguf_shapes[name] = (t.shape[0], t.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def resolve_quantization(self, requested: str) -> str:
        """The keepwarm scheme this checkpoint is served as for a requested `--quantization` (auto, a scheme, or
        the checkpoint's own method); QuantizationError when they conflict."""
        return resolve_quantization(requested, self.quant, self.model_dir.name)

    def _refuse_stray_quantized_tensors(self) -> None:
        # Quantized tensors without a quantization_config would be read as plain weights: wrong numbers.
        stray = sorted(n for n in self.sources if n.rsplit(".", 1)[-1] in _QUANTIZED_TENSOR_SUFFIXES)
        if stray:
            raise QuantizationError(f"{self.model_dir.name}: tensor {stray[0]!r} is a quantized weight's part, but "
                                    f"config.json has no quantization_config")

    def _get(self, name: str) -> SourceTensor:
        try:
            return self.sources[name]
        except KeyError:
            raise ModelConfigError(f"{self.model_dir}: checkpoint lacks tensor {name!r}") from None

    def _fuse(self, name: str, part_names: list[str]) -> FusedTensor:
        if self.gguf_types and part_names[0] in self.gguf_types:
            return self._fuse_gguf(name, part_names)
        if self.quant is not None and self.quant.kind != "gguf" and name.endswith("_proj.weight"):
            return self._fuse_quantized(name, [p.removesuffix(".weight") for p in part_names])
        parts = tuple(self._get(p) for p in part_names)
        dtypes = {p.dtype for p in parts}
        if len(dtypes) != 1:
            raise ModelConfigError(f"{self.model_dir}: parts of {name} have mixed dtypes")
        rest = {p.shape[1:] for p in parts}
        if len(rest) != 1:
            raise ModelConfigError(f"{self.model_dir}: parts of {name} have mismatched shapes")
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        return FusedTensor(name, parts, parts[0].dtype, shape)

    def _fuse_quantized(self, name: str, projections: list[str]) -> FusedTensor:
        assert self.quant is not None
        parts: list[SourceTensor] = []
        roles: list[str] = []
        shapes: list[tuple[int, int]] = []
        for i, proj in enumerate(projections):
            found: dict[str, tuple[int, ...]] = {}
            for suffix, required in self.quant.tensor_suffixes():
                src = self.sources.get(f"{proj}.{suffix}")
                if src is None:
                    if required:
                        raise QuantizationError(f"{self.model_dir.name}: tensor {proj}.{suffix} is missing "
                                                f"({self.quant.description} needs it)")
                    continue
                parts.append(src)
                roles.append(f"{i}.{suffix}")
                found[suffix] = src.shape
            shapes.append(dense_shape(self.quant, found, proj))
        ks = {k for _, k in shapes}
        if len(ks) != 1:
            raise QuantizationError(f"{self.model_dir.name}: parts of {name} have different K: {sorted(ks)}")
        shape = (sum(n for n, _ in shapes), shapes[0][1])
        return FusedTensor(name, tuple(parts), torch.uint8, shape, tuple(roles), tuple(shapes))

    def _fuse_gguf(self, name: str, part_names: list[str]) -> FusedTensor:
        c = self.config
        parts, roles, shapes = [], [], []
        for i, p in enumerate(part_names):
            if p not in self.gguf_types:
                raise QuantizationError(f"{self.model_dir.name}: {p} is not quantized but {part_names[0]} is; "
                                        f"keepwarm fuses them into one weight")
            # llama.cpp permuted Q and K rows for its rotary layout: undone at conversion (whole rows).
            heads = c.num_attention_heads if p.endswith("q_proj.weight") else \
                c.num_key_value_heads if p.endswith("k_proj.weight") else 0
            parts.append(self._get(p))
            roles.append(f"{i}.{self.gguf_types[p]}.{heads}")
            shapes.append(self._gguf_shapes[p])
        types = [self.gguf_types[p] for p in part_names]
        plain = [x in PLAIN_TYPES for x in types]
        if any(plain) and not all(plain):
            kinds = [", ".join(sorted({x for x, p in zip(types, plain, strict=True) if p == want})) for want in (1, 0)]
            raise QuantizationError(f"{self.model_dir.name}: {name} fuses plain ({kinds[0]}) and quantized "
                                    f"({kinds[1]}) projections; keepwarm stores a fused weight in one layout")
        shape = (sum(n for n, _ in shapes), shapes[0][1])
        return FusedTensor(name, tuple(parts), torch.uint8, shape, tuple(roles), tuple(shapes))

    def plan_quantized(self, t: FusedTensor, act_dtype: torch.dtype, device_type: str, name: str | None = None,
                       ) -> QuantMeta | None:
        """A pre-quantized tensor's arena layout (headers only); None: it is stored dense (a GGUF embedding).
        ``name``: the weight it is stored as, when not ``t``'s (a tied GGUF ``lm_head`` from the token embedding)."""
        assert self.quant is not None and t.roles
        if self.quant.kind != "gguf":
            return plan_weight(self.quant, t.dense_shapes, act_dtype, device_type)
        if not is_quantized_target(name or t.name) and name != "lm_head.weight":
            if len(t.parts) != 1:
                raise QuantizationError(f"{t.name}: a fused GGUF tensor that is not a projection")
            return None
        if t.roles[0].split(".")[1] in PLAIN_TYPES:  # F32 / F16 / BF16 projections: stored dense, arena dtype
            return None
        return plan_gguf([r.split(".")[1] for r in t.roles], t.dense_shapes, act_dtype, device_type)

    def convert_quantized(self, t: FusedTensor, meta: QuantMeta | None, staging: torch.Tensor,
                          act_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The arena parts of a pre-quantized tensor from its source bytes read back to back into `staging`."""
        assert self.quant is not None
        views = _role_views(t, staging)
        if self.quant.kind != "gguf":
            assert meta is not None
            return convert_weight(self.quant, meta, [{k: v for k, v in p.items()} for p in views], t.dense_shapes,
                                  act_dtype, t.name)
        raws = [next(iter(p.items())) for p in views]  # one raw block tensor per projection, keyed "TYPE.heads"
        if meta is None:
            if all(key.split(".")[0] in PLAIN_TYPES for key, _ in raws):  # plain projections, Q/K rows un-permuted
                return {"": torch.cat([_plain_rows(key, raw, shape) for (key, raw), shape in
                                       zip(raws, t.dense_shapes, strict=True)]).to(act_dtype)}
            (key, raw), = raws
            return {"": dequantize_dense(key.split(".")[0], raw, t.dense_shapes[0]).to(act_dtype)}
        projections = [(key.split(".")[0], raw, int(key.split(".")[1])) for key, raw in raws]
        return convert_gguf(meta, projections, t.dense_shapes, act_dtype, t.name)

    def signature(self) -> tuple[tuple[str, int, int, int], ...]:
        return source_signature(self.model_dir, self.files)

    def _plan(self) -> list[FusedTensor]:
        """The model code's tensors: q/k/v and gate/up fused (Phi-3 ships them fused), each expert's gate/up fused,
        Mixtral's ``block_sparse_moe`` names mapped onto ``mlp``."""
        c = self.config
        plan = [self._fuse("model.embed_tokens.weight", ["model.embed_tokens.weight"])]
        norms = ["input_layernorm", "post_attention_layernorm"]
        if c.family == "gemma":
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            plan += [self._fuse(p + f"{n}.weight", [p + f"{n}.weight"]) for n in norms]
            plan += self._plan_attention(attn)
            plan += self._plan_moe(p) if c.is_moe_layer[i] else self._plan_mlp(p + "mlp.")
        plan.append(self._fuse("model.norm.weight", ["model.norm.weight"]))
        if not c.tie_word_embeddings:
            plan.append(self._fuse("lm_head.weight", ["lm_head.weight"]))
        return plan

    def _plan_attention(self, attn: str) -> list[FusedTensor]:
        c = self.config
        fused = attn + "qkv_proj.weight" in self.sources  # Phi-3
        plan = [self._fuse(attn + "qkv_proj.weight",
                           [attn + "qkv_proj.weight"] if fused else [attn + f"{x}_proj.weight" for x in "qkv"])]
        if c.qkv_bias:
            plan.append(self._fuse(attn + "qkv_proj.bias",
                                   [attn + "qkv_proj.bias"] if fused else [attn + f"{x}_proj.bias" for x in "qkv"]))
        plan.append(self._fuse(attn + "o_proj.weight", [attn + "o_proj.weight"]))
        if c.o_bias:
            plan.append(self._fuse(attn + "o_proj.bias", [attn + "o_proj.bias"]))
        if c.qk_norm:
            plan += [self._fuse(attn + f"{x}_norm.weight", [attn + f"{x}_norm.weight"]) for x in "qk"]
        return plan

    def _plan_mlp(self, mlp: str) -> list[FusedTensor]:
        fused = mlp + "gate_up_proj.weight" in self.sources  # Phi-3
        parts = [mlp + "gate_up_proj.weight"] if fused else [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
        plan = [self._fuse(mlp + "gate_up_proj.weight", parts),
                self._fuse(mlp + "down_proj.weight", [mlp + "down_proj.weight"])]
        if self.config.mlp_bias:
            plan.append(self._fuse(mlp + "gate_up_proj.bias", [mlp + "gate_proj.bias", mlp + "up_proj.bias"]))
            plan.append(self._fuse(mlp + "down_proj.bias", [mlp + "down_proj.bias"]))
        return plan

    def _plan_moe(self, p: str) -> list[FusedTensor]:
        """Router ``mlp.gate`` and per expert ``mlp.experts.E.gate_up_proj`` / ``down_proj`` (Mixtral: w1 gate,
        w3 up, w2 down under ``block_sparse_moe``)."""
        mixtral = self.config.architecture == "MixtralForCausalLM"
        src = p + ("block_sparse_moe." if mixtral else "mlp.")
        dst = p + "mlp."
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        plan = [self._fuse(dst + "gate.weight", [src + "gate.weight"])]
        for e in range(self.config.num_experts):
            s, d = f"{src}experts.{e}.", f"{dst}experts.{e}."
            plan.append(self._fuse(d + "gate_up_proj.weight", [s + f"{names[0]}.weight", s + f"{names[1]}.weight"]))
            plan.append(self._fuse(d + "down_proj.weight", [s + f"{names[2]}.weight"]))
        return plan


def _role_views(t: FusedTensor, staging: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """A pre-quantized tensor's staging bytes as one {role suffix: tensor} per projection (views where aligned)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in t.dense_shapes]
    off = 0
    for part, role in zip(t.parts, t.roles, strict=True):
        index, suffix = role.split(".", 1)
        chunk = staging[off:off + part.nbytes]
        if off % 8:  # parts lie back to back: one after an odd-sized part may sit misaligned for its dtype
            chunk = chunk.clone()
        out[int(index)][suffix] = chunk.view(part.dtype).view(part.shape)
        off += part.nbytes
    return out


def read_into(part: SourceTensor, dest: memoryview, on_bytes: Callable[[bytes | memoryview], None] | None = None,
              ) -> None:
    """Read one source tensor's bytes from its file straight into ``dest`` (exactly ``part.nbytes`` long)."""
    fd = os.open(part.file, os.O_RDONLY)
    try:
        # the whole range asynchronously now: the disk streams while earlier chunks are hashed and packed
        os.posix_fadvise(fd, part.offset, part.nbytes, os.POSIX_FADV_WILLNEED)
        done = 0
        while done < part.nbytes:
            n = os.preadv(fd, [dest[done:min(done + _READ_CHUNK, part.nbytes)]], part.offset + done)
            if n <= 0:
                raise OSError(f"{part.file}: short read at {part.offset + done}")
            if on_bytes is not None:
                on_bytes(dest[done:done + n])
            done += n
    finally:
        os.close(fd)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage (no copy)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.dtype != torch.uint8 else \
        memoryview(t.numpy()).cast("B")


def tensors_from_buffer(flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views (no copy) of every tensor in a safetensors file held in a uint8 buffer, e.g. a read-only mapping."""
    raw = bytes(flat[:8].numpy())
    (n,) = struct.unpack("<Q", raw)
    if n > flat.numel() - 8:
        raise ValueError("not a safetensors buffer (header size)")
    header = json.loads(bytes(flat[8:8 + n].numpy()))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        if base + end > flat.numel():
            raise ValueError(f"tensor {name!r} extends past the buffer")
        out[name] = flat[base + begin:base + end].view(dtype).view(tuple(info["shape"]))
    return out


def _plain_rows(key: str, raw: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A plain GGUF projection ("TYPE.heads" and its bytes) as its values [N, K], Q/K rows un-permuted."""
    type_name, heads = key.split(".")[0], int(key.split(".")[1])
    values = raw.view(PLAIN_TYPES[type_name]).view(shape)
    return unpermute_rows(values, heads) if heads else values


def _fused_name(gguf_hf_name: str) -> str:
    """The fused weight a GGUF tensor (by its Hugging Face name) goes into: q/k/v -> qkv_proj, gate/up -> gate_up."""
    for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
        for part in parts:
            if gguf_hf_name.endswith(f".{part}.weight"):
                return gguf_hf_name.replace(f".{part}.weight", f".{fused}.weight")
    return gguf_hf_name
