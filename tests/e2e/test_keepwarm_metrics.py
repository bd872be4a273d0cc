"""keepwarm's own figures that no engine has: how the weights were loaded (keepwarm:preload_* on a worker's /metrics:
the daemon's preload as its `status` reports it, asked once at attach time, or the worker's own disk load), and
what the short-lived snapshot commands did (keepwarm:snapshot_* in the textfile node_exporter exports,
keepwarm.snapshot.textfile). docs/vllm-compat.md, "Metrics", describes both."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.registry import registry_env
from support.serve import ServeProcess, metric
from support.snapshots import synthetic

from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot import textfile
from keepwarm.snapshot.inspect import mb
from keepwarm.snapshot.store import Store
from keepwarm.weights.checkpoint import Checkpoint

SERVE_ARGS = ("--dtype", "float32", "--max-model-len", "256", "--threads", "1", "--served-model-name", "tiny")


# -- preload figures on /metrics ------------------------------------------------------------------------------------
def test_attached_worker_exports_the_daemons_preload_figures(tiny_llama) -> None:
    """A worker attached to a daemon's arena exports that arena's preload figures, equal to the daemon's `status`
    for the model (the one preload this test asked for)."""
    from keepwarm.daemon.client import start_daemon

    rt = Path(tempfile.mkdtemp(prefix="kwrt-", dir="/tmp"))
    client = start_daemon(rt)
    try:
        client.preload(tiny_llama)
        s = ServeProcess(tiny_llama, *SERVE_ARGS, env={"KEEPWARM_RUNTIME_DIR": str(rt)})
        try:
            weights = httpx.get(s.base + "/health").json()["weights"]
            assert weights["source"] == "daemon"
            status = client.status()
            (model,) = [m for m in status["models"] if m["fingerprint"] == weights["fingerprint"]]
            assert model["origin"] == "preload" and model["source_bytes"] > 0 and model["load_seconds"] > 0
            samples = s.metrics()
            labels = {"model_name": "tiny", "origin": "preload"}
            assert metric(samples, "keepwarm:preload_seconds", **labels) == model["load_seconds"]
            assert metric(samples, "keepwarm:preload_source_bytes", **labels) == model["source_bytes"]
            assert metric(samples, "keepwarm:preload_arena_bytes", **labels) == model["arena_bytes"]
            assert weights["preload"] == {"origin": "preload", "seconds": model["load_seconds"],
                                          "source_bytes": model["source_bytes"], "arena_bytes": model["arena_bytes"]}
            assert status["counters"]["preloads"] == 1 and status["counters"]["attaches"] == 1  # ours; the worker's
        finally:
            assert s.stop() == 0
    finally:
        client.shutdown()
        client.close()
        shutil.rmtree(rt, ignore_errors=True)


def test_disk_load_exports_its_own_figures(tiny_llama) -> None:
    """Without a daemon the worker exports its own load under the same names (origin "disk"): the checkpoint's
    tensor bytes read, the arena it built, the seconds reading and building took (within the whole load's)."""
    s = ServeProcess(tiny_llama, "--no-daemon", *SERVE_ARGS)
    try:
        samples = s.metrics()
        labels = {"model_name": "tiny", "origin": "disk"}
        assert metric(samples, "keepwarm:preload_source_bytes", **labels) == Checkpoint(tiny_llama).nbytes
        assert metric(samples, "keepwarm:preload_arena_bytes", **labels) == metric(samples, "keepwarm:resident_bytes")
        seconds = metric(samples, "keepwarm:preload_seconds", **labels)
        assert 0 < seconds <= metric(samples, "keepwarm:attach_seconds")
        assert not [k for k in samples if k[0].startswith("keepwarm:preload_") and ("origin", "disk") not in k[1]]
    finally:
        assert s.stop() == 0


# -- snapshot commands: node_exporter's textfile --------------------------------------------------------------------
def kw_cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KEEPWARM_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "--log-level", "warning", "snapshot", *args],
                          env=env, capture_output=True, text=True, timeout=120)


def read_textfile(home: Path) -> dict[tuple[str, frozenset], float]:
    """$KEEPWARM_HOME/metrics/keepwarm_snapshot.prom parsed by prometheus_client, as node_exporter would; every
    family a gauge; no temporary file left beside it."""
    d = home / "metrics"
    assert sorted(p.name for p in d.iterdir() if not p.name.endswith(".lock")) == ["keepwarm_snapshot.prom"]
    families = list(text_string_to_metric_families((d / "keepwarm_snapshot.prom").read_text()))
    assert {f.type for f in families} == {"gauge"}
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def home_with(tmp_path: Path, name: str) -> tuple[Path, Store, dict]:
    home = tmp_path / name
    store = Store(home / "store").ensure()
    return home, store, synthetic(store)


def _seconds(stdout: str) -> float:
    return float(re.findall(r"([0-9.]+)s$", stdout.strip())[-1])


def test_export_and_import_write_the_textfile(tmp_path) -> None:
    """`snapshot export` / `import` leave their seconds and bytes in the textfile, as their own output says them;
    runs are counted per command and result, a failure keeps the last success's figures."""
    home, _, syn = home_with(tmp_path, "a")
    t0 = time.time()
    r = kw_cli(home, "export", "syn", "-o", str(tmp_path / "syn.tar"))
    assert r.returncode == 0, r.stderr
    size = (tmp_path / "syn.tar").stat().st_size
    m = read_textfile(home)
    assert metric(m, "keepwarm:snapshot_last_bytes", op="export", snapshot="syn") == size
    assert f"({mb(size)})" in r.stdout
    assert metric(m, "keepwarm:snapshot_last_seconds", op="export", snapshot="syn") == pytest.approx(
        _seconds(r.stdout), abs=0.006)
    assert t0 <= metric(m, "keepwarm:snapshot_last_success_timestamp_seconds", op="export") <= time.time()
    assert metric(m, "keepwarm:snapshot_runs", op="export", result="success") == 1
    assert metric(m, "keepwarm:snapshot_runs", op="export", result="failure") == 0

    # a failure (no such snapshot): counted; the last success's figures stay
    assert kw_cli(home, "export", "nope", "-o", str(tmp_path / "nope.tar")).returncode == 1
    after = read_textfile(home)
    assert metric(after, "keepwarm:snapshot_runs", op="export", result="failure") == 1
    assert {k: v for k, v in after.items() if k[0] != "keepwarm:snapshot_runs"} == \
        {k: v for k, v in m.items() if k[0] != "keepwarm:snapshot_runs"}

    other = tmp_path / "b"
    r = kw_cli(other, "import", str(tmp_path / "syn.tar"))
    assert r.returncode == 0, r.stderr
    new_bytes = sum(mf.blobs(syn).values())  # every blob is new to this store
    i = read_textfile(other)
    assert metric(i, "keepwarm:snapshot_last_bytes", op="import", snapshot="syn") == new_bytes > 0
    assert f"({mb(new_bytes)})" in r.stdout
    assert metric(i, "keepwarm:snapshot_last_seconds", op="import", snapshot="syn") > 0
    assert metric(i, "keepwarm:snapshot_runs", op="import", result="success") == 1


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    yield from registry_env(tmp_path_factory.mktemp("registry"))


def test_push_and_pull_write_the_textfile(reg, tmp_path) -> None:
    """`snapshot push` / `pull` against a real registry: the bytes each moved (all 5 blobs uploaded, the 4 of the
    store's downloaded), their seconds as their output says, the time of the last success, the runs; a second push
    uploads nothing and says so in the file too."""
    home, _, m = home_with(tmp_path, "src")
    ref = f"{reg.proxy.host}/kw/metrics:v1"
    r = kw_cli(home, "push", "syn", ref, "--insecure")
    assert r.returncode == 0, r.stderr
    uploaded = sum(mf.blobs(m).values()) + len(mf.dumps(m).encode())  # the blobs and the manifest (OCI config)
    t = read_textfile(home)
    assert metric(t, "keepwarm:snapshot_last_bytes", op="push", snapshot="syn") == uploaded
    assert f"({mb(uploaded)}," in r.stdout
    assert metric(t, "keepwarm:snapshot_last_seconds", op="push", snapshot="syn") == pytest.approx(
        _seconds(r.stdout), abs=0.006)
    assert metric(t, "keepwarm:snapshot_runs", op="push", result="success") == 1

    assert "0 uploaded" in kw_cli(home, "push", "syn", ref, "--insecure").stdout
    t = read_textfile(home)
    assert metric(t, "keepwarm:snapshot_last_bytes", op="push", snapshot="syn") == 0
    assert metric(t, "keepwarm:snapshot_runs", op="push", result="success") == 2
    assert kw_cli(home, "push", "syn", ref).returncode == 1  # plain HTTP without --insecure
    assert metric(read_textfile(home), "keepwarm:snapshot_runs", op="push", result="failure") == 1

    other = tmp_path / "dst"
    r = kw_cli(other, "pull", ref, "--insecure", "--name", "copy")
    assert r.returncode == 0 and "pulled copy" in r.stdout, r.stderr
    downloaded = sum(mf.blobs(m).values())  # the blobs (the manifest is counted apart)
    p = read_textfile(other)
    assert metric(p, "keepwarm:snapshot_last_bytes", op="pull", snapshot="copy") == downloaded
    assert f"({mb(downloaded)}," in r.stdout
    assert metric(p, "keepwarm:snapshot_last_seconds", op="pull", snapshot="copy") == pytest.approx(
        _seconds(r.stdout), abs=0.006)
    assert metric(p, "keepwarm:snapshot_runs", op="pull", result="success") == 1


def test_textfile_counts_every_concurrent_run(tmp_path) -> None:
    """Runs at once each rewrite the file whole under the lock: none is lost, and a reader never sees a partial
    file (each write is a rename)."""
    path = tmp_path / textfile.FILENAME
    seen: list[int] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            if path.exists():
                families = list(text_string_to_metric_families(path.read_text()))
                seen.append(len(families))

    def writer(i: int) -> None:
        for _ in range(5):
            textfile.record_success("push", f"s{i}", 0.5, 10, path)

    r = threading.Thread(target=reader)
    r.start()
    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stop.set()
    r.join()
    assert set(seen) <= {len(textfile.SERIES)}
    m = textfile.read(path)
    assert m["keepwarm:snapshot_runs"][("push", "success")] == 30
    assert set(m["keepwarm:snapshot_last_seconds"]) == {("push", f"s{i}") for i in range(6)}
