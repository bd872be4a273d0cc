"""`keepwarm serve --zygote` and `keepwarm restart`: restarts with no downtime, from a pre-imported zygote.

Real processes and sockets: a daemon in a runtime dir of its own (the workers attach to its arena), the supervisor
started by `keepwarm serve --zygote`, the `keepwarm restart` command, and the official openai client as the load.
One supervised server is shared by the module's tests, in order: the restarts under load, a failed restart, a
restart after the zygote was killed, and what the zygote holds.
"""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import httpx
import openai
import pytest
import torch
from support.ports import free_port
from support.serve import ServeProcess, metric, parse_metrics
from support.supervised import PROMPTS, Load, ask, engine_config, health, restart
from support.wait import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def supervised(tiny_llama, tmp_path_factory):
    from keepwarm.daemon.client import start_daemon

    rt = Path(tempfile.mkdtemp(prefix="kwz-", dir="/tmp"))  # short: unix socket paths are limited
    client = start_daemon(rt)
    toml = tmp_path_factory.mktemp("zygote") / "server.toml"
    toml.write_text("max_num_batched_tokens = 512\n")
    server = None
    try:
        client.preload(tiny_llama, "none", "float32")
        env = {"KEEPWARM_RUNTIME_DIR": str(rt)}
        grpc_port = free_port()
        server = ServeProcess(tiny_llama, "--zygote", "--grpc", "--grpc-port", str(grpc_port), "--config", toml,
                              "--dtype", "float32", "--max-model-len",
                              "256", "--threads", "1", "--served-model-name", "tiny", "--shutdown-timeout", "120",
                              env=env, timeout=180)
        server.env = {**os.environ, **env}
        server.toml = toml
        server.grpc_port = grpc_port
        yield server
    finally:
        if server is not None:
            code = server.stop()
            assert code == 0, server.output()[-3000:]
        client.shutdown()
        client.close()


# (flags of each restart, what the engine must report after it); the fifth is SIGHUP with server.toml changed.
RESTARTS = [
    (["--max-num-seqs", "3"], {"max_num_seqs": 3}),
    (["--block-size", "32", "--no-enable-prefix-caching"], {"block_size": 32, "enable_prefix_caching": False}),
    (["--max-num-seqs", "5"], {"max_num_seqs": 5, "block_size": 32}),
    (["--enable-prefix-caching", "--block-size", "16"], {"enable_prefix_caching": True, "block_size": 16}),
]


def test_restarts_under_load(supervised) -> None:
    """Five restarts (four `keepwarm restart` with changed flags, one SIGHUP after server.toml changed) while
    clients send requests without pause: none fails or is cut short, every greedy answer is its reference, each
    new worker attached to the daemon's arena and runs the new flags."""
    client = openai.OpenAI(base_url=supervised.base + "/v1", api_key="unused", max_retries=0)
    references = {(p, k): ask(client, p, k)[0] for p in PROMPTS for k in ("stream", "plain", "chat")}
    pids = [health(supervised)["restarts"]["worker_pid"]]
    with Load(supervised.base, references) as load:
        load.wait_for(6)
        for flags, expected in RESTARTS:
            r = restart(supervised, *flags)
            assert r.returncode == 0, r.stdout + r.stderr
            assert "handoff in" in r.stdout and "(zygote)" in r.stdout, r.stdout
            engine = engine_config(supervised)
            assert {k: engine[k] for k in expected} == expected, (flags, engine)
            assert engine["weights_source"] == "daemon"
            pids.append(health(supervised)["restarts"]["worker_pid"])
            load.wait_for(6)
        supervised.toml.write_text("max_num_batched_tokens = 384\n")
        supervised.proc.send_signal(signal.SIGHUP)  # systemd's ExecReload
        wait_until(lambda: engine_config(supervised)["max_num_batched_tokens"] == 384, 120, interval=0.1,
                   strict=False)
        assert engine_config(supervised)["max_num_batched_tokens"] == 384
        assert engine_config(supervised)["max_num_seqs"] == 5  # the flags given by restarts stay
        pids.append(health(supervised)["restarts"]["worker_pid"])
        load.wait_for(6)
    assert not load.errors, load.errors[:10]
    assert len(set(pids)) == 6, pids  # six workers served in turn
    samples = parse_metrics(httpx.get(supervised.base + "/metrics").text)
    assert metric(samples, "keepwarm:restarts_total", mode="zygote") == 5
    assert metric(samples, "keepwarm:restart_duration_seconds_count") == 5
    assert "SIGHUP: handoff in" in supervised.output()
    # gRPC (--grpc) moved to the new worker too: the port is shared across the handoff, the old one stopped
    import grpc

    from keepwarm.worker.grpc.grpc_gen import keepwarm_pb2 as pb
    from keepwarm.worker.grpc.grpc_gen import keepwarm_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{supervised.grpc_port}") as channel:
        grpc_health = pb_grpc.KeepwarmStub(channel).Health(pb.HealthRequest(), timeout=30)
    assert grpc_health.status == pb.HealthResponse.SERVING


LONG_PROMPT = list(range(7, 7 + 70))  # four full 16-token blocks and 6 tokens more


def _complete(server, prompt: list[int]) -> list[str]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    r = httpx.post(server.base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_a_restart_carries_the_prefix_cache_over(supervised) -> None:
    """The old worker's cached blocks move to the new one: a prompt it had served is a prefix hit right after the
    restart, with the same greedy tokens; a restart whose new worker has other KV (another block size) carries
    nothing and says why."""
    reference = _complete(supervised, LONG_PROMPT)
    r = restart(supervised)
    assert r.returncode == 0 and "blocks carried over" in r.stdout, r.stdout + r.stderr
    carried = health(supervised)["restarts"]["last"]["prefix_cache"]
    assert carried["blocks"] >= 4 and carried["nbytes"] > 0, carried
    hits = supervised.metric("vllm:prefix_cache_hits_total")
    assert _complete(supervised, LONG_PROMPT) == reference
    assert supervised.metric("vllm:prefix_cache_hits_total") - hits == 4 * 16
    assert supervised.metric("keepwarm:restart_prefix_blocks_carried_total") >= carried["blocks"]
    r = restart(supervised, "--block-size", "32")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "prefix cache not carried over: the KV's block_size differs (16 there, 32 here)" in r.stdout, r.stdout
    assert _complete(supervised, LONG_PROMPT) == reference
    assert restart(supervised, "--block-size", "16").returncode == 0


def test_a_restart_that_fails_its_warm_up_leaves_the_old_worker_serving(supervised) -> None:
    before = health(supervised)["restarts"]
    r = restart(supervised, "--kv-cache-dtype", "int3")
    assert r.returncode == 1
    line = r.stderr.strip().splitlines()[-1]
    assert "failed its warm-up" in line and "int3" in line and "keeps serving" in line, r.stderr
    after = health(supervised)["restarts"]
    assert after["worker_pid"] == before["worker_pid"]
    assert after["failed"] == before["failed"] + 1
    client = openai.OpenAI(base_url=supervised.base + "/v1", api_key="unused", max_retries=0)
    assert ask(client, PROMPTS[0], "plain")[1] == "length"
    # the refused flag was not adopted: the next restart runs without it
    r = restart(supervised)
    assert r.returncode == 0, r.stderr
    assert engine_config(supervised)["kv_cache_dtype"] != "int3"


def test_a_restart_after_the_zygote_was_killed_is_a_cold_start_and_says_so(supervised) -> None:
    zygote = health(supervised)["restarts"]["zygote_pid"]
    os.kill(zygote, signal.SIGKILL)
    wait_until(lambda: not Path(f"/proc/{zygote}").exists(), 10, strict=False)
    r = restart(supervised, "--max-num-seqs", "4")
    assert r.returncode == 0, r.stderr
    assert "(cold)" in r.stdout and f"the zygote (pid {zygote}) was gone" in r.stdout, r.stdout
    assert "cold start" in r.stderr, r.stderr
    restarts = health(supervised)["restarts"]
    assert restarts["last"]["mode"] == "cold" and str(zygote) in restarts["last"]["reason"]
    assert restarts["zygote_pid"] not in (None, zygote)
    assert f"the zygote (pid {zygote}) was gone" in supervised.output()
    assert engine_config(supervised)["max_num_seqs"] == 4
    assert metric(supervised.metrics(), "keepwarm:restarts_total", mode="cold") == 1
    r = restart(supervised)  # the new zygote serves the next restart warm
    assert r.returncode == 0 and "(zygote)" in r.stdout, r.stdout + r.stderr


def test_an_upgrade_forks_from_a_zygote_of_the_other_python_prepared_ahead(supervised) -> None:
    """`restart --prepare --python P` starts P's zygote in the background; `restart --python P` then forks from it
    (warm), and it serves the restarts after. P here is the venv's other name for its interpreter: another
    environment works the same way when its keepwarm speaks the same ipc version."""
    current = health(supervised)["restarts"]["python"]
    other = str(Path(current).with_name("python3" if Path(current).name != "python3" else "python"))
    assert Path(other).exists() and other != current
    r = restart(supervised, "--prepare", "--python", other)
    assert r.returncode == 0 and f"zygote from {other} ready" in r.stdout, r.stdout + r.stderr
    r = restart(supervised, "--python", other)
    assert r.returncode == 0 and "(zygote)" in r.stdout, r.stdout + r.stderr
    restarts = health(supervised)["restarts"]
    assert restarts["python"] == other and restarts["last"]["mode"] == "zygote"


def test_a_worker_that_dies_is_replaced_warm_from_the_zygote(supervised) -> None:
    """kill -9 of the worker: the supervisor forks a replacement from the zygote with the running config; a request
    sent meanwhile waits in the listening socket's queue and gets its answer; /health, /metrics and the log say so."""
    client = openai.OpenAI(base_url=supervised.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    reference = ask(client, PROMPTS[1], "plain")
    before, engine = health(supervised)["restarts"], engine_config(supervised)
    dead = before["worker_pid"]
    os.kill(dead, signal.SIGKILL)
    wait_until(lambda: not Path(f"/proc/{dead}").exists(), 10, interval=0.01, strict=False)  # the zygote reaps it
    assert ask(client, PROMPTS[1], "plain") == reference
    after = health(supervised)["restarts"]
    assert after["worker_pid"] != dead and after["replaced"] == before["replaced"] + 1
    assert after["last_replacement"]["old_pid"] == dead and after["last_replacement"]["mode"] == "zygote"
    assert engine_config(supervised) == engine  # the running config, not the command line's
    assert metric(supervised.metrics(), "keepwarm:worker_replacements_total") == before["replaced"] + 1
    assert f"the worker (pid {dead}) exited on its own" in supervised.output()


def test_the_replacement_policy_gives_up_after_failures_in_a_row() -> None:
    """Backoff grows with the failures in a row; a worker that served long enough resets them; REPLACE_MAX_FAILURES
    in a row give up (the supervisor then exits non-zero and systemd restarts the server)."""
    from keepwarm.worker.process.supervisor import REPLACE_MAX_FAILURES, REPLACE_STABLE_S, ReplacePolicy

    policy = ReplacePolicy()
    policy.worker_died(REPLACE_STABLE_S + 1)
    assert (policy.failures, policy.give_up, policy.backoff_s) == (0, False, 0.0)
    delays = []
    for _ in range(REPLACE_MAX_FAILURES - 1):
        policy.attempt_failed()
        delays.append(policy.backoff_s)
        assert not policy.give_up
    assert delays == sorted(delays) and delays[0] > 0
    policy.worker_died(1.0)  # one more: a replacement that died at once
    assert policy.give_up
    policy.worker_died(REPLACE_STABLE_S)
    assert not policy.give_up


def _probe(server) -> object:
    from keepwarm.worker.process import ipc

    reply = ipc.request_restart(server.port, ipc.Probe(), Path(server.env["KEEPWARM_RUNTIME_DIR"]))
    assert isinstance(reply, ipc.ProbeReply), reply
    return reply


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_the_zygote_never_builds_an_engine_or_starts_a_thread(supervised) -> None:
    """CPU twin of the GPU test below: the zygote holds no engine, no model, no event loop, no thread besides its
    own, and maps no arena; its worker maps the daemon's arena. What it does hold: the server's tokenizer, loaded
    once for every worker it forks (prepare)."""
    probe = _probe(supervised)
    restarts = health(supervised)["restarts"]
    assert probe.pid == restarts["zygote_pid"]
    assert (probe.engines, probe.modules, probe.event_loop, probe.threads) == (0, 0, False, 1)
    assert probe.tokenizers == [str(Path(engine_config(supervised)["tokenizer"]).resolve())]
    assert not probe.cuda_initialized
    assert ".arena" not in _maps(probe.pid)
    assert ".arena" in _maps(restarts["worker_pid"])


@pytest.mark.gpu
def test_the_zygote_never_holds_cuda_state(tiny_llama, tmp_path) -> None:
    """On a GPU: the worker initialises CUDA after its fork; the zygote never loads the driver."""
    assert torch.cuda.is_available()
    rt = Path(tempfile.mkdtemp(prefix="kwzg-", dir="/tmp"))
    s = ServeProcess(tiny_llama, "--zygote", "--no-daemon", "--device", "cuda", "--dtype", "float32",
                     "--max-model-len", "256", env={"KEEPWARM_RUNTIME_DIR": str(rt)}, timeout=300)
    s.env = {**os.environ, "KEEPWARM_RUNTIME_DIR": str(rt)}
    try:
        probe = _probe(s)
        assert not probe.cuda_initialized and probe.engines == 0
        assert "libcuda" not in _maps(probe.pid)
        worker = health(s)["restarts"]["worker_pid"]
        assert "libcuda" in _maps(worker)
        assert engine_config(s)["device"].startswith("cuda")
        r = restart(s, "--max-num-seqs", "3")
        assert r.returncode == 0 and "(zygote)" in r.stdout, r.stdout + r.stderr
        assert "libcuda" not in _maps(_probe(s).pid)
    finally:
        assert s.stop() == 0
