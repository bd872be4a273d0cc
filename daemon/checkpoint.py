"""Read a Hugging Face checkpoint's safetensors and plan the fused tensors the model code uses.

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

from keepwarm.formats.model_config import ModelConfig, ModelConfigError, load_model_config

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

# Reads this large keep the kernel's readahead busy without holding big Python buffers.
_READ_CHUNK = 64 << 20


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
    """A tensor the model code uses, made of source tensors concatenated along dim 0 (one part if unfused)."""

    name: str
    parts: tuple[SourceTensor, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]

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
    """A model directory: its config, its source tensors, and the fused tensors the model code needs."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir).resolve() if Path(model_dir).exists() else Path(model_dir)
        self.config: ModelConfig = load_model_config(self.model_dir)
        self.files = _safetensors_files(self.model_dir)
        self.sources: dict[str, SourceTensor] = {}
        for f in self.files:
            self.sources.update(read_safetensors_header(f))
        self.tensors: list[FusedTensor] = self._plan()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def _get(self, name: str) -> SourceTensor:
        try:
            return self.sources[name]
        except KeyError:
            raise ModelConfigError(f"{self.model_dir}: checkpoint lacks tensor {name!r}") from None

    def _fuse(self, name: str, part_names: list[str]) -> FusedTensor:
        parts = tuple(self._get(p) for p in part_names)
        dtypes = {p.dtype for p in parts}
        if len(dtypes) != 1:
            raise ModelConfigError(f"{self.model_dir}: parts of {name} have mixed dtypes")
        rest = {p.shape[1:] for p in parts}
        if len(rest) != 1:
            raise ModelConfigError(f"{self.model_dir}: parts of {name} have mismatched shapes")
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        return FusedTensor(name, parts, parts[0].dtype, shape)

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


def read_into(part: SourceTensor, dest: memoryview, on_bytes: Callable[[bytes | memoryview], None] | None = None,
              ) -> None:
    """Read one source tensor's bytes from its file straight into ``dest`` (exactly ``part.nbytes`` long)."""
    fd = os.open(part.file, os.O_RDONLY)
    try:
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
