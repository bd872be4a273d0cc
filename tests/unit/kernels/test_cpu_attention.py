"""The C decode attention over the paged KV cache (kernels/csrc/attention.c, ``kw_decode_attention``): against the
torch path it replaces (kernels/reference.py ``_decode_attention`` after the gather) and against float64, over GQA
shapes, lengths around block boundaries, sliding windows, soft-capping, garbage in unwritten slots, shuffled
block tables, 1 and 2 threads, and its switch; then greedy tokens of a bf16 engine with the kernel on and off.
Needs AVX2 + FMA and a C compiler; elsewhere the tests say which is missing."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from support.inputs import make_prompts, plan_inputs

from keepwarm import LLM, SamplingParams
from keepwarm.kernels import cpu, cpu_native, dispatch, native_ops, reference

pytestmark = pytest.mark.skipif(not cpu_native.glue_on(),
                                reason=f"native attention: {cpu_native.reasons()[1]}")

GARBAGE = 3.0e4  # what unwritten slots hold: finite, and large enough to show in any output that reads one


def _batch(lens: list[int], hq: int, hk: int, d: int, bs: int, seed: int, prefill: dict[int, int] | None = None):
    """Caches [Hk, NB, bs, D] full of GARBAGE except the sequences' written positions, block tables drawn from a
    shuffled pool (out of order, wider than needed, padded with junk ids), and q rows: one per sequence, or
    ``prefill[s]`` rows for sequence s."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // bs) for n in lens]
    width = max(per_seq) + 2
    nb = sum(per_seq) + 7
    kc = torch.full((hk, nb, bs, d), GARBAGE, dtype=torch.bfloat16)
    vc = torch.full((hk, nb, bs, d), -GARBAGE, dtype=torch.bfloat16)
    ids = torch.randperm(nb, generator=g).tolist()
    table = torch.full((len(lens), width), 10**6, dtype=torch.int32)  # junk past each sequence's blocks
    for s, n in enumerate(lens):
        row = [ids.pop() for _ in range(per_seq[s])]
        table[s, :len(row)] = torch.tensor(row, dtype=torch.int32)
        for p in range(n):
            blk, off = row[p // bs], p % bs
            kc[:, blk, off] = torch.randn(hk, d, generator=g).bfloat16()
            vc[:, blk, off] = torch.randn(hk, d, generator=g).bfloat16()
    rows = [1 if prefill is None or s not in prefill else prefill[s] for s in range(len(lens))]
    qsl = torch.tensor([0] + torch.tensor(rows).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g).bfloat16()
    return q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), qsl


def _attention(q, kc, vc, table, lens, qsl, window=None, softcap=None, native=True,
               monkeypatch: pytest.MonkeyPatch | None = None) -> torch.Tensor:
    assert monkeypatch is not None
    monkeypatch.setenv(cpu_native.ENV_VAR, "1" if native else "0")
    return cpu.paged_attention(q, kc, vc, table, lens, qsl, q.shape[-1] ** -0.5, sliding_window=window,
                               logit_softcap=softcap)


def _float64(q, kc, vc, table, lens, window, softcap) -> torch.Tensor:
    """Decode rows in float64 straight from the cache: no roundings at all."""
    hk, _, bs, d = kc.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        blocks = table[s].long()[pos // bs]
        k = kc[:, blocks, pos % bs].double()  # [Hk, L, D]
        v = vc[:, blocks, pos % bs].double()
        qs = q[s].double().reshape(hk, -1, d)  # [Hk, G, D]
        scores = qs @ k.transpose(1, 2) * d ** -0.5
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out[s] = (torch.softmax(scores, -1) @ v).reshape(-1, d)
    return out


# (lens, Hq, Hk, D, block size): G = 1, 3, 4, 8 (two groups of the kernel's 6); a length of 1, lengths on, just
# under and just over block boundaries; an odd block size; D of 32, 64 and 128.
CASES = [
    ([1, 15, 16, 17, 33], 2, 2, 64, 16),
    ([1, 31, 32, 33, 100], 9, 3, 64, 16),
    ([7, 64, 65, 130], 8, 2, 32, 16),
    ([3, 5, 11, 49], 8, 1, 128, 5),
    ([200], 9, 3, 64, 16),
]


@pytest.mark.parametrize(("lens", "hq", "hk", "d", "bs"), CASES)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, None), (1, None), (None, 5.0), (16, 30.0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_torch_path_and_float64(lens, hq, hk, d, bs, window, softcap, threads,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    batch = _batch(lens, hq, hk, d, bs, seed=len(lens) * 100 + hq + d)
    if softcap:  # larger scores, so the cap bends them
        batch = (batch[0] * 4,) + batch[1:]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _attention(*batch, window, softcap, native=True, monkeypatch=monkeypatch)
        torch_path = _attention(*batch, window, softcap, native=False, monkeypatch=monkeypatch)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.bfloat16 and got.shape == torch_path.shape
    assert bool(got.isfinite().all())  # no GARBAGE slot was read (it would show as ~1e4)
    # Same rounding points as the torch path: what is left is float32 summation order (and exp's last ulp), which
    # can move a rounded score or probability by one bf16 step: a few outputs by about 1% of |v|.
    diff = (got.float() - torch_path.float()).abs()
    assert diff.max().item() <= 0.02 and (diff > 0).float().mean().item() <= 0.02
    # ...and it is as close to float64 as the torch path is.
    exact = _float64(*batch[:5], window, softcap)
    err_c = (got.double() - exact).abs().max().item()
    err_torch = (torch_path.double() - exact).abs().max().item()
    assert err_c <= 1.25 * err_torch + 1e-3 and err_c < 0.05


def test_two_threads_split_the_work(monkeypatch: pytest.MonkeyPatch) -> None:
    # Enough (key, query head) pairs for the pool: 2 threads and 1 give the same bits (each unit is computed by
    # one thread, the same way).
    batch = _batch(list(range(60, 188, 4)), 9, 3, 64, 16, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = _attention(*batch, monkeypatch=monkeypatch)
        torch.set_num_threads(1)
        one = _attention(*batch, monkeypatch=monkeypatch)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_used_where_it_fits_and_only_there(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = native_ops.decode_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(native_ops, "decode_attention", spy)
    q, kc, vc, table, lens, qsl = _batch([5, 40], 4, 2, 32, 16, seed=1)
    _attention(q, kc, vc, table, lens, qsl, monkeypatch=monkeypatch)
    assert len(calls) == 1
    # the switch, float32, a float32 query against a bf16 cache, fp8-style scales, a head dim not a multiple of 16
    _attention(q, kc, vc, table, lens, qsl, native=False, monkeypatch=monkeypatch)
    _attention(q.float(), kc.float(), vc.float(), table, lens, qsl, monkeypatch=monkeypatch)
    _attention(q.float(), kc, vc, table, lens, qsl, monkeypatch=monkeypatch)
    cpu.paged_attention(q, kc, vc, table, lens, qsl, 0.1, k_scale=0.5)
    q8, kc8, vc8, *rest = _batch([5, 40], 4, 2, 40, 16, seed=1)
    _attention(q8, kc8, vc8, *rest, monkeypatch=monkeypatch)
    assert len(calls) == 1


def test_switch_off_is_the_torch_path_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    q, kc, vc, table, lens, qsl = _batch([1, 17, 70], 9, 3, 64, 16, seed=2)
    off = _attention(q, kc, vc, table, lens, qsl, window=24, native=False, monkeypatch=monkeypatch)
    plan = reference.plan_attention(table, lens, qsl, None, 16, (24,))
    g = plan.gathers[24]
    want = reference._decode_attention(q, reference._gather_blocks(kc, g.table), reference._gather_blocks(vc, g.table),
                                       g.masked, 64 ** -0.5, 1.0, 1.0)
    assert torch.equal(off, want)
    assert cpu_native.reasons()[1] == f"{cpu_native.ENV_VAR}=0"


def test_mixed_batch_and_strided_query(monkeypatch: pytest.MonkeyPatch) -> None:
    # A prefill chunk between decode rows (the decode rows are gathered out of q), and q as the model hands it
    # over: a view into a wider [T, Hq + Hk, D] tensor (rows not contiguous).
    q, kc, vc, table, lens, qsl = _batch([9, 40, 23], 6, 2, 64, 16, seed=3, prefill={1: 5})
    wide = torch.cat((q, torch.zeros(q.shape[0], 2, 64, dtype=q.dtype)), dim=1)[:, :6]
    assert not wide.is_contiguous()
    for query in (q, wide):
        got = _attention(query, kc, vc, table, lens, qsl, monkeypatch=monkeypatch)
        want = _attention(query, kc, vc, table, lens, qsl, native=False, monkeypatch=monkeypatch)
        assert (got.float() - want.float()).abs().max().item() <= 0.02
    decode_only = _batch([9, 23], 6, 2, 64, 16, seed=4)
    strided = torch.cat((decode_only[0], decode_only[0][:, :2]), dim=1)[:, :6]
    got = _attention(strided, *decode_only[1:], monkeypatch=monkeypatch)
    assert torch.equal(got, _attention(decode_only[0], *decode_only[1:], monkeypatch=monkeypatch))


def _float64_rows(q, kc, vc, table, lens, qsl, window, softcap) -> torch.Tensor:
    """Every query row, prefill chunks included, in float64 straight from the cache: row r of a chunk of q_len
    rows in a sequence of context n sits at position n - q_len + r and sees positions up to it."""
    hk, _, bs, d = kc.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s, n in enumerate(lens.tolist()):
        a, b = int(qsl[s]), int(qsl[s + 1])
        pos = torch.arange(n)
        blocks = table[s].long()[pos // bs]
        k, v = kc[:, blocks, pos % bs].double(), vc[:, blocks, pos % bs].double()  # [Hk, n, D]
        for r in range(a, b):
            p = n - (b - a) + (r - a)
            lo = max(0, p - window + 1) if window else 0
            scores = q[r].double().reshape(hk, -1, d) @ k[:, lo:p + 1].transpose(1, 2) * d ** -0.5
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            out[r] = (torch.softmax(scores, -1) @ v[:, lo:p + 1]).reshape(-1, d)
    return out


# (lens, prefill rows per sequence, Hq, Hk, D, window, softcap): a whole prompt; a chunk after a cached prefix
# beside a whole prompt; a sliding window shorter than the chunk; a soft-capped chunk between decode rows; chunks
# that end on and just past a block edge with G = 4 and D = 128.
PREFILL_CASES = [
    ([85], {0: 85}, 8, 2, 64, None, None),
    ([120, 60], {0: 40, 1: 60}, 6, 2, 64, None, None),
    ([200], {0: 200}, 4, 4, 32, 64, None),
    ([9, 130, 50], {1: 130}, 6, 3, 64, None, 20.0),
    ([32, 33], {0: 32, 1: 17}, 4, 1, 128, 24, None),
]


@pytest.mark.parametrize("lens,prefill,hq,hk,d,window,softcap", PREFILL_CASES)
def test_prefill_rows_match_float64_as_well_as_sdpa(lens, prefill, hq, hk, d, window, softcap,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    q, kc, vc, table, seq_lens, qsl = _batch(lens, hq, hk, d, 16, seed=len(lens) + d, prefill=prefill)
    calls: list[int] = []
    real = native_ops.decode_attention
    monkeypatch.setattr(native_ops, "decode_attention", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    got = _attention(q, kc, vc, table, seq_lens, qsl, window, softcap, monkeypatch=monkeypatch)
    rows = sum(prefill.values())
    assert sorted(calls) == sorted([rows] + ([len(lens) - len(prefill)] if len(lens) > len(prefill) else []))
    sdpa = _attention(q, kc, vc, table, seq_lens, qsl, window, softcap, native=False, monkeypatch=monkeypatch)
    want = _float64_rows(q, kc, vc, table, seq_lens, qsl, window, softcap)
    err, err_sdpa = (got.double() - want).abs(), (sdpa.double() - want).abs()
    # float32 scores and probabilities, as SDPA: as close to float64 as SDPA is (another order of float32 sums)
    assert err.max() <= 1.25 * err_sdpa.max() + 1e-3, (err.max(), err_sdpa.max())
    assert err.mean() <= 1.25 * err_sdpa.mean(), (err.mean(), err_sdpa.mean())
    # padding rows after the sequences' rows stay zero; the sequences' rows do not change
    padded = torch.cat((q, torch.randn(3, hq, d).bfloat16()))
    out = _attention(padded, kc, vc, table, seq_lens, qsl, window, softcap, monkeypatch=monkeypatch)
    assert torch.equal(out[:len(q)], got) and not out[len(q):].any()


def test_a_decode_row_does_not_depend_on_a_prefill_in_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prefill rows keep float32 scores, decode rows the torch decode path's bf16 roundings, in the same step.
    q, kc, vc, table, lens, qsl = _batch([9, 40, 23], 6, 2, 64, 16, seed=5, prefill={1: 12})
    mixed = _attention(q, kc, vc, table, lens, qsl, monkeypatch=monkeypatch)
    keep = torch.tensor([0, 2])
    rows = qsl[keep]
    alone = _attention(q[rows], kc, vc, table[keep], lens[keep], torch.tensor([0, 1, 2], dtype=torch.int32),
                       monkeypatch=monkeypatch)
    assert torch.equal(mixed[rows], alone)


def test_rejects_a_plan_that_reads_outside_the_cache() -> None:
    kc = torch.zeros(1, 4, 16, 32, dtype=torch.bfloat16)
    q = torch.zeros(1, 2, 32, dtype=torch.bfloat16)
    for table, ctx, lo in (([[4]], 5, 0), ([[-1]], 5, 0), ([[0]], 17, 0), ([[0]], 5, 5)):
        plan = native_ops.attention_plan(torch.tensor(table), torch.tensor([ctx]), torch.tensor([lo]), None)
        with pytest.raises(ValueError, match="refused"):
            native_ops.decode_attention(q, kc, kc, plan, 0.1, None)


def test_softmax_exp_and_rounding_edges(monkeypatch: pytest.MonkeyPatch) -> None:
    # Scores far apart (probabilities that underflow), equal (ties), and a row whose only key is itself.
    q, kc, vc, table, lens, qsl = _batch([1, 40, 40], 4, 1, 32, 16, seed=6)
    q = q.clone()
    q[1] *= 200  # huge scores: most probabilities underflow to 0
    q[2] = 0  # all scores 0: uniform
    got = _attention(q, kc, vc, table, lens, qsl, monkeypatch=monkeypatch)
    want = _attention(q, kc, vc, table, lens, qsl, native=False, monkeypatch=monkeypatch)
    assert (got.float() - want.float()).abs().max().item() <= 0.02
    exact = _float64(q, kc, vc, table, lens, None, None)
    assert math.isclose(float((got[2].double() - exact[2]).abs().max()), 0.0, abs_tol=0.02)


TESTS = str(Path(__file__).resolve().parents[2])  # the child imports support/ from here
_CHILD = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, sys.argv[1])
    from support.inputs import plan_inputs
    from keepwarm.kernels import cpu_native, native_ops
    torch.set_num_threads(2)
    q, kc, vc, plan = plan_inputs(0)
    first = native_ops.decode_attention(q, kc, vc, plan, 0.125, None)  # enough work for 2 threads: starts the pool
    print(cpu_native._load()[0]._name)
    pid = os.fork()
    if pid == 0:  # the child has no pool threads: it must start its own, not wait for the parent's forever
        os._exit(0 if torch.equal(native_ops.decode_attention(q, kc, vc, plan, 0.125, None), first) else 3)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
""")


def test_build_cached_and_fork_safe(tmp_path: Path) -> None:
    env = {**os.environ, "KEEPWARM_HOME": str(tmp_path)}
    env.pop(cpu_native.ENV_VAR, None)
    runs = [subprocess.run([sys.executable, "-c", _CHILD, TESTS], env=env, capture_output=True,
                           text=True, timeout=120) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    built = list((tmp_path / "cache" / "native").iterdir())
    # one library, built by the first process and loaded from the cache by the second; no temporary left
    assert [p.name for p in built] == [Path(runs[0].stdout.strip()).name] == [Path(runs[1].stdout.strip()).name]


def test_calls_from_two_threads_take_turns() -> None:
    # ctypes drops the GIL: two engine-like threads may call at once and must not share the pool's one job.
    cases = [plan_inputs(seed, s) for seed, s in ((1, 32), (2, 8))]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = [native_ops.decode_attention(q, kc, vc, plan, 0.125, None) for q, kc, vc, plan in cases]
        with ThreadPoolExecutor(2) as pool:
            for _ in range(20):
                got = list(pool.map(lambda c: native_ops.decode_attention(*c, 0.125, None), cases))
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    finally:
        torch.set_num_threads(before)


# The decode rows and the prefill chunks of a bf16 step both go through the kernel, which sums in another order
# than the torch path (and SDPA): a bf16 output can move by an ulp, and a greedy choice between two tokens whose
# log-probabilities are that close can flip. Measured over 16 prompts x 24 tokens: llama 2, gemma2 6, mistral_sw 2
# prompts diverge, the first flip of each at a gap of 0-0.0625 (bf16 logits in [4, 8) are 0.03125 apart; Gemma 2's
# capped logits are float32). A flip at a wider gap is a wrong answer, not a rounding.
NEAR_TIE = 0.07  # nats between the two candidates in the run without the kernel: two bf16 ulps of a logit < 8


@pytest.mark.parametrize("model_name", ["llama", "gemma2", "mistral_sw"])
def test_bf16_engine_greedy_same_with_and_without(tiny_model_factory, model_name: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model=tiny_model_factory(model_name), dtype="bfloat16", max_model_len=256,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    prompts = make_prompts(seed=11)
    # the attention's switch alone: the AVX2 bf16 matmul (on where oneDNN has no bf16) shares the switch and sums
    # in another order than torch's matmul, which can flip a near-tie;
    # tests/unit/kernels/test_cpu_bf16_matmul.py covers it
    monkeypatch.setattr(dispatch, "_onednn_bf16", lambda: True)
    runs = {}
    for native in ("1", "0"):
        monkeypatch.setenv(cpu_native.ENV_VAR, native)
        runs[native] = [o.outputs[0] for o in llm.generate(prompts, params)]
    flips = 0
    for on, off in zip(runs["1"], runs["0"], strict=True):
        if on.token_ids == off.token_ids:
            continue
        j = next(i for i, (a, b) in enumerate(zip(on.token_ids, off.token_ids, strict=True)) if a != b)
        top = {t: x.logprob for t, x in off.logprobs[j].items()}  # vLLM's {id: Logprob}
        gap = top[off.token_ids[j]] - top.get(on.token_ids[j], float("-inf"))
        print(f"{model_name}: flip at token {j}, gap {gap:.4f}")
        assert gap < NEAR_TIE, f"greedy token {j} differs at a log-probability gap of {gap:.3f}: not a near-tie"
        flips += 1
    assert flips <= len(prompts) // 2, f"{flips} of {len(prompts)} prompts diverge"
