"""`keepwarm bench restart` and `keepwarm bench serving`: the server measured from outside, over HTTP, against
vLLM's OpenAI server where a vLLM venv is given. Figures go to docs/benchmarks.md; nothing here is asserted."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from keepwarm.cli.bench import (
    SMOKE_HELP,
    bench_app,
    bench_prompts,
    drop_page_cache,
    machine_line,
    smoke_model,
    smoke_start,
    vllm_env,
)
from keepwarm.cli.bench_handoff import describe, describe_phases, median_phases, zygote_rows
from keepwarm.cli.errors import fail
from keepwarm.formats.paths import keepwarm_home
from keepwarm.worker.default_model import default_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve_model(spec: str, dtype: str) -> Path:
    # deferred: torch and transformers (~2 s), which `keepwarm --help` must not pay
    from keepwarm.worker.models.random_model import LARGE_PRESETS, make_large_random_model

    if spec == "smollm2":
        return default_model()
    if spec in LARGE_PRESETS:
        return make_large_random_model(keepwarm_home() / "bench-models" / f"random-llama-{spec}", spec, dtype)
    if not Path(spec).is_dir():
        fail(f"--models: {spec!r} is not 'smollm2', a random preset ({', '.join(sorted(LARGE_PRESETS))}) or a model "
             "directory (a GGUF file: `keepwarm bench profile --model FILE` or `bench llamacpp`)", 2)
    return Path(spec)


async def _first_token(base: str, model: str, prompt_ids: list[int], deadline: float, proc: subprocess.Popen,
                       ) -> float:
    """Poll until the server takes a streaming completion; return when its first text chunk arrives."""
    import httpx  # deferred: ~80 ms, which `keepwarm --help` must not pay

    body = {"model": model, "prompt": prompt_ids, "max_tokens": 4, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=1)) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with client.stream("POST", base + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        await asyncio.sleep(0.02)
                        continue
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                            return time.monotonic()
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                await asyncio.sleep(0.02)
    raise TimeoutError("no first token before the deadline")


def _start_to_first_token(cmd: list[str], env: dict[str, str], port: int, model: str, prompt_ids: list[int],
                          timeout: float = 600) -> tuple[float, subprocess.Popen]:
    log = tempfile.NamedTemporaryFile(prefix="kwbench-", suffix=".log", delete=False)  # noqa: SIM115
    t0 = time.monotonic()
    # cwd /tmp: a checkout's top-level folders (kernels/, daemon/...) must not shadow other programs' imports
    # (vLLM imports an optional package named `kernels`).
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=tempfile.gettempdir())
    try:
        t1 = asyncio.run(_first_token(f"http://127.0.0.1:{port}", model, prompt_ids, t0 + timeout, proc))
    except Exception as e:
        _kill(proc)
        tail = Path(log.name).read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{cmd[:4]}... failed: {e}: {tail}") from None
    return t1 - t0, proc


def _startup_phases(port: int) -> dict[str, float]:
    """The server's startup phases (/health "startup": seconds per phase, to_serve being its imports)."""
    import httpx  # deferred: ~80 ms, which `keepwarm --help` must not pay

    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json().get("startup", {})


def _kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _import_floor(env: dict[str, str]) -> tuple[float, float]:
    """Process start until `python -c pass` prints, and until the server's own modules are imported (the floor
    of any restart: what `keepwarm serve` imports before it can do anything), best of 3. Exit time not counted."""
    def timed(code: str) -> float:
        best = float("inf")
        for _ in range(3):
            t = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-c", code + "; print('ready', flush=True)"], env=env,
                                    stdout=subprocess.PIPE, text=True)
            proc.stdout.readline()
            best = min(best, time.monotonic() - t)
            proc.wait()
        return best

    return timed("pass"), timed("import keepwarm.cli.main, keepwarm.worker.serve, keepwarm.worker.engine")


def _keepwarm_cmd(model: Path, port: int, dtype: str, threads: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "keepwarm.cli.main", "--log-level", "warning", "serve", str(model), "--port",
            str(port), "--dtype", dtype, "--max-model-len", "2048", "--threads", str(threads),
            "--served-model-name", "bench", *extra]


def _vllm_cmd(vllm_python: str, model: Path, port: int, dtype: str, eager: bool) -> list[str]:
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--host", "127.0.0.1", "--dtype", dtype, "--max-model-len", "2048", "--served-model-name", "bench"]
    return cmd + (["--enforce-eager"] if eager else [])


@bench_app.command()
def restart(
    models: Annotated[str, typer.Option(help="Comma-separated: 'smollm2', '1b' or model directories.")] = "smollm2,1b",
    dtype: Annotated[str, typer.Option()] = "bfloat16",
    repeats: Annotated[int, typer.Option()] = 3,
    threads: Annotated[int, typer.Option()] = 2,
    vllm_python: Annotated[str | None, typer.Option("--vllm-python")] = None,
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
    smoke: Annotated[bool, typer.Option("--smoke", help=SMOKE_HELP)] = False,
) -> None:
    """Restart-to-first-token: process start to the first streamed token, for a warm restart (attach to the daemon),
    a cold start (--no-daemon, page cache dropped), the import floor, and vLLM's api_server; and `serve --zygote`
    restarted under load (restart to first token, handoff, the longest gap a client saw: cli/bench_handoff.py), then
    the same with ``--standby``."""
    if smoke:
        smoke_start(vllm_python)
        models, repeats, vllm_python = str(smoke_model()), 1, None
    # deferred, these two: torch, zmq and psutil, which `keepwarm --help` must not pay
    from keepwarm.daemon.client import start_daemon
    from keepwarm.weights.checkpoint import Checkpoint  # deferred (above)

    typer.echo(f"# machine: {machine_line()}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per probe otherwise
    rows = []
    for spec in models.split(","):
        model = _resolve_model(spec, dtype)
        files = Checkpoint(model).files
        rt = Path(tempfile.mkdtemp(prefix="kwr-", dir="/tmp"))
        env = {**os.environ, "KEEPWARM_RUNTIME_DIR": str(rt), "OMP_NUM_THREADS": str(threads)}
        from transformers import AutoTokenizer  # deferred: ~0.7 s, which `keepwarm --help` must not pay

        prompt_ids = bench_prompts(AutoTokenizer.from_pretrained(str(model)), 1)[0]
        py_floor, import_floor = _import_floor(env)
        row: dict = {"model": model.name, "python_start_s": py_floor, "import_floor_s": import_floor}
        typer.echo(f"{model.name}: python start {py_floor:.2f}s, import floor {import_floor:.2f}s")

        cold = []
        for _ in range(max(1, repeats - 1)):
            note = drop_page_cache(files)
            port = _free_port()
            secs, proc = _start_to_first_token(_keepwarm_cmd(model, port, dtype, threads, "--no-daemon"), env,
                                               port, "bench", prompt_ids)
            _kill(proc, signal.SIGTERM)
            cold.append(secs)
        row.update(cold_start_s=cold, page_cache=note)
        typer.echo(f"  cold start (--no-daemon, {note}): {statistics.median(cold):.2f}s  {cold}")

        client = start_daemon(rt)
        try:
            client.preload(str(model), "none", dtype)
            warm, warm_phases = [], []
            for _ in range(repeats):
                port = _free_port()
                secs, proc = _start_to_first_token(_keepwarm_cmd(model, port, dtype, threads), env, port, "bench",
                                                   prompt_ids)
                warm_phases.append(_startup_phases(port))
                _kill(proc)  # kill -9: the crash case; the daemon keeps the weights
                warm.append(secs)
            counters = client.status()["counters"]
            port = _free_port()
            cmd = _keepwarm_cmd(model, port, dtype, threads, "--zygote", "--shutdown-timeout", "600")
            zygote = zygote_rows(cmd, env, port, rt, prompt_ids, repeats, _start_to_first_token, _kill)
            port = _free_port()
            cmd = _keepwarm_cmd(model, port, dtype, threads, "--zygote", "--standby", "--shutdown-timeout", "600")
            standby = zygote_rows(cmd, env, port, rt, prompt_ids, repeats, _start_to_first_token, _kill)
        finally:
            client.shutdown()
            client.close()
        row.update(warm_restart_s=warm, daemon_preloads=counters["preloads"], daemon_attaches=counters["attaches"],
                   warm_phases_s=median_phases(warm_phases))
        typer.echo(f"  warm restart (attach):            {statistics.median(warm):.2f}s  {warm}  "
                   f"(daemon preloads {counters['preloads']}, attaches {counters['attaches']})\n"
                   f"  its phases (ms, median): {describe_phases(row['warm_phases_s'])}")
        row.update(zygote)
        row.update({f"standby_{k}": v for k, v in standby.items()})
        typer.echo(describe(zygote))
        typer.echo(describe(standby, "standby"))

        if vllm_python:
            venv_env = vllm_env(vllm_python)
            for eager in (True, False):
                port = _free_port()
                try:
                    secs, proc = _start_to_first_token(_vllm_cmd(vllm_python, model, port, dtype, eager), venv_env,
                                                       port, "bench", prompt_ids, timeout=900)
                    _kill(proc, signal.SIGTERM)
                except RuntimeError as e:
                    typer.echo(f"  vLLM ({'eager' if eager else 'compiled'}) failed: {e}")
                    continue
                row[f"vllm_{'eager' if eager else 'compiled'}_s"] = secs
                typer.echo(f"  vLLM api_server ({'--enforce-eager' if eager else 'compiled, cache warm'}): "
                           f"{secs:.2f}s")
        rows.append(row)
    if json_out:
        json_out.write_text(json.dumps({"machine": machine_line(), "dtype": dtype, "rows": rows}, indent=2) + "\n")


async def _load(base: str, warm_up: list[int], prompts: list[list[int]], max_tokens: int) -> dict:
    """``len(prompts)`` streams at once, after one request of ``warm_up``. The timed prompts must be ones the
    server has not seen (serving() gives each concurrency its own): a prompt sent before would find its blocks in
    keepwarm's prefix cache (16-token blocks) and not in vLLM CPU's (128-token blocks), and the first tokens would
    measure the cache, not the prefill."""
    import httpx  # deferred: ~80 ms, which `keepwarm --help` must not pay

    concurrency = len(prompts)

    async def one(client: httpx.AsyncClient, ids: list[int]) -> dict:
        body = {"model": "bench", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        t0 = time.monotonic()
        first = last = None
        tokens = 0
        async with client.stream("POST", base + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                msg = json.loads(line[6:])
                if msg.get("usage"):
                    tokens = msg["usage"]["completion_tokens"]
                # Both servers stream a chunk per token, text or not (a random model's tokens often decode to no
                # text yet): the first chunk with a choice is the first token. The usage chunk has no choices.
                if msg["choices"]:
                    now = time.monotonic()
                    first = first or now
                    last = now
        return {"ttft": first - t0, "tpot": (last - first) / max(tokens - 1, 1), "tokens": tokens}

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        await one(client, warm_up)
        t0 = time.monotonic()
        results = await asyncio.gather(*(one(client, ids) for ids in prompts))
        wall = time.monotonic() - t0
    ttfts = sorted(r["ttft"] for r in results)
    tokens = sum(r["tokens"] for r in results)

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]

    return {"concurrency": concurrency, "output_tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
            "tpot_mean_s": statistics.mean(r["tpot"] for r in results)}


@bench_app.command()
def serving(
    model: Annotated[str, typer.Option(help="'smollm2' or a model directory.")] = "smollm2",
    concurrency: Annotated[str, typer.Option()] = "1,8,32",
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 128,
    dtype: Annotated[str, typer.Option()] = "bfloat16",
    threads: Annotated[int, typer.Option()] = 2,
    vllm_python: Annotated[str | None, typer.Option("--vllm-python")] = None,
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
    smoke: Annotated[bool, typer.Option("--smoke", help=SMOKE_HELP)] = False,
) -> None:
    """Throughput and latency through the HTTP API (streaming, greedy, ignore_eos): output tokens/s, TTFT p50/p99,
    TPOT at each concurrency, for `keepwarm serve` and vLLM's api_server one after the other."""
    from transformers import AutoTokenizer  # deferred: ~0.7 s, which `keepwarm --help` must not pay

    if smoke:
        smoke_start(vllm_python)
        model, concurrency, max_tokens, vllm_python = str(smoke_model()), "1,2", 4, None
    path = _resolve_model(model, dtype)
    ns = [int(x) for x in concurrency.split(",")]
    # prompts[0] starts the server and warms each load up; every concurrency then sends prompts of its own.
    prompts = bench_prompts(AutoTokenizer.from_pretrained(str(path)), 1 + sum(ns))
    offsets = [1 + sum(ns[:i]) for i in range(len(ns))]
    typer.echo(f"# machine: {machine_line()}")
    typer.echo(f"# model {path.name}, {dtype}, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
               f"max_tokens {max_tokens}")
    servers = [("keepwarm", _keepwarm_cmd(path, 0, dtype, threads, "--no-daemon"),
                {**os.environ, "OMP_NUM_THREADS": str(threads)})]
    if vllm_python:
        servers.append(("vllm", _vllm_cmd(vllm_python, path, 0, dtype, True), vllm_env(vllm_python)))
    rows = []
    for name, cmd, env in servers:
        port = _free_port()
        cmd = [str(port) if c == "0" and cmd[i - 1] == "--port" else c for i, c in enumerate(cmd)]
        _, proc = _start_to_first_token(cmd, env, port, "bench", prompts[0], timeout=900)
        try:
            for n, first in zip(ns, offsets, strict=True):
                r = asyncio.run(_load(f"http://127.0.0.1:{port}", prompts[0], prompts[first:first + n], max_tokens))
                rows.append({"server": name, **r, "prompts": [first, first + n]})
                typer.echo(f"{name:9s} c={n:<3} {r['tokens_per_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_s'] * 1e3:7.1f} "
                           f"ms p99 {r['ttft_p99_s'] * 1e3:7.1f} ms  TPOT {r['tpot_mean_s'] * 1e3:6.1f} ms")
        finally:
            _kill(proc, signal.SIGTERM)
    if json_out:
        json_out.write_text(json.dumps({"machine": machine_line(), "model": path.name, "dtype": dtype,
                                        "max_tokens": max_tokens, "rows": rows}, indent=2) + "\n")
