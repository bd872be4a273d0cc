"""Inputs several test files share: the engine tests' prompts and a decode-attention plan for the native kernels."""

from __future__ import annotations

import random

import torch

from keepwarm.kernels import native_ops


def make_prompts(seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """16 prompts of different lengths (1..70 tokens); some share prefixes so prefix caching is exercised."""
    rng = random.Random(seed)
    lengths = [1, 2, 5, 9, 15, 16, 17, 23, 31, 32, 33, 40, 47, 55, 64, 70]
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]
    prompts[6] = prompts[5] + prompts[6][:1]  # 16-token block shared, then one more token
    prompts[12] = prompts[9] + prompts[12][:15]  # two full blocks shared
    return prompts


def plan_inputs(seed: int, s: int = 32) -> tuple[torch.Tensor, ...]:
    """(q, k cache, v cache, plan) of ``s`` bfloat16 decode rows over 400 random blocks, contexts 60..189."""
    g = torch.Generator().manual_seed(seed)
    plan = native_ops.attention_plan(torch.randperm(400, generator=g)[:s * 12].reshape(s, 12),
                                     torch.randint(60, 190, (s,), generator=g), None, None)
    kc, vc = (torch.randn(3, 400, 16, 64, generator=g).bfloat16() for _ in range(2))
    return torch.randn(s, 9, 64, generator=g).bfloat16(), kc, vc, plan
