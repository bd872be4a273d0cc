"""keepwarm's AMX tile matmuls (kernels/csrc/gemm_int8_amx.c: ``kw_gemm``'s tile path for int8 / fp8 above one
row, gemm_int4_amx.c ``kw_q4amx`` for int4 in torch's "halves" pack), which bfloat16 models take on CPUs with
amx_tile, amx_bf16 and avx512vbmi:
- the path is on exactly where the CPU has the tiles and ``KEEPWARM_CPU_AMX`` is not 0, and a call counter shows
  each checked call really ran on the tiles (or did not);
- against float64 sums of the test's own dequantization (int4 packed by tests/support/int4_pack.py from torch's
  documented rule, not the project's): within one bf16 rounding, at the blocking edges (rows of x 1-70 across the
  16-row tiles, channels past the 32-channel tile, K one 32-step, a 512-chunk plus a tail, groups of 32 / 64 / 128,
  blocks of 32 and 64 rows), and int8 / fp8 also against the vector path;
- one summation order per output: a row of a batch equals that row in any other batch, at 1 and 2 threads;
- int4 with torch's own pack (the arena's layout here) equals the hand pack;
- sizes the tiles cannot take are refused by the int4 entry, never computed wrong.
Needs an AVX512-BF16 CPU with AMX; elsewhere the tile tests say what is missing (the vector paths they compare with
are tested on every CPU by tests/unit/kernels/test_cpu_native.py and tests/unit/kernels/test_cpu_quant_avx2.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch
from support.int4_pack import halves, q4_case, torch_pack_matches_hand_pack, within_one_rounding

from keepwarm.kernels import cpu_native, native_ops

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"native kernels: {cpu_native.reasons()[0]}")
_HAS_AMX = {"amx_tile", "amx_bf16", "avx512vbmi"} <= cpu_native.cpu_flags()
needs_amx = pytest.mark.skipif(not _HAS_AMX, reason="AMX tiles: the CPU lacks amx_tile / amx_bf16 / avx512vbmi")


def test_amx_on_where_the_cpu_has_it() -> None:
    if os.environ.get(cpu_native.AMX_ENV_VAR, "1") == "0":
        assert cpu_native.amx_reason() == f"{cpu_native.AMX_ENV_VAR}=0"
    elif _HAS_AMX:
        assert cpu_native.amx_reason() == ""
    else:
        assert "amx" in cpu_native.amx_reason()


@pytest.fixture
def amx() -> Iterator[None]:
    before = cpu_native.amx_reason() == ""
    assert cpu_native.set_amx(True)
    yield
    cpu_native.set_amx(before)


def _tiles_then_vector(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """fn's result on the tiles and on the vector path, each checked to have taken its path."""
    calls = cpu_native.amx_calls()
    tiles = fn()
    assert cpu_native.amx_calls() == calls + 1
    cpu_native.set_amx(False)
    try:
        vector = fn()
    finally:
        cpu_native.set_amx(True)
    assert cpu_native.amx_calls() == calls + 1
    return tiles, vector




# M from 2 (the tiles' lowest) through one and two 16-row blocks and their tails; N below, at and past the
# 32-channel tile; K one 32-step, a 512-chunk plus a tail, two whole chunks.
@needs_amx
@pytest.mark.parametrize(("m", "n", "k"), [(2, 37, 32), (16, 64, 576), (17, 100, 1024), (33, 33, 96),
                                           (70, 64, 544)])
@pytest.mark.parametrize("fp8", [False, True])
def test_int8_fp8_match_float64_and_the_vector_path(amx: None, m: int, n: int, k: int, fp8: bool) -> None:
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    if fp8:
        q = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)
        s = torch.rand(n, generator=g) * 0.01 + 1e-3
        tiles, vector = _tiles_then_vector(lambda: native_ops.fp8_linear(x, q, s))
    else:
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        s = (torch.rand(n, generator=g) * 0.01 + 1e-3).bfloat16()
        tiles, vector = _tiles_then_vector(lambda: native_ops.int8_linear(x, q, s))
    w = q.double() * s.double()[:, None]
    for got in (tiles, vector):
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        within_one_rounding(got, x.double() @ w.T, x.double().abs() @ w.abs().T)


@needs_amx
def test_fp8_every_code_on_the_tiles(amx: None) -> None:
    # the 254 finite e4m3 codes in one row of the weight, picked out by one-hot rows of x (K = 256: the tiles)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    q = torch.zeros(64, 256, dtype=torch.uint8)
    q[:, : codes.numel()] = codes
    x = torch.eye(256, dtype=torch.bfloat16)[: codes.numel()]
    calls = cpu_native.amx_calls()
    got = native_ops.fp8_linear(x, q.view(torch.float8_e4m3fn), torch.tensor(1.0))
    assert cpu_native.amx_calls() == calls + 1
    assert torch.equal(got[:, 0].float(), codes.view(torch.float8_e4m3fn).float())






@needs_amx
@pytest.mark.parametrize(("m", "n", "k", "gs", "block"),
                         [(1, 32, 32, 32, 32), (2, 96, 576, 64, 32), (17, 64, 256, 128, 32), (33, 96, 576, 32, 32),
                          (1, 64, 256, 32, 64), (5, 128, 512, 128, 64), (40, 192, 1024, 64, 64)])
def test_int4_matches_float64(amx: None, m: int, n: int, k: int, gs: int, block: int) -> None:
    codes, sz, w = q4_case(n, k, gs, m + n + k + block)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(gs)).bfloat16()
    calls = cpu_native.amx_calls()
    got = native_ops.q4_amx_linear(x, halves(codes, block), sz, gs, block)
    assert cpu_native.amx_calls() == calls + 1
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    within_one_rounding(got, x.double() @ w.T, x.double().abs() @ w.abs().T)


@needs_amx
def test_torch_int4_pack_gives_the_hand_packs_results(amx: None) -> None:
    torch_pack_matches_hand_pack(native_ops.q4_amx_linear)


@needs_amx
def test_rows_do_not_depend_on_the_batch_or_threads(amx: None) -> None:
    g = torch.Generator().manual_seed(3)
    # magnitudes 2^-12 .. 2^12: float32 sums round, so another summation order would show in the bf16 results
    x = (torch.randn(40, 1152, generator=g) * torch.exp2(torch.randint(-12, 13, (40, 1152), generator=g))).bfloat16()
    q = torch.randint(-128, 128, (96, 1152), dtype=torch.int8, generator=g)
    s = torch.rand(96, generator=g).bfloat16()
    codes, sz, _ = q4_case(128, 1152, 128, 2)
    packed = halves(codes, 64)
    before = torch.get_num_threads()
    try:
        for run in (lambda a: native_ops.int8_linear(a, q, s), lambda a: native_ops.q4_amx_linear(a, packed, sz, 128,
                                                                                                   64)):
            torch.set_num_threads(2)
            full = run(x)
            for rows in (2, 3, 16, 17, 33):
                assert torch.equal(run(x[:rows].contiguous()), full[:rows])
            assert torch.equal(run(x[5:7].contiguous()), full[5:7])
            torch.set_num_threads(1)
            assert torch.equal(run(x), full)
    finally:
        torch.set_num_threads(before)


@needs_amx
def test_int4_sizes_the_tiles_cannot_take_are_refused(amx: None) -> None:
    codes, sz, _ = q4_case(48, 64, 32, 0)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        native_ops.q4_amx_linear(x, halves(codes, 16), sz, 32, 16)  # blocks of 16 rows
    codes, sz, _ = q4_case(64, 48, 16, 0)
    with pytest.raises(ValueError, match="do not fit"):
        native_ops.q4_amx_linear(torch.zeros(2, 48, dtype=torch.bfloat16), halves(codes, 32), sz, 16, 32)  # K 48
    cpu_native.set_amx(False)
    codes, sz, _ = q4_case(64, 64, 32, 0)
    with pytest.raises(ValueError, match="no AMX"):
        native_ops.q4_amx_linear(x, halves(codes, 32), sz, 32, 32)
