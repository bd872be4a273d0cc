"""llama.cpp GGUF files read directly: the model config from the metadata, each tensor's raw blocks decoded here, in
torch, into (codes, scale, offset) with code * scale + offset equal to the `gguf` package's float32 dequantization
bit for bit, so keepwarm.weights.convert stores them in the arena's int4 / int8 layouts exactly.

Rules:
- The container (header, metadata, tensor table) is parsed by the `gguf` package; the blocks are decoded here.
- Supported tensor types and the layout each becomes: docs/quantization.md, "Support matrix" and "GGUF blocks"
  (F32 / F16 / BF16 plain; Q4_0 / Q4_1 int4 groups of 32; Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS int8 groups,
  codes within int8 as they are (IQ4: the table value); mixed types fused: int8 groups of the smallest group size).
  Anything else (IQ1 / IQ2 / IQ3, TQ*, MXFP4, an unknown type, a truncated file) is refused in one line naming the
  tensor and its type.
- llama.cpp's converter permutes the rows of Q and K for its rotary layout; they are permuted back (whole rows, so
  the blocks stay intact), as transformers does.
- A quantized token embedding (not a matmul) is decoded to dense values in the activation dtype (exact in float32).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from keepwarm.formats.errors import QuantizationError

# ggml type name -> (bits of a code in the file, values per block, bytes per block, values per scale)
QUANT_TYPES: dict[str, tuple[int, int, int, int]] = {
    "Q4_0": (4, 32, 18, 32), "Q4_1": (4, 32, 20, 32), "Q5_0": (5, 32, 22, 32), "Q5_1": (5, 32, 24, 32),
    "Q8_0": (8, 32, 34, 32), "Q2_K": (2, 256, 84, 16), "Q3_K": (3, 256, 110, 16), "Q4_K": (4, 256, 144, 32),
    "Q5_K": (5, 256, 176, 32), "Q6_K": (6, 256, 210, 16), "IQ4_NL": (4, 32, 18, 32), "IQ4_XS": (4, 256, 136, 32),
}
# IQ4_NL / IQ4_XS: a 4-bit code indexes this table (llama.cpp's kvalues_iq4nl); the value is the stored int8 code.
IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                          dtype=torch.int16)
PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True)
class GGUFTensor:
    name: str  # the Hugging Face name (model.layers.0.self_attn.q_proj.weight)
    gguf_name: str
    type_name: str
    shape: tuple[int, ...]  # torch order: [N, K]
    offset: int  # absolute byte offset in the file
    nbytes: int


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf") and Path(path).is_file()


def _reader(path: Path) -> Any:
    import gguf  # deferred: the gguf package costs ~0.2 s and only a .gguf model needs it

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, OSError) as e:
        size = path.stat().st_size if path.exists() else 0
        raise QuantizationError(f"{path.name} is not a complete, readable GGUF file ({size} bytes; truncated or "
                                f"an unknown tensor type?): {str(e).splitlines()[0]}") from None


def _field(r: Any, key: str, default: Any = None) -> Any:
    f = r.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """The config.json-equivalent dict and the tensors (Hugging Face names) of a GGUF file."""
    r = _reader(path)
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise QuantizationError(f"{path.name}: general.architecture = {arch!r} is not supported (only llama)")
    tensors: dict[str, GGUFTensor] = {}
    for t in r.tensors:
        tname = t.tensor_type.name
        if tname not in QUANT_TYPES and tname not in PLAIN_TYPES:
            raise QuantizationError(f"{path.name}: tensor {t.name} has GGUF type {tname}, which is not supported "
                                    f"(supported: {', '.join([*PLAIN_TYPES, *QUANT_TYPES])})")
        hf = _hf_name(t.name)
        if hf is None:
            raise QuantizationError(f"{path.name}: unexpected tensor {t.name}")
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        tensors[hf] = GGUFTensor(hf, t.name, tname, shape, int(t.data_offset), int(t.n_bytes))
    size = path.stat().st_size
    end = max(t.offset + t.nbytes for t in tensors.values())
    if end > size:
        raise QuantizationError(f"{path.name} is truncated: tensors end at byte {end}, the file has {size}")
    heads = int(_field(r, "llama.attention.head_count"))
    hidden = int(_field(r, "llama.embedding_length"))
    tokens = r.fields.get("tokenizer.ggml.tokens")
    vocab = int(_field(r, "llama.vocab_size") or (len(tokens.data) if tokens is not None else 0))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": int(_field(r, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(r, "llama.block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(_field(r, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(r, "llama.rope.dimension_count", hidden // heads)),
        "vocab_size": vocab, "rms_norm_eps": float(_field(r, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(r, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(r, "llama.context_length", 2048)),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
        "dtype": "bfloat16",
    }
    return config, tensors


def gguf_config_json(path: Path) -> str:
    return json.dumps(read_gguf(path)[0], indent=1, sort_keys=True)


def _hf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    m = _BLK.fullmatch(name)
    if m and m.group(2) in _NAMES:
        return f"model.layers.{m.group(1)}.{_NAMES[m.group(2)]}.weight"
    return None


# ---------------------------------------------------------------------------------------------- decoding
def unpermute_rows(raw: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation on a [N, row bytes] tensor (whole rows move)."""
    # llama.cpp stored row (h, j, half) at (h, half, j); read each head's rows back as (j, half).
    n = raw.shape[0]
    return raw.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(raw.shape)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 from [..., 2] bytes, as float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., m] bytes -> [..., 2m] 4-bit values: the low nibbles first, then the high ones (llama.cpp's order)."""
    return torch.cat((qs & 15, qs >> 4), -1)


def _bit_planes(x: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """[..., m] -> [..., count, m]: field i (``bits`` wide, lowest first) of every byte in row i."""
    return torch.stack([(x >> (bits * i)) & ((1 << bits) - 1) for i in range(count)], -2)


def _k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 8 sub-block 6-bit scales and mins packed in 12 bytes ([..., 12] -> two [..., 8])."""
    lo_s, lo_m = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    hi_s = (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)
    hi_m = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return torch.cat((lo_s, hi_s), -1), torch.cat((lo_m, hi_m), -1)


Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes [n, B, values], scale and offset [n, B, subs]


def _legacy(t: str, b: torch.Tensor, r8: torch.Tensor) -> Decoded:
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL: one float16 scale (and min) per 32 values."""
    d = _f16(r8[..., 0:2])[..., None]
    zero = torch.zeros_like(d)
    if t == "Q8_0":
        return r8[..., 2:].contiguous().view(torch.int8).to(torch.int16), d, zero
    if t == "IQ4_NL":
        return IQ4_VALUES[_nibbles(b[..., 2:]).int()], d, zero
    if t in ("Q4_0", "Q4_1"):  # unsigned codes: they become torch's int4 groups
        head = 2 if t == "Q4_0" else 4
        return _nibbles(b[..., head:]), d, -8.0 * d if t == "Q4_0" else _f16(r8[..., 2:4])[..., None]
    head = 2 if t == "Q5_0" else 4
    qh = _bit_planes(b[..., head:head + 4], 1, 8).transpose(-1, -2).flatten(-2)  # the uint32: bit j is value j
    codes = _nibbles(b[..., head + 4:]) | (qh << 4)
    if t == "Q5_0":
        return codes - 16, d, zero
    return codes, d, _f16(r8[..., 2:4])[..., None]


def _q2_k_q3_k(t: str, b: torch.Tensor, r8: torch.Tensor) -> Decoded:
    """Q2_K (w = d*sc*q - dmin*m, 4-bit sc and m) and Q3_K (w = d*(sc - 32)*(low - 4 + 4*hbit), 6-bit sc): 16 sub-blocks
    of 16; the 2-bit codes fill 32-byte quarters of a half at shifts 0, 2, 4, 6."""
    n, nb = b.shape[:2]
    qs = b[..., 16:80] if t == "Q2_K" else b[..., 32:96]
    low = _bit_planes(qs.reshape(n, nb, 2, 32), 2, 4).reshape(n, nb, 256)
    if t == "Q2_K":
        d, dmin, sc = _f16(r8[..., 80:82])[..., None], _f16(r8[..., 82:84])[..., None], b[..., 0:16]
        return low, d * (sc & 15), -(dmin * (sc >> 4))
    high = _bit_planes(b[..., 0:32], 1, 8).reshape(n, nb, 256)  # bit i of byte j is value 32 i + j
    sc_lo = _nibbles(b[..., 96:104])  # scale i: low nibble of byte i (i < 8), high nibble of byte i - 8
    sc_hi = _bit_planes(b[..., 104:108], 2, 4).flatten(-2)  # scale 4 s + j: bits 2s..2s+1 of byte 8 + j
    scale = (sc_lo | (sc_hi << 4)) - 32
    return low - 4 + 4 * high, _f16(r8[..., 108:110])[..., None] * scale, torch.zeros(n, nb, 16)


def _k_quant(t: str, b: torch.Tensor, r8: torch.Tensor) -> Decoded:
    """Q4_K / Q5_K (w = d*sc*q - dmin*m, 6-bit sc and m per 32 values), Q6_K (w = d*sc*(q - 32), int8 sc per 16),
    IQ4_XS (w = d*(sc - 32)*IQ4_VALUES[q], 6-bit sc per 32)."""
    n, nb = b.shape[:2]
    if t in ("Q4_K", "Q5_K"):
        d, dmin = _f16(r8[..., 0:2])[..., None], _f16(r8[..., 2:4])[..., None]
        sc, mn = _k_scales(b[..., 4:16])
        codes = _nibbles(b[..., -128:].reshape(n, nb, 4, 32))  # 4 chunks of 64 values: low nibbles, then high
        if t == "Q5_K":
            codes = codes + (_bit_planes(b[..., 16:48], 1, 8).reshape(n, nb, 4, 64) << 4)
        return codes.reshape(n, nb, 256), d * sc, -(dmin * mn)
    if t == "IQ4_XS":
        sc_lo = _bit_planes(b[..., 4:8], 4, 2).transpose(-1, -2).flatten(-2)  # scale 2i, 2i+1: byte i's nibbles
        sc_hi = _bit_planes(b[..., 2:4], 2, 4).transpose(-1, -2).flatten(-2)  # a uint16: 2 bits each, lowest first
        scale = (sc_lo | (sc_hi << 4)) - 32
        codes = IQ4_VALUES[_nibbles(b[..., 8:].reshape(n, nb, 8, 16)).int()]
        return codes.reshape(n, nb, 256), _f16(r8[..., 0:2])[..., None] * scale, torch.zeros(n, nb, 8)
    # Q6_K: two halves of 128 values; ql 64 bytes + qh 32 bytes per half; int8 scales per 16 values.
    ql, qh = b[..., 0:128].reshape(n, nb, 2, 64), b[..., 128:192].reshape(n, nb, 2, 32)
    sc = r8[..., 192:208].contiguous().view(torch.int8).float()
    hi = _bit_planes(qh, 2, 4) << 4
    low = torch.stack((ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4), 3)
    return (low | hi).reshape(n, nb, 256) - 32, _f16(r8[..., 208:210])[..., None] * sc, torch.zeros(n, nb, 16)


_DECODERS = {"Q4_0": _legacy, "Q4_1": _legacy, "Q5_0": _legacy, "Q5_1": _legacy, "Q8_0": _legacy, "IQ4_NL": _legacy,
             "Q2_K": _q2_k_q3_k, "Q3_K": _q2_k_q3_k, "Q4_K": _k_quant, "Q5_K": _k_quant, "Q6_K": _k_quant,
             "IQ4_XS": _k_quant}


def decode(type_name: str, raw: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """Codes [N, K] (int16: 0..15 for Q4_0 / Q4_1, else within int8), scale and offset [N, K/gs] (float32):
    w = code * scale + offset, bit for bit as llama.cpp's dequantization in float32."""
    n, k = shape
    _, per_block, block_bytes, _ = QUANT_TYPES[type_name]
    r8 = raw.reshape(n, k // per_block, block_bytes)
    codes, scale, offset = _DECODERS[type_name](type_name, r8.to(torch.int16), r8)
    return codes.reshape(n, k), scale.reshape(n, -1).float(), offset.expand_as(scale).reshape(n, -1).float()


def dequantize_dense(type_name: str, raw: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The dense float32 values (for the token embedding, which is looked up, not multiplied)."""
    codes, scale, offset = decode(type_name, raw, shape)
    gs = QUANT_TYPES[type_name][3]
    n, k = shape
    return (codes.float().view(n, k // gs, gs) * scale[..., None] + offset[..., None]).reshape(n, k)
