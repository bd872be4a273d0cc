"""`keepwarm serve --zygote`: a supervisor that owns the listening socket and a zygote, and restarts the worker
with no downtime (`keepwarm restart`, SIGHUP, systemd's ExecReload).

Processes: the supervisor (this module; it never imports torch: it starts in ~0.2 s and stays small), its zygote
(``keepwarm.worker.api.zygote``: the imports done, nothing built) and the worker the zygote forked. The supervisor
owns the zygote, not the daemon: the zygote carries the API stack and one server's Python environment, its life
is the server's, and only the supervisor holds what a worker needs besides weights (the listening socket, the
config, the restart history); the daemon serves several servers and knows none of that.

A restart (``restart``):
1. the new config: the last one with the given flags merged over it (or a new server.toml); ``host``/``port``
   cannot change (the listening socket is handed over, not re-bound);
2. previous old workers finish draining first, so at most one old and one new worker hold a KV pool at once:
   the weights are the daemon's arena, mapped by both, and a handoff costs one extra KV pool, never more;
3. the zygote forks the new worker with the listening socket and a status socket (SCM_RIGHTS); the child
   attaches, warms one step, starts accepting on the *same* listening socket and says Ready. A zygote that is
   gone is replaced first: a cold start (the import floor), logged, answered and shown in /health and /metrics;
4. the old worker's prefix cache is carried over (``_carry_prefixes``, keepwarm.worker.prefix_handover): it
   exports its cached blocks into a memfd while it serves on, the new worker adopts what fits its pool (the same
   weights, dtypes, block size and Python, else nothing, and the reason is logged and answered); never a failed
   restart, and at most the old worker's cached blocks in memory for the copy's time;
5. the old worker is told to Drain: it closes its copy of the listener at once (the kernel's accept queue is
   shared, so nothing queued is lost: the reason for passing one socket rather than ``SO_REUSEPORT``, whose
   per-socket queues drop what is queued on the socket that closes) and finishes its in-flight requests;
6. a new worker that fails (Failed, exits, or is not ready within the timeout) is killed; the old one never
   stopped serving, and the restart answers why.
With ``--standby`` one more worker is kept forked (``Fork(standby=True)``): it attaches, builds its engine, warms
one step, says Standing and waits, not accepting, for Go. A restart whose config and Python are the standby's (and
a dead worker's replacement) sends it Go instead of forking in step 3: it starts accepting and says Ready (mode
"standby"). Other flags or another Python drop it (Drain: it exits without serving) and fork as above. The next
standby is forked ``STANDBY_DELAY_S`` after the handoff (the new worker's first requests have the machine to
themselves) and once no old worker drains, so besides the current worker at most one more holds a KV pool (the
draining one or the standby); a standby that dies is logged, and the next restart forks and brings one back.
A worker that exits on its own (a crash, ``kill -9``, 70: the engine failed) is replaced (``_replace``): the
zygote forks a new one with the running config while the listening socket stays open in the supervisor, so new
connections wait in the kernel's queue (the dead worker's in-flight requests are lost with it). Bounded: a
replacement that fails, or a worker that dies within ``REPLACE_STABLE_S`` of becoming ready, is a failure; after
``REPLACE_MAX_FAILURES`` in a row the supervisor gives up and exits with the worker's status (70 if it was 0) so
systemd restarts everything; between attempts it waits 0.5, 1, 2... s. Each replacement is logged and counted
(/health ``restarts.replaced``, /metrics ``keepwarm:worker_replacements_total``). SIGTERM/SIGINT drain everything.
How a worker ended is logged as it happened (``ended``): "killed by SIGKILL (signal 9)" for a signal (the OOM
killer's kill -9: the worker could say nothing, its zygote reaps it and says Exit(-9) on its status socket, see
``keepwarm.worker.api.zygote``), "status N" for an exit; a status that never came (its zygote died too) is said so.
Giving up on a worker killed by signal N exits with 128 + N, as a shell reports it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keepwarm.daemon.protocol import ProtocolError
from keepwarm.formats import paths
from keepwarm.worker.api import ipc
from keepwarm.worker.api.config import ConfigError, ServerConfig, build_config, load_toml
from keepwarm.worker.api.listen import bind_listener, systemd_socket

log = logging.getLogger("keepwarm.supervisor")

ZYGOTE_START_TIMEOUT_S = 300.0
FORK_TIMEOUT_S = 30.0
# The flags a restart with ``replace_flags`` keeps: where the server listens (the socket is handed over, it cannot
# move) and which daemon it uses.
PLACE_FLAGS = frozenset({"host", "port", "runtime_dir"})
DRAIN_NOTICE_TIMEOUT_S = 5.0
REPLACE_MAX_FAILURES = 3  # failed replacements (or workers dead within REPLACE_STABLE_S) in a row before giving up
REPLACE_STABLE_S = 30.0  # a worker that served this long before dying resets the count
REPLACE_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 4.0)  # the wait before attempt 1, 2, ... (the last one repeats)
# After a handoff, the next standby is forked this much later: even at SCHED_IDLE its warm-up (page population,
# memory traffic) beside the new worker's first requests made them slower on 2 cores.
STANDBY_DELAY_S = 3.0
# An export or adoption waits for the worker's step in flight, then copies its cached blocks (the worker's own limit
# is 30 s); past this the restart goes on without the cache.
PREFIX_TIMEOUT_S = 35.0


# EX_SOFTWARE (the worker's own status for a failed engine, keepwarm.worker.api.server; not imported: no torch
# here): what the supervisor exits with when it gives up on a worker that had exited with 0.
FATAL_STATUS = 70


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
    """The status to exit with for a worker's ``code``: a shell's 128 + N for a signal, else the code (70 for 0)."""
    return 128 - code if code < 0 else code or FATAL_STATUS


class _NotCarried(Exception):
    """Why a restart's prefix cache was not carried over (the restart goes on)."""


class RestartFailed(Exception):
    """A restart that did not happen; the old worker keeps serving. One line for the command to print."""


@dataclass
class Zygote:
    proc: subprocess.Popen
    sock: socket.socket
    hello: ipc.Hello

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

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


def start_zygote(python: str, log_level: str) -> Zygote:
    """A zygote from ``python`` (this one, or another venv's for an upgrade); returns once its imports are done."""
    ours, theirs = ipc.pair()
    env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}  # torch.cuda.is_available() without cuInit
    t0 = time.time()
    proc = subprocess.Popen([python, "-m", "keepwarm.worker.api.zygote", str(theirs.fileno()), log_level, repr(t0)],
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

    def to_dict(self, supervisor: Supervisor) -> dict[str, Any]:
        z, standby = supervisor.zygote, supervisor.standby
        return {"supervisor_pid": os.getpid(), "zygote_pid": z.hello.pid if z and z.alive else None,
                "standby_pid": standby.pid if standby is not None and standby.standing else None,
                "python": z.hello.python if z else None, "total": dict(self.total), "failed": self.failed,
                "durations": list(self.durations[-1000:]), "last": self.last, "replaced": self.replaced,
                "replace_failed": self.replace_failed, "last_replacement": self.last_replacement,
                "prefix_blocks_carried": self.carried_blocks}


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
        self.zygote: Zygote | None = None
        self.prepared: dict[str, Zygote] = {}  # zygotes started ahead of an upgrade, by python
        self.worker: Worker | None = None
        self.old: list[Worker] = []  # draining
        self.standby: Worker | None = None  # ``--standby``: forked and warmed, not accepting (pending until Standing)
        self.standby_due: float | None = 0.0  # when (monotonic) to fork a standby, once no old worker drains
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
        self.zygote = start_zygote(sys.executable, self.log_level)
        try:
            self.worker = self._spawn(self.zygote, self.config, timeout=600.0)
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
        """Ask ``zygote`` for a worker (a standby: one that waits for Go); returns once it is forked."""
        assert self.listener is not None
        ours, theirs = ipc.pair()
        t0 = time.monotonic()
        try:
            ipc.send(zygote.sock, ipc.Fork(config=config.to_dict(), restarts=self.history.to_dict(self),
                                           log_level=self.log_level, standby=standby),
                     fds=(self.listener.fileno(), theirs.fileno()))
            forked = ipc.expect(zygote.sock, ipc.Forked, timeout=FORK_TIMEOUT_S)
        except (OSError, EOFError, TimeoutError, ProtocolError) as e:
            ours.close()
            raise RestartFailed(f"the zygote (pid {zygote.hello.pid}) did not fork: {e}") from None
        finally:
            theirs.close()
        return Worker(forked.pid, ours, config, fork_s=time.monotonic() - t0, python=zygote.hello.python)

    def _spawn(self, zygote: Zygote, config: ServerConfig, timeout: float) -> Worker:
        """Fork a worker from ``zygote`` and wait until it says Ready; RestartFailed (it is killed) otherwise."""
        worker = self._fork(zygote, config)
        self._await(worker, ipc.Ready, timeout, "failed its warm-up")
        return worker

    def _await(self, worker: Worker, expected: type, timeout: float, failure: str) -> None:
        """Wait for ``worker``'s Ready (or a standby's Standing): RestartFailed (it is killed) on anything else."""
        deadline = time.monotonic() + timeout
        try:
            msg, fds = ipc.recv(worker.sock, timeout=timeout)
            for fd in fds:
                os.close(fd)
            why = msg.error if isinstance(msg, ipc.Failed) else "" if isinstance(msg, expected) else \
                f"it exited ({ended(msg.code)})" if isinstance(msg, ipc.Exit) else f"it sent {type(msg).__name__}"
        except (EOFError, TimeoutError, ProtocolError, OSError) as e:
            why = "it exited" if isinstance(e, EOFError | OSError) else \
                f"not ready after {timeout:.0f}s" if time.monotonic() >= deadline else str(e)
        if why:
            worker.kill()
            with contextlib.suppress(OSError):
                worker.sock.close()
            raise RestartFailed(f"the new worker (pid {worker.pid}) {failure}: {why}")
        if isinstance(msg, ipc.Standing):
            worker.standing, worker.phases = True, msg.phases
            return
        worker.ready_at, worker.phases = time.monotonic(), msg.phases
        log.info("worker %d ready %.3fs after its fork (weights from %s); phases (s): %s", msg.pid, msg.ready_s,
                 msg.weights_source, " ".join(f"{k} {v:.3f}" for k, v in msg.phases.items()))

    def _loop(self) -> int:
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        signal.set_wakeup_fd(wfd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda s, _f: self._signals.append(int(s)))
        assert self.control is not None
        try:
            while True:
                watched = {w.sock: w for w in [self.worker, *self.old, self.standby]
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
            self.standby_due = time.monotonic() + STANDBY_DELAY_S
            python = dead.python or sys.executable
            try:
                self.worker, mode, reason = self._take_standby(self.config, python, 600.0), "standby", ""
                if self.worker is None:
                    zygote, mode, reason = self._zygote_for(python)
                    self.worker = self._spawn(zygote, self.config, timeout=600.0)
            except RestartFailed as e:
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
        with contextlib.suppress(OSError):
            dead.sock.close()

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
        elif isinstance(msg, ipc.Standing) and worker is self.standby:
            worker.standing, worker.phases = True, msg.phases
            log.info("standby worker %d warmed %.3fs after its fork; phases (s): %s", msg.pid, msg.ready_s,
                     " ".join(f"{k} {v:.3f}" for k, v in msg.phases.items()))
            self._send_history()  # /health shows its pid
        elif isinstance(msg, ipc.Ready) and worker is self.standby:  # a zygote whose keepwarm predates --standby
            log.error("standby worker %d accepts without Go (its zygote's keepwarm knows no standby): killed",
                      worker.pid)
            worker.kill()
            worker.code = 1
        return False

    def _stop(self) -> int:
        """SIGTERM the workers (they drain) and wait for them; stop the zygotes. The current worker's status."""
        self._drop_standby("the server stops")
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
        for z in [self.zygote, *self.prepared.values()]:
            if z is not None:
                z.stop()
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
            reply = self._probe() if isinstance(req, ipc.Probe) else self._restart_request(req)
            with contextlib.suppress(OSError):
                ipc.send(conn, reply)

    def _probe(self) -> Any:
        """The zygote's own account of what it holds (ProbeReply), or a RestartReply saying why not."""
        z = self.zygote
        if z is None or not z.alive:
            return ipc.RestartReply(ok=False, message="no zygote runs")
        try:
            ipc.send(z.sock, ipc.Probe())
            return ipc.expect(z.sock, ipc.ProbeReply, timeout=FORK_TIMEOUT_S)
        except (OSError, EOFError, TimeoutError, ProtocolError) as e:
            return ipc.RestartReply(ok=False, message=f"the zygote did not answer: {e}")

    def _restart_request(self, req: ipc.RestartRequest) -> ipc.RestartReply:
        python = req.python or (self.zygote.hello.python if self.zygote else sys.executable)
        if req.prepare:
            try:
                self._prepare(python)
            except RestartFailed as e:
                return ipc.RestartReply(ok=False, message=str(e))
            return ipc.RestartReply(ok=True, message=f"zygote from {python} ready (pid "
                                                     f"{self.prepared[python].hello.pid})")
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
        reply = self.restart(config, self.zygote.hello.python if self.zygote else sys.executable, 300.0)
        (log.info if reply.ok else log.error)("SIGHUP: %s", reply.message)

    def _prepare(self, python: str) -> Zygote:
        z = self.prepared.get(python)
        if z is None or not z.alive:
            z = self.prepared[python] = start_zygote(python, self.log_level)
        return z

    def restart(self, config: ServerConfig, python: str, timeout: float,
                on_success: Any = None) -> ipc.RestartReply:
        assert self.worker is not None
        t0 = time.monotonic()
        if (config.host, config.port) != (self.config.host, self.config.port):
            return ipc.RestartReply(ok=False, message=f"host/port cannot change in a restart (the listening socket "
                                                      f"{self.config.host}:{self.config.port} is handed over); "
                                                      "stop the server and serve again")
        self._wait_old_drained()
        t_fork = time.monotonic()
        old = self.worker
        # whatever happens, a standby (of the config that ends up serving) follows, after the first requests
        self.standby_due = time.monotonic() + STANDBY_DELAY_S
        try:
            new, mode, reason = self._take_standby(config, python, timeout), "standby", ""
            if new is None:
                zygote, mode, reason = self._zygote_for(python)
                new = self._spawn(zygote, config, timeout)
        except RestartFailed as e:
            self.history.failed += 1
            log.error("restart failed: %s; the old worker (pid %d) keeps serving", e, old.pid)
            self._send_history()
            return ipc.RestartReply(ok=False, message=f"{e}; the old worker (pid {old.pid}) keeps serving",
                                    old_pid=old.pid)
        ready_s = time.monotonic() - t0
        t_carry = time.monotonic()
        carried = self._carry_prefixes(old, new)
        t_drain = time.monotonic()
        ipc.send(old.sock, ipc.Drain())
        try:
            ipc.expect(old.sock, ipc.Draining, timeout=DRAIN_NOTICE_TIMEOUT_S)
        except (EOFError, TimeoutError, ProtocolError, OSError) as e:
            log.warning("old worker %d did not confirm its drain (%s); SIGTERM", old.pid, e)
            with contextlib.suppress(ProcessLookupError):
                os.kill(old.pid, signal.SIGTERM)
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
        note = f"; cold start: {reason}" if mode == "cold" else ""
        note += (f"; prefix cache: {carried['blocks']} blocks carried over ({carried['nbytes'] / 1e6:.1f} MB in "
                 f"{carried['seconds']:.3f}s)" if carried["blocks"] else
                 f"; prefix cache not carried over: {carried['reason']}")
        log.info("restarted: worker %d -> %d in %.3fs (%s; %s)%s", old.pid, new.pid, ready_s, mode,
                 " ".join(f"{k} {v:.3f}" for k, v in steps.items()), note)
        return ipc.RestartReply(ok=True, message=f"handoff in {ready_s:.3f}s: worker {old.pid} -> {new.pid} "
                                                 f"({mode}){note}", mode=mode, handoff_s=ready_s,
                                old_pid=old.pid, new_pid=new.pid)

    # -- the prefix cache carried over (keepwarm.worker.prefix_handover) ------------------------------------------
    def _carry_prefixes(self, old: Worker, new: Worker) -> dict[str, Any]:
        """The old worker's cached prefix blocks into the new one's pool, while the old one still serves: what was
        carried (``blocks`` 0 and the ``reason`` when nothing was; never a failed restart)."""
        t0 = time.monotonic()
        fd = None
        try:
            if old.python != new.python:
                raise _NotCarried("the new worker runs another Python (block keys are per interpreter)")
            ipc.send(old.sock, ipc.ExportPrefixes())
            export, fds = self._reply(old, ipc.PrefixExport, PREFIX_TIMEOUT_S)
            fd = fds[0] if fds else None
            if not export.blocks or fd is None:
                raise _NotCarried(export.reason or "the export came without its file")
            ipc.send(new.sock, ipc.AdoptPrefixes(export.blocks), (fd,))
            adopted, _ = self._reply(new, ipc.PrefixAdopted, PREFIX_TIMEOUT_S)
            result = {"blocks": adopted.blocks, "nbytes": adopted.nbytes, "seconds": time.monotonic() - t0,
                      "exported": export.blocks, "reason": adopted.reason}
        except (_NotCarried, EOFError, TimeoutError, ProtocolError, OSError) as e:
            result = {"blocks": 0, "nbytes": 0, "seconds": time.monotonic() - t0, "exported": 0, "reason": str(e)}
        finally:
            if fd is not None:
                os.close(fd)
        log.log(logging.INFO if result["blocks"] else logging.WARNING, "prefix cache: %s",
                f"{result['blocks']} of {result['exported']} blocks carried over from worker {old.pid} to {new.pid} "
                f"({result['nbytes'] / 1e6:.1f} MB in {result['seconds']:.3f}s)" if result["blocks"] else
                f"not carried over from worker {old.pid} to {new.pid}: {result['reason']}")
        return result

    @staticmethod
    def _reply(worker: Worker, cls: type, timeout: float) -> tuple[Any, list[int]]:
        """The worker's next ``cls`` message and its fds; other messages before it are taken as the loop would."""
        deadline = time.monotonic() + timeout
        while True:
            msg, fds = ipc.recv(worker.sock, timeout=deadline - time.monotonic())
            if isinstance(msg, cls):
                return msg, fds
            for fd in fds:
                os.close(fd)
            if isinstance(msg, ipc.Exit):
                worker.code = msg.code
                raise EOFError(f"worker {worker.pid} exited ({ended(msg.code)})")

    # -- the standby (``serve --standby``) ------------------------------------------------------------------------
    def _tend_standby(self) -> None:
        """Forget a standby that died; fork one when due, ``--standby`` is on and no old worker drains (so at most
        one worker besides the current one holds a KV pool: the draining one or the standby)."""
        s = self.standby
        if s is not None and s.code is not None:
            log.warning("standby worker %d exited (%s); the next restart forks its worker", s.pid, ended(s.code))
            self.standby = None
            self._send_history()
        if not (self.config.standby and self.standby_due is not None and time.monotonic() >= self.standby_due
                and self.standby is None and not self.old
                and self.worker is not None and self.worker.code is None):
            return
        self.standby_due = None
        try:
            zygote, _, _ = self._zygote_for(self.worker.python or sys.executable)
            self.standby = self._fork(zygote, self.config, standby=True)
        except RestartFailed as e:
            log.error("no standby worker: %s", e)
            return
        log.info("standby worker %d forked", self.standby.pid)

    def _take_standby(self, config: ServerConfig, python: str, timeout: float) -> Worker | None:
        """The standby, told Go, as the new worker once it says Ready. None (the caller forks one) when there is
        none, when it was forked for another config or Python (it is dropped), or when it fails (logged)."""
        s = self.standby
        if s is None:
            return None
        if s.code is not None or s.python != python or s.config.to_dict() != config.to_dict():
            self._drop_standby("the restart's config or Python differ from its own")
            return None
        self.standby = None
        try:
            if not s.standing:  # still warming at SCHED_IDLE (under load it may get no CPU): at full priority now
                from keepwarm.worker.api.zygote import normal_priority

                with contextlib.suppress(OSError):
                    normal_priority(s.pid)
                self._await(s, ipc.Standing, timeout, "failed its warm-up")
            ipc.send(s.sock, ipc.Go())
            self._await(s, ipc.Ready, timeout, "did not start accepting")
        except (RestartFailed, OSError) as e:
            s.kill()
            log.error("the standby worker (pid %d) failed (%s): forking a new worker instead", s.pid, e)
            return None
        s.fork_s = 0.0
        return s

    def _drop_standby(self, why: str) -> None:
        """Tell the standby to go (Drain, then EOF: it exits without having served)."""
        s, self.standby = self.standby, None
        if s is None:
            return
        log.info("standby worker %d dropped: %s", s.pid, why)
        self._send_history()
        with contextlib.suppress(OSError):
            ipc.send(s.sock, ipc.Drain())
        with contextlib.suppress(OSError):
            s.sock.close()

    def _zygote_for(self, python: str) -> tuple[Zygote, str, str]:
        """The zygote to fork from, and whether the restart is warm ("zygote") or had to start one ("cold")."""
        z = self.zygote
        if z is not None and z.alive and z.hello.python == python:
            return z, "zygote", ""
        prepared = self.prepared.pop(python, None)
        if prepared is not None and prepared.alive:
            self._replace_zygote(prepared)
            return prepared, "zygote", ""
        if z is not None and z.hello.python == python:
            reason = f"the zygote (pid {z.hello.pid}) was gone (exit status {z.proc.poll()})"
        else:
            reason = f"no zygote from {python} was prepared (`keepwarm restart --prepare --python {python}`)"
        log.warning("%s: starting one (cold start)", reason)
        new = start_zygote(python, self.log_level)
        self._replace_zygote(new)
        return new, "cold", reason

    def _replace_zygote(self, z: Zygote) -> None:
        if self.zygote is not None and self.zygote is not z:
            self.zygote.stop()
        self.zygote = z

    def _wait_old_drained(self) -> None:
        for w in list(self.old):
            if w.wait(time.monotonic() + w.config.shutdown_timeout + 15) is None:
                log.warning("old worker %d still draining after its shutdown timeout: killed", w.pid)
                w.kill()
            self.old.remove(w)
            with contextlib.suppress(OSError):
                w.sock.close()

    def _send_history(self) -> None:
        if self.worker is not None:
            with contextlib.suppress(OSError):
                ipc.send(self.worker.sock, ipc.Restarts(self.history.to_dict(self)))
