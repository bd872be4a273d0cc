"""A standby worker's CPU priority: it warms at SCHED_IDLE, beside the serving worker, and returns to SCHED_OTHER
when told Go (or when a restart needs it before it finished warming)."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


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
