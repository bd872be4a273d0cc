"""keepwarm's AVX2 int8, fp8 and int4 weight-only matmuls (kernels/csrc/gemm_int8_avx2.c ``kw_q8gemm``,
gemm_int4_avx2.c ``kw_q4gemm``),
which the int8 / fp8 / int4 linears of bfloat16 models take on CPUs without AVX512-BF16:
- every float8_e4m3fn code (subnormals and the largest included) is read exactly, at one row and above;
- against float64 sums of the test's own dequantization (codes written here, int4 packed here by torch's
  documented "halves" rule for blocks of 16, 32 and 64 rows, independent of the project's unpack): within one bf16
  rounding, at every blocking edge (rows of x 1-33, weight rows not a multiple of 8, groups of 32 / 64 / 128);
- one summation order per output: each row of a batch equals that row computed alone, at 1 and 2 threads (the
  M == 1 paths convert codes in registers, M > 1 through a scratch: the same bits); int8 gives kw_bgemm's bits on
  the codes as bf16 times the scale;
- torch's own int4 pack (the layout keepwarm's arena holds on this CPU) gives the same results as the hand pack;
- sizes the kernels cannot run are refused with a ValueError naming them, never computed wrong;
- routing: on a CPU without AVX512-BF16 the int8 / int4 linears of bf16 x take them, and KEEPWARM_CPU_NATIVE=0
  gives torch's ops back (tests/unit/kernels/test_quant.py ``test_select_path``).
The kernels run on every CPU with AVX2 + FMA (tests call them directly); elsewhere the tests say what is missing."""

from __future__ import annotations

import pytest
import torch
from support.int4_pack import halves, q4_case, torch_pack_matches_hand_pack, within_one_rounding

from keepwarm.kernels import cpu_native, native_ops

pytestmark = pytest.mark.skipif(not cpu_native.glue_on(),
                                reason=f"native kernels: {cpu_native.reasons()[1]}")

# (M, N, K): N = 8 rows per block, with tails; K = 16 (one step) to 2048; M odd and even (blocks of 2 rows of x)
Q8_SHAPES = [(1, 8, 16), (1, 13, 576), (2, 8, 32), (3, 12, 528), (7, 49, 64), (32, 96, 576), (33, 17, 2048),
             (1, 64, 1168), (5, 7, 1168)]




def _q8(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return q, (torch.rand(n, generator=g) * 0.02 + 1e-4).bfloat16()


@pytest.mark.parametrize(("m", "n", "k"), Q8_SHAPES)
def test_int8_is_within_one_rounding_of_the_true_product(m, n, k) -> None:
    q, s = _q8(n, k, m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    got = native_ops.q8_linear(x, q, s)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # with unit scales, kw_bgemm's bits on the codes as bf16 (exact): the same float32 sums in the same order
    ones = torch.ones(n, dtype=torch.bfloat16)
    assert torch.equal(native_ops.q8_linear(x, q, ones), native_ops.bf16_linear(x, q.bfloat16()))
    w = q.double() * s.double()[:, None]
    within_one_rounding(got, x.double() @ w.T, x.double().abs() @ w.abs().T)


def test_int8_exact_sums_give_the_exactly_rounded_product() -> None:
    # small integers and a power-of-two scale: every float32 partial sum is exact, so the result must be exact
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-8, 9, (5, 1168), generator=g).bfloat16()
    q = torch.randint(-128, 128, (21, 1168), generator=g, dtype=torch.int8)
    s = torch.full((21,), 2.0 ** -7).bfloat16()
    for rows in (x, x[:1]):
        true = (rows.double() @ q.double().T) * 2.0 ** -7
        assert torch.equal(native_ops.q8_linear(rows, q, s), true.to(torch.bfloat16))






@pytest.mark.parametrize(("m", "n", "k", "gs", "block"),
                         [(1, 32, 32, 32, 32), (1, 96, 576, 64, 32), (2, 64, 256, 128, 32), (3, 32, 1024, 128, 32),
                          (33, 96, 576, 32, 32), (1, 64, 256, 32, 64), (5, 128, 512, 128, 64), (1, 48, 64, 32, 16),
                          (7, 16, 96, 32, 16)])
def test_int4_is_within_one_rounding_of_the_true_product(m, n, k, gs, block) -> None:
    codes, sz, w = q4_case(n, k, gs, m + n + k + block)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(gs)).bfloat16()
    got = native_ops.q4_linear(x, halves(codes, block), sz, gs, block)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    within_one_rounding(got, x.double() @ w.T, x.double().abs() @ w.abs().T)


def test_torch_int4_pack_gives_the_hand_packs_results() -> None:
    torch_pack_matches_hand_pack(native_ops.q4_linear)


def test_each_row_is_computed_as_if_alone_at_any_thread_count() -> None:
    g = torch.Generator().manual_seed(3)
    # magnitudes 2^-12 .. 2^12: float32 sums round, so another summation order would show in the bf16 results
    x = (torch.randn(33, 1168, generator=g) * torch.exp2(torch.randint(-12, 13, (33, 1168), generator=g))).bfloat16()
    q, s = _q8(200, 1168, 1)
    codes, sz, _ = q4_case(256, 1152, 128, 2)
    packed = halves(codes, 32)
    before = torch.get_num_threads()
    try:
        for run in (lambda a: native_ops.q8_linear(a, q, s), lambda a: native_ops.q4_linear(a[:, :1152], packed, sz,
                                                                                             128, 32)):
            torch.set_num_threads(2)
            batch = run(x)
            pairs = torch.cat([run(x[i:i + 2]) for i in range(0, 32, 2)])
            torch.set_num_threads(1)
            alone = torch.cat([run(x[i:i + 1]) for i in range(33)])
            assert torch.equal(batch, alone) and torch.equal(batch[:32], pairs)
    finally:
        torch.set_num_threads(before)


def test_sizes_the_kernels_cannot_run_are_refused() -> None:
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    q, s = _q8(16, 64, 0)
    with pytest.raises(ValueError, match="do not fit"):
        native_ops.q8_linear(x.float(), q, s)  # float32 x
    with pytest.raises(ValueError, match="do not fit"):
        native_ops.q8_linear(torch.zeros(2, 56, dtype=torch.bfloat16), q[:, :56].contiguous(), s)  # K % 16
    with pytest.raises(ValueError, match="do not fit"):
        native_ops.q8_linear(x, q, s[:8])  # neither one scale per row nor one for the tensor
    codes, sz, _ = q4_case(48, 64, 32, 0)
    with pytest.raises(ValueError, match="do not fit"):
        native_ops.q4_linear(x, halves(codes, 16), sz, 32, 32)  # 48 rows are not whole blocks of 32
    with pytest.raises(ValueError, match="do not fit"):
        native_ops.q4_linear(x, halves(codes, 16), sz, 64, 16)  # scales for groups of 32, not 64
    with pytest.raises(ValueError, match="do not fit"):
        native_ops.q4_linear(x, halves(codes, 16), sz.float(), 32, 16)  # float32 scales


def _every_e4m3_code(n: int) -> torch.Tensor:
    """[n, 256] float8_e4m3fn codes: every code but the two NaNs in each row (rotated), zeros for them."""
    codes = torch.arange(256, dtype=torch.int32)
    rows = torch.stack([codes.roll(i) for i in range(n)]).to(torch.uint8)
    rows[(rows & 0x7F) == 0x7F] = 0
    return rows.view(torch.float8_e4m3fn)


def test_fp8_codes_are_read_exactly() -> None:
    # x = the identity: out[m, n] = w[n, m] * 1, exactly representable in bf16 (e4m3 has 3 mantissa bits)
    q = _every_e4m3_code(24)
    eye = torch.eye(256, dtype=torch.bfloat16)
    want = q.float().T.bfloat16()
    assert torch.equal(native_ops.q8_linear(eye, q, torch.ones(1)), want)  # M > 1: through bf16
    for m in (0, 1, 7, 8, 9, 127, 255):  # M == 1: in registers, subnormals (codes 1-7) and the largest included
        assert torch.equal(native_ops.q8_linear(eye[m:m + 1], q, torch.ones(24)), want[m:m + 1])


@pytest.mark.parametrize(("m", "n", "k"), [(1, 24, 256), (3, 17, 512), (33, 40, 1168)])
def test_fp8_is_within_one_rounding_of_the_true_product(m, n, k) -> None:
    g = torch.Generator().manual_seed(m + n)
    q = (torch.randn(n, k, generator=g) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(n, generator=g) * 0.01 + 1e-4
    x = torch.randn(m, k, generator=g).bfloat16()
    w = q.double() * s.double()[:, None]
    for scale, weight in ((s, w), (s[:1], q.double() * float(s[0]))):  # per row, per tensor
        got = native_ops.q8_linear(x, q, scale)
        within_one_rounding(got, x.double() @ weight.T, x.double().abs() @ weight.abs().T)
