"""A forked worker's end of its status socket to the supervisor (``WorkerLink``).

The worker says Ready / Standing / Draining / Exit / Failed on it, hears Go, Drain and Restarts (the restart
history /health shows), and answers ExportPrefixes / AdoptPrefixes (the prefix cache a restart carries over) through
the callables its serving side hands to ``listen``: they run in the engine thread and return the typed replies.
The supervisor going away (EOF) drains the worker (SIGTERM to itself), so no worker outlives its server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from keepwarm.formats.wire import ProtocolError
from keepwarm.worker.process import ipc
from keepwarm.worker.process.priority import normal_priority

log = logging.getLogger("keepwarm.zygote")

# The serving side's prefix-cache calls (keepwarm.worker.serve): the export's memfd (None when nothing was exported)
# and what it holds; the adoption of the memfd beside an AdoptPrefixes.
ExportCall = Callable[[], tuple[int | None, ipc.CarriedPrefixes]]
AdoptCall = Callable[[int], ipc.CarriedPrefixes]


class WorkerLink:
    """The worker's end of its status socket (module docstring)."""

    def __init__(self, sock: socket.socket, restarts: dict[str, Any], fork_time: float,
                 standby: bool = False) -> None:
        self.sock = sock
        self.restarts = restarts  # replaced whole by the reader thread; the event loop reads it
        self.fork_time = fork_time
        self.standby = standby
        self.idle_priority = False  # a standby warming at SCHED_IDLE (``priority.idle_priority``), restored on Go
        self._lock = threading.Lock()

    def say(self, message: Any, fds: tuple[int, ...] = ()) -> None:
        with self._lock, contextlib.suppress(OSError):  # the supervisor is gone: the reader drains us
            ipc.send(self.sock, message, fds)

    def await_go(self, phases: dict[str, float]) -> bool:
        """A standby's wait, warmed and not accepting: say Standing, then block until Go (True) or until the
        supervisor drops it (Drain or EOF: False, the worker exits without serving). Runs before ``listen``."""
        self.say(ipc.Standing(pid=os.getpid(), ready_s=time.time() - self.fork_time, phases=dict(phases)))
        while (msg := self._next()) is not None:
            if isinstance(msg, ipc.Go | ipc.Drain):
                if isinstance(msg, ipc.Go) and self.idle_priority:
                    normal_priority()
                return isinstance(msg, ipc.Go)
        return False

    def listen(self, on_drain: Callable[[], None], export: ExportCall | None = None,
               adopt: AdoptCall | None = None) -> None:
        """Read the supervisor's messages in a thread: Drain calls ``on_drain``; ExportPrefixes and AdoptPrefixes
        are answered with what ``export`` and ``adopt`` return (None: this worker has no engine to ask)."""
        threading.Thread(target=self._read, args=(on_drain, export, adopt), name="keepwarm-link",
                         daemon=True).start()

    def _read(self, on_drain: Callable[[], None], export: ExportCall | None, adopt: AdoptCall | None) -> None:
        while (got := self._next_with_fds()) is not None:
            msg, fds = got
            if isinstance(msg, ipc.Drain):
                on_drain()
            elif isinstance(msg, ipc.ExportPrefixes):
                self._export(export)
            elif isinstance(msg, ipc.AdoptPrefixes):
                self._adopt(adopt, fds[0] if fds else None)
            for fd in fds:
                os.close(fd)
        log.warning("the server's supervisor is gone: draining")
        os.kill(os.getpid(), signal.SIGTERM)

    def _export(self, export: ExportCall | None) -> None:
        fd = None
        try:
            if export is None:
                raise RuntimeError("this worker has no engine to export from")
            fd, reply = export()
            self.say(reply, (fd,) if fd is not None else ())
        except Exception as e:  # the restart goes on without the cache; the supervisor logs why
            log.warning("prefix cache export failed: %s: %s", type(e).__name__, e)
            self.say(ipc.CarriedPrefixes(0, 0, 0.0, f"the export failed: {type(e).__name__}: {e}"))
        finally:
            if fd is not None:
                os.close(fd)

    def _adopt(self, adopt: AdoptCall | None, fd: int | None) -> None:
        try:
            if adopt is None or fd is None:
                raise RuntimeError("no engine to adopt into" if adopt is None else "no export file came with it")
            reply = adopt(fd)
        except Exception as e:  # this worker serves on without the cache
            log.warning("prefix cache adoption failed: %s: %s", type(e).__name__, e)
            reply = ipc.CarriedPrefixes(0, 0, 0.0, f"the adoption failed: {type(e).__name__}: {e}")
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
