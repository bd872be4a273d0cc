"""``keepwarm snapshot restore``: bring the daemon and the server config back to a snapshot's state.

Rules, in order, so that a failure at any step leaves the previous state in place (docs/snapshots.md, "restore"):
1. re-hash every blob but the arena image before touching anything; the daemon checks the image as it copies it
   (every tensor byte against the arena digest, every byte between tensors for zero), or this module by its sha256
   when the daemon already holds that model and does not read it;
2. check up front what can be: the daemon's device kind against the image's, the server config and its API key,
   the systemd unit's config path;
3. stage the model files and write the adapters' content-addressed directories;
4. ``load_image`` each model (no re-quantization; one resident with the same fingerprint is kept), then the adapters;
5. commit: the model files to ``restored/<fingerprint>/``, the config atomically (the previous as ``<config>.prev``);
6. with ``--restart-server``, restart the server in place (a ``serve --zygote`` on the config's port, else systemd),
   or print the command that starts it.
If 3-5 fail, what this restore added is removed again and the config is not written; nothing resident before is
evicted, and a load the daemon refuses leaves nothing in it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keepwarm.daemon.client import DaemonClient, DaemonError, ensure_daemon
from keepwarm.formats import paths
from keepwarm.formats.paths import keepwarm_home
from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.manifest import SnapshotError
from keepwarm.snapshot.store import Store, fsync_dir, hash_file
from keepwarm.worker.default_model import DEFAULT_MODEL_NAME
from keepwarm.worker.process import ipc
from keepwarm.worker.process.config import ConfigError, ServerConfig, build_config, to_toml

UNIT = "keepwarm-server.service"
# Keys restore rewrites in the server config: they name this machine's paths (or the daemon restored into).
REWRITTEN_KEYS = ("model", "fingerprint", "lora_modules", "tokenizer", "runtime_dir", "served_model_name", "daemon",
                  "api_key")

Say = Callable[[str], None]


@dataclass
class RestoreResult:
    name: str
    config_path: Path
    config: dict[str, Any]
    command: str
    model_dirs: list[Path]
    images_loaded: list[str] = field(default_factory=list)  # fingerprints loaded now (not resident before)
    restarted: str | None = None  # how the server was restarted, if it was
    verify_seconds: float = 0.0
    load_seconds: float = 0.0
    seconds: float = 0.0


def restored_root() -> Path:
    return keepwarm_home() / "restored"


def default_config_path() -> Path:
    return keepwarm_home() / "server.toml"


# -- systemd -----------------------------------------------------------------------------------------------------------
def systemd_unit() -> dict[str, Any] | None:
    """The keepwarm-server.service unit if systemd knows it: {scope, active, config (its --config path)}."""
    if not shutil.which("systemctl"):
        return None
    for scope in ([], ["--user"]):
        try:
            r = subprocess.run(["systemctl", *scope, "show", UNIT, "-p", "LoadState", "-p", "ActiveState", "-p",
                                "ExecStart"], capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode != 0:
            continue
        props = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
        if props.get("LoadState") == "loaded":
            m = re.search(r"--config[= ]([^\s;]+)", props.get("ExecStart", ""))
            return {"scope": scope, "active": props.get("ActiveState", ""), "config": m.group(1) if m else None}
    return None


def restart_supervised(port: int, rt: Path, config: Path, say: Say) -> str:
    """Restart the `serve --zygote` server on ``port`` onto ``config`` alone (its own flags dropped but where it
    listens: they would override the restored config), with no downtime; how it went, or SnapshotError."""
    try:
        reply = ipc.request_restart(port, ipc.RestartRequest(config_file=str(config), replace_flags=True), rt)
    except (ConnectionError, OSError) as e:
        raise SnapshotError(f"restored, and the config is written to {config}, but the server on port {port} was not "
                            f"restarted: {e}") from None
    if not reply.ok:
        raise SnapshotError(f"restored, and the config is written to {config}, but the server on port {port} did not "
                            f"restart (it still serves what it did): {reply.message}")
    if reply.mode == "cold":
        say(f"warning: the server on port {port} had no warm zygote: this restart was a cold start")
    return f"the serve --zygote server on port {port}, in place: {reply.message}"


def restart_unit(unit: dict[str, Any]) -> None:
    r = subprocess.run(["systemctl", *unit["scope"], "restart", UNIT], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        msg = (r.stderr or r.stdout).strip().splitlines()
        raise SnapshotError(f"systemctl restart {UNIT} failed: {msg[-1] if msg else f'exit {r.returncode}'}")


# -- files -------------------------------------------------------------------------------------------------------------
def _write_files(store: Store, directory: Path, files: dict[str, dict[str, Any]]) -> None:
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    for fname, b in files.items():
        dest = directory / fname
        shutil.copyfile(store.blob_path(b["digest"]), dest)
        os.chmod(dest, 0o644)
        fd = os.open(dest, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(directory)


def _dir_matches(directory: Path, files: dict[str, dict[str, Any]]) -> bool:
    if not directory.is_dir():
        return False
    present = {p.name for p in directory.iterdir()}
    if present != set(files):
        return False
    return all(hash_file(directory / f) == (b["digest"], b["size"]) for f, b in files.items())


def _swap_in(staged: Path, final: Path) -> None:
    """Replace ``final`` by ``staged`` (both directories on one file system)."""
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{secrets.token_hex(4)}")
        os.replace(final, old)
    os.replace(staged, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _existing_api_key(path: Path) -> str | None:
    try:
        value = tomllib.loads(path.read_text()).get("api_key")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return value if isinstance(value, str) else None


# -- the config --------------------------------------------------------------------------------------------------------
def build_server_config(m: dict[str, Any], model_dir: Path, adapter_dirs: dict[str, Path], runtime_dir: Path | None,
                        api_key: str | None) -> dict[str, Any]:
    """The snapshot's config with this machine's paths (see REWRITTEN_KEYS), validated."""
    model = m["models"][0]
    cfg = dict(m["server_config"])
    cfg.pop("api_key", None)
    # Clients keep the names they used: the served name was the model path (or the bundled model's name).
    cfg["served_model_name"] = cfg.get("served_model_name") or [cfg.get("model") or DEFAULT_MODEL_NAME]
    cfg["model"] = str(model_dir)
    cfg["fingerprint"] = model["fingerprint"]
    cfg["daemon"] = True  # the weights are the daemon's now: the restored directory holds none
    if model.get("tokenizer_files"):
        cfg["tokenizer"] = str(model_dir / "tokenizer")
    else:
        cfg.pop("tokenizer", None)
    if m["adapters"]:
        cfg["enable_lora"] = True
    cfg["lora_modules"] = [f"{a['name']}={adapter_dirs[a['digest']]}" for a in m["adapters"]]
    if runtime_dir is not None:
        cfg["runtime_dir"] = str(runtime_dir)
    else:
        cfg.pop("runtime_dir", None)
    if api_key:
        cfg["api_key"] = api_key
    try:
        return build_config(cfg, {}).to_dict()
    except ConfigError as e:
        raise SnapshotError(f"the snapshot's server config is not valid here: {e}") from None


# -- restore -----------------------------------------------------------------------------------------------------------
def restore(name: str, *, store: Store | None = None, server_config: str | None = None, restart_server: bool = False,
            api_key: str | None = None, api_key_from_env: bool = False, say: Say = lambda s: None) -> RestoreResult:
    t0 = time.perf_counter()
    store = store or Store()
    with store.lock():
        m = store.load(name)
        # 1. every blob, before anything else; the arena image (or portable layer) is checked by the daemon as it
        # loads it (one pass), or here if the daemon turns out to hold that model already (step 4); the layers this
        # restore does not load are not read (`snapshot verify` checks every one)
        layers = frozenset(layer["image"]["digest"] for mod in m["models"] for img in mf.images(mod)
                           for _, layer in mf.arena_layers(img))
        n, nbytes = store.verify(m, skip=layers)
        verify_seconds = time.perf_counter() - t0
        say(f"verified {n} blobs ({nbytes / 1e6:.1f} MB) in {verify_seconds:.2f}s; the arena image is checked "
            "as the daemon loads it")
        rt = paths.runtime_dir()
        client = _daemon_for(rt, m["models"][0], say)
        try:  # 0. what to load: this platform's image, else the portable layer
            model, picks = _arena_manifests(store, name, m, client.status().get("platform"))
        except BaseException:
            client.close()
            raise

        # 2. up-front checks: the server config's target, the API key, the daemon's device
        unit, target = _config_target(server_config, restart_server)
        key = api_key or _existing_api_key(target)
        if m["source"].get("api_key_required") and not key and not api_key_from_env:
            raise SnapshotError("the snapshot's server required an API key, which snapshots never store: pass "
                                "--api-key (or KEEPWARM_API_KEY), keep api_key in the existing server config, or "
                                "pass --api-key-from-env if the server gets KEEPWARM_API_KEY from its environment")
        root = restored_root()
        model_dir = root / model["fingerprint"]
        adapter_dirs = {a["digest"]: root / "adapters" / a["digest"] for a in m["adapters"]}
        explicit_rt = bool(m["server_config"].get("runtime_dir")) or bool(os.environ.get("KEEPWARM_RUNTIME_DIR"))
        cfg = build_server_config(m, model_dir, adapter_dirs, rt if explicit_rt else None, key)
        config_text = to_toml(ServerConfig(**cfg))

        created: list[Path] = []  # to remove on failure
        loaded_images: list[str] = []
        loaded_adapters: list[str] = []
        try:
            # 3. files
            staged = _stage_files(store, root, m, adapter_dirs, created)
            # 4. the daemon
            load_seconds = _load_into_daemon(client, store, m, picks, adapter_dirs, loaded_images,
                                             loaded_adapters, say)
            # 5. commit
            if not model.get("tokenizer_files") and _dir_matches(model_dir, model["files"]):
                shutil.rmtree(staged, ignore_errors=True)
            else:
                _swap_in(staged, model_dir)
            created.remove(staged)
            _write_config(store, target, config_text, private=bool(key))
        except BaseException as e:
            _undo(client, loaded_images, loaded_adapters, created)
            client.close()
            if isinstance(e, OSError):
                raise SnapshotError(f"restore failed, nothing changed: {e}") from None
            raise
        client.close()

    command = f"keepwarm serve --config {shlex.quote(str(target))}"
    result = RestoreResult(name, target, cfg, command, [model_dir], loaded_images, None, verify_seconds,
                           load_seconds)
    # 6. the server
    if restart_server:
        port = cfg.get("port", ServerConfig.port)
        if ipc.control_path(port, rt).exists():
            result.restarted = restart_supervised(port, rt, target, say)
        elif unit is not None:
            restart_unit(unit)
            result.restarted = f"systemctl {' '.join(unit['scope'] + ['restart', UNIT])}"
        else:
            say(f"no {UNIT} unit here; start the server with: {command}")
    result.seconds = time.perf_counter() - t0
    return result


@dataclass(frozen=True)
class Pick:
    """What restore loads for one arena: a platform ``image`` (``layer``: its blob refs) or the ``portable``
    layer, with the arena manifest (JSON) and, for an image of a layered snapshot, the portable layer to fall back
    to if the daemon finds the image's layouts are not its own."""

    how: str  # "image" | "portable"
    layer: dict[str, Any]
    arena_json: str
    platform: str  # the image's platform name ("" for a single-image snapshot or the portable layer)
    fallback: Pick | None = None


def _arena_manifests(store: Store, name: str, m: dict[str, Any], platform: dict[str, Any] | None,
                     ) -> tuple[dict[str, Any], list[Pick]]:
    """The snapshot's one model entry and, per arena (one, or a shard per (stage, rank)), what to load on the
    daemon's ``platform``: the image made for its key, else the portable layer (a single-image snapshot: its image)."""
    if len(m["models"]) != 1:
        raise SnapshotError(f"snapshot {name} holds {len(m['models'])} models; this keepwarm restores one")
    model = m["models"][0]
    key = (platform or {}).get("key")
    picks = []
    for img in mf.images(model):
        portable = None
        if mf.layered(img):
            portable = Pick("portable", img["portable"], _arena_json(store, name, model, img, img["portable"], True),
                            "")
        match = next((p for p in mf.platform_images(img) if p["platform"] is None or p["platform"]["key"] == key),
                     None)
        if match is None:
            assert portable is not None  # a single-image snapshot's one image has no platform: it always matches
            picks.append(portable)
            continue
        label = match["platform"]["name"] if match["platform"] else ""
        picks.append(Pick("image", match, _arena_json(store, name, model, img, match, False), label, portable))
    return model, picks


def _arena_json(store: Store, name: str, model: dict[str, Any], img: dict[str, Any], layer: dict[str, Any],
                portable: bool) -> str:
    """A layer's arena manifest (JSON), after checking it agrees with the model entry."""
    arena_json = store.read_blob(layer["image_manifest"]["digest"]).decode()
    try:  # only what must match here; the daemon parses and checks the whole manifest (this needs no torch)
        arena = json.loads(arena_json)
        arena_ids = (arena["fingerprint"], arena["arena_digest"], arena.get("source_fingerprint") or
                     arena["fingerprint"], arena.get("tp_rank", 0), arena.get("tp_size", 1),
                     arena.get("pp_stage", 0), arena.get("pp_size", 1), arena["device"] == "portable")
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotError(f"the arena manifest of {model['name']} does not parse: {e}") from None
    if arena_ids != (img["fingerprint"], layer["arena_digest"], model["fingerprint"], img.get("tp_rank", 0),
                     model.get("tensor_parallel_size", 1), img.get("pp_stage", 0),
                     model.get("pipeline_parallel_size", 1), portable):
        raise SnapshotError(f"snapshot {name}: its {'portable ' if portable else ''}arena manifest does not match the "
                            "model entry (fingerprint, arena_digest, tensor-parallel rank or device differ)")
    return arena_json


def _config_target(server_config: str | None, restart_server: bool) -> tuple[dict[str, Any] | None, Path]:
    """(the server's systemd unit if it is to be restarted, the server config file to write)."""
    unit = systemd_unit() if restart_server else None
    if unit is not None and not unit["config"]:
        raise SnapshotError(f"{UNIT} starts the server without --config, so it would not read a restored "
                            "config; add --config PATH to its ExecStart (see systemd/README.md)")
    if server_config is not None:
        target = Path(server_config).absolute()
        if unit and unit["config"] and Path(unit["config"]).absolute() != target:
            raise SnapshotError(f"{UNIT} reads {unit['config']}, not {target}; pass --server-config "
                                f"{unit['config']} (or leave it out)")
    elif unit and unit["config"]:
        target = Path(unit["config"])
    else:
        target = default_config_path()
    return unit, target


def _daemon_for(rt: Path, model: dict[str, Any], say: Say) -> Any:
    """A client to the daemon at ``rt`` (started if none answers, on the snapshot's device kind). A snapshot with a
    portable layer restores on a daemon of either kind; a single-image one needs the image's kind."""
    kind = "cpu" if model["device"] == "cpu" else "cuda"
    layered = all(mf.layered(img) for img in mf.images(model))
    client = DaemonClient(rt, timeout=30.0)
    if client.ping(timeout=2.0) is None:
        client.close()
        try:
            client, _ = ensure_daemon(rt, device=kind)
        except DaemonError as e:
            if not layered or kind == "cpu":
                raise SnapshotError(f"no daemon answers at {paths.socket_path(rt)} and starting one failed: "
                                    f"{e.message}") from None
            say(f"no {kind} daemon could start ({e.message}); restoring on a cpu daemon from the portable layer")
            try:
                client, _ = ensure_daemon(rt, device="cpu")
            except DaemonError as e2:
                raise SnapshotError(f"no daemon answers at {paths.socket_path(rt)} and starting one failed: "
                                    f"{e2.message}") from None
        say(f"started a keepwarm daemon ({client.socket_path})")
    status = client.status()
    if not layered and status["device"].split(":", 1)[0] != kind:
        client.close()
        raise SnapshotError(f"the snapshot holds a {kind} arena image of {model['name']} ({model['device']}) and no "
                            f"portable layer (made before keepwarm had one); the daemon at {client.socket_path} "
                            f"keeps {status['device']} arenas")
    return client


def _stage_files(store: Store, root: Path, m: dict[str, Any], adapter_dirs: dict[str, Path],
                 created: list[Path]) -> Path:
    """Write the model's files to a staging directory (returned) and each adapter to its final directory; every
    path made is appended to ``created`` (removed if the restore fails)."""
    model = m["models"][0]
    adapter_root = root / "adapters"
    if not root.exists():
        created.append(root)  # made by this restore: removed with the rest if it fails
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    staged = root / f".staging-{secrets.token_hex(6)}"
    created.append(staged)
    _write_files(store, staged, model["files"])
    if model.get("tokenizer_files"):
        _write_files(store, staged / "tokenizer", model["tokenizer_files"])
    for a in m["adapters"]:
        final = adapter_dirs[a["digest"]]
        if _dir_matches(final, a["files"]):
            continue
        tmp = adapter_root / f".staging-{secrets.token_hex(6)}"
        created.append(tmp)
        _write_files(store, tmp, a["files"])
        if final.exists():
            _swap_in(tmp, final)  # a damaged earlier copy
        else:
            os.replace(tmp, final)
            created.append(final)
        fsync_dir(adapter_root)
    return staged


def _load_into_daemon(client: Any, store: Store, m: dict[str, Any], picks: list[Pick],
                      adapter_dirs: dict[str, Path], loaded_images: list[str], loaded_adapters: list[str],
                      say: Say) -> float:
    """Load the model's arenas (one, or a shard per tensor-parallel rank) and the adapters into the daemon; what it
    newly loaded is appended to ``loaded_images`` / ``loaded_adapters`` (undone if the restore fails). Returns the
    arenas' load time."""
    model = m["models"][0]
    tl = time.perf_counter()
    cached, paths_taken = True, set()
    for img, pick in zip(mf.images(model), picks, strict=True):
        shard = f", stage {img.get('pp_stage', 0)} rank {img['tp_rank']}" if "tp_rank" in img else ""
        reply, pick = _load_arena(client, store, model, pick, shard, say)
        paths_taken.add(reply.origin if not reply.cached else "resident")
        if not reply.cached:
            loaded_images.append(img["fingerprint"])
            cached = False
        else:  # resident already, so the daemon did not read the layer: a corrupt snapshot is refused all the same
            image = pick.layer["image"]
            store.verify_blob(image["digest"], image["size"], f"model {model['name']}: arena image{shard}")
    load_seconds = time.perf_counter() - tl
    how = {"image": "the image made for this platform loaded", "resident": "already resident, kept as is",
           "portable": "built from the portable layer (re-packed where this machine's layout differs, never "
                       "re-quantized)"}
    say(f"{model['name']}: " + ("already resident, kept as is" if cached else
                                f"{'; '.join(how[p] for p in sorted(paths_taken))} in {load_seconds:.2f}s"))
    for a in m["adapters"]:
        try:
            r = client.load_adapter(adapter_dirs[a["digest"]])
        except DaemonError as e:
            raise SnapshotError(f"the daemon refused adapter {a['name']}: {e.message}") from None
        if not r.cached:  # recorded first: an adapter refused below is unloaded again with the rest
            loaded_adapters.append(r.digest)
        if r.digest != a["digest"]:
            raise SnapshotError(f"adapter {a['name']}: the daemon read digest {r.digest[:16]}, the "
                                f"snapshot says {a['digest'][:16]}")
    return load_seconds


def _load_arena(client: Any, store: Store, model: dict[str, Any], pick: Pick, shard: str, say: Say,
                ) -> tuple[Any, Pick]:
    """Load one arena by ``pick`` (an image whose layouts the daemon refuses falls back to the portable layer, said
    in one line): (the daemon's reply, the pick that loaded)."""
    image = pick.layer["image"]
    what = f"the {pick.platform} image" if pick.how == "image" and pick.platform else (
        "the image" if pick.how == "image" else "the portable layer")
    say(f"loading {what} of {model['name']} ({model['quantization']}/{model['dtype']}, {image['size'] / 1e6:.1f} MB"
        f"{shard}) into the daemon")
    try:
        # no sha256 over the file: the daemon checks every tensor byte against the arena digest and every other
        # byte for zero as it copies, which pins the image to the blob the snapshot names (daemon/image.py)
        return client.load_image(pick.arena_json, store.blob_path(image["digest"]),
                                 portable=pick.how == "portable"), pick
    except DaemonError as e:
        if e.code == "incompatible_image" and pick.fallback is not None:
            say(f"the daemon cannot use {what} as it is ({e.message}); building it from the portable layer")
            return _load_arena(client, store, model, pick.fallback, shard, say)
        raise SnapshotError(f"the daemon cannot hold {what} of {model['name']}{shard}: {e.message}") from None


def _write_config(store: Store, target: Path, text: str, private: bool) -> None:
    if target.is_file():
        old = target.read_text()
        if old == text:
            return
        store.write_atomic(target.with_name(target.name + ".prev"), old.encode(), 0o600)
    store.write_atomic(target, text.encode(), 0o600 if private else 0o644)


def _undo(client, images: list[str], adapters: list[str], created: list[Path]) -> None:
    for fp in images:
        with contextlib.suppress(DaemonError):
            client.evict(fp)
    for digest in adapters:
        with contextlib.suppress(DaemonError):
            client.request("unload_adapter", {"adapter": digest})
    for p in reversed(created):
        shutil.rmtree(p, ignore_errors=True)
