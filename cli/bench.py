"""`keepwarm bench ...`: benchmarks that print figures (never asserted in tests; see docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

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


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores ({cpu}), {gpu}, torch {torch.__version__}, threads {torch.get_num_threads()}"


def _run_vllm_peer(vllm_python: str, spec: dict) -> list[dict]:
    peer = Path(__file__).with_name("peer_vllm.py")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")}
    env.pop("PYTHONPATH", None)
    try:
        proc = subprocess.run([vllm_python, str(peer), f.name], capture_output=True, text=True, env=env,
                              timeout=3600)
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
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results here as JSON.")] = None,
) -> None:
    """Offline throughput (output tokens/s, greedy, ignore_eos) for 1, 8 and 32 concurrent requests."""
    import torch

    from keepwarm import LLM, SamplingParams

    torch.set_num_threads(threads)
    ns = [int(x) for x in concurrency.split(",")]
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, max_model_len=2048, max_num_seqs=max(ns))
    init_s = time.perf_counter() - t0
    model_dir = str(llm.llm_engine.model_dir)
    prompts = bench_prompts(llm.get_tokenizer(), max(ns))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows: list[dict] = []
    typer.echo(f"# machine: {machine_line()}")
    typer.echo(f"# model: {model_dir}, dtype {dtype}, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
               f"tokens, max_tokens {max_tokens}, greedy, ignore_eos")
    typer.echo(f"keepwarm init {init_s:.2f}s")
    for n in ns:
        batch = [{"prompt_token_ids": p} for p in prompts[:n]]
        llm.generate(batch, params)  # warm-up of the same shape
        llm.llm_engine.block_manager.reset_prefix_cache()
        best, tokens = float("inf"), 0
        for _ in range(repeats):
            llm.llm_engine.block_manager.reset_prefix_cache()  # measure compute, not cache hits
            t = time.perf_counter()
            outs = llm.generate(batch, params)
            best = min(best, time.perf_counter() - t)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"engine": "keepwarm", "concurrency": n, "output_tokens": tokens, "seconds": best,
                     "tokens_per_s": tokens / best})
        typer.echo(f"keepwarm      n={n:<3} {tokens / best:8.1f} tok/s  ({tokens} tokens in {best:.2f}s)")
    del llm

    if hf:
        import transformers

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
        spec = {"model": model_dir, "dtype": dtype, "max_model_len": 2048, "max_tokens": max_tokens,
                "prompts": prompts, "concurrency": ns, "repeats": repeats}
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


if __name__ == "__main__":
    bench_app()
