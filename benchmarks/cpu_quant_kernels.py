"""keepwarm's CPU weight-only matmuls against its bf16 one, per layer of the random 1B, interleaved.

    .venv/bin/python benchmarks/cpu_quant_kernels.py [--rows 1,8,32,256] [--rounds 11] [--threads 2]

One "layer" is the 1B's four matmuls (qkv [3072, 2048], o [2048, 2048], gate_up [11264, 2048], down [2048, 5632]),
three layers' weights per scheme so that each call reads its weight from memory, not from the last-level cache.
Each round times every candidate back to back; the figure is the median over rounds of each one's time divided by
bf16's in the same round (these VMs drift by tens of percent from minute to minute; a ratio taken within seconds
does not). Random codes: the kernels' work does not depend on the values. The candidates are what the CPU has:
with AVX2 only, bf16 ``bf16_linear``, int8 / fp8 ``q8_linear``, int4 ``q4_linear``; with AVX512-BF16, bf16 is
oneDNN's matmul on a weight packed as the arena packs it, int8 / fp8 ``int8_linear`` / ``fp8_linear`` on the vector
units (and on the AMX tiles where there are some), torch's own int8 and int4 ops, ``q4_vec_linear`` (VBMI) and
``q4_amx_linear`` (AMX). Run it from the repository root on a quiet machine; the C library is built on first use.
Figures: docs/quantization.md, "Throughput"."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from keepwarm.kernels import cpu_native, native_ops  # noqa: E402

SHAPES = [(3072, 2048), (2048, 2048), (11264, 2048), (2048, 5632)] * 3


def _weights() -> dict[str, list[tuple[torch.Tensor, ...]]]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, list[tuple[torch.Tensor, ...]]] = {"bf16": [], "int8": [], "fp8": [], "int4": []}
    for n, k in SHAPES:
        out["bf16"].append(((torch.randn(n, k, generator=g) * 0.02).bfloat16(),))
        scale = torch.rand(n, generator=g).bfloat16()
        out["int8"].append((torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), scale))
        out["fp8"].append(((torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn), scale.float()))
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
        out["int4"].append((torch._convert_weight_to_int4pack_for_cpu(codes, 2),
                            torch.rand(k // 128, n, 2, generator=g).bfloat16()))
    return out


def _runner(scheme: str, parts: list[tuple[torch.Tensor, ...]], xs: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for x, p in zip(xs, parts, strict=True):
            if scheme == "bf16":
                native_ops.bf16_linear(x, p[0])
            elif scheme == "int4":
                native_ops.q4_linear(x, p[0], p[1], 128, 32)
            else:
                native_ops.q8_linear(x, p[0], p[1])
    return run


def _avx512_runners(xs: list[torch.Tensor]) -> dict[str, Callable[[], None]]:
    """name -> one layer set's calls on an AVX512-BF16 CPU (weights built once, cached on the function)."""
    from keepwarm.formats.quant import cpu_int4_layout

    if not hasattr(_avx512_runners, "weights"):
        w = _weights()
        w["bf16"] = [(torch.ops.mkldnn._reorder_linear_weight(p[0], 32),) for p in w["bf16"]]
        _avx512_runners.weights = w  # type: ignore[attr-defined]
    w = _avx512_runners.weights  # type: ignore[attr-defined]
    block = int((cpu_int4_layout() or "int4_cpu_halves64")[-2:])
    amx = cpu_native.set_amx(True)

    def calls(fn: Callable[[torch.Tensor, tuple[torch.Tensor, ...]], object], scheme: str,
              tiles: bool | None = None) -> Callable[[], None]:
        def run() -> None:
            if tiles is not None:
                cpu_native.set_amx(tiles)
            for x, p in zip(xs, w[scheme], strict=True):
                fn(x, p)
        return run

    runs = {
        "bf16": calls(lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p[0], None, "none", [], ""), "bf16"),
        "int8-op": calls(lambda x, p: torch._weight_int8pack_mm(x, p[0], p[1]), "int8"),
        "int8-vec": calls(lambda x, p: native_ops.int8_linear(x, p[0], p[1]), "int8", False),
        "fp8-vec": calls(lambda x, p: native_ops.fp8_linear(x, p[0], p[1]), "fp8", False),
        "int4-op": calls(lambda x, p: torch._weight_int4pack_mm_for_cpu(x, p[0], 128, p[1]), "int4"),
    }
    if cpu_native.has_vbmi():
        runs["int4-vec"] = calls(lambda x, p: native_ops.q4_vec_linear(x, p[0], p[1], 128, block), "int4")
    if amx:
        runs["int8-amx"] = calls(lambda x, p: native_ops.int8_linear(x, p[0], p[1]), "int8", True)
        runs["fp8-amx"] = calls(lambda x, p: native_ops.fp8_linear(x, p[0], p[1]), "fp8", True)
        runs["int4-amx"] = calls(lambda x, p: native_ops.q4_amx_linear(x, p[0], p[1], 128, block), "int4", True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = {} if cpu_native.available() else _weights()
    layers = len(SHAPES) // 4
    for m in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(m, k).bfloat16() for _, k in SHAPES]
        if cpu_native.available():
            runs = _avx512_runners(xs)
        else:
            runs = {s: _runner(s, parts, xs) for s, parts in weights.items()}
        times: dict[str, list[float]] = {s: [] for s in runs}
        for _ in range(args.rounds):
            for s, run in runs.items():
                run()  # warm: the C build, the scratch, the pages of x
                t = time.perf_counter()
                run()
                times[s].append((time.perf_counter() - t) / layers * 1e3)
        ratios = {s: statistics.median(a / b for a, b in zip(times[s], times["bf16"], strict=True)) for s in runs}
        print(f"M={m}: " + "  ".join(f"{s} {statistics.median(times[s]):.2f} ms ({ratios[s]:.2f}x bf16)"
                                     for s in runs) + "  per layer, median")


if __name__ == "__main__":
    main()
