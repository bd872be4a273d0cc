"""The gRPC API (`keepwarm serve --grpc`) on a real server process, driven by a real grpc channel."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from support.ports import free_port
from support.serve import ServeProcess
from support.wait import wait_until

from keepwarm.worker.grpc.grpc_gen import keepwarm_pb2 as pb
from keepwarm.worker.grpc.grpc_gen import keepwarm_pb2_grpc as pb_grpc

# End-to-end: real server processes. CI runs them (make test); skip locally with -m "not slow".
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "worker" / "grpc" / "grpc_gen"
SHUTDOWN_TIMEOUT = 10.0
PROMPT = "The quick brown"


class GrpcServerProc(ServeProcess):
    def __init__(self, model: str) -> None:
        self.grpc_port = free_port()
        super().__init__(model, "--grpc", "--grpc-port", str(self.grpc_port), "--no-daemon", "--dtype", "float32",
                         "--max-model-len", "256", "--threads", "1", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.stub = pb_grpc.KeepwarmStub(self.channel)

    def stop(self) -> int:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=SHUTDOWN_TIMEOUT + 15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"no exit within the shutdown timeout: {self.output()}") from None
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = GrpcServerProc(tiny_llama)
    yield s
    code = s.stop()
    assert code == 0, s.output()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def vocab_size(tiny_llama) -> int:
    return json.loads((Path(tiny_llama) / "config.json").read_text())["vocab_size"]


def greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def collect(stream) -> dict[int, dict]:
    choices: dict[int, dict] = {}
    for m in stream:
        c = choices.setdefault(m.index, {"text": "", "ids": [], "logprobs": [], "finish": None, "usage": None})
        assert c["finish"] is None, "a message after the choice's last one"
        c["text"] += m.text
        c["ids"] += list(m.token_ids)
        c["logprobs"] += list(m.logprobs)
        if m.HasField("finish_reason"):
            c["finish"] = m.finish_reason
        if m.HasField("usage"):
            c["usage"] = m.usage
    return choices


def test_generated_code_matches_make_proto(tmp_path) -> None:
    """The committed worker/grpc/grpc_gen/ is exactly what `make proto` writes from keepwarm.proto."""
    pytest.importorskip("grpc_tools")
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # -o: run only the proto recipe, never the venv set-up it depends on; BIN: this interpreter's grpc_tools.
    subprocess.run(["make", "-s", "-o", ".venv/.dev-installed", "proto", f"PROTO_OUT={tmp_path}",
                    f"BIN={Path(sys.executable).parent}"], cwd=ROOT, check=True, capture_output=True)
    names = ["__init__.py", "keepwarm_pb2.py", "keepwarm_pb2_grpc.py", "keepwarm_pb2.pyi"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    for name in names:
        assert (tmp_path / name).read_text() == (GEN / name).read_text(), f"{name} is stale: run `make proto`"
    assert "from . import keepwarm_pb2 as" in (GEN / "keepwarm_pb2_grpc.py").read_text()


def test_models_and_health(server, tiny_llama) -> None:
    models = server.stub.Models(pb.ModelsRequest(), timeout=10)
    assert list(models.ids) == [tiny_llama] and models.max_model_len == 256
    health = server.stub.Health(pb.HealthRequest(), timeout=10)
    assert health.status == pb.HealthResponse.SERVING
    http = httpx.get(server.base + "/health").json()["weights"]
    assert health.weights_source == "disk" == http["source"]
    assert health.fingerprint == (http["fingerprint"] or "") and health.attach_seconds == http["attach_seconds"]
    assert health.model == tiny_llama and health.version


def test_greedy_stream_matches_http(server, tokenizer) -> None:
    http = httpx.post(server.base + "/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0}).json()
    stream = list(server.stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=greedy(12)), timeout=60))
    assert len(stream) > 1 and len({m.request_id for m in stream}) == 1 and stream[0].request_id
    assert [m.HasField("usage") for m in stream] == [False] * (len(stream) - 1) + [True]
    (c,) = collect(iter(stream)).values()
    h = http["choices"][0]
    assert c["text"] == h["text"] and c["finish"] == h["finish_reason"] == "length"
    assert [tokenizer.decode([t]) for t in c["ids"]] == h["logprobs"]["tokens"] and len(c["ids"]) == 12
    assert c["usage"].prompt_tokens == http["usage"]["prompt_tokens"]
    assert c["usage"].completion_tokens == http["usage"]["completion_tokens"] == 12
    # The same prompt as token ids (tokenized as the server does) gives the same tokens.
    ids = tokenizer.encode(PROMPT)
    by_ids = collect(server.stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                                                             sampling_params=greedy(12)), timeout=60))
    assert by_ids[0]["ids"] == c["ids"] and by_ids[0]["text"] == c["text"]
    # n, logprobs, a stop string, a named model, a chosen request id.
    both = collect(server.stub.Generate(pb.GenerateRequest(
        model=server.stub.Models(pb.ModelsRequest()).ids[0], prompt=PROMPT, request_id="mine-1",
        sampling_params=greedy(4, n=2, logprobs=2)), timeout=60))
    assert sorted(both) == [0, 1] and all(x["ids"] == c["ids"][:4] for x in both.values())
    assert all(len(x["logprobs"]) == 4 and len(x["logprobs"][0].top) == 2 for x in both.values())
    assert all([lp.token_id for lp in x["logprobs"]] == x["ids"] for x in both.values())
    stop = next(c["text"][i:i + 2] for i in range(2, len(c["text"]) - 2) if c["text"][i:i + 2].strip())
    cut = collect(server.stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=greedy(12, stop=[stop])),
                                       timeout=60))[0]
    assert cut["text"] == c["text"][: c["text"].index(stop)] and cut["finish"] == "stop"


def bad_requests(vocab: int) -> list[tuple[str, pb.GenerateRequest, grpc.StatusCode, str]]:
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    return [
        ("temperature", pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(temperature=-1)), invalid,
         "temperature"),
        ("empty prompt", pb.GenerateRequest(prompt=""), invalid, "prompt: String should have at least 1 character"),
        ("empty ids", pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[])), invalid,
         "prompt_token_ids: List should have at least 1 item"),
        ("no prompt", pb.GenerateRequest(), invalid, "prompt"),
        ("too long", pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[7] * 300)), invalid, "context length"),
        ("too many tokens", pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(max_tokens=400)),
         invalid, "context length"),
        ("id out of vocab", pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, vocab])), invalid,
         f"[0, {vocab})"),
        ("negative id", pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[-1])), invalid,
         "prompt_token_ids.0: Input should be greater than or equal to 0"),
        ("top_p", pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(top_p=0)), invalid, "top_p"),
        ("n", pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(n=0)), invalid, "sampling_params.n: "),
        ("logprobs", pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(logprobs=50)), invalid,
         "logprobs"),
        ("nan", pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(temperature=float("nan"))),
         invalid, "temperature"),
        ("unknown model", pb.GenerateRequest(model="nope", prompt="x"), grpc.StatusCode.NOT_FOUND, "nope"),
    ]


def test_bad_requests_get_status_codes_and_server_keeps_serving(server, vocab_size) -> None:
    for what, request, code, needle in bad_requests(vocab_size):
        with pytest.raises(grpc.RpcError) as e:
            list(server.stub.Generate(request, timeout=30))
        assert e.value.code() == code, (what, e.value.code(), e.value.details())
        details = e.value.details()
        assert needle in details and "\n" not in details, (what, details)
        assert server.stub.Models(pb.ModelsRequest(), timeout=10).max_model_len == 256, what
    ok = collect(server.stub.Generate(pb.GenerateRequest(prompt="x", sampling_params=greedy(2)), timeout=60))
    assert len(ok[0]["ids"]) == 2 and ok[0]["finish"] == "length"


def test_cancelled_stream_aborts_and_frees_kv(server) -> None:
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    total = server.metric("keepwarm:kv_cache_total_blocks")
    # 16 sequences of 240 tokens: far more work than the first message, after which the client cancels. The abort
    # count below shows the request was cut short rather than finished.
    call = server.stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=pb.SamplingParams(
        max_tokens=240, temperature=1.0, seed=1, ignore_eos=True, n=16)), timeout=120)
    assert not next(call).HasField("finish_reason")
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    wait_until(lambda: server.metric("keepwarm:kv_cache_free_blocks") == total and
               server.metric("vllm:request_success_total", finished_reason="abort") > aborted, 10, interval=0.1,
               strict=False)
    assert server.metric("keepwarm:kv_cache_free_blocks") == total
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 16
    assert server.stub.Health(pb.HealthRequest(), timeout=10).status == pb.HealthResponse.SERVING


def test_grpc_port_in_use_is_a_one_line_error(tiny_llama) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "keepwarm.cli.main", "serve", tiny_llama, "--grpc", "--grpc-port",
               str(port), "--port", str(free_port()), "--no-daemon", "--threads", "1"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    # Checked before any work (cli/serve_cmd.py's preflight): exit 2, one line naming the flag and the port.
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: --grpc-port {port}: cannot listen on 127.0.0.1:")
    assert "Traceback" not in r.stderr
