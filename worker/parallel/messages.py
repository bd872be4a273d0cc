"""The typed messages rank 0 broadcasts to the other tensor-parallel ranks: msgpack maps, never pickle.

Every message is a map with ``v`` (``VERSION``) and ``kind``; each kind is a frozen dataclass whose fields are
checked on arrival (a wrong name or type raises :class:`MessageError` naming it). Tensors travel as their raw
little-endian bytes with the dtype fixed by the field, so a step costs no Python objects per token; a LoRA
adapter's weights travel as ``[layer, module, dtype A, shape A, bytes A, dtype B, shape B, bytes B]`` lists, float
dtypes only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import torch

VERSION = 2


class MessageError(ValueError):
    """A message that does not decode to one of the kinds below; one line naming the field."""


@dataclass(frozen=True)
class Setup:
    """What every rank loads: the engine's model settings (rank 0's ``EngineConfig``, resolved)."""

    kind: ClassVar[str] = "setup"
    model: str
    dtype: str
    quantization: str
    device: str  # "cpu" or "cuda" (a rank on CUDA takes the device of its LOCAL_RANK)
    max_position: int
    daemon: bool | str
    runtime_dir: str | None
    fingerprint: str | None
    threads: int
    seed: int
    max_loras: int  # 0: LoRA off
    max_lora_rank: int
    model_dtype: str  # rank 0's resolved model dtype: the LoRA buffers', the pipeline's activations'
    pp_size: int  # pipeline stages (rank r is stage r; 1: tensor parallelism only)


@dataclass(frozen=True)
class CacheSpec:
    """The KV cache every rank allocates for its own KV heads (rank 0 sizes it)."""

    kind: ClassVar[str] = "cache"
    num_blocks: int
    block_size: int
    kv_dtype: str  # torch dtype name without "torch."


@dataclass(frozen=True)
class Step:
    """One step's flattened batch, as the model runner consumes it (see ``ModelRunner.host_inputs``)."""

    kind: ClassVar[str] = "step"
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, rotary positions
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, W] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    max_query_len: int
    token_rows: torch.Tensor  # [R] int64, the rows whose logits are gathered
    lora_slots: torch.Tensor  # [S] int64, each sequence's LoRA slot (-1: base model); empty: no LoRA this step


@dataclass(frozen=True)
class LoRASlot:
    """Rank 0 wrote ``slot``: every rank puts the same adapter there (its own part of it) before the next step.
    ``name`` "" and no weights: the slot is cleared."""

    kind: ClassVar[str] = "lora_slot"
    slot: int
    name: str
    digest: str
    rank: int
    scaling: float
    weights: list  # [[layer, module, dtype A, shape A, bytes A, dtype B, shape B, bytes B], ...]


@dataclass(frozen=True)
class Shutdown:
    kind: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class Ping:
    """Sent by rank 0 when the control channel has been quiet for a while: keeps the ranks' waits bounded."""

    kind: ClassVar[str] = "ping"


Message = Setup | CacheSpec | Step | LoRASlot | Shutdown | Ping
_KINDS: dict[str, Any] = {c.kind: c for c in (Setup, CacheSpec, Step, LoRASlot, Shutdown, Ping)}
_TENSOR_DTYPES = {"input_ids": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64,
                  "block_tables": torch.int32, "seq_lens": torch.int32, "query_start_loc": torch.int32,
                  "token_rows": torch.int64, "lora_slots": torch.int64}
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "str": str, "float": (int, float), "list": list}
_LORA_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def encode(msg: Message) -> bytes:
    body: dict[str, Any] = {"v": VERSION, "kind": msg.kind}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if isinstance(value, torch.Tensor):
            t = value.to(_TENSOR_DTYPES[f.name]).contiguous()
            body[f.name] = [list(t.shape), t.numpy().tobytes()]
        else:
            body[f.name] = value
    return msgpack.packb(body, use_bin_type=True)


def _tensor(name: str, value: Any) -> torch.Tensor:
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], bytes)):
        raise MessageError(f"field {name!r}: expected [shape, bytes]")
    shape, raw = value
    dtype = _TENSOR_DTYPES[name]
    t = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    try:
        return t.view(*shape)
    except (RuntimeError, TypeError):
        raise MessageError(f"field {name!r}: {len(raw)} bytes do not make shape {shape}") from None


def decode(data: bytes) -> Message:
    try:
        body = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise MessageError(f"not a msgpack message: {e}") from None
    if not isinstance(body, dict) or body.get("v") != VERSION:
        raise MessageError(f"message version {body.get('v') if isinstance(body, dict) else None!r}, "
                           f"expected {VERSION}")
    cls = _KINDS.get(body.get("kind", ""))
    if cls is None:
        raise MessageError(f"unknown message kind {body.get('kind')!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    given = set(body) - {"v", "kind"}
    if given != names:
        raise MessageError(f"{cls.kind}: fields {sorted(given ^ names)} missing or unknown")
    values = {n: _tensor(n, body[n]) if n in _TENSOR_DTYPES else body[n] for n in names}
    for f in dataclasses.fields(cls):
        want = _FIELD_TYPES.get(str(f.type))
        if want is not None and not isinstance(values[f.name], want):
            raise MessageError(f"{cls.kind}: field {f.name!r} must be {f.type}, got {values[f.name]!r}")
    return cls(**values)


def lora_weights(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> list:
    """An adapter's (layer, module) -> (A, B) as a ``LoRASlot``'s ``weights`` field."""
    out = []
    for (layer, module), pair in sorted(weights.items()):
        row: list[Any] = [layer, module]
        for t in pair:
            t = t.detach().to("cpu").contiguous()
            row += [str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes()]
        out.append(row)
    return out


def lora_tensors(weights: list) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """The inverse of :func:`lora_weights`; a malformed entry raises :class:`MessageError` naming it."""
    out = {}
    for i, row in enumerate(weights):
        if not (isinstance(row, list) and len(row) == 8 and isinstance(row[0], int) and isinstance(row[1], str)
                and row[2] in _LORA_DTYPES and row[5] in _LORA_DTYPES):
            raise MessageError(f"lora_slot: weights[{i}] is not [layer, module, then dtype, shape and bytes of A "
                               "and of B] with float dtypes")
        pair = []
        for dtype, shape, raw in (row[2:5], row[5:8]):
            try:
                flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                pair.append(flat.view(_LORA_DTYPES[dtype]).view(*shape))
            except (RuntimeError, TypeError, ValueError):
                raise MessageError(f"lora_slot: weights[{i}] ({row[1]} of layer {row[0]}): bytes do not make "
                                   f"shape {shape}") from None
        out[(row[0], row[1])] = (pair[0], pair[1])
    return out
