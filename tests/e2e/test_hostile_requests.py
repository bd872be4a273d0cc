"""Issue 17's table of hostile requests, as regression tests against a real `keepwarm serve` (HTTP + gRPC, with
an API key). After each, the server keeps serving: /health answers 200 and a normal request completes."""

from __future__ import annotations

import asyncio
import json
import re
import time

import grpc
import httpx
import pytest
from support.ports import free_port
from support.serve import ServeProcess
from support.wait import wait_until

from keepwarm.worker.grpc.grpc_gen import keepwarm_pb2 as pb
from keepwarm.worker.grpc.grpc_gen import keepwarm_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

KEY = "hostile-key"
MAX_NUM_SEQS = 8
MAX_QUEUED = 4
CLIENT_TIMEOUT = 2.0
AUTH = {"Authorization": f"Bearer {KEY}"}


class HostileServer(ServeProcess):
    def __init__(self, model: str, *args: str) -> None:
        self.grpc_port = free_port()
        super().__init__(model, "--no-daemon", "--dtype", "float32", "--max-model-len", "512", "--threads", "1",
                         "--served-model-name", "tiny", "--api-key", KEY, "--grpc", "--grpc-port",
                         str(self.grpc_port), "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests",
                         str(MAX_QUEUED), "--client-timeout", str(CLIENT_TIMEOUT), "--max-request-body-mb", "4",
                         *args)

    def post(self, route: str, body: dict | str, headers: dict | None = None, **kw) -> httpx.Response:
        content = body if isinstance(body, str) else json.dumps(body)
        return httpx.post(f"{self.base}/v1/{route}", content=content,
                          headers={"Content-Type": "application/json", **AUTH, **(headers or {})}, **kw)

    def still_serving(self) -> None:
        assert httpx.get(self.base + "/health").status_code == 200
        r = self.post("completions", {"model": "tiny", "prompt": "ok", "max_tokens": 2})
        assert r.status_code == 200, r.text

    def metric(self, name: str, **labels: str) -> float:
        for line in httpx.get(self.base + "/metrics").text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = HostileServer(tiny_llama)
    yield s
    assert s.stop() == 0, s.output()[-3000:]


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and "\n" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


COMPLETION = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}


def test_item1_a_seed_torch_cannot_take_is_a_400_and_the_engine_goes_on(server) -> None:
    for seed in ("18446744073709551616", "-9223372036854775809"):
        r = server.post("completions", '{"model": "tiny", "prompt": "Hi", "max_tokens": 2, "seed": ' + seed + "}")
        _error(r, 400, "seed")
    ok = server.post("completions", {**COMPLETION, "seed": 9223372036854775807, "temperature": 1.0})
    assert ok.status_code == 200, ok.text
    server.still_serving()


def _aborts_and_lengths(server: HostileServer) -> tuple[float, float]:
    return (server.metric("vllm:request_success_total", finished_reason="abort"),
            server.metric("vllm:request_success_total", finished_reason="length"))


def _wait_idle(server: HostileServer) -> None:
    wait_until(lambda: not (server.metric("vllm:num_requests_running") or
                            server.metric("vllm:num_requests_waiting")), 60, interval=0.1)


def test_item2_a_non_streaming_request_is_aborted_when_its_client_leaves(server) -> None:
    _wait_idle(server)
    aborts, lengths = _aborts_and_lengths(server)
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 500, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        server.post("completions", body, timeout=0.5)
    _wait_idle(server)
    assert _aborts_and_lengths(server) == (aborts + 1, lengths)  # aborted, not run to its 500 tokens
    kv = (server.metric("keepwarm:kv_cache_free_blocks"), server.metric("keepwarm:kv_cache_total_blocks"))
    assert kv[0] == kv[1]


def test_item3_a_huge_body_is_413_at_once_and_memory_stays(server) -> None:
    import psutil

    rss = psutil.Process(server.proc.pid).memory_info().rss
    prompt = "x" * (50 << 20)
    r = server.post("completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2}, timeout=60)
    err = _error(r, 413, None)
    assert "--max-request-body-mb" in err["message"]

    def chunks():  # no Content-Length: the limit applies to the bytes as they come
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(50):
            yield b"x" * (1 << 20)
        yield b'"}'

    r = httpx.post(server.base + "/v1/completions", content=chunks(), headers={**AUTH, "Content-Type":
                                                                               "application/json"}, timeout=60)
    assert r.status_code == 413, r.text
    # Under the body limit but more characters than 512 tokens can hold: refused before tokenizing.
    r = server.post("completions", {"model": "tiny", "prompt": "word " * 400_000, "max_tokens": 2})
    assert "cannot fit" in _error(r, 400, "prompt")["message"]
    assert psutil.Process(server.proc.pid).memory_info().rss - rss < 200 << 20
    server.still_serving()


def test_a_stalled_client_gets_408(server) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"model\"")
        sock.settimeout(CLIENT_TIMEOUT * 10)
        head = sock.recv(4096).decode()
    assert head.startswith("HTTP/1.1 408"), head
    server.still_serving()


def test_past_the_queue_bound_is_429(server) -> None:
    _wait_idle(server)
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
            "stream": True}
    n = MAX_NUM_SEQS + MAX_QUEUED + 3

    async def one(client: httpx.AsyncClient) -> int:
        async with client.stream("POST", server.base + "/v1/completions", json=body, headers=AUTH) as r:
            await r.aread()
            return r.status_code

    async def flood() -> list[int]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n + 5)) as client:
            return await asyncio.gather(*[one(client) for _ in range(n)])

    codes = asyncio.run(flood())
    assert codes.count(429) >= 1 and codes.count(200) >= MAX_NUM_SEQS, codes
    assert set(codes) <= {200, 429}
    server.still_serving()


def test_item4_admin_and_docs_need_the_key(server) -> None:
    for path in ("/keepwarm/config", "/docs", "/openapi.json", "/v1/models"):
        assert httpx.get(server.base + path).status_code == 401, path
        assert httpx.get(server.base + path, headers=AUTH).status_code == 200, path
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.base + path).status_code == 200, path


def test_item4_grpc_needs_the_key(server) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.KeepwarmStub(channel)
        request = pb.GenerateRequest(prompt="Hi", sampling_params=pb.SamplingParams(max_tokens=2, temperature=0))
        for call in (lambda md: list(stub.Generate(request, metadata=md)),
                     lambda md: stub.Models(pb.ModelsRequest(), metadata=md)):
            for md in (None, [("authorization", "Bearer wrong")], [("authorization", KEY)]):
                with pytest.raises(grpc.RpcError) as info:
                    call(md)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = [("authorization", f"Bearer {KEY}")]
        assert stub.Models(pb.ModelsRequest(), metadata=good).ids == ["tiny"]
        assert "".join(m.text for m in stub.Generate(request, metadata=good)) is not None
        assert stub.Health(pb.HealthRequest()).status == pb.HealthResponse.SERVING  # open, as /health


def test_item5_a_request_chat_template_needs_the_trust_flag(server) -> None:
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    r = server.post("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                         "chat_template": loop})
    assert "--trust-request-chat-template" in _error(r, 400, "chat_template")["message"]
    server.still_serving()


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p", "presence_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_item6_non_finite_numbers_are_400(server, field: str, value: str) -> None:
    r = server.post("completions", f'{{"model": "tiny", "prompt": "Hi", "max_tokens": 2, "{field}": {value}}}')
    _error(r, 400, field)


SURROGATES = [
    ("completions", '{"model": "tiny", "prompt": "ab\\ud800cd", "max_tokens": 2}', "prompt"),
    ("completions", '{"model": "ti\\udfffny", "prompt": "x", "max_tokens": 2}', "model"),
    ("completions", '{"model": "tiny", "prompt": "x", "max_tokens": 2, "request_id": "\\ud800"}', "request_id"),
    ("chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "ab\\ud800cd"}]}',
     "messages.0.content"),
]


@pytest.mark.parametrize("route, body, where", SURROGATES, ids=[w for _, _, w in SURROGATES])
def test_item7_lone_surrogates_are_400(server, route: str, body: str, where: str) -> None:
    err = _error(server.post(route, body), 400, None)
    assert where in err["message"]
    server.still_serving()


def test_item8_text_offsets_index_the_returned_text(server) -> None:
    for skip in (True, False):
        r = server.post("completions", {**COMPLETION, "max_tokens": 24, "logprobs": 1, "temperature": 0,
                                        "ignore_eos": True, "skip_special_tokens": skip, "prompt": "The"})
        choice = r.json()["choices"][0]
        text, offsets = choice["text"], choice["logprobs"]["text_offset"]
        assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
        assert offsets[0] == 0


def test_item9_clients_cannot_collide_on_request_ids(server) -> None:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "request_id": "mine"}

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[client.post(server.base + "/v1/completions", json=body, headers=AUTH)
                                          for _ in range(2)])

    a, b = asyncio.run(both())
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.json()["id"] == b.json()["id"] == "mine"
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]


def test_item10_token_ids_are_strict(server) -> None:
    for prompt in ([[False]], [True, 5], [[1.5]], [-1], [[]]):
        _error(server.post("completions", {**COMPLETION, "prompt": prompt}), 400, "prompt")


def test_health_says_what_the_engine_does(server) -> None:
    body = httpx.get(server.base + "/health").json()
    assert body["status"] == "ok" and body["engine"]["running"] is True and body["engine"]["error"] is None
    assert re.fullmatch(r"[0-9a-f]{64}", body["weights"]["fingerprint"])
    time.sleep(0)  # nothing in flight: no request is holding the engine
    assert body["engine"]["requests_in_flight"] == 0


SITECUSTOMIZE = '''
# Test-only fault injection, loaded by the server process through PYTHONPATH: the forward pass fails once a
# prompt holds the token id MAGIC, as a kernel or device failure would.
import os
from keepwarm.worker import model_runner

MAGIC = int(os.environ["KEEPWARM_TEST_FAIL_ON_TOKEN"])
_execute = model_runner.ModelRunner.execute


def execute(self, batch, *args, **kwargs):
    if any(MAGIC in seq.prompt_token_ids for seq in batch.seqs):
        raise RuntimeError("injected device failure")
    return _execute(self, batch, *args, **kwargs)


model_runner.ModelRunner.execute = execute
'''


def test_an_engine_that_cannot_go_on_exits_non_zero(tiny_llama, tmp_path) -> None:
    """The issue's item 1 left a process that answered 503 forever; a dead engine must end the process (status
    70) so its supervisor restarts it, after failing the requests in flight."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    import os

    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "KEEPWARM_TEST_FAIL_ON_TOKEN": "7"}
    s = ServeProcess(tiny_llama, "--no-daemon", "--dtype", "float32", "--max-model-len", "128", "--threads", "1",
                     "--served-model-name", "tiny", env=env)
    try:
        assert httpx.post(s.base + "/v1/completions", json={"model": "tiny", "prompt": [5, 6],
                                                            "max_tokens": 2}).status_code == 200
        r = httpx.post(s.base + "/v1/completions", json={"model": "tiny", "prompt": [5, 7], "max_tokens": 2})
        assert r.status_code == 503 and "injected device failure" in r.json()["error"]["message"], r.text
        code = s.proc.wait(timeout=60)
        assert code == 70, s.output()[-3000:]
        assert "the engine cannot go on" in s.output() and "exiting with status 70" in s.output()
    finally:
        s.stop()
