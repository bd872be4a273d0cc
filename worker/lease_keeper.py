"""The lease keeper: a small child process that renews a worker's lease with the daemon.

Why a process and not a thread: a worker's threads share one GIL, and native code that holds it for long (a
pydantic parse of a huge body, a tokenizer call on a long text) starved the renewal thread until the daemon
dropped the lease. The keeper imports only the daemon client (no torch: ~0.15 s, ~20 MB), so nothing the worker
does can stop it from renewing. Rules:
- it renews at once, then every ``ttl / 3`` seconds; when the daemon answers ``unknown_lease`` (it restarted,
  or dropped us) it attaches again by fingerprint, for the worker's pid, and reports the new lease id;
- it ends when the worker's pid is gone, when its stdin closes (the worker died: the daemon drops the lease when
  it sees the pid gone), or on ``stop keep`` / ``stop detach`` (the latter detaches the current lease first);
- stdout is one event per line: ``renewed``, ``lease <id>``, ``warn <message>``.

    python -m keepwarm.worker.lease_keeper RUNTIME_DIR LEASE_ID PID TTL MODEL QUANTIZATION DTYPE FINGERPRINT
"""

from __future__ import annotations

import contextlib
import sys
import threading
from pathlib import Path

from keepwarm.daemon.client import DaemonClient, DaemonError, pid_alive


def _say(line: str) -> None:
    with contextlib.suppress(BrokenPipeError, ValueError):  # the worker stopped reading: it is gone or going
        print(" ".join(line.split()), flush=True)


def run(runtime_dir: str, lease: str, pid: int, ttl: float, model: str, quantization: str, dtype: str,
        fingerprint: str) -> int:
    interval = max(0.2, ttl / 3)
    stop = threading.Event()
    detach = threading.Event()

    def read_commands() -> None:
        for line in sys.stdin:
            if line.startswith("stop"):
                if "detach" in line:
                    detach.set()
                break
        stop.set()

    threading.Thread(target=read_commands, name="commands", daemon=True).start()
    client = DaemonClient(Path(runtime_dir) if runtime_dir else None, timeout=max(1.0, interval))
    try:
        # The first renewal goes out at once: the keeper's own start-up (~0.1 s idle, several times that on a
        # loaded machine) already used part of the TTL since the attach.
        first = True
        while first or not stop.wait(interval):
            first = False
            if not pid_alive(pid):  # a zombie worker counts as gone, as in the daemon
                return 0
            try:
                client.heartbeat(lease)
                _say("renewed")
            except Exception as e:  # noqa: BLE001 - the keeper must outlive any one failed renewal
                if not isinstance(e, DaemonError) or e.code != "unknown_lease":
                    _say(f"warn lease {lease}: cannot renew: {type(e).__name__}: {e}")
                    continue
                try:
                    reply = client.attach(model, quantization, dtype, fingerprint=fingerprint, preload=False, pid=pid)
                except Exception as e2:  # noqa: BLE001 - try again at the next renewal
                    _say(f"warn lease {lease} lost and re-attach failed ({e2}); the weights stay mapped")
                    continue
                lease = reply["lease_id"]
                _say(f"lease {lease}")
        if detach.is_set():
            try:
                client.detach(lease)
            except DaemonError as e:
                _say(f"warn detach of lease {lease}: {e.message}")
        return 0
    finally:
        client.close()


def main(argv: list[str]) -> int:
    if len(argv) != 8:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    runtime_dir, lease, pid, ttl, model, quantization, dtype, fingerprint = argv
    return run(runtime_dir, lease, int(pid), float(ttl), model, quantization, dtype, fingerprint)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
