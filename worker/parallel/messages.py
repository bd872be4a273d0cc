"""The typed messages rank 0 broadcasts to the other tensor-parallel ranks, in keepwarm.formats.wire's frames
(msgpack maps, never pickle).

Every message is a map with ``v`` (``VERSION``) and ``kind``; each kind is a frozen dataclass, checked on arrival by
a strict ``CODEC`` (a missing, unknown or mistyped field is a ``ProtocolError`` naming it). Tensors travel as
``[shape, raw little-endian bytes]`` with the dtype fixed by the field, so a step costs no Python objects per token;
a LoRA adapter's weights travel as ``[layer, module, dtype A, shape A, bytes A, dtype B, shape B, bytes B]`` lists,
float dtypes only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from keepwarm.formats.wire import Codec, FieldCodec, ProtocolError

VERSION = 2


@dataclass(frozen=True)
class Setup:
    """What every rank loads: the engine's model settings (rank 0's ``EngineConfig``, resolved)."""

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

    num_blocks: int
    block_size: int
    kv_dtype: str  # torch dtype name without "torch."


@dataclass(frozen=True)
class Step:
    """One step's flattened batch, as the model runner consumes it (see ``ModelRunner.host_inputs``)."""

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

    slot: int
    name: str
    digest: str
    rank: int
    scaling: float
    weights: list  # [[layer, module, dtype A, shape A, bytes A, dtype B, shape B, bytes B], ...]


@dataclass(frozen=True)
class Shutdown:
    """Rank 0 is closing: the rank leaves the group and exits."""


@dataclass(frozen=True)
class Ping:
    """Sent by rank 0 when the control channel has been quiet for a while: keeps the ranks' waits bounded."""


Message = Setup | CacheSpec | Step | LoRASlot | Shutdown | Ping
_TENSOR_DTYPES = {"input_ids": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64,
                  "block_tables": torch.int32, "seq_lens": torch.int32, "query_start_loc": torch.int32,
                  "token_rows": torch.int64, "lora_slots": torch.int64}
_LORA_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _to_wire(dtype: torch.dtype, t: torch.Tensor) -> list:
    t = t.to(dtype).contiguous()
    return [list(t.shape), t.numpy().tobytes()]


def _from_wire(dtype: torch.dtype, value: Any) -> torch.Tensor:
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], bytes)):
        raise ValueError("expected [shape, bytes]")
    shape, raw = value
    try:
        t = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return t.view(*shape)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{len(raw)} bytes do not make shape {shape}") from None


CODEC = Codec("rank", VERSION, {"setup": Setup, "cache": CacheSpec, "step": Step, "lora_slot": LoRASlot,
                                "shutdown": Shutdown, "ping": Ping}, tag="kind", strict=True, max_bytes=None,
              fields={name: FieldCodec(partial(_to_wire, dtype), partial(_from_wire, dtype))
                      for name, dtype in _TENSOR_DTYPES.items()})


def encode(msg: Message) -> bytes:
    return CODEC.encode(msg)


def decode(data: bytes) -> Message:
    return CODEC.decode(data)


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
    """The inverse of :func:`lora_weights`; a malformed entry raises a ``ProtocolError`` naming it."""
    out = {}
    for i, row in enumerate(weights):
        if not (isinstance(row, list) and len(row) == 8 and isinstance(row[0], int) and isinstance(row[1], str)
                and row[2] in _LORA_DTYPES and row[5] in _LORA_DTYPES):
            raise ProtocolError("bad_message", f"lora_slot: weights[{i}] is not [layer, module, then dtype, "
                                               "shape and bytes of A and of B] with float dtypes")
        pair = []
        for dtype, shape, raw in (row[2:5], row[5:8]):
            try:
                flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                pair.append(flat.view(_LORA_DTYPES[dtype]).view(*shape))
            except (RuntimeError, TypeError, ValueError):
                raise ProtocolError("bad_message", f"lora_slot: weights[{i}] ({row[1]} of layer {row[0]}): bytes "
                                                   f"do not make shape {shape}") from None
        out[(row[0], row[1])] = (pair[0], pair[1])
    return out
