"""Snapshot commands' figures for Prometheus, through node_exporter's textfile collector (a short-lived command
cannot be scraped).

After each run, ``keepwarm snapshot create|export|import|push|pull`` rewrite ``textfile_path()``
(``$KEEPWARM_HOME/metrics/keepwarm_snapshot.prom``): the last successful run's seconds and bytes per op and snapshot,
when each op last succeeded, and runs per op and result, all gauges (the series: docs/vllm-compat.md, "Metrics").
Rules: the file is its own state; each run reads it back (prometheus_client's parser), updates its series and writes
it whole to a temporary file renamed over it (node_exporter never reads half a file), under a lock, so that two
commands at once both count; a failed run leaves the last success's figures."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from keepwarm.formats.paths import keepwarm_home

FILENAME = "keepwarm_snapshot.prom"
OPS = ("create", "export", "import", "push", "pull")

# name -> (help, label names)
SERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "keepwarm:snapshot_last_seconds": ("Seconds the last successful run of a snapshot command took.",
                                       ("op", "snapshot")),
    "keepwarm:snapshot_last_bytes": ("Bytes the last successful run moved (create, import: new bytes in the store; "
                                     "export: the archive; push: uploaded; pull: downloaded).", ("op", "snapshot")),
    "keepwarm:snapshot_last_success_timestamp_seconds": ("Unix time of the last successful run of a snapshot "
                                                         "command.", ("op",)),
    "keepwarm:snapshot_runs": ("Runs of a snapshot command recorded in this file, by result (success, failure).",
                               ("op", "result")),
}

Samples = dict[str, dict[tuple[str, ...], float]]  # series -> label values (in SERIES' order) -> value


def textfile_path() -> Path:
    return keepwarm_home() / "metrics" / FILENAME


def read(path: Path) -> Samples:
    """The series in ``path`` (empty when it is missing; series this module does not write are dropped)."""
    out: Samples = {name: {} for name in SERIES}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in SERIES:
                out[s.name][tuple(s.labels.get(k, "") for k in SERIES[s.name][1])] = s.value
    return out


class _Families(Collector):
    def __init__(self, samples: Samples) -> None:
        self._samples = samples

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, (doc, labels) in SERIES.items():
            g = GaugeMetricFamily(name, doc, labels=list(labels))
            for values, value in sorted(self._samples[name].items()):
                g.add_metric(list(values), value)
            yield g


def render(samples: Samples) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(samples))
    return generate_latest(registry)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    with open(directory / f".{FILENAME}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _update(op: str, change: dict[str, dict[tuple[str, ...], float]], count: str, path: Path | None) -> Path:
    path = path or textfile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent):
        samples = read(path)
        for name, values in change.items():
            samples[name].update(values)
        runs = samples["keepwarm:snapshot_runs"]
        for result in ("success", "failure"):
            runs.setdefault((op, result), 0.0)
        runs[(op, count)] += 1
        fd, tmp = tempfile.mkstemp(prefix=f".{FILENAME}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(render(samples))
            os.chmod(tmp, 0o644)  # node_exporter runs as another user
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return path


def record_success(op: str, name: str, seconds: float, nbytes: int, path: Path | None = None) -> Path:
    """Record a successful run of ``op`` on snapshot ``snapshot``; returns the file written."""
    return _update(op, {"keepwarm:snapshot_last_seconds": {(op, name): seconds},
                        "keepwarm:snapshot_last_bytes": {(op, name): float(nbytes)},
                        "keepwarm:snapshot_last_success_timestamp_seconds": {(op,): time.time()}},
                   "success", path)


def record_failure(op: str, path: Path | None = None) -> Path:
    """Count a failed run of ``op`` (the last-run gauges keep the last success's figures)."""
    return _update(op, {}, "failure", path)
