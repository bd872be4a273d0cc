"""`keepwarm serve` as a real process on a loopback port, driven by the official openai client and httpx."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import openai
import pytest
from support.ports import free_port
from support.serve import ServeProcess, metric, wait_healthy
from support.wait import wait_until

from keepwarm import LLM, SamplingParams

# End-to-end: real server processes. CI runs them (make test); skip locally with -m "not slow".
pytestmark = pytest.mark.slow

class ServerProc(ServeProcess):
    """A tiny model in float32 on one thread."""

    def __init__(self, model: str, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__(model, "--dtype", "float32", "--max-model-len", "256", "--threads", "1", *args, env=env)


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    s = ServerProc(tiny_model_factory("llama"), "--no-daemon", "--served-model-name", "tiny")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    """Greedy continuations computed offline, for checking served text."""
    llm = LLM(model=tiny_model_factory("llama"), dtype="float32", max_model_len=256, daemon=False)

    def run(prompts: list[str], max_tokens: int) -> list[str]:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
        return [o.outputs[0].text for o in outs]

    return run


def test_openai_client_completions_and_chat(server, reference) -> None:
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=12, temperature=0)
    assert r.choices[0].text == reference(["The quick brown"], 12)[0]
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="tiny", prompt="The quick brown", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    assert sum(1 for c in chunks if c.choices) == 12  # a chunk per token, text or not (as vLLM streams)
    msgs = [{"role": "user", "content": "Say something about caches."}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    streamed = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content and chat.choices[0].message.role == "assistant"
    # Several prompts, n, logprobs, seed, stop and vLLM's extra fields.
    multi = client.completions.create(model="tiny", prompt=["a b", "c d"], max_tokens=4, temperature=0, n=2,
                                      logprobs=2)
    assert sorted(c.index for c in multi.choices) == [0, 1, 2, 3]
    assert all(len(c.logprobs.tokens) == 4 and len(c.logprobs.top_logprobs[0]) == 2 for c in multi.choices)
    seeded = [client.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=1.0, seed=7,
                                        extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1})
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    full = r.choices[0].text
    stop = next(full[i:i + 2] for i in range(2, len(full) - 2) if full[i:i + 2].strip())
    cut = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed_cut = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=12, temperature=0,
                                             stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed_cut) == cut.choices[0].text
    token_prompt = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                             extra_body={"ignore_eos": True, "stop_token_ids": []})
    assert token_prompt.usage.prompt_tokens == 3
    chat_lp = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=3, temperature=0,
                                             logprobs=True, top_logprobs=2)
    assert len(chat_lp.choices[0].logprobs.content) == 3
    assert len(chat_lp.choices[0].logprobs.content[0].top_logprobs) == 2


def test_health_version_and_config(server) -> None:
    health = httpx.get(server.base + "/health").json()
    assert health["status"] == "ok" and health["weights"]["source"] == "disk"
    assert health["weights"]["fallback_reason"] is None  # --no-daemon: disk by choice, not by fallback
    assert httpx.get(server.base + "/version").json()["version"]
    cfg = httpx.get(server.base + "/keepwarm/config").json()["config"]
    assert cfg["max_model_len"] == 256 and cfg["daemon"] is False and cfg["served_model_name"] == ["tiny"]


def test_api_key(tiny_llama) -> None:
    s = ServerProc(tiny_llama, "--no-daemon", "--api-key", "sekret")
    try:
        bad = openai.OpenAI(base_url=s.base + "/v1", api_key="wrong")
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model=tiny_llama, prompt="hi", max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
        good = openai.OpenAI(base_url=s.base + "/v1", api_key="sekret")
        assert good.completions.create(model=tiny_llama, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        chunks = list(good.chat.completions.create(model=tiny_llama, messages=[{"role": "user", "content": "x"}],
                                                   max_tokens=2, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        # /health and /metrics stay open, as in vLLM.
        assert httpx.get(s.base + "/health").status_code == 200
        assert httpx.get(s.base + "/metrics").status_code == 200
        assert httpx.get(s.base + "/v1/models").status_code == 401
    finally:
        assert s.stop() == 0


MALFORMED = [
    ("completions", "{not json", 400),
    ("completions", "[1, 2, 3]", 400),
    ("completions", {"model": "tiny"}, 400),
    ("completions", {"model": "tiny", "prompt": 12}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": -3}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "top_p": 0}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "top_k": -5}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "n": 0}, 400),
    ("completions", {"model": "nope", "prompt": "x"}, 404),
    ("completions", {"model": "tiny", "prompt": [7] * 300}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": 400}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "logprobs": 50}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "stop": 5}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "suffix": "known but unsupported"}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "presence_penalty": 5}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "repetition_penalty": 0}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "min_p": 2}, 400),
    ("completions", {"model": "tiny", "prompt": [1, 99999]}, 400),
    ("completions", {"model": "tiny", "prompt": ""}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, 400),
    ("completions", {"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, 400),
    ("chat/completions", {"model": "tiny", "messages": []}, 400),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("chat/completions", {"model": "tiny"}, 400),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 2000}]}, 400),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": 0}, 400),
]


@pytest.mark.parametrize("route, body, status", MALFORMED,
                         ids=[f"{i}-{r}" for i, (r, _, _) in enumerate(MALFORMED)])
def test_malformed_requests_get_openai_errors(server, route, body, status) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.base}/v1/{route}", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and "param" in err and "code" in err
    assert "\n" not in err["message"]
    # And the server keeps serving.
    ok = httpx.post(f"{server.base}/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 1})
    assert ok.status_code == 200


def test_wrong_method_and_route(server) -> None:
    r = httpx.get(f"{server.base}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(f"{server.base}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def _stream_body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}


async def _stream_text(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> str:
    text = []
    async with client.stream("POST", base + "/v1/completions", json=_stream_body(prompt, max_tokens)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


async def _disconnect_midway(client: httpx.AsyncClient, base: str, prompt: str) -> int:
    seen = 0
    async with client.stream("POST", base + "/v1/completions",
                             json=_stream_body(prompt, 200, ignore_eos=True)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 3:
                break  # leaving the block closes the connection mid-stream
    return seen


def _aborted(server: ServerProc) -> float:
    return server.metric("vllm:request_success_total", finished_reason="abort")


def _wait_all_blocks_free(server: ServerProc) -> None:
    def free() -> dict:
        m = server.metrics()
        return m if metric(m, "keepwarm:kv_cache_free_blocks") == metric(m, "keepwarm:kv_cache_total_blocks") and \
            metric(m, "vllm:num_requests_running") == 0 else {}

    m = wait_until(free, 60, interval=0.2, message=lambda: str(server.metrics()))
    assert metric(m, "vllm:kv_cache_usage_perc") == 0.0


def test_64_concurrent_streams_and_disconnects_free_kv(server, reference) -> None:
    prompts = [f"Request number {i} asks about item {i * 7 % 13}" for i in range(64)]
    expected = reference(prompts, 16)
    aborted_before = _aborted(server)

    async def main() -> tuple[list[str], list[int]]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            streams = [_stream_text(client, server.base, p, 16) for p in prompts]
            drops = [_disconnect_midway(client, server.base, f"long request {i}") for i in range(8)]
            results = await asyncio.gather(*streams, *drops)
        return results[:64], results[64:]

    texts, seen = asyncio.run(main())
    assert texts == expected
    assert all(n >= 3 for n in seen)
    _wait_all_blocks_free(server)
    # The engine aborted exactly the 8 streams whose clients left after 3 of their 200 tokens (with a no-op
    # abort they would run to their length and count as "length" instead).
    assert _aborted(server) - aborted_before == 8


def test_plain_request_whose_client_leaves_is_aborted(tiny_llama) -> None:
    s = ServerProc(tiny_llama, "--no-daemon", "--max-model-len", "1024", "--served-model-name", "tiny")
    body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(client.post(s.base + "/v1/completions", json=body)) for _ in range(4)]
            while await asyncio.to_thread(s.metric, "vllm:num_requests_running") < 4:
                await asyncio.sleep(0.05)
            for t in tasks:
                t.cancel()  # closes each connection while its request is being generated
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run(main())
        _wait_all_blocks_free(s)
        assert _aborted(s) == 4
        assert s.metric("vllm:request_success_total", finished_reason="length") == 0
        assert s.metric("vllm:generation_tokens_total") < 4 * 1000
    finally:
        assert s.stop() == 0


def test_config_file_and_flags(tiny_llama, tmp_path) -> None:
    cfg = tmp_path / "server.toml"
    cfg.write_text(f'model = "{tiny_llama}"\nmax_num_seqs = 7\nserved_model_name = ["from-file"]\n'
                   'daemon = false\nblock_size = 32\n')
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "keepwarm.cli.main", "serve", "--config", str(cfg), "--port",
                             str(port), "--max-num-seqs", "9", "--dtype", "float32", "--max-model-len", "128"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, lambda: "", 90)
        got = httpx.get(base + "/keepwarm/config").json()["config"]
        assert got["max_num_seqs"] == 9  # the flag wins
        assert got["block_size"] == 32 and got["served_model_name"] == ["from-file"]  # from the file
        assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == "from-file"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_bad_config_is_one_line_error(tmp_path) -> None:
    cfg = tmp_path / "server.toml"
    cfg.write_text("max_num_seqz = 3\n")
    out = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error:") and "max_num_seqz" in out.stderr


def test_sigterm_drains_in_flight_requests(tiny_llama) -> None:
    s = ServerProc(tiny_llama, "--no-daemon", "--shutdown-timeout", "30", "--served-model-name", "tiny")

    async def main() -> tuple[int, bool, int]:
        chunks, done, finish = 0, False, None
        async with httpx.AsyncClient(timeout=120) as client, client.stream(
                "POST", s.base + "/v1/completions", json=_stream_body("drain me", 240, ignore_eos=True)) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunks += 1
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
                    if chunks == 1:
                        s.proc.send_signal(signal.SIGTERM)  # mid-stream
        return finish, done, await asyncio.to_thread(s.proc.wait, 60)

    finish, done, code = asyncio.run(main())
    assert done and finish == "length"  # the in-flight request ran to its end (240 tokens)
    assert code == 0
    assert "draining" in s.output()


def test_restart_attaches_warm_weights(tiny_llama) -> None:
    from keepwarm.daemon.client import DaemonClient, start_daemon

    rt = Path(tempfile.mkdtemp(prefix="kwrt-", dir="/tmp"))
    env = {"KEEPWARM_RUNTIME_DIR": str(rt)}
    client = start_daemon(rt)
    try:
        client.preload(tiny_llama)
        body = {"model": tiny_llama, "prompt": "Warm weights", "max_tokens": 12, "temperature": 0}
        first = ServerProc(tiny_llama, env=env)
        assert httpx.get(first.base + "/health").json()["weights"]["source"] == "daemon"
        answer = httpx.post(first.base + "/v1/completions", json=body).json()["choices"][0]["text"]
        first.stop(signal.SIGKILL)
        second = ServerProc(tiny_llama, env=env)
        try:
            health = httpx.get(second.base + "/health").json()
            assert health["weights"]["source"] == "daemon"
            assert httpx.post(second.base + "/v1/completions", json=body).json()["choices"][0]["text"] == answer
            counters = DaemonClient(rt).status()["counters"]
            assert counters["preloads"] == 1 and counters["attaches"] == 2
            assert "ready" in second.output() and "attached in" in second.output()
        finally:
            assert second.stop() == 0
    finally:
        client.shutdown()
        client.close()


def test_serve_falls_back_to_disk_and_says_so(tiny_llama, tmp_path) -> None:
    # A daemon that cannot start (a directory where its socket goes) -> the server loads from disk and says why.
    # (A runtime dir that is not private is refused before any work: tests/unit/cli/test_vllm_flags.py.)
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    (rt / "daemon.sock").mkdir()
    s = ServerProc(tiny_llama, env={"KEEPWARM_RUNTIME_DIR": str(rt)})
    try:
        health = httpx.get(s.base + "/health").json()
        assert health["weights"]["source"] == "disk"
        assert "the daemon exited" in health["weights"]["fallback_reason"]
        assert "weights from disk" in s.output()
        m = s.metrics()
        assert metric(m, "keepwarm:weights_source", source="disk") == 1.0
        assert metric(m, "keepwarm:weights_source", source="daemon") == 0.0
    finally:
        assert s.stop() == 0
