"""A restart's handoff from the old worker to the new one (`keepwarm restart`, SIGHUP), with no downtime.

Steps (keepwarm.worker.process.supervisor runs them; why each: docs/architecture.md, "Restarts with no downtime"):
1. the new config: the last one with the given flags merged over it (or a new server.toml); ``host``/``port``
   cannot change (the listening socket is handed over, not re-bound);
2. previous old workers finish draining first (``wait_drained``), so at most one old and one new worker hold a KV
   pool at once: the weights are the daemon's arena, mapped by both;
3. the standby takes over, or the zygote forks the new worker with the listening socket; it attaches, warms one
   step, starts accepting on the *same* socket and says Ready (keepwarm.worker.process.children);
4. the old worker's prefix cache is carried over (``carry_prefixes``, keepwarm.worker.prefix_handover) while it serves
   on, if both KVs are the same (else nothing: the reason logged and answered), never failing the restart;
5. the old worker is told to Drain (``drain``): it closes its copy of the listener at once (the kernel's shared
   accept queue loses nothing, unlike ``SO_REUSEPORT``'s per-socket queues) and finishes its in-flight requests;
6. a new worker that fails is killed; the old one never stopped serving, and the restart answers why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Any

from keepwarm.formats.wire import ProtocolError
from keepwarm.worker.process import ipc
from keepwarm.worker.process.children import Worker, ended

log = logging.getLogger("keepwarm.supervisor")

DRAIN_NOTICE_TIMEOUT_S = 5.0
# An export or adoption waits for the worker's step in flight, then copies its cached blocks (the worker's own limit
# is 30 s); past this the restart goes on without the cache.
PREFIX_TIMEOUT_S = 35.0


class _NotCarried(Exception):
    """Why a restart's prefix cache was not carried over (the restart goes on)."""


def wait_drained(old: list[Worker]) -> None:
    """Wait for each old worker to finish draining (killed past its shutdown timeout); ``old`` ends empty."""
    for w in list(old):
        if w.wait(time.monotonic() + w.config.shutdown_timeout + 15) is None:
            log.warning("old worker %d still draining after its shutdown timeout: killed", w.pid)
            w.kill()
        old.remove(w)
        w.close()


def drain(old: Worker) -> None:
    """Tell the old worker to Drain and wait for its Draining (SIGTERM if it does not confirm)."""
    ipc.send(old.sock, ipc.Drain())
    try:
        ipc.expect(old.sock, ipc.Draining, timeout=DRAIN_NOTICE_TIMEOUT_S)
    except (EOFError, TimeoutError, ProtocolError, OSError) as e:
        log.warning("old worker %d did not confirm its drain (%s); SIGTERM", old.pid, e)
        with contextlib.suppress(ProcessLookupError):
            os.kill(old.pid, signal.SIGTERM)


def carry_prefixes(old: Worker, new: Worker) -> dict[str, Any]:
    """The old worker's cached prefix blocks into the new one's pool, while the old one still serves: what was
    carried (``blocks`` 0 and the ``reason`` when nothing was; never a failed restart)."""
    t0 = time.monotonic()
    fd = None
    try:
        if old.python != new.python:
            raise _NotCarried("the new worker runs another Python (block keys are per interpreter)")
        ipc.send(old.sock, ipc.ExportPrefixes())
        export, fds = _reply(old, ipc.CarriedPrefixes, PREFIX_TIMEOUT_S)
        fd = fds[0] if fds else None
        if not export.blocks or fd is None:
            raise _NotCarried(export.reason or "the export came without its file")
        ipc.send(new.sock, ipc.AdoptPrefixes(export.blocks), (fd,))
        adopted, _ = _reply(new, ipc.CarriedPrefixes, PREFIX_TIMEOUT_S)
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


def summary(mode: str, reason: str, carried: dict[str, Any]) -> str:
    """What the restart's answer and log line add after the handoff: a cold start's reason, the prefix cache."""
    note = f"; cold start: {reason}" if mode == "cold" else ""
    return note + (f"; prefix cache: {carried['blocks']} blocks carried over ({carried['nbytes'] / 1e6:.1f} MB in "
                   f"{carried['seconds']:.3f}s)" if carried["blocks"] else
                   f"; prefix cache not carried over: {carried['reason']}")
