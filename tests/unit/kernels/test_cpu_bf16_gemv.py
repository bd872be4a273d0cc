"""keepwarm's bf16 matmul for 1-4 rows of x on AVX512-BF16 (kernels/csrc/gemm_bf16_avx512.c ``kw_bgemv512``), what
``cpu.linear`` runs for a decode step's dense bf16 linears in place of oneDNN's (8 weight rows streamed side by side):
- exact where the float32 sums are exact (small integers): the true product rounded to bf16, at the blocking edges
  (weight rows past the 8-row and the 4-row blocks, the threads' 32-output chunks, K from 32 to 5632);
- random values: within the float64 bound of its own order (K / 16 + 4 float32 roundings of sum |x w|, then one
  bf16 rounding), and close to ``F.linear``;
- one summation order per output: a row alone, in a batch of 2, 3 or 4, at 1 or 2 threads: the same bits, on data
  whose float32 sums round (another order would show);
- routing: ``cpu.linear`` takes it for 1-4 bias-free bf16 rows with K % 32 == 0, never for 5, and not with
  ``KEEPWARM_CPU_NATIVE=0``; refusals name the shapes. NaN and inf: tests/unit/kernels/test_cpu_bf16_matmul.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keepwarm.kernels import cpu, cpu_native, dispatch, native_ops

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason=f"the AVX512-BF16 build: {cpu_native.reasons()[0]}")

SHAPES = [(1, 1, 32), (1, 7, 64), (2, 13, 576), (3, 9, 96), (4, 65, 576), (1, 200, 2048), (2, 96, 5632),
          (3, 33, 1536), (4, 8, 32), (1, 577, 576)]


def _ints(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_exact_sums_give_the_exactly_rounded_product(m: int, n: int, k: int) -> None:
    # |x|, |w| <= 8 and K <= 5632: every partial sum is an integer below 2^24, exact in float32 in any order
    x, w = _ints((m, k), m * k), _ints((n, k), n + k)
    got = native_ops.bf16_gemv(x, w)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert torch.equal(got, (x.double() @ w.double().T).to(torch.bfloat16))


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_random_values_are_within_the_bound_of_its_order(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(7 * m + n)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).div(k ** 0.5).bfloat16()
    got = native_ops.bf16_gemv(x, w).double()
    true = x.double() @ w.double().T
    # each lane: two products a step (each rounded into the float32 sum), K / 32 steps, then a 4-level tree
    bound = (k / 16 + 4) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    assert ((got - true).abs() <= true.abs() * 2.0 ** -8 + bound * (1 + 2.0 ** -8)).all()
    torch.testing.assert_close(got, F.linear(x, w).double(), rtol=2 ** -7, atol=1e-2)


def test_a_rows_bits_do_not_depend_on_its_batch_or_the_threads() -> None:
    g = torch.Generator().manual_seed(3)
    # magnitudes 2^-12 .. 2^12: float32 sums round, so another summation order would show in the bf16 results
    x = (torch.randn(4, 1152, generator=g) * torch.exp2(torch.randint(-12, 13, (4, 1152), generator=g))).bfloat16()
    w = torch.randn(1000, 1152, generator=g).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = native_ops.bf16_gemv(x, w)
        for rows in (1, 2, 3):
            assert torch.equal(native_ops.bf16_gemv(x[:rows], w), full[:rows])
        for i in range(4):
            assert torch.equal(native_ops.bf16_gemv(x[i:i + 1], w), full[i:i + 1])
        assert torch.equal(native_ops.bf16_gemv(x[1:3], w), full[1:3])
        torch.set_num_threads(1)
        assert torch.equal(native_ops.bf16_gemv(x, w), full)
        assert torch.equal(native_ops.bf16_gemv(x[2:3], w), full[2:3])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(native_ops.bf16_gemv(x.view(2, 2, 1152), w).view(4, 1000), full)  # [..., K] as rows


def test_refusals_name_the_shapes() -> None:
    w = torch.ones(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"bf16_gemv: x \(5, 64\).*at most 4 rows"):
        native_ops.bf16_gemv(torch.ones(5, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"bf16_gemv: x \(1, 48\).*K a multiple of 32"):
        native_ops.bf16_gemv(torch.ones(1, 48, dtype=torch.bfloat16), torch.ones(8, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="do not fit"):
        native_ops.bf16_gemv(torch.ones(1, 64), w)  # float32 x


def _select(x: torch.Tensor, w: torch.Tensor) -> str:
    return dispatch.select("linear", dispatch.rows_of(x), x, w, None)


def test_cpu_linear_takes_it_for_one_to_four_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(11)
    w = torch.randn(40, 576, generator=g).bfloat16()
    calls: list[tuple[int, ...]] = []
    real = native_ops.bf16_gemv
    monkeypatch.setattr(native_ops, "bf16_gemv", lambda a, b: calls.append(tuple(a.shape)) or real(a, b))
    monkeypatch.setenv(cpu_native.ENV_VAR, "1")
    for m in (1, 4):
        x = torch.randn(m, 576, generator=g).bfloat16()
        assert _select(x, w) == dispatch.BF16_AVX512
        assert torch.equal(cpu.linear(x, w), real(x, w))
    assert calls == [(1, 576), (4, 576)]
    x5 = torch.randn(5, 576, generator=g).bfloat16()
    assert _select(x5, w) == dispatch.F_LINEAR  # oneDNN has bf16 here
    assert torch.equal(cpu.linear(x5, w), F.linear(x5, w))
    x = x5[:1]
    bias = torch.randn(40, generator=g).bfloat16()
    assert torch.equal(cpu.linear(x, w, bias), F.linear(x, w, bias))  # biases keep torch's op
    w48 = torch.randn(8, 48, generator=g).bfloat16()
    assert _select(x[:, :48], w48) != dispatch.BF16_AVX512  # K % 32 != 0
    assert torch.equal(cpu.linear(x.float(), w.float()), F.linear(x.float(), w.float()))  # float32 too
    assert len(calls) == 2
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    assert _select(x, w) == dispatch.F_LINEAR
    assert torch.equal(cpu.linear(x, w), F.linear(x, w)) and len(calls) == 2
