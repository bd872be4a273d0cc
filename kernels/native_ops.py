"""The C library's entry points (kernels/csrc/, built by kernels/cpu_native.py) as functions of torch tensors.

Rules:
- Each function checks its inputs against what its kernel takes (the `*_fits` predicates, which
  kernels/dispatch.py's rows also ask) and raises ValueError naming the shapes otherwise; nothing here chooses a
  kernel or reads a switch: callable wherever a build loaded (tests and benchmarks call them directly).
- Outputs are new tensors; weights, caches and x are only read (a weight may be a read-only view of the arena).
- Threads: the callers' torch intra-op count (``torch.get_num_threads()``).
- What each kernel computes and where it rounds: the header comment of its source file.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from keepwarm.formats.errors import QuantizationError

from . import cpu_native

__all__ = ["BGEMV_ROWS", "attention_fits", "attention_plan", "bf16_fits", "bf16_gemv", "bf16_linear", "bgemv_fits",
           "codes_to_bf16", "decode_attention", "fp8_linear", "int8_linear", "q4_amx_linear", "q4_fits", "q4_linear",
           "q4_pairs_fits", "q4_vec_linear", "q8_fits", "q8_linear", "q8g_avx512_linear", "q8g_fits", "q8g_linear",
           "q8g_to_bf16", "quantize_int8", "rms_norm", "rotary_neox", "rows_fit", "store_kv"]


def _lib(what: str, matmuls: bool = False) -> ctypes.CDLL:
    lib = cpu_native.library()
    assert lib is not None and (not matmuls or cpu_native.variant_name() == "avx512"), \
        f"{what} called where no {'AVX512-BF16 ' if matmuls else ''}build loaded"
    return lib


# -- int8 / fp8 on AVX512-BF16 (gemm_int8_avx512.c, gemm_int8_amx.c) -------------------------------------------------
def _gemm(x2d: torch.Tensor, qweight: torch.Tensor, scale32: torch.Tensor, fp8: bool, what: str) -> torch.Tensor:
    lib = _lib(what, matmuls=True)
    m, k = x2d.shape
    n = qweight.shape[0]
    if qweight.dim() != 2 or qweight.shape[1] != k or x2d.dtype != torch.bfloat16 or scale32.shape != (n,):
        raise ValueError(f"{what}: x {tuple(x2d.shape)} {x2d.dtype}, weight {tuple(qweight.shape)} and scale "
                         f"{tuple(scale32.shape)} do not fit (x must be bfloat16)")
    if not (x2d.is_contiguous() and qweight.is_contiguous()):
        raise ValueError(f"{what}: x and weight must be contiguous")
    out = torch.empty((m, n), dtype=torch.bfloat16)
    rc = lib.kw_gemm(x2d.data_ptr(), qweight.data_ptr(), scale32.data_ptr(), out.data_ptr(), m, n, k, int(fp8),
                     torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"{what}: the kernel refused M={m} N={n} K={k}")
    return out


def int8_linear(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(x2d @ qweight^T) * scales`` in bfloat16: x2d bf16 [M, K] and qweight int8 [N, K], both contiguous."""
    if qweight.dtype != torch.int8:
        raise ValueError(f"int8_linear: the weight is {qweight.dtype}, not int8")
    return _gemm(x2d, qweight, scales.to(torch.float32).contiguous(), False, "int8_linear")


def fp8_linear(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(x2d @ qweight^T) * scales`` in bfloat16 for float8_e4m3fn codes [N, K]; scales: one, or one per row."""
    if qweight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear: the weight is {qweight.dtype}, not float8_e4m3fn")
    n = qweight.shape[0]
    # The kernel reads each code as its value / 256 (exact): the 256 goes into the scale (a power of two: exact).
    scale32 = (scales.to(torch.float32).reshape(-1) * 256.0).expand(n).contiguous()
    return _gemm(x2d, qweight.view(torch.int8), scale32, True, "fp8_linear")


def codes_to_bf16(qweight: torch.Tensor) -> torch.Tensor:
    """An int8 or float8_e4m3fn weight [N, K] (contiguous) as bf16, exactly: int8 codes as integers, fp8 codes as
    value / 256 (the caller's scale takes the 256). Threads as the matmuls; for the widest calls."""
    if cpu_native.variant_name() != "avx512" or qweight.dim() != 2 or not qweight.is_contiguous() \
            or qweight.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"codes_to_bf16: a contiguous 2-D int8 / float8_e4m3fn weight on an AVX512-BF16 build, not "
                         f"{tuple(qweight.shape)} {qweight.dtype} ({cpu_native.reasons()[0] or 'built'})")
    n, k = qweight.shape
    out = torch.empty((n, k), dtype=torch.bfloat16)
    rc = _lib("codes_to_bf16", matmuls=True).kw_codes_bf16(
        qweight.data_ptr(), out.data_ptr(), n, k, int(qweight.dtype == torch.float8_e4m3fn), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"codes_to_bf16: the kernel refused N={n} K={k}")
    return out


# -- decode attention over the paged KV cache (attention.c) -------------------------------------------------------
def attention_plan(table: torch.Tensor, ctx: torch.Tensor, lo: torch.Tensor | None,
                   base: torch.Tensor | None, float32_scores: bool = False) -> torch.Tensor:
    """One step's rows for :func:`decode_attention`, as the one int64 tensor the C kernel reads: table [S, W]
    block ids, where column c holds the block of positions base[s] + c * block_size onward; ctx [S] context
    lengths; lo [S] first visible positions (None: 0); base [S] (None: 0; a multiple of block_size).
    ``float32_scores``: scores and probabilities stay float32 (SDPA's roundings, for prefill rows), else they are
    rounded to bf16 as the torch decode path rounds them."""
    S, W = table.shape
    zeros = torch.zeros(S, dtype=torch.int64)
    head = torch.tensor([S, W, int(float32_scores)], dtype=torch.int64)
    parts = (head, ctx, zeros if lo is None else lo, zeros if base is None else base, table.reshape(-1))
    return torch.cat([p.to(torch.int64) for p in parts])


def attention_fits(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: float,
                   v_scale: float) -> bool:
    """Whether :func:`decode_attention` takes these: bfloat16 q and caches (unscaled: no fp8 KV), head dim a multiple
    of 16, caches contiguous, each row of q's heads contiguous, on the CPU."""
    bf16 = torch.bfloat16
    if q.dtype != bf16 or key_cache.dtype != bf16 or value_cache.dtype != bf16 or k_scale != 1.0 or v_scale != 1.0:
        return False
    _, head_stride, col_stride = q.stride()
    d = q.shape[2]
    return (col_stride == 1 and head_stride == d and d % 16 == 0 and key_cache.shape == value_cache.shape
            and d == key_cache.shape[3] and key_cache.is_contiguous() and value_cache.is_contiguous()
            and q.device.type == "cpu")


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: torch.Tensor,
                     scale: float, softcap: float | None) -> torch.Tensor:
    """One query row per sequence, q [S, Hq, D] bf16, against its keys and values read in place from the paged
    caches [Hk, num_blocks, block_size, D] -> [S, Hq, D] bf16; ``plan`` from :func:`attention_plan`; inputs as
    :func:`attention_fits` takes them. Rounds where kernels/reference.py's ``_decode_attention`` rounds."""
    lib = _lib("decode_attention")
    S, Hq, D = q.shape
    Hk, num_blocks, block_size, _ = key_cache.shape
    out = torch.empty((S, Hq, D), dtype=torch.bfloat16)
    rc = lib.kw_decode_attention(q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
                                 out.data_ptr(), plan.data_ptr(), S, Hq, Hk, D, num_blocks, block_size, scale,
                                 softcap or 0.0, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"decode_attention: the kernel refused q {tuple(q.shape)}, cache {tuple(key_cache.shape)} "
                         f"and its plan (rc {rc}: a block id or length out of range, or no memory)")
    return out


# -- a decode step's glue: RMSNorm (+ residual), neox rotary, KV store (glue.c); preload's int8 (quantize.c) ------
def rows_fit(x: torch.Tensor, multiple: int) -> bool:
    """x is a CPU bfloat16 [rows, n] whose rows are contiguous, n a multiple of ``multiple``: what the glue reads."""
    return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % multiple == 0
            and x.device.type == "cpu")


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual) * weight, x + residual) (residual None: (rms_norm(x) * weight, None)); x and
    residual satisfy :func:`rows_fit` (8), weight is a contiguous bfloat16 [n]. New tensors; inputs untouched."""
    lib = _lib("rms_norm")
    T, H = x.shape
    out = torch.empty((T, H), dtype=torch.bfloat16)
    new = None if residual is None else torch.empty((T, H), dtype=torch.bfloat16)
    rc = lib.kw_rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                         0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(),
                         None if new is None else new.data_ptr(), T, H, eps)
    if rc != 0:
        raise ValueError(f"rms_norm: the kernel refused x {tuple(x.shape)}")
    return out, new


def rotary_neox(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary over whole heads: q [T, Hq * D], k [T, Hk * D] (:func:`rows_fit` (16)), cos and sin [T, D / 2]
    float32 with unit column stride and one row stride -> new contiguous q, k."""
    lib = _lib("rotary_neox")
    T = q.shape[0]
    qo, ko = torch.empty(q.shape, dtype=torch.bfloat16), torch.empty(k.shape, dtype=torch.bfloat16)
    rc = lib.kw_rotary_neox(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos.data_ptr(), sin.data_ptr(),
                            cos.stride(0), qo.data_ptr(), ko.data_ptr(), T, q.shape[1] // head_dim,
                            k.shape[1] // head_dim, head_dim)
    if rc != 0:
        raise ValueError(f"rotary_neox: the kernel refused q {tuple(q.shape)}, head_dim {head_dim}")
    return qo, ko


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """key, value [T, Hk, D] bfloat16 (heads contiguous in a row) into the contiguous bfloat16 pools
    [Hk, num_blocks, block_size, D] at ``slots`` [T] int64 (-1: skipped). A slot out of range raises, and nothing
    is written."""
    lib = _lib("store_kv")
    hk, nb, bs, d = key_cache.shape
    rc = lib.kw_store_kv(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), key_cache.data_ptr(),
                         value_cache.data_ptr(), slots.data_ptr(), key.shape[0], hk, d, nb, bs)
    if rc != 0:
        raise ValueError(f"store_kv: a slot of {slots.tolist()} is outside the pools ({nb} blocks of {bs})")


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``keepwarm.formats.quant``'s per-row int8 (codes, bfloat16 scales) of a contiguous CPU bfloat16 weight [N, K]
    in C, bit for bit, at several GB/s where torch's row blocks run at ~0.6; None where no build runs here or the
    switch is off: the caller then takes torch's path."""
    if not (w.dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous() and w.device.type == "cpu"):
        return None
    if not cpu_native.glue_on():
        cpu_native.log_unavailable("int8 quantization at preload")
        return None
    n, k = w.shape
    q = torch.empty((n, k), dtype=torch.int8)
    scales = torch.empty(n, dtype=torch.bfloat16)
    if _lib("quantize_int8").kw_quant_int8(w.data_ptr(), n, k, q.data_ptr(), scales.data_ptr()) != 0:
        raise QuantizationError(f"weight of shape {(n, k)} has non-finite values")
    return q, scales


# -- bf16 x bf16, and int8 / fp8 / int4 weight-only matmuls on AVX2 + FMA (gemm_*_avx2.c) -------------------------
def bf16_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [..., K] and weight [N, K] are CPU bfloat16, weight contiguous, K a multiple of 16."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous() and x.dim() >= 1
            and x.shape[-1] == weight.shape[1] and weight.shape[1] % 16 == 0 and x.numel() > 0)


def _split_x(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., k] as float32 [rows, k] (exact), converted once, not per weight row; each 16 values as their 8 even
    then 8 odd (the C splits 16 weights that way: one load, a shift and a mask)."""
    return x.reshape(-1, k // 16, 8, 2).transpose(-1, -2).float().contiguous().view(-1, k)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` in bfloat16 (:func:`bf16_fits` inputs): float32 products and sums, one fixed summation
    order per output element whatever the batch, rounded once."""
    lib = _lib("bf16_linear")
    if not bf16_fits(x, weight):
        raise ValueError(f"bf16_linear: x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} "
                         f"{weight.dtype} do not fit (bfloat16, contiguous weight, K a multiple of 16)")
    n, k = weight.shape
    xf = _split_x(x, k)
    out = torch.empty((xf.shape[0], n), dtype=torch.bfloat16)
    rc = lib.kw_bgemm(xf.data_ptr(), weight.data_ptr(), out.data_ptr(), xf.shape[0], n, k, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"bf16_linear: the kernel refused M={xf.shape[0]} N={n} K={k}")
    return out.reshape(*x.shape[:-1], n)


# -- bf16 x bf16 for a few rows on AVX512-BF16 (gemm_bf16_avx512.c) --------------------------------------------------
BGEMV_ROWS = 4  # the most rows of x kw_bgemv512 takes


def bgemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """:func:`bf16_fits`, with K a multiple of 32 and at most :data:`BGEMV_ROWS` rows of x."""
    return bf16_fits(x, weight) and weight.shape[1] % 32 == 0 and x.numel() // x.shape[-1] <= BGEMV_ROWS


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` in bfloat16 for :func:`bgemv_fits` inputs: vdpbf16ps over 32 values of k at a time, 16
    float32 lanes summed in one fixed order, rounded once; a row's bits do not depend on the others or the threads."""
    lib = _lib("bf16_gemv", matmuls=True)
    if not bgemv_fits(x, weight):
        raise ValueError(f"bf16_gemv: x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} "
                         f"do not fit (bfloat16, contiguous weight, K a multiple of 32, at most {BGEMV_ROWS} rows)")
    n, k = weight.shape
    x2d = x.reshape(-1, k).contiguous()
    out = torch.empty((x2d.shape[0], n), dtype=torch.bfloat16)
    if lib.kw_bgemv512(x2d.data_ptr(), weight.data_ptr(), out.data_ptr(), x2d.shape[0], n, k,
                       torch.get_num_threads()) != 0:
        raise ValueError(f"bf16_gemv: the kernel refused M={x2d.shape[0]} N={n} K={k}")
    return out.reshape(*x.shape[:-1], n)


def q8_fits(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> bool:
    """x [..., K] bfloat16, qweight int8 or float8_e4m3fn [N, K] contiguous, K a multiple of 16, all on the CPU;
    scales: one per row ([N]), or one for the tensor ([] or [1])."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and qweight.dtype in (torch.int8, torch.float8_e4m3fn)
            and qweight.device.type == "cpu" and qweight.dim() == 2 and qweight.is_contiguous()
            and x.numel() > 0 and x.shape[-1] == qweight.shape[1] and qweight.shape[1] % 16 == 0
            and scales.is_floating_point() and scales.numel() in (1, qweight.shape[0]))


def q8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(x @ qweight^T) * scales`` in bfloat16 (:func:`q8_fits` inputs: int8 or float8_e4m3fn codes): the codes
    exactly as float32, products and sums in float32 in kw_bgemm's order, times the float32 scale, rounded once."""
    lib = _lib("q8_linear")
    if not q8_fits(x, qweight, scales):
        raise ValueError(f"q8_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(qweight.shape)} {qweight.dtype}"
                         f" and scales {tuple(scales.shape)} {scales.dtype} do not fit")
    n, k = qweight.shape
    xf = _split_x(x, k)
    scale32 = scales.to(torch.float32).reshape(-1).expand(n).contiguous()
    out = torch.empty((xf.shape[0], n), dtype=torch.bfloat16)
    fp8 = int(qweight.dtype == torch.float8_e4m3fn)
    rc = lib.kw_q8gemm(xf.data_ptr(), qweight.data_ptr(), scale32.data_ptr(), out.data_ptr(), xf.shape[0], n, k, fp8,
                       torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"q8_linear: the kernel refused M={xf.shape[0]} N={n} K={k} (rc {rc})")
    return out.reshape(*x.shape[:-1], n)


def q8g_fits(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             group_size: int) -> bool:
    """x [..., K] bfloat16; qweight int8 [N, K] (int8_group) or uint8 [N, K / 2] (int8_group_u4, K % 32 == 0)
    contiguous; scales and zeros bfloat16 [N, K / group_size] contiguous; group_size a multiple of 16 that divides K;
    all on the CPU (no g_idx)."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() > 0 and x.dim() > 0
            and _q8g_weight_fits(qweight, scales, zeros, group_size) and x.shape[-1] == _q8g_k(qweight))


def _q8g_k(qweight: torch.Tensor) -> int:
    """K of an int8_group qweight: int8 codes [N, K], or two 4-bit codes a byte (uint8 [N, K / 2])."""
    return int(qweight.shape[1]) * (2 if qweight.dtype == torch.uint8 else 1)


def _q8g_weight_fits(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> bool:
    if not (qweight.dim() == 2 and qweight.dtype in (torch.int8, torch.uint8) and qweight.device.type == "cpu"
            and qweight.is_contiguous() and qweight.numel() > 0):
        return False
    n, k = qweight.shape[0], _q8g_k(qweight)
    return (group_size >= 16 and group_size % 16 == 0 and k % group_size == 0
            and (qweight.dtype == torch.int8 or k % 32 == 0)
            and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()
                    and tuple(t.shape) == (n, k // group_size) for t in (scales, zeros)))


def _q8g_entry(name: str, qweight: torch.Tensor) -> str:
    """The entry point for this qweight's codes: `name`, or its ``_u4`` twin for the 4-bit pack."""
    if qweight.dtype != torch.uint8:
        return name
    return name.replace("_bf16", "_u4_bf16") if name.endswith("_bf16") else name + "_u4"


@functools.cache
def _q8group(name: str) -> Any:  # a ctypes function
    # The int8_group entry points' C signatures are declared here, not in cpu_native._declare (their files).
    fn = getattr(_lib(name, matmuls="512" in name), name)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    pointers, sizes = (4, 3) if name.endswith("bf16") else (5, 4)
    fn.restype, fn.argtypes = ctypes.c_int, [p] * pointers + [i64] * sizes + [ctypes.c_int]
    return fn


def _q8g(name: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         group_size: int) -> torch.Tensor:
    if not q8g_fits(x, qweight, scales, zeros, group_size):
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype}, weight {tuple(qweight.shape)} {qweight.dtype}, "
                         f"scales {tuple(scales.shape)} {scales.dtype}, zeros {tuple(zeros.shape)} {zeros.dtype} "
                         f"and groups of {group_size} do not fit")
    n, k = qweight.shape[0], _q8g_k(qweight)
    x2 = x.reshape(-1, k).contiguous()
    out = torch.empty((x2.shape[0], n), dtype=torch.bfloat16)
    rc = _q8group(_q8g_entry(name, qweight))(x2.data_ptr(), qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
                                             out.data_ptr(), x2.shape[0], n, k, group_size, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"{name}: the kernel refused M={x2.shape[0]} N={n} K={k} groups of {group_size} (rc {rc})")
    return out.reshape(*x.shape[:-1], n)


def q8g_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int) -> torch.Tensor:
    """``x @ W^T`` in bfloat16 for the int8_group layouts, W = code * scale + zero per group of ``group_size``
    columns (:func:`q8g_fits` inputs; 4-bit codes: the same bits as their int8 form), on AVX2 (every build): per
    output, the exact float32 products x * (code * scale) summed, plus zero * (x's group sum) per group, float32,
    one order whatever the batch or the threads, rounded once."""
    return _q8g("kw_q8group", x, qweight, scales, zeros, group_size)


def q8g_avx512_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int) -> torch.Tensor:
    """:func:`q8g_linear` on 16 lanes (the avx512 build only): the same products, its sums in another fixed
    order."""
    if cpu_native.variant_name() != "avx512":
        raise ValueError(f"q8g_avx512_linear: no avx512 build here ({cpu_native.reasons()[0] or 'switched off'})")
    return _q8g("kw_q8group512", x, qweight, scales, zeros, group_size)


def q8g_to_bf16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                lanes: int = 0) -> torch.Tensor:
    """The int8_group weight as bfloat16 [N, K], bit for bit the reference's ``dequantize(torch.bfloat16)`` (code *
    scale + zero in float32, rounded once to nearest even), threads as the matmuls; for the widest calls. On 16
    lanes in the avx512 build, else 8 (`lanes` 8 or 16 asks for one: tests)."""
    if not _q8g_weight_fits(qweight, scales, zeros, group_size):
        raise ValueError(f"q8g_to_bf16: weight {tuple(qweight.shape)} {qweight.dtype}, scales {tuple(scales.shape)} "
                         f"{scales.dtype}, zeros {tuple(zeros.shape)} {zeros.dtype} and groups of {group_size} do "
                         "not fit")
    n, k = qweight.shape[0], _q8g_k(qweight)
    out = torch.empty((n, k), dtype=torch.bfloat16)
    wide = lanes == 16 or not lanes and cpu_native.variant_name() == "avx512"
    if wide and cpu_native.variant_name() != "avx512":
        raise ValueError(f"q8g_to_bf16: no avx512 build here ({cpu_native.reasons()[0] or 'switched off'})")
    fn = _q8group(_q8g_entry("kw_q8group512_bf16" if wide else "kw_q8group_bf16", qweight))
    rc = fn(qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), out.data_ptr(), n, k, group_size,
            torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"q8g_to_bf16: the kernel refused N={n} K={k} groups of {group_size} (rc {rc})")
    return out


def q4_fits(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
            block: int) -> bool:
    """x [..., K] bfloat16; qweight uint8 in torch's CPU int4 "halves" pack of `block` rows (N a multiple of it);
    scales_and_zeros bfloat16 [K / group_size, N, 2]; group_size a multiple of 8."""
    n2 = scales_and_zeros.shape[1] if scales_and_zeros.dim() == 3 else -1
    k = x.shape[-1] if x.dim() else -1
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() > 0 and qweight.dtype == torch.uint8
            and qweight.device.type == "cpu" and qweight.is_contiguous() and block in (16, 32, 48, 64)
            and group_size >= 8 and group_size % 8 == 0 and k % group_size == 0 and n2 > 0 and n2 % block == 0
            and qweight.numel() == n2 * k // 2 and scales_and_zeros.dtype == torch.bfloat16
            and tuple(scales_and_zeros.shape) == (k // group_size, n2, 2) and scales_and_zeros.is_contiguous())


def q4_linear(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
              block: int) -> torch.Tensor:
    """``x @ W^T`` in bfloat16 for an int4 weight in torch's CPU "halves" pack (:func:`q4_fits`), W = (code - 8) *
    scale + zero per group: per group ``scale * sum x (code - 8) + zero * sum x``, float32, one order per output
    element whatever the batch, rounded once."""
    lib = _lib("q4_linear")
    if not q4_fits(x, qweight, scales_and_zeros, group_size, block):
        raise ValueError(f"q4_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(qweight.shape)} {qweight.dtype}, "
                         f"scales_and_zeros {tuple(scales_and_zeros.shape)} {scales_and_zeros.dtype}, groups of "
                         f"{group_size} and blocks of {block} do not fit")
    n, k = scales_and_zeros.shape[1], x.shape[-1]
    xf = x.reshape(-1, k).float().contiguous()
    out = torch.empty((xf.shape[0], n), dtype=torch.bfloat16)
    rc = lib.kw_q4gemm(xf.data_ptr(), qweight.data_ptr(), scales_and_zeros.data_ptr(), out.data_ptr(),
                       xf.shape[0], n, k, group_size, block, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"q4_linear: the kernel refused M={xf.shape[0]} N={n} K={k} (rc {rc})")
    return out.reshape(*x.shape[:-1], n)


# -- int4 as (16 + code) bf16 pairs on AVX512-BF16 + VBMI or AMX (gemm_int4_vbmi.c, gemm_int4_amx.c) --------------
def q4_pairs_fits(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                  block: int) -> bool:
    """:func:`q4_fits`, with K and the group a multiple of 32 and blocks of 32 or 64 rows."""
    return (block in (32, 64) and group_size % 32 == 0 and x.dim() > 0 and x.shape[-1] % 32 == 0
            and q4_fits(x, qweight, scales_and_zeros, group_size, block))


def q4_amx_linear(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                  block: int) -> torch.Tensor:
    """:func:`q4_linear` on the AMX tiles (:func:`q4_pairs_fits`, the tiles on): x's bf16 rows times 16 + each code
    as bf16 (exact), float32 sums per group folded as ``scale * sum x (16 + c) + (zero - 24 scale) * sum x`` (the same
    weight), one order per output whatever the batch, rounded once."""
    if not cpu_native.available() or cpu_native.amx_reason() \
            or not q4_pairs_fits(x, qweight, scales_and_zeros, group_size, block):
        why = cpu_native.amx_reason() or cpu_native.reasons()[0] or "on"
        raise ValueError(f"q4_amx_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(qweight.shape)}, groups of "
                         f"{group_size} and blocks of {block} do not fit, or no AMX ({why})")
    return _q4_paired("kw_q4amx", x, qweight, scales_and_zeros, group_size, block)


def q4_vec_linear(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                  block: int) -> torch.Tensor:
    """:func:`q4_amx_linear`'s product on the vector units (vdpbf16ps; :func:`q4_pairs_fits`, AVX512-BF16 and VBMI,
    tiles or not): the same (16 + code) bf16 pairs and fold, one order per output whatever the batch."""
    if not (cpu_native.available() and cpu_native.has_vbmi()
            and q4_pairs_fits(x, qweight, scales_and_zeros, group_size, block)):
        raise ValueError(f"q4_vec_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(qweight.shape)}, groups of "
                         f"{group_size} and blocks of {block} do not fit, or this CPU lacks AVX512-BF16 / VBMI")
    return _q4_paired("kw_q4vec", x, qweight, scales_and_zeros, group_size, block)


def _q4_paired(fn: str, x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
               block: int) -> torch.Tensor:
    lib = _lib(fn, matmuls=True)
    n, k = scales_and_zeros.shape[1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    out = torch.empty((x2.shape[0], n), dtype=torch.bfloat16)
    rc = getattr(lib, fn)(x2.data_ptr(), qweight.data_ptr(), scales_and_zeros.data_ptr(), out.data_ptr(),
                          x2.shape[0], n, k, group_size, block, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"{fn}: the kernel refused M={x2.shape[0]} N={n} K={k} (rc {rc})")
    return out.reshape(*x.shape[:-1], n)
