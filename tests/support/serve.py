"""A real `keepwarm serve` process on a free loopback port for the end-to-end tests, and /metrics read through
prometheus_client's parser."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import httpx

from support.ports import free_port
from support.procs import stop_process
from support.wait import wait_until


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a Prometheus exposition, keyed by (sample name, its labels), parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    """The one sample called ``name`` whose labels include ``labels`` (an error if none or several match)."""
    hits = [v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= lab]
    assert len(hits) == 1, f"{len(hits)} samples of {name} {labels}: {sorted(k for k in samples if k[0] == name)}"
    return hits[0]


def wait_healthy(proc: subprocess.Popen, base: str, output: Callable[[], str], timeout: float = 90.0,
                 interval: float = 0.1) -> None:
    """Until ``base``/health answers 200; an AssertionError with the tail of ``output()`` (the server's log) once
    ``proc`` has exited, or after ``timeout`` seconds."""
    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {output()[-3000:]}")
        try:
            return httpx.get(base + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout, interval, message=lambda: f"server not ready: {output()[-3000:]}")


class ServeProcess:
    """`keepwarm serve ARGS --port P`; waits until /health answers 200 (or fails with the server's output)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, timeout: float = 90.0,
                 port: int | None = None) -> None:
        self.port = port or free_port()
        host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"
        self.base = f"http://{host}:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="kw-serve-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "keepwarm.cli.main", "serve", *map(str, args), "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        wait_healthy(self.proc, self.base, self.output, timeout)

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        """/metrics parsed: read one value with ``metric(samples, name, label=value)``."""
        return parse_metrics(httpx.get(self.base + "/metrics").text)

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.metrics(), name, **labels)

    def output(self) -> str:
        return Path(self.log_path).read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        return stop_process(self.proc, sig, timeout)
