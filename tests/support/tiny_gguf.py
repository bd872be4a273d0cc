"""A tiny llama written as a GGUF file with the `gguf` package's writer, one GGML type per projection, and valid
random blocks of each type: shared by the GGUF format tests and the quantized kernels' engine checks.

The model: hidden 256, intermediate 512 (K-quants need multiples of 256), 4 heads, 2 KV heads, a 512-token
vocabulary (the tiny llama's tokenizer, copied beside the file by :func:`tiny_gguf_dir`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import torch

from keepwarm.formats.gguf import QUANT_TYPES

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 512
HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
      "ffn_down": "mlp.down_proj"}
# Where each type keeps its float16 scale fields in a block (the rest of a block is any bytes).
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
# float16 scales at their edges: zeros of both signs, the smallest subnormal and normal, the largest finite ones
F16_EDGES = np.array([0.0, -0.0, 2.0 ** -24, -(2.0 ** -14), 65504.0, -65504.0, 1.0, -1.0], dtype=np.float16)


def random_blocks(type_name: str, n: int, k: int, seed: int, edges: bool = False) -> np.ndarray:
    """Valid blocks of `type_name` for an [n, k] weight: random codes and sub-scales, sane float16 scales (a plain
    type: random values, as its bytes). ``edges``: row 0 all 0x00 bytes, row 1 all 0xFF (the sub-scales and codes at
    both ends: Q3_K / IQ4_XS sub-scales -32 and 31), row 2's first scales F16_EDGES."""
    rng = np.random.default_rng(seed)
    if type_name in ("F32", "F16", "BF16"):
        v = rng.normal(0, 0.05, size=(n, k)).astype(np.float32)
        typed = {"F32": v, "F16": v.astype(np.float16), "BF16": (v.view(np.uint32) >> 16).astype(np.uint16)}
        return typed[type_name].view(np.uint8).reshape(n, -1)
    _, per_block, block_bytes, _ = QUANT_TYPES[type_name]
    raw = rng.integers(0, 256, size=(n, k // per_block, block_bytes), dtype=np.uint8)
    if edges:
        raw[0], raw[1] = 0x00, 0xFF
    for pos in F16_FIELDS[type_name]:
        scale = rng.uniform(-0.01, 0.01, size=(n, k // per_block)).astype(np.float16)
        if edges:
            scale[2, :len(F16_EDGES)] = F16_EDGES[:k // per_block]
        raw[..., pos:pos + 2] = scale.view(np.uint8).reshape(n, k // per_block, 2)
    return raw.reshape(n, -1)


def gguf_dense(type_name: str, raw: np.ndarray) -> torch.Tensor:
    """The `gguf` package's own dequantization (numpy, float32): the independent reference."""
    dense = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(dense)).float()


def projection_shape(proj: str) -> tuple[int, int]:
    hd = HIDDEN // HEADS
    return {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * hd, HIDDEN), "attn_v": (KV_HEADS * hd, HIDDEN),
            "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
            "ffn_down": (HIDDEN, INTER)}[proj]


def _header(w: gguf.GGUFWriter, layers: int) -> None:
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_tiny_gguf(path: Path, types: list[dict[str, str]],
                    extra: dict[str, tuple[str, np.ndarray]] | None = None, embed_type: str = "F32",
                    ) -> dict[str, torch.Tensor]:
    """Write the tiny llama, a layer per entry of ``types`` (projection -> GGML type name, every projection of
    :data:`HF`), plus ``extra`` tensors as given; returns its expected dense weights (Hugging Face names and row
    order: Q and K un-permuted by transformers' own GGUF code)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor  # heavy: only where a file is written

    unpermute = LlamaTensorProcessor(config={"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    w = gguf.GGUFWriter(str(path), "llama")
    _header(w, len(types))
    rng = np.random.default_rng(0)
    expected: dict[str, torch.Tensor] = {}
    embed = rng.normal(0, 0.5, size=(VOCAB, HIDDEN)).astype(np.float32)
    if embed_type != "F32":  # quantized token embedding (tied: the head too): random valid blocks of that type
        embed_q = random_blocks(embed_type, VOCAB, HIDDEN, seed=7)
        w.add_tensor("token_embd.weight", embed_q, raw_dtype=gguf.GGMLQuantizationType[embed_type])
        expected["model.embed_tokens.weight"] = gguf_dense(embed_type, embed_q)
    else:
        w.add_tensor("token_embd.weight", embed)
        expected["model.embed_tokens.weight"] = torch.from_numpy(embed)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    expected["model.norm.weight"] = torch.ones(HIDDEN)
    for i, layer in enumerate(types):
        for norm, hf in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            v = rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
            w.add_tensor(f"blk.{i}.{norm}.weight", v)
            expected[f"model.layers.{i}.{hf}.weight"] = torch.from_numpy(v)
        for proj, type_name in layer.items():
            n, k = projection_shape(proj)
            raw = random_blocks(type_name, n, k, seed=100 * i + len(proj))
            qtype = gguf.GGMLQuantizationType[type_name]
            name = f"blk.{i}.{proj}.weight"
            w.add_tensor(name, raw, raw_dtype=qtype)
            dense = unpermute.process(gguf.quants.dequantize(raw, qtype), name).weights
            expected[f"model.layers.{i}.{HF[proj]}.weight"] = torch.from_numpy(np.ascontiguousarray(dense)).float()
    for name, (type_name, raw) in (extra or {}).items():
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def tiny_gguf_dir(out: Path, tiny_llama: str | Path, types: list[dict[str, str]], embed_type: str = "F32",
                  ) -> tuple[Path, dict[str, torch.Tensor]]:
    """``out``/tiny.gguf (:func:`write_tiny_gguf`) with the tiny llama's tokenizer beside it (the same 512-token
    vocabulary); returns the file and its expected dense weights."""
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(tiny_llama).iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out / "tiny.gguf", write_tiny_gguf(out / "tiny.gguf", types, embed_type=embed_type)
