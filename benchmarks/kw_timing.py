"""Timing of GPU kernels for the benchmark scripts (gpu_check.py, tune_quant.py), shared so both time alike.

A decode step replays CUDA graphs, so a kernel is timed the same way: the calls are captured in one graph and its
replays timed with CUDA events; an eager loop would time Python's launch overhead (~30 us) instead of a ~10 us
kernel. `fns` holds one call per input copy, cycled through, so that weights larger together than the L2 come from
HBM. Off a GPU (smoke runs: figures meaningless) a plain loop.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def graph_timed(device: Any, fns: list[Callable[[], Any]], iters: int = 20) -> float:
    """Median, over 3 replays, of the mean seconds per call of `iters` calls cycling through `fns`."""
    import torch

    for f in fns:
        f()
    rounds = []
    if device.type != "cuda":
        for _ in range(3):
            t0 = time.perf_counter()
            for i in range(iters):
                fns[i % len(fns)]()
            rounds.append((time.perf_counter() - t0) / iters)
        return statistics.median(rounds)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fns[i % len(fns)]()
    graph.replay()
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        rounds.append(a.elapsed_time(b) / 1e3 / iters)
    del graph
    return statistics.median(rounds)
