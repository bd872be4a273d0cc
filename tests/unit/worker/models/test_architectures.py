"""Issue 13's families beyond the in-process greedy test of test_engine: through the daemon's arena, MoE with int8,
int4 and fp8 experts against the dequantized model under transformers, LoRA on Qwen3 and Gemma 3 against PEFT,
and the lines keepwarm refuses with (unsupported architectures, LoRA on MoE, text without a tokenizer)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from support.daemon import DaemonProc, new_runtime_dir, remove_runtime_dir
from support.references import MAX_TOKENS, dequantized_moe_hf, hf_greedy, load_hf

from keepwarm import LLM, LoRARequest, SamplingParams
from keepwarm.formats.model_config import ModelConfigError

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Longer than every sliding window (16) and, for the Phi-3 model, before, across and past longrope's switch (64).
PROMPTS = [list(range(7, 8)), list(range(30, 39)), list(range(100, 131)), list(range(200, 255)),
           list(range(250, 314)), list(range(400, 470))]


@pytest.fixture(scope="module")
def daemon_dir():
    d = new_runtime_dir()
    proc = DaemonProc(d).start()
    yield d
    proc.stop()
    remove_runtime_dir(d)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"])
def test_greedy_from_the_daemon_matches_transformers(tiny_model_factory, daemon_dir, model_name: str) -> None:
    model = tiny_model_factory(model_name)
    llm = LLM(model=model, dtype="float32", daemon=True, runtime_dir=str(daemon_dir), max_model_len=256,
              max_num_batched_tokens=40)  # chunked as well: the 55- and 70-token prompts take two steps
    try:
        assert llm.weights_source == "daemon"
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(load_hf(model), PROMPTS)


# Each family with int8, and each of int4 / fp8 on one family (the expert path is the same code for both).
@pytest.mark.parametrize(("model_name", "scheme"), [("mixtral", "int8"), ("qwen3_moe", "int8"), ("mixtral", "int4"),
                                                    ("qwen3_moe", "fp8")])
def test_quantized_experts_match_the_dequantized_model(tiny_model_factory, model_name: str, scheme: str) -> None:
    """Every linear (attention, each expert, the dense MLP) quantized: int8 per output channel, int4 in groups,
    fp8 e4m3 with one scale; the router and embeddings dense. The same greedy tokens as transformers (float32)
    running the weights this test dequantizes from the engine's own parts."""
    model = tiny_model_factory(model_name)
    llm = LLM(model=model, dtype="float32", quantization=scheme, daemon=False, max_model_len=256)
    moe = next(layer.mlp for layer in llm.llm_engine.loaded.model.model.layers if hasattr(layer.mlp, "experts"))
    assert moe.experts[0].gate_up_proj.weight.meta.scheme == scheme
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(dequantized_moe_hf(model, llm), PROMPTS)


SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# Phi-3's checkpoint has qkv_proj and gate_up_proj fused, so its adapters target those.
@pytest.mark.parametrize(("model_name", "targets"), [("qwen3", SEVEN), ("gemma3", SEVEN),
                                                     ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])])
def test_lora_matches_peft(tiny_model_factory, make_adapter, tmp_path, model_name: str, targets: list[str]) -> None:
    from peft import PeftModel

    base = tiny_model_factory(model_name)
    adapter = make_adapter(base, tmp_path / "ad", seed=3, r=8, lora_alpha=16, target_modules=targets)
    llm = LLM(model=base, dtype="float32", max_model_len=256, enable_lora=True, max_lora_rank=8, daemon=False)
    lora = LoRARequest("ad", 1, adapter)
    outs = llm.generate(PROMPTS * 2, GREEDY, lora_request=[lora] * len(PROMPTS) + [None] * len(PROMPTS))
    want = hf_greedy(PeftModel.from_pretrained(load_hf(base), adapter).eval(), PROMPTS)
    assert [o.outputs[0].token_ids for o in outs[:len(PROMPTS)]] == want
    assert [o.outputs[0].token_ids for o in outs[len(PROMPTS):]] == hf_greedy(load_hf(base), PROMPTS)
    assert want != hf_greedy(load_hf(base), PROMPTS)  # the adapter does change the output


def test_lora_on_moe_is_refused_with_one_line(tiny_model_factory) -> None:
    with pytest.raises(ModelConfigError, match=r"^LoRA is not supported for MixtralForCausalLM"):
        LLM(model=tiny_model_factory("mixtral"), dtype="float32", enable_lora=True, daemon=False)


def test_lora_for_another_layout_is_refused(tiny_model_factory, make_adapter, tmp_path) -> None:
    """An adapter with q_proj/k_proj/v_proj cannot apply to Phi-3's fused qkv_proj (nor the reverse): refused."""
    from keepwarm.worker.lora import LoRAError

    adapter = make_adapter(tiny_model_factory("qwen3"), tmp_path / "q", target_modules=["q_proj", "v_proj"])
    llm = LLM(model=tiny_model_factory("phi3"), dtype="float32", enable_lora=True, daemon=False, max_model_len=128)
    with pytest.raises(LoRAError, match=r"targets module '[qv]_proj', which the model lacks \(supported: qkv_proj"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("q", 1, adapter))


def test_unsupported_architecture_lists_the_supported(tiny_llama, tmp_path) -> None:
    import json

    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(ModelConfigError) as e:
        LLM(model=str(d), daemon=False)
    msg = str(e.value)
    assert "\n" not in msg and "unsupported architecture 'DeepseekV3ForCausalLM'" in msg
    for arch in ("Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
                 "MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        assert arch in msg


def test_skip_tokenizer_init_serves_token_ids_without_tokenizer_files(tiny_model_factory, tmp_path) -> None:
    src = Path(tiny_model_factory("qwen3"))
    d = tmp_path / "no-tokenizer"
    d.mkdir()
    for f in src.iterdir():
        if f.name in ("config.json", "generation_config.json") or f.suffix == ".safetensors":
            shutil.copy(f, d / f.name)
    llm = LLM(model=str(d), dtype="float32", skip_tokenizer_init=True, daemon=False, max_model_len=256)
    outs = llm.generate(PROMPTS[:3], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(load_hf(str(src)), PROMPTS[:3])
    assert all(o.outputs[0].text == "" for o in outs)
    with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
        llm.generate("hello", GREEDY)


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_experts_take_every_quantized_layout(tiny_model_factory, scheme: str) -> None:
    """The arena plan quantizes each expert's gate_up / down like any linear; the router and norms stay dense."""
    from keepwarm.weights.checkpoint import Checkpoint
    from keepwarm.weights.loader import plan_arena

    ckpt = Checkpoint(tiny_model_factory("qwen3_moe"))
    planned, _ = plan_arena(ckpt, scheme, torch.float32)
    quantized = {p.name for p in planned if p.quantized}
    experts = {p.name for p in planned if ".experts." in p.name}
    assert len(experts) == 2 * 6 * 2  # 2 MoE layers (layer 1 is dense) x 6 experts x (gate_up, down)
    assert experts <= quantized
    assert "model.layers.1.mlp.gate_up_proj.weight" in quantized  # the dense layer's MLP
    assert not any(n.endswith("mlp.gate.weight") for n in quantized)  # routers stay dense
