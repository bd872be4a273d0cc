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

from keepwarm import LLM, SamplingParams

MAX_TOKENS = 16
PROMPTS = [[7], [5, 9, 200], list(range(20, 60)), [300 + i % 50 for i in range(70)], [11, 12] * 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
FP8_MAX = 448.0


def _int4_codes_from_torch_pack(qweight: torch.Tensor, scales_and_zeros: torch.Tensor, n: int, k: int,
                                gs: int) -> torch.Tensor:
    """Dense weight of torch's CPU int4 pack, computed by torch's own int4 matmul on the identity matrix (torch's
    kernel, not keepwarm's unpacking): I @ W^T = W^T."""
    eye = torch.eye(k, dtype=scales_and_zeros.dtype, device=qweight.device)
    return torch._weight_int4pack_mm_for_cpu(eye, qweight, gs, scales_and_zeros).t().float()


def dequantize(meta, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The dense float32 [N, K] weight from the stored parts, by the formats' definitions."""
    n, k = meta.shape
    if meta.scheme == "int8":
        return parts["qweight"].to(torch.float32) * parts["scales"].to(torch.float32)[:, None]
    if meta.scheme == "fp8":
        return parts["qweight"].to(torch.float32) * parts["scale"].to(torch.float32)
    assert meta.scheme == "int4", meta
    gs = meta.group_size
    if meta.layout == "int4_canonical":  # two codes a byte, low nibble = even k
        q = parts["qweight"]
        codes = torch.empty(n, k, dtype=torch.float32, device=q.device)
        codes[:, 0::2] = (q & 0x0F).float()
        codes[:, 1::2] = (q >> 4).float()
        scales = parts["scales"].float().repeat_interleave(gs, dim=1)
        zeros = parts["zeros"].float().repeat_interleave(gs, dim=1)
        return (codes - 8.0) * scales + zeros
    return _int4_codes_from_torch_pack(parts["qweight"], parts["scales_and_zeros"], n, k, gs)


def hf_greedy(model, prompts: list[list[int]], cache_factory=None) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        kwargs = {"cache": cache_factory()} if cache_factory else {}
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                             pad_token_id=0, **kwargs)
        outs.append(gen[0, len(p):].tolist())
    return outs


def dequantized_hf_model(model_dir: str, llm: LLM, device: str = "cpu"):
    """transformers' model with each projection replaced by the test's dequantization of the engine's weight."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    hf.generation_config.eos_token_id = None
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q_rows, kv_rows = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    engine_layers = llm.llm_engine.loaded.model.model.layers
    with torch.no_grad():
        for ours, theirs in zip(engine_layers, hf.model.layers, strict=True):
            fused = {
                "qkv": (ours.self_attn.qkv_proj.weight, [theirs.self_attn.q_proj, theirs.self_attn.k_proj,
                                                          theirs.self_attn.v_proj], [q_rows, kv_rows, kv_rows]),
                "o": (ours.self_attn.o_proj.weight, [theirs.self_attn.o_proj], None),
                "gate_up": (ours.mlp.gate_up_proj.weight, [theirs.mlp.gate_proj, theirs.mlp.up_proj],
                            [cfg.intermediate_size] * 2),
                "down": (ours.mlp.down_proj.weight, [theirs.mlp.down_proj], None),
            }
            for name, (qw, targets, rows) in fused.items():
                assert getattr(qw, "is_quantized_weight", False), f"{name} is not quantized"
                dense = dequantize(qw.meta, qw.parts)
                pieces = dense.split(rows) if rows else [dense]
                for target, piece in zip(targets, pieces, strict=True):
                    assert target.weight.shape == piece.shape
                    # The quantized weight is close to the original, and not equal to it (it was quantized).
                    assert not torch.equal(target.weight, piece)
                    target.weight.copy_(piece.to(device))
    return hf


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("model_name", ["llama", "qwen2"])
def test_quantized_greedy_matches_transformers_on_own_dequantization(tiny_model_factory, model_name: str,
                                                                     scheme: str) -> None:
    model_dir = tiny_model_factory(model_name)
    llm = LLM(model=model_dir, dtype="float32", quantization=scheme, daemon=False, max_model_len=256)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    expected = hf_greedy(dequantized_hf_model(model_dir, llm), PROMPTS)
    assert got == expected


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """What an e4m3 cache with scale 1.0 gives back: clamp to the format's range, round to nearest, read back."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype)


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
