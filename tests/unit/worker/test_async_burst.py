"""worker/async_engine.py's "Bursts" rule: requests that the front end's event loop already holds when the first
one wakes the idle engine go into the same first step. Six coroutines each hold the loop for 3 ms (1 ms of Python,
2 ms of a blocking call that releases the GIL) before handing their request over, as HTTP handlers parse and
validate, started together: with the rule the engine's first step sees all six; with the wait set to zero the
engine thread, free to run during those blocking calls, steps with fewer, so the test can fail."""

from __future__ import annotations

import asyncio
import time

import pytest

from keepwarm.worker import async_engine as async_engine_module
from keepwarm.worker.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def _first_step_sees(tiny_llama: str) -> int:
    from keepwarm.worker.engine import EngineConfig, LLMEngine

    eng = async_engine_module.AsyncEngine(lambda: LLMEngine(EngineConfig(model=tiny_llama, dtype="float32",
                                                                         max_model_len=64, daemon=False)))
    waiting: list[int] = []
    step = eng.engine.step

    def counting_step() -> list:
        waiting.append(len(eng.engine.scheduler.waiting))
        return step()

    eng.engine.step = counting_step  # type: ignore[method-assign]

    async def one(i: int) -> None:
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:  # the handler's own work, holding the loop (and the GIL)
            pass
        time.sleep(0.002)  # and some without the GIL (the engine thread may run), still holding the loop
        async for _ in eng.generate(f"r{i}", [5, 6, 7 + i], GREEDY):
            pass

    async def burst() -> None:
        await asyncio.gather(*(one(i) for i in range(6)))

    try:
        asyncio.run(burst())
    finally:
        eng.shutdown()
        eng.engine.close()
    return next(n for n in waiting if n)


def test_a_burst_is_scheduled_in_one_first_step(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule is the round trip; _BURST_WAIT_S only bounds it. The six handlers hold the loop for 18 ms plus their
    own Python, which under coverage on a slow 2-core VM took past the 20 ms bound (the burst split once in a
    `make test`): with a bound far above that, only the round trip decides."""
    monkeypatch.setattr(async_engine_module, "_BURST_WAIT_S", 2.0)
    assert _first_step_sees(tiny_llama) == 6


def test_without_the_wait_the_burst_splits(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(async_engine_module, "_BURST_WAIT_S", 0.0)
    assert _first_step_sees(tiny_llama) < 6
