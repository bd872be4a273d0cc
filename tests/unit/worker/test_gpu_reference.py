"""On a GPU, the model level against transformers on the same GPU (not keepwarm against keepwarm), and the serve
settings that only act on a CUDA device. Marked `gpu` (skipped without CUDA; `make gpu-check` runs them); the CPU
twins are tests/unit/worker/engine/test_engine.py, tests/unit/worker/test_quant_reference.py,
tests/unit/worker/models/test_architectures.py (quantized experts) and tests/e2e/test_serve_flags.py. The MoE models run
their experts through the Triton fused-MoE kernel here.
"""

from __future__ import annotations

import pytest
import torch
from support.references import PROMPTS, dequantized_hf_model, dequantized_moe_hf, fp8_round, hf_greedy, load_hf

from keepwarm import LLM, SamplingParams

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _hf(model_dir: str):
    return load_hf(model_dir).to(CUDA)


@pytest.mark.parametrize("model_name", ["llama", "llama3_tied", "mistral", "qwen2", "mixtral", "qwen3_moe"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_gpu_greedy_matches_transformers_on_gpu(tiny_model_factory, model_name: str, enforce_eager: bool) -> None:
    model_dir = tiny_model_factory(model_name)
    llm = LLM(model=model_dir, dtype="float32", device="cuda", daemon=False, max_model_len=256,
              enforce_eager=enforce_eager)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == hf_greedy(_hf(model_dir), PROMPTS)


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_gpu_quantized_matches_transformers_on_own_dequantization(tiny_llama, scheme: str) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", device="cuda", daemon=False, max_model_len=256,
              quantization=scheme)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    hf = dequantized_hf_model(tiny_llama, llm, device="cuda")
    assert got == hf_greedy(hf, PROMPTS)


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_gpu_quantized_experts_match_transformers_on_own_dequantization(tiny_model_factory, scheme: str) -> None:
    """The fused-MoE kernel on int8 / fp8 / int4 experts (the CUDA arena's canonical layouts)."""
    model_dir = tiny_model_factory("mixtral")
    llm = LLM(model=model_dir, dtype="float32", device="cuda", daemon=False, max_model_len=256,
              quantization=scheme)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    hf = dequantized_moe_hf(model_dir, llm, device="cuda")
    hf.generation_config.eos_token_id = None
    assert got == hf_greedy(hf, PROMPTS)


def test_gpu_fp8_kv_matches_transformers_with_the_same_rounding(tiny_llama) -> None:
    import transformers

    class RoundedCache(transformers.DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(fp8_round(key_states), fp8_round(value_states), layer_idx, *args, **kwargs)

    llm = LLM(model=tiny_llama, dtype="float32", device="cuda", daemon=False, max_model_len=256,
              kv_cache_dtype="fp8")
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    hf = _hf(tiny_llama)
    assert got == hf_greedy(hf, PROMPTS, lambda: RoundedCache(config=hf.config))


def test_gpu_flags_reach_the_engine(tiny_llama) -> None:
    """--enforce-eager, --gpu-memory-utilization and --device, read back from the engine's live parts."""
    from keepwarm.worker.process.config import ServerConfig
    from keepwarm.worker.serve import create_engine

    def effective(**kw) -> dict:
        engine = create_engine(ServerConfig(model=tiny_llama, daemon=False, max_model_len=256, **kw))
        try:
            return engine.effective_config()
        finally:
            engine.close()
            torch.cuda.empty_cache()

    graphs, eager = effective(), effective(enforce_eager=True)
    assert graphs["device"].startswith("cuda") and graphs["cuda_graphs"] is True
    assert eager["cuda_graphs"] is False
    small, large = effective(gpu_memory_utilization=0.2), effective(gpu_memory_utilization=0.3)
    assert small["num_kv_blocks"] < large["num_kv_blocks"]
    assert effective(device="cpu")["device"] == "cpu"
