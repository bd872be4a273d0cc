"""The Triton kernels (kernels/triton_*.py) on the CPU, through Triton's interpreter, against the torch reference.

Triton decides whether a `@triton.jit` function is compiled or interpreted when it is decorated, i.e. when its
module is imported, from TRITON_INTERPRET; triton's own library (tl.zeros, tl.max, ...) is decorated when triton
is first imported, and interpreted kernels cannot call compiled library functions. So the suite runs in-process
only when this module sets TRITON_INTERPRET=1 before anything imported triton (and no GPU is there, whose tests
need the compiled kernels). In a full `pytest` session something imports triton first (transformers' Llama
modeling does, via torch): there only `test_interpreter_suite_in_subprocess` is collected, and it runs this same
file in a fresh interpreter-mode process.

Tolerances (vs the reference on the same inputs):
  exact                 KV-cache writes (every dtype, fp8 bit for bit), float8 encode/decode, rotary, the
                        residual sum of fused_add_rms_norm: the same float32 ops with one rounding.
  float32               1e-5 (summation order; attention vs a float64 oracle).
  bf16 / fp16 outputs   one unit in the last place of the output (2^-8 / 2^-11 relative) where the math is
                        the reference's up to summation order; attention vs the float32 oracle on the same
                        rounded inputs: 1.6e-2 / 2e-3 (test_ops_against_oracles' bounds: the probabilities are rounded
                        to the model dtype before P @ V, as in the reference).
  matmuls               relative to mag = max_mn sum_k |x_mk| |w_nk|, as tests/unit/kernels/test_quant.py: float32 1e-6,
                        float16 2^-9, bfloat16 2^-7.
Shapes are small: the interpreter runs every program of a grid in Python.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import torch  # noqa: E402  (torch does not import triton)

# In-process only where interpreting cannot hurt: triton not imported yet, and no GPU whose tests in this session
# need the compiled kernels (keepwarm.kernels, imported next, registers whichever kind this decides).
_SET_INTERPRET = "triton" not in sys.modules and not torch.cuda.is_available()
IN_PROCESS = _SET_INTERPRET or os.environ.get("TRITON_INTERPRET") == "1"
if _SET_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton (see the module docstring)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from keepwarm import kernels  # noqa: E402
from keepwarm.formats.quant import quantize  # noqa: E402
from keepwarm.kernels import quant, reference, registry  # noqa: E402
from keepwarm.kernels import triton_attention as ta  # noqa: E402
from keepwarm.kernels import triton_common as tc  # noqa: E402
from keepwarm.kernels import triton_lora as tlora  # noqa: E402
from keepwarm.kernels import triton_moe as tmoe  # noqa: E402
from keepwarm.kernels import triton_norm as tn  # noqa: E402
from keepwarm.kernels import triton_quant as tq  # noqa: E402
from keepwarm.kernels.quant import QuantizedWeight  # noqa: E402

FP8 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
SUITE = "test_interpreter_suite_in_subprocess"


@pytest.fixture(autouse=True)
def _default_backend() -> Iterator[None]:
    # A KEEPWARM_KERNELS left in the environment (or a test's set_backend) must not change what others exercise.
    previous = kernels.set_backend("auto")
    yield
    kernels.set_backend(previous)


@pytest.fixture(autouse=True, scope="module")
def _interpret_while_here():
    # Kept set while this module's kernels launch (Triton reads it at launch too); not leaked to later modules,
    # nor to the processes their tests start.
    yield
    if _SET_INTERPRET:
        os.environ.pop("TRITON_INTERPRET", None)


def test_interpreter_suite_in_subprocess() -> None:
    """Collected only where triton was imported compiled before this module (see the module docstring)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop(kernels.ENV_VAR, None)
    root = Path(__file__).resolve().parents[3]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0 and " passed" in summary, \
        f"interpreter suite failed ({summary}):\n{r.stdout[-8000:]}\n{r.stderr[-3000:]}"
    print(r.stdout[-3000:])


def test_kernels_are_interpreted_and_registered() -> None:
    assert tc.INTERPRETED
    impls = {**ta.IMPLS, **tn.IMPLS, **tq.IMPLS, **tlora.IMPLS, **tmoe.IMPLS}
    assert set(impls) == {"paged_attention", "write_kv_cache", "rms_norm", "fused_add_rms_norm",
                          "rotary_embedding", "linear", "linear_int8", "linear_int4", "linear_fp8", "lora_shrink",
                          "lora_expand", "fused_moe"}
    kernels._register_triton()  # what keepwarm.kernels does at import under TRITON_INTERPRET=1 or with CUDA
    for name, fn in impls.items():
        assert registry.impl(name, "triton") is fn
    # auto keeps CPU tensors on torch; forcing triton picks these kernels.
    assert kernels.select_backend("paged_attention", torch.device("cpu")) == "torch"
    kernels.set_backend("triton")
    assert kernels.get_impl("paged_attention", torch.device("cpu")) is ta.paged_attention


# --------------------------------------------------------------------------- dtype helpers
@triton.jit
def _decode_fp8(bits_ptr, out_ptr, N: tl.constexpr, KIND: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(out_ptr + o, tc.fp8_to_f32(tl.load(bits_ptr + o), KIND))


@triton.jit
def _encode_fp8(x_ptr, out_ptr, n, N: tl.constexpr, KIND: tl.constexpr):
    o = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(out_ptr + o, tc.f32_to_fp8(tl.load(x_ptr + o, mask=o < n), KIND), mask=o < n)


@triton.jit
def _round(x_ptr, out_ptr, n, N: tl.constexpr, DTYPE: tl.constexpr):
    o = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(out_ptr + o, tc.to_dtype(tl.load(x_ptr + o, mask=o < n), DTYPE), mask=o < n)


@pytest.mark.parametrize("dtype", [FP8, E5M2])
def test_fp8_decode_and_encode_match_torch(dtype: torch.dtype) -> None:
    kind = tc.fp8_kind(dtype)
    codes = torch.arange(256, dtype=torch.uint8)
    values = torch.empty(256)
    _decode_fp8[(1,)](codes, values, 256, kind)
    ref = codes.view(dtype).float()
    finite = ref.isfinite()
    assert torch.equal(values[finite], ref[finite])  # every finite code, subnormals included
    # Encode: random magnitudes over the whole range (subnormals too), every code, and every midpoint (ties).
    g = torch.Generator().manual_seed(0)
    fmax = torch.finfo(dtype).max
    exps = torch.randint(-26, 17, (6000,), generator=g).float()
    grid = ref[finite].sort().values
    x = torch.cat([torch.randn(6000, generator=g) * torch.exp2(exps), grid, (grid[1:] + grid[:-1]) / 2,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-38, fmax, -fmax])]).clamp(-fmax, fmax)
    bits = torch.empty(len(x), dtype=torch.uint8)
    _encode_fp8[(triton.cdiv(len(x), 2048),)](x, bits, len(x), 2048, kind)
    assert torch.equal(bits, x.to(dtype).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_matches_torch_casts(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8192, generator=g) * torch.exp2(torch.randint(-30, 30, (8192,), generator=g).float())
    x[:5] = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.3895e38, -0.0])
    out = torch.empty(len(x), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's overflow warning: float16 casts of huge values
        _round[(triton.cdiv(len(x), 4096),)](x, out, len(x), 4096, tc.tl_dtype(dtype))
    ref = x.to(dtype)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out[~ref.isnan()], ref[~ref.isnan()])


# --------------------------------------------------------------------------- KV cache
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, FP8, E5M2])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache_matches_reference(cache_dtype: torch.dtype, block_size: int) -> None:
    g = torch.Generator().manual_seed(block_size)
    hk, d, nb, t = 2, 24, 5, 11  # head_dim 24: a padded (non power of two) head
    src_dtype = torch.bfloat16 if cache_dtype == torch.float16 else torch.float32  # fp16 cache: a converting write
    key = (torch.randn(t, hk, d, generator=g) * 3).to(src_dtype)
    value = (torch.randn(t, hk, d, generator=g) * 3).to(src_dtype)
    key[0, 0, :2] = torch.tensor([500.0, -500.0])  # / 0.5 = +-1000: fp8 e4m3 must saturate to +-448, not NaN
    slots = torch.randperm(nb * block_size, generator=g)[:t]
    slots[[2, 7]] = -1  # padding: skipped, and must not wrap around to the pool's last slot
    # Both caches as strided views into one buffer (non-contiguous), pre-filled with a marker.
    buf = torch.full((hk, nb, 2, block_size, d), 3.0).to(cache_dtype)
    expected = buf.clone()
    reference.write_kv_cache(key, value, expected[:, :, 0], expected[:, :, 1], slots, 0.5, 0.25)
    ta.write_kv_cache(key, value, buf[:, :, 0], buf[:, :, 1], slots, 0.5, 0.25)
    assert torch.equal(buf.view(torch.uint8), expected.view(torch.uint8))


# --------------------------------------------------------------------------- paged attention
def _paged_batch(specs: list[tuple[int, int]], hq: int, hk: int, d: int, block_size: int, dtype: torch.dtype,
                 cache_dtype: torch.dtype | None = None, k_scale: float = 1.0, v_scale: float = 1.0, seed: int = 0):
    """Random K/V for every context position written with the reference; garbage everywhere else, and table
    entries past each sequence's blocks that would fault if read."""
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    per_seq = [math.ceil(n / block_size) for _, n in specs]
    num_blocks = sum(per_seq) + 3
    ids = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(2**30, 2**31 - 1, (len(specs), max(per_seq) + 1), generator=g)
    garbage = torch.full((hk, num_blocks, block_size, d), 100.0).to(cache_dtype)
    k_cache, v_cache = garbage.clone(), garbage.clone()
    keys, values, used = [], [], 0
    for s, (_, n) in enumerate(specs):
        own = ids[used:used + per_seq[s]]
        used += per_seq[s]
        tables[s, :len(own)] = own
        pos = torch.arange(n)
        k, v = torch.randn(n, hk, d, generator=g).to(dtype), torch.randn(n, hk, d, generator=g).to(dtype)
        reference.write_kv_cache(k, v, k_cache, v_cache, own[pos // block_size] * block_size + pos % block_size,
                                 k_scale, v_scale)
        if cache_dtype in (FP8, E5M2):  # what the cache holds, dequantized
            k = (k.float() / k_scale).clamp(-448, 448).to(cache_dtype).float() * k_scale
            v = (v.float() / v_scale).clamp(-448, 448).to(cache_dtype).float() * v_scale
        keys.append(k.float())
        values.append(v.float())
    q_lens = [q for q, _ in specs]
    query = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([n for _, n in specs], dtype=torch.int32)
    return query, k_cache, v_cache, tables.to(torch.int32), seq_lens, qsl, keys, values


def _oracle(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
            specs: list[tuple[int, int]], scale: float, window: int | None = None,
            softcap: float | None = None) -> torch.Tensor:
    """Dense causal attention in float64, one sequence at a time; ``window`` w: a row at position p sees
    p-w+1..p; ``softcap`` c: scores c * tanh(s / c)."""
    hq, hk = query.shape[1], keys[0].shape[1]
    out, start = [], 0
    for s, (q_len, n) in enumerate(specs):
        q = query[start:start + q_len].double()
        k = keys[s].double().repeat_interleave(hq // hk, dim=1)
        v = values[s].double().repeat_interleave(hq // hk, dim=1)
        scores = torch.einsum("qhd,lhd->hql", q, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        causal = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
        if window is not None:
            causal &= torch.arange(n)[None, :] > torch.arange(n - q_len, n)[:, None] - window
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out.append(torch.einsum("hql,lhd->qhd", probs, v))
        start += q_len
    return torch.cat(out).float()


# (q_len, seq_len): decodes (a 1-token context, block-boundary lengths), a prefill without a cached prefix, and
# prefill chunks on top of cached prefixes (one spanning several query tiles).
MIXED = [(1, 1), (6, 6), (1, 33), (5, 40), (1, 64), (3, 19), (1, 17), (20, 70), (1, 100)]
ATTN_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _attend(batch, specs, scale: float, k_scale: float = 1.0, v_scale: float = 1.0, max_query_len: object = "max",
            num_splits: int | None = None) -> torch.Tensor:
    query, k_cache, v_cache, tables, seq_lens, qsl, _, _ = batch
    mql = max(q for q, _ in specs) if max_query_len == "max" else max_query_len
    return ta.paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl, scale, k_scale, v_scale, mql,
                              num_splits=num_splits)


# GQA (4 query heads per kv head) and MHA, block sizes 16 and 32, every activation dtype: a covering subset of
# the full product, which would cost the interpreter three times as long.
@pytest.mark.parametrize(("hq", "hk", "block_size", "dtype"), [(8, 2, 16, torch.float32), (8, 2, 32, torch.bfloat16),
                                                               (4, 4, 16, torch.float16), (4, 4, 32, torch.float32)])
def test_paged_attention_mixed(hq: int, hk: int, block_size: int, dtype: torch.dtype) -> None:
    d = 32
    batch = _paged_batch(MIXED, hq, hk, d, block_size, dtype, seed=block_size + hq)
    out = _attend(batch, MIXED, d**-0.5)
    assert out.shape == batch[0].shape and out.dtype == dtype
    expected = _oracle(batch[0], batch[6], batch[7], MIXED, d**-0.5)
    tol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    if dtype == torch.float32:
        ref = reference.paged_attention(*batch[:6], d**-0.5, max_query_len=20)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("cache_dtype", "dtype"), [(FP8, torch.float32), (FP8, torch.bfloat16),
                                                    (E5M2, torch.float32)])
def test_paged_attention_fp8_cache(cache_dtype: torch.dtype, dtype: torch.dtype) -> None:
    k_scale, v_scale = 0.02, 0.01  # |randn| / scale stays inside +-448: nothing clamps
    batch = _paged_batch(MIXED, 8, 2, 64, 16, dtype, cache_dtype, k_scale, v_scale, seed=11)
    out = _attend(batch, MIXED, 0.125, k_scale, v_scale)
    # Against the oracle on the dequantized cache: the dequantized K/V are rounded to the query's dtype first.
    tol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), _oracle(batch[0], batch[6], batch[7], MIXED, 0.125), atol=tol, rtol=tol)
    ref = reference.paged_attention(*batch[:6], 0.125, k_scale, v_scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("window", "softcap", "max_query_len", "num_splits"),
                         [(7, None, "max", 1), (16, 5.0, "max", 2), (33, None, 1, 3), (1, 5.0, 1, 1)])
def test_paged_attention_sliding_window(window: int, softcap: float | None, max_query_len: object,
                                        num_splits: int) -> None:
    # Blocks wholly before every row's window point at ids that fault if read: the kernel must skip them.
    specs = [(1, 100), (1, 40), (1, 5), (1, 64)] if max_query_len == 1 else MIXED
    batch = _paged_batch(specs, 8, 2, 32, 16, torch.float32, seed=window)
    tables = batch[3]
    for s, (q_len, n) in enumerate(specs):
        tables[s, :max(0, n - q_len - window + 1) // 16] = 2**31 - 1
    query, k_cache, v_cache, _, seq_lens, qsl, keys, values = batch
    mql = max(q for q, _ in specs) if max_query_len == "max" else max_query_len
    out = ta.paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl, 0.3, 1.0, 1.0, mql,
                             sliding_window=window, logit_softcap=softcap, num_splits=num_splits)
    expected = _oracle(query, keys, values, specs, 0.3, window=window, softcap=softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    ref = reference.paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl, 0.3, sliding_window=window,
                                    logit_softcap=softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [None, 2, 3])
def test_paged_attention_decode_grid_and_splits(num_splits: int | None) -> None:
    # Decode-only batch with max_query_len=1: one program per sequence; split-KV forced (the heuristic gives 1
    # on CPU), including slices that are empty for short contexts.
    specs = [(1, 5), (1, 1), (1, 48), (1, 31), (1, 130)]
    batch = _paged_batch(specs, 8, 2, 32, 16, torch.float32, seed=3)
    out = _attend(batch, specs, 0.2, max_query_len=1, num_splits=num_splits)
    torch.testing.assert_close(out, _oracle(batch[0], batch[6], batch[7], specs, 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_attention_mixed_grid_unknown_max_and_odd_shapes(num_splits: int) -> None:
    # max_query_len unknown (None: the grid is sized from T), block size 8, head_dim 48 (padded to 64), 6 query
    # heads per kv head (padded to 8), padding rows after the last sequence (must stay zero).
    specs = [(4, 4), (1, 9), (7, 25)]
    batch = list(_paged_batch(specs, 12, 2, 48, 8, torch.float32, seed=4))
    batch[0] = torch.cat([batch[0], torch.randn(3, 12, 48)])  # 3 padding rows owned by no sequence
    out = _attend(batch, specs, 0.15, max_query_len=None, num_splits=num_splits)
    expected = _oracle(batch[0][:-3], batch[6], batch[7], specs, 0.15)
    torch.testing.assert_close(out[:-3], expected, atol=1e-5, rtol=1e-5)
    assert not out[-3:].any()


# --------------------------------------------------------------------------- norms and rotary
ULP = {torch.float32: 1e-6, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norms_match_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    # Strided inputs (a column slice; a transposed residual), hidden size 96 (padded to 128).
    x = (torch.randn(9, 200, generator=g) * 3).to(dtype)[:, :96]
    residual = torch.randn(96, 9, generator=g).to(dtype).t()
    weight = torch.randn(96, generator=g).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    tol = ULP[dtype]
    torch.testing.assert_close(tn.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), atol=tol,
                               rtol=2 * tol)
    normed, summed = tn.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, ref_summed) and summed.dtype == dtype
    torch.testing.assert_close(normed, ref_normed, atol=tol, rtol=2 * tol)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
    # A float32 weight with bfloat16 activations promotes, as torch does.
    if dtype == torch.bfloat16:
        out = tn.rms_norm(x, weight.float(), 1e-5)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, reference.rms_norm(x, weight.float(), 1e-5), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [32, 16])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_matches_reference(is_neox: bool, rot_dim: int, dtype: torch.dtype) -> None:
    head_dim, hq, hk, t = 32, 4, 2, 7
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    cache = kernels.build_cos_sin_cache(rot_dim, 64, inv_freq)
    g = torch.Generator().manual_seed(rot_dim)
    positions = torch.randint(0, 64, (t,), generator=g)
    # q and k as the model has them: column slices of the fused qkv output (strided rows).
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, generator=g).to(dtype)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    q_out, k_out = tn.rotary_embedding(positions, q, k, head_dim, cache, is_neox)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, head_dim, cache, is_neox)
    assert q_out.shape == q.shape and q_out.dtype == dtype
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    # [T, H, D] inputs keep their shape.
    q3, k3 = tn.rotary_embedding(positions, q.reshape(t, hq, head_dim), k.reshape(t, hk, head_dim), head_dim, cache,
                                 is_neox)
    assert q3.shape == (t, hq, head_dim) and torch.equal(q3.reshape(t, -1), q_ref)


# --------------------------------------------------------------------------- weight-only quantized matmuls
MM_TOL = {torch.float32: 1e-6, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-7}


def _mm_close(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> None:
    mag = float((x.float().abs().reshape(-1, x.shape[-1]) @ w.float().abs().T).max())
    err = float((y.float() - ref.float()).abs().max())
    assert err <= MM_TOL[dtype] * mag, f"max error {err:.3g} > {MM_TOL[dtype]:.3g} * {mag:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_quantized_linear_matches_reference(scheme: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    n, k = 80, 96  # N not a multiple of the tile; int4 groups of 32
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] = 0.0  # an all-zero row / group
    meta, parts = quantize(w, scheme, dtype, "cuda", group_size=32)  # "cuda": int4's canonical layout
    qw = QuantizedWeight.from_parts(meta, parts)
    dense = qw.dequantize(dtype)
    fn = getattr(tq, f"linear_{scheme}")
    for rows in ((1,), (5,), (2, 3), (70,)):  # the three tile configurations, and a 3-D input
        x = torch.randn(*rows, k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g).to(dtype) if len(rows) == 2 else None
        y = fn(x, qw, bias)
        assert y.shape == (*rows, n) and y.dtype == dtype
        _mm_close(y, quant.linear_reference(x, qw, bias), x, dense, dtype)


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_quantized_linear_split_k_and_tiles(scheme: str) -> None:
    """Every tile shape the table can hold (MMA tiles and GEMV, block_m 1), with split-K (3 slices over 4 K tiles:
    a short last slice) and without: the same result as the reference. The CPU has no SM count, so split-K is
    only reached like this."""
    g = torch.Generator().manual_seed(3)
    n, k = 72, 256
    w = torch.randn(n, k, generator=g) * 0.05
    qw = QuantizedWeight.from_parts(*quantize(w, scheme, torch.bfloat16, "cuda", group_size=64))
    dense = qw.dequantize(torch.bfloat16)
    kind = getattr(tq, f"KIND_{scheme.upper()}")
    for rows, tile in ((1, tq.Tile(16, 32, 64, 3)), (5, tq.Tile(16, 64, 64, 2)), (20, tq.Tile(32, 16, 128, 1)),
                       (3, tq.Tile(16, 16, 32, 8)), (1, tq.Tile(1, 32, 64, 3)), (1, tq.Tile(1, 16, 128, 1)),
                       (2, tq.Tile(1, 64, 32, 2))):  # the last three: the GEMV kernel (one program row per x row)
        x = torch.randn(rows, k, generator=g).bfloat16()
        bias = torch.randn(n, generator=g).bfloat16()
        if scheme == "int4" and tile.block_k > 64:
            tile = tq.Tile(tile.block_m, tile.block_n, 64, tile.split_k)
        y = tq.launch(x, qw, bias, kind, tile)
        _mm_close(y, quant.linear_reference(x, qw, bias), x, dense, torch.bfloat16)


def test_fp8_per_channel_scale() -> None:
    """A per-output-channel fp8 scale (pre-quantized checkpoints) is applied per row of W, by both paths' math."""
    g = torch.Generator().manual_seed(4)
    n, k = 48, 128
    w = torch.randn(n, k, generator=g) * torch.linspace(0.01, 1.0, n)[:, None]
    scale = w.abs().amax(1) / 448.0
    meta, _ = quantize(w, "fp8", torch.bfloat16, "cuda")
    # Built directly: from_parts checks the [1]-shaped per-tensor scale of today's layout.
    qw = QuantizedWeight(meta, {"qweight": (w / scale[:, None]).to(FP8), "scale": scale})
    dense = (qw.parts["qweight"].float() * scale[:, None]).bfloat16()
    x = torch.randn(5, k, generator=g).bfloat16()
    y = tq.launch(x, qw, None, tq.KIND_FP8, tq.Tile(16, 16, 64, 2))
    _mm_close(y, x.float() @ dense.float().t(), x, dense, torch.bfloat16)


def test_tile_table_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shape row, then the kind and M range's '*' row, then the built-in heuristic; int4 K tiles stay in a group."""
    table = {"tiles": {"int4": {"1": {"4096x4096": [16, 128, 256, 4, 4, 4], "*": [16, 32, 64, 2, 4, 3]}},
                       "int8": {"64": {"*": [64, 64, 128, 1, 4, 3]}}},
             "fp8_scaled_mm_min_rows": 48}
    monkeypatch.setattr(tq, "load_table", lambda path=None: table)
    cpu = torch.device("cpu")
    assert tq.m_bucket(1) == 1 and tq.m_bucket(2) == 16 and tq.m_bucket(17) == 64 and tq.m_bucket(10**6) == 256
    t = tq.choose_tile(tq.KIND_INT4, 1, 4096, 4096, 128, False, cpu)
    assert (t.block_n, t.block_k, t.split_k) == (128, 128, 4)  # 256 legalised to the group of 128
    assert tq.choose_tile(tq.KIND_INT4, 1, 6144, 4096, 128, False, cpu).block_n == 32  # '*'
    assert tq.choose_tile(tq.KIND_INT8, 40, 6144, 4096, 0, False, cpu) == tq.Tile(64, 64, 128, 1, 4, 3)
    assert tq.choose_tile(tq.KIND_INT8, 1, 6144, 4096, 0, False, cpu) == tq._default_tile(
        tq.KIND_INT8, 1, 6144, 4096, 0)  # no row at all
    assert tq.fp8_min_rows() == 48
    assert tq.table_arch({"device": "NVIDIA H200"}) == 9 and tq.table_arch({"capability": [8, 0]}) == 8
    assert tq.table_arch({"device": "none (smoke run)"}) is None
    # Per shape, from the table's timings: the smallest timed M from which _scaled_mm won at every larger one.
    table["timings_us"] = {"fp8": {"16": {"64x128": {"best_us": 5.0, "scaled_mm_us": 4.0}},
                                   "64": {"64x128": {"best_us": 5.0, "scaled_mm_us": 6.0},
                                          "32x128": {"best_us": 5.0, "scaled_mm_us": 6.0}},
                                   "256": {"64x128": {"best_us": 9.0, "scaled_mm_us": 8.0},
                                           "32x128": {"best_us": 5.0, "scaled_mm_us": 6.0}}}}
    assert tq.fp8_min_rows(64, 128) == 256  # won at 16, lost at 64: not from 16
    assert tq.fp8_min_rows(32, 128) == 512  # never won: past the largest timed M
    assert tq.fp8_min_rows(48, 128) == 48  # not timed: the all-shapes value


def test_default_tile_splits_k_only_to_fill_the_gpu() -> None:
    small_n = tq._default_tile(tq.KIND_INT8, 1, 4096, 14336, 132)  # 64 tiles of N: split to fill 132 SMs
    wide_n = tq._default_tile(tq.KIND_INT8, 1, 28672, 4096, 132)  # 448 tiles: no split
    assert small_n.split_k > 1 and wide_n.split_k == 1
    assert tq._default_tile(tq.KIND_INT8, 1, 4096, 14336, 0).split_k == 1  # interpreter: no SMs to fill


def test_int4_cpu_layout_falls_back_to_reference() -> None:
    from keepwarm.formats.quant import cpu_int4_layout

    if cpu_int4_layout() is None:
        pytest.skip("this torch has no recognised CPU int4 pack")
    qw = QuantizedWeight.from_parts(*quantize(torch.randn(32, 64) * 0.05, "int4", torch.bfloat16, "cpu",
                                              group_size=32))
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(tq.linear_int4(x, qw), quant.linear_reference(x, qw))


def test_fp8_path_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    qw = QuantizedWeight.from_parts(*quantize(torch.randn(64, 128), "fp8", torch.bfloat16, "cuda"))
    big, small = torch.randn(256, 128).bfloat16(), torch.randn(4, 128).bfloat16()
    hopper, ampere = (9, 0), (8, 0)
    assert tq.fp8_path(big, qw, hopper) == "scaled_mm"
    assert tq.fp8_path(small, qw, hopper) == "triton"  # few rows: weight-bandwidth bound
    assert tq.fp8_path(big, qw, ampere) == "triton"
    assert tq.fp8_path(big.float(), qw, hopper) == "triton"  # rowwise _scaled_mm outputs bfloat16 only
    odd = QuantizedWeight.from_parts(*quantize(torch.randn(40, 120), "fp8", torch.bfloat16, "cuda"))
    assert tq.fp8_path(torch.randn(256, 120).bfloat16(), odd, hopper) == "triton"  # K, N not multiples of 16
    monkeypatch.setenv(tq.FP8_MATMUL_ENV, "scaled_mm")
    assert tq.fp8_path(small, qw, ampere) == "scaled_mm"
    monkeypatch.setenv(tq.FP8_MATMUL_ENV, "triton")
    assert tq.fp8_path(big, qw, hopper) == "triton"
    monkeypatch.setenv(tq.FP8_MATMUL_ENV, "fast")
    with pytest.raises(ValueError, match=tq.FP8_MATMUL_ENV):
        tq.fp8_path(big, qw, hopper)


def test_quantize_rows_kernel_matches_torch_bit_for_bit() -> None:
    """The one-launch per-token fp8 quantization feeding _scaled_mm equals the torch expression exactly: same
    scales, same codes (an all-zero row, values that saturate, K not a multiple of the kernel's block)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 1500, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1.0])[:, None]).bfloat16()
    x[0] = 0
    codes, scale = tq.quantize_rows(x)
    xf = x.float()
    want_scale = (xf.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    want = (xf / want_scale).clamp(-448, 448).to(FP8)
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8))


def test_fp8_scaled_mm_is_w8a8() -> None:
    # torch._scaled_mm runs on the CPU too (torch 2.13): checks the per-token scaling against a W8A8 oracle.
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=g) * 0.05
    qw = QuantizedWeight.from_parts(*quantize(w, "fp8", torch.bfloat16, "cuda"))
    x = (torch.randn(2, 9, 128, generator=g) * torch.linspace(0.1, 10, 9)[:, None]).bfloat16()
    x[0, 0] = 0  # an all-zero row
    bias = torch.randn(64, generator=g).bfloat16()
    y = tq.fp8_scaled_mm(x, qw, bias)
    assert y.shape == (2, 9, 64) and y.dtype == torch.bfloat16
    xf = x.float().reshape(-1, 128)
    s = (xf.abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
    xq = (xf / s).clamp(-448, 448).to(FP8).float() * s
    oracle = xq @ qw.dequantize().t() + bias.float()
    _mm_close(y.reshape(-1, 64), oracle, x, qw.dequantize(), torch.bfloat16)
    # ... and it is within fp8 activation rounding (3 mantissa bits) of the weight-only product.
    err = (y.float().reshape(-1, 64) - (xf @ qw.dequantize().t() + bias.float())).abs().max()
    assert err < 2.0**-4 * float((xf.abs() @ qw.dequantize().abs().t()).max())


# --------------------------------------------------------------------------- LoRA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 16])
def test_lora_shrink_and_expand_match_reference(rank: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rank)
    t, k, groups, slots = 21, 96, 3, 2
    x = torch.randn(t, k, generator=g).to(dtype)
    a = (torch.randn(groups * slots * rank, k, generator=g) * 0.1).to(dtype)
    # Runs of tokens per adapter, as the engine's batches have them, plus base-model tokens (-1).
    token_slots = torch.tensor([-1] * 3 + [0] * 7 + [1] * 5 + [0] * 2 + [-1] * 4)
    buf = tlora.lora_shrink(x, a, token_slots, rank, slots)
    ref = reference.lora_shrink(x, a, token_slots, rank, slots)
    assert buf.shape == ref.shape and buf.dtype == dtype
    _mm_close(buf, ref, x, a, dtype)
    assert torch.equal(buf == 0, ref == 0) or dtype != torch.float32  # exact zeros outside each token's slot
    assert not buf[token_slots < 0].any()
    width = slots * rank
    b = (torch.randn(40, width, generator=g) * 0.1).to(dtype)
    y = torch.randn(t, 100, generator=g).to(dtype)
    for grp in range(groups):  # a column slice of buf, as LoRALayer.apply passes it (strided)
        part = ref[:, grp * width:(grp + 1) * width]
        out = tlora.lora_expand(y.clone(), part, b, 30)
        expected = reference.lora_expand(y.clone(), part, b, 30)
        assert torch.equal(out[:, :30], y[:, :30]) and torch.equal(out[:, 70:], y[:, 70:])
        tol = MM_TOL[dtype] * (1.0 + float((part.float().abs() @ b.float().abs().t()).max()))
        assert float((out.float() - expected.float()).abs().max()) <= max(tol, 2 * ULP[dtype] * 8)


# --------------------------------------------------------------------------- fused mixture of experts
def _moe_linear(x: torch.Tensor, w) -> torch.Tensor:
    """The reference's per-expert matmul: dequantize (float32, then x's dtype) and F.linear."""
    quantized = getattr(w, "is_quantized_weight", False)
    return quant.linear_reference(x, w) if quantized else torch.nn.functional.linear(x, w)


def _moe_experts(num_experts: int, hidden: int, inter: int, scheme: str, dtype: torch.dtype,
                 g: torch.Generator) -> kernels.MoEWeights:
    gate_up, down = [], []
    for _ in range(num_experts):
        for shape, out in (((2 * inter, hidden), gate_up), ((hidden, inter), down)):
            w = torch.randn(*shape, generator=g) * 0.1
            # "cuda": int4's canonical layout, the one the CUDA arena holds; int4 groups of 32.
            out.append(w.to(dtype) if scheme == "none"
                       else QuantizedWeight.from_parts(*quantize(w, scheme, dtype, "cuda", group_size=32)))
    return kernels.MoEWeights(tuple(gate_up), tuple(down))


def _moe_routing(tokens: int, num_experts: int, top_k: int, renormalize: bool, idle: list[int], dtype: torch.dtype,
                 g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing as the model does it; experts in `idle` never chosen (they receive zero tokens)."""
    logits = torch.randn(tokens, num_experts, generator=g)
    logits[:, idle] = float("-inf")
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def test_moe_align_block_size_groups_pairs_by_expert() -> None:
    ids = torch.tensor([[3, 0], [0, 3], [3, 1], [0, 3], [3, 0]])  # experts 2 and 4 get no token
    sorted_ids, block_expert = tmoe.align_block_size(ids, num_experts=5, block_m=4)
    pairs = ids.numel()
    # Expert 0 has 4 pairs (one block), 1 has 1 (one padded block), 3 has 5 (two); the grid is sized for the
    # worst case, 10 pairs + 5 experts' padding of up to 3 each -> 7 blocks, the unused ones -1.
    assert block_expert.tolist() == [0, 1, 3, 3, -1, -1, -1]
    blocks = sorted_ids.view(-1, 4)
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        real = blocks[b][blocks[b] < pairs]
        if e < 0:
            assert real.numel() == 0
        else:
            assert (flat[real] == e).all() and torch.equal(real, real.sort().values)  # pair ids ascending
    valid = sorted_ids[sorted_ids < pairs]
    assert sorted(valid.tolist()) == list(range(pairs))  # every pair exactly once
    assert int((sorted_ids == pairs).sum()) == 7 * 4 - pairs


MOE_TOL = {torch.float32: 1e-5, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-7}


@pytest.mark.parametrize(("scheme", "dtype", "top_k", "renormalize"), [
    ("none", torch.float32, 1, False), ("none", torch.float32, 3, True), ("none", torch.bfloat16, 2, False),
    ("none", torch.float16, 2, True), ("int8", torch.float32, 2, True), ("int8", torch.bfloat16, 1, False),
    ("fp8", torch.float32, 2, False), ("fp8", torch.float16, 2, True), ("int4", torch.float32, 2, True),
    ("int4", torch.bfloat16, 2, False),
])
def test_fused_moe_matches_reference(scheme: str, dtype: torch.dtype, top_k: int, renormalize: bool) -> None:
    """Random routing with two experts that receive no tokens; N and K not multiples of the tiles. The products
    equal the reference's (dequantized weights rounded to x's dtype alike), so only summation order differs."""
    g = torch.Generator().manual_seed(5 + top_k)
    experts = _moe_experts(6, 64, 96, scheme, dtype, g)
    for tokens in (1, 11):  # a decode step, and a chunk over several blocks
        x = torch.randn(tokens, 64, generator=g).to(dtype)
        weights, ids = _moe_routing(tokens, 6, top_k, renormalize, [1, 4], dtype, g)
        y = tmoe.fused_moe(x, weights, ids, experts, "silu")
        ref = reference.fused_moe(x, weights, ids, experts, "silu", _moe_linear)
        assert y.shape == ref.shape and y.dtype == dtype
        err = float((y.float() - ref.float()).abs().max())
        assert err <= MOE_TOL[dtype] * float(ref.abs().max()), f"{tokens} tokens: max error {err:.3g}"


def test_fused_moe_edge_cases_and_dispatch() -> None:
    g = torch.Generator().manual_seed(6)
    experts = _moe_experts(4, 32, 32, "none", torch.float32, g)
    empty = tmoe.fused_moe(torch.zeros(0, 32), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long), experts, "silu")
    assert empty.shape == (0, 32)
    # One expert takes every token (the others none), and the dispatcher reaches the kernel when triton is forced.
    x = torch.randn(5, 32, generator=g)
    weights, ids = torch.ones(5, 1), torch.full((5, 1), 2)
    kernels.set_backend("triton")
    y = kernels.fused_moe(x, weights, ids, experts, "silu")
    assert "triton:cpu" in experts.prepared  # the pointer tables, built once for this layer
    kernels.set_backend("torch")
    ref = kernels.fused_moe(x, weights, ids, experts, "silu")
    assert float((y - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_fused_moe_takes_the_reference_for_layouts_it_lacks(caplog: pytest.LogCaptureFixture) -> None:
    """An activation other than silu, or int4 in the CPU pack: the reference runs, and the log says so."""
    g = torch.Generator().manual_seed(7)
    experts = _moe_experts(3, 32, 32, "none", torch.float32, g)
    x = torch.randn(4, 32, generator=g)
    weights, ids = _moe_routing(4, 3, 2, True, [], torch.float32, g)
    with caplog.at_level("WARNING", logger="keepwarm.kernels"):
        y = tmoe.fused_moe(x, weights, ids, experts, "gelu_pytorch_tanh")
    assert "does not take activation gelu_pytorch_tanh" in caplog.text
    assert torch.equal(y, reference.fused_moe(x, weights, ids, experts, "gelu_pytorch_tanh", kernels.linear))


# --------------------------------------------------------------------------- the whole model on the triton backend
@pytest.mark.parametrize(("model_name", "quantization"), [("llama", "int8"), ("mixtral", "none")])
def test_tiny_model_greedy_same_tokens_on_triton(tiny_model_factory, model_name: str, quantization: str) -> None:
    """Every kernel of a forward (norms, rotary, KV write, paged attention, the int8 matmul; Mixtral's routed
    experts through the fused-MoE kernel) through the interpreted triton backend: greedy tokens equal the torch
    backend's, prefill chunks and decodes alike."""
    from keepwarm import LLM, SamplingParams

    kernels._register_triton()
    prompts = [[5, 6, 7, 8, 9], list(range(20, 44)), [100, 200, 300]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)  # prefill chunks, then 2 decodes
    tokens = {}
    for backend in ("torch", "triton"):
        kernels.set_backend(backend)
        llm = LLM(model=tiny_model_factory(model_name), dtype="float32", max_model_len=128, num_gpu_blocks=32,
                  block_size=16, daemon=False, device="cpu", quantization=quantization, max_num_batched_tokens=24)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if model_name == "mixtral":  # the experts went through the kernel (it caches its pointer tables)
            moe = llm.llm_engine.loaded.model.model.layers[0].mlp
            assert ("triton:cpu" in moe.weights().prepared) == (backend == "triton")
        llm.close()
    assert tokens["triton"] == tokens["torch"]


# Collect either the cases above (this process interprets) or the one test that runs them in a subprocess.
for _name in [n for n in globals() if n.startswith("test_")]:
    if (_name == SUITE) == IN_PROCESS:
        del globals()[_name]
del _name
