"""`keepwarm serve --zygote --standby`: a worker kept forked, attached and warmed, not accepting, for the next restart.

Real processes and sockets, as test_restart.py: a daemon of its own, the supervisor, `keepwarm restart`, the official
openai client as the load. One server is shared by the module's tests, in order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import openai
import pytest
from support.serve import ServeProcess, metric
from support.supervised import PROMPTS, Load, ask, engine_config, health, restart
from support.wait import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_llama):
    from keepwarm.daemon.client import start_daemon

    rt = Path(tempfile.mkdtemp(prefix="kws-", dir="/tmp"))
    client = start_daemon(rt)
    s = None
    try:
        client.preload(tiny_llama, "none", "float32")
        env = {"KEEPWARM_RUNTIME_DIR": str(rt)}
        s = ServeProcess(tiny_llama, "--zygote", "--standby", "--dtype", "float32", "--max-model-len", "256",
                         "--threads", "1", "--served-model-name", "tiny", "--shutdown-timeout", "120", env=env,
                         timeout=180)
        s.env = {**os.environ, **env}
        yield s
    finally:
        if s is not None:
            code = s.stop()
            assert code == 0, s.output()[-3000:]
        client.shutdown()
        client.close()


def standby_pid(server, other_than: int | None = None, timeout: float = 120.0) -> int:
    """The warmed standby's pid (one other than ``other_than``) once /health reports it."""
    def standby() -> int | None:
        pid = health(server)["restarts"]["standby_pid"]
        return pid if pid is not None and pid != other_than else None

    return wait_until(standby, timeout, message=lambda: f"no standby after {timeout:.0f}s: {server.output()[-2000:]}")


def _children(pid: int) -> list[int]:
    return [int(c) for tid in os.listdir(f"/proc/{pid}/task")
            for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]


def policies(pid: int) -> set[int]:
    """The scheduling policies of every thread of ``pid`` and of its child processes (a worker's lease keeper)."""
    pids = [pid, *_children(pid)]
    assert len(pids) > 1, "no child process found"
    return {os.sched_getscheduler(int(t)) for p in pids for t in os.listdir(f"/proc/{p}/task")}


def gone(pid: int, timeout: float = 30.0) -> bool:
    # the zygote reaps its children
    return wait_until(lambda: not Path(f"/proc/{pid}").exists(), timeout, strict=False)


def test_restarts_take_over_the_warmed_standby_under_load(server) -> None:
    """The standby maps the daemon's arena and accepts nothing; a restart with the same flags hands the socket to
    it (mode standby) with no failed or wrong answer, and a new standby follows; changed flags drop the standby
    (its config is stale), fork a worker with them, and the next standby carries them."""
    spare = standby_pid(server)
    assert ".arena" in Path(f"/proc/{spare}/maps").read_text()
    # it warmed (and waits) at SCHED_IDLE where it may return from it (root here in CI), else it says why not
    if os.geteuid() == 0:
        assert policies(spare) == {os.SCHED_IDLE}
    else:
        assert policies(spare) == {os.SCHED_IDLE} or f"standby worker {spare} warms at normal" in server.output()
    worker = health(server)["restarts"]["worker_pid"]
    # on fresh connections only the serving worker answers: the standby has not started accepting
    assert {httpx.get(server.base + "/health", timeout=10).json()["restarts"]["worker_pid"] for _ in range(20)} \
        == {worker}
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    references = {(p, k): ask(client, p, k)[0] for p in PROMPTS for k in ("stream", "plain", "chat")}
    with Load(server.base, references) as load:
        load.wait_for(6)
        for _ in range(2):
            r = restart(server)
            assert r.returncode == 0 and "(standby)" in r.stdout, r.stdout + r.stderr
            assert health(server)["restarts"]["worker_pid"] == spare
            assert policies(spare) == {os.SCHED_OTHER}  # serving: every thread and the lease keeper back
            load.wait_for(6)
            spare = standby_pid(server, other_than=spare)
        r = restart(server, "--max-num-seqs", "3")
        assert r.returncode == 0 and "(zygote)" in r.stdout, r.stdout + r.stderr
        assert gone(spare), f"the stale standby {spare} still runs"
        load.wait_for(6)
        spare = standby_pid(server, other_than=spare)
        r = restart(server)
        assert r.returncode == 0 and "(standby)" in r.stdout, r.stdout + r.stderr
        assert engine_config(server)["max_num_seqs"] == 3 and engine_config(server)["weights_source"] == "daemon"
        load.wait_for(6)
    assert not load.errors, load.errors[:10]
    samples = server.metrics()
    assert metric(samples, "keepwarm:restarts_total", mode="standby") == 3
    assert metric(samples, "keepwarm:restarts_total", mode="zygote") == 1
    assert "standby_wait" in health(server)["startup"]


def test_a_dead_worker_is_replaced_by_the_standby(server) -> None:
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    reference = ask(client, PROMPTS[1], "plain")
    spare = standby_pid(server)
    dead = health(server)["restarts"]["worker_pid"]
    os.kill(dead, signal.SIGKILL)
    assert gone(dead)
    assert ask(client, PROMPTS[1], "plain") == reference
    after = health(server)["restarts"]
    assert after["worker_pid"] == spare and after["last_replacement"]["mode"] == "standby"
    standby_pid(server, other_than=spare)  # and another standby follows


def test_a_dead_standby_is_said_and_the_next_restart_forks(server) -> None:
    spare = standby_pid(server)
    os.kill(spare, signal.SIGKILL)
    assert gone(spare)
    wait_until(lambda: f"standby worker {spare} exited" in server.output(), 30, strict=False)
    assert f"standby worker {spare} exited" in server.output()
    assert health(server)["restarts"]["standby_pid"] is None
    r = restart(server)
    assert r.returncode == 0 and "(zygote)" in r.stdout, r.stdout + r.stderr
    standby_pid(server, other_than=spare)


def test_standby_without_zygote_is_refused_in_one_line(tiny_llama) -> None:
    r = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "serve", tiny_llama, "--standby"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: --standby needs --zygote"), r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="leaving SCHED_IDLE needs root or an RLIMIT_NICE allowing nice 0")
def test_normal_priority_lifts_a_process_its_threads_and_children_out_of_sched_idle() -> None:
    """What the supervisor does to a standby still warming when a restart needs it (its warm-up may get no CPU
    under load at SCHED_IDLE): every thread of the process and of its children back to SCHED_OTHER."""
    from keepwarm.worker.process.priority import normal_priority

    code = ("import subprocess, sys, threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print(c.pid, flush=True); "
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)))
    try:
        child = int(proc.stdout.readline())
        assert policies(proc.pid) == {os.SCHED_IDLE} and child in _children(proc.pid)
        normal_priority(proc.pid)
        assert policies(proc.pid) == {os.SCHED_OTHER}
    finally:
        proc.kill()
        proc.wait()
