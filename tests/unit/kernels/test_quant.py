"""Weight-only quantization: layouts, round-trip error bounds, every matmul path vs the reference, dispatch.

Tolerances for path == reference are relative to mag = max over outputs of sum_k |x_mk| |W_nk| (the size of the
dot products, so cancellation does not make them meaningless): float32 1e-6 (accumulation order only), float16
2^-9 and bfloat16 2^-7 (the reference rounds every weight to x's dtype, a path may round the output instead).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from support.int4_pack import pack_int4

from keepwarm import kernels
from keepwarm.formats.errors import QuantizationError
from keepwarm.formats.quant import (
    SCHEMES,
    QuantMeta,
    cpu_int4_layout,
    is_quantized_target,
    quantize,
    quantized_layout,
    repack_int4_canonical,
    unpack_int4,
    validate_scheme,
)
from keepwarm.kernels import cpu_native, dispatch, native_ops, quant
from keepwarm.kernels.quant import PATHS, QuantizedWeight, fp8_as_float16, linear_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-6, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-7}
# (N, K): N a multiple of 64 and not (48: one short CPU block; 80: a full and a short one); K picks group 128/64/32.
SHAPES = [(64, 256), (48, 192), (80, 96)]


@pytest.fixture(autouse=True)
def _default_backend() -> Iterator[None]:
    # A KEEPWARM_KERNELS left in the environment (or a test's set_backend) must not change what others exercise.
    previous = kernels.set_backend("auto")
    yield
    kernels.set_backend(previous)


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] = 0.0  # an all-zero row / group: the zero-amax guards
    w[1] = 0.3  # constant groups
    return w


def _close(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> None:
    mag = float((x.float().abs().reshape(-1, x.shape[-1]) @ w.float().abs().T).max())
    err = float((y.float() - ref.float()).abs().max())
    assert err <= TOL[dtype] * mag, f"max error {err:.3g} > {TOL[dtype]:.3g} * {mag:.3g}"


# ---------------------------------------------------------------------------------------------- API basics
def test_unknown_scheme() -> None:
    msg = r"^unknown quantization 'int3' \(choose none, int8, fp8, int4, int4-g64 or int4-g32\)$"
    with pytest.raises(QuantizationError, match=msg):
        validate_scheme("int3")
    with pytest.raises(QuantizationError, match="unknown quantization"):
        quantize(torch.zeros(16, 64), "int3", torch.float32)
    with pytest.raises(QuantizationError, match="unknown quantization"):
        quantized_layout((16, 64), "int3", torch.float32)
    assert all(validate_scheme(s) == s for s in SCHEMES)


@pytest.mark.parametrize(("name", "expected"), [
    ("model.layers.0.self_attn.qkv_proj.weight", True),
    ("model.layers.11.self_attn.o_proj.weight", True),
    ("model.layers.3.mlp.gate_up_proj.weight", True),
    ("model.layers.3.mlp.down_proj.weight", True),
    ("model.layers.0.self_attn.qkv_proj.bias", False),
    ("model.layers.0.mlp.down_proj.bias", False),
    ("model.embed_tokens.weight", False),
    ("lm_head.weight", False),
    ("model.norm.weight", False),
    ("model.layers.0.input_layernorm.weight", False),
    ("model.layers.0.post_attention_layernorm.weight", False),
    ("model.layers.0.self_attn.q_proj.weight", False),  # unfused names never reach the quantizer
    ("model.layers.0.mlp.down_proj.weight_scale", False),
])
def test_is_quantized_target(name: str, expected: bool) -> None:
    assert is_quantized_target(name) is expected


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_layout_matches_quantize(scheme: str, act: torch.dtype, device_type: str) -> None:
    for n, k in SHAPES:
        layout = quantized_layout((n, k), scheme, act, device_type)
        meta, parts = quantize(_weight(n, k), scheme, act, device_type)
        assert {name: (t.dtype, tuple(t.shape)) for name, t in parts.items()} == layout
        assert all(t.is_contiguous() for t in parts.values())
        assert QuantMeta.from_dict(json.loads(json.dumps(meta.to_dict()))) == meta
        qw = QuantizedWeight.from_parts(meta, parts)
        assert qw.shape == (n, k) and qw.nbytes == sum(t.nbytes for t in parts.values())


def test_layouts_exact() -> None:
    bf = torch.bfloat16
    assert quantized_layout((1536, 576), "int8", bf) == {"qweight": (torch.int8, (1536, 576)), "scales": (bf, (1536,))}
    assert quantized_layout((1536, 576), "fp8", bf) == {"qweight": (torch.float8_e4m3fn, (1536, 576)),
                                                        "scale": (torch.float32, (1,))}
    # K = 576 is not a multiple of 128: group size 64.
    assert quantized_layout((1536, 576), "int4", bf, "cuda") == {
        "qweight": (torch.uint8, (1536, 288)), "scales": (bf, (1536, 9)), "zeros": (bf, (1536, 9))}
    if cpu_int4_layout() is not None:
        assert quantized_layout((1536, 576), "int4", bf) == {"qweight": (torch.uint8, (1536, 288)),
                                                            "scales_and_zeros": (bf, (9, 1536, 2))}


def test_int4_group_size_fallback_and_errors() -> None:
    assert quantize(_weight(16, 256), "int4", torch.float32)[0].group_size == 128
    assert quantize(_weight(16, 192), "int4", torch.float32)[0].group_size == 64
    assert quantize(_weight(16, 96), "int4", torch.float32)[0].group_size == 32
    with pytest.raises(QuantizationError, match=r"int4 needs K divisible by 128, 64 or 32; got K=100"):
        quantize(_weight(16, 100), "int4", torch.float32)
    with pytest.raises(QuantizationError, match="group size must be one of"):
        quantized_layout((16, 256), "int4", torch.float32, group_size=16)
    if cpu_int4_layout() is not None:
        # torch's CPU pack needs N % 16 == 0: refused at quantize / layout time, not at the first matmul.
        with pytest.raises(QuantizationError, match=r"int4 on cpu needs N .* divisible by 16; got N=24"):
            quantized_layout((24, 128), "int4", torch.bfloat16)
        with pytest.raises(QuantizationError, match="got N=24"):
            quantize(_weight(24, 128), "int4", torch.bfloat16)
    assert quantize(_weight(24, 128), "int4", torch.bfloat16, "cuda")[0].layout == "int4_canonical"
    assert quantize(_weight(24, 128), "int8", torch.bfloat16)[0].shape == (24, 128)


def test_bad_inputs() -> None:
    with pytest.raises(QuantizationError, match="2-D weight"):
        quantize(torch.zeros(2, 16, 64), "int8", torch.float32)
    with pytest.raises(QuantizationError, match="non-finite"):
        quantize(torch.full((16, 64), float("inf")), "fp8", torch.float32)
    with pytest.raises(QuantizationError, match="activation dtype"):
        quantized_layout((16, 64), "int8", torch.int32)
    with pytest.raises(QuantizationError, match="bad quantization metadata"):
        QuantMeta.from_dict({"scheme": "int8", "layout": "int8_channel"})
    with pytest.raises(QuantizationError, match="layout"):
        QuantMeta.from_dict({"scheme": "int8", "layout": "fp8_tensor", "group_size": None, "shape": [4, 4]})
    with pytest.raises(QuantizationError, match="unknown layout 'int8_channel' for scheme 'int4'"):
        QuantMeta.from_dict({"scheme": "int4", "layout": "int8_channel", "group_size": 32, "shape": [4, 64]})
    with pytest.raises(QuantizationError, match="group size 48 does not divide K=64"):
        QuantMeta.from_dict({"scheme": "int4", "layout": "int4_canonical", "group_size": 48, "shape": [4, 64]})
    meta, parts = quantize(_weight(16, 64), "int8", torch.float32)
    with pytest.raises(QuantizationError, match="do not match layout"):
        QuantizedWeight.from_parts(meta, {**parts, "scales": parts["scales"][:8]})


# ---------------------------------------------------------------------------------------------- error bounds
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_int8_error_bound(act: torch.dtype) -> None:
    w = _weight(64, 256)
    meta, parts = quantize(w, "int8", act)
    scales = parts["scales"].float()
    err = (QuantizedWeight(meta, parts).dequantize() - w).abs().amax(dim=1)
    # Half a step per channel (the stored scale is rounded up, so nothing clips); float32 rounding on top.
    assert bool((err <= scales / 2 * (1 + 1e-5)).all())
    assert float(err[0]) == 0.0  # all-zero row


@pytest.mark.parametrize(("src", "act"), [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                          (torch.float16, torch.float16), (torch.float32, torch.bfloat16)])
def test_int8_codes_are_the_whole_weight_formula_in_row_blocks(src: torch.dtype, act: torch.dtype) -> None:
    """int8 goes through row blocks of one float32 buffer (formats.quant._int8_channel): the codes and scales must
    be what the whole-weight formula gives, here written out independently, at every block edge and on ties."""
    from keepwarm.formats import quant as fq

    gen = torch.Generator().manual_seed(8)
    for n, k in [(1, 16), (300, 576), (257, 2048), (5, 70000)]:
        w = (torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3).to(src)
        w[0] = 0  # an all-zero row: scale 1
        if n > 3:
            w[3, : k // 2] = 63.5 / 127 * 2  # exact halves of a step: round to even
            w[3, 0] = 2.0
        amax = w.float().abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        stored = scale.to(act)
        up = torch.nextafter(stored, torch.full_like(stored, float("inf")))
        stored = torch.where(stored.float() < scale, up, stored)
        codes = torch.round(w.float() / stored.float()[:, None]).clamp(-127, 127).to(torch.int8)
        _, parts = quantize(w, "int8", act)
        assert torch.equal(parts["scales"], stored) and torch.equal(parts["qweight"], codes), (n, k)
        assert n * k * 4 <= fq._BLOCK_BYTES or n > fq._BLOCK_BYTES // (4 * k)  # the case spans several blocks
    with pytest.raises(QuantizationError, match="non-finite"):
        quantize(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]), "int8", torch.float32)
    with pytest.raises(QuantizationError, match="non-finite"):
        quantize(torch.tensor([[1.0, 2.0], [float("-inf"), 1.0]]).to(torch.bfloat16), "int8", torch.bfloat16)


def test_native_int8_quantization_is_the_torch_path_bit_for_bit(monkeypatch, tmp_path) -> None:
    """The daemon quantizes bfloat16 weights to int8 in C (kernels/csrc/quantize.c kw_quant_int8) where the library
    runs: the same codes and scales as formats.quant's row blocks, so the arena is the same with it off."""
    from keepwarm.formats import quant as fq
    from keepwarm.weights import loader
    from keepwarm.weights.checkpoint import Checkpoint
    from keepwarm.worker.models.random_model import make_random_model

    if cpu_native._reason(2):
        pytest.skip(f"the native library does not run here ({cpu_native._reason(2)}): torch's path is the one used")
    gen = torch.Generator().manual_seed(9)
    for n, k in [(1, 16), (300, 576), (3, 70001)]:
        w = (torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 40).to(torch.bfloat16)
        w[0, : k // 3] = 0
        w[-1] = torch.tensor([2.0, -2.0, 1.0]).repeat(k // 3 + 1)[:k].to(torch.bfloat16)  # exact halves of a step
        got = native_ops.quantize_int8(w)
        assert got is not None
        want = fq._int8_channel(w, torch.bfloat16)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (n, k)
    assert torch.equal(native_ops.quantize_int8(torch.zeros(2, 8, dtype=torch.bfloat16))[1],
                       torch.ones(2, dtype=torch.bfloat16))  # an all-zero row: scale 1
    for bad in (float("nan"), float("inf"), float("-inf")):
        w = torch.ones(4, 32, dtype=torch.bfloat16)
        w[2, 5] = bad
        with pytest.raises(QuantizationError, match="non-finite"):
            native_ops.quantize_int8(w)
    assert native_ops.quantize_int8(torch.ones(4, 32)) is None  # float32: torch's path
    model = make_random_model(tmp_path / "bf16", "llama", dtype="bfloat16", tokenizer=False)
    native_calls: list[bool] = []

    def counted(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        made = native_ops.quantize_int8(w)
        native_calls.append(made is not None)
        return made

    monkeypatch.setattr(loader, "quantize_int8", counted)
    digests = []
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_native.ENV_VAR, switch)
        ckpt = Checkpoint(model)
        _, total = loader.plan_arena(ckpt, "int8", torch.bfloat16, "cpu")
        flat = torch.empty(total, dtype=torch.uint8)
        digests.append(loader.build_arena(ckpt, "int8", "bfloat16", flat, "cpu", threads=2).arena_digest)
        assert set(native_calls) == {switch == "1"}  # every projection took the path the switch says
        native_calls.clear()
    assert digests[0] == digests[1]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_int4_error_bound(act: torch.dtype, device_type: str) -> None:
    w = _weight(64, 256)
    w[2, 128:] += 4.0  # a group far from zero: its zero point is large, so its rounding matters
    meta, parts = quantize(w, "int4", act, device_type)
    qw = QuantizedWeight(meta, parts)
    gs = meta.group_size
    if "scales" in parts:
        scales, zeros = parts["scales"].float(), parts["zeros"].float()
    else:
        scales, zeros = parts["scales_and_zeros"][..., 0].float().t(), parts["scales_and_zeros"][..., 1].float().t()
    err = (qw.dequantize() - w).abs().view(64, -1, gs).amax(dim=-1)
    # Half a step per group, plus what rounding the stored zero point to act can shift the grid by.
    half_ulp = torch.finfo(act).eps / 2
    bound = scales / 2 + zeros.abs() * half_ulp + 1e-6 * w.abs().view(64, -1, gs).amax(dim=-1)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err[0].max()) == 0.0 and float(err[1, 0]) <= 0.3 * half_ulp  # zero row; constant group


def test_fp8_error_bound() -> None:
    w = _weight(64, 256)
    w[3, :4] = torch.tensor([1e-7, -1e-7, 3e-6, 0.2])  # subnormal codes
    meta, parts = quantize(w, "fp8", torch.bfloat16)
    scale = float(parts["scale"])
    assert scale == pytest.approx(float(w.abs().max()) / 448)
    err = (QuantizedWeight(meta, parts).dequantize() - w).abs()
    # e4m3: 3 mantissa bits, relative error <= 2^-4; subnormal steps are 2^-9 * scale.
    assert bool((err <= w.abs() * 2.0**-4 + 2.0**-10 * scale + 1e-7 * scale).all())
    assert float(QuantizedWeight(*quantize(torch.zeros(8, 32), "fp8", torch.float32)).dequantize().abs().max()) == 0


def test_fp8_as_float16_every_code() -> None:
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert torch.equal(fp8_as_float16(codes).float() * 256, codes.float())


# ---------------------------------------------------------------------------------------------- paths vs reference
NATIVE = (dispatch.INT8_NATIVE, dispatch.FP8_NATIVE, dispatch.INT8_AMX,  # the AMX names: same function
          dispatch.FP8_AMX, dispatch.CODES_WIDE, dispatch.INT8G_AVX512, dispatch.INT8G_AMX)
AVX2 = (dispatch.INT8_AVX2, dispatch.INT4_AVX2, dispatch.FP8_AVX2,  # bfloat16 only; callable wherever a build loaded
        dispatch.INT8G_AVX2, dispatch.INT8G_WIDE)


def _cases() -> list[tuple[str, str]]:
    return [(scheme, path) for scheme, paths in PATHS.items() for path in paths]


def fp8_block_weight(w: torch.Tensor, gs: int) -> QuantizedWeight:
    """A pre-quantized fp8 weight with one float32 scale per row and `gs` columns (gs = K: per channel)."""
    n, k = w.shape
    groups = w.float().view(n, k // gs, gs)
    scales = (groups.abs().amax(dim=-1) / 448.0).clamp(min=1e-8)
    q = (groups / scales[..., None]).to(torch.float8_e4m3fn).view(n, k)
    return QuantizedWeight.from_parts(QuantMeta("fp8_block", "fp8_block", gs, (n, k)), {"qweight": q, "scales": scales})


def int8_group_weight(w: torch.Tensor, gs: int, dtype: torch.dtype) -> QuantizedWeight:
    """A pre-quantized int8_group weight (what GGUF Q8_0 / K-quants load as): per group of `gs` columns a scale and
    a zero in `dtype`, codes -128..127."""
    n, k = w.shape
    groups = w.float().view(n, k // gs, gs)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales, zeros = ((hi - lo) / 255).clamp(min=1e-8).to(dtype), ((hi + lo) / 2).to(dtype)
    q = ((groups - zeros.float()[..., None]) / scales.float()[..., None]).round().clamp(-128, 127)
    return QuantizedWeight.from_parts(QuantMeta("int8_group", "int8_group", gs, (n, k)),
                                      {"qweight": q.to(torch.int8).view(n, k), "scales": scales, "zeros": zeros})


def _quantized(scheme: str, n: int, k: int, dtype: torch.dtype, seed: int) -> QuantizedWeight:
    if scheme == "int8_group":  # only checkpoints (GGUF) have it: groups of 32 for even seeds, 16 for odd ones
        return int8_group_weight(_weight(n, k, seed=seed), 32 if seed % 2 == 0 else 16, dtype)
    if scheme == "fp8_block":  # only checkpoints have it: per channel for even seeds, blocks of 32 for odd ones
        return fp8_block_weight(_weight(n, k, seed=seed), k if seed % 2 == 0 else 32)
    return QuantizedWeight.from_parts(*quantize(_weight(n, k, seed=seed), scheme, dtype))


@pytest.mark.parametrize(("scheme", "path"), _cases())
@pytest.mark.parametrize("dtype", DTYPES)
def test_path_matches_reference(scheme: str, path: str, dtype: torch.dtype) -> None:
    if scheme == "int4" and cpu_int4_layout() is None:
        pytest.skip("this torch has no recognised CPU int4 pack")
    if path in NATIVE and (dtype != torch.bfloat16 or not cpu_native.available()):
        with pytest.raises((ValueError, AssertionError)):  # never taken for other dtypes (test_select_path)
            PATHS[scheme][path](torch.zeros(1, 64, dtype=dtype), _quantized(scheme, 16, 64, dtype, 0), None)
        return
    if path == dispatch.INT4_AMX and (dtype != torch.bfloat16 or not dispatch.amx_takes(2, 64)):
        with pytest.raises((ValueError, AssertionError)):
            PATHS[scheme][path](torch.zeros(2, 64, dtype=dtype), _quantized(scheme, 64, 64, dtype, 0), None)
        return
    if path == dispatch.INT4_VEC and (dtype != torch.bfloat16 or not cpu_native.has_vbmi() or
                                    not cpu_native.available()):
        with pytest.raises((ValueError, AssertionError)):
            PATHS[scheme][path](torch.zeros(2, 64, dtype=dtype), _quantized(scheme, 64, 64, dtype, 0), None)
        return
    if path in AVX2 and (dtype != torch.bfloat16 or not cpu_native.glue_on()):
        with pytest.raises((ValueError, AssertionError)):
            PATHS[scheme][path](torch.zeros(1, 64, dtype=dtype), _quantized(scheme, 32, 64, dtype, 0), None)
        return
    g = torch.Generator().manual_seed(1)
    for i, (n, k) in enumerate(SHAPES):
        qw = _quantized(scheme, n, k, dtype, i)
        w = qw.dequantize(dtype)
        if path in (*NATIVE, dispatch.FP8_AVX2) and scheme == "fp8_block" and i % 2:  # blocks of 32: C refuses them
            with pytest.raises(ValueError, match="blocks of 32"):
                PATHS[scheme][path](torch.zeros(1, k, dtype=dtype), qw, None)
            continue
        if path in (dispatch.INT4_AVX2, dispatch.INT4_AMX, dispatch.INT4_VEC) and (
                n % dispatch.int4_block(qw.meta.layout) or (path != dispatch.INT4_AVX2 and k % 32)):  # short: refused
            with pytest.raises(ValueError, match="do not fit"):
                PATHS[scheme][path](torch.zeros(1, k, dtype=dtype), qw, None)
            continue
        for rows in ((1,), (33,), (2, 3)):
            x = torch.randn(*rows, k, generator=g).to(dtype)
            bias = torch.randn(n, generator=g).to(dtype) if rows == (2, 3) else None
            y = PATHS[scheme][path](x, qw, bias)
            ref = linear_reference(x, qw, bias)
            assert y.dtype == dtype and y.shape == (*rows, n)
            _close(y, ref, x, w, dtype)
            last = (x, qw, w, bias)
    # The reference itself is F.linear of the dequantized weight.
    x, qw, w, bias = last
    assert torch.equal(linear_reference(x, qw, bias), F.linear(x, w, bias))


def test_canonical_int4_runs_reference_on_cpu() -> None:
    # device_type="cuda" gives the canonical int4 layout (int8 and fp8 have one layout everywhere).
    qw = QuantizedWeight.from_parts(*quantize(_weight(24, 128), "int4", torch.float32, "cuda"))
    assert qw.meta.layout == "int4_canonical"
    x = torch.randn(5, 128)
    assert quant.select_path("int4", x, qw) == "reference dequantize+matmul"
    assert torch.equal(kernels.linear(x, qw), linear_reference(x, qw))


# ---------------------------------------------------------------------------------------------- dispatch
def test_select_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu_int4_layout() is None:
        pytest.skip("this torch has no recognised CPU int4 pack")
    qws = {s: QuantizedWeight.from_parts(*quantize(_weight(64, 256), s, torch.bfloat16)) for s in ("int8", "int4")}
    bf1, bf33, f1, f33 = (torch.zeros(m, 256, dtype=d) for d in (torch.bfloat16, torch.float32) for m in (1, 33))
    monkeypatch.setattr(dispatch, "_simd", lambda: True)
    avx2 = dispatch.avx2_quant_on()  # no AVX512-BF16 here: keepwarm's AVX2 int8 / int4 kernels for bfloat16
    tiles = dispatch.amx_takes(33, 256)  # AMX: the int8 / fp8 / int4 tile kernels above 4 rows (int8, int4)
    assert quant.select_path("int8", bf1, qws["int8"]) == (dispatch.INT8_AVX2 if avx2 else "torch._weight_int8pack_mm")
    wide1 = dispatch.INT8_NATIVE if cpu_native.available() else "int8->dtype cast + matmul, per-channel scale"
    wide = dispatch.INT8_AMX if tiles else wide1
    assert quant.select_path("int8", bf33, qws["int8"]) == (dispatch.INT8_AVX2 if avx2 else wide)
    if cpu_native.available():  # the op up to 4 rows, the C kernel (on the tiles or not) from 5
        assert quant.select_path("int8", torch.zeros(4, 256, dtype=torch.bfloat16), qws["int8"]) == (
            "torch._weight_int8pack_mm")
        assert quant.select_path("int8", torch.zeros(5, 256, dtype=torch.bfloat16), qws["int8"]) == wide
    if tiles:
        wide_x = torch.zeros(513, 256, dtype=torch.bfloat16)  # above 512 rows: the codes to bf16, oneDNN
        assert quant.select_path("int8", torch.zeros(512, 256, dtype=torch.bfloat16), qws["int8"]) == dispatch.INT8_AMX
        assert quant.select_path("int8", wide_x, qws["int8"]) == dispatch.CODES_WIDE
    assert quant.select_path("int8", f1, qws["int8"]).startswith("int8->dtype cast")
    assert quant.select_path("int8", f33, qws["int8"]).startswith("int8->dtype cast")
    fp8 = QuantizedWeight.from_parts(*quantize(_weight(64, 256), "fp8", torch.bfloat16))
    blocks, channels = fp8_block_weight(_weight(64, 256), 32), fp8_block_weight(_weight(64, 256), 256)
    native = cpu_native.available()
    fused = dispatch.FP8_NATIVE if native else dispatch.FP8_AVX2 if avx2 else None
    assert quant.select_path("fp8", bf1, fp8) == (fused or "fp8 bits->float16 + matmul, scalar scale")
    assert quant.select_path("fp8", f1, fp8).startswith("fp8 bits")
    fused33 = dispatch.FP8_AMX if tiles else fused
    assert quant.select_path("fp8_block", bf33, channels) == (fused33 or "fp8 bits->float16 + matmul, channel/block "
                                                                         "scales")
    assert quant.select_path("fp8_block", bf33, blocks).startswith("fp8 bits")
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    assert quant.select_path("fp8", bf1, fp8).startswith("fp8 bits")
    assert quant.select_path("int8", bf33, qws["int8"]).startswith("int8->dtype cast")
    assert quant.select_path("int8", bf1, qws["int8"]) == "torch._weight_int8pack_mm"
    assert quant.select_path("int4", bf1, qws["int4"]) == "torch._weight_int4pack_mm_for_cpu"
    assert quant.select_path("int4", bf33, qws["int4"]) == "torch._weight_int4pack_mm_for_cpu"
    monkeypatch.delenv(cpu_native.ENV_VAR)
    int4 = dispatch.INT4_AVX2 if avx2 else "torch._weight_int4pack_mm_for_cpu"
    vec4 = cpu_native.available() and cpu_native.has_vbmi()  # AVX512-BF16 + VBMI: the vector int4 kernel from 5 rows
    int4_33 = dispatch.INT4_AMX if tiles else dispatch.INT4_VEC if vec4 else int4
    if vec4 and not tiles:
        assert quant.select_path("int4", torch.zeros(4, 256, dtype=torch.bfloat16), qws["int4"]) == int4
        assert quant.select_path("int4", torch.zeros(5, 256, dtype=torch.bfloat16), qws["int4"]) == dispatch.INT4_VEC
    assert quant.select_path("int4", bf33, qws["int4"]) == int4_33
    assert quant.select_path("int4", bf1, qws["int4"]) == int4
    assert quant.select_path("int4", f1, qws["int4"]) == "reference dequantize+matmul"
    assert quant.select_path("int4", f33, qws["int4"]) == "reference dequantize+matmul"
    monkeypatch.setattr(dispatch, "_simd", lambda: False)
    assert quant.select_path("int8", bf1, qws["int8"]) == (dispatch.INT8_AVX2 if avx2 else wide1)
    assert quant.select_path("int4", bf33, qws["int4"]) == (
        int4 if avx2 else int4_33 if tiles or vec4 else "reference dequantize+matmul")


def test_kernels_linear_dispatch(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant, "_LOGGED", set())
    caplog.set_level(logging.INFO, logger="keepwarm.kernels")
    w = _weight(48, 192)
    x = torch.randn(3, 192, dtype=torch.bfloat16)
    for scheme in SCHEMES:
        qw = QuantizedWeight.from_parts(*quantize(w, scheme, torch.bfloat16))
        y = kernels.linear(x, qw)
        assert torch.equal(y, kernels.linear(x, qw))
        _close(y, linear_reference(x, qw), x, w, torch.bfloat16)
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("linear ")]
    assert len(msgs) == len(set(msgs)) == 4, msgs  # once per scheme, not per call
    assert any(m.startswith("linear none: reference") for m in msgs)
    assert kernels.QuantizedWeight is QuantizedWeight


def test_kernels_linear_plain_tensor() -> None:
    w, b, x = torch.randn(40, 24), torch.randn(40), torch.randn(7, 24)
    assert torch.equal(kernels.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(kernels.linear(x, w), F.linear(x, w))


def test_read_only_parts() -> None:
    # The daemon's arena is shared memory mapped read-only: parts are views that must never be written.
    w = _weight(128, 192)  # 128 rows: whole int4 CPU blocks of 32 (AVX2) and of 64 (AVX512), as the int4 kernels need
    x = torch.randn(5, 192, dtype=torch.bfloat16)
    for scheme in ("int8", "fp8", "int4"):
        meta, parts = quantize(w, scheme, torch.bfloat16)
        ro, blobs = {}, {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "The given buffer is not writable"
            for name, t in parts.items():
                blobs[name] = bytes(t.view(-1).view(torch.uint8).numpy())
                ro[name] = torch.frombuffer(blobs[name], dtype=t.dtype).view(t.shape)
        saved = {name: bytes(bytearray(b)) for name, b in blobs.items()}
        qw = QuantizedWeight.from_parts(meta, ro)
        expected = PATHS[scheme]
        for name, fn in (*expected.items(), ("reference", linear_reference)):
            for xx in (x, x[:1], x.float()):
                if name in NATIVE and not (xx.dtype == torch.bfloat16 and cpu_native.available()):
                    continue  # the native path takes only bfloat16 (test_select_path)
                if name == dispatch.INT4_AMX and not (xx.dtype == torch.bfloat16 and dispatch.amx_takes(2, 64)):
                    continue
                if name == dispatch.INT4_VEC and not (xx.dtype == torch.bfloat16 and cpu_native.available() and
                                                     cpu_native.has_vbmi()):
                    continue
                if name in AVX2 and not (xx.dtype == torch.bfloat16 and cpu_native.glue_on()):
                    continue  # so do the AVX2 ones
                fn(xx, qw, None)
        assert torch.equal(kernels.linear(x, qw), kernels.linear(x, QuantizedWeight(meta, parts)))
        assert blobs == saved


# ---------------------------------------------------------------------------------------------- int4 CPU packing
@pytest.mark.parametrize("layout", ["int4_canonical"] + [f"int4_cpu_{m}{b}" for m in ("halves", "pairs")
                                                            for b in (16, 32, 64)])
def test_unpack_int4_layouts(layout: str) -> None:
    codes = torch.randint(0, 16, (80, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int4(pack_int4(codes, layout), layout, (80, 64)), codes)


@pytest.mark.parametrize("layout", [f"int4_cpu_{m}{b}" for m in ("halves", "pairs") for b in (16, 32, 64)])
@pytest.mark.parametrize("n", [80, 144, 208])  # 80 and 208: a short last row block for 64
def test_repack_int4_canonical_is_the_cpu_pack(layout: str, n: int) -> None:
    """A snapshot's portable int4 bytes re-packed byte to byte (keepwarm.weights.portable) are exactly the pack of
    the same codes: the test's own pack for every layout, and torch's op for this machine's."""
    codes = torch.randint(0, 16, (n, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    canonical = codes[:, 0::2] | (codes[:, 1::2] << 4)
    got = repack_int4_canonical(canonical, layout, (n, 64))
    assert torch.equal(got.reshape(-1), pack_int4(codes, layout).reshape(-1))
    if layout == cpu_int4_layout():
        assert torch.equal(got.reshape(-1), torch._convert_weight_to_int4pack_for_cpu(codes.int(), 2).reshape(-1))


def test_foreign_cpu_int4_layout_uses_reference() -> None:
    # An arena packed by a process with another CPU capability (e.g. an imported snapshot): still correct.
    here = cpu_int4_layout()
    layout = "int4_cpu_pairs16" if here != "int4_cpu_pairs16" else "int4_cpu_halves64"
    meta, parts = quantize(_weight(80, 192), "int4", torch.bfloat16, "cuda")
    codes = unpack_int4(parts["qweight"], meta.layout, meta.shape)
    sz = torch.stack((parts["scales"].t(), parts["zeros"].t()), dim=-1)
    foreign = QuantizedWeight.from_parts(QuantMeta("int4", layout, meta.group_size, meta.shape),
                                         {"qweight": pack_int4(codes, layout), "scales_and_zeros": sz})
    x = torch.randn(2, 192, dtype=torch.bfloat16)
    assert quant.select_path("int4", x, foreign) == "reference dequantize+matmul"
    assert torch.equal(foreign.dequantize(), QuantizedWeight(meta, parts).dequantize())
    assert torch.equal(kernels.linear(x, foreign), linear_reference(x, QuantizedWeight(meta, parts)))


def test_cpu_int4_layout_matches_op() -> None:
    layout = cpu_int4_layout()
    if layout is None:
        pytest.skip("this torch has no recognised CPU int4 pack")
    codes = torch.randint(0, 16, (208, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
    assert torch.equal(unpack_int4(packed, layout, (208, 64)).int(), codes)


_CAPABILITY_SCRIPT = """
import torch
from keepwarm.formats.quant import cpu_int4_layout, quantize
from keepwarm.kernels.quant import PATHS, QuantizedWeight, linear_reference
torch.set_num_threads(1)
w = torch.randn(80, 128)
qw = QuantizedWeight.from_parts(*quantize(w, "int4", torch.float32))
x = torch.randn(3, 128)
d = (PATHS["int4"]["torch._weight_int4pack_mm_for_cpu"](x, qw, None) - linear_reference(x, qw)).abs().max()
print(cpu_int4_layout(), float(d) < 1e-4)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("capability", "layout"), [("default", "int4_cpu_pairs32"), ("avx2", "int4_cpu_halves32")])
def test_cpu_int4_layout_per_capability(capability: str, layout: str) -> None:
    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        pytest.skip("x86-64 capabilities")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _CAPABILITY_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == [layout, "True"]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cuda_quantize_and_reference(scheme: str) -> None:
    w = _weight(80, 192)
    meta, parts = quantize(w.cuda(), scheme, torch.bfloat16, "cuda")
    assert all(t.is_cuda for t in parts.values())
    assert {n: (t.dtype, tuple(t.shape)) for n, t in parts.items()} == quantized_layout((80, 192), scheme,
                                                                                       torch.bfloat16, "cuda")
    qw = QuantizedWeight.from_parts(meta, parts)
    on_cpu = QuantizedWeight.from_parts(*quantize(w, scheme, torch.bfloat16, "cuda"))
    torch.testing.assert_close(qw.dequantize().cpu(), on_cpu.dequantize(), rtol=0, atol=1e-6)
    x = torch.randn(33, 192, dtype=torch.bfloat16, device="cuda")
    assert quant.select_path(scheme, x, qw) == "reference dequantize+matmul"
    _close(kernels.linear(x, qw).cpu(), linear_reference(x.cpu(), on_cpu), x.cpu(), on_cpu.dequantize(), torch.bfloat16)
