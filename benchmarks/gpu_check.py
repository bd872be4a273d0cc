"""The benchmark half of `make gpu-check` (benchmarks/gpu_check.sh runs `pytest -m gpu` first).

    python benchmarks/gpu_check.py --out FILE [--budget SECONDS] [--pytest-log LOG --pytest-rc RC] [--smoke]

Phases, in order; each records its own seconds, and a phase that would start past the time budget is recorded as
skipped instead of run:
  bandwidth  device-to-device copy of 2 GiB: bytes read + written per second. The ceiling for memory-bound work.
  model      an ~8B Llama (Llama-3-8B shapes, random bfloat16 weights, 16 GB) generated on the GPU and written
             as safetensors shards (`make_large_random_model(..., device="cuda")`).
  load       a `keepwarm daemon run --device cuda` preloads it into one CUDA arena; then fresh worker processes
             (a) attach from the daemon (CUDA IPC, no copy) and (b) load it from disk: page cache warm, and cold
             when the kernel lets root drop its caches. Each reports load_model's seconds and process start -> ready.
  decode     decode throughput at batch 1, 16 and 64 on the attached weights (CUDA graphs on; batch 1 eager too),
             against the floor = bytes a step must read (weights + the batch's KV) / copy bandwidth.
  attention  paged attention in isolation, Llama-8B heads, decode: batch 64 x 4096 context (bfloat16 and fp8
             KV) and batch 1 x 32768 (split-KV on and off): K/V bytes read per second.
  matmul     weight-only quantized matmuls at M=1 (4096 -> 14336): weight bytes read per second.
Results and a human summary go to one JSON file (`summary` holds the text). `--smoke` runs every phase small and
on whatever device there is (the CPU here): it checks the script, its numbers mean nothing.
"""

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
    import torch

    from keepwarm.worker.engine import EngineConfig, LLMEngine
    from keepwarm.worker.model_runner import kv_bytes_per_block
    from keepwarm.worker.sampling_params import SamplingParams

    device = ctx["device"]
    smoke = ctx["smoke"]
    batches = (1, 4) if smoke else (1, 16, 64)
    prompt_len, warmup_steps, steps = (16, 2, 4) if smoke else (128, 4, 32)
    engine = LLMEngine(EngineConfig(model=ctx["model"], dtype="bfloat16", max_model_len=1024, max_num_seqs=64,
                                    num_gpu_blocks=2048 if not smoke else 256, daemon=True,
                                    runtime_dir=str(ctx["runtime_dir"]), device=str(device)))
    mc = engine.model_config
    arena_bytes = engine.loaded.nbytes
    embed_bytes = mc.vocab_size * mc.hidden_size * 2  # the embedding table: a decode step reads B rows of it
    kv_per_token = kv_bytes_per_block(mc, 1, engine.cache_config.dtype)
    out: dict[str, Any] = {"weights_bytes": arena_bytes, "kv_bytes_per_token": kv_per_token, "batches": {}}
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
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        engine.runner.cuda_graphs = graphs
        return {"step_ms": secs * 1e3, "tokens_per_s": batch / secs, "floor_ms": floor * 1e3,
                "fraction_of_floor": floor / secs, "cuda_graphs": engine.runner.cuda_graphs is not None and not eager}

    for b in batches:
        if ctx["budget"].left() < 30:
            out["batches"][str(b)] = {"skipped": "time budget"}
            continue
        out["batches"][str(b)] = run(b, eager=False)
    if device.type == "cuda" and ctx["budget"].left() > 30:
        out["batch1_eager"] = run(1, eager=True)
    engine.close()
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
    cases = [("b64_ctx4096_bf16", 64, 4096, torch.bfloat16, None), ("b64_ctx4096_fp8", 64, 4096,
                                                                        torch.float8_e4m3fn, None),
             ("b1_ctx32768_auto_splits", 1, 32768, torch.bfloat16, None),
             ("b1_ctx32768_no_splits", 1, 32768, torch.bfloat16, 1)]
    if smoke:
        cases = [(name, b, min(ctx_len, 256), dt, s) for name, b, ctx_len, dt, s in cases[:3]]
    for name, batch, ctx_len, cache_dtype, splits in cases:
        nb = batch * ctx_len // bs
        k_cache = torch.randn(hk, nb, bs, d, device=device, dtype=torch.bfloat16).to(cache_dtype)
        v_cache = torch.randn(hk, nb, bs, d, device=device, dtype=torch.bfloat16).to(cache_dtype)
        tables = torch.randperm(nb, device=device, dtype=torch.int64).view(batch, -1).to(torch.int32)
        seq_lens = torch.full((batch,), ctx_len, dtype=torch.int32, device=device)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
        fn = _attention_fn(device, (q, k_cache, v_cache, tables, seq_lens, qsl, 0.088, 1.0, 1.0, 1), splits)
        secs = _timed(device, fn, iters=20 if not smoke else 2)
        kv_bytes = 2 * batch * ctx_len * hk * d * k_cache.element_size()
        out[name] = {"us": secs * 1e6, "kv_bytes": kv_bytes, "bytes_per_s": kv_bytes / secs,
                     "fraction_of_copy_bw": kv_bytes / secs / ctx["copy_bw"]}
        del k_cache, v_cache
    return out


def phase_matmul(ctx: dict) -> dict:
    import torch

    from keepwarm import kernels
    from keepwarm.formats.quant import quantize
    from keepwarm.kernels.quant import QuantizedWeight

    device = ctx["device"]
    n, k = (14336, 4096) if not ctx["smoke"] else (512, 256)
    w = torch.randn(n, k, device=device) * 0.02
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    out: dict[str, Any] = {}
    dense = w.bfloat16()
    secs = _timed(device, lambda: kernels.linear(x, dense), iters=50 if not ctx["smoke"] else 2)
    out["bf16_dense"] = {"us": secs * 1e6, "bytes_per_s": dense.nbytes / secs}
    for scheme in ("int8", "int4", "fp8"):
        qw = QuantizedWeight.from_parts(*quantize(w, scheme, torch.bfloat16, device.type))
        secs = _timed(device, lambda qw=qw: kernels.linear(x, qw), iters=50 if not ctx["smoke"] else 2)
        out[scheme] = {"us": secs * 1e6, "weight_bytes": qw.nbytes, "bytes_per_s": qw.nbytes / secs,
                       "fraction_of_copy_bw": qw.nbytes / secs / ctx["copy_bw"]}
    return out


def phase_cleanup(ctx: dict) -> None:
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
    if (de := ok("decode")) is not None:
        for b, r in de["batches"].items():
            if "step_ms" in r:
                lines.append(f"decode batch {b}: {r['step_ms']:.2f} ms/step, {r['tokens_per_s']:.0f} tok/s; floor "
                             f"{r['floor_ms']:.2f} ms ({100 * r['fraction_of_floor']:.0f}% of it)")
            else:
                lines.append(f"decode batch {b}: {r}")
        if "batch1_eager" in de:
            r = de["batch1_eager"]
            lines.append(f"decode batch 1 eager (no CUDA graphs): {r['step_ms']:.2f} ms/step")
    if (at := ok("attention")) is not None:
        for name, r in at.items():
            lines.append(f"paged attention {name}: {r['us']:.0f} us, {r['bytes_per_s'] / 1e12:.2f} TB/s of K/V "
                         f"({100 * r['fraction_of_copy_bw']:.0f}% of copy bandwidth)")
    if (mm := ok("matmul")) is not None:
        for name, r in mm.items():
            lines.append(f"matmul M=1 {name}: {r['us']:.1f} us, {r['bytes_per_s'] / 1e12:.2f} TB/s of weights")
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
    needs = {"bandwidth": 5, "model": 120, "load": 150, "decode": 60, "attention": 20, "matmul": 15}
    after = {"load": "model", "decode": "load"}
    try:
        for name, fn in (("bandwidth", phase_bandwidth), ("model", phase_model), ("load", phase_load),
                         ("decode", phase_decode), ("attention", phase_attention), ("matmul", phase_matmul)):
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
