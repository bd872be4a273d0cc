"""`keepwarm bench lora`: throughput with 0, 1, 4 and 8 distinct LoRA adapters in one batch against the base model
alone, for the stacked-slot kernels and for a Python loop over adapters (the baseline they replace)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from keepwarm.cli.bench import SMOKE_HELP, bench_app, bench_prompts, machine_line, smoke_model, smoke_start
from keepwarm.worker.sampling_params import SamplingParams


def write_random_adapter(out: Path, model_config, rank: int, seed: int) -> str:
    """A PEFT-format LoRA adapter (all seven projections) with random weights, without needing peft."""
    # deferred, these three: torch (~1.2 s), which `keepwarm --help` must not pay
    import torch
    from safetensors.torch import save_file  # deferred (above)

    from keepwarm.worker.lora import LORA_MODULES, module_dims  # deferred (above)

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for module, (path, _) in LORA_MODULES.items():
            fan_in, fan_out = module_dims(model_config, module)
            prefix = f"base_model.model.model.layers.{layer}.{path.split('.')[0]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) * fan_in ** -0.5)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.01)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_MODULES),
        "bias": "none", "use_rslora": False}))
    return str(out)


def _loop_shrink(x, a_stacked, token_slots, rank, num_slots):
    import torch  # deferred: ~1.2 s, which `keepwarm --help` must not pay

    out = torch.zeros(x.shape[0], a_stacked.shape[0], dtype=x.dtype, device=x.device)
    groups = a_stacked.shape[0] // (num_slots * rank)
    for s in token_slots.unique().tolist():
        if s < 0:
            continue
        rows = (token_slots == s).nonzero()[:, 0]
        for grp in range(groups):
            cols = slice((grp * num_slots + s) * rank, (grp * num_slots + s + 1) * rank)
            out[rows, cols] = x[rows] @ a_stacked[cols].t()
    return out


def _loop_expand_for(manager):
    """A Python loop over the batch's adapters: for each, only its tokens' rows and its R columns of B."""
    def expand(y, buf, b_stacked, offset):
        slots, R = manager.token_slots, manager.max_rank
        n = b_stacked.shape[0]
        for s in slots.unique().tolist():
            if s < 0:
                continue
            rows = (slots == s).nonzero()[:, 0]
            cols = slice(s * R, (s + 1) * R)
            y[rows, offset:offset + n] += buf[rows][:, cols] @ b_stacked[:, cols].t()
        return y

    return expand


@bench_app.command()
def lora(
    model: Annotated[str | None, typer.Option(help="Model directory (default: bundled SmolLM2).")] = None,
    batch: Annotated[int, typer.Option(help="Concurrent requests.")] = 32,
    adapters: Annotated[str, typer.Option(help="Distinct adapters per batch.")] = "0,1,4,8",
    rank: Annotated[int, typer.Option()] = 16,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 64,
    dtype: Annotated[str, typer.Option()] = "bfloat16",
    threads: Annotated[int, typer.Option()] = 2,
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
    smoke: Annotated[bool, typer.Option("--smoke", help=SMOKE_HELP)] = False,
) -> None:
    """Output tokens/s of one batch of requests spread over k distinct adapters (k = 0: the base model)."""
    # deferred, these four: torch (~1.2 s), which `keepwarm --help` must not pay
    import torch

    from keepwarm import kernels  # deferred (above)
    from keepwarm.worker.llm import LLM  # deferred (above)
    from keepwarm.worker.lora import LoRARequest  # deferred (above)

    if smoke:
        smoke_start()
        model, batch, adapters, rank, max_tokens = str(smoke_model()), 4, "0,1,2", 4, 4
    torch.set_num_threads(threads)
    ks = [int(k) for k in adapters.split(",")]
    typer.echo(f"# machine: {machine_line()}")
    base = LLM(model=model, dtype=dtype, max_model_len=1024, max_num_seqs=batch, daemon=False)
    llm = LLM(model=model, dtype=dtype, max_model_len=1024, max_num_seqs=batch, enable_lora=True,
              max_loras=max(max(ks), 1), max_lora_rank=rank, daemon=False)
    mc = llm.llm_engine.model_config
    tmp = Path(tempfile.mkdtemp(prefix="kw-lora-bench-"))
    paths = [write_random_adapter(tmp / f"a{i}", mc, rank, i) for i in range(max(ks))]
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    prompts = [{"prompt_token_ids": p} for p in bench_prompts(llm.get_tokenizer(), batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run(engine_llm, loras) -> float:
        engine_llm.generate(prompts[:2], params, lora_request=loras[:2] if isinstance(loras, list) else loras)
        best = float("inf")
        for _ in range(2):
            engine_llm.llm_engine.block_manager.reset_prefix_cache()
            t = time.perf_counter()
            outs = engine_llm.generate(prompts, params, lora_request=loras)
            best = min(best, time.perf_counter() - t)
        return sum(len(o.outputs[0].token_ids) for o in outs) / best

    rows = [{"variant": "base model, LoRA disabled", "adapters": 0, "tokens_per_s": run(base, None)}]
    typer.echo(f"base model (LoRA off)          {rows[0]['tokens_per_s']:7.1f} tok/s")
    stacked = {name: kernels.registry.impl(name, "torch") for name in ("lora_shrink", "lora_expand")}
    for impl in ("stacked", "loop"):
        if impl == "loop":
            kernels.register("lora_shrink", "torch", _loop_shrink)
            kernels.register("lora_expand", "torch", _loop_expand_for(llm.llm_engine.lora_manager))
        try:
            for k in ks:
                loras = [requests[i % k] if k else None for i in range(batch)]
                tps = run(llm, loras)
                rows.append({"variant": impl, "adapters": k, "tokens_per_s": tps})
                typer.echo(f"{impl:7s} {k} distinct adapter(s)   {tps:7.1f} tok/s")
        finally:
            for name, fn in stacked.items():
                kernels.register(name, "torch", fn)
    if json_out:
        json_out.write_text(json.dumps({"machine": machine_line(), "batch": batch, "rank": rank,
                                        "max_tokens": max_tokens, "rows": rows}, indent=2) + "\n")
