"""Every front end holds the same limits, names the field it refuses, and a killed worker is said to be killed
(issue 43, rows 12 and 15, and a lone surrogate's ``param``).

One supervised server (`keepwarm serve --zygote --grpc`, weights from disk, a 1 MiB body limit) is shared by the
module's tests, in order: the gRPC table, each row refused with the limit HTTP uses for the same field, then the
server still serves on both; lone surrogates named by their path in the 400's ``param``; last, kill -9 of the
worker (as the OOM killer does): the supervisor logs the signal, replaces the worker, and both front ends serve.
"""

from __future__ import annotations

import json
import math
import os
import signal
import tempfile
from pathlib import Path

import grpc
import httpx
import pytest
from support.ports import free_port
from support.serve import ServeProcess
from support.wait import wait_until

from keepwarm.worker.grpc.grpc_gen import keepwarm_pb2 as pb
from keepwarm.worker.grpc.grpc_gen import keepwarm_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

INT64_MAX = (1 << 63) - 1
CONTEXT = 64


@pytest.fixture(scope="module")
def server(tiny_llama):
    rt = Path(tempfile.mkdtemp(prefix="kwf-", dir="/tmp"))  # short: the control socket's path is limited
    s = ServeProcess(tiny_llama, "--zygote", "--no-daemon", "--grpc", "--grpc-port", str(free_port()),
                     "--dtype", "float32", "--max-model-len", str(CONTEXT), "--threads", "1",
                     "--served-model-name", "tiny", "--max-request-body-mb", "1",
                     env={"KEEPWARM_RUNTIME_DIR": str(rt)}, timeout=180)
    s.grpc_port = int(s.proc.args[s.proc.args.index("--grpc-port") + 1])
    s.vocab = json.loads((Path(tiny_llama) / "config.json").read_text())["vocab_size"]
    try:
        yield s
    finally:
        code = s.stop()
        assert code == 0, s.output()[-3000:]


def _grpc(server, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}",
                               options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
        return list(pb_grpc.KeepwarmStub(channel).Generate(request, timeout=60))


def _grpc_refusal(server, request: pb.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        _grpc(server, request)
    return info.value


def _http(server, route: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.base}/{route}", content=content, headers={"Content-Type": "application/json"},
                      timeout=60)


def _serves(server) -> None:
    r = _http(server, "v1/completions", {"model": "tiny", "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200, r.text
    out = _grpc(server, pb.GenerateRequest(prompt="ok", sampling_params=pb.SamplingParams(max_tokens=2)))
    assert out[-1].usage.completion_tokens == 2


SP = pb.SamplingParams
# (id, gRPC request fields, the same request as a /v1/completions body, the gRPC field's path, HTTP's param, words
# both messages carry: the limit itself). Each was accepted by gRPC, or refused with a limit of its own, before.
TABLE = [
    ("request_id", dict(prompt="Hi", request_id="r" * 100_000), {"prompt": "Hi", "request_id": "r" * 100_000},
     "request_id", "request_id", "at most 256 characters"),
    ("n", dict(prompt="Hi", sampling_params=SP(n=17)), {"prompt": "Hi", "n": 17}, "sampling_params.n", "n",
     "less than or equal to 16"),
    ("logprobs", dict(prompt="Hi", sampling_params=SP(logprobs=21)), {"prompt": "Hi", "logprobs": 21},
     "sampling_params.logprobs", "logprobs", "less than or equal to 20"),
    ("max_tokens", dict(prompt="Hi", sampling_params=SP(max_tokens=0)), {"prompt": "Hi", "max_tokens": 0},
     "sampling_params.max_tokens", "max_tokens", "greater than or equal to 1"),
    ("context", dict(prompt="Hi", sampling_params=SP(max_tokens=CONTEXT)), {"prompt": "Hi", "max_tokens": CONTEXT},
     "sampling_params.max_tokens", "max_tokens", f"maximum context length is {CONTEXT} tokens"),
    ("seed+n", dict(prompt="Hi", sampling_params=SP(seed=INT64_MAX, n=2)), {"prompt": "Hi", "seed": INT64_MAX, "n": 2},
     "sampling_params.seed", "seed", f"[{-(1 << 63)}, {INT64_MAX - 1}]"),
    ("stop", dict(prompt="Hi", sampling_params=SP(stop=["ok", ""])), {"prompt": "Hi", "stop": ["ok", ""]},
     "sampling_params.stop.1", "stop", "at least 1 character"),
    ("stop_token_ids", dict(prompt="Hi", sampling_params=SP(stop_token_ids=[-1])), {"prompt": "Hi",
     "stop_token_ids": [-1]}, "sampling_params.stop_token_ids.0", "stop_token_ids", "greater than or equal to 0"),
    ("top_k", dict(prompt="Hi", sampling_params=SP(top_k=-2)), {"prompt": "Hi", "top_k": -2},
     "sampling_params.top_k", "top_k", "greater than or equal to -1"),
    ("min_tokens", dict(prompt="Hi", sampling_params=SP(min_tokens=5, max_tokens=2)),
     {"prompt": "Hi", "min_tokens": 5, "max_tokens": 2}, "sampling_params.min_tokens", "min_tokens",
     "between 0 and max_tokens"),
    ("temperature", dict(prompt="Hi", sampling_params=SP(temperature=math.nan)), '{"prompt": "Hi", "temperature": '
     'NaN}', "sampling_params.temperature", "temperature", "finite number"),
    ("empty prompt", dict(prompt=""), {"prompt": ""}, "prompt", "prompt", "at least 1 character"),
    ("prompt chars", dict(prompt="x" * 300_000), {"prompt": "x" * 300_000}, "prompt", "prompt",
     "characters cannot fit"),
]


@pytest.mark.parametrize("fields, body, path, param, words", [row[1:] for row in TABLE], ids=[r[0] for r in TABLE])
def test_grpc_holds_the_limits_http_holds(server, fields, body, path, param, words) -> None:
    """The same request on both front ends: HTTP 400 naming the field in ``param``, gRPC INVALID_ARGUMENT whose
    one-line message starts with the field's gRPC path; both state the same limit."""
    body = {"model": "tiny", **body} if isinstance(body, dict) else body.replace("{", '{"model": "tiny", ', 1)
    r = _http(server, "v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert words in r.json()["error"]["message"], r.text
    err = _grpc_refusal(server, pb.GenerateRequest(model="tiny", **fields))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details().startswith(f"{path}: ") and words in err.details(), err.details()
    assert "\n" not in err.details()


def test_grpc_token_ids_are_bounded_by_the_vocabulary(server) -> None:
    r = _http(server, "v1/completions", {"model": "tiny", "prompt": [1, server.vocab]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    err = _grpc_refusal(server, pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, server.vocab])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == f"prompt_token_ids: token ids must be in [0, {server.vocab})", err.details()
    err = _grpc_refusal(server, pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, -3])))
    assert err.details().startswith("prompt_token_ids.1: ") and "greater than or equal to 0" in err.details()


def test_a_message_over_the_body_limit_is_refused_on_both(server) -> None:
    """--max-request-body-mb bounds a gRPC message as it bounds an HTTP body."""
    prompt = "x" * (2 << 20)
    r = _http(server, "v1/completions", {"model": "tiny", "prompt": prompt})
    assert r.status_code == 413, r.text
    err = _grpc_refusal(server, pb.GenerateRequest(prompt=prompt))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err


def test_a_string_that_is_not_utf8_on_the_wire_is_named(server) -> None:
    """Bytes a client sends raw (HTTP's lone surrogate, on gRPC): INVALID_ARGUMENT naming the field, where gRPC
    itself answered UNKNOWN ("Unexpected DecodeError")."""
    stop = pb.SamplingParams(stop=["ok"]).SerializeToString().replace(b"ok", b"\xff\xfe")
    cases = [(bytes([0x12, 2, 0xFF, 0xFE]), "prompt"),  # field 2, 2 bytes
             (pb.GenerateRequest(prompt="hi").SerializeToString() + bytes([0x22, len(stop)]) + stop,
              "sampling_params.stop")]
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = channel.unary_stream("/keepwarm.v1.Keepwarm/Generate", request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
        for raw, path in cases:
            with pytest.raises(grpc.RpcError) as info:
                list(call(raw, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
            assert info.value.details() == f"{path}: not valid UTF-8 text"


def test_after_the_table_both_front_ends_serve(server) -> None:
    _serves(server)


# (route, raw JSON body, the path the 400's param must name): valid JSON, not valid Unicode text.
SURROGATES = [
    ("v1/completions", '{"model": "tiny", "prompt": "ab\\ud800cd", "max_tokens": 2}', "prompt"),
    ("v1/completions", '{"model": "ti\\udfffny", "prompt": "x", "max_tokens": 2}', "model"),
    ("v1/completions", '{"model": "tiny", "prompt": "x", "stop": ["ok", "\\udc00"]}', "stop.1"),
    ("v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "ab\\ud800cd"}]}',
     "messages.0.content"),
    ("v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
     '"text": "\\ud800"}]}]}', "messages.0.content.0.text"),
    ("tokenize", '{"prompt": "\\udbff"}', "prompt"),
]


@pytest.mark.parametrize("route, body, path", SURROGATES, ids=[p for _, _, p in SURROGATES])
def test_a_lone_surrogate_is_named_by_its_path(server, route: str, body: str, path: str) -> None:
    r = _http(server, route, body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == path, r.text
    assert err["message"].startswith(f"{path}: ") and "\n" not in err["message"], err


def test_a_worker_killed_by_a_signal_is_said_so_and_replaced(server) -> None:
    """kill -9 of the worker, a child of the zygote: the zygote reaps it and tells the supervisor, which logs
    the signal (it used to log "exited on its own with status 1"), replaces the worker, and both front ends serve."""
    dead = httpx.get(server.base + "/health", timeout=10).json()["restarts"]["worker_pid"]
    os.kill(dead, signal.SIGKILL)
    said = f"the worker (pid {dead}) exited on its own: killed by SIGKILL (signal 9)"

    def replaced() -> dict:
        try:
            restarts = httpx.get(server.base + "/health", timeout=10).json()["restarts"]
        except httpx.HTTPError:
            return {}
        return restarts if restarts.get("worker_pid") not in (None, dead) and said in server.output() else {}

    restarts = wait_until(replaced, 120, interval=0.1, message=lambda: server.output()[-3000:])
    assert said in server.output(), server.output()[-3000:]
    assert restarts["last_replacement"]["old_pid"] == dead and restarts["last_replacement"]["status"] == -9
    _serves(server)


def test_how_a_worker_ended_reads() -> None:
    from keepwarm.worker.process.children import ended, exit_status

    assert ended(-9) == "killed by SIGKILL (signal 9)" and ended(-15) == "killed by SIGTERM (signal 15)"
    assert ended(3) == "status 3" and ended(-200) == "killed by an unknown signal (signal 200)"
    assert (exit_status(-9), exit_status(70), exit_status(0), exit_status(1)) == (137, 70, 70, 1)
