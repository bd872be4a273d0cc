"""The benchmark half of `make gpu-check` (benchmarks/gpu_check.sh runs `pytest -m gpu` first).

    python benchmarks/gpu_check.py --out FILE [--budget SECONDS] [--pytest-log LOG --pytest-rc RC] [--smoke]

Phases, in order: bandwidth, model (an ~8B random Llama written as safetensors on the GPU), load (the daemon's
preload, then worker attach and disk loads), decode, attention, matmul, moe, decode_int4 / decode_fp8, serve; what
each measures is in docs/gpu.md, "What it runs and measures". Rules: each phase records its own seconds; a phase
that would start past the time budget is recorded as skipped, not run; results and a human summary (`summary`) go
to one JSON file, always written. `--smoke` runs every phase small on whatever device there is (the CPU here): it
checks the script, its numbers mean nothing."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The shared timing helper beside this script (gpu_check.sh runs scripts with PYTHONSAFEPATH=1).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kw_timing import graph_timed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


# ---------------------------------------------------------------------------------------------- child processes
def child_load(args: argparse.Namespace) -> None:
    """One worker's weight load, in a fresh process: prints one JSON line."""
    started = time.time()
    import psutil
    import torch

    from keepwarm.worker.model_loader import load_model

    imported = time.time()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)  # the CUDA context, so that load time excludes it
    ready = time.time()
    loaded = load_model(Path(args.model), "bfloat16", "none", device, 4096, daemon=args.mode == "daemon",
                        runtime_dir=Path(args.runtime_dir) if args.runtime_dir else None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    done = time.time()
    print(json.dumps({"mode": args.mode, "source": loaded.source, "load_seconds": round(loaded.seconds, 4),
                      "context_seconds": round(ready - imported, 4), "import_seconds": round(imported - started, 4),
                      "process_start_to_ready": round(done - psutil.Process().create_time(), 4),
                      "bytes": loaded.nbytes}), flush=True)
    loaded.close()


# ---------------------------------------------------------------------------------------------- helpers
class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _timed(device, fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
    """Mean seconds per call: CUDA events on a GPU, wall clock elsewhere."""
    import torch

    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------- phases
def phase_bandwidth(ctx: dict) -> dict:
    import torch

    device = ctx["device"]
    n = (2 * GiB) if not ctx["smoke"] else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    secs = _timed(device, lambda: dst.copy_(src), iters=10)
    bw = 2 * n / secs
    ctx["copy_bw"] = bw
    return {"bytes": n, "seconds_per_copy": secs, "read_plus_write_bytes_per_s": bw}


def phase_model(ctx: dict) -> dict:
    from keepwarm.worker.models.random_model import make_large_random_model

    t0 = time.perf_counter()
    if ctx["smoke"]:
        from keepwarm.worker.models.random_model import make_random_model

        path = make_random_model(ctx["work"] / "model", "llama", hidden_size=256, intermediate_size=512,
                                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, vocab_size=512,
                                 dtype="bfloat16")
    else:
        path = make_large_random_model(ctx["work"] / "llama-8b", "8b", "bfloat16", device=str(ctx["device"]))
    ctx["model"] = str(path)
    files = list(Path(path).glob("*.safetensors"))
    return {"path": str(path), "bytes": sum(f.stat().st_size for f in files), "files": len(files),
            "seconds": time.perf_counter() - t0}


def _child(ctx: dict, mode: str, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", "load", "--mode", mode, "--model", ctx["model"], "--device",
           str(ctx["device"]), "--runtime-dir", str(ctx["runtime_dir"])]
    r = subprocess.run(cmd, env=ctx["env"], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{mode} load failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def phase_load(ctx: dict) -> dict:
    from keepwarm.daemon.client import DaemonClient

    out: dict[str, Any] = {}
    log = open(ctx["work"] / "daemon.log", "ab")  # noqa: SIM115 (closed by phase_cleanup)
    device = "cuda" if ctx["device"].type == "cuda" else "cpu"
    ctx["daemon"] = subprocess.Popen([sys.executable, "-m", "keepwarm.cli.main", "daemon", "run", "--device",
                                      device, "--threads", str(min(16, os.cpu_count() or 4))], env=ctx["env"],
                                     stdout=log, stderr=log)
    ctx["daemon_log"] = log
    deadline = time.monotonic() + 120
    while True:
        with DaemonClient(ctx["runtime_dir"]) as c:
            if c.ping(timeout=0.5) is not None:
                break
        if ctx["daemon"].poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the daemon did not start: " + (ctx["work"] / "daemon.log").read_text()[-2000:])
        time.sleep(0.1)
    t0 = time.perf_counter()
    with DaemonClient(ctx["runtime_dir"], timeout=600) as c:
        pre = c.request("preload", {"model": ctx["model"], "quantization": "none", "dtype": "bfloat16"},
                        timeout=600)
    out["daemon_preload"] = {"seconds": time.perf_counter() - t0, "bytes": pre.get("bytes"),
                             "daemon_load_seconds": pre.get("load_seconds")}
    for key, mode in (("attach", "daemon"), ("disk_warm", "disk"), ("disk_cold", "disk")):
        if key == "disk_cold" and (ctx["smoke"] or ctx["budget"].left() < 240 or not _drop_page_cache()):
            out[key] = {"skipped": "page cache not dropped (smoke run, not root, or too little time left)"}
            continue
        try:  # one failed load is a result; the others (and the decode phase, which needs the daemon) go on
            out[key] = _child(ctx, mode, min(600, max(30, ctx["budget"].left())))
        except Exception as e:
            out[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    return out


def phase_decode(ctx: dict) -> dict:
    return _decode(ctx, "none", (1, 4) if ctx["smoke"] else (1, 16, 64), eager_batch1=True)


def phase_decode_int4(ctx: dict) -> dict:
    return _decode(ctx, "int4", (1,) if ctx["smoke"] else (1, 16), eager_batch1=False)


def phase_decode_fp8(ctx: dict) -> dict:
    return _decode(ctx, "fp8", (1,) if ctx["smoke"] else (1, 16), eager_batch1=False)


def _decode(ctx: dict, quantization: str, batches: tuple[int, ...], eager_batch1: bool) -> dict:
    """Engine steps on weights attached from the daemon (which quantizes them at preload when asked)."""
    import torch

    from keepwarm.worker.engine import EngineConfig, LLMEngine
    from keepwarm.worker.model_runner import kv_bytes_per_block
    from keepwarm.worker.sampling_params import SamplingParams

    device = ctx["device"]
    smoke = ctx["smoke"]
    prompt_len, warmup_steps, steps = (16, 2, 4) if smoke else (128, 4, 32)
    engine = LLMEngine(EngineConfig(model=ctx["model"], dtype="bfloat16", quantization=quantization,
                                    max_model_len=1024, max_num_seqs=64,
                                    num_gpu_blocks=2048 if not smoke else 256, daemon=True,
                                    runtime_dir=str(ctx["runtime_dir"]), device=str(device)))
    mc = engine.model_config
    arena_bytes = engine.loaded.nbytes
    embed_bytes = mc.vocab_size * mc.hidden_size * 2  # the embedding table: a decode step reads B rows of it
    kv_per_token = kv_bytes_per_block(mc, 1, engine.cache_config.dtype)
    out: dict[str, Any] = {"quantization": quantization, "weights_bytes": arena_bytes,
                           "kv_bytes_per_token": kv_per_token, "batches": {}}
    gen = torch.Generator().manual_seed(0)
    counter = 0

    def run(batch: int, eager: bool) -> dict:
        nonlocal counter
        graphs = engine.runner.cuda_graphs
        if eager:
            engine.runner.cuda_graphs = None
        params = SamplingParams(temperature=0, max_tokens=warmup_steps + steps + 8, ignore_eos=True)
        ids = []
        for _ in range(batch):
            counter += 1
            ids.append(f"r{counter}")
            engine.add_request(ids[-1], torch.randint(10, mc.vocab_size - 10, (prompt_len,), generator=gen).tolist(),
                               params)
        while engine.num_waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
            engine.step()  # prefill (in chunks) until every sequence decodes
        for _ in range(warmup_steps):  # includes the graph capture for this batch size
            engine.step()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        secs = (time.perf_counter() - t0) / steps
        ctx_len = prompt_len + warmup_steps + steps / 2
        step_bytes = arena_bytes - embed_bytes + batch * ctx_len * kv_per_token
        floor = step_bytes / ctx["copy_bw"]
        extra = _decode_breakdown(ctx, engine, steps=6) if (batch == 1 and not eager and device.type == "cuda"
                                                             and quantization == "none") else {}
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        engine.runner.cuda_graphs = graphs
        return {"step_ms": secs * 1e3, "tokens_per_s": batch / secs, "floor_ms": floor * 1e3,
                "fraction_of_floor": floor / secs, "cuda_graphs": engine.runner.cuda_graphs is not None and not eager,
                **extra}

    for b in batches:
        if ctx["budget"].left() < 30:
            out["batches"][str(b)] = {"skipped": "time budget"}
            continue
        out["batches"][str(b)] = run(b, eager=False)
    if eager_batch1 and device.type == "cuda" and ctx["budget"].left() > 30:
        out["batch1_eager"] = run(1, eager=True)
    engine.close()
    return out


def _decode_breakdown(ctx: dict, engine, steps: int) -> dict:
    """Where a batch-1 decode step goes: the captured forward's GPU time alone (graph replays timed with events),
    the logits matmul's, and a torch.profiler table of a few whole engine steps (CPU and CUDA time per op)."""
    import torch

    device = ctx["device"]
    out: dict[str, Any] = {}
    graphs = engine.runner.cuda_graphs
    if graphs is not None and 1 in graphs.graphs:
        graph = graphs.graphs[1][0]
        graph.replay()
        torch.cuda.synchronize(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            graph.replay()
        b.record()
        b.synchronize()
        out["forward_graph_gpu_ms"] = a.elapsed_time(b) / 20
    model = engine.runner.model
    hidden = torch.randn(1, engine.model_config.hidden_size, device=device, dtype=torch.bfloat16)
    out["logits_gpu_ms"] = graph_timed(device, [lambda: model.compute_logits(hidden)], iters=10) * 1e3
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            _sync(device)
        ka = prof.key_averages()
        out["profile_steps"] = steps
        out["profile_by_cuda"] = ka.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60)
        out["profile_by_cpu"] = ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
    except Exception as e:  # the profile is extra information: its failure is recorded, not fatal
        out["profile_error"] = f"{type(e).__name__}: {e}"[:500]
    return out


def _attention_fn(device, args: tuple, splits: int | None) -> Callable[[], Any]:
    """The decode attention call: the triton kernel itself on a GPU (to pass num_splits), the dispatcher elsewhere."""
    if device.type == "cuda":
        from keepwarm.kernels import triton_attention

        return lambda: triton_attention.paged_attention(*args, num_splits=splits)
    from keepwarm import kernels

    return lambda: kernels.paged_attention(*args)


def phase_attention(ctx: dict) -> dict:
    import torch

    device = ctx["device"]
    smoke = ctx["smoke"]
    hq, hk, d, bs = 32, 8, 128, 16
    out: dict[str, Any] = {}
    fp8 = torch.float8_e4m3fn
    cases = [("b64_ctx4096_bf16", 64, 4096, torch.bfloat16, None), ("b64_ctx4096_fp8", 64, 4096, fp8, None),
             ("b1_ctx32768_auto_splits", 1, 32768, torch.bfloat16, None),
             ("b1_ctx32768_no_splits", 1, 32768, torch.bfloat16, 1),
             ("b1_ctx32768_fp8_auto_splits", 1, 32768, fp8, None)]
    cases += [(f"b1_ctx32768_{n}_splits", 1, 32768, torch.bfloat16, n) for n in (16, 32, 64, 128)]
    if smoke:
        cases = [(name, b, min(ctx_len, 256), dt, s) for name, b, ctx_len, dt, s in cases[:3]]
    for name, batch, ctx_len, cache_dtype, splits in cases:
        if ctx["budget"].left() < 15:
            out[name] = {"skipped": "time budget"}
            continue
        nb = batch * ctx_len // bs
        k_cache = torch.randn(hk, nb, bs, d, device=device, dtype=torch.bfloat16).to(cache_dtype)
        v_cache = torch.randn(hk, nb, bs, d, device=device, dtype=torch.bfloat16).to(cache_dtype)
        tables = torch.randperm(nb, device=device, dtype=torch.int64).view(batch, -1).to(torch.int32)
        seq_lens = torch.full((batch,), ctx_len, dtype=torch.int32, device=device)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
        fn = _attention_fn(device, (q, k_cache, v_cache, tables, seq_lens, qsl, 0.088, 1.0, 1.0, 1), splits)
        secs = graph_timed(device, [fn], iters=20 if not smoke else 2)
        kv_bytes = 2 * batch * ctx_len * hk * d * k_cache.element_size()
        out[name] = {"us": secs * 1e6, "kv_bytes": kv_bytes, "bytes_per_s": kv_bytes / secs,
                     "fraction_of_copy_bw": kv_bytes / secs / ctx["copy_bw"], "splits": splits or "auto"}
        if device.type == "cuda" and splits is None:
            from keepwarm.kernels import triton_attention

            out[name]["splits"] = triton_attention._num_splits(device, batch * hk, ctx_len)
        del k_cache, v_cache
    return out


def phase_matmul(ctx: dict) -> dict:
    """Quantized matmuls 4096 -> 14336 at M = 1, 16, 64, 256 against dense bf16 (cuBLAS), graph-timed, over weight
    copies that together exceed the L2; fp8 by its automatic path and by each path forced."""
    import torch

    from keepwarm import kernels
    from keepwarm.formats.quant import quantize
    from keepwarm.kernels.quant import QuantizedWeight

    device = ctx["device"]
    smoke = ctx["smoke"]
    n, k = (14336, 4096) if not smoke else (512, 256)
    copies = 4 if not smoke else 1  # int4: 4 x 29 MB, past the H200's 60 MB L2
    ws = [torch.randn(n, k, device=device) * 0.02 for _ in range(copies)]
    weights = {"bf16_dense": [w.bfloat16() for w in ws]}
    for scheme in ("int8", "int4", "fp8"):
        weights[scheme] = [QuantizedWeight.from_parts(*quantize(w, scheme, torch.bfloat16, device.type)) for w in ws]
    del ws
    out: dict[str, Any] = {"shape": [n, k]}
    fp8_env = "KEEPWARM_FP8_MATMUL"
    for m in (1, 16, 64, 256) if not smoke else (1, 16):
        if ctx["budget"].left() < 10:
            out[f"M{m}"] = {"skipped": "time budget"}
            continue
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        row: dict[str, Any] = {}
        variants = [(name, None) for name in weights]
        if device.type == "cuda":
            variants += [("fp8_triton", "triton"), ("fp8_scaled_mm", "scaled_mm")]
        for name, mode in variants:
            ws_ = weights["fp8" if mode else name]
            old = os.environ.pop(fp8_env, None)
            if mode:
                os.environ[fp8_env] = mode
            try:
                secs = graph_timed(device, [lambda w=w, x=x: kernels.linear(x, w) for w in ws_],
                                    iters=20 if not smoke else 1)
            except Exception as e:
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                continue
            finally:
                os.environ.pop(fp8_env, None)
                if old is not None:
                    os.environ[fp8_env] = old
            nbytes = ws_[0].nbytes
            row[name] = {"us": secs * 1e6, "weight_bytes": nbytes, "bytes_per_s": nbytes / secs,
                         "fraction_of_copy_bw": nbytes / secs / ctx["copy_bw"]}
        base = row.get("bf16_dense", {}).get("us")
        for r in row.values():
            if base and "us" in r:
                r["x_bf16_time"] = r["us"] / base
        out[f"M{m}"] = row
    return out


def phase_moe(ctx: dict) -> dict:
    """One Mixtral-8x7B MoE layer's experts (see the module docstring); routing random, top-2 renormalised."""
    import torch

    from keepwarm import kernels
    from keepwarm.formats.quant import quantize
    from keepwarm.kernels import quant, reference
    from keepwarm.kernels.quant import QuantizedWeight

    device = ctx["device"]
    smoke = ctx["smoke"]
    e, h, i = (8, 4096, 14336) if not smoke else (4, 256, 512)
    dense = [(torch.randn(2 * i, h, device=device) * 0.02, torch.randn(h, i, device=device) * 0.02) for _ in range(e)]
    out: dict[str, Any] = {"experts": e, "hidden": h, "intermediate": i, "top_k": 2}
    for scheme in ("none", "int8", "fp8", "int4"):
        if ctx["budget"].left() < 10:
            out[scheme] = {"skipped": "time budget"}
            continue

        def q(w: torch.Tensor, scheme: str = scheme) -> Any:
            return w.bfloat16() if scheme == "none" else QuantizedWeight.from_parts(
                *quantize(w, scheme, torch.bfloat16, device.type))

        experts = kernels.MoEWeights(tuple(q(a) for a, _ in dense), tuple(q(b) for _, b in dense))
        expert_bytes = (experts.gate_up[0].nbytes + experts.down[0].nbytes)
        linear = torch.nn.functional.linear if scheme == "none" else quant.linear_reference
        row: dict[str, Any] = {}
        for t in (1, 16, 64, 256) if not smoke else (1, 16):
            x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
            weights, ids = torch.topk(torch.softmax(torch.randn(t, e, device=device), -1), 2, dim=-1)
            weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
            touched = int(ids.unique().numel()) * expert_bytes
            try:
                fused = graph_timed(device, [lambda x=x, w=weights, d=ids, ex=experts: kernels.fused_moe(
                    x, w, d, ex, "silu")], iters=10 if not smoke else 1)
                ref = _timed(device, lambda x=x, w=weights, d=ids, ex=experts, lin=linear: reference.fused_moe(
                    x, w, d, ex, "silu", lin), iters=5 if not smoke else 1)
            except Exception as err:
                row[f"T{t}"] = {"error": f"{type(err).__name__}: {err}"[:300]}
                continue
            row[f"T{t}"] = {"fused_us": fused * 1e6, "reference_us": ref * 1e6, "speedup": ref / fused,
                            "expert_bytes_per_s": touched / fused,
                            "backend": kernels.select_backend("fused_moe", device)}
        out[scheme] = row
    return out


def _stream_request(client, base: str, prompt: str, max_tokens: int) -> dict:
    """One streaming completion: seconds to the first chunk (the first token; its text may be held back while it
    is an incomplete character, so chunks are not tokens), the completion's token count from the usage chunk,
    seconds in all."""
    t0 = time.perf_counter()
    first = None
    tokens = 0
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft": first - t0 if first else None, "first_at": first, "tokens": tokens,
            "seconds": time.perf_counter() - t0}


def _serve(ctx: dict, *flags: str) -> tuple[subprocess.Popen, str, float, float]:
    """`keepwarm serve MODEL` on a free port: (process, base URL, spawn time (perf_counter), seconds from spawn to
    /health 200)."""
    import socket

    import httpx

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    log = open(ctx["work"] / f"serve-{port}.log", "ab")  # noqa: SIM115 (closed with the process)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "keepwarm.cli.main", "serve", ctx["model"], "--port", str(port),
                             "--served-model-name", "m", "--max-model-len", "1024", "--max-num-seqs", "64",
                             "--num-gpu-blocks-override", "2048" if not ctx["smoke"] else "256", *flags],
                            env=ctx["env"], stdout=log, stderr=log)
    ctx.setdefault("servers", []).append(proc)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + min(240, max(10, ctx["budget"].left()))
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"serve {flags} not ready: " + (ctx["work"] / f"serve-{port}.log").read_text()[-2000:])
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base, t0, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.05)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def phase_serve(ctx: dict) -> dict:
    """HTTP serving with `keepwarm serve` on the 8B: a (re)start to first token attaching to the daemon's weights
    and with --no-daemon (disk, page cache warm), and tokens/s and time to first token at 1, 16 and 64 concurrent
    streams (the attached server; streaming completions, 128 tokens each, greedy, ignore_eos)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    max_tokens = 128 if not ctx["smoke"] else 8
    out: dict[str, Any] = {}

    def restart(name: str, *flags: str) -> tuple[subprocess.Popen, str]:
        proc, base, spawned, ready = _serve(ctx, *flags)
        with httpx.Client() as c:
            r = _stream_request(c, base, prompt, 1)
        out[name] = {"spawn_to_ready_s": ready, "first_request_ttft_s": r["ttft"],
                     "spawn_to_first_token_s": r["first_at"] - spawned if r["first_at"] else None}
        return proc, base

    proc, base = restart("restart_attach", "--daemon")
    try:
        for streams in (1, 16, 64) if not ctx["smoke"] else (1, 4):
            if ctx["budget"].left() < 20:
                out[f"streams_{streams}"] = {"skipped": "time budget"}
                continue
            with httpx.Client(limits=httpx.Limits(max_connections=streams + 4)) as c:
                _stream_request(c, base, prompt, 4)  # warm: this batch size's CUDA graph may still be uncaptured
                t0 = time.perf_counter()
                with ThreadPoolExecutor(streams) as pool:
                    rs = list(pool.map(lambda _: _stream_request(c, base, prompt, max_tokens), range(streams)))
                wall = time.perf_counter() - t0
            ttfts = sorted(r["ttft"] for r in rs if r["ttft"] is not None)
            total = sum(r["tokens"] for r in rs)
            out[f"streams_{streams}"] = {"tokens": total, "seconds": wall, "tokens_per_s": total / wall,
                                         "ttft_median_s": ttfts[len(ttfts) // 2] if ttfts else None,
                                         "ttft_max_s": ttfts[-1] if ttfts else None}
    finally:
        _stop(proc)
    if ctx["budget"].left() > 60:
        proc, _ = restart("restart_no_daemon", "--no-daemon")
        _stop(proc)
    else:
        out["restart_no_daemon"] = {"skipped": "time budget"}
    return out


def phase_cleanup(ctx: dict) -> None:
    for server in ctx.get("servers", []):
        _stop(server)
    proc = ctx.get("daemon")
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if ctx.get("daemon_log"):
        ctx["daemon_log"].close()


# ---------------------------------------------------------------------------------------------- summary
def _fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def summarize(res: dict) -> str:
    m = res.get("machine", {})
    lines = [f"keepwarm gpu-check, {res['started']}: {m.get('gpu', '?')}, torch {m.get('torch')}, triton "
             f"{m.get('triton')}, {res['total_seconds']:.0f}s"]
    pt = res.get("pytest")
    if pt:
        lines.append(f"pytest -m gpu: {pt.get('summary', '?')} (exit {pt.get('returncode')})")
    ph = res["phases"]

    def ok(name: str) -> dict | None:
        p = ph.get(name, {})
        if "error" in p or "skipped" in p:
            lines.append(f"{name}: {p.get('error') or p.get('skipped')}")
            return None
        return p.get("result")

    if (bw := ok("bandwidth")) is not None:
        lines.append(f"copy bandwidth (read + write): {bw['read_plus_write_bytes_per_s'] / 1e12:.2f} TB/s")
    if (mo := ok("model")) is not None:
        lines.append(f"model: {_fmt_bytes(mo['bytes'])} in {mo['files']} files, generated + written in "
                     f"{mo['seconds']:.1f}s")
    if (ld := ok("load")) is not None:
        lines.append(f"daemon preload: {ld['daemon_preload']['seconds']:.1f}s")
        for key in ("attach", "disk_warm", "disk_cold"):
            r = ld.get(key, {})
            if "load_seconds" in r:
                lines.append(f"{key}: load_model {r['load_seconds']:.3f}s, process start -> ready "
                             f"{r['process_start_to_ready']:.2f}s (CUDA context {r['context_seconds']:.2f}s)")
            else:
                lines.append(f"{key}: {r.get('skipped') or r.get('error') or r}")
    for phase in ("decode", "decode_int4", "decode_fp8"):
        if (de := ok(phase)) is None:
            continue
        for b, r in de["batches"].items():
            if "step_ms" in r:
                lines.append(f"{phase} batch {b}: {r['step_ms']:.2f} ms/step, {r['tokens_per_s']:.0f} tok/s; floor "
                             f"{r['floor_ms']:.2f} ms ({100 * r['fraction_of_floor']:.0f}% of it)")
            else:
                lines.append(f"{phase} batch {b}: {r}")
        if "batch1_eager" in de:
            lines.append(f"{phase} batch 1 eager (no CUDA graphs): {de['batch1_eager']['step_ms']:.2f} ms/step")
    if (at := ok("attention")) is not None:
        for name, r in at.items():
            if "us" in r:
                lines.append(f"paged attention {name} (splits {r['splits']}): {r['us']:.0f} us, "
                             f"{r['bytes_per_s'] / 1e12:.2f} TB/s of K/V ({100 * r['fraction_of_copy_bw']:.0f}% of "
                             "copy bandwidth)")
            else:
                lines.append(f"paged attention {name}: {r}")
    if (mm := ok("matmul")) is not None:
        for m, row in mm.items():
            if not m.startswith("M"):
                continue
            for name, r in (row.items() if "skipped" not in row else [("all", row)]):
                if "us" in r:
                    lines.append(f"matmul {m} {mm['shape'][1]}->{mm['shape'][0]} {name}: {r['us']:.1f} us "
                                 f"({r.get('x_bf16_time', float('nan')):.2f}x bf16), "
                                 f"{r['bytes_per_s'] / 1e12:.2f} TB/s of weights")
                else:
                    lines.append(f"matmul {m} {name}: {r}")
    if (mo := ok("moe")) is not None:
        for scheme in ("none", "int8", "fp8", "int4"):
            for t, r in (mo.get(scheme) or {}).items():
                if isinstance(r, dict) and "fused_us" in r:
                    lines.append(f"moe {scheme} {t} ({r['backend']}): {r['fused_us']:.0f} us vs reference "
                                 f"{r['reference_us']:.0f} us ({r['speedup']:.1f}x), "
                                 f"{r['expert_bytes_per_s'] / 1e12:.2f} TB/s of touched experts")
                else:
                    lines.append(f"moe {scheme} {t}: {r}")
    if (sv := ok("serve")) is not None:
        for name, r in sv.items():
            if "spawn_to_first_token_s" in r:
                lines.append(f"serve {name}: spawn -> ready {r['spawn_to_ready_s']:.2f}s, spawn -> first token "
                             f"{r['spawn_to_first_token_s']:.2f}s")
            elif "tokens_per_s" in r:
                lines.append(f"serve {name}: {r['tokens_per_s']:.0f} tok/s, TTFT median {r['ttft_median_s']:.3f}s"
                             f" (max {r['ttft_max_s']:.3f}s)")
            else:
                lines.append(f"serve {name}: {r}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench-out" / "gpu-check.json"))
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all phases")
    ap.add_argument("--pytest-log")
    ap.add_argument("--pytest-rc", type=int)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--child")
    ap.add_argument("--mode")
    ap.add_argument("--model")
    ap.add_argument("--device")
    ap.add_argument("--runtime-dir")
    a = ap.parse_args()
    if a.child == "load":
        child_load(a)
        return 0

    t_start = time.perf_counter()
    import torch
    import triton

    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if not a.smoke and device.type != "cuda":
        print("gpu-check needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    res: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "smoke": a.smoke, "phases": {}}
    res["machine"] = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (smoke run)",
                      "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
                      "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                      "cpus": os.cpu_count()}
    if a.pytest_log:
        log = Path(a.pytest_log).read_text(errors="replace") if Path(a.pytest_log).exists() else ""
        tail = [ln for ln in log.strip().splitlines() if ln.strip()]
        res["pytest"] = {"returncode": a.pytest_rc, "summary": tail[-1] if tail else "no output",
                         "log_tail": "\n".join(tail[-60:])}
    work = Path(tempfile.mkdtemp(prefix="kw-gpucheck-", dir=os.environ.get("KEEPWARM_GPU_CHECK_DIR", "/tmp")))
    runtime_dir = Path(tempfile.mkdtemp(prefix="kwg-", dir="/tmp"))  # short: unix socket path limit
    env = {**os.environ, "KEEPWARM_RUNTIME_DIR": str(runtime_dir)}
    ctx: dict[str, Any] = {"device": device, "smoke": a.smoke, "work": work, "runtime_dir": runtime_dir, "env": env,
                           "budget": Budget(a.budget), "copy_bw": float("nan")}
    # A phase still running at the deadline (plus a grace period) is interrupted, so the results file is written
    # in time whatever happens; each phase is also skipped up front when less time is left than it needs.
    def _out_of_time(_signum: int, _frame: object) -> None:
        raise TimeoutError("interrupted at the time budget")

    signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(max(1, int(a.budget + 15)))
    # Rough seconds each phase needs at most (16 GB of weights on an H200-class machine); skipped if less is left.
    needs = {"bandwidth": 5, "model": 120, "load": 150, "decode": 60, "attention": 20, "matmul": 20, "moe": 30,
             "decode_int4": 60, "decode_fp8": 60, "serve": 45}
    after = {"load": "model", "decode": "load", "decode_int4": "load", "decode_fp8": "load", "serve": "load"}
    try:
        phases = (("bandwidth", phase_bandwidth), ("model", phase_model), ("load", phase_load),
                  ("decode", phase_decode), ("attention", phase_attention), ("matmul", phase_matmul),
                  ("moe", phase_moe),
                  ("decode_int4", phase_decode_int4), ("decode_fp8", phase_decode_fp8), ("serve", phase_serve))
        only = [p for p in os.environ.get("GPU_CHECK_PHASES", "").split(",") if p]
        for name, fn in phases:
            if only and name not in only:
                res["phases"][name] = {"skipped": "not in GPU_CHECK_PHASES"}
                continue
            dep = after.get(name)
            if dep and "result" not in res["phases"].get(dep, {}):
                res["phases"][name] = {"skipped": f"needs the {dep} phase"}
                continue
            if ctx["budget"].left() < (5 if a.smoke else needs[name]):
                res["phases"][name] = {"skipped": f"time budget ({ctx['budget'].left():.0f}s left)"}
                continue
            t0 = time.perf_counter()
            try:
                res["phases"][name] = {"result": fn(ctx)}
            except Exception as e:  # a failed phase is a result too; the others still run
                res["phases"][name] = {"error": f"{type(e).__name__}: {e}"[:3000]}
            res["phases"][name]["seconds"] = round(time.perf_counter() - t0, 2)
            print(f"[gpu-check] {name}: {res['phases'][name].get('seconds')}s "
                  f"{'ok' if 'result' in res['phases'][name] else res['phases'][name]}", flush=True)
    finally:
        signal.alarm(0)
        phase_cleanup(ctx)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(runtime_dir, ignore_errors=True)
    res["total_seconds"] = time.perf_counter() - t_start
    res["summary"] = summarize(res)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    print(res["summary"])
    print(f"[gpu-check] results in {out}")
    failed = [n for n, p in res["phases"].items() if "error" in p]
    return 1 if failed or (a.pytest_rc not in (None, 0)) else 0


if __name__ == "__main__":
    sys.exit(main())
