"""GGUF files read without transformers' dequantization: each block type decoded exactly as the `gguf` package's
own (independent) dequantizer does (random blocks, blocks at their fields' extremes, hand-computed values), fused
weights of mixed types stored exactly, tiny llamas written with the `gguf` package's writer (one with the legacy and
plain types, one with Q2_K / Q3_K / Q5_0 / Q5_1 / IQ4_NL / IQ4_XS and a Q3_K embedding) serve the same greedy tokens
as transformers on their dequantized weights, bad files and unsupported types are refused in one line, and the
bundled SmolLM2 is served from its own Q4_1 weights (slow)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from support.daemon import DaemonProc, new_runtime_dir, remove_runtime_dir
from support.tiny_gguf import F16_FIELDS, gguf_dense, random_blocks, write_tiny_gguf

from keepwarm.formats.errors import QuantizationError
from keepwarm.formats.gguf import QUANT_TYPES, decode, dequantize_dense
from keepwarm.kernels.quant import QuantizedWeight
from keepwarm.weights.checkpoint import Checkpoint
from keepwarm.weights.convert import convert_gguf, plan_gguf
from keepwarm.weights.loader import build_arena, plan_arena
from keepwarm.worker.attach import model_tensors


@pytest.mark.parametrize("type_name", sorted(QUANT_TYPES))
def test_block_decoding_equals_the_gguf_package(type_name: str) -> None:
    _, per_block, block_bytes, _ = QUANT_TYPES[type_name]
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]] == (per_block, block_bytes)
    raw = random_blocks(type_name, 8, 2048, seed=len(type_name), edges=True)
    ref = gguf_dense(type_name, raw)
    assert torch.equal(dequantize_dense(type_name, torch.from_numpy(raw), (8, 2048)), ref)
    codes, _, _ = decode(type_name, torch.from_numpy(raw), (8, 2048))
    # the arena stores codes as int8 unchanged (and Q4_0 / Q4_1's as torch's unsigned int4)
    low, high = (0, 15) if type_name in ("Q4_0", "Q4_1") else (-128, 127)
    assert low <= int(codes.min()) and int(codes.max()) <= high
    # llama.cpp's dot products: a quantized embedding row read back is the same row as in a whole-tensor decode
    assert torch.equal(dequantize_dense(type_name, torch.from_numpy(raw[5:6]), (1, 2048)), ref[5:6])


# Every weight of a block of all 0x00 / all 0xFF bytes whose float16 scale (and min) fields are 1.0, by hand from
# llama.cpp's block layouts: e.g. Q3_K 0x00 is sub-scale 0 - 32 times code 0 - 4 (high bit clear) = 128; IQ4_XS 0xFF
# is (63 - 32) * kvalues[15] = 31 * 113; Q6_K 0xFF is int8 scale -1 times 63 - 32; Q5_K 0xFF is 63 * 31 - 63.
BY_HAND = {"Q4_0": (-8, 7), "Q4_1": (1, 16), "Q5_0": (-16, 15), "Q5_1": (1, 32), "Q8_0": (0, -1),
           "Q2_K": (0, 15 * 3 - 15), "Q3_K": (128, 31 * 3), "Q4_K": (0, 63 * 15 - 63), "Q5_K": (0, 63 * 31 - 63),
           "Q6_K": (0, -31), "IQ4_NL": (-127, 113), "IQ4_XS": (-32 * -127, 31 * 113)}


@pytest.mark.parametrize("type_name", sorted(QUANT_TYPES))
def test_extreme_blocks_decode_to_the_values_computed_by_hand(type_name: str) -> None:
    _, per_block, block_bytes, _ = QUANT_TYPES[type_name]
    for fill, want in zip((0x00, 0xFF), BY_HAND[type_name], strict=True):
        raw = np.full((1, block_bytes), fill, dtype=np.uint8)
        for pos in F16_FIELDS[type_name]:
            raw[0, pos:pos + 2] = np.array([1.0], dtype=np.float16).view(np.uint8)
        got = dequantize_dense(type_name, torch.from_numpy(raw), (1, per_block))
        assert torch.equal(got, torch.full((1, per_block), float(want))), (fill, got.unique())
        assert torch.equal(got, gguf_dense(type_name, raw))


# Fused projections of mixed types (llama.cpp's Q4_K_M writes Q4_K beside Q6_K; Q3_K_M, Q3_K beside Q5_K) and the
# layout each pair becomes: int4 only for Q4_0 / Q4_1, else int8 groups of the finer type's group size, their codes
# at 4 bits (int8_group_u4) where every type's are unsigned 4-bit ones (Q4_K, Q2_K).
FUSED = [(("Q4_K", "Q6_K"), "int8_group", 16), (("Q4_K", "Q2_K"), "int8_group_u4", 16),
         (("Q4_K",), "int8_group_u4", 32), (("Q3_K", "Q5_K"), "int8_group", 16), (("Q2_K", "IQ4_XS"), "int8_group", 16),
         (("IQ4_NL", "Q8_0"), "int8_group", 32),
         (("Q5_0", "Q5_1", "Q4_0"), "int8_group", 32), (("Q4_0", "Q4_1"), "int4", 32)]


@pytest.mark.parametrize("types, scheme, group_size", FUSED)
def test_fused_weights_of_mixed_types_convert_exactly(types: tuple[str, ...], scheme: str, group_size: int) -> None:
    shapes = [(64, 512), (32, 512), (48, 512)][:len(types)]
    raws = [random_blocks(t, n, k, seed=i, edges=True) for i, (t, (n, k)) in enumerate(zip(types, shapes, strict=True))]
    meta = plan_gguf(types, shapes, torch.float32, "cpu")
    assert (meta.layout if scheme == "int8_group_u4" else meta.scheme, meta.group_size) == (scheme, group_size)
    assert meta.layout != "int8_group_u4" or scheme == "int8_group_u4", meta
    parts = convert_gguf(meta, [(t, torch.from_numpy(r), 0) for t, r in zip(types, raws, strict=True)], shapes,
                         torch.float32, "fused")
    got = QuantizedWeight.from_parts(meta, parts).dequantize()
    assert torch.equal(got, torch.cat([gguf_dense(t, r) for t, r in zip(types, raws, strict=True)]))


# Tiny llamas with K = 256 / 512 (K-quants need multiples of 256) and a type per projection. "legacy": layer 0 fuses
# Q4_K with Q6_K (stored as int8 groups of 16); in layer 1 Q4_0 and Q4_1 are torch's int4 groups of 32, Q4_K int8
# groups of 4-bit codes (int8_group_u4); layer 2 is plain. "kquant_iq4": the other types, each fused weight a mix,
# and a Q3_K token embedding.
TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q8_0", "ffn_gate": "Q5_K",
     "ffn_up": "Q5_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_1", "ffn_gate": "Q4_1",
     "ffn_up": "Q4_1", "ffn_down": "Q4_K"},
    # plain projections (a BF16 / F16 GGUF, refused before): stored dense, Q and K rows un-permuted
    {"attn_q": "BF16", "attn_k": "BF16", "attn_v": "BF16", "attn_output": "F16", "ffn_gate": "F32",
     "ffn_up": "F32", "ffn_down": "BF16"},
]
NEW_TYPES = [
    {"attn_q": "Q3_K", "attn_k": "Q3_K", "attn_v": "Q5_K", "attn_output": "Q5_0", "ffn_gate": "Q2_K",
     "ffn_up": "Q3_K", "ffn_down": "Q3_K"},
    {"attn_q": "IQ4_NL", "attn_k": "IQ4_NL", "attn_v": "Q8_0", "attn_output": "Q5_1", "ffn_gate": "IQ4_XS",
     "ffn_up": "Q6_K", "ffn_down": "IQ4_XS"},
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "IQ4_XS", "ffn_gate": "Q5_0",
     "ffn_up": "Q5_1", "ffn_down": "Q2_K"},
]
# model -> (its layers' types, the token embedding's type, the (layout, group size) of some fused weights)
MODELS = {
    "legacy": (TYPES, "F32", {"0.self_attn.qkv_proj": ("int8_group", 16), "0.self_attn.o_proj": ("int8_group", 32),
                              "1.self_attn.qkv_proj": ("int4_cpu", 32), "1.mlp.gate_up_proj": ("int4_cpu", 32),
                              "1.mlp.down_proj": ("int8_group_u4", 32)}),
    "kquant_iq4": (NEW_TYPES, "Q3_K", {
        "0.self_attn.qkv_proj": ("int8_group", 16), "0.self_attn.o_proj": ("int8_group", 32),
        "0.mlp.gate_up_proj": ("int8_group", 16), "0.mlp.down_proj": ("int8_group", 16),
        "1.self_attn.qkv_proj": ("int8_group", 32), "1.self_attn.o_proj": ("int8_group", 32),
        "1.mlp.gate_up_proj": ("int8_group", 16), "1.mlp.down_proj": ("int8_group", 32),
        "2.self_attn.qkv_proj": ("int8_group", 16), "2.self_attn.o_proj": ("int8_group", 32),
        "2.mlp.gate_up_proj": ("int8_group", 32), "2.mlp.down_proj": ("int8_group", 16)}),
}

@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory, tiny_llama):
    """name -> (its .gguf file, its expected dense weights): each of MODELS written once for the module, in its own
    directory beside the tokenizer files (the same 512-token vocabulary)."""
    written: dict[str, tuple[Path, dict[str, torch.Tensor]]] = {}

    def get(name: str) -> tuple[Path, dict[str, torch.Tensor]]:
        if name not in written:
            d = tmp_path_factory.mktemp(f"gguf_{name}")
            for f in Path(tiny_llama).iterdir():
                if f.suffix != ".safetensors" and f.name not in ("config.json", "generation_config.json"):
                    shutil.copy(f, d / f.name)
            types, embed_type, _ = MODELS[name]
            written[name] = d / "tiny.gguf", write_tiny_gguf(d / "tiny.gguf", types, embed_type=embed_type)
        return written[name]
    return get


@pytest.fixture(scope="module")
def tiny_gguf(gguf_models) -> tuple[Path, dict[str, torch.Tensor]]:
    return gguf_models("legacy")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_gguf_arena_weights_and_layouts(gguf_models, model) -> None:
    path, expected = gguf_models(model)
    types, _, layouts = MODELS[model]
    ckpt = Checkpoint(path)
    assert ckpt.resolve_quantization("auto") == "gguf"
    _, total = plan_arena(ckpt, "auto", torch.float32)
    flat = torch.empty(total, dtype=torch.uint8)
    got = model_tensors(build_arena(ckpt, "auto", "float32", flat, "cpu"), flat)
    for short, (layout, group_size) in layouts.items():
        meta = got[f"model.layers.{short}.weight"].meta
        assert meta.layout.startswith(layout) and meta.group_size == group_size, (short, meta)
    for i, layer in enumerate(types):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        fused = {a + "qkv_proj.weight": [a + f"{x}_proj.weight" for x in "qkv"],
                 a + "o_proj.weight": [a + "o_proj.weight"],
                 m + "gate_up_proj.weight": [m + "gate_proj.weight", m + "up_proj.weight"],
                 m + "down_proj.weight": [m + "down_proj.weight"]}
        plain = layer["attn_q"] in ("F32", "F16", "BF16")
        for name, parts in fused.items():
            w = got[name]
            dense = w.dequantize() if isinstance(w, QuantizedWeight) else w  # plain: the arena holds the values
            assert isinstance(w, QuantizedWeight) != plain, name
            assert torch.equal(dense, torch.cat([expected[x] for x in parts])), name
    assert torch.equal(got["model.embed_tokens.weight"], expected["model.embed_tokens.weight"])


def _dense_dir(path: Path, expected: dict[str, torch.Tensor], out: Path) -> Path:
    from safetensors.torch import save_file

    out.mkdir()
    for f in path.parent.iterdir():
        if f.suffix != ".gguf":
            shutil.copy(f, out / f.name)
    save_file({k: v.contiguous() for k, v in expected.items()}, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads(Checkpoint(path).config_json)
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("model", sorted(MODELS))
def test_gguf_greedy_tokens_equal_transformers_on_its_dequantized_weights(gguf_models, model, tmp_path) -> None:
    import transformers

    from keepwarm import LLM, SamplingParams

    path, expected = gguf_models(model)
    prompts = [[5, 17, 99, 240, 7], [300, 12, 45]]
    llm = LLM(model=str(path), dtype="float32", daemon=False, max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(_dense_dir(path, expected, tmp_path / "dense"),
                                                           dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    for p, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                          pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref


# ---------------------------------------------------------------------------------------------- bad files
def bad_gguf(case: str, tmp_path: Path, tiny_gguf_path: Path) -> Path:
    out = tmp_path / f"{case}.gguf"
    if case == "truncated":
        data = tiny_gguf_path.read_bytes()
        out.write_bytes(data[:len(data) - 5000])
    elif case.startswith("unsupported_"):  # a type the package knows but keepwarm does not run
        type_name = case.removeprefix("unsupported_")
        _, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
        write_tiny_gguf(out, TYPES, {"blk.0.extra.weight": (type_name, np.zeros((4, block_bytes), dtype=np.uint8))})
    elif case == "plain_and_quantized_fused":  # q in F16 beside k and v quantized: one fused weight, two layouts
        write_tiny_gguf(out, [{**TYPES[0], "attn_q": "F16"}])
    else:  # a tensor type number no GGUF version defines
        write_tiny_gguf(out, TYPES)
        data = bytearray(out.read_bytes())
        name = b"blk.1.ffn_down.weight"
        at = data.index(name) + len(name) + 4 + 2 * 8  # after the name: n_dims (u32), two dims (u64 each)
        data[at:at + 4] = (250).to_bytes(4, "little")
        out.write_bytes(bytes(data))
    return out


GGUF_BAD = [
    ("truncated", "is not a complete, readable GGUF file"),
    ("unsupported_IQ2_XXS", "tensor blk.0.extra.weight has GGUF type IQ2_XXS, which is not supported"),
    ("unsupported_IQ3_S", "tensor blk.0.extra.weight has GGUF type IQ3_S, which is not supported"),
    ("unsupported_IQ1_M", "tensor blk.0.extra.weight has GGUF type IQ1_M, which is not supported"),
    ("unsupported_TQ2_0", "tensor blk.0.extra.weight has GGUF type TQ2_0, which is not supported"),
    ("unknown_type", "is not a complete, readable GGUF file"),
    ("plain_and_quantized_fused", "qkv_proj.weight fuses plain (F16) and quantized (Q4_K, Q6_K) projections"),
]


@pytest.mark.parametrize("case, message", GGUF_BAD)
def test_bad_gguf_files_are_refused_in_one_line(tiny_gguf, tmp_path, case, message) -> None:
    with pytest.raises(QuantizationError) as e:
        Checkpoint(bad_gguf(case, tmp_path, tiny_gguf[0]))
    assert message in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- SmolLM2 (slow)
@pytest.mark.slow
def test_smollm2_served_from_its_own_q4_1_weights(tmp_path) -> None:
    from safetensors.torch import load_file

    from keepwarm import LLM, SamplingParams
    from keepwarm.worker.default_model import bundled_gguf, default_model

    path = bundled_gguf()
    ckpt = Checkpoint(path)
    _, total = plan_arena(ckpt, "auto", torch.float32)
    flat = torch.empty(total, dtype=torch.uint8)
    got = model_tensors(build_arena(ckpt, "auto", "float32", flat, "cpu"), flat)
    converted = load_file(default_model() / "model.safetensors")  # transformers' GGUF dequantization, in bf16
    a = "model.layers.7.self_attn."
    qkv = torch.cat([converted[a + f"{x}_proj.weight"] for x in "qkv"])
    assert got[a + "qkv_proj.weight"].meta.layout.startswith("int4_cpu")  # Q4_1: int4 groups of 32
    assert torch.equal(got[a + "qkv_proj.weight"].dequantize().to(torch.bfloat16), qkv)
    llm = LLM(model=str(path), max_model_len=512, daemon=False)
    # tests/e2e/test_smollm2.py's question: the bare one's first token wins by 0.1 logits and rambles on some CPUs.
    question = "What is the capital of France? Answer in one sentence."
    out = llm.chat([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert "Paris" in out.text


@pytest.mark.slow
def test_daemon_preloads_gguf_and_refuses_bad_ones(tiny_gguf, tmp_path) -> None:
    import subprocess
    import sys

    from keepwarm.daemon.client import DaemonError
    from keepwarm.formats import paths

    runtime = new_runtime_dir()
    d = DaemonProc(runtime).start()
    try:
        out = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "preload", str(tiny_gguf[0])], env=d.env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        with d.client() as c:
            (model,) = c.status()["models"]
            assert model["quantization"] == "gguf"
            for case, message in GGUF_BAD:
                with pytest.raises(DaemonError) as e:
                    c.preload(str(bad_gguf(case, tmp_path, tiny_gguf[0])))
                assert e.value.code == "bad_quantization" and message in e.value.message, e.value.message
                assert "\n" not in e.value.message
                assert [m["fingerprint"] for m in c.status()["models"]] == [model["fingerprint"]], case
                assert len(list(paths.shm_dir(runtime).iterdir())) == 2, case  # one arena + its manifest
            assert c.preload(str(tiny_gguf[0]))["cached"] is True
    finally:
        d.stop()
        remove_runtime_dir(runtime)
