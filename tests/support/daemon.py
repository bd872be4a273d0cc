"""Real daemon and worker processes for the tests: `keepwarm daemon run` on a runtime dir of its own (not
detached, so a test can SIGKILL it), a worker process that attaches or loads from disk and reports as JSON
(support/worker_script.py), and a "machine" (``Side``: its own KEEPWARM_HOME and runtime dir) for the snapshot
and fault tests.

Runtime dirs live directly under /tmp: a unix socket path is limited to 107 bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from keepwarm.daemon.client import DaemonClient
from keepwarm.formats import paths
from keepwarm.snapshot.store import Store
from support.procs import stop_process
from support.wait import wait_until

WORKER_SCRIPT = str(Path(__file__).with_name("worker_script.py"))


def new_runtime_dir(prefix: str = "kwrt-") -> Path:
    """A fresh, short runtime dir under /tmp (remove it with ``remove_runtime_dir``)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def remove_runtime_dir(runtime_dir: Path) -> None:
    """The runtime dir and the daemon's shared-memory dir beside it."""
    shutil.rmtree(paths.shm_dir(runtime_dir), ignore_errors=True)
    shutil.rmtree(runtime_dir, ignore_errors=True)


def wait_daemon_up(runtime_dir: Path, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    """Until the daemon on ``runtime_dir`` answers a ping; an AssertionError with its log once ``proc`` exited."""
    def log_tail() -> str:
        return log.read_text()[-3000:] if log.exists() else ""

    def answers() -> bool:
        assert proc.poll() is None, f"daemon exited {proc.returncode}: {log_tail()}"
        return c.ping(timeout=0.5) is not None

    with DaemonClient(runtime_dir) as c:
        wait_until(answers, timeout, message=lambda: f"daemon did not start: {log_tail()}")


class DaemonProc:
    """A real `keepwarm daemon run --threads N` process on ``runtime_dir``; ``env`` adds to (or overrides) the
    environment it and the CLI commands of a test run with (``env``)."""

    def __init__(self, runtime_dir: Path, threads: int = 2, env: dict[str, str] | None = None) -> None:
        self.runtime_dir = runtime_dir
        self.threads = threads
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KEEPWARM_RUNTIME_DIR": str(self.runtime_dir), "OMP_NUM_THREADS": "1",
                **self.extra_env}

    @property
    def log_path(self) -> Path:
        return self.runtime_dir / "test-daemon.log"

    def start(self, *args: str) -> DaemonProc:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "keepwarm.cli.main", "daemon", "run", "--threads",
                                          str(self.threads), *args], env=self.env, stdout=log, stderr=log)
        wait_daemon_up(self.runtime_dir, self.proc, self.log_path)
        return self

    def client(self, timeout: float = 30.0) -> DaemonClient:
        return DaemonClient(self.runtime_dir, timeout=timeout)

    def status(self) -> dict:
        with self.client() as c:
            return c.status()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=30)


class Worker:
    """support/worker_script.py: an engine that attaches (``daemon="on"``) or loads from disk, generates greedily and
    prints a JSON report; with ``hold`` it then takes commands on stdin (``send``) and answers a line each."""

    def __init__(self, model: str, runtime_dir: Path, daemon: str = "on", hold: bool = True,
                 quantization: str = "none") -> None:
        env = {**os.environ, "KEEPWARM_RUNTIME_DIR": str(runtime_dir), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, WORKER_SCRIPT, model, "--daemon", daemon, "--quantization", quantization]
        self.proc = subprocess.Popen(cmd + (["--hold"] if hold else []), env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.report = self.read()

    def read(self) -> dict:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"worker died ({self.proc.wait()}): {self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("exit")
            self.proc.wait(timeout=30)


class Side:
    """One "machine": its own KEEPWARM_HOME and daemon runtime dir (a fresh one unless given)."""

    def __init__(self, root: Path, runtime_dir: Path | None = None) -> None:
        self.home = root / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.own_rt = runtime_dir is None
        self.rt = runtime_dir or new_runtime_dir("kwsn-")
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KEEPWARM_HOME": str(self.home), "KEEPWARM_RUNTIME_DIR": str(self.rt),
                "OMP_NUM_THREADS": "1"}

    @property
    def store(self) -> Store:
        return Store(self.home / "store")

    def start_daemon(self, *args: str, env: dict[str, str] | None = None) -> Side:
        """`daemon run --threads 2 ARGS` with this side's environment (or ``env``), once it answers."""
        log_path = self.rt / "test-daemon.log"
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "keepwarm.cli.main", "daemon", "run", "--threads", "2",
                                          *args], env=env or self.env, stdout=log, stderr=log)
        wait_daemon_up(self.rt, self.proc, log_path)
        return self

    def status(self) -> dict:
        with DaemonClient(self.rt) as c:
            return c.status()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        else:  # a daemon that restore started (detached)
            with DaemonClient(self.rt) as c:
                if c.ping(timeout=0.5) is not None:
                    c.shutdown()
                    with contextlib.suppress(AssertionError):  # cleanup: a slow exit is not the test's failure
                        wait_until(lambda: not paths.socket_path(self.rt).exists(), 30)
        if self.own_rt:
            remove_runtime_dir(self.rt)
