"""The C glue of a decode step (kernels/csrc/glue.c: ``kw_rms_norm``, ``kw_rotary_neox``, ``kw_store_kv``) against
the torch ops it replaces in kernels/reference.py, with the switch (``KEEPWARM_CPU_NATIVE``) off and on:
- rotary and the KV store are bit-identical (the same roundings, nothing summed);
- so is RMSNorm: its float32 sum of squares is added up in ATen's order (checked here over widths that take
  every branch of that order: leftover vectors, one and two cascade levels);
- strided inputs (q, k, v are views into the fused qkv output), padding slots (-1), and refusals: a slot outside
  the pools raises with nothing written;
- then greedy tokens of bf16 tiny models with the glue on and off.
Needs AVX2 + FMA and a C compiler; elsewhere the tests say which is missing."""

from __future__ import annotations

import pytest
import torch
from support.inputs import make_prompts, plan_inputs

from keepwarm import LLM, SamplingParams
from keepwarm.kernels import cpu, cpu_native, dispatch, native_ops, reference

pytestmark = pytest.mark.skipif(not cpu_native.glue_on(),
                                reason=f"native glue: {cpu_native.reasons()[1]}")


def _both(monkeypatch: pytest.MonkeyPatch, fn):
    """fn() with the C glue off, then on."""
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    off = fn()
    monkeypatch.setenv(cpu_native.ENV_VAR, "1")
    return off, fn()


@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (8, 64), (33, 2048), (5, 8), (3, 8200), (2, 40),
                                             (4, 1032), (1, 24576)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_is_torch_but_for_the_order_of_one_sum(monkeypatch, rows, hidden, residual) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    wide = torch.randn(rows, hidden + 24, generator=g).mul(3).bfloat16()
    x = wide[:, 8:8 + hidden]  # strided rows, as a view into a wider output
    res = torch.randn(rows, hidden, generator=g).bfloat16()
    w = torch.randn(hidden, generator=g).bfloat16()
    if residual:
        (off, off_res), (on, on_res) = _both(monkeypatch, lambda: cpu.fused_add_rms_norm(x, res, w, 1e-5))
        assert torch.equal(off_res, on_res)  # one add, one rounding: exact
    else:
        off, on = _both(monkeypatch, lambda: cpu.rms_norm(x, w, 1e-5))
    assert on.shape == off.shape and on.dtype == torch.bfloat16
    assert torch.equal(on, off), f"{int((on != off).sum())} of {on.numel()} outputs differ"
    # the input is not touched
    assert torch.equal(x, wide[:, 8:8 + hidden])


def test_rms_norm_leaves_float32_and_odd_widths_to_torch(monkeypatch) -> None:
    """What the glue cannot compute takes the torch path unchanged: float32 rows, widths not a multiple of 8."""
    for x, w in ((torch.randn(3, 64), torch.randn(64)), (torch.randn(3, 12).bfloat16(), torch.randn(12).bfloat16())):
        off, on = _both(monkeypatch, lambda x=x, w=w: cpu.rms_norm(x, w, 1e-6))
        assert torch.equal(off, on)


@pytest.mark.parametrize(("T", "hq", "hk", "d"), [(1, 9, 3, 64), (7, 4, 4, 32), (32, 8, 2, 128), (3, 2, 1, 16)])
def test_rotary_is_bit_identical_on_qkv_views(monkeypatch, T, hq, hk, d) -> None:
    g = torch.Generator().manual_seed(T * hq + d)
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).mul(4).bfloat16()
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    table = reference.build_cos_sin_cache(d, 4096, inv_freq, 1.3)
    positions = torch.randint(0, 4096, (T,), generator=g)
    plan = reference.plan_rotary(positions, table)
    (qo0, ko0), (qo1, ko1) = _both(monkeypatch,
                                   lambda: cpu.rotary_embedding(positions, q, k, d, table, True, plan))
    assert torch.equal(qo0, qo1) and torch.equal(ko0, ko1)
    assert qo1.shape == q.shape and ko1.shape == k.shape


def test_rotary_leaves_partial_and_gptj_rotation_to_torch(monkeypatch) -> None:
    d = 64
    q, k = torch.randn(2, 2 * d).bfloat16(), torch.randn(2, d).bfloat16()
    positions = torch.tensor([3, 9])
    for rot, neox in ((32, True), (64, False)):
        table = reference.build_cos_sin_cache(rot, 64, 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot)))
        (a0, b0), (a1, b1) = _both(monkeypatch,
                                   lambda t=table, n=neox: cpu.rotary_embedding(positions, q, k, d, t, n))
        assert torch.equal(a0, a1) and torch.equal(b0, b1)


def _pools(hk: int, nb: int, bs: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((hk, nb, bs, d), 7.0, dtype=torch.bfloat16),
            torch.full((hk, nb, bs, d), -7.0, dtype=torch.bfloat16))


def test_store_kv_equals_torch_and_skips_padding(monkeypatch) -> None:
    T, hq, hk, d, nb, bs = 6, 4, 2, 32, 5, 4
    qkv = torch.randn(T, (hq + 2 * hk) * d).bfloat16()
    _, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    k, v = k.reshape(T, hk, d), v.reshape(T, hk, d)  # strided rows: views into qkv
    slots = torch.tensor([19, 0, -1, 7, 8, -1], dtype=torch.int64)
    results = []
    for native in ("0", "1"):
        monkeypatch.setenv(cpu_native.ENV_VAR, native)
        kc, vc = _pools(hk, nb, bs, d)
        cpu.write_kv_cache(k, v, kc, vc, slots)
        results.append((kc, vc))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    kc = results[1][0].view(hk, nb * bs, d)
    assert torch.equal(kc[:, 19], k[0]) and torch.equal(kc[:, 8], k[4])
    assert int((kc == 7.0).all(-1).sum()) == hk * (nb * bs - 4)  # the 4 real rows, nothing else


@pytest.mark.parametrize("bad", [20, -2])
def test_store_kv_refuses_a_slot_outside_the_pools_and_writes_nothing(bad) -> None:
    hk, nb, bs, d = 2, 5, 4, 32
    k = torch.randn(3, hk, d).bfloat16()
    kc, vc = _pools(hk, nb, bs, d)
    with pytest.raises(ValueError, match="outside the pools"):
        native_ops.store_kv(k, k, kc, vc, torch.tensor([1, bad, 2], dtype=torch.int64))
    assert bool((kc == 7.0).all()) and bool((vc == -7.0).all())


@pytest.mark.parametrize("model_name", ["llama", "llama3_tied", "qwen2", "qwen3", "phi3"])
def test_bf16_greedy_tokens_equal_with_the_glue_on_and_off(tiny_model_factory, model_name: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model=tiny_model_factory(model_name), dtype="bfloat16", max_model_len=256,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = make_prompts(seed=11)
    monkeypatch.setattr(dispatch, "_onednn_bf16", lambda: True)  # torch's matmul both times (see test_cpu_attention)
    # and the torch attention both times: the C attention (same switch) sums in another order, which can flip a
    # near-tie (test_cpu_attention's engine test bounds those); the glue is bit for bit, so the tokens are equal
    monkeypatch.setitem(dispatch._BY_OP, "paged_attention", ())  # no C attention row
    runs = {}
    for native in ("1", "0"):
        monkeypatch.setenv(cpu_native.ENV_VAR, native)
        runs[native] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert runs["1"] == runs["0"]


def test_openmp_team_and_own_pool_give_the_same_bits() -> None:
    """The kernels' threads come from torch's OpenMP team here (one runtime in the process) or from the library's
    own pool (KEEPWARM_CPU_NATIVE_OPENMP=0): the split of the work is the same, so are the results."""
    from pathlib import Path

    lib = cpu_native._load()[0]
    q, kc, vc, plan = plan_inputs(4)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for on in (1, 0, 1):
            lib.kw_use_openmp(on)
            runs.append(native_ops.decode_attention(q, kc, vc, plan, 0.125, None))
    finally:
        lib.kw_use_openmp(1)
        torch.set_num_threads(before)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[1], runs[2])
    maps = Path("/proc/self/maps").read_text()
    assert len({line.split()[-1] for line in maps.splitlines() if "/libgomp" in line}) == 1  # torch's, shared
