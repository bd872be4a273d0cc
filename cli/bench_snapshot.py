"""`keepwarm bench snapshot`: snapshot create / restore times against raw copies of the same bytes, and
restore-to-serving against a cold preload from the checkpoint; per model, the three ways to an arena in the same
run: a preload from the checkpoint, a restore of the image made for this platform, and a restore through the
portable layer (a copy of the snapshot's manifest with no platform image, so the daemon builds its layout from the
portable layer), each into an empty daemon. Figures go to docs/benchmarks.md; nothing here is asserted."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from keepwarm.cli.bench import (
    SMOKE_HELP,
    bench_app,
    bench_prompts,
    drop_page_cache,
    machine_line,
    smoke_model,
    smoke_start,
    tiny_bench_model,
)
from keepwarm.cli.bench_serving import _first_token, _free_port, _kill, _resolve_model, _start_to_first_token
from keepwarm.formats import paths
from keepwarm.formats.paths import keepwarm_home
from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.store import Store
from keepwarm.worker.process.config import ServerConfig, to_toml

# The CLI imports this module to register the command: what needs torch is imported when the benchmark runs.


@contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _timed_cp(src: Path, dst: Path, sync: bool) -> float:
    t = time.perf_counter()
    subprocess.run(["cp", str(src), str(dst)], check=True)
    if sync:
        subprocess.run(["sync", str(dst)], check=True)  # coreutils: fsync the file, as the store does
    return time.perf_counter() - t


def _daemon(rt: Path):
    from keepwarm.daemon.client import start_daemon  # deferred: zmq and psutil, which `keepwarm --help` must not pay

    return start_daemon(rt)


def _stop(client) -> None:
    try:
        client.shutdown()
    finally:
        client.close()


@bench_app.command("snapshot")
def snapshot_bench(
    models: Annotated[str, typer.Option(help="Comma-separated: 'smollm2', '1b' or model directories.")] = "smollm2,1b",
    dtype: Annotated[str, typer.Option()] = "bfloat16",
    quantization: Annotated[str, typer.Option("--quantization", "-q", help="What the preload makes of the checkpoint "
                                              "(none, int8, ...): a quantized preload also quantizes, which a "
                                              "restore skips.")] = "none",
    threads: Annotated[int, typer.Option()] = 2,
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
    registry: Annotated[str | None, typer.Option("--registry", help="HOST:PORT of a plain-HTTP OCI registry "
                                                 "(e.g. a local docker-registry): also time push and pull.")] = None,
    smoke: Annotated[bool, typer.Option("--smoke", help=SMOKE_HELP)] = False,
) -> None:
    """Per model: snapshot create (cold store, the portable layer included; then a config-only second snapshot) vs
    `cp` of the arena file to the store's disk (+ fsync); restore into an empty daemon (verify + image load) vs `cp`
    of the image to /dev/shm, and through the portable layer against it and the preload; restore + server start to
    first token vs a cold start (preload from the checkpoint) to first token;
    the same two into a running `serve --zygote` server (`keepwarm restart` onto the restored config, or onto the
    checkpoint);
    with ``--registry``, push to a new repository and pull into an empty store. Page caches of the files read are
    dropped before each cold measurement."""
    if smoke:
        smoke_start()
        models = str(smoke_model())
    typer.echo(f"# machine: {machine_line()}")
    rows = []
    for spec in models.split(","):
        path = _resolve_model(spec, dtype)
        work = Path(tempfile.mkdtemp(prefix="bench-snapshot-", dir=keepwarm_home()))  # the store's real disk
        rts = [Path(tempfile.mkdtemp(prefix="kwbs-", dir="/tmp")) for _ in range(9)]
        try:
            rows.append(_bench_model(path, _Run(dtype, quantization, threads, _free_port()), work, rts, registry))
        finally:
            shutil.rmtree(work, ignore_errors=True)
            for rt in rts:
                shutil.rmtree(paths.shm_dir(rt), ignore_errors=True)
                shutil.rmtree(rt, ignore_errors=True)
    if json_out:
        json_out.write_text(json.dumps({"machine": machine_line(), "rows": rows}, indent=2) + "\n")


@dataclass(frozen=True)
class _Run:
    """What every server and preload of a row runs with; ``port``: the zygote rows' server's, in the snapshot's
    config too (`snapshot restore --restart-server` restarts the server on the restored config's port)."""

    dtype: str
    quantization: str
    threads: int
    port: int

    def flags(self) -> list[str]:
        """`serve` / `restart` flags for the model measured."""
        return ["--dtype", self.dtype, "--quantization", self.quantization, "--max-model-len", "2048"]


def _bench_model(path: Path, run: _Run, work: Path, rts: list[Path], registry: str | None = None) -> dict[str, Any]:
    """One model's row: create, restore (the platform image, then the portable layer), then restore-to-first-token
    against a cold start; each in its own daemon (runtime dirs ``rts[0..8]``), the store under ``work``; then push /
    pull through ``registry``."""
    from keepwarm.weights.checkpoint import Checkpoint  # deferred: torch, which `keepwarm --help` must not pay

    files = Checkpoint(path).files
    home = work / "home"
    base_env = {"KEEPWARM_HOME": str(home), "OMP_NUM_THREADS": str(run.threads)}
    row: dict[str, Any] = {"model": path.name, "dtype": run.dtype, "quantization": run.quantization}
    # The native CPU kernels are built once per KEEPWARM_HOME (~2.4 s on a Zen 3, 4.6 s on this slow VM): built here
    # first, as on any machine that ran keepwarm before, so that no timed row pays it. The first preload below did
    # (an int8 preload quantizes with them): 11.5-12.8 s against 2.7-3.4 s for the 1B.
    subprocess.run([sys.executable, "-c", "from keepwarm.kernels import cpu_native; cpu_native.glue_on()"],
                   env={**os.environ, **base_env}, check=True, capture_output=True)
    with _env(**base_env, KEEPWARM_RUNTIME_DIR=str(rts[0])):
        store, blobs, arena_bytes, file_bytes, note = _bench_create(path, run, work, home, rts[0], files, row)
    typer.echo(f"{path.name} ({run.quantization}, {run.dtype}): arena {arena_bytes / 1e6:.1f} MB (file "
               f"{file_bytes / 1e6:.1f} MB); preload from the checkpoint {row['preload_s']:.2f}s (page cache {note})")
    typer.echo(f"  create (cold store)          {row['create_s']:7.2f} s  {row['create_mbps']:8.1f} MB/s  "
               f"(arena image and portable layer {row['create_image_s']:.2f}s)")
    same = "the same blob" if row["portable_same_blob"] else "a second blob"
    typer.echo(f"  snapshot sizes               image {row['image_blob_bytes'] / 1e6:.1f} MB, portable layer "
               f"{row['portable_blob_bytes'] / 1e6:.1f} MB ({same}): {row['snapshot_blob_bytes'] / 1e6:.1f} MB "
               f"of arena blobs")
    cp_s, cp_sync_s = row["cp_arena_to_disk_s"], row["cp_arena_to_disk_fsync_s"]
    typer.echo(f"  cp arena -> store disk       {cp_s:7.2f} s  {file_bytes / cp_s / 1e6:8.1f} MB/s  "
               f"(+fsync {cp_sync_s:.2f}s, {file_bytes / cp_sync_s / 1e6:.1f} MB/s; before the create "
               f"{row['cp_arena_to_disk_fsync_before_s']:.2f}s)")
    typer.echo(f"  create (config only)         {row['create_config_only_s']:7.2f} s  "
               f"{row['create_config_only_new_bytes'] / 1e3:.1f} KB new blobs")

    _bench_restores(store, base_env, rts[1:5], blobs, work, row)
    from transformers import AutoTokenizer  # deferred: ~0.7 s, which `keepwarm --help` must not pay

    prompt = bench_prompts(AutoTokenizer.from_pretrained(str(path)), 1)[0]
    _bench_first_token(path, run, home, base_env, rts[5:7], files, blobs, prompt, row)
    _bench_zygote(path, run, home, base_env, rts[7:9], files, blobs, prompt, row)
    if registry:
        _bench_registry(store, registry, work, blobs, row)
    return row


def _bench_registry(store: Store, registry: str, work: Path, blobs: list[Path], row: dict[str, Any]) -> None:
    """Push the snapshot to a fresh repository (every blob uploaded), then pull it into an empty store."""
    from keepwarm.snapshot.oci import Reference, Registry, pull, push  # deferred: httpx (~80 ms)

    ref = Reference.parse(f"{registry}/keepwarm-bench/run-{os.getpid()}-{int(time.time())}:v1")
    drop_page_cache(blobs)
    with Registry(ref, insecure=True) as reg:
        p = push(store, "bench", reg)
    with Registry(ref, insecure=True) as reg:
        q = pull(Store(work / "pulled"), reg)
    row.update(push_s=p.seconds, push_bytes=p.uploaded_bytes, push_mbps=p.uploaded_bytes / p.seconds / 1e6,
               pull_s=q.seconds, pull_bytes=q.downloaded_bytes, pull_mbps=q.downloaded_bytes / q.seconds / 1e6)
    typer.echo(f"  push to {registry:18s} {p.seconds:7.2f} s  {row['push_mbps']:8.1f} MB/s  "
               f"({p.uploaded_bytes / 1e6:.1f} MB uploaded)")
    typer.echo(f"  pull into an empty store     {q.seconds:7.2f} s  {row['pull_mbps']:8.1f} MB/s  "
               f"({q.downloaded_bytes / 1e6:.1f} MB, every blob verified)")


def _bench_create(path: Path, run: _Run, work: Path, home: Path, rt: Path, files: list[Path], row: dict[str, Any]
                  ) -> tuple[Store, list[Path], int, int, str]:
    """Preload, then snapshot create (cold store, then config only) against cp of the arena file (+ fsync, before
    and after the create); fills ``row``, the blob sizes too.
    Returns (the store, the arena blobs: the image, then the portable layer where it is another blob, arena bytes,
    arena file bytes, the page-cache note)."""
    from keepwarm.snapshot.create import create  # deferred: torch (~1.2 s), which `keepwarm --help` must not pay

    client = _daemon(rt)
    try:
        note = drop_page_cache(files)
        t = time.perf_counter()
        reply = client.preload(str(path), run.quantization, run.dtype)
        row["preload_s"] = time.perf_counter() - t
        arena_bytes = reply.bytes
        arena_file = Path(client.status()["arena_dir"]) / f"{reply.fingerprint}.arena"
        file_bytes = arena_file.stat().st_size
        toml = work / "server.toml"
        toml.write_text(to_toml(ServerConfig(model=str(path), dtype=run.dtype, quantization=run.quantization,
                                             runtime_dir=str(rt), max_model_len=2048, port=run.port,
                                             threads=run.threads)))
        store = Store(home / "store")
        raw = work / "raw-copy.arena"
        # The same copy before the create as after it: on some VMs the first large write after a while runs at a
        # fraction of the disk's speed (1.16 GB: 2.3-2.8 s first, 0.7 s next), whichever command does it.
        row["cp_arena_to_disk_fsync_before_s"] = _timed_cp(arena_file, raw, sync=True)
        raw.unlink()
        r = create("bench", config_path=str(toml), store=store)
        row.update(create_s=r.seconds, create_image_s=r.image_seconds, image_bytes=file_bytes,
                   create_mbps=file_bytes / r.seconds / 1e6)
        toml.write_text(to_toml(ServerConfig(model=str(path), dtype=run.dtype, quantization=run.quantization,
                                             runtime_dir=str(rt), max_model_len=2048,
                                             max_num_seqs=8)))
        r2 = create("bench-cfg", config_path=str(toml), store=store)
        row.update(create_config_only_s=r2.seconds, create_config_only_new_bytes=r2.new_bytes)
        row["cp_arena_to_disk_s"] = _timed_cp(arena_file, raw, sync=False)
        raw.unlink()
        row["cp_arena_to_disk_fsync_s"] = _timed_cp(arena_file, raw, sync=True)
        raw.unlink()
    finally:
        _stop(client)
    return store, _snapshot_blobs(store, row), arena_bytes, file_bytes, note


def _snapshot_blobs(store: Store, row: dict[str, Any]) -> list[Path]:
    """The snapshot's image blob (this platform's) and portable blob, their sizes into ``row``: [image] where the
    portable layer is the image itself (no machine-specific layout), else [image, portable]."""
    model = store.load("bench")["models"][0]
    image, portable = mf.platform_images(model)[0]["image"], model["portable"]["image"]
    same = image["digest"] == portable["digest"]
    row.update(image_blob_bytes=image["size"], portable_blob_bytes=portable["size"], portable_same_blob=same,
               snapshot_blob_bytes=image["size"] + (0 if same else portable["size"]))
    return [store.blob_path(image["digest"])] + ([] if same else [store.blob_path(portable["digest"])])


# The order of the restores (ABBA) and the figure kept, each kind's faster run: on these VMs the first large load
# after a preload ran 1.5-2.9x slower than the next ones, whichever kind it was (the 1B int8, whose two kinds load
# the same blob the same way: 1.9-2.8 s first, 0.9-1.0 s after; a pause or touching 4 GB first did not remove it).
RESTORE_ORDER = (("restore", "bench"), ("restore_portable", "bench-portable"),
                 ("restore_portable", "bench-portable"), ("restore", "bench"))


def _bench_restores(store: Store, base_env: dict[str, str], rts: list[Path], blobs: list[Path], work: Path,
                    row: dict[str, Any]) -> None:
    """Restore into an empty daemon (page caches dropped first) the image made for this platform, and through the
    portable layer (a copy of the manifest under another name with no platform image, so restore finds none for
    this machine), twice each in RESTORE_ORDER (daemons ``rts[0..3]``), against `cp` of the image to /dev/shm;
    fills ``row`` with each kind's faster run (all runs in ``*_runs_s``), their ratio and each against the
    preload."""
    store.save({**mf.without_platforms(store.load("bench"), set()), "name": "bench-portable"})
    runs: dict[str, list[dict[str, Any]]] = {"restore": [], "restore_portable": []}
    for (key, name), rt in zip(RESTORE_ORDER, rts, strict=True):
        runs[key].append(_restore_once(store, name, rt, base_env, work, blobs))
    for key, done in runs.items():
        best = min(done, key=lambda r: r["s"])
        row.update({f"{key}_{k}": v for k, v in best.items() if k != "images_loaded"})
        row[f"{key}_runs_s"] = [r["s"] for r in done]
        row[f"{key}_mbps"] = row["image_bytes"] / best["s"] / 1e6
    row["images_loaded"] = runs["restore"][0]["images_loaded"]
    row.update(portable_vs_image=row["restore_portable_s"] / row["restore_s"],
               portable_vs_preload=row["restore_portable_s"] / row["preload_s"])
    shm = Path("/dev/shm") / f"kwbench-{os.getpid()}.arena"
    drop_page_cache(blobs)
    row["cp_image_to_shm_s"] = _timed_cp(blobs[0], shm, sync=False)
    shm.unlink()
    runs_s = {k: ", ".join(f"{x:.2f}" for x in row[f"{k}_runs_s"]) for k in runs}
    typer.echo(f"  restore (verify + load)      {row['restore_s']:7.2f} s  {row['restore_mbps']:8.1f} MB/s  "
               f"(verify {row['restore_verify_s']:.2f}s, image load {row['restore_load_s']:.2f}s, in the daemon "
               f"{row['restore_daemon_s']:.2f}s; runs {runs_s['restore']}s)")
    typer.echo(f"  restore via portable layer   {row['restore_portable_s']:7.2f} s  "
               f"{row['restore_portable_mbps']:8.1f} MB/s  (verify {row['restore_portable_verify_s']:.2f}s, load "
               f"{row['restore_portable_load_s']:.2f}s, in the daemon {row['restore_portable_daemon_s']:.2f}s, "
               f"origin {row['restore_portable_origin']}; runs {runs_s['restore_portable']}s); "
               f"x{row['portable_vs_image']:.2f} the image restore, x{row['portable_vs_preload']:.2f} the preload")
    typer.echo(f"  cp image -> /dev/shm         {row['cp_image_to_shm_s']:7.2f} s  "
               f"{row['image_bytes'] / row['cp_image_to_shm_s'] / 1e6:8.1f} MB/s")


def _restore_once(store: Store, name: str, rt: Path, base_env: dict[str, str], work: Path, blobs: list[Path]
                  ) -> dict[str, Any]:
    """`snapshot restore NAME` into a new, empty daemon at ``rt``, page caches dropped first (its arena removed
    after: only the times are kept): the times, the resident's origin and what restore said of its path."""
    from keepwarm.snapshot.restore import restore  # deferred: zmq and psutil, which `keepwarm --help` must not pay

    said: list[str] = []
    with _env(**base_env, KEEPWARM_RUNTIME_DIR=str(rt)):
        client = _daemon(rt)
        try:
            drop_page_cache(blobs)
            # its own config file: the first-token rows serve the one `snapshot restore bench` writes
            res = restore(name, store=store, server_config=str(work / f"{name}.toml"), say=said.append)
            st = client.status()
            [resident] = st["models"]
        finally:
            _stop(client)
            shutil.rmtree(paths.shm_dir(rt), ignore_errors=True)
    return {"s": res.seconds, "verify_s": res.verify_seconds, "load_s": res.load_seconds,
            "daemon_s": resident["load_seconds"], "origin": resident["origin"],
            "said": said[-1] if said else "",  # which path restore says it took, and its time
            "images_loaded": st["counters"]["images_loaded"]}


def _bench_first_token(path: Path, run: _Run, home: Path, base_env: dict[str, str], rts: list[Path],
                       files: list[Path], blobs: list[Path], prompt: list[int], row: dict[str, Any]) -> None:
    """`snapshot restore` + server start to the first token of ``prompt`` (daemon ``rts[0]``) against a cold start
    that preloads from the checkpoint (daemon ``rts[1]``); fills ``row``."""
    kw = [sys.executable, "-m", "keepwarm.cli.main", "--log-level", "warning"]
    env = {**os.environ, **base_env, "KEEPWARM_RUNTIME_DIR": str(rts[0])}
    client = _daemon(rts[0])
    try:
        drop_page_cache(blobs)
        port = _free_port()
        t = time.perf_counter()
        subprocess.run([*kw, "snapshot", "restore", "bench"], env=env, check=True, capture_output=True)
        restore_cli = time.perf_counter() - t
        serve, proc = _start_to_first_token([*kw, "serve", "--config", str(home / "server.toml"), "--port",
                                             str(port), "--threads", str(run.threads)], env, port, str(path), prompt)
        _kill(proc, signal.SIGTERM)
        row.update(restore_to_first_token_s=restore_cli + serve, restore_cli_s=restore_cli,
                   restored_serve_to_first_token_s=serve)
    finally:
        _stop(client)
    env = {**env, "KEEPWARM_RUNTIME_DIR": str(rts[1])}
    client = _daemon(rts[1])
    try:
        drop_page_cache(files)
        port = _free_port()
        cold, proc = _start_to_first_token([*kw, "serve", str(path), *run.flags(), "--port", str(port),
                                            "--threads", str(run.threads)], env, port, str(path), prompt)
        _kill(proc, signal.SIGTERM)
        row["cold_preload_to_first_token_s"] = cold
    finally:
        _stop(client)
    typer.echo(f"  restore -> first token       {row['restore_to_first_token_s']:7.2f} s  (restore "
               f"{restore_cli:.2f}s + server start {serve:.2f}s)")
    typer.echo(f"  cold preload -> first token  {cold:7.2f} s  (checkpoint read + pack through the daemon)")


def _placeholder_model() -> Path:
    """What a zygote server serves before the benchmark restarts it onto the model measured (not the smoke model:
    another fingerprint)."""
    return tiny_bench_model("placeholder-llama", seed=7, hidden_size=64, intermediate_size=128, num_hidden_layers=1)


def _bench_zygote(path: Path, run: _Run, home: Path, base_env: dict[str, str], rts: list[Path],
                  files: list[Path], blobs: list[Path], prompt: list[int], row: dict[str, Any]) -> None:
    """Into a running `serve --zygote` server (serving a placeholder model, its imports done): `snapshot restore
    --restart-server` (the restore, then the server restarted in place onto the restored config), to the first
    token (daemon ``rts[0]``), against `keepwarm restart CHECKPOINT`, a cold preload through the daemon, to the
    first token (daemon ``rts[1]``); each a fresh daemon and server, the page cache of what is read dropped first;
    fills ``row``."""
    kw = [sys.executable, "-m", "keepwarm.cli.main", "--log-level", "warning"]
    port = run.port
    restore = [*kw, "snapshot", "restore", "bench", "--restart-server"]
    cold = [*kw, "restart", "--port", str(port), "--threads", str(run.threads), str(path), *run.flags()]
    for key, rt, cmd, cached in (("zygote_restore", rts[0], restore, blobs), ("zygote_cold", rts[1], cold, files)):
        env = {**os.environ, **base_env, "KEEPWARM_RUNTIME_DIR": str(rt)}
        client = _daemon(rt)
        proc = _zygote_server(kw, env, rt, port, run.threads, run.dtype)
        try:
            drop_page_cache(cached)
            t0 = time.monotonic()
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
            if r.returncode != 0 or "cold start" in r.stderr + r.stdout:
                raise RuntimeError(f"{' '.join(cmd[5:8])}... exit {r.returncode}: {r.stderr.strip()[-300:]}")
            row[f"{key}_{cmd[5]}_s"] = time.monotonic() - t0
            deadline = time.monotonic() + 600
            row[f"{key}_to_first_token_s"] = asyncio.run(
                _first_token(f"http://127.0.0.1:{port}", str(path), prompt, deadline, proc)) - t0
        finally:
            _kill(proc, signal.SIGTERM)
            _stop(client)
    ratio = row["zygote_restore_to_first_token_s"] / row["zygote_cold_to_first_token_s"]
    typer.echo(f"  into a running serve --zygote:\n"
               f"    restore + restart -> first token   {row['zygote_restore_to_first_token_s']:7.2f} s  (restore "
               f"--restart-server answered at {row['zygote_restore_snapshot_s']:.2f}s)\n"
               f"    restart onto the checkpoint -> first token {row['zygote_cold_to_first_token_s']:7.2f} s  "
               f"(cold preload through the daemon; restart answered at {row['zygote_cold_restart_s']:.2f}s); "
               f"ratio {ratio:.2f}")


def _zygote_server(kw: list[str], env: dict[str, str], rt: Path, port: int, threads: int, dtype: str
                   ) -> subprocess.Popen:
    """`serve --zygote` on the placeholder model, started and answering (its config file names no flags the
    restarts would then keep)."""
    from transformers import AutoTokenizer  # deferred: ~0.7 s, which `keepwarm --help` must not pay

    model = _placeholder_model()
    toml = rt / "placeholder.toml"
    toml.write_text(to_toml(ServerConfig(model=str(model), dtype=dtype, runtime_dir=str(rt), port=port,
                                         threads=threads, max_model_len=1024, shutdown_timeout=30)))
    prompt = bench_prompts(AutoTokenizer.from_pretrained(str(model)), 1)[0]
    _, proc = _start_to_first_token([*kw, "serve", "--zygote", "--config", str(toml)], env, port, str(model), prompt)
    return proc
