"""Kernels vs oracles: HF modules for norm/rotary, a naive dense loop for paged attention; plus dispatch."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from keepwarm import kernels
from keepwarm.kernels import cpu, reference
from keepwarm.kernels import registry as kernel_registry

FP8 = torch.float8_e4m3fn
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def _default_backend() -> Iterator[None]:
    # A KEEPWARM_KERNELS left in the environment (or a test's set_backend) must not change what others exercise.
    previous = kernels.set_backend("auto")
    yield
    kernels.set_backend(previous)


# --------------------------------------------------------------------------- paged attention


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S+1] int32
    keys: list[torch.Tensor]  # per sequence [seq_len, Hk, D] float32, as written (before cache rounding)
    values: list[torch.Tensor]
    slots: torch.Tensor  # [sum seq_len] slot of every written position, in (seq, position) order
    specs: list[tuple[int, int]]  # (q_len, seq_len) per sequence


def _garbage_cache(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # Large garbage everywhere a test did not write: any unmasked read of an unwritten slot swamps the output.
    # (Finite, not NaN: masked slots are excluded by the softmax mask, and the engine zero-fills its pools.)
    if dtype == FP8:
        return torch.full(shape, 0x7E, dtype=torch.uint8).view(FP8)  # 0x7E is e4m3fn's largest value, 448
    return torch.full(shape, 1e4, dtype=dtype)


def _make_batch(
    specs: list[tuple[int, int]],
    hq: int,
    hk: int,
    d: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    num_blocks: int | None = None,
    min_block_id: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    device: str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """Random K/V for every context position, written through write_kv_cache in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    blocks_per_seq = [math.ceil(seq_len / block_size) for _, seq_len in specs]
    num_blocks = num_blocks or sum(blocks_per_seq) + 7
    ids = min_block_id + torch.randperm(num_blocks - min_block_id, generator=g)[: sum(blocks_per_seq)]
    # Columns past a sequence's blocks hold huge ids: reading one would raise an index error.
    block_tables = torch.randint(2**30, 2**31 - 1, (len(specs), max(blocks_per_seq) + 2), generator=g)
    keys, values, slots = [], [], []
    used = 0
    for s, (_, seq_len) in enumerate(specs):
        own = ids[used : used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        block_tables[s, : len(own)] = own
        pos = torch.arange(seq_len)
        slots.append(own[pos // block_size] * block_size + pos % block_size)
        keys.append(torch.randn(seq_len, hk, d, generator=g))
        values.append(torch.randn(seq_len, hk, d, generator=g))
    slots_all = torch.cat(slots)
    # Padding rows (slot -1) carry huge values so a write that failed to skip them is obvious.
    n_pad = 5
    k_all = torch.cat([torch.cat(keys), torch.full((n_pad, hk, d), 1e4)])
    v_all = torch.cat([torch.cat(values), torch.full((n_pad, hk, d), 1e4)])
    slot_mapping = torch.cat([slots_all, torch.full((n_pad,), -1, dtype=torch.long)])
    perm = torch.randperm(len(slot_mapping), generator=g)

    key_cache = _garbage_cache((hk, num_blocks, block_size, d), cache_dtype).to(device)
    value_cache = _garbage_cache((hk, num_blocks, block_size, d), cache_dtype).to(device)
    kernels.write_kv_cache(
        k_all[perm].to(device=device, dtype=dtype), v_all[perm].to(device=device, dtype=dtype),
        key_cache, value_cache, slot_mapping[perm].to(device), k_scale, v_scale,
    )
    q_lens = [q_len for q_len, _ in specs]
    return PagedBatch(
        query=torch.randn(sum(q_lens), hq, d, generator=g).to(device=device, dtype=dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(device=device, dtype=torch.int32),
        seq_lens=torch.tensor([seq_len for _, seq_len in specs], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                                     device=device),
        keys=keys,
        values=values,
        slots=slots_all,
        specs=specs,
    )


def _oracle(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
            specs: list[tuple[int, int]], scale: float, window: int | None = None,
            softcap: float | None = None) -> torch.Tensor:
    """Dense causal attention, one query row at a time, float32 on CPU; with ``window`` a row at position p sees
    keys p-window+1..p, with ``softcap`` c the scores are c * tanh(s / c)."""
    query = query.float().cpu()
    hq, hk = query.shape[1], keys[0].shape[1]
    out = torch.zeros_like(query)
    start = 0
    for s, (q_len, seq_len) in enumerate(specs):
        k = keys[s].float().repeat_interleave(hq // hk, dim=1)  # [seq_len, Hq, D]
        v = values[s].float().repeat_interleave(hq // hk, dim=1)
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,lhd->hl", query[start + i], k[lo: pos + 1]) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[start + i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[lo: pos + 1])
        start += q_len
    return out


def _run(b: PagedBatch, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    return kernels.paged_attention(
        b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc, scale,
        k_scale, v_scale, max_query_len=max(q for q, _ in b.specs),
    )


# (q_len, seq_len): decodes (incl. a 1-token context and block-boundary lengths), a prefill with no
# cached prefix, and prefill chunks on top of cached prefixes.
MIXED = [(1, 1), (6, 6), (1, 33), (5, 40), (1, 64), (3, 19), (1, 17), (9, 70), (1, 100)]


def _mixed(seed: int) -> list[tuple[int, int]]:
    specs = list(MIXED)
    random.Random(seed).shuffle(specs)
    return specs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("hq", "hk"), [(8, 2), (4, 4)])
def test_paged_attention_mixed_fp32(hq: int, hk: int, block_size: int, d: int, device: str) -> None:
    specs = _mixed(seed=block_size + d + hq)
    b = _make_batch(specs, hq, hk, d, block_size, device=device, seed=block_size * d + hk)
    scale = d**-0.5
    out = _run(b, scale)
    assert out.shape == b.query.shape and out.dtype == torch.float32
    expected = _oracle(b.query, b.keys, b.values, specs, scale)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_mixed_half(dtype: torch.dtype, device: str) -> None:
    specs = _mixed(seed=3)
    b = _make_batch(specs, 8, 2, 64, 16, dtype=dtype, device=device, seed=3)
    out = _run(b, 0.125)
    assert out.dtype == dtype
    # The oracle sees the same rounded K/V/Q and computes in fp32; what's left is rounding the output to
    # 8 (bf16) / 11 (fp16) mantissa bits, so: bf16 atol=rtol=1.6e-2, fp16 atol=rtol=2e-3.
    keys = [k.to(dtype) for k in b.keys]
    values = [v.to(dtype) for v in b.values]
    tol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3
    expected = _oracle(b.query, keys, values, specs, 0.125)
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


def _poison_outside_windows(b: PagedBatch, window: int) -> None:
    """Point every table entry wholly before all of a sequence's rows' windows at a huge block id: a kernel that
    reads such a block fails, so the test proves those blocks could be freed."""
    block_size = b.key_cache.shape[2]
    for s, (q_len, seq_len) in enumerate(b.specs):
        first_visible = max(0, seq_len - q_len - window + 1)
        b.block_tables[s, : first_visible // block_size] = 2**31 - 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize(("window", "block_size"), [(1, 8), (7, 8), (16, 16), (33, 16), (200, 32)])
def test_paged_attention_sliding_window(window: int, block_size: int, softcap: float | None, device: str) -> None:
    specs = _mixed(seed=window)
    b = _make_batch(specs, 8, 2, 32, block_size, device=device, seed=window + block_size)
    _poison_outside_windows(b, window)
    out = kernels.paged_attention(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                                  b.query_start_loc, 0.3, max_query_len=9, sliding_window=window,
                                  logit_softcap=softcap)
    expected = _oracle(b.query, b.keys, b.values, specs, 0.3, window=window, softcap=softcap)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    if window < 100:  # the window changes the answer: a test that would pass without it proves nothing
        assert not torch.allclose(expected, _oracle(b.query, b.keys, b.values, specs, 0.3, softcap=softcap))


def test_paged_attention_decode_only_and_prefill_only() -> None:
    for specs in ([(1, 5), (1, 1), (1, 48), (1, 31)], [(7, 7), (4, 30), (2, 2)]):
        b = _make_batch(specs, 4, 2, 32, 8, seed=len(specs))
        torch.testing.assert_close(_run(b, 0.2), _oracle(b.query, b.keys, b.values, specs, 0.2),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("specs", [MIXED, [(1, 5), (1, 1), (1, 48), (1, 31)]], ids=["mixed", "decode-only"])
def test_step_plan_changes_no_bit(specs: list[tuple[int, int]], pad: int) -> None:
    """kernels.plan_attention, built once per step and passed to every layer, gives exactly what each call
    derives alone: the same KV writes and the same attention, for each window the plan covers, with and without
    padding rows after the last sequence (slot -1, a zero output row)."""
    b = _make_batch(specs, 8, 2, 32, 8, seed=11)
    g = torch.Generator().manual_seed(12)
    query = torch.cat([b.query, torch.randn(pad, 8, 32, generator=g)])
    new_kv = torch.randn(2, query.shape[0], 2, 32, generator=g)
    slots = [int(b.block_tables[s, p // 8]) * 8 + p % 8 for s, (q_len, seq_len) in enumerate(specs)
             for p in range(seq_len - q_len, seq_len)]
    slot_mapping = torch.tensor(slots + [-1] * pad)
    windows = (None, 7, 33)
    plan = kernels.plan_attention(b.block_tables, b.seq_lens, b.query_start_loc, slot_mapping, 8, windows)
    assert plan is not None and plan.ref.decode_only == (len(specs) == 4)
    planned = (b.key_cache.clone(), b.value_cache.clone())
    kernels.write_kv_cache(new_kv[0], new_kv[1], b.key_cache, b.value_cache, slot_mapping)
    kernels.write_kv_cache(new_kv[0], new_kv[1], *planned, slot_mapping, plan=plan)
    assert torch.equal(planned[0], b.key_cache) and torch.equal(planned[1], b.value_cache)
    for window in windows:
        args = (query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.2)
        alone = kernels.paged_attention(*args, sliding_window=window)
        assert torch.equal(kernels.paged_attention(*args, sliding_window=window, plan=plan), alone)
        assert not alone[query.shape[0] - pad:].any()
    with pytest.raises(ValueError, match="no gather for sliding_window=5"):
        kernels.paged_attention(*args, sliding_window=5, plan=plan)


def test_paged_attention_large_block_pool() -> None:
    # 70k blocks with ids > 2**16; tiny otherwise (Hk=1, D=32: ~36M elements per cache).
    specs = [(1, 40), (4, 50), (1, 17), (3, 3)]
    num_blocks = 70_000
    b = _make_batch(specs, 2, 1, 32, 16, num_blocks=num_blocks, min_block_id=num_blocks - 64, seed=7)
    used = b.block_tables[b.block_tables < num_blocks]
    assert used.min() > 2**16 and used.max() < num_blocks
    torch.testing.assert_close(_run(b, 0.3), _oracle(b.query, b.keys, b.values, specs, 0.3),
                               atol=1e-5, rtol=1e-5)


def _fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_fp8_cache(device: str) -> None:
    specs = _mixed(seed=11)
    k_scale, v_scale = 0.02, 0.01  # |randn| / scale stays well inside ±448: no clamping here
    b = _make_batch(specs, 8, 2, 64, 16, cache_dtype=FP8, k_scale=k_scale, v_scale=v_scale,
                    device=device, seed=11)
    block_size = b.key_cache.shape[2]
    blocks, offsets = b.slots // block_size, b.slots % block_size
    stored_k = b.key_cache.cpu()[:, blocks, offsets].transpose(0, 1)  # [T, Hk, D]
    assert torch.equal(stored_k.view(torch.uint8), _fp8(torch.cat(b.keys), k_scale).view(torch.uint8))
    stored_v = b.value_cache.cpu()[:, blocks, offsets].transpose(0, 1)
    assert torch.equal(stored_v.view(torch.uint8), _fp8(torch.cat(b.values), v_scale).view(torch.uint8))

    out = _run(b, 0.125, k_scale, v_scale)
    # Exact path check: against the oracle on the dequantized cache contents.
    deq = [_fp8(k, k_scale).float() * k_scale for k in b.keys], [_fp8(v, v_scale).float() * v_scale
                                                                 for v in b.values]
    torch.testing.assert_close(out.cpu(), _oracle(b.query, *deq, specs, 0.125), atol=1e-5, rtol=1e-5)
    # Against full-precision K/V: e4m3 keeps 3 mantissa bits (up to ~6% per element). Over seeds the max
    # error is ~0.16 and the mean ~0.009 (outputs average ~0.29), so: max atol=0.25, mean abs error < 0.02.
    err = (out.cpu() - _oracle(b.query, b.keys, b.values, specs, 0.125)).abs()
    assert err.max() < 0.25 and err.mean() < 0.02


# --------------------------------------------------------------------------- write_kv_cache


def test_write_kv_cache_skips_padding_and_handles_views() -> None:
    nb, bs, hk, d = 4, 4, 2, 3
    # key/value caches [hk, nb, bs, d] as strided views into one [hk, nb, 2, bs, d] buffer (non-contiguous).
    buf = torch.full((hk, nb, 2, bs, d), 7.0, dtype=torch.bfloat16)
    key_cache, value_cache = buf[:, :, 0], buf[:, :, 1]
    slot_mapping = torch.tensor([5, -1, 0, -1, 10])
    key = torch.randn(5, hk, d, generator=torch.Generator().manual_seed(0))
    value = key + 1
    kernels.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    expected = torch.full_like(buf, 7.0)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected[:, slot // bs, 0, slot % bs] = key[t].to(torch.bfloat16)
            expected[:, slot // bs, 1, slot % bs] = value[t].to(torch.bfloat16)
    # In particular the last slot of the pool (where a -1 index would wrap to) is untouched.
    assert torch.equal(buf, expected)


def test_write_kv_cache_fp8_quantizes_and_clamps() -> None:
    nb, bs, hk, d = 2, 4, 1, 8
    key = torch.randn(3, hk, d, generator=torch.Generator().manual_seed(1))
    key[0, 0, :2] = torch.tensor([100.0, -100.0])  # / 0.05 = ±2000: must saturate to ±448, not NaN
    key_cache = torch.zeros(hk, nb, bs, d, dtype=FP8)
    value_cache = torch.zeros(hk, nb, bs, d, dtype=FP8)
    kernels.write_kv_cache(key, key, key_cache, value_cache, torch.tensor([1, 6, -1]), 0.05, 0.5)
    assert torch.equal(key_cache[:, 0, 1].view(torch.uint8), _fp8(key[0], 0.05).view(torch.uint8))
    assert torch.equal(key_cache[:, 1, 2].view(torch.uint8), _fp8(key[1], 0.05).view(torch.uint8))
    assert torch.equal(value_cache[:, 1, 2].view(torch.uint8), _fp8(key[1], 0.5).view(torch.uint8))
    assert key_cache[0, 0, 1, :2].float().tolist() == [448.0, -448.0]
    assert not key_cache.float().isnan().any()
    assert torch.count_nonzero(key_cache.view(torch.uint8)) == torch.count_nonzero(
        key_cache[:, [0, 1], [1, 2]].view(torch.uint8))  # nothing written outside the two valid slots


# --------------------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_rms_norm_matches_hf(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    hf.weight.copy_(torch.randn(96, generator=g))
    x = (torch.randn(13, 96, generator=g) * 3).to(dtype)
    assert torch.equal(kernels.rms_norm(x, hf.weight, 1e-5), hf(x))


@torch.no_grad()
def test_rms_norm_float32_weight_on_bf16_promotes_as_hf() -> None:
    """A float32 weight on bf16 activations: HF multiplies after the cast back, so the result is float32."""
    g = torch.Generator().manual_seed(6)
    hf = LlamaRMSNorm(96, eps=1e-5)
    hf.weight.copy_(torch.randn(96, generator=g))
    x = (torch.randn(5, 96, generator=g) * 3).bfloat16()
    out = kernels.rms_norm(x, hf.weight, 1e-5)
    assert out.dtype == torch.float32 and torch.equal(out, hf(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_fused_add_rms_norm_matches_hf(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    hf = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    hf.weight.copy_(torch.randn(64, generator=g))
    # Non-contiguous views as inputs; the kernel must not write into them.
    x = torch.randn(9, 128, generator=g).to(dtype)[:, :64]
    residual = torch.randn(64, 9, generator=g).to(dtype).t()
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = kernels.fused_add_rms_norm(x, residual, hf.weight, 1e-6)
    assert torch.equal(new_residual, x + residual) and new_residual.dtype == dtype
    assert torch.equal(normed, hf(x + residual))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


# --------------------------------------------------------------------------- rotary


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        # yarn has attention_scaling != 1, exercising the cache's scaling factor.
        {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    ],
)
@torch.no_grad()
def test_rotary_neox_matches_hf(rope_parameters: dict[str, object]) -> None:
    head_dim, hq, hk, max_pos, t = 64, 4, 2, 512, 11
    config = LlamaConfig(hidden_size=hq * head_dim, num_attention_heads=hq, num_key_value_heads=hk,
                         max_position_embeddings=max_pos, rope_parameters=rope_parameters)
    rope = LlamaRotaryEmbedding(config)
    cache = kernels.build_cos_sin_cache(head_dim, max_pos, rope.inv_freq, rope.attention_scaling)
    g = torch.Generator().manual_seed(2)
    positions = torch.randint(0, max_pos, (t,), generator=g)
    q = torch.randn(t, hq * head_dim, generator=g)
    k = torch.randn(t, hk * head_dim, generator=g)
    cos, sin = rope(q, positions[None])  # [1, t, head_dim], emb = cat(freqs, freqs)
    half = head_dim // 2
    assert torch.equal(cache[positions], torch.cat([cos[0, :, :half], sin[0, :, :half]], -1))
    q_hf, k_hf = apply_rotary_pos_emb(q.view(t, hq, head_dim), k.view(t, hk, head_dim), cos[0], sin[0])
    q_out, k_out = kernels.rotary_embedding(positions, q, k, head_dim, cache, is_neox=True)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert torch.equal(q_out, q_hf.reshape(q.shape)) and torch.equal(k_out, k_hf.reshape(k.shape))


def _inv_freq(rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))


def test_rotary_partial_neox_matches_hf() -> None:
    head_dim, rot_dim, h, t = 64, 16, 3, 7
    cache = kernels.build_cos_sin_cache(rot_dim, 100, _inv_freq(rot_dim))
    g = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 100, (t,), generator=g)
    q = torch.randn(t, h * head_dim, generator=g)
    k = torch.randn(t, 1 * head_dim, generator=g)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    q3, k3 = q.view(t, h, head_dim), k.view(t, 1, head_dim)
    q_rot, k_rot = apply_rotary_pos_emb(q3[..., :rot_dim], k3[..., :rot_dim], cos, sin)
    q_exp = torch.cat([q_rot, q3[..., rot_dim:]], -1).reshape(q.shape)
    k_exp = torch.cat([k_rot, k3[..., rot_dim:]], -1).reshape(k.shape)
    q_out, k_out = kernels.rotary_embedding(positions, q, k, head_dim, cache)
    assert torch.equal(q_out, q_exp) and torch.equal(k_out, k_exp)


@pytest.mark.parametrize("rot_dim", [8, 4])
def test_rotary_gptj_matches_loop(rot_dim: int) -> None:
    head_dim, h, t = 8, 2, 5
    cache = kernels.build_cos_sin_cache(rot_dim, 32, _inv_freq(rot_dim))
    g = torch.Generator().manual_seed(4)
    positions = torch.randint(0, 32, (t,), generator=g)
    q = torch.randn(t, h * head_dim, generator=g)
    k = torch.randn(t, head_dim, generator=g)

    def oracle(x: torch.Tensor) -> torch.Tensor:
        x = x.view(t, -1, head_dim)
        out = x.clone()
        for i in range(t):
            for j in range(x.shape[1]):
                for p in range(rot_dim // 2):
                    c, s = cache[positions[i], p], cache[positions[i], rot_dim // 2 + p]
                    a, b = x[i, j, 2 * p], x[i, j, 2 * p + 1]
                    out[i, j, 2 * p], out[i, j, 2 * p + 1] = a * c - b * s, b * c + a * s
        return out.reshape(t, -1)

    q_out, k_out = kernels.rotary_embedding(positions, q, k, head_dim, cache, is_neox=False)
    torch.testing.assert_close(q_out, oracle(q), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, oracle(k), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_bf16_is_fp32_math_rounded(is_neox: bool) -> None:
    cache = kernels.build_cos_sin_cache(32, 64, _inv_freq(32))
    g = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 64, (6,), generator=g)
    q = torch.randn(6, 4 * 32, generator=g).bfloat16()
    k = torch.randn(6, 2 * 32, generator=g).bfloat16()
    q_ref, k_ref = kernels.rotary_embedding(positions, q.float(), k.float(), 32, cache, is_neox)
    q_out, k_out = kernels.rotary_embedding(positions, q, k, 32, cache, is_neox)
    assert q_out.dtype == torch.bfloat16
    assert torch.equal(q_out, q_ref.bfloat16()) and torch.equal(k_out, k_ref.bfloat16())


@pytest.mark.parametrize(("rot_dim", "is_neox"), [(32, True), (16, True), (32, False)])
def test_rotary_plan_changes_no_bit(rot_dim: int, is_neox: bool) -> None:
    """kernels.plan_rotary, gathered once per step and passed to every layer, gives exactly what each call
    gathers alone (whole-head neox takes the roll path, partial and GPT-J the halves), inputs untouched."""
    cache = kernels.build_cos_sin_cache(rot_dim, 64, _inv_freq(rot_dim))
    g = torch.Generator().manual_seed(7)
    positions = torch.randint(0, 64, (5,), generator=g)
    qkv = torch.randn(5, 8 * 32, generator=g).bfloat16()
    q, k = qkv[:, :6 * 32], qkv[:, 6 * 32:]  # views into one fused projection, as the model passes them
    before = qkv.clone()
    plan = kernels.plan_rotary(positions, cache)
    assert plan is not None  # the torch backend on CPU
    alone = kernels.rotary_embedding(positions, q, k, 32, cache, is_neox)
    planned = kernels.rotary_embedding(positions, q, k, 32, cache, is_neox, plan=plan)
    assert all(torch.equal(a, b) for a, b in zip(alone, planned, strict=True))
    assert torch.equal(qkv, before)
    other = kernels.plan_rotary(positions + 1, cache)  # the plan is what is used: other positions, other result
    assert not torch.equal(kernels.rotary_embedding(positions, q, k, 32, cache, is_neox, plan=other)[0], alone[0])


# --------------------------------------------------------------------------- dispatch


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, object]]:
    """A private copy of the registry (and of the logged set and the resolved choices), restored after the test."""
    impls = {name: dict(by_backend) for name, by_backend in kernel_registry._IMPLS.items()}
    monkeypatch.setattr(kernel_registry, "_IMPLS", impls)
    monkeypatch.setattr(kernel_registry, "_LOGGED", set())
    monkeypatch.setattr(kernel_registry, "_RESOLVED", {})
    return kernel_registry._IMPLS


def test_torch_backend_selects_the_cpu_path(registry: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    kernels.set_backend("torch")
    for name in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "write_kv_cache", "paged_attention"):
        assert kernels.get_impl(name, torch.device("cpu")) is getattr(cpu, name)
        # Forced torch wins even for CUDA inputs with a triton impl present.
        kernels.register(name, "triton", lambda *a: None)
        assert kernels.select_backend(name, torch.device("cuda")) == "torch"


def test_forced_triton_without_impl_raises(registry: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    registry["rms_norm"].pop("triton", None)
    kernels.set_backend("triton")
    with pytest.raises(kernels.KernelBackendError, match="'rms_norm' has no triton implementation"):
        kernels.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)


def test_registered_backend_is_picked_up(registry: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        calls.append(eps)
        return torch.zeros_like(x)

    kernels.register("rms_norm", "triton", fake_rms_norm)
    x = torch.ones(2, 4)
    # auto: CPU tensors stay on torch; a CUDA device would get triton (if triton is importable).
    assert torch.equal(kernels.rms_norm(x, torch.ones(4), 1e-6), reference.rms_norm(x, torch.ones(4), 1e-6))
    assert calls == []
    monkeypatch.setattr(kernel_registry, "_TRITON_IMPORTABLE", True)
    assert kernels.select_backend("rms_norm", torch.device("cuda")) == "triton"
    monkeypatch.setattr(kernel_registry, "_TRITON_IMPORTABLE", False)
    assert kernels.select_backend("rms_norm", torch.device("cuda")) == "torch"
    kernels.set_backend("triton")
    assert torch.equal(kernels.rms_norm(x, torch.ones(4), 1e-3), torch.zeros_like(x))
    assert calls == [1e-3]


def test_dispatch_rejects_bad_env_and_backend(registry: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels.register("rms_norm", "cuda", reference.rms_norm)
    with pytest.raises(ValueError, match="kernel backend='fast'"):
        kernels.set_backend("fast")
    monkeypatch.setenv(kernels.ENV_VAR, "fast")
    kernels.set_backend(None)  # re-read the environment at the next dispatch
    with pytest.raises(ValueError, match="KEEPWARM_KERNELS='fast'"):
        kernels.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)


def test_backend_read_from_env_once(registry: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment is read at the first dispatch; changing it later has no effect until set_backend(None)."""
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    kernels.set_backend(None)
    kernels.register("rms_norm", "triton", lambda *a: None)
    assert kernels.select_backend("rms_norm", torch.device("cpu")) == "torch"
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    assert kernels.select_backend("rms_norm", torch.device("cpu")) == "torch"
    assert kernels.set_backend("triton") == "torch"
    assert kernels.select_backend("rms_norm", torch.device("cpu")) == "triton"


def test_backend_choice_logged_once(registry: dict, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="keepwarm.kernels")
    for _ in range(3):
        kernels.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)
    records = [r for r in caplog.records if r.name == "keepwarm.kernels"]
    assert len(records) == 1 and "rms_norm" in records[0].getMessage()
    assert "torch" in records[0].getMessage()
