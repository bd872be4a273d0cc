"""A bounded load test against a real `keepwarm serve`: 300 concurrent streams over the base model and two LoRA
adapters, a quarter of them dropped mid-stream at random. Afterwards every completed answer equals its greedy
reference (computed offline), the KV pool is free, nothing runs, and the server's RSS is back within a bound."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import psutil
import pytest
from support.serve import ServeProcess
from support.wait import wait_until

from keepwarm import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow

STREAMS = 300
DROP_FRACTION = 0.25
MAX_TOKENS = 8
PROMPTS = ["The quick brown fox", "Caches keep", "A paged key value cache", "Numbers like 12345",
           "Once upon a time", "Servers must not fall over", "Hello", "Adapters mix in one batch"]
MODELS = ["base", "ad_qv", "ad_all"]
# RSS may grow by what allocators keep for reuse (KV pages touched, malloc arenas of the request threads); a
# leak per request (300 requests' buffers, streams or outputs kept) would exceed this.
RSS_SLACK_BYTES = 96 << 20


@pytest.fixture(scope="module")
def references(tiny_llama, lora_adapters) -> dict[tuple[str, str], str]:
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256, enable_lora=True, max_loras=2,
              max_lora_rank=16, daemon=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {}
    for i, model in enumerate(MODELS):
        lora = None if model == "base" else LoRARequest(model, i, lora_adapters[model])
        for prompt, o in zip(PROMPTS, llm.generate(PROMPTS, params, lora_request=lora), strict=True):
            out[(model, prompt)] = o.outputs[0].text
    llm.close()
    return out


def _metrics(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out.setdefault(name.split("{")[0], float(value))
    return out


async def _stream(client: httpx.AsyncClient, base: str, model: str, prompt: str, drop: bool) -> str | None:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text = []
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text.append(chunk["choices"][0]["text"])
            if drop:
                return None  # leaving the block closes the connection mid-stream
    return "".join(text)


def _wait_idle(base: str, timeout: float = 60) -> dict[str, float]:
    def idle() -> dict[str, float]:
        m = _metrics(base)
        return m if m["keepwarm:kv_cache_free_blocks"] == m["keepwarm:kv_cache_total_blocks"] and \
            m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0 else {}

    return wait_until(idle, timeout, interval=0.2, message=lambda: str(_metrics(base)))


def test_hundreds_of_streams_with_disconnects_and_adapters(tiny_llama, lora_adapters, references) -> None:
    server = ServeProcess(tiny_llama, "--no-daemon", "--dtype", "float32", "--max-model-len", "256",
                          "--threads", "1", "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
                          "--max-lora-rank", "16", "--lora-modules", f"ad_qv={lora_adapters['ad_qv']}",
                          f"ad_all={lora_adapters['ad_all']}")
    try:
        rng = random.Random(17)
        jobs = [(rng.choice(MODELS), rng.choice(PROMPTS), rng.random() < DROP_FRACTION) for _ in range(STREAMS)]

        async def run(batch) -> list[str | None]:
            limits = httpx.Limits(max_connections=STREAMS + 10, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=180, limits=limits) as client:
                return await asyncio.gather(*[_stream(client, server.base, m, p, d) for m, p, d in batch])

        # Warm-up round (first-use allocations), then the baseline RSS.
        asyncio.run(run(jobs[:32]))
        _wait_idle(server.base)
        proc = psutil.Process(server.proc.pid)
        rss_before = proc.memory_info().rss

        t0 = time.monotonic()
        texts = asyncio.run(run(jobs))
        elapsed = time.monotonic() - t0
        done = [(job, text) for job, text in zip(jobs, texts, strict=True) if text is not None]
        assert len(done) == sum(1 for _, _, d in jobs if not d)
        wrong = [(m, p, t, references[(m, p)]) for (m, p, _), t in done if t != references[(m, p)]]
        assert not wrong, wrong[:5]

        m = _wait_idle(server.base)
        assert m["vllm:kv_cache_usage_perc"] == 0.0
        rss_after = proc.memory_info().rss
        assert rss_after - rss_before < RSS_SLACK_BYTES, (rss_before, rss_after)
        print(f"{STREAMS} streams ({len(done)} completed, {STREAMS - len(done)} dropped) in {elapsed:.1f}s; "
              f"RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
        assert httpx.get(server.base + "/health").status_code == 200
    finally:
        assert server.stop() == 0
