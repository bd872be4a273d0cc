"""The zygote's fork loop: a process that has imported torch, the API stack and keepwarm's worker (it does the
imports, nothing more), and forks a worker on demand. This half has no torch in it: what needs torch comes in as
``Hooks`` from the entry module, keepwarm.worker.zygote (``python -m keepwarm.worker.zygote FD LOG_LEVEL SPAWN_TIME``).

Started and owned by the supervisor (keepwarm.worker.process.supervisor); it talks to it over a private socketpair
(keepwarm.worker.process.ipc: ``Fork`` with the listening and status sockets as SCM_RIGHTS fds -> ``Forked``; ``Probe``
-> ``ProbeReply``). Fork-safety rules, before ``fork``: never touch a GPU (``PYTORCH_NVML_BASED_CUDA_CHECK=1``, set by
the supervisor), run a torch op or start a thread (OpenMP's team would not survive it), create an event loop, build an
engine or unpickle anything (configs come as ``ServerConfig.to_dict()`` maps, checked like a server.toml). Per-server
CPU work that needs none of that may run (``Hooks.prepare``: the tokenizer, inherited by every worker). Copy-on-write:
the garbage collector is off and ``gc.freeze()`` runs right before each fork (the child turns it on): a collection in
the child never writes to the pages of the imports' objects (~0.3 s of engine setup before, ~0.02). How a worker ended
(``Reaper``): the zygote, its parent, keeps its status socket until it reaps it, then says ``Exit(code)`` there (-N:
killed by signal N); SIGCHLD only wakes the loop, which reaps.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keepwarm.formats.version import __version__
from keepwarm.formats.wire import ProtocolError
from keepwarm.worker.process import ipc
from keepwarm.worker.process.config import ServerConfig, from_mapping
from keepwarm.worker.process.link import WorkerLink
from keepwarm.worker.process.priority import idle_priority

log = logging.getLogger("keepwarm.zygote")


@dataclass(frozen=True)
class Hooks:
    """The serving side's part in a zygote (keepwarm.worker.zygote)."""

    preimport: tuple[str, ...]  # modules a worker imports on its way to its first token; none runs a torch op
    prepare: Callable[[dict[str, Any]], None]  # per-server work before a fork (a ``ServerConfig.to_dict()``)
    probe: Callable[[], ipc.ProbeReply]  # what this process holds
    # the forked child's server: (config, fork time, the listening socket, its link) -> exit status
    serve: Callable[[ServerConfig, float, socket.socket, WorkerLink], int]


def preimport(names: tuple[str, ...]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:  # an optional piece (uvloop, httptools): the worker does without it as well
            log.debug("zygote: %s not imported: %s", name, e)


def thread_count() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return threading.active_count()


def _child(hooks: Hooks, request: ipc.Fork, fds: list[int], fork_time: float) -> int:
    """The forked worker: serve ``request.config`` on the listening socket; say Failed or Exit at the end."""
    listen_fd, status_fd = fds
    listener = socket.socket(fileno=listen_fd)
    listener.setblocking(False)
    link = WorkerLink(socket.socket(fileno=status_fd), request.restarts, fork_time, standby=request.standby)
    logging.getLogger().setLevel(request.log_level)
    if request.standby:
        why = idle_priority()
        link.idle_priority = not why
        if why:
            log.warning("standby worker %d warms at normal priority (%s): its warm-up shares the CPU with the "
                        "serving worker", os.getpid(), why)
    try:
        config = ServerConfig(**from_mapping(request.config, "restart"))
        code = hooks.serve(config, fork_time, listener, link)
    except BaseException as e:  # noqa: BLE001  (anything: it is reported, then the child exits)
        message = f"{type(e).__name__}: {e}".splitlines()[0]
        log.error("worker %d failed: %s", os.getpid(), message)
        link.say(ipc.Failed(message))
        return 1
    link.say(ipc.Exit(code))
    return code


class Reaper:
    """The zygote's forked workers, each with its status socket kept until the worker is reaped (module docstring).

    Created in the zygote's main thread (``signal.set_wakeup_fd`` must be); ``wakeup`` is what its loop selects on.
    """

    def __init__(self) -> None:
        self.links: dict[int, socket.socket] = {}
        self.wakeup, self._wake_w = os.pipe()
        os.set_blocking(self.wakeup, False)
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGCHLD, lambda _s, _f: None)  # a Python handler, so the wakeup fd is written

    def keep(self, pid: int, status_fd: int) -> None:
        # Blocking, as it came: O_NONBLOCK would be set on the file description the worker shares with us.
        self.links[pid] = socket.socket(fileno=status_fd)

    def reap(self) -> None:
        """Reap every child that ended; tell the supervisor how each one did, on its status socket."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wakeup, 512):
                pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            link = self.links.pop(pid, None)
            if link is None:
                continue
            # A supervisor that stopped reading must not block the zygote: send only where there is room; an error
            # means it gave up on the worker already (it killed a failed one and closed its end).
            with contextlib.suppress(OSError):
                if select.select([], [link], [], 1.0)[1]:
                    ipc.send(link, ipc.Exit(os.waitstatus_to_exitcode(status)))
            link.close()

    def close_in_child(self) -> None:
        """In a forked worker: none of the zygote's links, pipe or SIGCHLD handling (the supervisor must see a
        worker's socket close when that worker and the zygote let go of it, not when its younger sibling does)."""
        signal.set_wakeup_fd(-1)
        for link in self.links.values():
            link.close()
        os.close(self.wakeup)
        os.close(self._wake_w)


def _fork(hooks: Hooks, sock: socket.socket, request: ipc.Fork, fds: list[int], reaper: Reaper) -> int:
    fork_time = time.time()
    gc.freeze()
    pid = os.fork()
    if pid:
        os.close(fds[0])
        reaper.keep(pid, fds[1])
        return pid
    code = 1
    try:
        gc.enable()
        sock.close()
        reaper.close_in_child()
        for sig in (signal.SIGCHLD, signal.SIGHUP, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        code = _child(hooks, request, fds, fork_time)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str], hooks: Hooks) -> int:
    """The zygote process: ``argv`` is FD LOG_LEVEL SPAWN_TIME (the supervisor's socket, its log level, when it
    started us); answers Fork and Probe until the supervisor goes away."""
    fd, log_level, spawn_time = int(argv[0]), argv[1], float(argv[2])
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    sock = socket.socket(fileno=fd)
    gc.disable()  # no collections here: they would leave freed holes in pages the workers share (see above)
    preimport(hooks.preimport)
    reaper = Reaper()  # we reap our children and tell the supervisor how each one ended
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the supervisor decides, we follow its EOF
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    ipc.send(sock, ipc.Hello(pid=os.getpid(), python=sys.executable, version=__version__,
                             import_s=time.time() - spawn_time))
    log.info("zygote %d ready: imports took %.2fs, %d thread(s)", os.getpid(), time.time() - spawn_time,
             thread_count())
    while True:
        reaper.reap()
        if sock.fileno() not in select.select([sock.fileno(), reaper.wakeup], [], [])[0]:
            continue  # SIGCHLD: reaped at the top
        try:
            msg, fds = ipc.recv(sock)
        except EOFError:
            return 0  # the supervisor is gone
        except ProtocolError as e:
            log.warning("zygote: %s", e)
            continue
        if isinstance(msg, ipc.Fork) and len(fds) == 2:
            hooks.prepare(msg.config)
            ipc.send(sock, ipc.Forked(pid=_fork(hooks, sock, msg, fds, reaper)))
            continue
        for fd_ in fds:
            os.close(fd_)
        if isinstance(msg, ipc.Probe):
            ipc.send(sock, hooks.probe())
        else:
            ipc.send(sock, ipc.Failed(f"zygote: unexpected {type(msg).__name__} with {len(fds)} fd(s)"))
