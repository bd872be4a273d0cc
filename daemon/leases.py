"""Leases: which worker processes hold which resident arena.

Rules: ``attach`` grants a lease on an arena's fingerprint; the worker renews it (``heartbeat``) every ``ttl / 3``.
A lease is dropped when its pid is gone (a zombie counts as gone) or it missed renewals for ``ttl`` seconds, when
the worker detaches, and when its arena is evicted. Residency never evicts a model with live leases unless forced.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass

from keepwarm.daemon.client import pid_alive

log = logging.getLogger("keepwarm.daemon")


@dataclass
class Lease:
    lease_id: str
    pid: int
    fingerprint: str
    created: float
    last_seen: float


class Leases:
    """The live leases, by id. Touched only by the daemon's socket loop."""

    def __init__(self, ttl: float, counters: dict[str, int]) -> None:
        self.ttl = ttl
        self._by_id: dict[str, Lease] = {}
        self.counters = counters  # the daemon's: "leases_dropped" counts reaped leases

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, lease_id: str) -> Lease | None:
        return self._by_id.get(lease_id)

    def grant(self, pid: int, fingerprint: str) -> Lease:
        lease = Lease(secrets.token_hex(8), pid, fingerprint, time.time(), time.monotonic())
        self._by_id[lease.lease_id] = lease
        return lease

    def pop(self, lease_id: str) -> Lease | None:
        return self._by_id.pop(lease_id, None)

    def holders(self, fingerprint: str) -> list[Lease]:
        return [x for x in self._by_id.values() if x.fingerprint == fingerprint]

    def held(self, fingerprint: str) -> bool:
        return any(x.fingerprint == fingerprint for x in self._by_id.values())

    def drop_all(self, fingerprint: str) -> None:
        """Forget the leases on an arena that is going away."""
        for lease_id in [k for k, x in self._by_id.items() if x.fingerprint == fingerprint]:
            del self._by_id[lease_id]

    def reap(self) -> None:
        """Drop the leases whose pid is gone or that missed their renewals."""
        now = time.monotonic()
        for lease_id, lease in list(self._by_id.items()):
            reason = None
            if not pid_alive(lease.pid):
                reason = f"pid {lease.pid} is gone"
            elif now - lease.last_seen > self.ttl:
                reason = f"no renewal for {now - lease.last_seen:.1f}s"
            if reason:
                del self._by_id[lease_id]
                self.counters["leases_dropped"] += 1
                log.info("lease %s dropped: %s", lease_id, reason)

