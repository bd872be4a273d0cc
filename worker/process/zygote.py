"""The zygote: a process that has imported torch, the API stack and keepwarm's worker, and forks a worker on demand.

Started by the server supervisor (``keepwarm.worker.api.supervisor``), which owns it: it is the one process that
knows the server's listening socket, config and restarts, and its lifetime is the server's (the daemon outlives
servers and serves several; a zygote with the API stack in it has no business there). The supervisor talks to it
over a private socketpair with typed JSON messages (``keepwarm.worker.api.ipc``: ``Fork`` with the listening and
status sockets as SCM_RIGHTS fds -> ``Forked``; ``Probe`` -> ``ProbeReply``).

    python -m keepwarm.worker.api.zygote FD LOG_LEVEL SPAWN_TIME

Fork-safety rules (what the zygote must never do before ``fork``):
- touch a GPU: ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (set by the supervisor) keeps ``torch.cuda.is_available()`` off
  the driver; the child initialises CUDA itself;
- run a torch op (OpenMP's thread team would not survive the fork) or start any thread: the zygote stays one
  thread; the child sets its torch threads;
- create an asyncio event loop (the child's uvicorn makes its own), or build a model or an engine;
- unpickle anything: configs arrive as ``ServerConfig.to_dict()`` maps and are checked like a server.toml.
What it may do before a fork is per-server CPU work that needs none of that (``prepare``: the tokenizer, loaded
once and inherited by every worker forked for the same tokenizer files).
Copy-on-write (Python's documented recipe for fork without exec): the zygote runs with the garbage collector off and
``gc.freeze()``s everything right before each fork, and the child turns the collector back on. A collection in the
child then never walks (and so never writes, copying page after page) the hundreds of thousands of objects the
imports made; measured before this: the child's engine setup took ~0.3 s against ~0.02 s in a fresh process.
The child resets the signals the zygote changed, attaches to the daemon's weights, builds its engine and warms
one step (``server.warm_up``, in the engine thread while the app is built) before it says ``Ready`` (a standby,
``Fork.standby``: says ``Standing`` and accepts only once told ``Go``, ``WorkerLink.await_go``).
How a worker ended (``Reaper``): the zygote is its parent, so the one process that learns its wait status. It keeps
each worker's status socket until it reaps the worker, then says ``Exit(code)`` on it for the worker (``code`` as
subprocess's returncode: -N for a worker killed by signal N, which could say nothing itself) and closes it: the
supervisor reads how the worker ended before it sees the socket's EOF. SIGCHLD only wakes the zygote's loop (a
wakeup fd; nothing runs in the handler), which reaps, so a child is never reaped before its socket is kept.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("keepwarm.zygote")

# What a worker imports on its way to its first token (measured: the child of a zygote that imports these loads no
# further module of any size). Everything here is imported only: no module runs a torch op at import.
PREIMPORT = (
    "torch", "keepwarm.worker.api.server", "keepwarm.worker.api.app", "keepwarm.worker.engine",
    "keepwarm.worker.model_loader", "keepwarm.worker.attach", "keepwarm.worker.models.registry",
    "keepwarm.worker.tokenizer", "keepwarm.daemon.client", "keepwarm.worker.api.grpc_server", "uvicorn",
    "uvicorn.lifespan.on", "uvicorn.protocols.http.h11_impl", "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.auto", "uvicorn.loops.auto", "uvicorn.loops.uvloop", "prometheus_client",
    "tokenizers", "pydantic.v1",  # imported lazily by the tokenizer load and by FastAPI's first route
)


def preimport() -> None:
    import importlib

    for name in PREIMPORT:
        try:
            importlib.import_module(name)
        except ImportError as e:  # an optional piece (uvloop, httptools): the worker does without it as well
            log.debug("zygote: %s not imported: %s", name, e)


def prepare(config: dict[str, Any]) -> None:
    """What a worker of ``config`` (``ServerConfig.to_dict()``) needs that is per server, not per device, done once
    here before the forks: its tokenizer (CPU work, no torch op, no thread; keyed by the tokenizer's files, so a
    restart that changes the model, the tokenizer or its files loads the new one). A failure here is left to the
    worker, which loads the tokenizer itself and reports what goes wrong (Failed)."""
    path = config.get("tokenizer") or config.get("model")
    if config.get("skip_tokenizer_init") or not isinstance(path, str):
        return
    from keepwarm.worker.tokenizer import preload_tokenizer

    t = time.perf_counter()
    try:
        kept = preload_tokenizer(path)
    except Exception as e:  # noqa: BLE001  (the worker meets the same error and reports it)
        log.info("zygote: the tokenizer of %s is not preloaded (%s); each worker loads it", path, e)
        return
    if kept:
        log.debug("zygote: tokenizer of %s ready for the workers in %.3fs", path, time.perf_counter() - t)


def thread_count() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return threading.active_count()


def probe() -> Any:
    """What this process holds: threads, CUDA, engines and modules, an event loop."""
    import asyncio

    import torch

    from keepwarm.worker.api import ipc
    from keepwarm.worker.engine import LLMEngine
    from keepwarm.worker.tokenizer import preloaded_tokenizers

    gc.unfreeze()  # the frozen objects are not in get_objects(); fork() freezes them again
    objects = gc.get_objects()
    loop = asyncio.get_event_loop_policy()._local._loop  # type: ignore[attr-defined]  # no get_event_loop(): it makes one
    return ipc.ProbeReply(pid=os.getpid(), threads=thread_count(), cuda_initialized=torch.cuda.is_initialized(),
                          engines=sum(isinstance(o, LLMEngine) for o in objects),
                          modules=sum(isinstance(o, torch.nn.Module) for o in objects), event_loop=loop is not None,
                          tokenizers=preloaded_tokenizers())


class WorkerLink:
    """The worker's end of its status socket: says Ready / Draining / Exit, hears Drain and Restarts, and answers
    ExportPrefixes / AdoptPrefixes (the prefix cache a restart carries over).

    The supervisor going away (EOF) drains the worker (SIGTERM to itself), so no worker outlives its server."""

    def __init__(self, sock: socket.socket, restarts: dict[str, Any], fork_time: float,
                 standby: bool = False) -> None:
        self.sock = sock
        self.restarts = restarts  # replaced whole by the reader thread; the event loop reads it
        self.fork_time = fork_time
        self.standby = standby
        self.idle_priority = False  # a standby warming at SCHED_IDLE (``idle_priority``), restored on Go
        self._lock = threading.Lock()

    def say(self, message: Any, fds: tuple[int, ...] = ()) -> None:
        from keepwarm.worker.api import ipc

        with self._lock, contextlib.suppress(OSError):  # the supervisor is gone: the reader drains us
            ipc.send(self.sock, message, fds)

    def await_go(self, phases: dict[str, float]) -> bool:
        """A standby's wait, warmed and not accepting: say Standing, then block until Go (True) or until the
        supervisor drops it (Drain or EOF: False, the worker exits without serving). Runs before ``listen``."""
        from keepwarm.worker.api import ipc

        self.say(ipc.Standing(pid=os.getpid(), ready_s=time.time() - self.fork_time, phases=dict(phases)))
        while (msg := self._next()) is not None:
            if isinstance(msg, ipc.Go | ipc.Drain):
                if isinstance(msg, ipc.Go) and self.idle_priority:
                    normal_priority()
                return isinstance(msg, ipc.Go)
        return False

    def listen(self, on_drain: Callable[[], None], call: Callable[[Any], Any] | None = None) -> None:
        """Read the supervisor's messages in a thread: Drain calls ``on_drain``; ExportPrefixes and AdoptPrefixes run
        in the engine thread through ``call`` (``AsyncEngine.call_blocking``'s partial) and are answered."""
        threading.Thread(target=self._read, args=(on_drain, call), name="keepwarm-link", daemon=True).start()

    def _read(self, on_drain: Callable[[], None], call: Callable[[Any], Any] | None) -> None:
        from keepwarm.worker.api import ipc

        while (got := self._next_with_fds()) is not None:
            msg, fds = got
            if isinstance(msg, ipc.Drain):
                on_drain()
            elif isinstance(msg, ipc.ExportPrefixes):
                self._export(call)
            elif isinstance(msg, ipc.AdoptPrefixes):
                self._adopt(call, fds[0] if fds else None)
            for fd in fds:
                os.close(fd)
        log.warning("the server's supervisor is gone: draining")
        os.kill(os.getpid(), signal.SIGTERM)

    def _export(self, call: Callable[[Any], Any] | None) -> None:
        from keepwarm.worker.api import ipc
        from keepwarm.worker.async_engine import ExportPrefixes

        fd = None
        try:
            if call is None:
                raise RuntimeError("this worker has no engine to export from")
            fd, done = call(ExportPrefixes())
            self.say(ipc.PrefixExport(done.blocks, done.nbytes, done.seconds, done.reason),
                              (fd,) if fd is not None else ())
        except Exception as e:  # the restart goes on without the cache; the supervisor logs why
            log.warning("prefix cache export failed: %s: %s", type(e).__name__, e)
            self.say(ipc.PrefixExport(0, 0, 0.0, f"the export failed: {type(e).__name__}: {e}"))
        finally:
            if fd is not None:
                os.close(fd)

    def _adopt(self, call: Callable[[Any], Any] | None, fd: int | None) -> None:
        from keepwarm.worker.api import ipc
        from keepwarm.worker.async_engine import AdoptPrefixes

        try:
            if call is None or fd is None:
                raise RuntimeError("no engine to adopt into" if call is None else "no export file came with it")
            done = call(AdoptPrefixes(fd))
            reply = ipc.PrefixAdopted(done.blocks, done.nbytes, done.seconds, done.reason)
        except Exception as e:  # this worker serves on without the cache
            log.warning("prefix cache adoption failed: %s: %s", type(e).__name__, e)
            reply = ipc.PrefixAdopted(0, 0, 0.0, f"the adoption failed: {type(e).__name__}: {e}")
        if reply.blocks:
            log.info("adopted %d prefix-cache blocks (%.1f MB) from the worker before in %.3fs", reply.blocks,
                     reply.nbytes / 1e6, reply.seconds)
        self.say(reply)

    def _next(self) -> Any:
        """The supervisor's next message (Restarts taken in passing), or None once it is gone (EOF)."""
        got = self._next_with_fds()
        if got is None:
            return None
        for fd in got[1]:
            os.close(fd)
        return got[0]

    def _next_with_fds(self) -> tuple[Any, list[int]] | None:
        from keepwarm.daemon.protocol import ProtocolError
        from keepwarm.worker.api import ipc

        while True:
            try:
                msg, fds = ipc.recv(self.sock)
            except (EOFError, OSError):
                return None
            except ProtocolError as e:
                log.warning("supervisor link: %s", e)
                continue
            if isinstance(msg, ipc.Restarts):
                self.restarts = msg.history
            return msg, fds


def idle_priority() -> str:
    """A standby warms up at SCHED_IDLE, so it takes only CPU time the serving worker leaves (on 2 cores its
    warm-up beside the worker's first requests doubled their time). Set on this thread before any other starts (new
    threads inherit it); only where this process may return to SCHED_OTHER on Go (root, or RLIMIT_NICE allowing
    nice 0: tried first on a throwaway thread). Returns why not ("" when set)."""
    why: list[str] = ["no SCHED_IDLE here"] if not hasattr(os, "SCHED_IDLE") else []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError as e:
            why.append(f"cannot return from SCHED_IDLE ({e.strerror})")

    if not why:
        t = threading.Thread(target=probe, name="keepwarm-sched-probe")
        t.start()
        t.join()
    if not why:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    return why[0] if why else ""


def normal_priority(pid: int | None = None) -> None:
    """Every thread of process ``pid`` (this one) and of its children (the lease keeper, which inherited
    SCHED_IDLE at its start) back to SCHED_OTHER: a standby told Go, or one still warming when a restart needs it
    (done by the supervisor, same user and limits)."""
    pid = os.getpid() if pid is None else pid
    pids = [pid]
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that just ended
            pids += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    for p in pids:
        with contextlib.suppress(OSError):  # a child that just ended
            for tid in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))


def _child(request: Any, fds: list[int], fork_time: float) -> int:
    """The forked worker: serve ``request.config`` on the listening socket; say Failed or Exit at the end."""
    from keepwarm.worker.api import ipc
    from keepwarm.worker.api.config import ServerConfig, from_mapping
    from keepwarm.worker.api.server import serve

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
        code = serve(config, process_start=fork_time, listener=listener, link=link)
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
        from keepwarm.worker.api import ipc

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


def _fork(sock: socket.socket, request: Any, fds: list[int], reaper: Reaper) -> int:
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
        code = _child(request, fds, fork_time)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str]) -> int:
    fd, log_level, spawn_time = int(argv[0]), argv[1], float(argv[2])
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    sock = socket.socket(fileno=fd)
    gc.disable()  # no collections here: they would leave freed holes in pages the workers share (see above)
    preimport()
    from keepwarm.daemon.protocol import ProtocolError
    from keepwarm.formats.version import __version__
    from keepwarm.worker.api import ipc

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
            prepare(msg.config)
            ipc.send(sock, ipc.Forked(pid=_fork(sock, msg, fds, reaper)))
            continue
        for fd_ in fds:
            os.close(fd_)
        if isinstance(msg, ipc.Probe):
            ipc.send(sock, probe())
        else:
            ipc.send(sock, ipc.Failed(f"zygote: unexpected {type(msg).__name__} with {len(fds)} fd(s)"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
