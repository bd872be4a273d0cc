"""`quant_method: fp8` checkpoints (transformers' FineGrainedFP8 / DeepSeek and Qwen3-FP8 style: e4m3 weights with
`weight_scale_inv` per 128x128 block; vLLM's per-tensor `weight_scale`), written here by the format's rule:
keepwarm's arena weights equal transformers' dequantization bit for bit and greedy tokens are equal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from keepwarm.weights.checkpoint import Checkpoint
from keepwarm.weights.loader import build_arena, plan_arena
from keepwarm.worker.attach import model_tensors

PROMPTS = [[5, 17, 99, 240, 7], [300, 12, 45]]


def write_fp8(base: str, out: Path, block: tuple[int, int] | None) -> Path:
    shutil.copytree(base, out)
    t = load_file(out / "model.safetensors")
    for name in [n for n in t if n.endswith("_proj.weight")]:
        w = t.pop(name).float()
        n, k = w.shape
        bn, bk = block or (n, k)
        rows, cols = -(-n // bn), -(-k // bk)
        s = torch.stack([torch.stack([w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax() / 448.0
                                      for j in range(cols)]) for i in range(rows)])
        spread = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        t[name] = (w / spread).to(torch.float8_e4m3fn)
        if block:
            t[name + "_scale_inv"] = s  # despite the name, multiplied (DeepSeek's convention)
        else:
            t[name.removesuffix("weight") + "weight_scale"] = s.reshape(())
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  **({"weight_block_size": list(block)} if block else {})}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _arena(model: Path) -> dict:
    ckpt = Checkpoint(model)
    _, total = plan_arena(ckpt, "fp8", torch.float32)
    flat = torch.empty(total, dtype=torch.uint8)
    return model_tensors(build_arena(ckpt, "fp8", "float32", flat, "cpu"), flat)


def test_block_fp8_equals_transformers(tiny_llama, tmp_path) -> None:
    import transformers
    from transformers import FineGrainedFP8Config

    from keepwarm import LLM, SamplingParams

    model = write_fp8(tiny_llama, tmp_path / "fp8", (128, 128))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                                           quantization_config=FineGrainedFP8Config(dequantize=True))
    got = _arena(model)
    for i, layer in enumerate(hf.model.layers):
        a = layer.self_attn
        qkv = got[f"model.layers.{i}.self_attn.qkv_proj.weight"]
        assert qkv.meta.layout == "fp8_block"
        assert torch.equal(qkv.dequantize(), torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach())
        assert torch.equal(got[f"model.layers.{i}.mlp.down_proj.weight"].dequantize(), layer.mlp.down_proj.weight)
    hf.generation_config.eos_token_id = None
    llm = LLM(model=str(model), dtype="float32", daemon=False, max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for p, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                          pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref


def test_per_tensor_fp8_weights(tiny_llama, tmp_path) -> None:
    model = write_fp8(tiny_llama, tmp_path / "fp8", None)
    t = load_file(model / "model.safetensors")
    got = _arena(model)
    p = "model.layers.1.self_attn."
    want = torch.cat([t[p + f"{x}_proj.weight"].float() * t[p + f"{x}_proj.weight_scale"] for x in "qkv"])
    assert got[p + "qkv_proj.weight"].meta.layout == "fp8_block"  # three scales: one per row after fusing
    assert torch.equal(got[p + "qkv_proj.weight"].dequantize(), want)
    o = got[p + "o_proj.weight"]
    assert o.meta.layout == "fp8_tensor"  # one projection, one scale: keepwarm's own fp8 layout and kernels
    assert torch.equal(o.dequantize(), t[p + "o_proj.weight"].float() * t[p + "o_proj.weight_scale"])
