"""`keepwarm snapshot create|restore|add-platform|list|show|diff|verify|delete|gc|export|import|push|pull`
(docs/snapshots.md)."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from keepwarm.cli.errors import fail
from keepwarm.snapshot.archive import export as do_export
from keepwarm.snapshot.archive import import_archive
from keepwarm.snapshot.inspect import diff as do_diff
from keepwarm.snapshot.inspect import diff_text, list_rows, list_text, mb, show_text
from keepwarm.snapshot.manifest import SnapshotError
from keepwarm.snapshot.store import Store
from keepwarm.snapshot.verify import verify as verify_snapshot

snapshot_app = typer.Typer(help="Capture, restore and move known-good states (model image, adapters, config).",
                           no_args_is_help=True)


def _say(message: str) -> None:
    """Progress: on stdout, so that stderr holds nothing but the one-line error of a failure."""
    typer.echo(message)


def _store():
    return Store()


def _quiet_http_logs() -> None:
    """httpx logs every request at INFO: push / pull / create would print one line per blob. Below --log-level
    debug they are kept to warnings."""
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _guard(fn):
    """Run ``fn``; a SnapshotError (or a daemon / OS error) becomes one line on stderr and exit status 1."""
    # deferred, these two: httpx (~80 ms) and the daemon client's zmq and psutil, which `keepwarm --help` must not pay
    import httpx

    from keepwarm.daemon.client import DaemonError  # deferred (above)

    _quiet_http_logs()
    try:
        return fn()
    except SnapshotError as e:
        fail(str(e))
    except httpx.HTTPError as e:  # a registry connection that broke where push/pull do not retry
        fail(f"registry connection failed: {type(e).__name__}: {e}")
    except DaemonError as e:
        fail(e.message)
    except OSError as e:
        fail(f"{e.strerror or e}: {e.filename}" if getattr(e, "filename", None) else str(e))
    except ValueError as e:  # a config or arena manifest that does not parse
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


def _write_textfile(write) -> None:
    """Run ``write(textfile module)``; a metrics file that cannot be written is a warning, never a failed command."""
    from keepwarm.snapshot import textfile  # deferred: prometheus_client (~45 ms), which `keepwarm --help` must not pay

    try:
        write(textfile)
    except OSError as e:
        logging.getLogger("keepwarm.snapshot").warning("could not write %s: %s", textfile.textfile_path(),
                                                       e.strerror or e)


@contextlib.contextmanager
def _recorded(op: str):
    """The run, recorded for node_exporter's textfile collector (keepwarm.snapshot.textfile): the command calls
    the yielded function with (snapshot name, seconds, bytes moved) once it succeeded; a run that fails (exits
    non-zero, or raises) counts as a failure."""
    done: list[tuple[str, float, int]] = []
    try:
        yield lambda name, seconds, nbytes: done.append((name, seconds, nbytes))
    except typer.Exit as e:
        if e.exit_code:
            _write_textfile(lambda t: t.record_failure(op))
        raise
    except BaseException:
        _write_textfile(lambda t: t.record_failure(op))
        raise
    if done:
        _write_textfile(lambda t: t.record_success(op, *done[0]))


@snapshot_app.command()
def create(
    name: Annotated[str, typer.Argument(help="Snapshot name (letters, digits, . _ -).")],
    server: Annotated[str | None, typer.Option("--server", help="The running server to capture "
                                               "(default http://127.0.0.1:8000).")] = None,
    from_config: Annotated[str | None, typer.Option("--from-config", help="Capture a server.toml instead of a "
                                                    "live server (the model must be resident, or --preload).")
                           ] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="KEEPWARM_API_KEY",
                                                help="The server's API key, if it needs one.")] = None,
    preload: Annotated[bool, typer.Option("--preload", help="Preload the model into the daemon when it is not "
                                          "resident (reads and quantizes it once, now).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace a snapshot of the same name.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
) -> None:
    """Capture the live state: the daemon's packed arena image, model files, adapters, the effective config."""
    from keepwarm.snapshot.create import create as do_create  # deferred: torch (~1.2 s), for this command alone

    if server and from_config:
        fail("--server and --from-config exclude each other")
    with _recorded("create") as record:
        r = _guard(lambda: do_create(name, server=server, config_path=from_config, api_key=api_key,
                                     preload=preload, force=force, say=(lambda _: None) if json_out else _say))
        record(name, r.seconds, r.new_bytes)
    if json_out:
        typer.echo(json.dumps(r.manifest, indent=1, sort_keys=True))
        return
    m = r.manifest
    mod = m["models"][0]
    typer.echo(f"snapshot {name}: {mod['name']} ({mod['quantization']}/{mod['dtype']}, fingerprint "
               f"{mod['fingerprint'][:16]}), {len(m['adapters'])} adapter(s), {len(m['server_config'])} config keys; "
               f"{mb(r.total_bytes)} in blobs, {mb(r.new_bytes)} new; {r.seconds:.2f}s")


@snapshot_app.command()
def restore(
    name: Annotated[str, typer.Argument()],
    restart_server: Annotated[bool, typer.Option("--restart-server", help="Restart the server: a `serve --zygote` "
                                                 "server on the config's port in place (no downtime), else "
                                                 "systemctl restart keepwarm-server.service when that unit "
                                                 "exists.")] = False,
    server_config: Annotated[str | None, typer.Option("--server-config", help="Where to write the server config "
                                                      "(default: the unit's --config, else "
                                                      "$KEEPWARM_HOME/server.toml).")] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="KEEPWARM_API_KEY",
                                                help="API key for the restored config (never stored in "
                                                     "snapshots).")] = None,
    api_key_from_env: Annotated[bool, typer.Option("--api-key-from-env", help="The server gets its key from "
                                                   "KEEPWARM_API_KEY in its environment: write none.")] = False,
) -> None:
    """Verify every blob, load the image into the daemon (no re-quantization), write the config, restart."""
    # deferred: the daemon client's zmq and psutil, which `keepwarm --help` must not pay
    from keepwarm.snapshot.restore import restore as do_restore

    r = _guard(lambda: do_restore(name, server_config=server_config, restart_server=restart_server,
                                  api_key=api_key, api_key_from_env=api_key_from_env, say=_say))
    typer.echo(f"restored {name} in {r.seconds:.2f}s: config written to {r.config_path}")
    if r.restarted:
        typer.echo(f"server restarted ({r.restarted})")
    elif not restart_server:
        typer.echo(f"start (or restart) the server with: {r.command}")


@snapshot_app.command("list")
def list_(json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Snapshots: name, created, the size unique to each (what delete + gc frees), models."""
    rows = _guard(lambda: list_rows(_store()))
    typer.echo(json.dumps(rows, indent=1) if json_out else list_text(rows))


@snapshot_app.command()
def show(name: Annotated[str, typer.Argument()], json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """One snapshot's manifest."""
    m = _guard(lambda: _store().load(name))
    typer.echo(json.dumps(m, indent=1, sort_keys=True) if json_out else show_text(m))


@snapshot_app.command()
def diff(a: Annotated[str, typer.Argument()], b: Annotated[str, typer.Argument()],
         json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """What differs between two snapshots: config keys, model fingerprints, quantization, adapters."""
    store = _store()
    changes = _guard(lambda: do_diff(store.load(a), store.load(b)))
    typer.echo(json.dumps(changes, indent=1) if json_out else diff_text(a, b, changes))


@snapshot_app.command()
def verify(name: Annotated[str, typer.Argument()]) -> None:
    """Re-hash every blob of the snapshot and check each arena layer (portable, per platform) against its manifest."""
    n, nbytes, secs = _guard(lambda: verify_snapshot(_store(), name))
    typer.echo(f"{name}: ok, {n} blobs ({mb(nbytes)}) verified in {secs:.2f}s")


@snapshot_app.command("add-platform")
def add_platform(name: Annotated[str, typer.Argument()]) -> None:
    """Add this machine's image to a snapshot, built by the daemon from the snapshot's portable layer (re-pack
    only), so a restore on a machine of this platform loads it as it is."""
    # deferred: the daemon client's zmq and psutil, which `keepwarm --help` must not pay
    from keepwarm.snapshot.platforms import add_platform as do_add

    r = _guard(lambda: do_add(name, store=_store(), say=_say))
    if r.added:
        typer.echo(f"{name}: added the {r.platform['name']} image (key {r.platform['key']}), {mb(r.new_bytes)} new; "
                   f"{r.seconds:.2f}s")


@snapshot_app.command()
def delete(name: Annotated[str, typer.Argument()]) -> None:
    """Remove a snapshot's manifest (its blobs go at the next gc unless another snapshot names them)."""
    store = _store()

    def run():
        ms, _ = store.readable_manifests()  # an unreadable manifest can still be deleted
        unique = store.unique_sizes(ms).get(name, 0)
        store.delete(name)
        return unique

    unique = _guard(run)
    typer.echo(f"deleted {name}; `keepwarm snapshot gc` frees {mb(unique)}")


@snapshot_app.command()
def gc() -> None:
    """Remove blobs no snapshot names."""
    removed, freed = _guard(lambda: _store().gc())
    typer.echo(f"removed {removed} blob(s), {mb(freed)} freed")


@snapshot_app.command("export")
def export_(
    name: Annotated[str, typer.Argument()],
    output: Annotated[Path, typer.Option("-o", "--output", help="The tar file to write.")],
    zstd: Annotated[bool, typer.Option("--zstd", help="Compress with zstd.")] = False,
) -> None:
    """Write the snapshot (manifest + blobs) to one tar file."""
    with _recorded("export") as record:
        t0 = time.perf_counter()
        size = _guard(lambda: do_export(_store(), name, output, zstd=zstd))
        seconds = time.perf_counter() - t0
        record(name, seconds, size)
    typer.echo(f"exported {name} to {output} ({mb(size)}) in {seconds:.2f}s")


@snapshot_app.command("import")
def import_(
    archive: Annotated[Path, typer.Argument(help="A tar (or tar.zst) written by `keepwarm snapshot export`.")],
    name: Annotated[str | None, typer.Option("--name", help="Import under another name.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a different snapshot of the same name.")] = False,
) -> None:
    """Check every digest of an exported snapshot, then add it to the store (nothing lands outside the store)."""
    with _recorded("import") as record:
        t0 = time.perf_counter()
        r = _guard(lambda: import_archive(_store(), archive, rename=name, force=force))
        seconds = time.perf_counter() - t0
        record(r.name, seconds, r.new_bytes)
    if r.already_present:
        typer.echo(f"{r.name}: already in the store")
    else:
        typer.echo(f"imported {r.name}: {r.blobs} blobs, {r.new_blobs} new ({mb(r.new_bytes)})")


def _registry(reference: str, insecure: bool, username: str | None, password_stdin: bool, chunk_size: int):
    """The registry client for a REF, with credentials from --username/--password-stdin or the docker config."""
    from keepwarm.snapshot.oci import Credentials, Reference, Registry  # deferred: httpx (~80 ms), for push and pull

    def make():
        if password_stdin and not username:
            raise SnapshotError("--password-stdin needs --username")
        creds = None
        if username:
            if not password_stdin:
                raise SnapshotError("--username needs --password-stdin (a password is never taken as an argument)")
            creds = Credentials(username, sys.stdin.readline().rstrip("\r\n"))
        return Registry(Reference.parse(reference), insecure=insecure, credentials=creds, chunk_size=chunk_size,
                        say=_say)

    return _guard(make)


_Insecure = Annotated[bool, typer.Option("--insecure", help="Plain HTTP (no TLS) to the registry.")]
_Username = Annotated[str | None, typer.Option("--username", help="Registry user (with --password-stdin); "
                                               "default: the docker config's credentials.")]
_PasswordStdin = Annotated[bool, typer.Option("--password-stdin", help="Read the registry password from stdin.")]


@snapshot_app.command()
def push(
    name: Annotated[str, typer.Argument(help="The snapshot to push.")],
    reference: Annotated[str, typer.Argument(help="REGISTRY/REPOSITORY:TAG")],
    insecure: _Insecure = False,
    username: _Username = None,
    password_stdin: _PasswordStdin = False,
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="Upload chunk in bytes (PATCH); a broken "
                                            "chunk resumes.")] = 64 << 20,
) -> None:
    """Push a snapshot to an OCI registry (an OCI artifact; blobs the registry has are not uploaded again)."""
    from keepwarm.snapshot.oci import push as do_push  # deferred: httpx (~80 ms), for push alone

    with _recorded("push") as record:
        reg = _registry(reference, insecure, username, password_stdin, chunk_size)
        with reg:
            r = _guard(lambda: do_push(_store(), name, reg))
        record(name, r.seconds, r.uploaded_bytes)
    rate = r.uploaded_bytes / 1e6 / r.seconds if r.seconds > 0 else 0.0
    what = (f"an OCI index: the portable layer + {len(r.platforms)} platform image(s) ({', '.join(r.platforms)}), "
            if r.platforms else "")
    typer.echo(f"pushed {name} to {r.reference} ({r.manifest_digest}): {what}{r.blobs} blobs ({mb(r.total_bytes)}), "
               f"{r.uploaded} uploaded ({mb(r.uploaded_bytes)}, {rate:.0f} MB/s), {r.blobs - r.uploaded} already "
               f"there; {r.seconds:.2f}s")


@snapshot_app.command()
def pull(
    reference: Annotated[str, typer.Argument(help="REGISTRY/REPOSITORY:TAG")],
    name: Annotated[str | None, typer.Option("--name", help="Store it under another name.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a different snapshot of the same name.")] = False,
    insecure: _Insecure = False,
    username: _Username = None,
    password_stdin: _PasswordStdin = False,
) -> None:
    """Pull a snapshot from an OCI registry: of an index, the portable layer and this machine's platform image (if it
    has one); blobs the store has are skipped, every other one is verified before anything lands."""
    from keepwarm.snapshot.oci import pull as do_pull  # deferred: httpx (~80 ms), for pull alone
    from keepwarm.snapshot.oci import this_platform_key  # deferred (above); it asks the daemon (or torch) for an index

    with _recorded("pull") as record:
        reg = _registry(reference, insecure, username, password_stdin, 64 << 20)
        with reg:
            r = _guard(lambda: do_pull(_store(), reg, rename=name, force=force, platform_key=this_platform_key))
        record(r.imported.name, r.seconds, r.downloaded_bytes)
    i = r.imported
    rate = r.downloaded_bytes / 1e6 / r.seconds if r.seconds > 0 else 0.0
    state = "already in the store" if i.already_present else "pulled"
    what = ""
    if r.platform is not None:
        what = f"the portable layer and the {r.platform['name']} image (platform {r.platform['key']}), "
    elif r.index:
        what = (f"the portable layer only (no image for this machine's platform {r.platform_key}: a restore builds "
                "it from the portable layer), ")
    typer.echo(f"{state} {i.name} from {reference}: {what}{i.blobs} blobs, {i.new_blobs} downloaded "
               f"({mb(r.downloaded_bytes)}, {rate:.0f} MB/s), {r.skipped} already here; {r.seconds:.2f}s")


def register(app: typer.Typer) -> None:
    app.add_typer(snapshot_app, name="snapshot")
