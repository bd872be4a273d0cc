"""The transformers references the numerics are checked against (float32, greedy, one prompt at a time), and
this suite's own dequantization of the engine's stored parts, written from the formats' definitions (int8:
q * scale per output channel; fp8 e4m3: q * one scale; int4: (q - 8) * scale + zero per group, torch's tinygemm
convention), never keepwarm's dequantize.
"""

from __future__ import annotations

from typing import Any

import torch

MAX_TOKENS = 16
# The quantization references' prompts (tests/unit/worker/test_quant_reference.py, its GPU twin
# in test_gpu_reference.py).
PROMPTS = [[7], [5, 9, 200], list(range(20, 60)), [300 + i % 50 for i in range(70)], [11, 12] * 9]
FP8_MAX = 448.0


def load_hf(model_dir: str) -> Any:
    """transformers' model of ``model_dir`` in float32 with no EOS (the engine runs with ``ignore_eos``)."""
    import transformers  # deferred: heavy, and only the reference tests need it

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    return hf


def hf_greedy(model: Any, prompts: list[list[int]], cache_factory: Any = None,
              max_new_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (``cache_factory()``: its KV cache)."""
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        kwargs = {"cache": cache_factory()} if cache_factory else {}
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0, **kwargs)
        outs.append(gen[0, len(p):].tolist())
    return outs


def _int4_codes_from_torch_pack(qweight: torch.Tensor, scales_and_zeros: torch.Tensor, n: int, k: int,
                                gs: int) -> torch.Tensor:
    """Dense weight of torch's CPU int4 pack, computed by torch's own int4 matmul on the identity matrix (torch's
    kernel, not keepwarm's unpacking): I @ W^T = W^T."""
    eye = torch.eye(k, dtype=scales_and_zeros.dtype, device=qweight.device)
    return torch._weight_int4pack_mm_for_cpu(eye, qweight, gs, scales_and_zeros).t().float()


def dequantize(meta: Any, parts: dict[str, torch.Tensor]) -> torch.Tensor:
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


def dequantized_hf_model(model_dir: str, llm: Any, device: str = "cpu") -> Any:
    """transformers' model with each projection replaced by the test's dequantization of the engine's weight."""
    hf = load_hf(model_dir).to(device)
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


def dequantized_moe_hf(model_dir: str, llm: Any, device: str = "cpu") -> Any:
    """transformers' model with every projection the engine quantized (attention, each expert's gate_up / down,
    Qwen3-MoE's dense MLP) replaced by this suite's own dequantization of the engine's parts
    (``dequantize``, written from the formats' definitions, not keepwarm's dequantize)."""
    hf = load_hf(model_dir).to(device)
    cfg = hf.config
    q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    with torch.no_grad():
        for ours, theirs in zip(llm.llm_engine.loaded.model.model.layers, hf.model.layers, strict=True):
            attn, mlp = theirs.self_attn, theirs.mlp
            pairs = [(ours.self_attn.qkv_proj.weight, [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                      [q_rows, kv_rows, kv_rows]), (ours.self_attn.o_proj.weight, [attn.o_proj.weight], None)]
            if hasattr(ours.mlp, "experts"):  # transformers stacks the experts: [E, 2I, H] and [E, H, I]
                assert not getattr(ours.mlp.gate.weight, "is_quantized_weight", False)  # the router stays dense
                for e, expert in enumerate(ours.mlp.experts):
                    pairs += [(expert.gate_up_proj.weight, [mlp.experts.gate_up_proj[e]], None),
                              (expert.down_proj.weight, [mlp.experts.down_proj[e]], None)]
            else:
                pairs += [(ours.mlp.gate_up_proj.weight, [mlp.gate_proj.weight, mlp.up_proj.weight],
                           [mlp.gate_proj.weight.shape[0]] * 2),
                          (ours.mlp.down_proj.weight, [mlp.down_proj.weight], None)]
            for qw, targets, rows in pairs:
                assert getattr(qw, "is_quantized_weight", False), f"{targets[0].shape} weight is not quantized"
                dense = dequantize(qw.meta, qw.parts)
                for target, piece in zip(targets, dense.split(rows) if rows else [dense], strict=True):
                    assert target.shape == piece.shape and not torch.equal(target, piece.to(device))
                    target.copy_(piece.to(device))
    return hf


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """What an e4m3 cache with scale 1.0 gives back: clamp to the format's range, round to nearest, read back."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype)
