"""GPTQ and AWQ checkpoints written here by the formats' published packing rules (no tool for them runs on this
CPU): keepwarm's arena weights must equal an independent dequantization written in this file, greedy tokens must
equal transformers on the dequantized dense model, and one tiny weight's expected values are fixed numbers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from keepwarm.kernels.quant import QuantizedWeight
from keepwarm.weights.checkpoint import Checkpoint
from keepwarm.weights.convert import convert_weight, plan_weight
from keepwarm.weights.loader import build_arena, plan_arena
from keepwarm.weights.prequant import detect
from keepwarm.worker.attach import model_tensors

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM pack: nibble i of a word = column AWQ_PACK_ORDER[i]


# ---------------------------------------------------------------------------------------------- writers (the rules)
def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qweight: codes [K, N] packed along K, 32/bits per int32, lowest bits first."""
    per = 32 // bits
    k, n = codes.shape
    words = torch.zeros(k // per, n, dtype=torch.int64)
    for i in range(per):
        words |= codes[i::per].to(torch.int64) << (bits * i)
    return _as_int32(words)


def _pack_cols(codes: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Codes [R, N] packed along N, 32/bits per int32 (nibble i = column order[i] of each run)."""
    per = 32 // bits
    order = order or list(range(per))
    r, n = codes.shape
    words = torch.zeros(r, n // per, dtype=torch.int64)
    for i in range(per):
        words |= codes[:, order[i]::per].to(torch.int64) << (bits * i)
    return _as_int32(words)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _quantize_groups(w: torch.Tensor, bits: int, gs: int, sym: bool, g_idx: torch.Tensor):
    """Asymmetric/symmetric min-max per group (columns grouped by g_idx): codes [N, K], scales, zeros [N, G]."""
    n, k = w.shape
    g = k // gs
    qmax = 2**bits - 1
    scales, zeros = torch.empty(n, g), torch.empty(n, g)
    for j in range(g):
        cols = w[:, g_idx == j]
        if sym:
            s = cols.abs().amax(dim=1) / (qmax / 2)
            z = torch.full((n,), float(2 ** (bits - 1)))
        else:
            lo, hi = cols.amin(dim=1), cols.amax(dim=1)
            s = (hi - lo) / qmax
            z = torch.round(-lo / s).clamp(1, qmax)  # >= 1: GPTQ v1 stores zero - 1
        scales[:, j], zeros[:, j] = s, z
    scales = scales.half().float()  # the file keeps fp16 scales: quantize against what is stored
    codes = torch.round(w / scales[:, g_idx] + zeros[:, g_idx]).clamp(0, qmax).to(torch.int64)
    return codes, scales, zeros.to(torch.int64)


def write_gptq(base: str, out: Path, bits: int, gs: int, sym: bool, desc_act: bool, v2: bool = False) -> Path:
    shutil.copytree(base, out)
    tensors = load_file(out / "model.safetensors")
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in PROJ]:
        w = tensors.pop(name).float()
        n, k = w.shape
        # Projections that share an input share its activation order (GPTQ orders columns by the input's Hessian).
        order = torch.randperm(k, generator=torch.Generator().manual_seed(k)) if desc_act else torch.arange(k)
        g_idx = order // gs
        codes, scales, zeros = _quantize_groups(w, bits, gs, sym, g_idx)
        p = name.removesuffix(".weight")
        tensors[p + ".qweight"] = _pack_rows(codes.t(), bits)
        tensors[p + ".qzeros"] = _pack_cols(zeros.t() - (0 if v2 else 1), bits)  # v1 stores zero - 1
        tensors[p + ".scales"] = scales.t().half().contiguous()
        tensors[p + ".g_idx"] = g_idx.to(torch.int32)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    _set_config(out, {"quant_method": "gptq", "bits": bits, "group_size": gs, "desc_act": desc_act, "sym": sym,
                      "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    return out


def write_awq(base: str, out: Path, gs: int) -> Path:
    shutil.copytree(base, out)
    tensors = load_file(out / "model.safetensors")
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in PROJ]:
        w = tensors.pop(name).float()
        k = w.shape[1]
        codes, scales, zeros = _quantize_groups(w, 4, gs, False, torch.arange(k) // gs)
        p = name.removesuffix(".weight")
        tensors[p + ".qweight"] = _pack_cols(codes.t(), 4, AWQ_PACK_ORDER)  # [K, N/8]
        tensors[p + ".qzeros"] = _pack_cols(zeros.t(), 4, AWQ_PACK_ORDER)  # [G, N/8]
        tensors[p + ".scales"] = scales.t().half().contiguous()  # [G, N]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    _set_config(out, {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True, "version": "gemm"})
    return out


def _set_config(out: Path, qc: dict) -> None:
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))


# ---------------------------------------------------------------------------------------------- reading (the rules)
def _unpack(words: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    per = 32 // bits
    order = order or list(range(per))
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = w if dim == 1 else w.t()
    out = torch.empty(w.shape[0], w.shape[1] * per, dtype=torch.int64)
    for i in range(per):
        out[:, order[i]::per] = (w >> (bits * i)) & (2**bits - 1)
    return out if dim == 1 else out.t()


def dequantize_gptq(t: dict[str, torch.Tensor], p: str, bits: int, v2: bool = False) -> torch.Tensor:
    codes = _unpack(t[p + ".qweight"], bits, 0)  # [K, N]
    zeros = _unpack(t[p + ".qzeros"], bits, 1) + (0 if v2 else 1)  # [G, N]
    g = t[p + ".g_idx"].long()
    return ((codes - zeros[g]) * t[p + ".scales"].float()[g]).t()


def dequantize_awq(t: dict[str, torch.Tensor], p: str, gs: int) -> torch.Tensor:
    codes = _unpack(t[p + ".qweight"], 4, 1, AWQ_PACK_ORDER)  # [K, N]
    zeros = _unpack(t[p + ".qzeros"], 4, 1, AWQ_PACK_ORDER)  # [G, N]
    g = torch.arange(codes.shape[0]) // gs
    return ((codes - zeros[g]) * t[p + ".scales"].float()[g]).t()


def _arena_weights(model: str) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint(model)
    _, total = plan_arena(ckpt, "auto", torch.float32)
    flat = torch.empty(total, dtype=torch.uint8)
    return model_tensors(build_arena(ckpt, "auto", "float32", flat, "cpu"), flat)


def _expected_fused(model: Path, dequant) -> dict[str, torch.Tensor]:
    t = load_file(model / "model.safetensors")
    out = {}
    for layer in sorted({n.split(".")[2] for n in t if n.startswith("model.layers.")}):
        a, m = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        out[a + "qkv_proj.weight"] = torch.cat([dequant(t, a + x) for x in ("q_proj", "k_proj", "v_proj")])
        out[a + "o_proj.weight"] = dequant(t, a + "o_proj")
        out[m + "gate_up_proj.weight"] = torch.cat([dequant(t, m + x) for x in ("gate_proj", "up_proj")])
        out[m + "down_proj.weight"] = dequant(t, m + "down_proj")
    return out


def _dense_copy(model: Path, out: Path, expected: dict[str, torch.Tensor]) -> Path:
    """The model with the independently dequantized weights, unfused, as a plain float32 checkpoint."""
    shutil.copytree(model, out)
    t = {n: v for n, v in load_file(model / "model.safetensors").items() if n.rsplit(".", 2)[-2] not in PROJ}
    for name, w in expected.items():
        pre = name.rsplit(".", 2)[0] + "."
        if "qkv_proj" in name:
            cfg = json.loads((model / "config.json").read_text())
            hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
            q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
            for x, part in zip(("q_proj", "k_proj", "v_proj"), w.split([q, kv, kv]), strict=True):
                t[pre + x + ".weight"] = part.contiguous()
        elif "gate_up_proj" in name:
            for x, part in zip(("gate_proj", "up_proj"), w.chunk(2), strict=True):
                t[pre + x + ".weight"] = part.contiguous()
        else:
            t[name] = w.contiguous()
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _greedy(model: str, prompts: list[list[int]]) -> list[list[int]]:
    from keepwarm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", daemon=False, max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _transformers_greedy(model: str, prompts: list[list[int]]) -> list[list[int]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        out.append(hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                               pad_token_id=0)[0, len(p):].tolist())
    return out


PROMPTS = [[5, 17, 99, 240, 7], [300, 12, 45]]


@pytest.mark.parametrize("bits, gs, sym, desc_act, v2", [
    (4, 32, False, False, False), (4, 64, True, True, False), (8, 32, False, True, False), (8, 128, True, False, True),
])
def test_gptq_matches_an_independent_dequantization(tiny_llama, tmp_path, bits, gs, sym, desc_act, v2) -> None:
    model = write_gptq(tiny_llama, tmp_path / "gptq", bits, gs, sym, desc_act, v2)
    expected = _expected_fused(model, lambda t, p: dequantize_gptq(t, p, bits, v2))
    got = _arena_weights(str(model))
    for name, w in expected.items():
        assert isinstance(got[name], QuantizedWeight)
        torch.testing.assert_close(got[name].dequantize(), w, rtol=0, atol=0, msg=name)
    dense = _dense_copy(model, tmp_path / "dense", expected)
    assert _greedy(str(model), PROMPTS) == _transformers_greedy(str(dense), PROMPTS)


@pytest.mark.parametrize("gs", [32, 128])
def test_awq_matches_an_independent_dequantization(tiny_llama, tmp_path, gs) -> None:
    model = write_awq(tiny_llama, tmp_path / "awq", gs)
    expected = _expected_fused(model, lambda t, p: dequantize_awq(t, p, gs))
    got = _arena_weights(str(model))
    for name, w in expected.items():
        torch.testing.assert_close(got[name].dequantize(), w, rtol=0, atol=0, msg=name)
    dense = _dense_copy(model, tmp_path / "dense", expected)
    assert _greedy(str(model), PROMPTS) == _transformers_greedy(str(dense), PROMPTS)


# ---------------------------------------------------------------------------------------------- fixed numbers
def _convert(qc: dict, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    src = detect({"quantization_config": qc})
    meta = plan_weight(src, [shape], torch.float32, "cuda")  # the portable (canonical) int4 layout
    parts = convert_weight(src, meta, [tensors], [shape], torch.float32, "w")
    return QuantizedWeight.from_parts(meta, parts).dequantize()


def test_gptq_word_with_fixed_expected_weights() -> None:
    # Every qweight word 0x76543210: along K the codes run 0..7; zero words 0x77777777 (v1: zero - 1 = 7 -> 8);
    # scale 0.5 for columns 0..3, 0.25 for 4..7.
    qweight = torch.full((4, 8), 0x76543210, dtype=torch.int32)
    qzeros = torch.full((1, 1), 0x77777777, dtype=torch.int32)
    scales = torch.tensor([[0.5] * 4 + [0.25] * 4], dtype=torch.float16)
    w = _convert({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
                 {"qweight": qweight, "qzeros": qzeros, "scales": scales}, (8, 32))
    assert w[0, :8].tolist() == [-4.0, -3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5]
    assert w[7, 8:16].tolist() == [-2.0, -1.75, -1.5, -1.25, -1.0, -0.75, -0.5, -0.25]


def test_awq_word_with_fixed_expected_weights() -> None:
    # One qweight word per row, 0x76543210: nibble i holds column (0 2 4 6 1 3 5 7)[i], so the columns' codes are
    # 0 4 1 5 2 6 3 7; zero words 0x88888888 (8 each), scales 0.25.
    qweight = torch.full((32, 1), 0x76543210, dtype=torch.int32)
    qzeros = torch.full((1, 1), 0x88888888 - 2**32, dtype=torch.int32)
    scales = torch.full((1, 8), 0.25, dtype=torch.float16)
    w = _convert({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
                 {"qweight": qweight, "qzeros": qzeros, "scales": scales}, (8, 32))
    assert w[:, 0].tolist() == [-2.0, -1.0, -1.75, -0.75, -1.5, -0.5, -1.25, -0.25]
    assert torch.equal(w[:, 5], w[:, 0])
