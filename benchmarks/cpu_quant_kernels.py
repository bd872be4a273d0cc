"""keepwarm's CPU weight-only matmuls against its bf16 one, per layer of the random 1B, interleaved.

    .venv/bin/python benchmarks/cpu_quant_kernels.py [--rows 1,8,32,256] [--rounds 11] [--threads 2] [--shapes smollm2]

One "layer" is the 1B's four matmuls (qkv [3072, 2048], o [2048, 2048], gate_up [11264, 2048], down [2048, 5632]),
three layers' weights per scheme so that each call reads its weight from memory; ``--shapes smollm2``: SmolLM2's
[1536, 576], [576, 1536] and lm_head [49152, 576] one at a time (copies up to 64 MB). Each round times every
candidate back to back; the figure is the median over rounds of each one's time divided by bf16's in the same round
(these VMs drift by tens of percent from minute to minute). Random codes. The candidates are what the CPU has: with
AVX2 only, bf16 ``bf16_linear``, int8 / fp8 ``q8_linear``, int4 ``q4_linear``; with AVX512-BF16, bf16 is oneDNN's
packed matmul, int8 / fp8 ``int8_linear`` / ``fp8_linear`` (vector units, AMX tiles), torch's int8 / int4 ops,
``q4_vec_linear`` (VBMI), ``q4_amx_linear`` (AMX). int8_group (GGUF Q8_0 / K-quants, groups of 32): the reference
(``int8g-ref``), ``q8g_linear`` (AVX2), with AVX512-BF16 ``q8g_avx512_linear`` and ``int8g-wide`` (the bf16 weight
made in C, then oneDNN). Run it from the repo root on a quiet machine. Figures: docs/quantization.md, "Throughput";
int8_group: docs/kernels.md."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from keepwarm.formats.quant import QuantMeta  # noqa: E402
from keepwarm.kernels import cpu_native, native_ops  # noqa: E402
from keepwarm.kernels.quant import QuantizedWeight, linear_reference  # noqa: E402

SHAPES = [(3072, 2048), (2048, 2048), (11264, 2048), (2048, 5632)] * 3
SMOLLM2 = [(1536, 576), (576, 1536), (49152, 576)]
GS = 32  # int8_group's columns per scale (Q8_0, Q5_K, Q4_K)


def _weights(shapes: list[tuple[int, int]]) -> dict[str, list[tuple[torch.Tensor, ...]]]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, list[tuple[torch.Tensor, ...]]] = {"bf16": [], "int8": [], "fp8": [], "int4": [], "int8g": []}
    for n, k in shapes:
        out["bf16"].append(((torch.randn(n, k, generator=g) * 0.02).bfloat16(),))
        scale = torch.rand(n, generator=g).bfloat16()
        out["int8"].append((torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), scale))
        out["fp8"].append(((torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn), scale.float()))
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
        out["int4"].append((torch._convert_weight_to_int4pack_for_cpu(codes, 2),
                            torch.rand(k // _gs4(k), n, 2, generator=g).bfloat16()))
        out["int8g"].append((torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
                             (torch.rand(n, k // GS, generator=g) * 0.02).bfloat16(),
                             (torch.randn(n, k // GS, generator=g) * 0.01).bfloat16()))
    return out


def _gs4(k: int) -> int:
    """int4's group: 128, or 64 where K is no multiple of 128 (SmolLM2's 576)."""
    return 128 if k % 128 == 0 else 64


def _q4(fn: Callable[..., object], block: int = 0) -> Callable[[torch.Tensor, tuple[torch.Tensor, ...]], object]:
    """an int4 call (x, packed, scales_and_zeros, group[, block]) with the group K asks for"""
    if block:
        return lambda x, p: fn(x, p[0], p[1], _gs4(x.shape[-1]), block)
    return lambda x, p: fn(x, p[0], _gs4(x.shape[-1]), p[1])


def _int8g_ref(x: torch.Tensor, p: tuple[torch.Tensor, ...]) -> None:
    n, k = p[0].shape
    linear_reference(x, QuantizedWeight(QuantMeta("int8_group", "int8_group", GS, (n, k)),
                                        {"qweight": p[0], "scales": p[1], "zeros": p[2]}))


def _calls(w: dict[str, list[tuple[torch.Tensor, ...]]], xs: list[torch.Tensor],
           fn: Callable[[torch.Tensor, tuple[torch.Tensor, ...]], object], scheme: str,
           tiles: bool | None = None) -> Callable[[], None]:
    def run() -> None:
        if tiles is not None:
            cpu_native.set_amx(tiles)
        for x, p in zip(xs, w[scheme], strict=True):
            fn(x, p)
    return run


def _avx2_runners(w: dict[str, list[tuple[torch.Tensor, ...]]], xs: list[torch.Tensor]
                  ) -> dict[str, Callable[[], None]]:
    """name -> one layer set's calls on a CPU without AVX512-BF16."""
    return {
        "bf16": _calls(w, xs, lambda x, p: native_ops.bf16_linear(x, p[0]), "bf16"),
        "int8": _calls(w, xs, lambda x, p: native_ops.q8_linear(x, p[0], p[1]), "int8"),
        "fp8": _calls(w, xs, lambda x, p: native_ops.q8_linear(x, p[0], p[1]), "fp8"),
        "int4": _calls(w, xs, _q4(native_ops.q4_linear, 32), "int4"),
        "int8g-ref": _calls(w, xs, _int8g_ref, "int8g"),
        "int8g-avx2": _calls(w, xs, lambda x, p: native_ops.q8g_linear(x, *p, GS), "int8g"),
    }


def _avx512_runners(w: dict[str, list[tuple[torch.Tensor, ...]]], xs: list[torch.Tensor]
                    ) -> dict[str, Callable[[], None]]:
    """name -> one layer set's calls on an AVX512-BF16 CPU (w["bf16"] packed as the arena packs it)."""
    from keepwarm.formats.quant import cpu_int4_layout

    block = int((cpu_int4_layout() or "int4_cpu_halves64")[-2:])
    amx = cpu_native.set_amx(True)
    runs = {
        "bf16": _calls(w, xs, lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p[0], None, "none", [], ""), "bf16"),
        "int8-op": _calls(w, xs, lambda x, p: torch._weight_int8pack_mm(x, p[0], p[1]), "int8"),
        "int8-vec": _calls(w, xs, lambda x, p: native_ops.int8_linear(x, p[0], p[1]), "int8", False),
        "fp8-vec": _calls(w, xs, lambda x, p: native_ops.fp8_linear(x, p[0], p[1]), "fp8", False),
        "int4-op": _calls(w, xs, _q4(torch._weight_int4pack_mm_for_cpu), "int4"),
        "int8g-ref": _calls(w, xs, _int8g_ref, "int8g"),
        "int8g-avx2": _calls(w, xs, lambda x, p: native_ops.q8g_linear(x, *p, GS), "int8g"),
        "int8g-vec": _calls(w, xs, lambda x, p: native_ops.q8g_avx512_linear(x, *p, GS), "int8g"),
        "int8g-wide": _calls(w, xs, lambda x, p: F.linear(x, native_ops.q8g_to_bf16(*p, GS)), "int8g"),
    }
    if cpu_native.has_vbmi():
        runs["int4-vec"] = _calls(w, xs, _q4(native_ops.q4_vec_linear, block), "int4")
    if amx:
        runs["int8-amx"] = _calls(w, xs, lambda x, p: native_ops.int8_linear(x, p[0], p[1]), "int8", True)
        runs["fp8-amx"] = _calls(w, xs, lambda x, p: native_ops.fp8_linear(x, p[0], p[1]), "fp8", True)
        runs["int4-amx"] = _calls(w, xs, _q4(native_ops.q4_amx_linear, block), "int4", True)
    return runs


def _sets(which: str) -> list[tuple[str, list[tuple[int, int]], int]]:
    """(label, shapes, calls per figure): the 1B's three layers, or each SmolLM2 shape with copies up to 64 MB."""
    if which == "1b":
        return [("per layer", SHAPES, len(SHAPES) // 4)]
    return [(f"[{n}, {k}]", [(n, k)] * max(1, (64 << 20) // (n * k)), max(1, (64 << 20) // (n * k)))
            for n, k in SMOLLM2]


def _time(label: str, m: int, shapes: list[tuple[int, int]], per: int, weights: dict[str, list[tuple[torch.Tensor,
          ...]]], rounds: int) -> None:
    xs = [torch.randn(m, k).bfloat16() for _, k in shapes]
    runs = _avx512_runners(weights, xs) if cpu_native.available() else _avx2_runners(weights, xs)
    times: dict[str, list[float]] = {s: [] for s in runs}
    for _ in range(rounds):
        for s, run in runs.items():
            run()  # warm: the C build, the scratch, the pages of x
            t = time.perf_counter()
            run()
            times[s].append((time.perf_counter() - t) / per * 1e3)
    ratios = {s: statistics.median(a / b for a, b in zip(times[s], times["bf16"], strict=True)) for s in runs}
    print(f"M={m} {label}: " + "  ".join(f"{s} {statistics.median(times[s]):.3f} ms ({ratios[s]:.2f}x bf16)"
                                         for s in runs) + "  median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", choices=("1b", "smollm2"), default="1b")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for label, shapes, per in _sets(args.shapes):
        weights = _weights(shapes)
        if cpu_native.available():
            weights["bf16"] = [(torch.ops.mkldnn._reorder_linear_weight(p[0], 32),) for p in weights["bf16"]]
        for m in (int(r) for r in args.rows.split(",")):
            _time(label, m, shapes, per, weights, args.rounds)


if __name__ == "__main__":
    main()
