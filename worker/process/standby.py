"""The standby worker (``serve --standby``): one more worker kept forked, attached and warmed, not accepting.

Rules: it is forked with ``Fork(standby=True)``: it builds its engine, warms one step at SCHED_IDLE
(keepwarm.worker.process.priority), says Standing and waits for Go. A restart whose config and Python are its own
(and a dead worker's replacement) sends it Go instead of forking: it starts accepting and says Ready (mode
"standby"); other flags or another Python drop it (Drain: it exits without serving). The next one is forked
``STANDBY_DELAY_S`` after a handoff (the new worker's first requests have the machine to themselves) and once no old
worker drains, so besides the current worker at most one more holds a KV pool (the draining one or the standby).
One that dies is logged; the next restart forks and brings one back.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from keepwarm.worker.process import ipc
from keepwarm.worker.process.children import RestartFailed, Worker, ended
from keepwarm.worker.process.config import ServerConfig
from keepwarm.worker.process.priority import normal_priority

log = logging.getLogger("keepwarm.supervisor")

# After a handoff, the next standby is forked this much later: even at SCHED_IDLE its warm-up (page population,
# memory traffic) beside the new worker's first requests made them slower on 2 cores.
STANDBY_DELAY_S = 3.0


class Standby:
    """The supervisor's standby worker (pending until it says Standing) and when to fork the next one.
    ``changed`` is called when /health's view of it changes (the supervisor sends its worker the history)."""

    def __init__(self, changed: Callable[[], None]) -> None:
        self.worker: Worker | None = None
        self.due: float | None = 0.0  # when (monotonic) to fork one, once no old worker drains
        self._changed = changed

    @property
    def pid(self) -> int | None:
        """The standby's pid once it stands (warmed, waiting for Go)."""
        return self.worker.pid if self.worker is not None and self.worker.standing else None

    def later(self) -> None:
        """A handoff or a replacement: the next standby follows, after the new worker's first requests."""
        self.due = time.monotonic() + STANDBY_DELAY_S

    def tend(self, wanted: bool, fork: Callable[[], Worker]) -> None:
        """Forget a standby that died; fork one (``fork``) when due and ``wanted`` (``--standby``, a serving
        worker, no old one draining)."""
        s = self.worker
        if s is not None and s.code is not None:
            log.warning("standby worker %d exited (%s); the next restart forks its worker", s.pid, ended(s.code))
            self.worker = None
            self._changed()
        if not (wanted and self.due is not None and time.monotonic() >= self.due and self.worker is None):
            return
        self.due = None
        try:
            self.worker = fork()
        except RestartFailed as e:
            log.error("no standby worker: %s", e)
            return
        log.info("standby worker %d forked", self.worker.pid)

    def stood(self, msg: ipc.Standing) -> None:
        """It said Standing: warmed, waiting for Go."""
        assert self.worker is not None
        self.worker.standing, self.worker.phases = True, msg.phases
        log.info("standby worker %d warmed %.3fs after its fork; phases (s): %s", msg.pid, msg.ready_s,
                 " ".join(f"{k} {v:.3f}" for k, v in msg.phases.items()))
        self._changed()  # /health shows its pid

    def take(self, config: ServerConfig, python: str, timeout: float) -> Worker | None:
        """The standby, told Go, as the new worker once it says Ready. None (the caller forks one) when there is
        none, when it was forked for another config or Python (it is dropped), or when it fails (logged)."""
        s = self.worker
        if s is None:
            return None
        if s.code is not None or s.python != python or s.config.to_dict() != config.to_dict():
            self.drop("the restart's config or Python differ from its own")
            return None
        self.worker = None
        try:
            if not s.standing:  # still warming at SCHED_IDLE (under load it may get no CPU): at full priority now
                with contextlib.suppress(OSError):
                    normal_priority(s.pid)
                s.await_(ipc.Standing, timeout, "failed its warm-up")
            ipc.send(s.sock, ipc.Go())
            s.await_(ipc.Ready, timeout, "did not start accepting")
        except (RestartFailed, OSError) as e:
            s.kill()
            log.error("the standby worker (pid %d) failed (%s): forking a new worker instead", s.pid, e)
            return None
        s.fork_s = 0.0
        return s

    def drop(self, why: str) -> None:
        """Tell the standby to go (Drain, then EOF: it exits without having served)."""
        s, self.worker = self.worker, None
        if s is None:
            return
        log.info("standby worker %d dropped: %s", s.pid, why)
        self._changed()
        with contextlib.suppress(OSError):
            ipc.send(s.sock, ipc.Drain())
        s.close()
