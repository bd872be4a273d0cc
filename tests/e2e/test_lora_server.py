"""Multi-LoRA through `keepwarm serve`: adapters by `model`, run-time load/unload, bad loads, a race, warm restart."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import tempfile
from pathlib import Path

import httpx
import openai
import pytest
from support.serve import ServeProcess

from keepwarm import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow  # real server processes; CI runs them

PROMPTS = ["The quick brown fox", "Caches keep", "A paged key value cache", "Numbers like 12345"]


class Server(ServeProcess):
    """The tiny model in float32, its base model served as "base"."""

    def __init__(self, model: str, *args: str, env: dict | None = None) -> None:
        super().__init__(model, "--dtype", "float32", "--max-model-len", "256", "--threads", "1",
                         "--served-model-name", "base", *args, env=env)


@pytest.fixture(scope="module")
def expected(tiny_llama, lora_adapters) -> dict[str | None, list[str]]:
    """Greedy texts offline (the offline engine equals PEFT under transformers: tests/unit/worker/test_lora.py)."""
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=256, enable_lora=True, max_loras=3,
              max_lora_rank=16, daemon=False)
    params = SamplingParams(temperature=0, max_tokens=10)
    out: dict[str | None, list[str]] = {None: [o.outputs[0].text for o in llm.generate(PROMPTS, params)]}
    for i, (name, path) in enumerate(lora_adapters.items()):
        outs = llm.generate(PROMPTS, params, lora_request=LoRARequest(name, i + 1, path))
        out[name] = [o.outputs[0].text for o in outs]
    assert len({tuple(v) for v in out.values()}) == len(out)  # every adapter answers differently
    return out


@pytest.fixture(scope="module")
def server(tiny_llama, lora_adapters):
    s = Server(tiny_llama, "--no-daemon", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
               "--lora-modules", f"ad_qv={lora_adapters['ad_qv']}", "--enable-lora-runtime-updates",
               "--max-cpu-loras", "4")
    yield s
    assert s.stop() == 0


def test_models_and_adapter_selection(server, expected) -> None:
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x")
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", "ad_qv"}
    assert models["ad_qv"].parent == "base" and models["base"].parent is None
    for model, key in (("base", None), ("ad_qv", "ad_qv")):
        for i, p in enumerate(PROMPTS):
            r = client.completions.create(model=model, prompt=p, max_tokens=10, temperature=0)
            assert r.choices[0].text == expected[key][i], (model, p)
    chunks = client.completions.create(model="ad_qv", prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == expected["ad_qv"][0]


def test_load_use_unload_at_runtime(server, lora_adapters, expected) -> None:
    r = httpx.post(server.base + "/v1/load_lora_adapter", json={"lora_name": "ad_mlp",
                                                                "lora_path": lora_adapters["ad_mlp"]})
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x")
    assert "ad_mlp" in {m.id for m in client.models.list().data}
    r2 = client.completions.create(model="ad_mlp", prompt=PROMPTS[1], max_tokens=10, temperature=0)
    assert r2.choices[0].text == expected["ad_mlp"][1]
    assert httpx.post(server.base + "/v1/unload_lora_adapter", json={"lora_name": "ad_mlp"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ad_mlp", prompt="x", max_tokens=2)
    assert "ad_mlp" not in {m.id for m in client.models.list().data}
    r = httpx.post(server.base + "/v1/unload_lora_adapter", json={"lora_name": "ad_mlp"})
    assert r.status_code == 404 and "ad_mlp" in r.json()["error"]["message"]


def test_bad_loads_are_400s_naming_the_cause(server, lora_adapters, tmp_path, make_adapter, tiny_llama) -> None:
    import shutil

    pickled = tmp_path / "pickled"
    shutil.copytree(lora_adapters["ad_qv"], pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    (tmp_path / "empty").mkdir()
    big = make_adapter(tiny_llama, tmp_path / "big", r=32, lora_alpha=32, target_modules=["q_proj"])
    head = make_adapter(tiny_llama, tmp_path / "head", r=4, lora_alpha=4, target_modules=["lm_head"])
    cases = [
        ({"lora_name": "x1", "lora_path": str(tmp_path / "missing")}, "does not exist"),
        ({"lora_name": "x2", "lora_path": str(tmp_path / "empty")}, "adapter_config.json is missing"),
        ({"lora_name": "x3", "lora_path": str(pickled)}, "never loads pickle"),
        ({"lora_name": "x4", "lora_path": big}, "above --max-lora-rank 16"),
        ({"lora_name": "x5", "lora_path": head}, "targets module 'lm_head'"),
        ({"lora_name": "ad_qv", "lora_path": lora_adapters["ad_all"]}, "already loaded"),
        ({"lora_name": "base", "lora_path": lora_adapters["ad_all"]}, "base model"),
        ({"lora_name": "", "lora_path": lora_adapters["ad_all"]}, "lora_name: String should have at least 1 character"),
        ({"lora_name": "x9"}, "lora_path"),
    ]
    before = {m["id"] for m in httpx.get(server.base + "/v1/models").json()["data"]}
    for body, message in cases:
        r = httpx.post(server.base + "/v1/load_lora_adapter", json=body)
        assert r.status_code == 400, (body, r.text)
        assert message in r.json()["error"]["message"], (body, r.json())
    assert {m["id"] for m in httpx.get(server.base + "/v1/models").json()["data"]} == before  # nothing registered


def test_race_load_unload_while_streaming(server, lora_adapters, expected) -> None:
    """Adapters come and go while requests stream; every answer matches its adapter (or the request is refused
    with a 404 when it named an adapter that was not loaded at that moment)."""
    rng = random.Random(0)

    async def stream(client: httpx.AsyncClient, model: str, i: int) -> tuple[str, int, str | None]:
        body = {"model": model, "prompt": PROMPTS[i], "max_tokens": 10, "temperature": 0, "stream": True}
        async with client.stream("POST", server.base + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return model, i, None
            text = []
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
            return model, i, "".join(text)

    async def churn(client: httpx.AsyncClient) -> int:
        cycles = 0
        for _ in range(6):
            for name in ("ad_all", "ad_mlp"):
                r = await client.post(server.base + "/v1/load_lora_adapter",
                                      json={"lora_name": name, "lora_path": lora_adapters[name]})
                assert r.status_code == 200, r.text
            await asyncio.sleep(0.05)
            for name in ("ad_all", "ad_mlp"):
                r = await client.post(server.base + "/v1/unload_lora_adapter", json={"lora_name": name})
                assert r.status_code == 200, r.text
            cycles += 1
        return cycles

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            jobs = [stream(client, rng.choice(["base", "ad_qv", "ad_all", "ad_mlp"]), rng.randrange(4))
                    for _ in range(60)]
            return await asyncio.gather(churn(client), *jobs)

    cycles, *results = asyncio.run(main())
    assert cycles == 6
    served = 0
    for model, i, text in results:
        if text is None:
            assert model in ("ad_all", "ad_mlp")  # refused while unloaded: never served by something else
            continue
        served += 1
        assert text == expected[None if model == "base" else model][i], (model, i)
    assert served >= 30


def test_restart_gets_adapters_warm_from_the_daemon(tiny_llama, lora_adapters, expected) -> None:
    from keepwarm.daemon.client import DaemonClient, start_daemon

    rt = Path(tempfile.mkdtemp(prefix="kwrt-", dir="/tmp"))
    env = {"KEEPWARM_RUNTIME_DIR": str(rt)}
    client = start_daemon(rt)
    args = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules",
            f"ad_qv={lora_adapters['ad_qv']}", f"ad_all={lora_adapters['ad_all']}")
    try:
        first = Server(tiny_llama, *args, env=env)
        body = {"model": "ad_all", "prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0}
        assert httpx.post(first.base + "/v1/completions", json=body).json()["choices"][0]["text"] == \
            expected["ad_all"][2]
        reads = DaemonClient(rt).status()["counters"]["adapter_file_reads"]
        assert reads == 2
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        second = Server(tiny_llama, *args, env=env)
        try:
            assert httpx.post(second.base + "/v1/completions", json=body).json()["choices"][0]["text"] == \
                expected["ad_all"][2]
            st = DaemonClient(rt).status()
            assert st["counters"]["adapter_file_reads"] == reads  # no adapter file read again
            assert {a["name"] for a in st["adapters"]} == {Path(lora_adapters["ad_qv"]).name,
                                                           Path(lora_adapters["ad_all"]).name}
            assert "already resident" in second.output()
        finally:
            assert second.stop() == 0
    finally:
        client.shutdown()
        client.close()
