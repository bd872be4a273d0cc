"""Tiny random models (no model hub) and PEFT adapters for them, each built once and cached on disk.

A model is built into a directory named by a hash of what makes it (its name and arguments, random_model.py's
source, the torch and transformers versions), under pytest's cache dir (.pytest_cache/, so a local rerun reuses
it) or the session's temp dir where the cache is off. The build goes to a private directory first and is renamed
into place (two processes building at once: the first rename wins). A digest of its files is recorded with it and
checked before a session reuses it: a model a test modified in place is rebuilt, never served.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

TINY_MODELS: dict[str, dict[str, Any]] = {
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

LORA_SPECS: dict[str, dict[str, Any]] = {
    "ad_qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "ad_all": dict(r=8, lora_alpha=16, use_rslora=True,
                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "ad_mlp": dict(r=16, lora_alpha=16, target_modules=["o_proj", "gate_proj", "down_proj"]),
}


def make_tiny_model(out_dir: Path, name: str) -> Path:
    """TINY_MODELS[name] built into ``out_dir`` (head_dim 32)."""
    from keepwarm.worker.models.random_model import TOOLS_CHAT_TEMPLATE, make_random_model

    spec = dict(TINY_MODELS[name])
    arch = spec.pop("arch")
    if spec.get("chat_template") == "tools":
        spec["chat_template"] = TOOLS_CHAT_TEMPLATE
    return Path(make_random_model(out_dir, arch, head_dim=32, **spec))


def make_peft_adapter(base_dir: str, out_dir: Path | str, seed: int = 0, **spec: Any) -> str:
    """A PEFT LoRA adapter with random A and B (PEFT's default zero B would make it a no-op)."""
    import torch  # deferred: heavy (and transformers / peft only where an adapter is built)
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


def build_key(*parts: Any) -> str:
    """A hash of ``parts`` (names, arguments), random_model.py's source and the torch and transformers versions."""
    import torch  # deferred: heavy
    import transformers

    from keepwarm.worker.models import random_model

    text = json.dumps([repr(p) for p in parts] + [inspect.getsource(random_model), torch.__version__,
                                                  transformers.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _digest(directory: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(directory)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def cached_build(cache_root: Path, label: str, key: str, build: Callable[[Path], object]) -> Path:
    """The directory ``build(dir)`` fills, built once for ``key`` under ``cache_root`` and reused while its files
    match the digest recorded when it was built."""
    entry = cache_root / f"{label}-{key}"  # holds LABEL/ (the build) and sha256 (its digest): complete once it exists
    if entry.is_dir():
        record = entry / "sha256"
        if record.is_file() and record.read_text() == _digest(entry / label):
            return entry / label
        with contextlib.suppress(OSError):  # modified since: aside (atomically), then gone
            aside = Path(tempfile.mkdtemp(prefix=f".stale-{label}-", dir=cache_root))
            entry.rename(aside / "old")
            shutil.rmtree(aside, ignore_errors=True)
    cache_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{label}-", dir=cache_root))
    build(work / label)
    (work / "sha256").write_text(_digest(work / label))
    try:
        work.rename(entry)
    except OSError:  # another process renamed its build first: use that one
        shutil.rmtree(work, ignore_errors=True)
    return entry / label
