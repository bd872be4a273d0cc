"""Shared test setup: deliberate torch threading (2-core CI machines), GPU marker handling."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Test helpers beside this file (tests/_serve.py) import as top-level modules under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).parent))

# Oversubscribed threads cost ~10x on a 2-core machine; tests that start worker processes set their own.
torch.set_num_threads(int(os.environ.get("KEEPWARM_TEST_THREADS", "2")))

# A daemon that runs in the default runtime dir (a user's, or another checkout's test run) must not be found by
# tests that expect none: `LLM()` attaches to any daemon it finds. Tests that want a daemon start their own in a
# directory of their own; everything else sees this empty one.
os.environ["KEEPWARM_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="keepwarm-test-rt-")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# -- tiny random models (built once per session; no model hub) ----------------------------------------------------
TINY_MODELS = {
    # GQA, untied embeddings.
    "llama": dict(arch="llama", tie_word_embeddings=False),
    # Tied embeddings and llama3 rope scaling (original context 64, so scaling changes low frequencies).
    "llama3_tied": dict(arch="llama", tie_word_embeddings=True, num_key_value_heads=1,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}),
    "mistral": dict(arch="mistral", tie_word_embeddings=False, sliding_window=None),
    # Qwen2 has q/k/v biases.
    "qwen2": dict(arch="qwen2", tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2),
    # A chat template that takes tools (Qwen 2.5's Hermes format), for the tool-calling tests.
    "qwen2_tools": dict(arch="qwen2", tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2,
                        chat_template="tools"),
    # The families of issue 13. Windows of 16 tokens, well below the 70-token prompts of test_engine.
    # Qwen3: per-head q/k norms, head_dim 32 != hidden / heads (128 / 8), layer 1 of 2 sliding.
    "qwen3": dict(arch="qwen3", num_attention_heads=8, use_sliding_window=True, sliding_window=16,
                  max_window_layers=1),
    "mistral_sw": dict(arch="mistral", sliding_window=16),
    # Gemma 2: alternating local/global, soft-capped attention and logits, query_pre_attn_scalar != head_dim.
    "gemma2": dict(arch="gemma2", num_hidden_layers=3, sliding_window=16, query_pre_attn_scalar=24,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    # Gemma 3: q/k norms, layer_types, a local rope base for sliding layers and linear scaling for global ones.
    "gemma3": dict(arch="gemma3", num_hidden_layers=3, sliding_window=16, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                       "rope_theta": 1000000.0}}),
    # Phi-3: fused qkv / gate_up in the checkpoint; longrope with an original context of 64, so the 64- and
    # 70-token prompts start long and the 55-token one crosses over while generating.
    "phi3": dict(arch="phi3", original_max_position_embeddings=64, max_position_embeddings=256,
                 rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 32 for i in range(16)],
                               "long_factor": [2.0 + i / 4 for i in range(16)]}),
    # Mixtral: 4 experts, top-2 renormalised.
    "mixtral": dict(arch="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=128),
    # Qwen3-MoE: 6 experts, top-2 not renormalised, layer 1 of 3 dense (mlp_only_layers).
    "qwen3_moe": dict(arch="qwen3_moe", num_hidden_layers=3, num_experts=6, num_experts_per_tok=2,
                      moe_intermediate_size=64, norm_topk_prob=False, mlp_only_layers=[1]),
}


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    from keepwarm.worker.models.random_model import make_random_model

    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            spec = dict(TINY_MODELS[name])
            arch = spec.pop("arch")
            if spec.get("chat_template") == "tools":
                from keepwarm.worker.models.random_model import TOOLS_CHAT_TEMPLATE

                spec["chat_template"] = TOOLS_CHAT_TEMPLATE
            built[name] = str(make_random_model(tmp_path_factory.mktemp(name), arch, head_dim=32, **spec))
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


# -- PEFT adapters for the tiny llama ---------------------------------------------------------------------------
LORA_SPECS = {
    "ad_qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "ad_all": dict(r=8, lora_alpha=16, use_rslora=True,
                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "ad_mlp": dict(r=16, lora_alpha=16, target_modules=["o_proj", "gate_proj", "down_proj"]),
}


def make_peft_adapter(base_dir: str, out_dir, seed: int = 0, **spec) -> str:
    """A PEFT LoRA adapter with random A and B (PEFT's default zero B would make it a no-op)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **spec))
    with torch.no_grad():  # scale B so the adapters change greedy output clearly but stay sane
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    return str(out_dir)


@pytest.fixture(scope="session")
def lora_adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    return {name: make_peft_adapter(tiny_llama, tmp_path_factory.mktemp(name), seed=i, **spec)
            for i, (name, spec) in enumerate(LORA_SPECS.items())}


@pytest.fixture(scope="session")
def make_adapter():
    """make_peft_adapter(base_dir, out_dir, seed=0, **LoraConfig kwargs) -> adapter dir."""
    return make_peft_adapter


@pytest.fixture
def small_tmpfs():
    """``small_tmpfs(size_bytes)``: a tmpfs of that size mounted for the test (root only; skipped, saying why,
    where mounting is refused), unmounted after it. For full-disk tests (ENOSPC named, nothing half-written)."""
    import shutil
    import subprocess

    mounts: list[Path] = []

    def mount(size_bytes: int) -> Path:
        d = Path(tempfile.mkdtemp(prefix="kw-full-"))
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            os.rmdir(d)
            pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
        mounts.append(d)
        return d

    yield mount
    for d in mounts:
        subprocess.run(["umount", "-l", str(d)], check=False)
        shutil.rmtree(d, ignore_errors=True)
