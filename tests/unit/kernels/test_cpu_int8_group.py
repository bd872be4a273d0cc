"""keepwarm's int8_group matmuls (kernels/csrc/gemm_int8_group.h: ``kw_q8group`` on AVX2, ``kw_q8group512`` on
AVX-512, which takes the AMX tiles first where they are on and K % 32 == 0, gemm_int8_group_amx.c; ``kw_q8group_bf16``,
the wide path's weight), which GGUF Q8_0 / Q5_K / Q6_K / Q4_K weights of bfloat16 models take on the CPU; each check
runs on the AVX2 kernel, AVX-512's vector kernel (tiles off) and the tiles (where the CPU has them, each call checked
to have taken them):
- against the test's own float64 product x @ (q * s + z)^T over odd shapes (rows 1, 3, 8, 33; weight rows not a
  multiple of 8 or 16; groups of 16, 32, 64, 128; K of one to many groups), signed scales, non-zero zeros, within
  BOUND; with small integers and power-of-two scales every float32 sum is exact, so the result must be the float64
  one rounded to bf16, bit for bit;
- one summation order per output: each row of a batch equals that row alone, at 1 and at 2 threads (same bits);
- the wide path's bf16 weight is the reference's ``dequantize(torch.bfloat16)``, bit for bit;
- sizes the kernels cannot run are refused (ValueError), never computed wrong;
- 4-bit codes in the int8_group_u4 pack (GGUF Q4_K / Q2_K) give the int8 codes' bits through every path (the
  kernels at 1 / many rows, the wide path's weight, the reference's dequantization), on half the bytes;
- dispatch: bfloat16 x takes the kernel (select and describe name it), float32 x, g_idx and groups of 8 the
  reference, 33+ rows the wide path where oneDNN has a bf16 matmul; ``KEEPWARM_CPU_NATIVE=0`` the reference;
- a tiny llama GGUF of Q4_K / Q5_K / Q6_K / Q8_0 projections decodes in bfloat16 the same greedy tokens through the
  kernels as through the reference.
BOUND, derived: the vector kernels: each product x * (q * s) is exact in float32 (8 + 8 + 8 significant bits); the
float32 result c adds at most K / 8 of them per lane, x's group sums (gs / 8 per lane, a tree of 3), G / 8 zero
terms per lane and a tree of 4 over the lanes, so |c - t| <= g * mag with g = (K / 8 + gs / 8 + G + 8) * 2^-24
(first order, 8 lanes; 16 lanes sum fewer terms) and mag = |x| @ (|q s| + |z|)^T. The tiles: a group's sum of the
exact products x * q rounds gs - 1 times, each group's two fused multiply-adds (scale times that sum, zero times x's
group sum: gs / 16 + 4 roundings) once each, so g = (gs + 2 G + gs / 16 + 4) * 2^-24. Both are under
g = (K / 8 + gs + 2 G + 8) * 2^-24, the bound checked; rounding to bf16 adds at most 2^-8 |c|. So
|got - t| <= 2^-8 |t| + (1 + 2^-8) g mag.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import pytest
import torch
from support.tiny_gguf import tiny_gguf_dir

from keepwarm import LLM, SamplingParams, kernels
from keepwarm.formats.quant import LAYOUT_INT8_GROUP_U4, QuantMeta, pack_u4_groups, unpack_u4_groups
from keepwarm.kernels import cpu_native, cpu_step, dispatch, native_ops, quant
from keepwarm.kernels.quant import QuantizedWeight, linear_reference

pytestmark = pytest.mark.skipif(not cpu_native.glue_on(), reason=f"native kernels: {cpu_native.reasons()[1]}")

# (M, N, K, gs): weight rows in blocks of 8 (M == 1) and 4 (M > 1) with tails; rows of x in blocks of 3 / 4, 2, 1
CASES = [(1, 13, 16, 16), (1, 100, 576, 32), (3, 37, 512, 16), (8, 100, 256, 64), (33, 29, 1024, 128),
         (8, 24, 384, 128), (3, 200, 1536, 32), (33, 7, 64, 32), (1, 1, 128, 128), (49, 70, 96, 16)]


_HAS_AMX = {"amx_tile", "amx_bf16", "avx512vbmi"} <= cpu_native.cpu_flags()


@contextlib.contextmanager
def _tiles(on: bool) -> Iterator[None]:
    before = cpu_native.amx_reason() == ""
    assert cpu_native.set_amx(on) == on
    try:
        yield
    finally:
        cpu_native.set_amx(before)


def _q8g_vector512(*args: object) -> torch.Tensor:
    """the AVX-512 entry with the tiles off: its vector kernel"""
    with _tiles(False):
        return native_ops.q8g_avx512_linear(*args)


def _entries() -> list[object]:
    """The vector entry points (AVX2; AVX-512 with the tiles off), the AVX-512 one marked skipped where this machine
    has no avx512 build."""
    no512 = cpu_native.variant_name() != "avx512"
    return [pytest.param(native_ops.q8g_linear, id="avx2"),
            pytest.param(_q8g_vector512, id="avx512",
                         marks=pytest.mark.skipif(no512, reason="no avx512 build here (the CPU lacks AVX512-BF16)"))]


def _case(n: int, k: int, gs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s = (torch.randn(n, k // gs, generator=g) * 0.01).bfloat16()  # signed, as GGUF's float16 scales may be
    z = (torch.randn(n, k // gs, generator=g) * 0.02).bfloat16()
    return q, s, z


def _dense(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, gs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q * s + z, |q s| + |z|) in float64, written here from the layout's definition"""
    n, k = q.shape
    qs = q.double().view(n, k // gs, gs) * s.double()[..., None]
    zz = z.double()[..., None].expand(n, k // gs, gs)
    return (qs + zz).reshape(n, k), (qs.abs() + zz.abs()).reshape(n, k)


def _within_bound(got: torch.Tensor, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor,
                  gs: int) -> None:
    w, wabs = _dense(q, s, z, gs)
    k = q.shape[1]
    true, mag = x.double() @ w.T, x.double().abs() @ wabs.T
    gamma = (k / 8 + gs + 2 * (k // gs) + 8) * 2.0 ** -24
    excess = (got.double() - true).abs() - (true.abs() * 2.0 ** -8 + (1 + 2.0 ** -8) * gamma * mag)
    assert bool((excess <= 0).all()), f"max excess {float(excess.max()):.3g}"


@pytest.mark.parametrize("linear", _entries())
@pytest.mark.parametrize(("m", "n", "k", "gs"), CASES)
def test_within_the_bound_of_the_float64_product(linear: Callable[..., torch.Tensor], m: int, n: int, k: int,
                                                 gs: int) -> None:
    q, s, z = _case(n, k, gs, m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(gs)).bfloat16()
    got = linear(x, q, s, z, gs)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    _within_bound(got, x, q, s, z, gs)
    # x [..., K] keeps its leading shape
    assert torch.equal(linear(x.view(1, m, k), q, s, z, gs), got.view(1, m, n))


@pytest.mark.parametrize("linear", _entries())
@pytest.mark.parametrize(("m", "gs"), [(1, 16), (5, 16), (1, 64), (8, 64)])
def test_exact_sums_give_the_exactly_rounded_product(linear: Callable[..., torch.Tensor], m: int, gs: int) -> None:
    # small integers, power-of-two scales, zeros on a 2^-5 grid: every float32 partial sum is exact (under 2^15 on a
    # 2^-7 grid), so the result must be the true product rounded to bf16 once
    g = torch.Generator().manual_seed(gs + m)
    n, k = 21, 1152
    x = torch.randint(-8, 9, (m, k), generator=g).bfloat16()
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s = (torch.randint(0, 2, (n, k // gs), generator=g) * 2 - 1) * 2.0 ** -torch.randint(7, 10, (n, k // gs),
                                                                                         generator=g)
    z = torch.randint(-8, 9, (n, k // gs), generator=g) * 2.0 ** -5
    s, z = s.bfloat16(), z.bfloat16()
    true = x.double() @ _dense(q, s, z, gs)[0].T
    assert torch.equal(linear(x, q, s, z, gs), true.to(torch.bfloat16))


@pytest.mark.parametrize("linear", _entries())
def test_each_row_is_computed_as_if_alone_at_any_thread_count(linear: Callable[..., torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(3)
    # magnitudes 2^-12 .. 2^12: float32 sums round, so another summation order would show in the bf16 results
    x = (torch.randn(33, 1152, generator=g) * torch.exp2(torch.randint(-12, 13, (33, 1152), generator=g))).bfloat16()
    q, s, z = _case(200, 1152, 32, 1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = linear(x, q, s, z, 32)
        pairs = torch.cat([linear(x[i:i + 2], q, s, z, 32) for i in range(0, 32, 2)])
        torch.set_num_threads(1)
        alone = torch.cat([linear(x[i:i + 1], q, s, z, 32) for i in range(33)])
        assert torch.equal(linear(x, q, s, z, 32), batch)  # 1 thread and 2: the same bits
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batch, alone) and torch.equal(batch[:32], pairs)


@pytest.mark.parametrize("lanes", [pytest.param(8, id="avx2"), pytest.param(16, id="avx512", marks=pytest.mark.skipif(
    cpu_native.variant_name() != "avx512", reason="no avx512 build here (the CPU lacks AVX512-BF16)"))])
def test_wide_weight_is_the_references_dequantization(lanes: int) -> None:
    for n, k, gs in ((13, 576, 32), (37, 512, 16), (200, 1024, 128)):
        q, s, z = _case(n, k, gs, n)
        meta = QuantMeta("int8_group", "int8_group", gs, (n, k))
        want = QuantizedWeight(meta, {"qweight": q, "scales": s, "zeros": z}).dequantize(torch.bfloat16)
        assert torch.equal(native_ops.q8g_to_bf16(q, s, z, gs, lanes), want)
        z[0, 0] = float("nan")  # a NaN zero: the reference's NaN, as bf16 0x7FC0 (its sign dropped)
        got = native_ops.q8g_to_bf16(q, s, z, gs, lanes)
        assert torch.isnan(got[0, :gs]).all() and torch.equal(got[1:], want[1:])


def test_sizes_the_kernels_cannot_run_are_refused() -> None:
    q, s, z = _case(16, 96, 32, 0)
    x = torch.zeros(2, 96, dtype=torch.bfloat16)
    q48, s48, z48 = _case(16, 48, 16, 0)
    bad = [
        ((x.float(), q, s, z, 32), "float32 x"),
        ((x, q, s, z, 16), "scales for groups of 32, not 16"),
        ((x, q, s.float(), z, 32), "float32 scales"),
        ((x, q, s, z[:, :2].contiguous(), 32), "zeros of another shape"),
        ((x, q.t().contiguous().t(), s, z, 32), "a column-major weight"),
        ((torch.zeros(2, 48, dtype=torch.bfloat16), q48, s48[:, :2].contiguous(), z48[:, :2].contiguous(), 24),
         "groups of 24 (no multiple of 16)"),
        ((torch.zeros(2, 40, dtype=torch.bfloat16), q[:, :40].contiguous(), s[:, :2].contiguous(),
          z[:, :2].contiguous(), 20), "groups of 20"),
    ]
    for args, why in bad:
        assert not native_ops.q8g_fits(*args), why
        with pytest.raises(ValueError, match="do not fit"):
            native_ops.q8g_linear(*args)
    with pytest.raises(ValueError, match="do not fit"):
        native_ops.q8g_to_bf16(q, s, z, 16)


def _weight(n: int, k: int, gs: int, layout: str = "int8_group") -> QuantizedWeight:
    q, s, z = _case(n, k, gs, 7)
    parts = {"qweight": q, "scales": s, "zeros": z}
    if layout == "int8_gidx":
        parts["g_idx"] = (torch.arange(k, dtype=torch.int32) // gs)
    return QuantizedWeight(QuantMeta("int8_group", layout, gs, (n, k)), parts)


@pytest.mark.parametrize(("level", "rows", "want"), [
    ("amx", 1, dispatch.INT8G_AVX512), ("avx512-vbmi", 32, dispatch.INT8G_AVX512),
    ("avx512", 8, dispatch.INT8G_AVX512),
    ("avx2", 1, dispatch.INT8G_AVX2), ("avx2", 32, dispatch.INT8G_AVX2), ("none", 1, dispatch.REFERENCE),
])
def test_bf16_x_takes_the_kernel(monkeypatch: pytest.MonkeyPatch, level: str, rows: int, want: str) -> None:
    monkeypatch.setattr(dispatch, "isa", lambda: level)
    x = torch.zeros(rows, 256, dtype=torch.bfloat16)
    assert dispatch.select_linear("int8_group", x, _weight(48, 256, 32)) == want
    assert dispatch.select_linear("int8_group", x, _weight(48, 256, 16)) == want  # Q6_K's groups of 16
    # float32 x, a g_idx and groups the kernels do not take: the reference
    assert dispatch.select_linear("int8_group", x.float(), _weight(48, 256, 32)) == dispatch.REFERENCE
    assert dispatch.select_linear("int8_group", x, _weight(48, 256, 32, "int8_gidx")) == dispatch.REFERENCE
    assert dispatch.select_linear("int8_group", x, _weight(48, 256, 8)) == dispatch.REFERENCE
    above = (dispatch.Q8G_TILE_ROWS if level == "amx" else dispatch.Q8G_WIDE_ROWS) + 1  # the tiles up to theirs
    wide = dispatch.select_linear("int8_group", torch.zeros(above, 256, dtype=torch.bfloat16), _weight(48, 256, 32))
    if level != "none":
        assert wide == (dispatch.INT8G_WIDE if dispatch._onednn_bf16() else want)
    kernels = [r[3] for r in dispatch.describe().rows if r[0] == "linear_int8_group"]
    assert want in kernels and kernels[-1] == dispatch.REFERENCE and (len(kernels) == 1) == (level == "none")


@pytest.mark.parametrize("level", ["amx", "avx512-vbmi"])
def test_the_tiles_take_two_rows_to_their_row_limit(monkeypatch: pytest.MonkeyPatch,
                                                                    level: str) -> None:
    monkeypatch.setattr(dispatch, "isa", lambda: level)
    q, s, z = _u4_case(48, 256, 32, 3)
    u4 = QuantizedWeight(QuantMeta("int8_group", LAYOUT_INT8_GROUP_U4, 32, (48, 256)),
                         {"qweight": pack_u4_groups(q), "scales": s, "zeros": z})
    wide = dispatch.INT8G_WIDE if dispatch._onednn_bf16() else dispatch.INT8G_AVX512
    tile_rows = dispatch.Q8G_TILE_ROWS
    for rows, want in [(1, dispatch.INT8G_AVX512), (2, dispatch.INT8G_AMX), (tile_rows, dispatch.INT8G_AMX),
                       (tile_rows + 1, wide)]:
        got = dispatch.select_linear("int8_group", torch.zeros(rows, 256, dtype=torch.bfloat16), u4)
        assert got == (want if level == "amx" or want != dispatch.INT8G_AMX else
                       (wide if rows > dispatch.Q8G_WIDE_ROWS else dispatch.INT8G_AVX512)), rows
    # int8 codes (Q8_0, Q6_K, Q5_0 ...) take them where K % 64 == 0; 4-bit codes need K % 128 == 0
    i8 = dispatch.select_linear("int8_group", torch.zeros(8, 256, dtype=torch.bfloat16), _weight(48, 256, 32))
    assert i8 == (dispatch.INT8G_AMX if level == "amx" else dispatch.INT8G_AVX512)
    assert dispatch.select_linear("int8_group", torch.zeros(8, 96, dtype=torch.bfloat16), _weight(48, 96, 32)) \
        == dispatch.INT8G_AVX512
    q2, s2, z2 = _u4_case(48, 192, 32, 4)
    odd = QuantizedWeight(QuantMeta("int8_group", LAYOUT_INT8_GROUP_U4, 32, (48, 192)),
                          {"qweight": pack_u4_groups(q2), "scales": s2, "zeros": z2})
    assert dispatch.select_linear("int8_group", torch.zeros(8, 192, dtype=torch.bfloat16), odd) \
        == dispatch.INT8G_AVX512


def test_linear_runs_the_kernel_and_the_switch_gives_the_reference(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(quant, "_LOGGED", set())
    caplog.set_level(logging.INFO, logger="keepwarm.kernels")
    w = _weight(48, 256, 32)
    p = w.parts
    kernel = native_ops.q8g_avx512_linear if dispatch.isa() in dispatch._AVX512S else native_ops.q8g_linear
    x, bias = torch.randn(3, 5, 256).bfloat16(), torch.randn(48).bfloat16()
    assert torch.equal(kernels.linear(x, w), kernel(x, p["qweight"], p["scales"], p["zeros"], 32))
    assert torch.equal(kernels.linear(x, w, bias), kernel(x, p["qweight"], p["scales"], p["zeros"], 32) + bias)
    wide = torch.randn(max(dispatch.Q8G_WIDE_ROWS, dispatch.Q8G_TILE_ROWS) + 1, 256).bfloat16()
    if dispatch._onednn_bf16():  # the wide path: the reference's weight and matmul, so its bits
        assert torch.equal(kernels.linear(wide, w, bias), linear_reference(wide, w, bias))
    assert any(r.getMessage().startswith("linear int8_group: keepwarm C kernel, int8 groups") for r in caplog.records)
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    assert dispatch.select_linear("int8_group", x, w) == dispatch.REFERENCE
    assert torch.equal(kernels.linear(x, w), linear_reference(x, w))


# ---------------------------------------------------------------------------------------------- 4-bit codes
def test_u4_pack_puts_column_j_and_16_plus_j_in_byte_j() -> None:
    codes = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64).repeat(3, 1)
    codes[1] = torch.randint(0, 16, (64,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    packed = pack_u4_groups(codes)
    assert packed.shape == (3, 32) and packed.dtype == torch.uint8
    for row in range(3):
        for c in range(2):  # each 32 columns
            for j in range(16):
                lo, hi = int(codes[row, c * 32 + j]), int(codes[row, c * 32 + 16 + j])
                assert int(packed[row, c * 16 + j]) == lo | hi << 4
    assert torch.equal(unpack_u4_groups(packed), codes)


@pytest.mark.parametrize("linear", _entries())
@pytest.mark.parametrize(("m", "n", "k", "gs"), [(1, 13, 64, 16), (1, 100, 576, 32), (3, 37, 512, 16),
                                                  (8, 100, 256, 64), (33, 29, 1024, 128), (49, 70, 96, 32)])
def test_u4_codes_give_the_int8_codes_bits(linear: Callable[..., torch.Tensor], m: int, n: int, k: int,
                                           gs: int) -> None:
    g = torch.Generator().manual_seed(m + n + k)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    _, s, z = _case(n, k, gs, n)
    x = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-12, 13, (m, k), generator=g))).bfloat16()
    packed = pack_u4_groups(q)
    assert native_ops.q8g_fits(x, packed, s, z, gs) and packed.nbytes * 2 == q.nbytes
    assert torch.equal(linear(x, packed, s, z, gs), linear(x, q, s, z, gs))
    assert torch.equal(linear(x[:1].contiguous(), packed, s, z, gs), linear(x[:1].contiguous(), q, s, z, gs))
    for lanes in (8, 16) if cpu_native.variant_name() == "avx512" else (8,):
        assert torch.equal(native_ops.q8g_to_bf16(packed, s, z, gs, lanes), native_ops.q8g_to_bf16(q, s, z, gs, 8))
    u4 = QuantizedWeight(QuantMeta("int8_group", LAYOUT_INT8_GROUP_U4, gs, (n, k)),
                         {"qweight": packed, "scales": s, "zeros": z})
    i8 = QuantizedWeight(QuantMeta("int8_group", "int8_group", gs, (n, k)), {"qweight": q, "scales": s, "zeros": z})
    assert torch.equal(u4.dequantize(), i8.dequantize())
    # the same kernel, but where the tiles take the 4-bit codes (test_4bit_codes_take_the_tiles_...)
    tiles = dispatch.select_linear("int8_group", x, u4) == dispatch.INT8G_AMX
    assert tiles or dispatch.select_linear("int8_group", x, u4) == dispatch.select_linear("int8_group", x, i8)


def test_u4_sizes_the_kernels_cannot_run_are_refused() -> None:
    q = torch.randint(0, 16, (16, 48), dtype=torch.int8)
    _, s, z = _case(16, 48, 16, 0)
    x = torch.zeros(2, 48, dtype=torch.bfloat16)
    packed = q.view(torch.uint8)[:, :24].contiguous()  # K = 48: not a multiple of 32
    assert not native_ops.q8g_fits(x, packed, s, z, 16)
    with pytest.raises(ValueError, match="do not fit"):
        native_ops.q8g_linear(x, packed, s, z, 16)


# ---------------------------------------------------------------------------------------------- a model
# Layer 0: llama.cpp's Q4_K_M mix (Q4_K with Q6_K: fused qkv in groups of 16) and Q5_K; layer 1: Q8_0 (groups of 32).
GGUF_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q8_0", "ffn_gate": "Q5_K",
     "ffn_up": "Q5_K", "ffn_down": "Q6_K"},
    {p: "Q8_0" for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")},
]


def test_gguf_model_decodes_the_references_greedy_tokens(tiny_llama, tmp_path, monkeypatch) -> None:
    path, _ = tiny_gguf_dir(tmp_path / "gguf", tiny_llama, GGUF_TYPES)
    # Prompts whose greedy steps all have a top-2 gap of 0.125 or more in logprob (bf16 logits are coarse: a tie,
    # as [300, 12, 45] meets at its fifth token, breaks either way under any change of summation order)
    prompts = [[5, 17, 99, 240, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    monkeypatch.setenv(cpu_step.ENV_VAR, "0")  # op by op: each linear through native_ops (counted below)
    calls: list[int] = []
    for name in ("q8g_linear", "q8g_avx512_linear"):  # count the kernels' calls (kernels/quant.py looks them up)
        fn = getattr(native_ops, name)
        monkeypatch.setattr(native_ops, name, lambda *a, fn=fn: calls.append(a[0].shape[0]) or fn(*a))

    def greedy() -> tuple[list[list[int]], float]:
        """each prompt's tokens, and the smallest top-2 logprob gap of any step"""
        llm = LLM(model=str(path), dtype="bfloat16", daemon=False, max_model_len=128)
        try:
            outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        finally:
            llm.close()
        tops = [sorted((v.logprob for v in step.values()), reverse=True) for o in outs for step in o.logprobs]
        gaps = [t[0] - t[1] for t in tops]
        return [o.token_ids for o in outs], min(gaps)

    native, gap = greedy()
    assert calls and min(calls) <= 2, "the kernels did not run"  # decode steps of one and two rows among them
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    calls.clear()
    reference, ref_gap = greedy()
    assert reference == native and not calls, f"smallest top-2 gaps: {gap:.3g} (kernels), {ref_gap:.3g} (reference)"


# ---------------------------------------------------------------------------------------------- the tiles
needs_tiles = pytest.mark.skipif(cpu_native.variant_name() != "avx512" or not _HAS_AMX,
                                 reason="AMX tiles: the CPU lacks AVX512-BF16 / amx_tile / amx_bf16 / avx512vbmi")
CODES = ["u4", "int8"]


def _tiles_q8g(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, gs: int) -> torch.Tensor:
    """the AVX-512 entry with the tiles on, checked to have taken them (2+ rows) or not (one row: the vector kernel)"""
    with _tiles(True):
        calls = cpu_native.amx_calls()
        out = native_ops.q8g_avx512_linear(x, w, s, z, gs)
        assert cpu_native.amx_calls() == calls + (x.shape[0] >= 2), "the call did not take the path it should"
    return out


def _codes(n: int, k: int, codes: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(the codes as int8 [N, K], the weight as the kernel takes it: the 4-bit pack or the int8 codes)"""
    if codes == "u4":
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
        return q, pack_u4_groups(q)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return q, q


def _u4_case(n: int, k: int, gs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    return q, (torch.randn(n, k // gs, generator=g) * 0.01).bfloat16(), (torch.randn(n, k // gs, generator=g) * 0.02
                                                                        ).bfloat16()


TILE_CASES = [(2, 16, 128, 32), (2, 37, 256, 16), (3, 37, 512, 16), (8, 100, 1024, 32), (17, 29, 128, 16),
              (33, 200, 2048, 32)]


@needs_tiles
@pytest.mark.parametrize(("codes", "m", "n", "k", "gs"), [(c, *case) for c in CODES for case in TILE_CASES]
                         + [("int8", 9, 40, 576, 32), ("int8", 5, 30, 192, 16)])  # int8 codes: K % 64 suffices
def test_tiles_within_their_bound(codes: str, m: int, n: int, k: int, gs: int) -> None:
    # BOUND of the tiles' order (gemm_int8_group_amx.c): t = sum_g s S_g + z' X_g with S_g = sum x c rounded at most
    # gs times (two per k pair), X_g = x's group sum (gs / 16 + 4), z' = z - 16 s (4-bit codes, c = 16 + q) once,
    # 2 G fused multiply-adds, each under u * magc, magc = |x| @ (|s| |c| + |z| + |s| |c - q|)^T:
    # |c - t| <= (gs + 2 G + 8) u magc, then the bf16 rounding
    g = torch.Generator().manual_seed(m + n + k)
    q, w = _codes(n, k, codes, g)
    s, z = (torch.randn(n, k // gs, generator=g) * 0.01).bfloat16(), (torch.randn(n, k // gs, generator=g) * 0.02
                                                                     ).bfloat16()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(gs)).bfloat16()
    got = _tiles_q8g(x, w, s, z, gs)
    sd, zd = s.double().repeat_interleave(gs, 1), z.double().repeat_interleave(gs, 1)
    off = 16.0 if codes == "u4" else 0.0
    magc = x.double().abs() @ (sd.abs() * (q.double() + off).abs() + zd.abs() + off * sd.abs()).T
    true = x.double() @ _dense(q, s, z, gs)[0].T
    gamma = (gs + 2 * (k // gs) + 8) * 2.0 ** -24
    excess = (got.double() - true).abs() - (true.abs() * 2.0 ** -8 + (1 + 2.0 ** -8) * gamma * magc)
    assert bool((excess <= 0).all()), f"max excess {float(excess.max()):.3g}"


@needs_tiles
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize(("m", "gs"), [(2, 16), (5, 16), (2, 32), (19, 32)])
def test_tiles_exact_sums_give_the_exactly_rounded_product(codes: str, m: int, gs: int) -> None:
    # x in -8..8, |c| <= 128, power-of-two scales, zeros on a 2^-5 grid: every group's sum of x c is an integer under
    # 2^16, z' exact, every partial total on a 2^-9 grid under 2^14: all exact
    g = torch.Generator().manual_seed(gs + m)
    n, k = 21, 1152
    x = torch.randint(-8, 9, (m, k), generator=g).bfloat16()
    q, w = _codes(n, k, codes, g)
    s = (torch.randint(0, 2, (n, k // gs), generator=g) * 2 - 1) * 2.0 ** -torch.randint(7, 10, (n, k // gs),
                                                                                         generator=g)
    z = (torch.randint(-8, 9, (n, k // gs), generator=g) * 2.0 ** -5).bfloat16()
    true = x.double() @ _dense(q, s.bfloat16(), z, gs)[0].T
    assert torch.equal(_tiles_q8g(x, w, s.bfloat16(), z, gs), true.to(torch.bfloat16))


@needs_tiles
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("gs", [16, 32])
def test_tiles_give_a_row_the_same_bits_in_any_batch_of_two_or_more(codes: str, gs: int) -> None:
    # magnitudes 2^-12 .. 2^12: another summation order or rounding would show in the bf16 results
    g = torch.Generator().manual_seed(gs)
    x = (torch.randn(33, 1152, generator=g) * torch.exp2(torch.randint(-12, 13, (33, 1152), generator=g))).bfloat16()
    _, w = _codes(200, 1152, codes, g)
    s, z = (torch.randn(200, 1152 // gs, generator=g) * 0.01).bfloat16(), (torch.randn(
        200, 1152 // gs, generator=g) * 0.02).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = _tiles_q8g(x, w, s, z, gs)  # tiles of 16 rows over x padded to 48
        pairs = torch.cat([_tiles_q8g(x[i:i + 2], w, s, z, gs) for i in range(0, 32, 2)])  # tiles of 2 rows
        torch.set_num_threads(1)
        odd = torch.cat([_tiles_q8g(x[i:i + 3], w, s, z, gs) for i in range(0, 33, 3)])  # of 3, one thread
        one = _tiles_q8g(x[32:].contiguous(), w, s, z, gs)  # one row: the vector kernel
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batch[:32], pairs) and torch.equal(batch, odd)
    with _tiles(False):  # one row is the vector kernel's (its own order: the tiles' rows may differ in the last bit)
        vector = native_ops.q8g_avx512_linear(x, w, s, z, gs)
    assert torch.equal(one, vector[32:])


@needs_tiles
@pytest.mark.parametrize(("m", "k", "gs", "u4"), [(4, 96, 32, False), (4, 160, 32, True), (4, 1152, 64, True),
                                                  (4, 1152, 64, False), (4, 96, 16, True), (1, 1152, 32, True),
                                                  (1, 1152, 32, False)])
def test_tiles_leave_one_row_other_groups_and_k_to_the_vector_kernel(m: int, k: int, gs: int, u4: bool) -> None:
    g = torch.Generator().manual_seed(k)
    q = torch.randint(0, 16, (40, k), generator=g, dtype=torch.int8)
    s, z = torch.randn(40, k // gs, generator=g).bfloat16(), torch.randn(40, k // gs, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    w = pack_u4_groups(q) if u4 else q
    with _tiles(True):
        calls = cpu_native.amx_calls()
        on = native_ops.q8g_avx512_linear(x, w, s, z, gs)
        assert cpu_native.amx_calls() == calls  # not taken
    assert torch.equal(on, _q8g_vector512(x, w, s, z, gs))
