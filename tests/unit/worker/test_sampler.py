"""Sampler: greedy, top-k/top-p/min-p supports, temperature, seeds, penalties, min_tokens, logprobs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from keepwarm.worker.engine.sequence import Sequence
from keepwarm.worker.sampler import Sampler, apply_penalties
from keepwarm.worker.sampling_params import SamplingParams

_ids = itertools.count()


def seq(prompt: list[int] | None = None, output: list[int] | None = None, **params: object) -> Sequence:
    s = Sequence(f"s{next(_ids)}", prompt or [0], SamplingParams(**params))
    for t in output or []:
        s.append_token(t)
    return s


def sampled_set(logits_row: torch.Tensor, n: int = 2000, **params: object) -> set[int]:
    """Tokens drawn from ``n`` independent rows with the same logits and params (one batched call)."""
    torch.manual_seed(0)
    seqs = [seq(**params) for _ in range(n)]
    return set(Sampler().sample(logits_row.expand(n, -1).contiguous(), seqs).token_ids)


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1.0
    out = Sampler().sample(logits, [seq(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[2] == 7
    assert out.logprobs == [None] * 6


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_1_equals_greedy(temperature: float) -> None:
    torch.manual_seed(1)
    logits = torch.randn(32, 100)
    logits[0, 3] = logits[0, 9] = logits[0].max() + 0.5  # tie: top_k=1 keeps the lowest id, like argmax
    out = Sampler().sample(logits, [seq(temperature=temperature, top_k=1) for _ in range(32)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_support() -> None:
    logits = torch.linspace(3.0, 0.0, 20)[torch.randperm(20, generator=torch.Generator().manual_seed(0))]
    expected = set(logits.topk(5).indices.tolist())
    assert sampled_set(logits, top_k=5) == expected
    assert sampled_set(logits, top_k=0) == set(range(20))


def test_top_p_support() -> None:
    logits = torch.tensor([0.1, 0.4, 0.2, 0.3]).log()  # sorted: 1 (.4), 3 (.3), 2 (.2), 0 (.1)
    assert sampled_set(logits, top_p=0.65) == {1, 3}
    assert sampled_set(logits, top_p=0.75) == {1, 3, 2}
    assert sampled_set(logits, top_p=0.3) == {1}
    assert sampled_set(logits, top_p=1.0) == {0, 1, 2, 3}


def test_min_p_support() -> None:
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    assert sampled_set(logits, min_p=0.2) == {0, 1, 3}  # threshold 0.1
    assert sampled_set(logits, min_p=0.5) == {1, 3}  # threshold 0.25


def test_per_row_masks_in_one_batch() -> None:
    # Different top-k / top-p / min-p per row of one batch: each row keeps exactly its own support.
    probs = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    configs = [dict(top_k=2), dict(top_p=0.7), dict(min_p=0.5), dict(top_k=3, top_p=0.5), dict()]
    expected = [{1, 3}, {1, 3, 4}, {1, 3, 4}, {1, 3}, set(range(6))]
    reps = 600
    seqs = [seq(**c) for _ in range(reps) for c in configs]
    torch.manual_seed(0)
    out = Sampler().sample(probs.log().expand(len(seqs), -1).contiguous(), seqs).token_ids
    for j, exp in enumerate(expected):
        assert set(out[j::len(configs)]) == exp


def test_temperature_scaling() -> None:
    logits = torch.tensor([0.0, 1.0])
    n = 4000
    for temperature in (0.5, 1.0, 2.0):
        torch.manual_seed(0)
        out = Sampler().sample(logits.expand(n, -1).contiguous(), [seq(temperature=temperature)
                                                                  for _ in range(n)])
        p1 = sum(out.token_ids) / n
        expected = 1.0 / (1.0 + math.exp(-1.0 / temperature))  # .881, .731, .622
        assert abs(p1 - expected) < 0.03, (temperature, p1, expected)


def _run_seeded(positions_and_batches: list[tuple[int, int]], seed: int, steps_logits: torch.Tensor,
                neighbour_seed: int = 0) -> list[int]:
    """Sample the seeded sequence for each step, at the given (row, batch size), with random neighbours."""
    sampler = Sampler()
    target = seq(seed=seed)
    rng = torch.Generator().manual_seed(neighbour_seed)
    tokens = []
    for step, (row, size) in enumerate(positions_and_batches):
        seqs = []
        for i in range(size):
            if i == row:
                seqs.append(target)
            else:  # neighbours: unseeded, other seeds, greedy
                kind = int(torch.randint(3, (1,), generator=rng))
                seqs.append(seq(**[{}, {"seed": 1000 + i}, {"temperature": 0.0}][kind]))
        logits = torch.randn(size, steps_logits.shape[1], generator=rng)
        logits[row] = steps_logits[step]
        tokens.append(sampler.sample(logits, seqs).token_ids[row])
    return tokens


def test_seeded_reproducible_across_batches() -> None:
    # Near-uniform over 1000 tokens: different draws almost surely give different tokens.
    steps = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3)) * 0.1
    alone = _run_seeded([(0, 1)] * 6, seed=42, steps_logits=steps)
    batched = _run_seeded([(0, 4), (3, 5), (1, 2), (7, 8), (2, 3), (0, 1)], seed=42, steps_logits=steps,
                          neighbour_seed=1)
    batched2 = _run_seeded([(5, 6), (0, 2), (2, 7), (1, 3), (0, 9), (4, 5)], seed=42, steps_logits=steps,
                           neighbour_seed=2)
    assert alone == batched == batched2
    assert _run_seeded([(0, 1)] * 6, seed=43, steps_logits=steps) != alone


def test_seeded_generator_per_sequence_and_forget() -> None:
    logits = torch.zeros(1, 1000)
    sampler = Sampler()
    a = seq(seed=7)
    first = [sampler.sample(logits, [a]).token_ids[0] for _ in range(5)]
    assert len(set(first)) > 1  # the generator advances between steps
    sampler.forget(a.seq_id)
    assert [sampler.sample(logits, [a]).token_ids[0] for _ in range(5)] == first
    sampler.forget("never-seen")  # harmless


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0]])
    s = seq(prompt=[0, 1], output=[2, 2, 3], repetition_penalty=2.0, frequency_penalty=0.5,
            presence_penalty=0.3)
    got = apply_penalties(logits, [s])
    # rep: tokens {0,1,2,3} seen; then freq 0.5*count and presence 0.3 on output tokens {2: 2x, 3: 1x}.
    expected = torch.tensor([[2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 * 2 - 0.3, -0.5 * 2 - 0.5 * 1 - 0.3, 1.0]])
    torch.testing.assert_close(got, expected)
    assert logits.tolist() == [[2.0, -1.0, 0.5, -0.5, 1.0]]  # input untouched


def test_penalties_each_alone_and_neutral_rows() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0]]).repeat(4, 1)
    seqs = [
        seq(prompt=[4], output=[1], repetition_penalty=1.5),  # prompt token counts for repetition
        seq(prompt=[4], output=[1, 1, 1], frequency_penalty=-1.0),
        seq(prompt=[4], output=[1, 1, 1], presence_penalty=1.0),  # presence ignores the prompt
        seq(prompt=[0, 1, 2], output=[3, 4]),  # neutral
    ]
    got = apply_penalties(logits, seqs)
    torch.testing.assert_close(got[0], torch.tensor([2.0, -1.5, 0.5, -0.5, 1.0 / 1.5]))
    torch.testing.assert_close(got[1], torch.tensor([2.0, 2.0, 0.5, -0.5, 1.0]))
    torch.testing.assert_close(got[2], torch.tensor([2.0, -2.0, 0.5, -0.5, 1.0]))
    torch.testing.assert_close(got[3], logits[3])


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    assert Sampler().sample(logits, [seq(output=[0], temperature=0.0)]).token_ids == [0]
    penalized = seq(output=[0], temperature=0.0, repetition_penalty=2.0)
    assert Sampler().sample(logits, [penalized]).token_ids == [1]


def test_min_tokens_blocks_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]]).repeat(2, 1)  # 2 = EOS, 3 = stop token
    params = dict(min_tokens=3, eos_token_ids=(2,), stop_token_ids=[3], temperature=0.0)
    out = Sampler().sample(logits, [seq(output=[1], **params), seq(output=[1, 1, 1], **params)])
    assert out.token_ids == [1, 2]
    # Sampled rows too: EOS dominates but is never drawn before min_tokens.
    torch.manual_seed(0)
    n = 500
    sampled = Sampler().sample(logits[:1].expand(n, -1).contiguous(),
                               [seq(min_tokens=2, eos_token_ids=(2,), stop_token_ids=[3]) for _ in range(n)])
    assert set(sampled.token_ids) == {0, 1}
    assert logits[0].tolist() == [0.0, 1.0, 5.0, 4.0]


def test_logprobs_raw_sorted_and_ranked() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    seqs = [
        seq(temperature=0.0, logprobs=3),
        seq(temperature=0.7, logprobs=5, repetition_penalty=1.3, output=[1, 2]),  # raw: before penalties
        seq(temperature=1.0),
        seq(temperature=1.2, logprobs=0, top_k=10),
    ]
    out = Sampler().sample(logits, seqs)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for i, k in ((0, 3), (1, 5), (3, 0)):
        lp = out.logprobs[i]
        tok = out.token_ids[i]
        assert lp is not None and lp.token_id == tok
        assert lp.logprob == pytest.approx(raw[i, tok].item(), abs=1e-6)
        assert lp.rank == int((raw[i] > raw[i, tok]).sum()) + 1
        assert len(lp.top) == k
        assert [t for t, _ in lp.top] == raw[i].topk(k).indices.tolist()
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        for t, v in lp.top:
            assert v == pytest.approx(raw[i, t].item(), abs=1e-6)
    assert out.logprobs[0].rank == 1 and out.logprobs[0].top[0][0] == out.token_ids[0]


def test_mixed_greedy_and_sampled_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 40)
    seqs = [seq(temperature=0.0) if i % 2 == 0 else seq(temperature=0.8, top_k=3, seed=i) for i in range(8)]
    out = Sampler().sample(logits, seqs)
    argmax = logits.argmax(-1).tolist()
    for i in range(0, 8, 2):
        assert out.token_ids[i] == argmax[i]
    for i in range(1, 8, 2):
        assert out.token_ids[i] in logits[i].topk(3).indices.tolist()
    assert all(isinstance(t, int) for t in out.token_ids)


def test_bad_shape_rejected() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(2, 5), [seq()])


def test_logits_must_be_one_row_per_sequence() -> None:
    with pytest.raises(ValueError, match=r"logits must be \[2, vocab\], got \(2, 1, 10\)"):
        Sampler().sample(torch.zeros(2, 1, 10), [seq(temperature=0.0), seq(temperature=0.0)])
    with pytest.raises(ValueError, match=r"logits must be \[2, vocab\], got \(3, 10\)"):
        Sampler().sample(torch.zeros(3, 10), [seq(temperature=0.0), seq(temperature=0.0)])


def test_min_tokens_bans_stop_token_id_zero_too() -> None:
    """Token id 0 is a real token: as a stop token it is banned until min_tokens, like any other id."""
    logits = torch.zeros(1, 10)
    logits[0, 0] = 10.0  # token 0 is by far the best
    early = Sampler().sample(logits, [seq(temperature=0.0, min_tokens=2, stop_token_ids=[0])])
    assert early.token_ids == [1]  # banned: the next best (lowest id on the tie)
    late = Sampler().sample(logits, [seq(output=[5, 6], temperature=0.0, min_tokens=2, stop_token_ids=[0])])
    assert late.token_ids == [0]


def test_logprobs_one_keeps_the_top_one() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    lp = Sampler().sample(logits, [seq(temperature=0.0, logprobs=1)]).logprobs[0]
    assert lp is not None and lp.token_id == 1 and [t for t, _ in lp.top] == [1]


def test_penalties_over_ragged_rows() -> None:
    """Rows of different output and prompt lengths are padded to one tensor; the pad never counts."""
    logits = torch.zeros(2, 6)
    seqs = [seq(prompt=[5], output=[1, 1], frequency_penalty=1.0),
            seq(prompt=[0, 1, 2, 3, 4], output=[2, 2, 2, 3, 3], frequency_penalty=1.0, repetition_penalty=2.0)]
    got = apply_penalties(logits, seqs)
    torch.testing.assert_close(got[0], torch.tensor([0.0, -2.0, 0.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(got[1], torch.tensor([0.0, 0.0, -3.0, -2.0, 0.0, 0.0]))


class _OnlyToken:
    """A stand-in grammar that allows one token (the sampler only asks for the bitmask)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def fill_bitmask(self, row: torch.Tensor) -> None:
        row.zero_()
        row[self.token // 32] = 1 << (self.token % 32)


@pytest.mark.parametrize("token", [3, 37, 49])
def test_grammar_rows_keep_only_allowed_tokens(token: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    constrained, free = seq(temperature=0.0), seq(temperature=0.0)
    constrained.grammar = _OnlyToken(token)  # type: ignore[assignment]
    out = Sampler().sample(logits, [constrained, free])
    assert out.token_ids == [token, int(logits[1].argmax())]
