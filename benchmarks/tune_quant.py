"""Offline tile sweep for the quantized matmuls of `kernels/triton_quant.py`; writes `kernels/quant_tiles.json`.

    python benchmarks/tune_quant.py [--out kernels/quant_tiles.json] [--budget 90] [--smoke]

On one GPU, for each kind (int8, int4, fp8), each M of the tile table (1, 16, 64, 256) and each weight shape of an
8B Llama decode (qkv, o, gate_up, down, and the gpu-check row 14336x4096): every candidate tile (shape, split-K,
stages) is timed with CUDA events over weight copies that together exceed the L2 (read from HBM, as in a model),
median of 3 rounds. The fastest per shape is written, plus a "*" row per kind and M (the best geometric-mean
slowdown over the shapes) for shapes the table does not list; for fp8 also the smallest M from which W8A8
`torch._scaled_mm` beats the best weight-only tile on every shape (`fp8_scaled_mm_min_rows`); dense bf16 (cuBLAS)
times beside, for the ratios. Candidates compile first in parallel worker processes, then are timed here; a sweep
past its budget writes what it measured. `--smoke` runs it small on the CPU under the interpreter: its numbers
mean nothing."""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

# The shared timing helper beside this script (gpu_check.sh runs scripts with PYTHONSAFEPATH=1).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kw_timing import graph_timed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (14336, 4096)]
SMOKE_SHAPES = [(64, 128), (32, 256)]
MS = (1, 16, 64, 256)
KINDS = ("int8", "int4", "fp8")
L2_BYTES = 60 << 20


def candidates(kind: str, m: int) -> list[tuple[int, int, int, int, int, int]]:
    """(block_m, block_n, block_k, split_k, warps, stages) to try; int4 K tiles stay inside a 128-group."""
    bks = (64, 128) if kind == "int4" else (128, 256)
    out = []
    if m == 1:  # the GEMV kernel (block_m 1): float32 FMAs, no MMA padding
        for bn in (16, 32, 64):
            for bk in bks:
                for split in (1, 2, 4, 8):
                    out.append((1, bn, bk, split, 4, 3))
    if m <= 16:
        for bn in (32, 64, 128):
            for bk in bks:
                for split in (1, 2, 4, 8):
                    out.append((16, bn, bk, split, 4, 4))
    elif m <= 64:
        for bn in (64, 128):
            for bk in (bks if kind == "int4" else (64, 128)):
                for split in (1, 2):
                    out.append((64, bn, bk, split, 4, 3))
    else:
        out += [(128, 128, 64, 1, 8, 3), (64, 128, 64, 1, 4, 3), (128, 64, 128, 1, 4, 3)]
    return sorted(set(out))


def _weights(kind: str, n: int, k: int, device, copies: int):
    import torch

    from keepwarm.formats.quant import quantize
    from keepwarm.kernels.quant import QuantizedWeight

    g = torch.Generator(device=device).manual_seed(n * 7 + k)
    ws = []
    for _ in range(copies):
        w = torch.randn(n, k, device=device, generator=g) * 0.02
        ws.append(QuantizedWeight.from_parts(*quantize(w, kind, torch.bfloat16, "cuda")))
    return ws


def _us(device, fns: list, iters: int = 12) -> float:
    """Microseconds per call (benchmarks/timing.py: one CUDA graph, median of 3 replays)."""
    return graph_timed(device, fns, iters) * 1e6


def _compile_worker(args: tuple[list, bool]) -> int:
    """Compile (and run once, small) each (kind, tile) into Triton's cache; returns how many failed."""
    jobs, smoke = args
    import torch

    from keepwarm.kernels import triton_quant as tq

    device = torch.device("cuda" if not smoke else "cpu")
    failed = 0
    for kind, tile in jobs:
        try:
            # K = 2048: int4's scale stride (K / 128) divisible by 16, like the real shapes (Triton specializes it)
            w = _weights(kind, 256, 2048, device, 1)[0]
            x = torch.randn(max(1, tile[0]), 2048, device=device, dtype=torch.bfloat16)
            tq.launch(x, w, None, getattr(tq, f"KIND_{kind.upper()}"), tq.Tile(*tile))
        except Exception:
            failed += 1
    return failed


def precompile(smoke: bool, workers: int) -> int:
    # One job per compiled variant: split-K only changes the grid and the SPLIT constexpr (1 or more slices).
    variants = {(kind, c[:3] + (min(c[3], 2),) + c[4:]) for kind in KINDS for m in MS for c in candidates(kind, m)}
    jobs = sorted(variants)
    if smoke or workers <= 1:
        return _compile_worker((jobs, smoke))
    chunks = [(jobs[i::workers], smoke) for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        return sum(pool.map(_compile_worker, chunks))


def sweep(a: argparse.Namespace) -> dict:
    import torch
    import triton

    from keepwarm.kernels import triton_quant as tq

    t_start = time.monotonic()
    device = torch.device("cuda" if not a.smoke else "cpu")
    shapes = SMOKE_SHAPES if a.smoke else SHAPES
    ms = (1, 16) if a.smoke else MS
    # The interpreter compiles nothing: a smoke run only checks the script, on two candidates per M.
    failed = 0 if a.smoke else precompile(False, min(12, os.cpu_count() or 4))
    compile_s = time.monotonic() - t_start
    tiles: dict = {}
    timings: dict = {}
    fp8_rows: dict[int, bool] = {}  # M -> scaled_mm beat the best triton tile on every shape
    stopped = None
    for kind in KINDS:
        kid = getattr(tq, f"KIND_{kind.upper()}")
        for n, k in shapes:
            if stopped:
                break
            one = n * k // (2 if kind == "int4" else 1)
            copies = 1 if a.smoke else max(2, math.ceil(3 * L2_BYTES / one))
            ws = _weights(kind, n, k, device, copies)
            dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
            for m in ms:
                if time.monotonic() - t_start > a.budget:
                    stopped = f"budget of {a.budget:.0f}s reached at {kind} {n}x{k} M={m}"
                    break
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                dense_fns = [lambda d=d, x=x: torch.nn.functional.linear(x, d) for d in dense]
                row: dict = {"bf16_us": _us(device, dense_fns)}
                best = None
                for c in candidates(kind, m)[:2] if a.smoke else candidates(kind, m):
                    t = tq.Tile(*c)
                    try:
                        us = _us(device, [lambda w=w, t=t, x=x, kid=kid: tq.launch(x, w, None, kid, t) for w in ws])
                    except Exception as e:  # a tile that does not compile or run is skipped, and counted
                        row.setdefault("failed", []).append(f"{c}: {type(e).__name__}")
                        continue
                    row.setdefault("all", {})[",".join(map(str, c))] = round(us, 2)
                    if best is None or us < best[0]:
                        best = (us, c)
                if best is None:
                    continue
                row["best_us"], row["best"] = round(best[0], 2), list(best[1])
                if kind == "fp8" and device.type == "cuda":
                    row["scaled_mm_us"] = _us(device, [lambda w=w, x=x: tq.fp8_scaled_mm(x, w) for w in ws])
                    fp8_rows[m] = fp8_rows.get(m, True) and row["scaled_mm_us"] < row["best_us"]
                timings.setdefault(kind, {}).setdefault(str(m), {})[f"{n}x{k}"] = row
                tiles.setdefault(kind, {}).setdefault(str(tq.m_bucket(m)), {})[f"{n}x{k}"] = list(best[1])
            del ws, dense
    # A default row per kind and M: the tile with the best geometric-mean slowdown over the shapes it saw.
    for kind, per_m in timings.items():
        for m, per_shape in per_m.items():
            common = set.intersection(*(set(r.get("all", {})) for r in per_shape.values()))
            if not common:
                continue
            score = {c: sum(math.log(r["all"][c] / r["best_us"]) for r in per_shape.values()) for c in common}
            tiles[kind][str(tq.m_bucket(int(m)))]["*"] = [int(v) for v in min(score, key=score.get).split(",")]
    crossover = next((m for m in sorted(fp8_rows) if all(fp8_rows[mm] for mm in fp8_rows if mm >= m)), None)
    return {
        "comment": "Measured by benchmarks/tune_quant.py; do not edit by hand. tiles[kind][M bucket]['NxK'] = "
                   "[block_m, block_n, block_k, split_k, warps, stages]; '*' = the default for shapes not listed.",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (smoke run)",
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "torch": torch.__version__, "triton": triton.__version__,
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": round(time.monotonic() - t_start, 1), "compile_seconds": round(compile_s, 1),
        "compile_failures": failed, "stopped": stopped,
        "fp8_scaled_mm_min_rows": crossover if crossover is not None else None,
        "tiles": tiles, "timings_us": timings,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "kernels" / "quant_tiles.json"))
    ap.add_argument("--budget", type=float, default=90.0, help="seconds, compiling included")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: no GPU, the interpreter
    import torch

    if not a.smoke and not torch.cuda.is_available():
        print("tune_quant needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    res = sweep(a)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    for kind, per_m in res["timings_us"].items():
        for m, per_shape in per_m.items():
            for shape, r in per_shape.items():
                print(f"{kind:5s} M={m:>3s} {shape:>11s}: best {r['best_us']:8.1f} us {r['best']} "
                      f"(bf16 {r['bf16_us']:.1f} us, x{r['best_us'] / r['bf16_us']:.2f})"
                      + (f" scaled_mm {r['scaled_mm_us']:.1f} us" if "scaled_mm_us" in r else ""))
    print(f"tune_quant: {res['seconds']}s (compile {res['compile_seconds']}s, {res['compile_failures']} failed), "
          f"fp8 scaled_mm from M={res['fp8_scaled_mm_min_rows']}, stopped: {res['stopped']}; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
