"""`keepwarm daemon run|stop`, `keepwarm preload`, `keepwarm status`, `keepwarm evict`.

`preload` checks the model (its path, or a Hugging Face id in the local cache, and its config.json) before it starts
a daemon: a model keepwarm cannot serve never leaves a daemon behind, and a daemon this command started for a preload
that still fails is stopped again.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from keepwarm.cli.errors import fail
from keepwarm.formats import paths
from keepwarm.formats.layout import describe_sizes
from keepwarm.formats.paths import RuntimeDirError
from keepwarm.worker.default_model import default_model, resolve_model

daemon_app = typer.Typer(help="Run or stop the weight-keeping daemon.", no_args_is_help=True)


def _runtime_dir() -> Path:
    return paths.runtime_dir()


@daemon_app.command("run")
def daemon_run(
    memory_budget: Annotated[str | None, typer.Option("--memory-budget",
                                                      help="Bytes (8G, 512M) or a fraction of memory (0.5).")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, or cuda:<GPU UUID>.")] = "cpu",
    lease_ttl: Annotated[float, typer.Option("--lease-ttl", help="Seconds without renewal before a lease drops.")
                         ] = 15.0,
    threads: Annotated[int, typer.Option(help="Loader threads.")] = 4,
) -> None:
    """Run the daemon in the foreground (systemd runs this; `keepwarm preload` starts one detached)."""
    from keepwarm.daemon.server import Daemon  # deferred: torch (~1.2 s), for the daemon alone

    try:
        daemon = Daemon(memory_budget=memory_budget, device=device, lease_ttl=lease_ttl, threads=threads)
        daemon.run()
    except (RuntimeError, RuntimeDirError, ValueError) as e:
        fail(str(e))


@daemon_app.command("stop")
def daemon_stop(
    wait: Annotated[float, typer.Option(help="Seconds to wait for the daemon to exit.")] = 30.0,
) -> None:
    """Stop the daemon cleanly: every arena is removed from shared memory."""
    # deferred: the client's zmq and psutil, which `keepwarm --help` must not pay
    from keepwarm.daemon.client import DaemonClient, DaemonError

    rt = _runtime_dir()
    client = DaemonClient(rt)
    try:
        status = client.status()
        reply = client.shutdown()
    except DaemonError as e:
        fail(e.message)
        return
    finally:
        client.close()
    deadline = time.monotonic() + wait
    while paths.socket_path(rt).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if paths.socket_path(rt).exists():
        fail(f"the daemon (pid {status['pid']}) did not exit within {wait:.0f}s")
    leases = reply.get("leases", 0)
    typer.echo(f"daemon (pid {status['pid']}) stopped" +
               (f"; {leases} attached worker(s) keep their mapped weights until they exit" if leases else ""))


def _progress_printer() -> Any:
    start = time.monotonic()
    state = {"shown": False}

    def show(ev: dict[str, Any]) -> None:
        done, total = ev.get("bytes_done", 0), max(ev.get("bytes_total", 1), 1)
        secs = max(ev.get("seconds", time.monotonic() - start), 1e-6)
        width = 30
        filled = int(width * done / total)
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(f"\r[{bar}] {done / 1e9:6.2f}/{total / 1e9:.2f} GB  {done / secs / 1e9:5.2f} GB/s")
        sys.stderr.flush()
        state["shown"] = True

    def finish() -> None:
        if state["shown"]:
            sys.stderr.write("\n")
            state["shown"] = False

    show.finish = finish  # type: ignore[attr-defined]
    return show


def _check_before_daemon(model: str) -> None:
    """With no daemon running, what the daemon would refuse (a missing directory, an unsupported architecture) is
    refused here, before one is started (this imports torch: no cost beside starting a daemon)."""
    # deferred, these two: zmq, psutil and torch, which `keepwarm --help` must not pay
    from keepwarm.daemon.client import DaemonClient
    from keepwarm.formats.model_config import load_model_config  # deferred (above)

    with DaemonClient(_runtime_dir()) as probe:
        if probe.ping(timeout=1.0) is not None:
            return  # a running daemon answers for itself, in one line
    load_model_config(model)


def preload_model(model: str | None, quantization: str = "auto", dtype: str = "auto",
                  memory_budget: str | None = None, device: str = "cpu", tensor_parallel_size: int = 1,
                  pipeline_parallel_size: int = 1, revision: str | None = None,
                  download_dir: str | None = None) -> str:
    """Preload through the daemon (started if needed) with a progress bar on stderr; returns the model path.
    Parallel sizes > 1: one shard arena per (pipeline stage, tensor-parallel rank), built in one pass. A Hugging
    Face id is its snapshot in the local cache (worker/default_model.py)."""
    # deferred: the client's zmq and psutil, which `keepwarm --help` must not pay
    from keepwarm.daemon.client import DaemonError, ensure_daemon

    model = str(default_model()) if model is None else resolve_model(model, revision, download_dir)
    model = str(Path(model).absolute()) if Path(model).exists() else model
    _check_before_daemon(model)
    client, started = ensure_daemon(memory_budget=memory_budget, device=device)
    if started:
        typer.echo(f"started the keepwarm daemon ({client.socket_path})", err=True)
    show = _progress_printer()
    t0 = time.perf_counter()
    try:
        reply = client.preload(model, quantization, dtype, on_event=show, tp_size=tensor_parallel_size,
                               pp_size=pipeline_parallel_size)
    except DaemonError:
        if started:  # started for this preload only: nothing is left running after a refusal
            show.finish()  # the progress line ends before this one
            client.shutdown()
            typer.echo(f"stopped the keepwarm daemon this command started ({client.socket_path})", err=True)
        raise
    finally:
        show.finish()
        client.close()
    secs = time.perf_counter() - t0
    how = "already resident" if reply.cached else f"loaded in {secs:.2f}s"
    if not reply.cached and reply.load_seconds > 0:  # the daemon's own time for reading and packing the source
        how += (f" (read {reply.source_bytes / 1e9:.3f} GB of checkpoint at "
                f"{reply.source_bytes / reply.load_seconds / 1e9:.2f} GB/s)")
    if reply.shards:
        sizes = " + ".join(f"{x['bytes'] / 1e6:.1f}" for x in reply.shards)
        split = describe_sizes(reply.tp_size, reply.pp_size)
        typer.echo(f"{reply.name}: {how}; {split} ({len(reply.shards)} arenas) of {sizes} MB, "
                   f"{reply.quantization}, {reply.dtype}, fingerprint {reply.source_fingerprint[:16]}", err=True)
        return model
    typer.echo(f"{reply.name}: {how}; {reply.bytes / 1e6:.1f} MB, {reply.quantization}, "
               f"{reply.dtype}, fingerprint {reply.fingerprint[:16]}", err=True)
    return model


def register(app: typer.Typer) -> None:
    app.add_typer(daemon_app, name="daemon")

    @app.command()
    def preload(
        model: Annotated[str | None, typer.Argument(help="Model directory, .gguf file or Hugging Face id in the local "
                                                         "cache (default: bundled SmolLM2).")] = None,
        quantization: Annotated[str, typer.Option(
            "--quantization", "-q", help="auto (the checkpoint's own), none, int8, fp8, int4, int4-g64, int4-g32.")
        ] = "auto",
        revision: Annotated[str | None, typer.Option(help="A Hugging Face id's revision in the cache.")] = None,
        download_dir: Annotated[str | None, typer.Option("--download-dir", help="The Hugging Face cache to look "
                                                                                "in.")] = None,
        dtype: Annotated[str, typer.Option(help="auto (the checkpoint's), bfloat16, float16, float32.")] = "auto",
        memory_budget: Annotated[str | None, typer.Option("--memory-budget",
                                                          help="For a daemon started now.")] = None,
        device: Annotated[str, typer.Option(help="Device of a daemon started now.")] = "cpu",
        tensor_parallel_size: Annotated[int, typer.Option(
            "--tensor-parallel-size", "-tp", min=1,
            help="Keep one shard per tensor-parallel rank (what `serve --tensor-parallel-size` attaches).")] = 1,
        pipeline_parallel_size: Annotated[int, typer.Option(
            "--pipeline-parallel-size", "-pp", min=1,
            help="Keep one arena per pipeline stage (times the tensor-parallel size).")] = 1,
    ) -> None:
        """Make MODEL resident in the daemon (starting a daemon if none answers); returns when it is."""
        # deferred, these two: zmq, psutil and torch, which `keepwarm --help` must not pay
        from keepwarm.daemon.client import DaemonError
        from keepwarm.formats.model_config import ModelConfigError  # deferred (above)

        try:
            preload_model(model, quantization, dtype, memory_budget, device, tensor_parallel_size,
                          pipeline_parallel_size, revision, download_dir)
        except DaemonError as e:
            fail(e.message)
        except (ModelConfigError, FileNotFoundError) as e:
            fail(str(e))

    @app.command()
    def status(json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
        """The daemon's pid, socket, memory budget, resident models and leases. Exit 1 when no daemon answers."""
        # deferred: the client's zmq and psutil, which `keepwarm --help` must not pay
        from keepwarm.daemon.client import DaemonClient

        with DaemonClient(_runtime_dir()) as client:
            st = client.ping(timeout=3.0)
        if st is None:
            if json_out:
                typer.echo(json.dumps({"running": False, "socket": str(client.socket_path)}))
                raise typer.Exit(1)
            fail(f"no keepwarm daemon answers at {client.socket_path}")
            return
        st = {k: v for k, v in st.items() if k not in ("v", "id", "ok")}
        if json_out:
            typer.echo(json.dumps({"running": True, **st}, indent=2))
            return
        budget = "none" if st["memory_budget"] is None else f"{st['memory_budget'] / 1e9:.2f} GB"
        typer.echo(f"daemon pid {st['pid']} (keepwarm {st['version']}), socket {st['socket']}, device {st['device']}")
        typer.echo(f"memory: {st['resident_bytes'] / 1e9:.3f} GB resident, budget {budget}; "
                   f"arenas in {st['arena_dir']}")
        if not st["models"]:
            typer.echo("no resident models")
        for m in st["models"]:
            pids = ", ".join(str(x["pid"]) for x in m["leases"]) or "none"
            shard = ""
            if m.get("source_fingerprint"):
                stage = f"pipeline stage {m['pp_stage']}/{m['pp_size']} " if m.get("pp_size", 1) > 1 else ""
                rank = f"tensor-parallel shard {m['tp_rank']}/{m['tp_size']} " if m["tp_size"] > 1 else ""
                shard = f"  {stage}{rank}of {m['source_fingerprint'][:16]}"
            typer.echo(f"  {m['name']}  {m['bytes'] / 1e6:.1f} MB  {m['quantization']}/{m['dtype']}  "
                       f"fingerprint {m['fingerprint'][:16]}{shard}  {m['origin']}  leases: {len(m['leases'])} "
                       f"(pids {pids})")
            typer.echo(f"    {m['model']}")
        for j in st.get("loading", []):
            typer.echo(f"  loading {j['model']} ({j['quantization']}): {j['bytes_done'] / 1e6:.0f}/"
                       f"{j['bytes_total'] / 1e6:.0f} MB")

    @app.command()
    def evict(
        model: Annotated[str, typer.Argument(help="Model path, directory name or fingerprint prefix.")],
        force: Annotated[bool, typer.Option("--force", help="Evict even with live leases.")] = False,
    ) -> None:
        """Drop a resident model from the daemon."""
        # deferred: the client's zmq and psutil, which `keepwarm --help` must not pay
        from keepwarm.daemon.client import DaemonClient, DaemonError

        with DaemonClient(_runtime_dir()) as client:
            try:
                reply = client.evict(model, force=force)
            except DaemonError as e:
                fail(e.message)
                return
        typer.echo(f"evicted {', '.join(fp[:16] for fp in reply['evicted'])}")
