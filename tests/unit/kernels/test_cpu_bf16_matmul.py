"""keepwarm's AVX2 bfloat16 matmul (kernels/csrc/gemm_bf16_avx2.c ``kw_bgemm``), which replaces torch's bf16
``F.linear`` on CPUs where oneDNN has no bf16 matmul (torch's generic loop is ~4x slower there):
- exact where the float32 sums are exact (small integer values): the result is the true product rounded to bf16,
  at every blocking edge (rows of x 1-33, weight rows not a multiple of 8, K from 8 to 5632);
- random values: within one bf16 rounding of the float64 product, and close to ``F.linear``;
- one summation order per output: each row of a batch equals that row computed alone, at 1 and 2 threads;
- routing: ``cpu.linear`` takes it exactly where kernels/dispatch.py's table says (bias-free bf16 weights), and
  ``KEEPWARM_CPU_NATIVE=0`` gives torch's ``F.linear`` back.
The kernel itself runs on every CPU with AVX2 + FMA (tests call it directly); elsewhere they say what is missing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keepwarm.kernels import cpu, cpu_native, dispatch, native_ops

pytestmark = pytest.mark.skipif(not cpu_native.glue_on(),
                                reason=f"native kernels: {cpu_native.reasons()[1]}")

SHAPES = [(1, 8, 16), (1, 13, 576), (2, 8, 32), (3, 12, 576), (7, 49, 64), (32, 96, 576), (33, 17, 2048),
          (1, 64, 5632), (5, 7, 5632)]


def _ints(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_exact_sums_give_the_exactly_rounded_product(m, n, k) -> None:
    # |x|, |w| <= 8 and K <= 5632: every partial sum is an integer below 2^24, exact in float32 in any order
    x, w = _ints((m, k), m * k), _ints((n, k), n + k)
    got = native_ops.bf16_linear(x, w)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert torch.equal(got, (x.double() @ w.double().T).to(torch.bfloat16))


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_random_values_are_within_one_rounding_of_the_true_product(m, n, k) -> None:
    g = torch.Generator().manual_seed(7 * m + n)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).div(k ** 0.5).bfloat16()
    got = native_ops.bf16_linear(x, w).double()
    true = x.double() @ w.double().T
    ulp = true.abs().clamp_min(1e-30) * 2.0 ** -8 + 1e-6 * (x.double().abs() @ w.double().abs().T)
    assert ((got - true).abs() <= ulp).all()
    torch.testing.assert_close(got, F.linear(x, w).double(), rtol=2 ** -7, atol=1e-2)


def test_each_row_is_computed_as_if_alone_at_any_thread_count() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(32, 576, generator=g).bfloat16(), torch.randn(1728, 576, generator=g).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = native_ops.bf16_linear(x, w)
        torch.set_num_threads(1)
        alone = torch.cat([native_ops.bf16_linear(x[i:i + 1], w) for i in range(32)])
        three_d = native_ops.bf16_linear(x.view(4, 8, 576), w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batch, alone)
    assert torch.equal(three_d.reshape(32, 1728), batch)


def test_refusals_name_the_shapes() -> None:
    x = torch.ones(2, 12, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"bf16_linear: x \(2, 12\)"):
        native_ops.bf16_linear(x, torch.ones(4, 12, dtype=torch.bfloat16))  # K not a multiple of 16
    with pytest.raises(ValueError, match="do not fit"):
        native_ops.bf16_linear(torch.ones(2, 16), torch.ones(4, 16, dtype=torch.bfloat16))  # float32 x
    with pytest.raises(ValueError, match="do not fit"):  # the weight is not contiguous
        native_ops.bf16_linear(torch.ones(2, 16, dtype=torch.bfloat16), torch.ones(16, 4, dtype=torch.bfloat16).T)


def test_cpu_linear_takes_it_where_onednn_has_no_bf16(monkeypatch) -> None:
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(5, 576, generator=g).bfloat16(), torch.randn(40, 576, generator=g).bfloat16()
    calls: list[tuple[int, ...]] = []
    real = native_ops.bf16_linear
    monkeypatch.setattr(native_ops, "bf16_linear", lambda a, b: calls.append(tuple(a.shape)) or real(a, b))
    monkeypatch.setattr(dispatch, "_onednn_bf16", lambda: False)
    monkeypatch.setenv(cpu_native.ENV_VAR, "1")
    assert dispatch.select("linear", 0, x, w, None) == dispatch.BF16_AVX2
    assert torch.equal(cpu.linear(x, w), real(x, w)) and calls == [(5, 576)]
    bias = torch.randn(40, generator=g).bfloat16()
    assert torch.equal(cpu.linear(x, w, bias), F.linear(x, w, bias))  # biases keep torch's op
    assert torch.equal(cpu.linear(x.float(), w.float()), F.linear(x.float(), w.float()))  # float32 too
    assert len(calls) == 1
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    assert dispatch.select("linear", 0, x, w, None) == dispatch.F_LINEAR
    assert torch.equal(cpu.linear(x, w), F.linear(x, w)) and len(calls) == 1
    monkeypatch.setenv(cpu_native.ENV_VAR, "1")
    monkeypatch.setattr(dispatch, "_onednn_bf16", lambda: True)  # where oneDNN multiplies bf16, torch's op
    assert dispatch.select("linear", 0, x, w, None) == dispatch.F_LINEAR
    assert torch.equal(cpu.linear(x, w), F.linear(x, w)) and len(calls) == 1


def test_int8_weights_above_the_op_rows_take_it_after_an_exact_cast(monkeypatch) -> None:
    from keepwarm.formats.quant import quantize
    from keepwarm.kernels import quant

    g = torch.Generator().manual_seed(5)
    qw = quant.QuantizedWeight(*quantize(torch.randn(64, 576, generator=g), "int8", torch.bfloat16))
    x = torch.randn(32, 576, generator=g).bfloat16()  # above the rows torch's int8 op wins at: cast + matmul
    monkeypatch.setattr(dispatch, "_onednn_bf16", lambda: False)
    # the int8 table without keepwarm's int8 kernels (AVX512-BF16, AMX, AVX2:
    # tests/unit/kernels/test_cpu_native.py and co.)
    monkeypatch.setitem(dispatch._BY_OP, "linear_int8", tuple(r for r in dispatch._BY_OP["linear_int8"]
                                                              if r.kernel == dispatch.INT8_OP))
    assert quant.select_path("int8", x, qw) == "int8->dtype cast + matmul, per-channel scale"
    codes, scales = qw.parts["qweight"].bfloat16(), qw.parts["scales"].bfloat16()
    assert torch.equal(quant.TORCH_IMPLS["int8"](x, qw), native_ops.bf16_linear(x, codes).mul_(scales))
    monkeypatch.setattr(dispatch, "_onednn_bf16", lambda: True)
    assert torch.equal(quant.TORCH_IMPLS["int8"](x, qw), F.linear(x, codes).mul_(scales))


@pytest.mark.parametrize("kernel", ["bf16_linear", "bf16_gemv"])
def test_nan_and_inf_come_out_as_torch_writes_them(kernel: str) -> None:
    if kernel == "bf16_gemv" and not cpu_native.available():  # kw_bgemv512: tests/unit/kernels/test_cpu_bf16_gemv.py
        pytest.skip(f"the AVX512-BF16 build: {cpu_native.reasons()[0]}")
    x = torch.ones(3, 32, dtype=torch.bfloat16)
    x[0, 5], x[1, 7] = float("nan"), float("inf")
    out = getattr(native_ops, kernel)(x, torch.ones(16, 32, dtype=torch.bfloat16))
    assert out[0].view(torch.int16).eq(0x7FC0).all()  # the canonical bf16 NaN, as torch's conversion gives
    assert out[1].isposinf().all() and out[2].eq(32).all()
