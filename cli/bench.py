"""`keepwarm bench ...`: benchmarks that print figures (never asserted in tests; see docs/benchmarks.md)."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from keepwarm.cli.heldout import HELDOUT_TEXT
from keepwarm.formats.paths import keepwarm_home
from keepwarm.worker.default_model import default_model
from keepwarm.worker.sampling_params import SamplingParams

bench_app = typer.Typer(help="Benchmarks: figures go to docs/benchmarks.md.", no_args_is_help=True)

TOPICS = ["the history of bread", "how volcanoes form", "the rules of chess", "why the sky is blue",
          "the life cycle of a frog", "how batteries work", "the invention of the printing press",
          "the water cycle", "how airplanes stay in the air", "the migration of birds",
          "the origin of the Olympic games", "how vaccines train the immune system", "the structure of a cell",
          "the causes of ocean tides", "the basics of compound interest", "how bees make honey"]
STYLES = ["for a ten-year-old", "in a formal tone", "as a short story", "with three concrete examples",
          "in exactly five bullet points", "as if you were a tour guide", "using a cooking analogy",
          "for a busy executive"]


def bench_prompts(tokenizer, n: int) -> list[list[int]]:
    """n distinct chat prompts of roughly 35-50 tokens, as token ids (the same ids go to every engine)."""
    out = []
    for i in range(n):
        text = (f"Request {i}: explain {TOPICS[i % len(TOPICS)]} {STYLES[(i // len(TOPICS) + i) % len(STYLES)]}, "
                "and mention one surprising fact.")
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(tokenizer.encode(chat, add_special_tokens=False))
    return out


# -- --smoke: every benchmark's code path on a tiny random model in seconds (CI runs them; figures mean nothing) --
SMOKE_HELP = "CI form: a tiny random model, a few tokens, one repeat; the code paths are real, the figures are not."
SMOKE_NOTE = "# smoke run: tiny random model, a few tokens; the figures are meaningless"


def tiny_bench_model(name: str, **config: Any) -> Path:
    """A tiny random Llama (with tokenizer and chat template) under $KEEPWARM_HOME/bench-models/<name>, built once
    from ``config`` (make_random_model's arguments) and renamed into place whole."""
    # deferred: torch and transformers (~2 s), which `keepwarm --help` must not pay
    from keepwarm.worker.models.random_model import make_random_model

    out = keepwarm_home() / "bench-models" / name
    if not (out / "config.json").is_file():
        tmp = out.with_name(f".{name}.{os.getpid()}")
        make_random_model(tmp, "llama", **config)
        tmp.rename(out)
    return out


def smoke_model() -> Path:
    """The smoke runs' model (see tiny_bench_model)."""
    return tiny_bench_model("smoke-llama", head_dim=32, max_position_embeddings=4096)


_SMOKE = {"on": False}  # a smoke run evicts only its own files from the page cache, never the whole machine's


def smoke_start(vllm_python: str | None = None) -> None:
    """Say it is a smoke run, and that the vLLM peer is skipped (its venv is not one of keepwarm's dependencies)."""
    _SMOKE["on"] = True
    typer.echo(SMOKE_NOTE)
    if vllm_python:
        typer.echo(f"# vLLM peer skipped: a smoke run does not start the peer ({vllm_python}); its venv is not a "
                   "keepwarm dependency")
    else:
        typer.echo("# vLLM peer skipped: no --vllm-python given (smoke run; the peer venv is not a dependency)")


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch  # deferred: ~1.2 s, which `keepwarm --help` must not pay

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores ({cpu}), {gpu}, torch {torch.__version__}, threads {torch.get_num_threads()}"


def vllm_env(vllm_python: str) -> dict[str, str]:
    """vLLM CPU's best configuration measured on this 2-core machine (see docs/benchmarks.md): a 1 GiB KV cache,
    OpenMP threads bound to both cores, Intel OpenMP preloaded (+5-30%), the compile cache reusable."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
           "VLLM_USE_AOT_COMPILE": "0"}
    iomp = Path(vllm_python).resolve().parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file() and "LD_PRELOAD" not in os.environ:
        env["LD_PRELOAD"] = str(iomp)
    for var in ("PYTHONPATH", "OMP_NUM_THREADS", "KEEPWARM_KERNELS"):
        env.pop(var, None)
    return env


def _run_vllm_peer(vllm_python: str, spec: dict) -> list[dict]:
    peer = Path(__file__).with_name("peer_vllm.py")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = vllm_env(vllm_python)
    try:
        proc = subprocess.run([vllm_python, str(peer), f.name], capture_output=True, text=True, env=env,
                              timeout=3600, cwd=tempfile.gettempdir())
    finally:
        os.unlink(f.name)
    results = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            results.append(json.loads(line))
    if proc.returncode != 0 or not any(r.get("event") == "result" for r in results):
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        typer.echo(f"vLLM peer failed (exit {proc.returncode}):\n{tail}", err=True)
    return results


def _keepwarm_throughput(model: str | None, dtype: str, scheme: str, ns: list[int], max_tokens: int, repeats: int,
                         rows: list[dict], tp_size: int = 1, pp_size: int = 1) -> tuple[str, list[list[int]]]:
    """keepwarm's rows for one weight scheme (from disk: the arena a daemon would build); returns the model
    directory and the prompts for the other engines. ``tp_size`` > 1: tensor parallel, the rows also say how long
    rank 0 spent in all-reduces per step; ``pp_size`` > 1: pipeline stages."""
    from keepwarm.worker.llm import LLM  # deferred: torch (~1.2 s), which `keepwarm --help` must not pay

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, max_model_len=2048, max_num_seqs=max(ns), quantization=scheme, daemon=False,
              tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size)
    tp = llm.llm_engine.tp
    init_s = time.perf_counter() - t0
    model_dir = str(llm.llm_engine.model_dir)
    prompts = bench_prompts(llm.get_tokenizer(), max(ns))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    typer.echo(f"# model: {model_dir}, dtype {dtype}, weights {scheme} ({llm.llm_engine.loaded.nbytes / 1e6:.0f} MB "
               f"arena), prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, max_tokens {max_tokens}, "
               f"greedy, ignore_eos")
    typer.echo(f"keepwarm init {init_s:.2f}s")
    for n in ns:
        batch = [{"prompt_token_ids": p} for p in prompts[:n]]
        llm.generate(batch, params)  # warm-up of the same shape
        best, best_cpu, tokens, reduce_ms = float("inf"), float("inf"), 0, None
        for _ in range(repeats):
            llm.llm_engine.block_manager.reset_prefix_cache()  # measure compute, not cache hits
            before = (tp.stats.all_reduce_seconds, tp.stats.steps) if tp is not None else (0.0, 0)
            t, c = time.perf_counter(), time.process_time()
            outs = llm.generate(batch, params)
            # CPU seconds of every thread: the figure to compare when other processes share the cores.
            elapsed = time.perf_counter() - t
            if elapsed < best and tp is not None and tp_size > 1:
                reduce_ms = 1e3 * (tp.stats.all_reduce_seconds - before[0]) / max(1, tp.stats.steps - before[1])
            best, best_cpu = min(best, elapsed), min(best_cpu, time.process_time() - c)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"engine": "keepwarm", "quantization": scheme, "concurrency": n, "output_tokens": tokens,
                     "seconds": best, "tokens_per_s": tokens / best, "cpu_seconds": best_cpu,
                     "weight_bytes": llm.llm_engine.loaded.nbytes, "tensor_parallel_size": tp_size,
                     "pipeline_parallel_size": pp_size,
                     "all_reduce_ms_per_step": reduce_ms})
        extra = f"; all-reduce {reduce_ms:.2f} ms/step on rank 0" if reduce_ms is not None else ""
        tp_note = (f" tp={tp_size}" if tp_size > 1 else "") + (f" pp={pp_size}" if pp_size > 1 else "")
        cpu_of = " of rank 0" if tp_size * pp_size > 1 else ""
        typer.echo(f"keepwarm {scheme:<8}{tp_note} n={n:<3} {tokens / best:8.1f} tok/s  ({tokens} tokens in "
                   f"{best:.2f}s; {tokens / best_cpu:.1f} tok per CPU-s{cpu_of}{extra})")
    llm.close()
    return model_dir, prompts


@bench_app.command()
def throughput(
    model: Annotated[str | None, typer.Option(help="Model directory (default: bundled SmolLM2).")] = None,
    concurrency: Annotated[str, typer.Option(help="Comma-separated numbers of concurrent requests.")] = "1,8,32",
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 128,
    dtype: Annotated[str, typer.Option()] = "bfloat16",
    repeats: Annotated[int, typer.Option()] = 2,
    threads: Annotated[int, typer.Option(help="torch threads (2-core machine: 2).")] = 2,
    hf: Annotated[bool, typer.Option("--hf/--no-hf", help="Also run transformers' generate.")] = True,
    vllm_python: Annotated[str | None, typer.Option(
        "--vllm-python", help="Python of a venv with vllm-cpu installed: also run vLLM's offline LLM.")] = None,
    quantization: Annotated[str, typer.Option(
        "--quantization", "-q", help="Weight schemes, comma-separated (auto, none, int8, fp8, int4, ...): one "
                                     "keepwarm row set each.")] = "auto",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results here as JSON.")] = None,
    smoke: Annotated[bool, typer.Option("--smoke", help=SMOKE_HELP)] = False,
    tensor_parallel_size: Annotated[int, typer.Option(
        "--tensor-parallel-size", "-tp", help="keepwarm across this many processes (--threads is the total).")] = 1,
    pipeline_parallel_size: Annotated[int, typer.Option(
        "--pipeline-parallel-size", "-pp", help="keepwarm's layers in this many stages, one process each.")] = 1,
) -> None:
    """Offline throughput (output tokens/s, greedy, ignore_eos) for 1, 8 and 32 concurrent requests."""
    import torch  # deferred: ~1.2 s, which `keepwarm --help` must not pay

    if smoke:
        smoke_start(vllm_python)
        model, concurrency, max_tokens, repeats, vllm_python = str(smoke_model()), "1,2", 4, 1, None
    torch.set_num_threads(threads)
    ns = [int(x) for x in concurrency.split(",")]
    rows: list[dict] = []
    typer.echo(f"# machine: {machine_line()}")
    model_dir, prompts = "", list[list[int]]()
    for scheme in quantization.split(","):
        model_dir, prompts = _keepwarm_throughput(model, dtype, scheme, ns, max_tokens, repeats, rows,
                                                  tensor_parallel_size, pipeline_parallel_size)

    if hf:
        import transformers  # deferred: ~0.7 s, for --hf alone

        hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        hf_model.generation_config.eos_token_id = None  # ignore_eos
        for n in ns:
            batch = prompts[:n]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])

            def run(ids=ids, mask=mask, width=width, n=n) -> int:
                with torch.inference_mode():
                    out = hf_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                                            pad_token_id=0)
                return (out.shape[1] - width) * n

            run()
            t = time.perf_counter()
            tokens = run()
            dt = time.perf_counter() - t
            rows.append({"engine": "transformers", "concurrency": n, "output_tokens": tokens, "seconds": dt,
                         "tokens_per_s": tokens / dt})
            typer.echo(f"transformers  n={n:<3} {tokens / dt:8.1f} tok/s  ({tokens} tokens in {dt:.2f}s)")
        del hf_model

    if vllm_python:
        # Eager mode: as fast as compiled in bf16 on this machine and it starts 3x sooner (measured).
        spec = {"model": model_dir, "dtype": dtype, "max_model_len": 2048, "max_tokens": max_tokens,
                "prompts": prompts, "concurrency": ns, "repeats": repeats, "llm_kwargs": {"enforce_eager": True}}
        for r in _run_vllm_peer(vllm_python, spec):
            if r.get("event") == "ready":
                typer.echo(f"vllm init {r['init_s']:.2f}s")
            elif r.get("event") == "result":
                rows.append({"engine": "vllm", **{k: r[k] for k in
                                                  ("concurrency", "output_tokens", "seconds", "tokens_per_s")}})
                typer.echo(f"vllm          n={r['concurrency']:<3} {r['tokens_per_s']:8.1f} tok/s  "
                           f"({r['output_tokens']} tokens in {r['seconds']:.2f}s)")
    if json_out:
        json_out.write_text(json.dumps({"machine": machine_line(), "model": model_dir, "dtype": dtype,
                                        "max_tokens": max_tokens, "rows": rows}, indent=2) + "\n")


# -- MoE: a tiny random Mixtral through `throughput` ------------------------------------------------------------
@bench_app.command()
def moe(
    concurrency: Annotated[str, typer.Option(help="Comma-separated numbers of concurrent requests.")] = "1,8,32",
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 64,
    dtype: Annotated[str, typer.Option()] = "bfloat16",
    repeats: Annotated[int, typer.Option()] = 2,
    threads: Annotated[int, typer.Option(help="torch threads (2-core machine: 2).")] = 2,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results here as JSON.")] = None,
) -> None:
    """Offline throughput of a tiny random Mixtral (hidden 256, 4 layers, 8 experts, top-2; made once under
    $KEEPWARM_HOME/models) against transformers' generate, in the same run."""
    # deferred: torch and transformers (~2 s), which `keepwarm --help` must not pay
    from keepwarm.worker.models.random_model import make_random_model

    path = keepwarm_home() / "models" / "tiny-mixtral-8x2"
    if not (path / "config.json").is_file():
        make_random_model(path, "mixtral", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                          max_position_embeddings=4096, dtype="bfloat16")
    throughput(model=str(path), concurrency=concurrency, max_tokens=max_tokens, dtype=dtype, repeats=repeats,
               threads=threads, hf=True, vllm_python=None, json_out=json_out)


if __name__ == "__main__":
    bench_app()


# -- quality: perplexity per quantization scheme -----------------------------------------------------------------
@bench_app.command()
def quality(
    model: Annotated[str | None, typer.Option(help="Model directory (default: bundled SmolLM2).")] = None,
    schemes: Annotated[str, typer.Option(help="Quantization schemes, comma-separated.")] = "none,int8,fp8,int4",
    dtype: Annotated[str, typer.Option()] = "bfloat16",
    threads: Annotated[int, typer.Option()] = 2,
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
    smoke: Annotated[bool, typer.Option("--smoke", help=SMOKE_HELP)] = False,
) -> None:
    """Perplexity on a fixed held-out text for each weight quantization scheme (and an fp8 KV cache), plus how
    often greedy output agrees with the unquantized model."""
    # deferred, these two: torch (~1.2 s), which `keepwarm --help` must not pay
    import torch

    from keepwarm.worker.llm import LLM  # deferred (above)

    max_tokens, text_tokens = 64, None
    if smoke:
        smoke_start()
        model, max_tokens, text_tokens = str(smoke_model()), 4, 128
    torch.set_num_threads(threads)
    names = schemes.split(",")
    variants = [(s, "auto") for s in names] + [(names[0], "fp8")]  # the fp8 KV cache over the first scheme
    rows = []
    reference_tokens: list[list[int]] | None = None
    typer.echo(f"# machine: {machine_line()}")
    for scheme, kv in variants:
        llm = LLM(model=model, dtype=dtype, quantization=scheme, kv_cache_dtype=kv, daemon=False,
                  max_model_len=2048)
        tok = llm.get_tokenizer()
        ids = tok.encode(HELDOUT_TEXT)[:text_tokens]
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        lps = [x[t].logprob for x, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]  # vLLM's dicts
        ppl = math.exp(-sum(lps) / len(lps))
        prompts = bench_prompts(tok, 8)
        greedy = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))]
        if reference_tokens is None:
            reference_tokens = greedy
        agree = sum(a == b for x, y in zip(greedy, reference_tokens, strict=True) for a, b in zip(x, y, strict=True))
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                  for x, y in zip(greedy, reference_tokens, strict=True)]
        row = {"quantization": scheme, "kv_cache_dtype": kv, "tokens": len(lps), "perplexity": ppl,
               "weight_bytes": llm.llm_engine.loaded.nbytes,
               "greedy_token_agreement": agree / sum(map(len, greedy)),
               "greedy_identical_prefix_mean": sum(prefix) / len(prefix)}
        rows.append(row)
        typer.echo(f"{scheme:8s} kv={kv:4s} ppl {ppl:8.3f}  weights {row['weight_bytes'] / 1e6:7.1f} MB  "
                   f"greedy agreement {row['greedy_token_agreement']:.1%}  "
                   f"identical prefix {row['greedy_identical_prefix_mean']:.1f}/{max_tokens}")
        del llm
    if json_out:
        json_out.write_text(json.dumps({"machine": machine_line(), "dtype": dtype, "rows": rows}, indent=2) + "\n")


# -- attach: cold load vs daemon preload vs warm attach ------------------------------------------------------------
_ENGINE_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads({threads})
from keepwarm import LLM
t1 = time.perf_counter()
llm = LLM(model={model!r}, dtype={dtype!r}, quantization={quantization!r}, daemon={daemon!r}, max_model_len=512,
          num_gpu_blocks=64)
t2 = time.perf_counter()
loaded = llm.llm_engine.loaded
att = loaded.attachment
print(json.dumps({{"import_s": t1 - t0, "engine_s": t2 - t1, "load_s": loaded.seconds, "source": loaded.source,
                  "attach_s": att.seconds if att else None, "bytes": loaded.nbytes}}))
llm.close()
"""


def drop_page_cache(files: list[Path]) -> str:
    """Evict the files from the page cache (posix_fadvise DONTNEED: no root needed for clean pages)."""
    os.sync()
    if not _SMOKE["on"]:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "dropped (drop_caches)"
        except OSError:
            pass
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "evicted (posix_fadvise DONTNEED)"


def _probe(model: str, dtype: str, daemon: bool, env: dict[str, str], threads: int, quantization: str = "none",
           ) -> dict:
    code = _ENGINE_PROBE.format(model=model, dtype=dtype, daemon=daemon, threads=threads, quantization=quantization)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"probe failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@bench_app.command()
def attach(
    models: Annotated[str, typer.Option(help="Comma-separated: 'smollm2', '1b', '8b' or model directories.")
                      ] = "smollm2,1b",
    dtype: Annotated[str, typer.Option()] = "bfloat16",
    quantization: Annotated[str, typer.Option("--quantization", "-q", help="What the loads make of the checkpoint "
                                              "(none, int8, int4, fp8): a quantized preload also quantizes.")
                            ] = "none",
    repeats: Annotated[int, typer.Option(help="Worker attaches per model (the median is reported).")] = 3,
    threads: Annotated[int, typer.Option()] = 2,
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
    smoke: Annotated[bool, typer.Option("--smoke", help=SMOKE_HELP)] = False,
) -> None:
    """Per model: raw read of the files (cat > /dev/null), cold load into the engine, daemon preload (time, GB/s),
    and worker attach time. Page cache is dropped before each cold measurement (or evicted per file)."""
    if smoke:
        smoke_start()
        models, repeats = str(smoke_model()), 1

    # deferred, these three: torch, zmq and psutil, which `keepwarm --help` must not pay
    from keepwarm.daemon.client import start_daemon
    from keepwarm.weights.checkpoint import Checkpoint  # deferred (above)
    from keepwarm.worker.models.random_model import LARGE_PRESETS, make_large_random_model  # deferred (above)

    typer.echo(f"# machine: {machine_line()}")
    rows = []
    for spec in models.split(","):
        if spec == "smollm2":
            path = default_model()
        elif spec in LARGE_PRESETS:
            typer.echo(f"(generating a random {spec} Llama once under {keepwarm_home() / 'bench-models'})")
            path = make_large_random_model(keepwarm_home() / "bench-models" / f"random-llama-{spec}", spec, dtype)
        else:
            path = Path(spec)
        ckpt = Checkpoint(path)
        files = ckpt.files
        nbytes = sum(f.stat().st_size for f in files)
        params = ckpt.config.num_parameters()
        cache_note = drop_page_cache(files)
        t = time.perf_counter()
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
        raw_s = time.perf_counter() - t
        drop_page_cache(files)
        rt = Path(tempfile.mkdtemp(prefix="kwb-", dir="/tmp"))
        env = {**os.environ, "KEEPWARM_RUNTIME_DIR": str(rt), "OMP_NUM_THREADS": str(threads)}
        cold = _probe(str(path), dtype, False, env, threads, quantization)
        warm_disk = _probe(str(path), dtype, False, env, threads, quantization)  # page cache now warm
        client = start_daemon(rt)
        try:
            drop_page_cache(files)
            t = time.perf_counter()
            reply = client.preload(str(path), quantization, dtype)
            preload_s = time.perf_counter() - t
            attaches = [_probe(str(path), dtype, True, env, threads, quantization) for _ in range(repeats)]
            assert all(a["source"] == "daemon" for a in attaches)
            status = client.status()
        finally:
            client.shutdown()
            client.close()
        att_s = statistics.median(a["attach_s"] for a in attaches)
        att_load = statistics.median(a["load_s"] for a in attaches)
        row = {"model": path.name, "quantization": quantization, "params": params, "checkpoint_bytes": nbytes,
               "arena_bytes": reply.bytes,
               "page_cache": cache_note, "raw_read_s": raw_s, "raw_read_gbps": nbytes / raw_s / 1e9,
               "cold_disk_load_s": cold["load_s"], "warm_disk_load_s": warm_disk["load_s"],
               "preload_s": preload_s, "preload_gbps": nbytes / preload_s / 1e9,
               "attach_s": att_s, "attach_and_build_s": att_load, "attaches": attaches,
               "daemon_preloads": status["counters"]["preloads"], "import_s": cold["import_s"]}
        rows.append(row)
        typer.echo(f"{path.name} ({quantization}): {params / 1e9:.2f}B params, {nbytes / 1e9:.2f} GB on disk; page "
                   f"cache {cache_note}")
        typer.echo(f"  raw read (cat > /dev/null)         {raw_s:7.2f} s  {row['raw_read_gbps']:6.2f} GB/s")
        typer.echo(f"  cold load from disk into engine    {cold['load_s']:7.2f} s  (page cache warm: "
                   f"{warm_disk['load_s']:.2f} s)")
        typer.echo(f"  daemon preload                     {preload_s:7.2f} s  {row['preload_gbps']:6.2f} GB/s")
        typer.echo(f"  worker attach (median of {repeats})       {att_s * 1e3:7.1f} ms  (attach + model build "
                   f"{att_load * 1e3:.1f} ms)")
    if json_out:
        json_out.write_text(json.dumps({"machine": machine_line(), "dtype": dtype, "rows": rows}, indent=2) + "\n")
