"""Triton weight-only quantized matmuls: ``y = x @ dequant(W)^T + b`` for int8 (W8A16), int4 (W4A16) and fp8.

Rules:
- The CUDA arena's canonical layouts (`formats/quant.py`) are the kernel's layouts: no re-layout at preload.
- The codes go to the MMA exactly as small integers and the scales are applied to the float32 partial product
  (per channel after the loop, per group once per K tile), so there is no per-element float math; the result
  differs from the reference (which rounds each dequantized weight first) by less than that rounding.
- Split-K for small M sums its slices in a fixed order: CUDA-graph replays and eager runs give the same bits.
- Tiles come from the committed `kernels/quant_tiles.json` (benchmarks/tune_quant.py); nothing is autotuned at
  serve time; a missing shape takes its row's default, then `_default_tile`.
- FP8 W8A8 (`torch._scaled_mm`, Hopper) changes the numbers, so it is taken only where measured to win
  (`fp8_min_rows`); ``KEEPWARM_FP8_MATMUL=auto|triton|scaled_mm`` overrides it (read per call, for A/B runs).
The design in full ("swap AB", int4's two half-K dots, split-K): docs/kernels.md, "Quantized matmuls".
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from keepwarm.formats.quant import LAYOUT_INT4_CANONICAL

from . import triton_common as tc
from .quant import linear_reference

logger = logging.getLogger("keepwarm.kernels")

KIND_INT8, KIND_FP8, KIND_INT4 = 0, 1, 2
KIND_NAMES = {KIND_INT8: "int8", KIND_FP8: "fp8", KIND_INT4: "int4"}
FP8_MATMUL_ENV = "KEEPWARM_FP8_MATMUL"
FP8_SCALED_MM_MIN_ROWS = 128  # used when the tile table has no measured crossover
TILES_FILE = Path(__file__).with_name("quant_tiles.json")
# M ranges of the tile table: a row applies to M up to its bound (the last one to any larger M too).
M_BUCKETS = (1, 16, 64, 256)
_FP8_MAX = 448.0
_LOGGED: set[str] = set()


# M is not specialized (Triton would compile M == 1 apart): decode batches of 1..16 share one compiled kernel.
@triton.jit(do_not_specialize=["M"])
def _wq_linear_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, k_per_split,
    stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg, stride_ym, stride_yn,
    KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    OUT_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, NATIVE_FP8: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    q_rows = q_ptr + rn.to(tl.int64)[:, None] * stride_qn
    x_cols = x_ptr + rm[None, :] * stride_xm
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T tile: rows are output channels
    if KIND == 2:
        HALF: tl.constexpr = BLOCK_K // 2
        rb = tl.arange(0, HALF)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ke = k0 + 2 * rb  # the even k of each byte; its odd partner is ke + 1
            e_ok = ke < K
            packed = tl.load(q_rows + (k0 // 2 + rb)[None, :] * stride_qk, mask=n_ok[:, None] & e_ok[None, :],
                             other=0)
            w_lo = ((packed & 15).to(tl.int32) - 8).to(DOT_DTYPE)  # exact: small integers
            w_hi = ((packed >> 4).to(tl.int32) - 8).to(DOT_DTYPE)
            # x's tile loaded contiguously (16-byte loads), then split into its even and odd columns in registers:
            # two stride-2 gathers cost more load instructions than the weight tile itself.
            kx = k0 + tl.arange(0, BLOCK_K)
            xr = tl.load(x_ptr + rm[:, None] * stride_xm + kx[None, :] * stride_xk,
                         mask=m_ok[:, None] & (kx < K)[None, :], other=0.0)
            x_e, x_o = tl.split(tl.reshape(xr, [BLOCK_M, HALF, 2]))
            x_e = tl.trans(x_e).to(DOT_DTYPE)
            x_o = tl.trans(x_o).to(DOT_DTYPE)
            part = tl.dot(w_lo, x_e, input_precision=PRECISION)
            part = tl.dot(w_hi, x_o, part, input_precision=PRECISION)
            # sum_k x_k per column, broadcast over the rows, by the tensor cores (idle at decode anyway): a
            # cross-warp reduction here, once per K tile, cost more than the whole weight load.
            ones = tl.full([BLOCK_N, HALF], 1.0, DOT_DTYPE)
            xz = tl.dot(ones, x_e, input_precision=PRECISION)
            xz = tl.dot(ones, x_o, xz, input_precision=PRECISION)
            g = k0 // GROUP_SIZE  # BLOCK_K divides GROUP_SIZE: the whole tile is in group g
            sc = tl.load(s_ptr + rn * stride_sn + g * stride_sg, mask=n_ok, other=0.0).to(tl.float32)
            zr = tl.load(z_ptr + rn * stride_zn + g * stride_zg, mask=n_ok, other=0.0).to(tl.float32)
            acc += part * sc[:, None] + zr[:, None] * xz
    else:
        rk = tl.arange(0, BLOCK_K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            raw = tl.load(q_rows + kk[None, :] * stride_qk, mask=n_ok[:, None] & k_ok[None, :], other=0)
            if KIND == 1:
                if NATIVE_FP8:  # the hardware's e4m3 conversion (sm_89+)
                    w = raw.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
                else:  # integer decode: older archs and the interpreter
                    w = tc.fp8_to_f32(raw, 1).to(DOT_DTYPE)
            else:
                w = raw.to(DOT_DTYPE)  # int8 codes are exact in bfloat16 / float16
            xt = tl.load(x_cols + kk[:, None] * stride_xk, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            acc = tl.dot(w, xt.to(DOT_DTYPE), acc, input_precision=PRECISION)
        # Per output channel scale (a per-tensor scale comes with stride 0).
        acc = acc * tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out_mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT:  # float32 partial into workspace [SPLIT_K, M, N]; _splitk_reduce_kernel finishes
        ws = ws_ptr + pid_k.to(tl.int64) * M * N + rm[None, :].to(tl.int64) * N + rn[:, None]
        tl.store(ws, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        y = y_ptr + rm[None, :].to(tl.int64) * stride_ym + rn[:, None] * stride_yn
        tl.store(y, tc.to_dtype(acc, OUT_DTYPE), mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _wq_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, k_per_split,
    stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg, stride_ym, stride_yn,
    KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr, NATIVE_FP8: tl.constexpr,
):
    """One row of x per program (grid axis 1), float32 FMAs instead of an MMA padded to 16 rows: for M = 1 the
    work per weight byte is a handful of integer/float ops, with the products summed per lane across the whole K
    slice and reduced across lanes once at the end. Codes become floats exactly without the (quarter-rate)
    int-to-float conversion: a code OR-ed into the mantissa of 2**23 is 2**23 + code."""
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    q_rows = q_ptr + rn.to(tl.int64)[:, None] * stride_qn
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if KIND == 2:
        HALF: tl.constexpr = BLOCK_K // 2
        rb = tl.arange(0, HALF)
        acc2 = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ke = k0 + 2 * rb
            e_ok = ke < K
            packed = tl.load(q_rows + (k0 // 2 + rb)[None, :] * stride_qk, mask=n_ok[:, None] & e_ok[None, :],
                             other=0).to(tl.int32)
            w_lo = ((packed & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # q - 8, exactly
            w_hi = (((packed >> 4) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            kx = k0 + tl.arange(0, BLOCK_K)  # contiguous, then split in registers (see the MMA kernel)
            x_e, x_o = tl.split(tl.reshape(tl.load(x_row + kx * stride_xk, mask=kx < K, other=0.0).to(tl.float32),
                                           [HALF, 2]))
            g = k0 // GROUP_SIZE  # BLOCK_K divides GROUP_SIZE: the whole tile is in group g
            sc = tl.load(s_ptr + rn * stride_sn + g * stride_sg, mask=n_ok, other=0.0).to(tl.float32)
            zr = tl.load(z_ptr + rn * stride_zn + g * stride_zg, mask=n_ok, other=0.0).to(tl.float32)
            t = w_lo * x_e[None, :] + w_hi * x_o[None, :]
            acc2 += sc[:, None] * t + zr[:, None] * (x_e + x_o)[None, :]
        acc = tl.sum(acc2, 1)
    else:
        rk = tl.arange(0, BLOCK_K)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            raw = tl.load(q_rows + kk[None, :] * stride_qk, mask=n_ok[:, None] & k_ok[None, :], other=0)
            if KIND == 1:
                if NATIVE_FP8:  # noqa: SIM108 (a static branch on a constexpr, kept as a plain if for Triton)
                    w = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                else:
                    w = tc.fp8_to_f32(raw, 1)
            else:  # int8: q + 128 in [0, 255], into the mantissa of 2**23
                w = ((raw.to(tl.int32) + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            xv = tl.load(x_row + kk * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
            acc2 += w * xv[None, :]
        acc = tl.sum(acc2, 1) * tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
    if SPLIT:
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + row.to(tl.int64) * N + rn, acc, mask=n_ok)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row.to(tl.int64) * stride_ym + rn * stride_yn, tc.to_dtype(acc, OUT_DTYPE), mask=n_ok)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, b_ptr, y_ptr, M, N, splits, stride_ym, stride_yn,
                          HAS_BIAS: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):  # a fixed order: deterministic
        acc += tl.load(ws_ptr + s * M * N + offs, mask=ok, other=0.0)
    m = offs // N
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + n * stride_yn, tc.to_dtype(acc, OUT_DTYPE), mask=ok)


# ---------------------------------------------------------------------------------------------- tiles
@dataclass(frozen=True)
class Tile:
    """One launch configuration: tile shape, K slices (split-K), warps and software-pipelining stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    warps: int = 4
    stages: int = 3

    def as_list(self) -> list[int]:
        return [self.block_m, self.block_n, self.block_k, self.split_k, self.warps, self.stages]


def m_bucket(m: int) -> int:
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


@functools.cache
def load_table(path: str = str(TILES_FILE)) -> dict:
    """The committed tile table ({} when absent or unreadable: the heuristic then decides, and says so once)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        logger.warning("quantized matmul tile table %s unreadable (%s): built-in tiles", path, e)
        return {}


def table_arch(table: dict) -> int | None:
    """The compute capability major the table was measured on ("capability", or Hopper for an H100/H200 name)."""
    cap = table.get("capability")
    if cap:
        return int(cap[0])
    return 9 if re.search(r"\bH(100|200)\b", str(table.get("device", ""))) else None


def _device_arch(device: torch.device) -> int | None:
    if device.type == "cuda":
        return tc.capability(device)[0]
    if tc.INTERPRETED:
        return None  # the interpreter runs any tile: the table's, to test the same rows
    arch = triton.runtime.driver.active.get_current_target().arch  # the compile check's stand-in target
    return arch // 10 if isinstance(arch, int) else None


def _table_tile(kind: int, m: int, n: int, k: int, device: torch.device) -> Tile | None:
    """The table's row, if the table was measured on this device's architecture (tiles tuned on an H200 can
    spill registers on an A100)."""
    table = load_table()
    arch = _device_arch(device)
    if arch is not None and table_arch(table) != arch:
        return None
    rows = table.get("tiles", {}).get(KIND_NAMES[kind], {}).get(str(m_bucket(m)), {})
    row = rows.get(f"{n}x{k}") or rows.get("*")
    return Tile(*row) if row else None


def _default_tile(kind: int, m: int, n: int, k: int, sms: int) -> Tile:
    """Before (or beside) a measured table: swap-AB tiles of 16 MMA columns for decode, split-K up to ~2 programs
    per SM while every slice keeps at least 4 K tiles."""
    if m <= 16:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
    elif kind == KIND_INT4:  # int4's extra operands (two half-K dots, scale/zero epilogue): K tiles of 64, or
        bm, bn, bk, warps, stages = (64, 64, 64, 4, 3) if m <= 64 else (64, 128, 64, 8, 3)  # sm_80 spills
    elif m <= 64:
        bm, bn, bk, warps, stages = 64, 64, 128, 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    split = 1
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    while sms and tiles * split * 2 <= 2 * sms and k // (bk * split * 2) >= 4 and split < 16:
        split *= 2
    return Tile(bm, bn, bk, split, warps, stages)


def choose_tile(kind: int, m: int, n: int, k: int, group_size: int, fp32: bool, device: torch.device) -> Tile:
    """The launch configuration for this call; legalised for the kind (int4 K tiles inside one group)."""
    if fp32:  # true float32 products: Triton's FMA dot, whose operands live in registers; small, no spills
        t = Tile(16, 32, 32, 1, 4, 3) if m <= 16 else Tile(32, 64, 32, 1, 4, 3)
    else:
        t = _table_tile(kind, m, n, k, device) or _default_tile(kind, m, n, k, tc.sm_count(device))
    if t.block_m == 1 and m > 1:  # a GEMV row of the table is for M = 1; more rows would each re-read W
        t = Tile(16, t.block_n, t.block_k, t.split_k, t.warps, t.stages)
    bk = t.block_k
    if kind == KIND_INT4:
        bk = max(32, min(bk, group_size))  # two half-K dots of >= 16
        while group_size % bk:
            bk //= 2
    if t.block_m == 1:
        bk = max(bk, 32)
    return Tile(t.block_m, t.block_n, bk, max(1, t.split_k), t.warps, t.stages)


# ---------------------------------------------------------------------------------------------- launch
def _operands(w, kind: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int], tuple[int, int]]:
    """(qweight, scales, zeros, scale strides (n, g), zero strides (n, g)); a per-tensor scale gets stride 0."""
    p = w.parts
    if kind == KIND_INT4:
        q, s, z = p["qweight"], p["scales"], p["zeros"]
        return q, s, z, (s.stride(0), s.stride(1)), (z.stride(0), z.stride(1))
    if kind == KIND_INT8:
        q, s = p["qweight"], p["scales"]
    else:
        q, s = p["qweight"].view(torch.uint8), p["scale"]  # bits: decoded in the kernel
    sn = 0 if s.numel() == 1 else s.stride(0)
    return q, s, s, (sn, 0), (sn, 0)


def launch(x: torch.Tensor, w, bias: torch.Tensor | None, kind: int, tile: Tile | None = None) -> torch.Tensor:
    """y = x @ dequant(w)^T + bias with `tile` (default: `choose_tile`); tests and the tuner pass their own."""
    n, k = w.meta.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    gs = w.meta.group_size or 0
    q, s, z, s_strides, z_strides = _operands(w, kind)
    dot = tc.dot_dtype(x.dtype)
    t = tile or choose_tile(kind, m, n, k, gs, x.dtype == torch.float32, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, t.split_k), t.block_k) * t.block_k
    splits = triton.cdiv(k, k_per_split)
    ws = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    out_dtype = tc.tl_dtype(x.dtype)
    args = (x2, q, s, z, bias if bias is not None else y, y, ws, m, n, k, k_per_split,
            *x2.stride(), *q.stride(), *s_strides, *z_strides, *y.stride())
    common = dict(KIND=kind, GROUP_SIZE=max(gs, 1), HAS_BIAS=bias is not None, SPLIT=splits > 1,
                  BLOCK_N=t.block_n, BLOCK_K=t.block_k, OUT_DTYPE=out_dtype, NATIVE_FP8=tc.native_fp8(x.device),
                  num_warps=t.warps, num_stages=t.stages)
    if t.block_m == 1:  # GEMV: one program column per row of x
        _wq_gemv_kernel[(triton.cdiv(n, t.block_n), m, splits)](*args, **common)
    else:
        _wq_linear_kernel[(triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m), splits)](
            *args, BLOCK_M=t.block_m, DOT_DTYPE=dot, PRECISION=tc.dot_precision(dot), **common)
    if splits > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            ws, bias if bias is not None else y, y, m, n, splits, *y.stride(), HAS_BIAS=bias is not None,
            OUT_DTYPE=out_dtype, BLOCK=block, num_warps=4,
        )
    return y.reshape(*x.shape[:-1], n)


def linear_int8(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    return launch(x, w, bias, KIND_INT8)


def linear_int4(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    if w.meta.layout != LAYOUT_INT4_CANONICAL:
        return linear_reference(x, w, bias)
    return launch(x, w, bias, KIND_INT4)


# ---------------------------------------------------------------------------------------------- fp8
def fp8_min_rows(n: int | None = None, k: int | None = None) -> int:
    """The M from which W8A8 `_scaled_mm` beats the weight-only kernel: for a shape the table timed, the smallest
    timed M from which it won at every larger timed M (twice the largest if it never won); else the table's
    all-shapes crossover; else 128."""
    table = load_table()
    if n is not None:
        wins = {int(m): r["scaled_mm_us"] < r["best_us"]
                for m, rows in table.get("timings_us", {}).get("fp8", {}).items()
                if (r := rows.get(f"{n}x{k}")) and "scaled_mm_us" in r and "best_us" in r}
        if wins:
            ms = sorted(wins)
            return next((m for m in ms if all(wins[x] for x in ms if x >= m)), 2 * ms[-1])
    return int(table.get("fp8_scaled_mm_min_rows") or FP8_SCALED_MM_MIN_ROWS)


def fp8_path(x: torch.Tensor, w, capability: tuple[int, int] | None = None) -> str:
    """"scaled_mm" or "triton" for this call (see the module docstring); `capability` is for tests."""
    mode = os.environ.get(FP8_MATMUL_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "triton", "scaled_mm"):
        raise ValueError(f"{FP8_MATMUL_ENV}={mode!r} is not one of auto, triton, scaled_mm")
    n, k = w.meta.shape
    usable = (x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0 and hasattr(torch, "_scaled_mm")
              and (capability is not None or x.device.type == "cuda"))
    if mode == "triton" or not usable:
        return "triton"
    if mode == "scaled_mm":
        return "scaled_mm"
    cap = capability or torch.cuda.get_device_capability(x.device)
    rows = x.numel() // max(k, 1)
    return "scaled_mm" if cap[0] == 9 and rows >= fp8_min_rows(n, k) else "triton"


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr):
    """One row of x per program: scale = max(amax / 448, 1e-12), codes = e4m3(clamp(x / scale)), bit for bit
    what the torch expression in `quantize_rows` gives (true divisions, round to nearest even)."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), 448.0), 1e-12)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)
        tl.store(q_ptr + row * stride_qm + k, tc.f32_to_fp8(v, 1), mask=k < K)
    tl.store(s_ptr + row, scale)


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 codes and float32 scales [M, 1] of a 2-D x: one Triton launch on CUDA (the torch expression
    took ~6 kernels, which cost more than a decode-sized matmul), the torch expression elsewhere."""
    m, k = x2.shape
    if x2.device.type != "cuda" and not tc.INTERPRETED:
        xf = x2.float()
        scale = (xf.abs().amax(dim=1, keepdim=True) / _FP8_MAX).clamp_(min=1e-12)  # an all-zero row -> 0s
        return (xf / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn), scale
    codes = torch.empty(m, k, dtype=torch.uint8, device=x2.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x2.device)
    if m:
        _quant_rows_kernel[(m,)](x2, codes, scale, k, x2.stride(0), codes.stride(0), BLOCK=1024, num_warps=4)
    return codes.view(torch.float8_e4m3fn), scale


def fp8_scaled_mm(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 through torch._scaled_mm: x quantized to e4m3 per row (scale = row amax / 448), rowwise scales."""
    n, k = w.meta.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    xq, x_scale = quantize_rows(x2)
    # Rowwise scaling wants scale_b as [1, N] float32: a per-channel scale as is, a per-tensor one broadcast
    # (no host sync either way).
    scale = w.parts["scale"].float()
    w_scale = scale.reshape(1, n) if scale.numel() == n else scale.reshape(1, 1).expand(1, n).contiguous()
    y = torch._scaled_mm(xq, w.parts["qweight"].t(), scale_a=x_scale, scale_b=w_scale,
                         bias=bias.to(torch.bfloat16) if bias is not None else None, out_dtype=torch.bfloat16)
    return y.reshape(*x.shape[:-1], n)


def linear_fp8(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    path = fp8_path(x, w)
    if path not in _LOGGED:
        _LOGGED.add(path)
        logger.info("linear fp8: %s (%s)", "torch._scaled_mm, per-token activation scales" if path == "scaled_mm"
                    else "triton weight-only kernel", str(x.dtype).removeprefix("torch."))
    if path == "scaled_mm":
        return fp8_scaled_mm(x, w, bias)
    return launch(x, w, bias, KIND_FP8)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dense weights stay on cuBLAS (F.linear): a hand-written Triton GEMM is not expected to beat it. Registered
    so that KEEPWARM_KERNELS=triton can run a whole model."""
    return F.linear(x, weight, bias)


IMPLS = {"linear": linear, "linear_int8": linear_int8, "linear_int4": linear_int4, "linear_fp8": linear_fp8}
