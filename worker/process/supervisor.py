"""`keepwarm serve --zygote`: a supervisor that owns the listening socket and a zygote, and restarts the worker
with no downtime (`keepwarm restart`, SIGHUP, systemd's ExecReload; the steps: keepwarm.worker.process.handoff).

Processes: the supervisor (this module, no torch: it starts in ~0.2 s and stays small), its zygote
(keepwarm.worker.process.zygote: the imports done, nothing built) and the workers the zygote forks
(keepwarm.worker.process.children), one of them perhaps a standby (keepwarm.worker.process.standby). It owns the
zygote, not the daemon: only the supervisor holds what a worker needs besides weights (the listening socket, the
config, the restart history); the daemon serves several servers and knows none of that.
A worker that exits on its own (a crash, ``kill -9``, 70: the engine failed) is replaced (``_replace``) with the
running config while the listening socket stays open here, so new connections wait in the kernel's queue (the dead
worker's in-flight requests are lost with it). Bounded: a replacement that fails, or a worker that dies within
``REPLACE_STABLE_S`` of becoming ready, is a failure; after ``REPLACE_MAX_FAILURES`` in a row the supervisor exits
with the worker's status (``children.exit_status``) so systemd restarts everything, waiting 0.5, 1, 2... s between
attempts; replacements are logged and counted (/health, /metrics). SIGTERM/SIGINT drain everything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keepwarm.formats import paths
from keepwarm.formats.wire import ProtocolError
from keepwarm.worker.process import handoff, ipc
from keepwarm.worker.process.children import RestartFailed, Worker, Zygote, Zygotes, ended, exit_status
from keepwarm.worker.process.config import ConfigError, ServerConfig, build_config, load_toml
from keepwarm.worker.process.listen import bind_listener, systemd_socket
from keepwarm.worker.process.standby import Standby

log = logging.getLogger("keepwarm.supervisor")

# The flags a restart with ``replace_flags`` keeps: where the server listens (the socket is handed over, it cannot
# move) and which daemon it uses.
PLACE_FLAGS = frozenset({"host", "port", "runtime_dir"})
REPLACE_MAX_FAILURES = 3  # failed replacements (or workers dead within REPLACE_STABLE_S) in a row before giving up
REPLACE_STABLE_S = 30.0  # a worker that served this long before dying resets the count
REPLACE_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 4.0)  # the wait before attempt 1, 2, ... (the last one repeats)


@dataclass
class History:
    """What /health and /metrics show (handed to every new worker)."""

    total: dict[str, int] = field(default_factory=lambda: {"standby": 0, "zygote": 0, "cold": 0})
    failed: int = 0
    durations: list[float] = field(default_factory=list)
    last: dict[str, Any] | None = None
    replaced: int = 0  # workers that exited on their own and were replaced
    replace_failed: int = 0  # replacement attempts that failed
    last_replacement: dict[str, Any] | None = None
    carried_blocks: int = 0  # prefix-cache blocks restarts carried over to their new worker

    def to_dict(self, zygote: Zygote | None, standby_pid: int | None) -> dict[str, Any]:
        return {"supervisor_pid": os.getpid(), "zygote_pid": zygote.hello.pid if zygote and zygote.alive else None,
                "standby_pid": standby_pid, "python": zygote.hello.python if zygote else None,
                "total": dict(self.total), "failed": self.failed, "durations": list(self.durations[-1000:]),
                "last": self.last, "replaced": self.replaced, "replace_failed": self.replace_failed,
                "last_replacement": self.last_replacement, "prefix_blocks_carried": self.carried_blocks}


@dataclass
class ReplacePolicy:
    """When to replace a worker that exited on its own, and when to give up (see the module docstring)."""

    failures: int = 0  # in a row

    def worker_died(self, served_s: float) -> None:
        """A worker died after serving ``served_s`` seconds: a failure unless it had been stable."""
        self.failures = 0 if served_s >= REPLACE_STABLE_S else self.failures + 1

    def attempt_failed(self) -> None:
        self.failures += 1

    @property
    def give_up(self) -> bool:
        return self.failures >= REPLACE_MAX_FAILURES

    @property
    def backoff_s(self) -> float:
        """The wait before the next attempt."""
        return REPLACE_BACKOFF_S[min(self.failures, len(REPLACE_BACKOFF_S) - 1)]


class Supervisor:
    def __init__(self, config_file: str | None, flags: dict[str, Any], log_level: str = "INFO") -> None:
        self.config_file = config_file
        self.flags = {k: v for k, v in flags.items() if v is not None}
        self.log_level = log_level
        self.config = self._build(config_file, self.flags)
        self.zygotes = Zygotes(log_level)
        self.worker: Worker | None = None
        self.old: list[Worker] = []  # draining
        self.standby = Standby(changed=self._send_history)  # ``--standby``: forked and warmed, not accepting
        self.history = History()
        self.replace_policy = ReplacePolicy()
        self.listener: socket.socket | None = None
        self.control: socket.socket | None = None
        self.control_path: Path | None = None
        self._signals: list[int] = []  # signal numbers, in arrival order

    @staticmethod
    def _build(config_file: str | None, flags: dict[str, Any]) -> ServerConfig:
        return build_config(load_toml(config_file) if config_file else {}, flags)

    # -- start and run -----------------------------------------------------------------------------------------
    def run(self) -> int:
        self.listener = systemd_socket() or bind_listener(self.config.host, self.config.port)
        port = self.listener.getsockname()[1]
        self.control = self._bind_control(port)
        zygote = self.zygotes.start(sys.executable)
        try:
            self.worker = self._spawn(zygote, self.config, timeout=600.0)
        except RestartFailed as e:
            self._close()
            raise ConfigError(str(e)) from None
        return self._loop()

    def _bind_control(self, port: int) -> socket.socket:
        path = ipc.control_path(port)
        paths.ensure_private_dir(path.parent)
        with contextlib.suppress(FileNotFoundError), socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            try:
                probe.connect(str(path))
                raise ConfigError(f"a supervised server already answers on {path}")
            except ConnectionRefusedError:
                path.unlink()  # stale: its supervisor is gone
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(8)
        self.control_path = path
        return sock

    def _fork(self, zygote: Zygote, config: ServerConfig, standby: bool = False) -> Worker:
        assert self.listener is not None
        return zygote.fork(self.listener, config, self._restarts(), self.log_level, standby)

    def _spawn(self, zygote: Zygote, config: ServerConfig, timeout: float) -> Worker:
        """Fork a worker from ``zygote`` and wait until it says Ready; RestartFailed (it is killed) otherwise."""
        worker = self._fork(zygote, config)
        worker.await_(ipc.Ready, timeout, "failed its warm-up")
        return worker

    def _new_worker(self, config: ServerConfig, python: str, timeout: float) -> tuple[Worker, str, str]:
        """The standby told Go, or a worker forked (warm from a zygote, or cold): (worker, mode, cold reason)."""
        self.standby.later()  # whatever happens, a standby (of the config that ends up serving) follows
        new = self.standby.take(config, python, timeout)
        if new is not None:
            return new, "standby", ""
        zygote, mode, reason = self.zygotes.for_python(python)
        return self._spawn(zygote, config, timeout), mode, reason

    def _loop(self) -> int:
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        signal.set_wakeup_fd(wfd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda s, _f: self._signals.append(int(s)))
        assert self.control is not None
        try:
            while True:
                watched = {w.sock: w for w in [self.worker, *self.old, self.standby.worker]
                           if w is not None and w.sock.fileno() >= 0}
                waits: list[Any] = [rfd, self.control, *watched]
                ready, _, _ = select.select(waits, [], [], 1.0)
                for obj in ready:
                    if obj == rfd:
                        os.read(rfd, 512)
                    elif obj is self.control:
                        self._answer_control()
                    elif obj in watched and obj.fileno() >= 0 and self._worker_message(watched[obj]):
                        obj.close()
                while self._signals:
                    got = self._signals.pop(0)
                    if got == signal.SIGHUP:
                        if self.worker is not None:  # else a replacement is under way: it runs the config anew
                            self._reload()
                    else:
                        log.info("signal %d: draining the worker and stopping", got)
                        return self._stop()
                if self.worker is not None and self.worker.code is not None:
                    code = self._replace(self.worker)
                    if code is not None:
                        self._stop()
                        return code
                self._tend_standby()
        finally:
            signal.set_wakeup_fd(-1)
            os.close(rfd)
            os.close(wfd)
            self._close()

    def _tend_standby(self) -> None:
        w = self.worker
        wanted = self.config.standby and not self.old and w is not None and w.code is None
        python = w.python if w is not None and w.python else sys.executable
        self.standby.tend(wanted, lambda: self._fork(self.zygotes.for_python(python)[0], self.config, standby=True))

    def _replace(self, dead: Worker) -> int | None:
        """The current worker exited on its own: fork a replacement (None) or give up (the status to exit with)."""
        code = dead.code if dead.code is not None else 1
        served_s = time.monotonic() - dead.ready_at
        self._forget(dead)
        self.replace_policy.worker_died(served_s)
        log.warning("the worker (pid %d) exited on its own: %s after %.1fs; replacing it", dead.pid, ended(code),
                    served_s)
        policy, t0 = self.replace_policy, time.monotonic()
        while not policy.give_up:
            if any(sig != signal.SIGHUP for sig in self._signals):  # SIGTERM/SIGINT meanwhile: the loop stops
                self.worker = None
                return None
            time.sleep(policy.backoff_s)
            try:
                self.worker, mode, reason = self._new_worker(self.config, dead.python or sys.executable, 600.0)
            except RestartFailed as e:
                self.worker = None
                policy.attempt_failed()
                self.history.replace_failed += 1
                log.error("replacing worker %d failed (%d in a row): %s", dead.pid, policy.failures, e)
                continue
            self.history.replaced += 1
            self.history.last_replacement = {"old_pid": dead.pid, "new_pid": self.worker.pid, "status": code,
                                             "mode": mode, "reason": reason, "seconds": time.monotonic() - t0,
                                             "at": time.time()}
            self._send_history()
            log.warning("replaced worker %d (%s) with %d in %.3fs (%s)", dead.pid, ended(code), self.worker.pid,
                        time.monotonic() - t0, mode)
            return None
        log.error("gave up replacing the worker after %d failures in a row; exiting with status %d so the service "
                  "manager restarts the server", policy.failures, exit_status(code))
        self.worker = None
        return exit_status(code)

    def _forget(self, dead: Worker) -> None:
        """A dead worker's last traces: its socket closed, the process killed if it lingers after saying Exit."""
        if dead.sock.fileno() >= 0 and not select.select([dead.sock], [], [], 5.0)[0]:
            dead.kill()
        dead.close()

    def _worker_message(self, worker: Worker) -> bool:
        """Handle one message from a worker; True once it has ended (EOF)."""
        try:
            msg, fds = ipc.recv(worker.sock)
        except (EOFError, OSError):
            if worker.code is None:
                worker.code = 1
                log.warning("worker %d ended without a word, and no exit status came (its zygote is gone)",
                            worker.pid)
            if worker in self.old:
                self.old.remove(worker)
            return True
        except ProtocolError as e:
            log.warning("worker %d: %s", worker.pid, e)
            return False
        for fd in fds:
            os.close(fd)
        if isinstance(msg, ipc.Exit):
            worker.code = msg.code
        elif isinstance(msg, ipc.Failed):
            worker.code = 1
            log.error("worker %d: %s", worker.pid, msg.error)
        elif isinstance(msg, ipc.Standing) and worker is self.standby.worker:
            self.standby.stood(msg)
        elif isinstance(msg, ipc.Ready) and worker is self.standby.worker:  # its zygote's keepwarm predates --standby
            log.error("standby worker %d accepts without Go (its zygote's keepwarm knows no standby): killed",
                      worker.pid)
            worker.kill()
            worker.code = 1
        return False

    def _stop(self) -> int:
        """SIGTERM the workers (they drain) and wait for them; stop the zygotes. The current worker's status."""
        self.standby.drop("the server stops")
        workers = [w for w in [self.worker, *self.old] if w is not None]
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGTERM)
        deadline = time.monotonic() + max(w.config.shutdown_timeout for w in workers) + 15 if workers else 0
        for w in workers:
            if w.wait(deadline) is None:
                w.kill()
        code = (self.worker.code or 0) if self.worker is not None else 0
        return 128 - code if code < 0 else code  # a worker killed by signal N meanwhile: 128 + N

    def _close(self) -> None:
        self.zygotes.stop()
        if self.control is not None:
            self.control.close()
        if self.control_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.control_path.unlink()

    # -- restarts ----------------------------------------------------------------------------------------------
    def _answer_control(self) -> None:
        assert self.control is not None
        conn, _ = self.control.accept()
        with conn:
            if ipc.peer_uid(conn) != os.getuid():
                log.warning("control socket: refused a peer of another uid")
                return
            try:
                req = ipc.expect(conn, ipc.RestartRequest | ipc.Probe, timeout=5.0)
            except (EOFError, TimeoutError, ProtocolError) as e:
                with contextlib.suppress(OSError):
                    ipc.send(conn, ipc.RestartReply(ok=False, message=f"bad request: {e}"))
                return
            z = self.zygotes.current
            reply = (z.probe() if z is not None else ipc.RestartReply(ok=False, message="no zygote runs")) \
                if isinstance(req, ipc.Probe) else self._restart_request(req)
            with contextlib.suppress(OSError):
                ipc.send(conn, reply)

    def _python(self) -> str:
        """The Python the current zygote runs (a restart forks from the same one unless told otherwise)."""
        return self.zygotes.current.hello.python if self.zygotes.current else sys.executable

    def _restart_request(self, req: ipc.RestartRequest) -> ipc.RestartReply:
        python = req.python or self._python()
        if req.prepare:
            try:
                z = self.zygotes.prepare(python)
            except RestartFailed as e:
                return ipc.RestartReply(ok=False, message=str(e))
            return ipc.RestartReply(ok=True, message=f"zygote from {python} ready (pid {z.hello.pid})")
        config_file = self.config_file if req.config_file is None else (req.config_file or None)
        kept = {k: v for k, v in self.flags.items() if k in PLACE_FLAGS} if req.replace_flags else self.flags
        flags = {**kept, **{k: v for k, v in req.flags.items() if v is not None}}
        try:
            config = self._build(config_file, flags)
        except ConfigError as e:
            return ipc.RestartReply(ok=False, message=f"bad config: {e}")
        return self.restart(config, python, req.timeout, on_success=lambda: self._adopt(config_file, flags))

    def _adopt(self, config_file: str | None, flags: dict[str, Any]) -> None:
        self.config_file, self.flags = config_file, flags

    def _reload(self) -> None:
        """SIGHUP (systemd's ExecReload): the same flags, the config file read again."""
        try:
            config = self._build(self.config_file, self.flags)
        except ConfigError as e:
            log.error("SIGHUP: not restarted: bad config: %s", e)
            return
        reply = self.restart(config, self._python(), 300.0)
        (log.info if reply.ok else log.error)("SIGHUP: %s", reply.message)

    def restart(self, config: ServerConfig, python: str, timeout: float,
                on_success: Callable[[], None] | None = None) -> ipc.RestartReply:
        """A handoff to a worker of ``config`` (keepwarm.worker.process.handoff's steps); the answer, one line."""
        assert self.worker is not None
        t0 = time.monotonic()
        if (config.host, config.port) != (self.config.host, self.config.port):
            return ipc.RestartReply(ok=False, message=f"host/port cannot change in a restart (the listening socket "
                                                      f"{self.config.host}:{self.config.port} is handed over); "
                                                      "stop the server and serve again")
        handoff.wait_drained(self.old)
        t_fork = time.monotonic()
        old = self.worker
        try:
            new, mode, reason = self._new_worker(config, python, timeout)
        except RestartFailed as e:
            self.history.failed += 1
            log.error("restart failed: %s; the old worker (pid %d) keeps serving", e, old.pid)
            self._send_history()
            return ipc.RestartReply(ok=False, message=f"{e}; the old worker (pid {old.pid}) keeps serving",
                                    old_pid=old.pid)
        ready_s = time.monotonic() - t0
        t_carry = time.monotonic()
        carried = handoff.carry_prefixes(old, new)
        t_drain = time.monotonic()
        handoff.drain(old)
        self.worker, self.config = new, config
        self.old.append(old)
        if on_success is not None:
            on_success()
        self.history.total[mode] += 1
        self.history.durations.append(ready_s)
        # where the handoff went: waiting for a previous old worker, the zygote's fork, the new worker to Ready, the
        # old one's Draining; and the new worker's own startup phases
        steps = {"wait_old": t_fork - t0, "fork": new.fork_s, "ready": t_carry - t_fork - new.fork_s,
                 "carry_prefixes": t_drain - t_carry, "drain_notice": time.monotonic() - t_drain}
        self.history.last = {"mode": mode, "seconds": ready_s, "reason": reason, "at": time.time(),
                             "old_pid": old.pid, "new_pid": new.pid, "steps": steps, "worker_phases": new.phases,
                             "prefix_cache": carried}
        self.history.carried_blocks += carried["blocks"]
        self._send_history()
        note = handoff.summary(mode, reason, carried)
        log.info("restarted: worker %d -> %d in %.3fs (%s; %s)%s", old.pid, new.pid, ready_s, mode,
                 " ".join(f"{k} {v:.3f}" for k, v in steps.items()), note)
        return ipc.RestartReply(ok=True, message=f"handoff in {ready_s:.3f}s: worker {old.pid} -> {new.pid} "
                                                 f"({mode}){note}", mode=mode, handoff_s=ready_s,
                                old_pid=old.pid, new_pid=new.pid)

    def _restarts(self) -> dict[str, Any]:
        return self.history.to_dict(self.zygotes.current, self.standby.pid)

    def _send_history(self) -> None:
        if self.worker is not None:
            with contextlib.suppress(OSError):
                ipc.send(self.worker.sock, ipc.Restarts(self._restarts()))
