"""Multi-LoRA: PEFT adapters mixed in one batch, exact against PEFT under transformers; kernels; bad adapters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from keepwarm import LLM, LoRARequest, SamplingParams, kernels
from keepwarm.worker.lora import LoRAError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 61)), [100, 200, 300, 17], list(range(300, 322))]


@pytest.fixture(scope="module")
def peft_reference(tiny_llama, lora_adapters):
    """Greedy continuations under transformers: the base model and each PEFT model, prompt by prompt."""
    import transformers
    from peft import PeftModel

    def generate(model) -> list[list[int]]:
        model.generation_config.eos_token_id = None
        out = []
        for p in PROMPTS:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                 pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
        return out

    ref = {None: generate(transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32))}
    for name, path in lora_adapters.items():
        base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        ref[name] = generate(PeftModel.from_pretrained(base, path).eval())
    assert all(ref[name] != ref[None] for name in lora_adapters)  # the adapters do change the output
    return ref


@pytest.mark.parametrize("max_loras", [3, 1])
def test_mixed_batch_matches_peft(tiny_llama, lora_adapters, peft_reference, max_loras) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256, enable_lora=True, max_loras=max_loras,
              max_lora_rank=16, daemon=False)
    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(lora_adapters.items())}
    names = [None, *lora_adapters]
    batch, loras, expected = [], [], []
    for name in names:  # interleave so one step mixes adapters and the base model
        for i, p in enumerate(PROMPTS):
            batch.append(p)
            loras.append(requests.get(name))
            expected.append(peft_reference[name][i])
    outs = llm.generate(batch, GREEDY, lora_request=loras)
    for out, want, lora in zip(outs, expected, loras, strict=True):
        assert out.outputs[0].token_ids == want, lora
    assert llm.llm_engine.lora_manager.slot_refs == [0] * max_loras  # every slot released


def test_adapters_never_share_prefix_blocks(tiny_llama, lora_adapters, peft_reference) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256, enable_lora=True, max_loras=2,
              max_lora_rank=16, daemon=False)
    bm = llm.llm_engine.block_manager
    prompt = PROMPTS[1]  # 41 tokens: two full blocks to cache
    llm.generate([prompt], GREEDY)
    hits = bm.prefix_cache_hits
    a = LoRARequest("ad_qv", 1, lora_adapters["ad_qv"])
    out = llm.generate([prompt], GREEDY, lora_request=a)[0]
    assert bm.prefix_cache_hits == hits  # the base model's blocks are not reused for the adapter
    assert out.outputs[0].token_ids == peft_reference["ad_qv"][1]
    again = llm.generate([prompt], GREEDY, lora_request=a)[0]
    assert bm.prefix_cache_hits == hits + 32  # but the adapter's own blocks are
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_lora_kernels_match_a_per_token_loop() -> None:
    g = torch.Generator().manual_seed(0)
    T, K, N, S, R = 37, 64, 48, 4, 8
    x = torch.randn(T, K, generator=g)
    a = torch.randn(2 * S * R, K, generator=g)  # two groups sharing x (like q and v)
    b = [torch.randn(N, S * R, generator=g), torch.randn(N // 2, S * R, generator=g)]
    slots = torch.randint(-1, S, (T,), generator=g)
    y0 = torch.randn(T, N + N // 2, generator=g)
    buf = kernels.lora_shrink(x, a, slots, R, S)
    y = y0.clone()
    kernels.lora_expand(y, buf[:, :S * R], b[0], 0)
    kernels.lora_expand(y, buf[:, S * R:], b[1], N)
    want = y0.clone()
    for t in range(T):
        s = int(slots[t])
        if s < 0:
            continue
        for grp, (bb, off) in enumerate(zip(b, [0, N], strict=True)):
            a_s = a[(grp * S + s) * R:(grp * S + s + 1) * R]
            want[t, off:off + bb.shape[0]] += bb[:, s * R:(s + 1) * R] @ (a_s @ x[t])
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(y[slots < 0], y0[slots < 0])  # base-model tokens untouched


def _copy_adapter(src: str, dst: Path, **config_changes) -> str:
    shutil.copytree(src, dst)
    if config_changes:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg.update(config_changes)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.fixture
def bad_adapters(tiny_llama, lora_adapters, tmp_path, make_adapter) -> dict[str, tuple[str, str]]:
    from safetensors.torch import load_file, save_file

    cases: dict[str, tuple[str, str]] = {}
    cases["missing"] = (str(tmp_path / "nope"), "does not exist")
    (tmp_path / "empty").mkdir()
    cases["not_adapter"] = (str(tmp_path / "empty"), "adapter_config.json is missing")
    pickled = Path(_copy_adapter(lora_adapters["ad_qv"], tmp_path / "pickled"))
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    cases["pickle"] = (str(pickled), "never loads pickle")
    big = make_adapter(tiny_llama, tmp_path / "big", r=32, lora_alpha=32, target_modules=["q_proj"])
    cases["rank"] = (big, "above --max-lora-rank 16")
    lm_head = make_adapter(tiny_llama, tmp_path / "lmhead", r=4, lora_alpha=4, target_modules=["lm_head"])
    cases["module"] = (lm_head, "targets module 'lm_head'")
    mismatched = Path(_copy_adapter(lora_adapters["ad_qv"], tmp_path / "shape"))
    t = load_file(str(mismatched / "adapter_model.safetensors"))
    key = next(k for k in t if "lora_B" in k)
    t[key] = torch.zeros(t[key].shape[0] + 3, t[key].shape[1])
    save_file(t, str(mismatched / "adapter_model.safetensors"))
    cases["shape"] = (str(mismatched), "the model needs")
    deep = Path(_copy_adapter(lora_adapters["ad_qv"], tmp_path / "deep"))
    t = load_file(str(deep / "adapter_model.safetensors"))
    t = {k.replace("layers.1.", "layers.7."): v for k, v in t.items()}
    save_file(t, str(deep / "adapter_model.safetensors"))
    cases["layer"] = (str(deep), "targets layer 7")
    cases["dora"] = (_copy_adapter(lora_adapters["ad_qv"], tmp_path / "dora", use_dora=True), "use_dora")
    return cases


def test_bad_adapters_are_refused_with_the_cause(tiny_llama, bad_adapters) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256, enable_lora=True, max_lora_rank=16,
              daemon=False)
    for case, (path, message) in bad_adapters.items():
        with pytest.raises(LoRAError) as e:
            llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest(case, 1, path))
        assert message in str(e.value) and "\n" not in str(e.value), case
        assert case not in llm.llm_engine.loras  # nothing registered
    assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids  # still serving


def test_lora_needs_enable_lora(tiny_llama, lora_adapters) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256, daemon=False)
    with pytest.raises(LoRAError, match="not enabled"):
        llm.generate([[5, 6]], GREEDY, lora_request=LoRARequest("a", 1, lora_adapters["ad_qv"]))


def test_cuda_graphs_are_bypassed_for_batches_with_lora(tiny_llama, lora_adapters, peft_reference) -> None:
    """The runner's rule, on the CPU: a graph runner that would take every batch is offered only those without
    an adapter (a captured graph has no LoRA inputs); LoRA batches run eagerly and still match PEFT."""
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256, enable_lora=True, max_loras=2,
              max_lora_rank=16, daemon=False)
    offered: list[bool] = []

    class AcceptEverything:
        def can_run(self, attn, num_tokens) -> bool:
            return True

        def run(self, input_ids, positions, attn):
            offered.append(llm.llm_engine.lora_manager.token_slots is not None)
            return None  # "not captured for this shape": the runner falls back to the eager forward

    llm.llm_engine.runner.cuda_graphs = AcceptEverything()
    base = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert offered and not any(offered)  # base-model batches went to the graph runner
    offered.clear()
    a = LoRARequest("ad_qv", 1, lora_adapters["ad_qv"])
    out = llm.generate([PROMPTS[0]], GREEDY, lora_request=a)[0]
    assert offered == []  # not one LoRA batch was offered to it
    assert out.outputs[0].token_ids == peft_reference["ad_qv"][0]
    assert base.outputs[0].token_ids == peft_reference[None][0]
