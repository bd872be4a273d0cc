"""The supervisor's handles on its children: its zygotes (``Zygote``, ``Zygotes``: the current one and those
prepared ahead of an upgrade) and the workers they fork (``Worker``).

A worker is forked with the listening socket and a status socket (SCM_RIGHTS) and waited for until it says Ready
(a standby: Standing); one that fails (Failed, exits, or is not ready within the timeout) is killed and the caller
gets ``RestartFailed``, one line. A zygote that is gone is replaced by a new one, a cold start (the import floor),
whose reason the restart answers. How a worker ended (``ended``): "killed by SIGKILL (signal 9)" for a signal (its
zygote reaped it and said Exit(-9) for it), "status N" for an exit; the supervisor exits for a worker it gave up on
with ``exit_status`` (128 + N for signal N, as a shell reports it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from keepwarm.formats.wire import ProtocolError
from keepwarm.worker.process import ipc
from keepwarm.worker.process.config import ServerConfig
from keepwarm.worker.process.lifecycle import FATAL_EXIT_CODE

log = logging.getLogger("keepwarm.supervisor")

ZYGOTE_MAIN = "keepwarm.worker.zygote"  # the zygote's entry: the fork loop with the serving side's hooks
ZYGOTE_START_TIMEOUT_S = 300.0
FORK_TIMEOUT_S = 30.0


class RestartFailed(Exception):
    """A restart that did not happen; the old worker keeps serving. One line for the command to print."""


def ended(code: int) -> str:
    """How a worker ended, from its status as subprocess's returncode (-N: killed by signal N)."""
    if code >= 0:
        return f"status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "an unknown signal"
    return f"killed by {name} (signal {-code})"


def exit_status(code: int) -> int:
    """The status to exit with for a worker's ``code``: a shell's 128 + N for a signal, else the code (70, a failed
    engine's status, for 0)."""
    return 128 - code if code < 0 else code or FATAL_EXIT_CODE


@dataclass
class Worker:
    pid: int
    sock: socket.socket
    config: ServerConfig
    code: int | None = None  # its exit status once known (Exit: -N killed by signal N; 1 when none came)
    ready_at: float = field(default_factory=time.monotonic)
    fork_s: float = 0.0  # the Fork request to the zygote's Forked (its prepare() and fork())
    phases: dict[str, float] = field(default_factory=dict)  # its startup phases (Ready)
    python: str = ""  # the zygote's Python it was forked from
    standing: bool = False  # a standby that said Standing: warmed, waiting for Go

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def wait(self, deadline: float) -> int | None:
        """Its exit status once it ends (it is draining), or None at ``deadline`` (monotonic)."""
        while self.code is None and time.monotonic() < deadline:
            try:
                self.code = ipc.expect(self.sock, ipc.Exit, timeout=max(0.0, deadline - time.monotonic())).code
            except (EOFError, OSError):
                self.code = 1  # gone without an Exit (or its socket already closed on its end)
            except (TimeoutError, ProtocolError):
                continue
        return self.code

    def await_(self, expected: type, timeout: float, failure: str) -> None:
        """Wait for its Ready (or a standby's Standing): RestartFailed (it is killed) on anything else."""
        deadline = time.monotonic() + timeout
        try:
            msg, fds = ipc.recv(self.sock, timeout=timeout)
            for fd in fds:
                os.close(fd)
            why = msg.error if isinstance(msg, ipc.Failed) else "" if isinstance(msg, expected) else \
                f"it exited ({ended(msg.code)})" if isinstance(msg, ipc.Exit) else f"it sent {type(msg).__name__}"
        except (EOFError, TimeoutError, ProtocolError, OSError) as e:
            why = "it exited" if isinstance(e, EOFError | OSError) else \
                f"not ready after {timeout:.0f}s" if time.monotonic() >= deadline else str(e)
        if why:
            self.kill()
            self.close()
            raise RestartFailed(f"the new worker (pid {self.pid}) {failure}: {why}")
        if isinstance(msg, ipc.Standing):
            self.standing, self.phases = True, msg.phases
            return
        self.ready_at, self.phases = time.monotonic(), msg.phases
        log.info("worker %d ready %.3fs after its fork (weights from %s); phases (s): %s", msg.pid, msg.ready_s,
                 msg.weights_source, " ".join(f"{k} {v:.3f}" for k, v in msg.phases.items()))


@dataclass
class Zygote:
    proc: subprocess.Popen
    sock: socket.socket
    hello: ipc.Hello

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, listener: socket.socket, config: ServerConfig, restarts: dict[str, Any], log_level: str,
             standby: bool = False) -> Worker:
        """A worker of ``config`` (a standby: one that waits for Go); returns once it is forked."""
        ours, theirs = ipc.pair()
        t0 = time.monotonic()
        try:
            ipc.send(self.sock, ipc.Fork(config=config.to_dict(), restarts=restarts, log_level=log_level,
                                         standby=standby), fds=(listener.fileno(), theirs.fileno()))
            forked = ipc.expect(self.sock, ipc.Forked, timeout=FORK_TIMEOUT_S)
        except (OSError, EOFError, TimeoutError, ProtocolError) as e:
            ours.close()
            raise RestartFailed(f"the zygote (pid {self.hello.pid}) did not fork: {e}") from None
        finally:
            theirs.close()
        return Worker(forked.pid, ours, config, fork_s=time.monotonic() - t0, python=self.hello.python)

    def probe(self) -> Any:
        """Its own account of what it holds (ProbeReply), or a RestartReply saying why not."""
        if not self.alive:
            return ipc.RestartReply(ok=False, message="no zygote runs")
        try:
            ipc.send(self.sock, ipc.Probe())
            return ipc.expect(self.sock, ipc.ProbeReply, timeout=FORK_TIMEOUT_S)
        except (OSError, EOFError, TimeoutError, ProtocolError) as e:
            return ipc.RestartReply(ok=False, message=f"the zygote did not answer: {e}")

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_zygote(python: str, log_level: str) -> Zygote:
    """A zygote from ``python`` (this one, or another venv's for an upgrade); returns once its imports are done."""
    ours, theirs = ipc.pair()
    env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}  # torch.cuda.is_available() without cuInit
    t0 = time.time()
    proc = subprocess.Popen([python, "-m", ZYGOTE_MAIN, str(theirs.fileno()), log_level, repr(t0)],
                            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
    theirs.close()
    try:
        hello = ipc.expect(ours, ipc.Hello, timeout=ZYGOTE_START_TIMEOUT_S)
    except (EOFError, TimeoutError, ProtocolError) as e:
        proc.kill()
        proc.wait()
        ours.close()
        raise RestartFailed(f"the zygote from {python} did not start ({e}; exit status {proc.returncode})") \
            from None
    log.info("zygote %d from %s (keepwarm %s): imports in %.2fs", hello.pid, hello.python, hello.version,
             hello.import_s)
    return Zygote(proc, ours, hello)


class Zygotes:
    """The zygote workers are forked from, and those started ahead of an upgrade (``prepare``), by Python."""

    def __init__(self, log_level: str) -> None:
        self.log_level = log_level
        self.current: Zygote | None = None
        self.prepared: dict[str, Zygote] = {}

    def start(self, python: str) -> Zygote:
        self.current = start_zygote(python, self.log_level)
        return self.current

    def prepare(self, python: str) -> Zygote:
        z = self.prepared.get(python)
        if z is None or not z.alive:
            z = self.prepared[python] = start_zygote(python, self.log_level)
        return z

    def for_python(self, python: str) -> tuple[Zygote, str, str]:
        """The zygote to fork from, and whether the restart is warm ("zygote") or had to start one ("cold")."""
        z = self.current
        if z is not None and z.alive and z.hello.python == python:
            return z, "zygote", ""
        prepared = self.prepared.pop(python, None)
        if prepared is not None and prepared.alive:
            self._replace(prepared)
            return prepared, "zygote", ""
        if z is not None and z.hello.python == python:
            reason = f"the zygote (pid {z.hello.pid}) was gone (exit status {z.proc.poll()})"
        else:
            reason = f"no zygote from {python} was prepared (`keepwarm restart --prepare --python {python}`)"
        log.warning("%s: starting one (cold start)", reason)
        new = start_zygote(python, self.log_level)
        self._replace(new)
        return new, "cold", reason

    def _replace(self, z: Zygote) -> None:
        if self.current is not None and self.current is not z:
            self.current.stop()
        self.current = z

    def stop(self) -> None:
        for z in [self.current, *self.prepared.values()]:
            if z is not None:
                z.stop()
