"""keepwarm's AVX512-BF16 C kernels (kernels/csrc/gemm_int8_avx512.c, gemm_int4_vbmi.c): the int8 x bfloat16 matmul
against float64, its build cache, its thread pool across fork(), and its switch. Needs an AVX512-BF16 CPU and a C
compiler (this machine and CI have both); elsewhere the tests say which is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from support.int4_pack import halves, q4_case, torch_pack_matches_hand_pack, within_one_rounding

from keepwarm.kernels import cpu_native, native_ops

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"native kernels: {cpu_native.reasons()[0]}")


def _expected(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x.double() @ q.double().t()) * s.float().double()


# (M, N, K): one row (the streaming path) and many (the tiled path); K neither a multiple of 32 nor of 64, odd K
# (row by row), K = 2 (too short for pairs), N not a multiple of the 4-channel block or the 32-channel tile, and
# M above the 12-row micro-kernel.
SHAPES = [(1, 37, 45), (1, 256, 64), (3, 40, 2), (2, 33, 66), (3, 96, 576), (13, 40, 130), (29, 70, 1001),
          (40, 64, 512)]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_linear_matches_float64(m: int, n: int, k: int, threads: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    q[0, : min(k, 3)] = torch.tensor([-128, 127, 0][: min(k, 3)], dtype=torch.int8)  # the code range's ends
    s = (torch.rand(n, generator=g) * 0.01 + 1e-3).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native_ops.int8_linear(x, q, s)
    finally:
        torch.set_num_threads(before)
    want = _expected(x, q, s)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # float32 sums in another order, then one bfloat16 rounding: within 2^-8 of each output's magnitude bound.
    bound = (x.double().abs() @ q.double().abs().t()) * s.double()
    assert bool(((got.double() - want).abs() <= bound * 2.0**-8 + 1e-30).all())


@pytest.mark.parametrize("fp8", [False, True])
def test_tiled_rows_do_not_depend_on_the_batch_or_threads(fp8: bool) -> None:
    """Above one row each output is one float32 sum in k order whatever the batch and the split: the next tile is
    packed inside the products of this one, in another buffer, and x read from a panel of its pairs. K = 1152 is
    4.5 tiles of 128 pairs and N = 100 ends in a 4-channel tile, so a unit packed into the wrong buffer, tile or
    place shows as a changed bit."""
    g = torch.Generator().manual_seed(11)
    # magnitudes 2^-12 .. 2^12: float32 sums round, so another summation order would show in the bf16 results
    x = (torch.randn(40, 1152, generator=g) * torch.exp2(torch.randint(-12, 13, (40, 1152), generator=g))).bfloat16()
    if fp8:
        w = (torch.randn(100, 1152, generator=g) * 50).to(torch.float8_e4m3fn)
        s = torch.rand(100, generator=g) + 0.5
        run = native_ops.fp8_linear
    else:
        w = torch.randint(-128, 128, (100, 1152), dtype=torch.int8, generator=g)
        s = (torch.rand(100, generator=g) + 0.5).bfloat16()
        run = native_ops.int8_linear
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = run(x, w, s)
        for rows in (2, 5, 12, 13, 25):
            assert torch.equal(run(x[:rows].contiguous(), w, s), full[:rows]), rows
        assert torch.equal(run(x[7:10].contiguous(), w, s), full[7:10])
        torch.set_num_threads(1)
        assert torch.equal(run(x, w, s), full)
    finally:
        torch.set_num_threads(before)
    want = (x.double() @ w.double().t()) * s.double()
    bound = (x.double().abs() @ w.double().abs().t()) * s.double()
    assert bool(((full.double() - want).abs() <= bound * 2.0**-8 + 1e-30).all())


def test_int8_linear_rejects_what_it_cannot_run() -> None:
    q = torch.zeros(8, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="bfloat16|int8_linear"):
        native_ops.int8_linear(torch.zeros(1, 32), q, torch.ones(8))
    with pytest.raises(ValueError, match="int8_linear"):
        native_ops.int8_linear(torch.zeros(1, 16, dtype=torch.bfloat16), q, torch.ones(8))
    with pytest.raises(ValueError, match="contiguous"):
        native_ops.int8_linear(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(32, 8, dtype=torch.int8).t(),
                               torch.ones(8))


def test_switch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    assert not cpu_native.available() and cpu_native.reasons()[0] == f"{cpu_native.ENV_VAR}=0"
    monkeypatch.delenv(cpu_native.ENV_VAR)
    assert cpu_native.available()


_CHILD = textwrap.dedent("""
    import os, sys, torch
    from keepwarm.kernels import cpu_native, native_ops
    torch.set_num_threads(2)
    x = torch.randn(5, 256).bfloat16(); q = torch.randint(-128, 128, (128, 256), dtype=torch.int8)
    s = torch.full((128,), 0.01).bfloat16()
    first = native_ops.int8_linear(x, q, s)  # starts the pool thread
    print(cpu_native._load()[0]._name)
    pid = os.fork()
    if pid == 0:  # the child has no pool threads: it must start its own, not wait for the parent's forever
        os._exit(0 if torch.equal(native_ops.int8_linear(x, q, s), first) else 3)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
""")


def test_build_cached_and_fork_safe(tmp_path: Path) -> None:
    env = {**os.environ, "KEEPWARM_HOME": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    built = list((tmp_path / "cache" / "native").iterdir())
    # one library, built by the first process and loaded from the cache by the second; no temporary left
    assert [p.name for p in built] == [Path(runs[0].stdout.strip()).name] == [Path(runs[1].stdout.strip()).name]


def test_calls_from_two_threads_take_turns() -> None:
    # ctypes drops the GIL: two engine-like threads may call at once and must not share the pool's one job.
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(7)
    cases = [(torch.randn(m, 256, generator=g).bfloat16(), torch.randint(-128, 128, (160, 256), dtype=torch.int8,
                                                                          generator=g)) for m in (1, 9)]
    s = torch.full((160,), 0.01).bfloat16()
    want = [native_ops.int8_linear(x, q, s) for x, q in cases]
    with ThreadPoolExecutor(2) as pool:
        for _ in range(20):
            got = list(pool.map(lambda c: native_ops.int8_linear(c[0], c[1], s), cases))
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_fp8_linear_every_code() -> None:
    # Each of the 254 finite e4m3 codes (subnormals and both zeros included) in one row: a one-hot x picks it out.
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    q = torch.zeros(64, 256, dtype=torch.uint8)
    q[:, : codes.numel()] = codes
    q = q.view(torch.float8_e4m3fn)
    x = torch.eye(256, dtype=torch.bfloat16)[: codes.numel()]
    got = native_ops.fp8_linear(x, q, torch.tensor(1.0))  # [codes, 64]: row i is code i in every column
    assert torch.equal(got[:, 0].float(), codes.view(torch.float8_e4m3fn).float())
    scales = torch.linspace(0.5, 2.0, 64)  # one per row (output channel): powers of two keep it exact only at 1
    per_row = native_ops.fp8_linear(x[:5], q, scales)
    assert torch.equal(per_row, (codes[:5].view(torch.float8_e4m3fn).float()[:, None] * scales).bfloat16())


@pytest.mark.parametrize(("m", "n", "k"), [(1, 70, 96), (17, 40, 130)])
def test_fp8_linear_matches_float64(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    q = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)
    s = torch.rand(n, generator=g) * 0.01 + 1e-3
    got = native_ops.fp8_linear(x, q, s)
    want = (x.double() @ q.double().t()) * s.double()
    bound = (x.double().abs() @ q.double().abs().t()) * s.double()
    assert bool(((got.double() - want).abs() <= bound * 2.0**-8 + 1e-30).all())


def test_codes_to_bf16_every_code() -> None:
    # every int8 code as itself and every finite e4m3 code as value / 256, with a row tail past 32 columns
    i8 = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).view(8, 32).repeat(1, 2)[:, :45].contiguous()
    assert torch.equal(native_ops.codes_to_bf16(i8), i8.bfloat16())
    f8 = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)[:250].view(10, 25)
    f8 = f8.view(torch.float8_e4m3fn).contiguous()
    assert torch.equal(native_ops.codes_to_bf16(f8).float() * 256, f8.float())
    with pytest.raises(ValueError, match="codes_to_bf16"):
        native_ops.codes_to_bf16(torch.zeros(4, 4))


# ---------------------------------------------------------------------------------- int4 above a few rows (kw_q4vec)
needs_vbmi = pytest.mark.skipif(not cpu_native.has_vbmi(), reason="the int4 vector kernel: the CPU lacks avx512vbmi")


@needs_vbmi
@pytest.mark.parametrize(("m", "n", "k", "gs", "block"),
                         [(1, 32, 32, 32, 32), (2, 96, 576, 64, 32), (13, 64, 256, 128, 32), (33, 96, 576, 32, 32),
                          (1, 64, 256, 32, 64), (1, 192, 256, 32, 64), (1, 96, 576, 32, 32), (5, 128, 512, 128, 64),
                          (40, 192, 1024, 64, 64)])
def test_int4_vector_kernel_matches_float64(m: int, n: int, k: int, gs: int, block: int) -> None:
    """Against float64 sums of the test's own dequantization (support/int4_pack.py) at the blocking edges: rows across
    the 12-row micro-kernel, channels past the 32-channel half of a 64-row block, K one 32-step or 256-chunks plus a
    tail, groups of 32 / 64 / 128, blocks of 32 and 64 rows; one row over 3 blocks (q4vec_row2's pair, then one)."""
    codes, sz, w = q4_case(n, k, gs, m + n + k + block)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(gs)).bfloat16()
    got = native_ops.q4_vec_linear(x, halves(codes, block), sz, gs, block)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    within_one_rounding(got, x.double() @ w.T, x.double().abs() @ w.abs().T)


@needs_vbmi
def test_int4_vector_kernel_reads_torchs_pack() -> None:
    torch_pack_matches_hand_pack(native_ops.q4_vec_linear)


@needs_vbmi
@pytest.mark.parametrize(("block", "gs"), [(64, 128), (32, 32), (32, 64)])
def test_int4_vector_rows_do_not_depend_on_the_batch_or_threads(block: int, gs: int) -> None:
    """One row (built in registers, q4vec_row) and many (through the code scratch): the same bits."""
    g = torch.Generator().manual_seed(3)
    # magnitudes 2^-12 .. 2^12: float32 sums round, so another summation order would show in the bf16 results
    x = (torch.randn(40, 1152, generator=g) * torch.exp2(torch.randint(-12, 13, (40, 1152), generator=g))).bfloat16()
    codes, sz, _ = q4_case(128, 1152, gs, 2)
    packed = halves(codes, block)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = native_ops.q4_vec_linear(x, packed, sz, gs, block)
        for rows in (1, 2, 3, 12, 13, 25):
            assert torch.equal(native_ops.q4_vec_linear(x[:rows].contiguous(), packed, sz, gs, block), full[:rows])
        for i in (5, 17, 39):
            assert torch.equal(native_ops.q4_vec_linear(x[i:i + 1].contiguous(), packed, sz, gs, block), full[i:i + 1])
        assert torch.equal(native_ops.q4_vec_linear(x[5:7].contiguous(), packed, sz, gs, block), full[5:7])
        torch.set_num_threads(1)
        assert torch.equal(native_ops.q4_vec_linear(x, packed, sz, gs, block), full)
        assert torch.equal(native_ops.q4_vec_linear(x[3:4].contiguous(), packed, sz, gs, block), full[3:4])
    finally:
        torch.set_num_threads(before)


@needs_vbmi
def test_int4_vector_kernel_refuses_what_it_cannot_take() -> None:
    codes, sz, _ = q4_case(48, 64, 32, 0)
    with pytest.raises(ValueError, match="do not fit"):
        native_ops.q4_vec_linear(torch.zeros(2, 64, dtype=torch.bfloat16), halves(codes, 16), sz, 32, 16)  # blocks 16
    codes, sz, _ = q4_case(64, 48, 16, 0)
    with pytest.raises(ValueError, match="do not fit"):
        native_ops.q4_vec_linear(torch.zeros(2, 48, dtype=torch.bfloat16), halves(codes, 32), sz, 16, 32)  # K 48
