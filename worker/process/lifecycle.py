"""A serving worker's life as a process: its drain on SIGTERM/SIGINT, the handoff under the supervisor, and its exit
with status 70 when the engine cannot go on (the supervisor, or systemd's Restart=on-failure, brings a new one up).

Rules: a signal stops accepting and drains in-flight requests for ``shutdown_timeout``; a drained worker exits 0
(uvicorn re-raises the signal it caught under the handler installed before it: ``quiet_reraised_signals`` makes
that a no-op). Under the supervisor (``Supervised``) the worker says Ready once it accepts; on Drain (a handoff)
it closes its listeners at once (the new worker accepts on the same socket), answers what is in flight, and what
arrives over connections already open, with ``Connection: close`` (``Serving.handing_over``), and exits once every
connection has closed (idle ones at the keep-alive timeout) or after ``shutdown_timeout``; /health stays 200
meanwhile. A fatal engine error (``exit_on_fatal``) stops serving at once (waiting requests already got their
error); if the orderly stop hangs, the process ends after ``FATAL_EXIT_GRACE_S``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from keepwarm.worker.process import ipc
from keepwarm.worker.process.link import AdoptCall, ExportCall, WorkerLink

log = logging.getLogger("keepwarm.server")

FATAL_EXIT_CODE = 70  # EX_SOFTWARE: the engine died; systemd's Restart=on-failure brings a fresh worker up warm
FATAL_EXIT_GRACE_S = 5.0


class Serving(Protocol):
    """What this module reads and sets on the server it runs (keepwarm.worker.http.state.ServerState)."""

    draining: bool
    handing_over: bool
    fatal: BaseException | None
    startup: dict[str, float]

    def stop_accepting(self) -> None: ...


@dataclass(frozen=True)
class Supervised:
    """A worker under the supervisor: its link, the Ready it says once it accepts, and the prefix-cache calls it
    answers ExportPrefixes / AdoptPrefixes with (built by keepwarm.worker.serve)."""

    link: WorkerLink
    ready: Callable[[], ipc.Ready]
    export: ExportCall
    adopt: AdoptCall


def uvicorn_server(uv_config: Any, serving: Serving, shutdown_timeout: float, supervised: Supervised | None,
                   on_hand_over: Callable[[], None] | None = None, log_started: bool = False) -> Any:
    """uvicorn's server with the drain on SIGTERM/SIGINT and, ``supervised``, Ready and the handoff
    (``on_hand_over``: what else stops taking requests then, gRPC). ``log_started``: uvicorn's "running on" line
    for a socket bound here (uvicorn logs it only for its own)."""
    import uvicorn  # deferred: only a serving worker runs it (the supervisor imports FATAL_EXIT_CODE from here)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not serving.draining:
                log.info("signal %d: draining (up to %.0fs)", sig, shutdown_timeout)
            serving.draining = True
            serving.stop_accepting()
            super().handle_exit(sig, frame)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            t = time.perf_counter()
            await super().startup(sockets=sockets)
            serving.startup["uvicorn_start"] = time.perf_counter() - t
            if log_started and self.started and sockets:
                self._log_started_message(sockets)
            log.info("startup phases (s): %s", " ".join(f"{k} {v:.3f}" for k, v in serving.startup.items()))
            if supervised is not None and self.started:
                loop = asyncio.get_running_loop()
                supervised.link.listen(on_drain=lambda: (loop.call_soon_threadsafe(self.hand_over), None)[1],
                                       export=supervised.export, adopt=supervised.adopt)
                supervised.link.say(supervised.ready())

        def hand_over(self) -> None:
            """Drain for a handoff (module docstring): stop accepting now, close connections as their responses
            end, exit once none is left or after ``shutdown_timeout``."""
            for srv in self.servers:
                srv.close()
            serving.handing_over = True
            if on_hand_over is not None:
                on_hand_over()
            if supervised is not None:
                supervised.link.say(ipc.Draining(pid=os.getpid()))
            self.handover_task = asyncio.get_running_loop().create_task(self._exit_when_closed())

        async def _exit_when_closed(self) -> None:
            deadline = time.monotonic() + shutdown_timeout
            while self.server_state.connections and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            self.should_exit = True

    return _Server(uv_config)


def quiet_reraised_signals() -> None:
    """uvicorn re-raises the signal it caught once it has shut down, under the handler that was installed before
    it; make that one a no-op so a drained SIGTERM ends in exit status 0, not death by signal."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)


def exit_on_fatal(serving: Serving, server: Any, error: BaseException) -> None:
    """The engine cannot go on: stop serving now (waiting requests already got their error) and exit non-zero;
    if the orderly stop hangs, end the process after a short grace."""
    if serving.fatal is not None:
        return
    serving.fatal = error
    serving.draining = True
    serving.stop_accepting()
    server.should_exit = True
    timer = threading.Timer(FATAL_EXIT_GRACE_S, os._exit, (FATAL_EXIT_CODE,))
    timer.daemon = True
    timer.start()
