"""`keepwarm bench profile`: where the time of one steady decode step goes.

Per batch size the engine runs that many greedy requests past their prefill, then K decode steps bare, K with every
phase timed, K bare again: the step time is the mean of the bare brackets, the split comes from the timed steps.
Rules: each phase is timed exclusively (a nested phase counts once, in the inner one), on the wall clock and on the
process CPU clock; the timers are wrappers installed on the engine's parts for the timed steps only and removed
afterwards, so a process that is not profiling runs no timing code; a wrapper that no longer finds its method (a
rename) is an error, not a silently missing line. The API side per token is measured apart, after each timed step.
The phases and the figures: docs/benchmarks.md, "Where a decode step goes"."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from keepwarm.cli.bench import SMOKE_HELP, bench_app, bench_prompts, machine_line, smoke_model, smoke_start
from keepwarm.worker.detokenizer import IncrementalDetokenizer
from keepwarm.worker.sampling_params import SamplingParams

PHASES = ("scheduling", "input preparation", "forward: matmuls", "forward: attention", "forward: norms+rotary",
          "forward: LoRA", "forward: other", "logits", "sampling", "detokenization", "stop checks", "outputs",
          "engine other")


@dataclass
class _Frame:
    label: str
    opaque: bool  # calls nested in an opaque phase count as part of it (the head's matmul is "logits")
    wall0: int
    cpu0: int
    child_wall: int = 0
    child_cpu: int = 0


@dataclass
class StepTimer:
    """Exclusive wall and process-CPU nanoseconds per phase label."""

    wall: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, int] = field(default_factory=dict)
    clock: Callable[[], int] = time.perf_counter_ns
    cpu_clock: Callable[[], int] = time.process_time_ns
    _stack: list[_Frame] = field(default_factory=list)

    def wrap(self, fn: Callable[..., Any], label: str, opaque: bool = False) -> Callable[..., Any]:
        stack, clock, cpu_clock = self._stack, self.clock, self.cpu_clock

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if stack and stack[-1].opaque:
                return fn(*args, **kwargs)
            frame = _Frame(label, opaque, clock(), cpu_clock())
            stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()
                wall, cpu = clock() - frame.wall0, cpu_clock() - frame.cpu0
                self.wall[label] = self.wall.get(label, 0) + wall - frame.child_wall
                self.cpu[label] = self.cpu.get(label, 0) + cpu - frame.child_cpu
                if stack:
                    stack[-1].child_wall += wall
                    stack[-1].child_cpu += cpu
        return timed


@contextmanager
def instrumented(engine: Any, timer: StepTimer) -> Iterator[None]:
    """Install ``timer``'s wrappers on ``engine``'s parts (``targets``: method -> phase); remove them on exit."""
    # deferred, these two: torch (~1.2 s), which `keepwarm --help` must not pay
    from keepwarm import kernels
    from keepwarm.worker.lora import LoRALayer  # deferred (above)

    runner = engine.runner
    targets: list[tuple[Any, str, str, bool]] = [
        (engine, "step", "engine other", False),
        (engine.scheduler, "schedule", "scheduling", False),
        (runner, "execute", "input preparation", False),
        (runner, "host_inputs", "input preparation", False),
        (runner, "device_inputs", "input preparation", False),
        (runner, "_forward", "forward: other", False),
        (runner.model, "compute_logits", "logits", True),
        (kernels, "linear", "forward: matmuls", False),
        (kernels, "write_kv_cache", "forward: attention", False),
        (kernels, "paged_attention", "forward: attention", False),
        (kernels, "rms_norm", "forward: norms+rotary", False),
        (kernels, "fused_add_rms_norm", "forward: norms+rotary", False),
        (kernels, "rotary_embedding", "forward: norms+rotary", False),
        (LoRALayer, "apply", "forward: LoRA", True),
        (engine.sampler, "sample", "sampling", False),
        (IncrementalDetokenizer, "step", "detokenization", False),
        (engine.output_processor, "process_token", "stop checks", False),
        (engine.output_processor, "make_output", "outputs", False),
    ]
    saved: list[tuple[Any, str, Any, bool]] = []
    try:
        for obj, name, label, opaque in targets:
            original = getattr(obj, name)  # AttributeError: the profiler no longer matches the engine
            own = name in vars(obj)
            saved.append((obj, name, vars(obj).get(name), own))
            setattr(obj, name, timer.wrap(original, label, opaque))
        yield
    finally:
        for obj, name, original, own in reversed(saved):
            if own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)


class ApiSide:
    """The server's per-token work after a step, on an event loop of our own (see the module docstring).

    Two figures: ``work`` is the per-output work itself (DeltaTracker, the chunk, sse), timed inside the consumer;
    ``handoff`` is the rest of the loop's time per step (call_soon_threadsafe, the queues, waking the consumer),
    which includes one ``run_until_complete`` per step that a server's ever-running loop does not pay."""

    def __init__(self) -> None:
        from keepwarm.worker.http import pipeline  # deferred: the API stack and torch, which `--help` must not pay

        self.pipeline = pipeline
        self.loop = asyncio.new_event_loop()
        self.queues: dict[str, asyncio.Queue] = {}
        self.trackers: dict[str, Any] = {}
        self.work = [0, 0]  # wall, cpu ns
        self.total = [0, 0]

    async def _consume(self, ids: list[str]) -> None:
        for rid in ids:
            out = await self.queues[rid].get()
            w0, c0 = _clocks()
            for c in out.outputs:
                d = self.trackers[rid].advance(c.index, c)
                chunk = {"id": rid, "object": "chat.completion.chunk", "created": 0, "model": "m",
                         "choices": [{"index": c.index, "delta": {"content": d.text}, "logprobs": None,
                                      "finish_reason": None}]}
                self.pipeline.sse(chunk)
            w1, c1 = _clocks()
            self.work[0] += w1 - w0
            self.work[1] += c1 - c0

    def feed(self, outputs: list[Any]) -> None:
        w0, c0 = _clocks()
        for out in outputs:
            if out.request_id not in self.queues:
                self.queues[out.request_id] = asyncio.Queue()
                self.trackers[out.request_id] = self.pipeline.DeltaTracker(None)
            self.loop.call_soon_threadsafe(self.queues[out.request_id].put_nowait, out)
        self.loop.run_until_complete(self._consume([o.request_id for o in outputs]))
        w1, c1 = _clocks()
        self.total[0] += w1 - w0
        self.total[1] += c1 - c0

    def close(self) -> None:
        self.loop.close()


def _clocks() -> tuple[int, int]:
    return time.perf_counter_ns(), time.process_time_ns()


def _bare_steps(engine: Any, k: int) -> tuple[int, int]:
    w0, c0 = _clocks()
    for _ in range(k):
        engine.step()
    w1, c1 = _clocks()
    return w1 - w0, c1 - c0


def _start_decoding(engine: Any, prompts: list[list[int]], max_tokens: int) -> None:
    """Add one greedy request per prompt and step until every one has its first token (prefill done)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"profile-{len(prompts)}-{i}", p, params)
    while any(seq.num_output_tokens == 0 for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def profile_batch(engine: Any, prompts: list[list[int]], steps: int, warmup: int) -> dict[str, Any]:
    """One batch size: the bracketed bare step time, the timed split and the API side, per step / per token."""
    n = len(prompts)
    _start_decoding(engine, prompts, warmup + 3 * steps + 2)
    for _ in range(warmup):
        engine.step()
    ctx0 = max(seq.num_tokens for seq in engine.scheduler.running)
    bare_a = _bare_steps(engine, steps)
    timer, api = StepTimer(), ApiSide()
    with instrumented(engine, timer):
        t0 = _clocks()
        for _ in range(steps):
            api.feed(engine.step())
        t1 = _clocks()
    api.close()
    bare_b = _bare_steps(engine, steps)
    ctx1 = max(seq.num_tokens for seq in engine.scheduler.running)
    while engine.has_unfinished_requests():
        engine.step()
    ms = 1e-6 / steps
    return {
        "batch": n, "steps": steps, "context": [ctx0, ctx1],
        "step_ms": {"wall": (bare_a[0] + bare_b[0]) / 2 * ms, "cpu": (bare_a[1] + bare_b[1]) / 2 * ms},
        "step_ms_timed": {"wall": (t1[0] - t0[0] - api.total[0]) * ms, "cpu": (t1[1] - t0[1] - api.total[1]) * ms},
        "phases": {p: {"wall": timer.wall.get(p, 0) * ms, "cpu": timer.cpu.get(p, 0) * ms} for p in PHASES},
        "api_us_per_token": {"wall": api.work[0] / (steps * n) / 1e3, "cpu": api.work[1] / (steps * n) / 1e3},
        "api_handoff_ms_per_step": {"wall": (api.total[0] - api.work[0]) * ms,
                                    "cpu": (api.total[1] - api.work[1]) * ms},
    }


def _print_row(row: dict[str, Any]) -> None:
    n, st, timed = row["batch"], row["step_ms"], row["step_ms_timed"]
    typer.echo(f"\nbatch {n}: context {row['context'][0]}->{row['context'][1]} tokens, {row['steps']} steps each")
    typer.echo(f"  step (bare)          {st['wall']:7.2f} ms wall  {st['cpu']:7.2f} ms cpu   "
               f"{n / st['wall'] * 1e3:7.1f} tok/s")
    typer.echo(f"  step (timed)         {timed['wall']:7.2f} ms wall  {timed['cpu']:7.2f} ms cpu   (timers' cost "
               f"{timed['wall'] - st['wall']:+.2f} ms wall)")
    total_wall = sum(v["wall"] for v in row["phases"].values()) or 1.0
    total_cpu = sum(v["cpu"] for v in row["phases"].values()) or 1.0
    for name, v in row["phases"].items():
        typer.echo(f"  {name:<21}{v['wall']:7.2f} ms {v['wall'] / total_wall:6.1%}  "
                   f"{v['cpu']:7.2f} ms cpu {v['cpu'] / total_cpu:6.1%}")
    api, hand = row["api_us_per_token"], row["api_handoff_ms_per_step"]
    typer.echo(f"  API per token        {api['wall']:7.1f} us wall  {api['cpu']:7.1f} us cpu   "
               "(DeltaTracker, chunk, sse)")
    typer.echo(f"  API hand-off / step  {hand['wall']:7.2f} ms wall  {hand['cpu']:7.2f} ms cpu   (event loop, queues)")


def _trace(engine: Any, prompts: list[list[int]], steps: int, top: int) -> None:
    """torch.profiler over ``steps`` decode steps: the aten ops by self CPU time."""
    import torch  # deferred: ~1.2 s, which `keepwarm --help` must not pay

    _start_decoding(engine, prompts, steps + 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    typer.echo(f"\naten ops over {steps} decode steps of batch {len(prompts)} (torch.profiler, self CPU time):")
    typer.echo(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


@bench_app.command()
def profile(
    model: Annotated[str | None, typer.Option(help="Model directory (default: bundled SmolLM2).")] = None,
    batch: Annotated[str, typer.Option(help="Comma-separated decode batch sizes.")] = "1,8,32",
    steps: Annotated[int, typer.Option(help="Decode steps per measurement (bare, timed, bare).")] = 24,
    warmup: Annotated[int, typer.Option(help="Decode steps before measuring.")] = 4,
    dtype: Annotated[str, typer.Option()] = "bfloat16",
    threads: Annotated[int, typer.Option(help="torch threads (2-core machine: 2).")] = 2,
    trace: Annotated[int, typer.Option(help="Also print the top N aten ops (torch.profiler) of the largest "
                                            "batch; 0: off.")] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results here as JSON.")] = None,
    smoke: Annotated[bool, typer.Option("--smoke", help=SMOKE_HELP)] = False,
) -> None:
    """The time of one steady decode step, split into scheduling, input preparation, forward (by op kind),
    logits, sampling, detokenization and stop checks; plus the API side per token."""
    # deferred, these two: torch (~1.2 s), which `keepwarm --help` must not pay
    import torch

    from keepwarm.worker.llm import LLM  # deferred (above)

    if smoke:
        smoke_start()
        model, batch, steps, warmup = str(smoke_model()), "1,2", 2, 1
    torch.set_num_threads(threads)
    sizes = [int(x) for x in batch.split(",")]
    llm = LLM(model=model, dtype=dtype, max_model_len=2048, max_num_seqs=max(sizes), daemon=False)
    engine = llm.llm_engine
    prompts = bench_prompts(llm.get_tokenizer(), max(sizes))
    typer.echo(f"# machine: {machine_line()}")
    typer.echo(f"# model: {engine.model_dir}, dtype {dtype}, weights {engine.loaded.source}, greedy, ignore_eos")
    _start_decoding(engine, prompts[:max(sizes)], 2)  # warm-up: every shape once
    while engine.has_unfinished_requests():
        engine.step()
    rows = []
    for n in sizes:
        rows.append(profile_batch(engine, prompts[:n], steps, warmup))
        _print_row(rows[-1])
    if trace:
        _trace(engine, prompts[:max(sizes)], steps, trace)
    llm.close()
    if json_out:
        json_out.write_text(json.dumps({"machine": machine_line(), "model": str(engine.model_dir), "dtype": dtype,
                                        "threads": threads, "rows": rows}, indent=2) + "\n")
