"""llama.cpp GGUF files read directly: the model config from the metadata, each tensor's raw blocks decoded here
(never through transformers' dequantization) into the same (codes, scale, offset) form as the other pre-quantized
formats, so keepwarm.weights.convert stores them in the arena's int4 / int8 layouts exactly.

Rules:
- The container (header, metadata, tensor table) is parsed by the `gguf` package; the blocks are decoded here.
- Supported tensor types and the layout each becomes: docs/quantization.md, "Support matrix" and "GGUF blocks"
  (F32 / F16 / BF16 plain; Q4_0 / Q4_1 as int4 groups of 32; Q4_K, Q5_K, Q8_0, Q6_K as int8 groups; a fused weight
  of mixed types as int8 groups of the smallest group size). Anything else (Q2_K, IQ*, a type the package does not
  know, a truncated file) is refused in one line naming the tensor and its type.
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

# ggml type name -> (bits of the stored code, values per block, bytes per block, values per scale)
QUANT_TYPES: dict[str, tuple[int, int, int, int]] = {
    "Q4_0": (4, 32, 18, 32), "Q4_1": (4, 32, 20, 32), "Q4_K": (4, 256, 144, 32),
    "Q8_0": (8, 32, 34, 32), "Q5_K": (8, 256, 176, 32), "Q6_K": (8, 256, 210, 16),
}
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


def _k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 8 sub-block 6-bit scales and mins packed in 12 bytes ([..., 12] -> two [..., 8])."""
    sc = sc.to(torch.int64)
    lo_s, lo_m = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    hi_s = (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)
    hi_m = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return torch.cat((lo_s, hi_s), -1), torch.cat((lo_m, hi_m), -1)


def decode(type_name: str, raw: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """Codes [N, K] (int64, unsigned), scale and offset [N, K/gs] (float32): w = code * scale + offset."""
    n, k = shape
    _, per_block, block_bytes, _ = QUANT_TYPES[type_name]
    b = raw.reshape(n, k // per_block, block_bytes).to(torch.int64)
    if type_name in ("Q4_0", "Q4_1"):
        d = _f16(raw.reshape(n, -1, block_bytes)[..., 0:2])
        head = 2 if type_name == "Q4_0" else 4
        qs = b[..., head:head + 16]
        codes = torch.cat((qs & 15, qs >> 4), -1)  # low nibbles are values 0..15, high ones 16..31
        offset = -8.0 * d if type_name == "Q4_0" else _f16(raw.reshape(n, -1, block_bytes)[..., 2:4])
        return codes.reshape(n, k), d, offset
    if type_name == "Q8_0":
        d = _f16(raw.reshape(n, -1, block_bytes)[..., 0:2])
        q = raw.reshape(n, -1, block_bytes)[..., 2:].contiguous().view(torch.int8).to(torch.int64)
        return (q + 128).reshape(n, k), d, -128.0 * d
    r8 = raw.reshape(n, -1, block_bytes)
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(r8[..., 0:2])[..., None], _f16(r8[..., 2:4])[..., None]
        sc, mn = _k_scales(b[..., 4:16])
        if type_name == "Q4_K":
            qs = b[..., 16:144].reshape(n, -1, 4, 32)  # 4 chunks of 64 values: low nibbles, then high
            codes = torch.stack((qs & 15, qs >> 4), 3)
        else:
            qh, qs = b[..., 16:48], b[..., 48:176].reshape(n, -1, 4, 32)
            bits = torch.stack([(qh >> i) & 1 for i in range(8)], 2).reshape(n, -1, 4, 2, 32)
            codes = torch.stack((qs & 15, qs >> 4), 3) + (bits << 4)
        return codes.reshape(n, k), (d * sc).reshape(n, -1), (-dmin * mn).reshape(n, -1)
    # Q6_K: two halves of 128 values; ql 64 bytes + qh 32 bytes per half; int8 scales per 16 values.
    ql, qh = b[..., 0:128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)
    sc = r8[..., 192:208].contiguous().view(torch.int8).float()
    d = _f16(r8[..., 208:210])[..., None]
    quarters = [(ql[..., :32] & 15) | ((qh & 3) << 4), (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
                (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]
    codes = torch.stack(quarters, 3).reshape(n, k)
    scale = (d * sc).reshape(n, -1)
    return codes, scale, -32.0 * scale


def dequantize_dense(type_name: str, raw: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The dense float32 values (for the token embedding, which is looked up, not multiplied)."""
    codes, scale, offset = decode(type_name, raw, shape)
    gs = QUANT_TYPES[type_name][3]
    n, k = shape
    return (codes.float().view(n, k // gs, gs) * scale[..., None] + offset[..., None]).reshape(n, k)
