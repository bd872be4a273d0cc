"""`keepwarm bench profile`'s timer: each phase's time is exclusive, so the split adds up to the step (fake clocks:
no wall-clock figure is asserted). The command itself runs end to end in tests/bench/test_bench_smoke.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from keepwarm.cli.bench_profile import StepTimer


def _fake_clocks() -> tuple[StepTimer, list[int]]:
    now = [0]
    return StepTimer(clock=lambda: now[0], cpu_clock=lambda: now[0] // 2), now


def test_nested_phases_count_once_in_the_inner_one() -> None:
    timer, now = _fake_clocks()

    def advance(ns: int) -> None:
        now[0] += ns

    inner = timer.wrap(lambda: advance(30), "inner")

    def outer_body() -> None:
        advance(10)
        inner()
        advance(5)

    timer.wrap(outer_body, "outer")()
    assert timer.wall == {"inner": 30, "outer": 15}
    assert timer.cpu == {"inner": 15, "outer": 7}  # the fake CPU clock runs at half speed (rounding down)
    assert sum(timer.wall.values()) == now[0]


def test_calls_inside_an_opaque_phase_belong_to_it() -> None:
    timer, now = _fake_clocks()
    matmul = timer.wrap(lambda: now.__setitem__(0, now[0] + 40), "matmuls")
    head = timer.wrap(lambda: (matmul(), now.__setitem__(0, now[0] + 2)), "logits", opaque=True)
    matmul()
    head()
    assert timer.wall == {"matmuls": 40, "logits": 42}


def test_an_exception_still_closes_the_phase() -> None:
    timer, now = _fake_clocks()

    def fails() -> None:
        now[0] += 7
        raise ValueError("boom")

    wrapped = timer.wrap(fails, "x")
    for _ in range(2):
        with pytest.raises(ValueError):
            wrapped()
    assert timer.wall == {"x": 14} and not timer._stack


class _Part:
    """Stands in for an engine part: every method the profiler wraps, returning 1."""

    def __getattr__(self, name: str):
        raise AttributeError(name)

    def _one(self) -> int:
        return 1

    step = schedule = execute = host_inputs = device_inputs = _forward = compute_logits = sample = process_token = \
        make_output = _one


def test_instrumented_times_the_parts_and_removes_every_wrapper() -> None:
    from keepwarm import kernels
    from keepwarm.cli.bench_profile import instrumented
    from keepwarm.worker.detokenizer import IncrementalDetokenizer
    from keepwarm.worker.lora import LoRALayer

    engine, runner = _Part(), _Part()
    runner.model = _Part()
    engine.scheduler, engine.runner, engine.sampler, engine.output_processor = _Part(), runner, _Part(), _Part()
    before = (kernels.linear, kernels.paged_attention, IncrementalDetokenizer.step, LoRALayer.apply)
    timer = StepTimer()
    with instrumented(engine, timer):
        assert kernels.linear is not before[0]
        assert runner.host_inputs() == 1 and engine.step() == 1
    assert set(timer.wall) == {"input preparation", "engine other"}
    assert (kernels.linear, kernels.paged_attention, IncrementalDetokenizer.step, LoRALayer.apply) == before
    assert not {"host_inputs", "device_inputs", "_forward"} & set(vars(runner)) and "step" not in vars(engine)


def test_a_bench_model_that_is_no_directory_is_refused_in_one_line(tmp_path) -> None:
    """`bench restart` / `bench snapshot` / `bench llamacpp` read a model directory: a file (a GGUF) is one line."""
    gguf = tmp_path / "model.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    run = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "bench", "restart", "--models", str(gguf)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [f"error: --models: {str(gguf)!r} is not 'smollm2', a random preset "
                                               "(1b, 8b) or a model directory (a GGUF file: `keepwarm bench "
                                               "profile --model FILE` or `bench llamacpp`)"]
