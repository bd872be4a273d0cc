"""`keepwarm bench structured`: what constrained decoding costs. The grammar mask per token (llguidance on the
served vocabulary, a JSON schema), and offline throughput at 8 streams with 0%, 50% and 100% of the requests
constrained by that schema."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from keepwarm.cli.bench import bench_app, bench_prompts, machine_line
from keepwarm.worker.sampling_params import SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["title", "year", "tags", "summary"],
          "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "summary": {"type": "string"}}}


def mask_cost(llm: Any, compiled: Any, prompts: list[list[int]], max_tokens: int) -> dict:
    """Mask fill + token accept per token, over the tokens the model really generates under the schema."""
    import torch  # deferred: ~1.2 s, which `keepwarm --help` must not pay

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]],
                        SamplingParams(temperature=0, max_tokens=max_tokens, structured=compiled))
    vocab = llm.llm_engine.model_config.vocab_size
    row = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    fill, accept = [], []
    for out in outs:
        m = compiled.matcher()
        for t in out.outputs[0].token_ids:
            t0 = time.perf_counter()
            m.fill_bitmask(row)
            t1 = time.perf_counter()
            m.accept(t)
            fill.append(t1 - t0)
            accept.append(time.perf_counter() - t1)
    return {"tokens": len(fill), "fill_us_median": statistics.median(fill) * 1e6,
            "fill_us_mean": statistics.fmean(fill) * 1e6, "accept_us_median": statistics.median(accept) * 1e6}


@bench_app.command()
def structured(
    model: Annotated[str | None, typer.Option(help="Model directory (default: bundled SmolLM2).")] = None,
    streams: Annotated[int, typer.Option(help="Concurrent requests.")] = 8,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 96,
    dtype: Annotated[str, typer.Option()] = "bfloat16",
    repeats: Annotated[int, typer.Option()] = 2,
    threads: Annotated[int, typer.Option(help="torch threads (2-core machine: 2).")] = 2,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results here as JSON.")] = None,
) -> None:
    """Mask cost per token and throughput with 0/50/100% of the streams constrained by a JSON schema."""
    # deferred, these three: torch (~1.2 s), which `keepwarm --help` must not pay
    import torch

    from keepwarm.worker.llm import LLM  # deferred (above)
    from keepwarm.worker.structured import StructuredOutputs  # deferred (above)

    torch.set_num_threads(threads)
    llm = LLM(model=model, dtype=dtype, max_model_len=1024, max_num_seqs=streams)
    engine = llm.llm_engine
    t0 = time.perf_counter()
    compiled = engine.grammar_compiler.compile(StructuredOutputs("json", SCHEMA))
    compile_s = time.perf_counter() - t0  # includes indexing the vocabulary once
    prompts = bench_prompts(llm.get_tokenizer(), streams)
    typer.echo(f"# machine: {machine_line()}")
    typer.echo(f"# model: {engine.model_dir}, dtype {dtype}, {streams} streams, max_tokens {max_tokens}, greedy; "
               f"first compile (vocabulary index + schema) {compile_s:.2f}s")
    cost = mask_cost(llm, compiled, prompts, max_tokens)
    typer.echo(f"mask per token: fill {cost['fill_us_median']:.1f} us median ({cost['fill_us_mean']:.1f} mean), "
               f"accept {cost['accept_us_median']:.1f} us median, over {cost['tokens']} generated tokens")
    rows = []
    for share in (0.0, 0.5, 1.0):
        n_con = round(streams * share)
        # Free rows ignore EOS so every stream runs max_tokens; constrained rows end when their JSON closes.
        params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured=compiled) if i < n_con
                  else SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                  for i in range(streams)]
        best = None
        for _ in range(repeats + 1):  # the first run warms up
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            dt = time.perf_counter() - t0
            ntok = sum(len(o.outputs[0].token_ids) for o in outs)
            best = max(best or 0.0, ntok / dt)
        valid = sum(1 for o in outs[:n_con] if _is_json(o.outputs[0].text))
        rows.append({"constrained": share, "tokens_per_s": best, "tokens": ntok, "valid_json": valid})
        typer.echo(f"{int(share * 100):3d}% constrained ({n_con}/{streams}): {best:7.1f} output tok/s "
                   f"({ntok} tokens; {valid}/{n_con} constrained outputs parse as JSON)")
    if json_out:
        json_out.write_text(json.dumps({"machine": machine_line(), "mask": cost, "rows": rows}, indent=1))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
