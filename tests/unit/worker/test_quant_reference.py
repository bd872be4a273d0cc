"""Quantized serving against an independent reference: the engine's greedy tokens (float32) must equal
transformers' on weights this test dequantizes itself.

For each scheme the test reads the quantized parts the engine runs with (the arena's codes and scales), turns
them back into dense float32 weights with its own code, written from the formats' definitions (int8: q * scale
per output channel; fp8 e4m3: q * one scale; int4: (q - 8) * scale + zero per group, torch's tinygemm convention),
never keepwarm's dequantize, and loads them into transformers. The fp8 KV cache is checked against transformers
with a cache that rounds every key and value to e4m3 the same way (x clamped to +-448, cast, read back).
"""

from __future__ import annotations

import pytest
import torch
from support.references import MAX_TOKENS, PROMPTS, dequantized_hf_model, fp8_round, hf_greedy

from keepwarm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("model_name", ["llama", "qwen2"])
def test_quantized_greedy_matches_transformers_on_own_dequantization(tiny_model_factory, model_name: str,
                                                                     scheme: str) -> None:
    model_dir = tiny_model_factory(model_name)
    llm = LLM(model=model_dir, dtype="float32", quantization=scheme, daemon=False, max_model_len=256)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    expected = hf_greedy(dequantized_hf_model(model_dir, llm), PROMPTS)
    assert got == expected


@pytest.mark.parametrize("model_name", ["llama", "mistral"])
def test_fp8_kv_cache_matches_transformers_with_the_same_rounding(tiny_model_factory, model_name: str) -> None:
    import transformers

    class RoundedCache(transformers.DynamicCache):
        """Keys (after rotary) and values rounded to e4m3 as they enter the cache; attention reads them back."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(fp8_round(key_states), fp8_round(value_states), layer_idx, *args, **kwargs)

    model_dir = tiny_model_factory(model_name)
    llm = LLM(model=model_dir, dtype="float32", kv_cache_dtype="fp8", daemon=False, max_model_len=256)
    assert llm.llm_engine.runner.kv_cache.key[0].dtype == torch.float8_e4m3fn
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    assert got == hf_greedy(hf, PROMPTS, lambda: RoundedCache(config=hf.config))
    # The rounding matters: without it transformers differs somewhere (else this test could not tell).
    assert hf_greedy(hf, PROMPTS) != got or pytest.fail("fp8 KV rounding changed nothing on these prompts")
