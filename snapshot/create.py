"""``keepwarm snapshot create``: capture the live state (or a config's) into the store.

What is captured, per model the server uses: the daemon's packed arena byte for byte (the image: restore needs no
re-quantization), the daemon's arena manifest, and the model directory's config/tokenizer/chat-template files;
per adapter its two files; the effective server config; and the identity of the machine (see identity.py).

The model must be resident in the daemon: its arena is the image. With ``preload`` a model that is not resident is
preloaded first (read and quantized once, now, rather than at restore). The arena is held under a lease while it
is copied, so the daemon cannot evict it meanwhile, and the copy is checked against the manifest's
``arena_digest`` before the snapshot is recorded.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keepwarm.daemon.client import DaemonClient, DaemonError, ensure_daemon
from keepwarm.formats import paths
from keepwarm.formats.adapter import LoRAError, adapter_digest, read_adapter_dir
from keepwarm.formats.arena import ArenaHasher, ArenaManifest, CpuArenaFile, CudaArena
from keepwarm.formats.layout import Layout
from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.identity import machine_identity
from keepwarm.snapshot.manifest import SnapshotError
from keepwarm.snapshot.store import CHUNK, COPY_DEPTH, BlobRef, Store, file_chunks
from keepwarm.worker.attach import Attachment, LeaseKeeper
from keepwarm.worker.default_model import default_model
from keepwarm.worker.lora import parse_lora_modules
from keepwarm.worker.process.config import ConfigError, build_config, load_toml
from keepwarm.worker.tokenizer import gguf_tokenizer_dir

DEFAULT_SERVER = "http://127.0.0.1:8000"
# The model directory's files a server reads besides the weights: config, tokenizer, generation config, chat
# template. Weight files and shard indexes are never taken (the arena image replaces them).
MODEL_FILE_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
MAX_MODEL_FILE_BYTES = 256 << 20

Say = Callable[[str], None]


@dataclass
class Source:
    """What to capture, from a live server or from a config file."""

    kind: str  # "server" | "config"
    where: str  # URL or config path
    config: dict[str, Any]  # effective config, without the api key
    model_dir: Path
    fingerprint: str | None
    adapters: list[dict[str, Any]]  # {name, path, digest (None from a config), rank}
    api_key_required: bool


@dataclass
class CreateResult:
    manifest: dict[str, Any]
    new_bytes: int
    total_bytes: int
    seconds: float
    image_seconds: float  # copying (or finding) the arena image


def model_files(model_dir: Path) -> list[Path]:
    out = []
    for p in sorted(model_dir.iterdir()):
        name = p.name
        if (not p.is_file() or not name.endswith(MODEL_FILE_SUFFIXES) or name.endswith(".index.json")
                or not mf.FILE_RE.fullmatch(name)):
            continue
        if p.stat().st_size > MAX_MODEL_FILE_BYTES:
            continue
        out.append(p)
    return out


# -- sources -----------------------------------------------------------------------------------------------------------
def from_server(url: str, api_key: str | None) -> Source:
    import httpx  # deferred: only a --server source needs it (~80 ms)

    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url}/keepwarm/config", headers=headers, timeout=10)
        probe = httpx.get(f"{url}/v1/models", timeout=10)
    except httpx.HTTPError as e:
        raise SnapshotError(f"no keepwarm server answers at {url} ({type(e).__name__}); start it, pass "
                            "--server URL, or snapshot a config with --from-config server.toml") from None
    if r.status_code != 200:
        raise SnapshotError(f"{url}/keepwarm/config answered HTTP {r.status_code}: is this a keepwarm server?")
    body = r.json()
    weights = body.get("weights") or {}
    cfg = dict(body["config"])
    cfg.pop("api_key", None)
    return Source("server", url, cfg, Path(body["model_dir"]), weights.get("fingerprint"),
                  list(body.get("adapters") or []), probe.status_code == 401)


def from_config(path: str) -> Source:
    try:
        config = build_config(load_toml(path), {})
    except ConfigError as e:
        raise SnapshotError(str(e)) from None
    model_dir = default_model() if config.model is None else Path(config.model)
    try:
        mods = parse_lora_modules(config.lora_modules) if config.enable_lora else []
    except LoRAError as e:
        raise SnapshotError(str(e)) from None
    cfg = config.to_dict()
    cfg.pop("api_key", None)
    return Source("config", str(Path(path).absolute()), cfg, model_dir.absolute(), config.fingerprint,
                  [{"name": n, "path": p, "digest": None, "rank": None} for n, p in mods], config.api_key is not None)


# -- the arena ---------------------------------------------------------------------------------------------------------
def _cuda_chunks(flat) -> Iterator[memoryview]:
    for off in range(0, flat.numel(), CHUNK):
        yield memoryview(flat[off:off + CHUNK].cpu().numpy())


def capture_arena(store: Store, manifest_json: str, arena: dict[str, Any]) -> tuple[BlobRef, list[str]]:
    """Store the arena's bytes as a blob (or find it stored already), in one pass: each chunk is hashed for the
    blob, written, and fed to the arena digest while it is in cache; a copy that does not match the manifest's
    arena_digest never lands."""
    m = ArenaManifest.from_json(manifest_json)
    layouts = sorted({q.get("layout", "?") for q in m.quant.values()} | ({"dense"} if any(
        t.weight not in m.quant for t in m.tensors) else set()))
    layout_id = json.dumps([[t.weight, t.part, t.offset, t.nbytes, t.dtype] for t in m.tensors]
                           + [m.quant], sort_keys=True)
    if arena["kind"] == "cpu":
        f = open(arena["path"], "rb", buffering=0)  # noqa: SIM115 (open before anything can unlink it)
        size = os.fstat(f.fileno()).st_size
    else:
        f = None
        size = int(arena["size"])
    key = store.arena_key(m.arena_digest, [layout_id], size)
    hasher = ArenaHasher(m.tensors, m.arena_digest_scheme)

    def check() -> None:
        if hasher.hexdigest() != m.arena_digest:
            raise SnapshotError(f"the arena of {m.model_name} read from the daemon does not match its manifest's "
                                "arena_digest; not recorded")

    try:
        found = store.arena_lookup(key, size)
        if found is not None:
            return found, layouts
        # from CUDA (f is None): a new host array per chunk, so any depth
        chunks = file_chunks(f, depth=COPY_DEPTH) if f is not None else _cuda_chunks(CudaArena.import_handle(arena))
        ref = store.put_chunks(chunks, also=hasher.feed, check=check, depth=COPY_DEPTH)
    finally:
        if f is not None:
            f.close()
    store.arena_remember(key, ref)
    return ref, layouts


def capture_portable(store: Store, m: ArenaManifest, arena: dict[str, Any], image: BlobRef) -> dict[str, Any]:
    """The arena's portable layer (keepwarm.weights.portable) as blobs: the image itself where nothing in it is
    machine-specific (one blob serves both), else its portable form written from the arena's bytes, tensor by
    tensor, and landed in the store."""
    # deferred: kernels (oneDNN) come with it
    from keepwarm.weights.portable import machine_specific, portable_chunks, to_portable

    key = store.arena_key(m.arena_digest, ["portable", m.fingerprint], m.total_bytes)
    known = store.layer_lookup(key)
    if known is not None:  # made from this arena before (a config-only second snapshot): not written again
        return known
    if not machine_specific(m):
        pm, ref = to_portable(m, None, None), image
    else:
        if arena["kind"] != "cpu":  # a CUDA arena's layouts are all portable
            raise SnapshotError(f"the {arena['kind']} arena of {m.model_name} has CPU-only layouts")
        src = CpuArenaFile.open_readonly(Path(arena["path"]), m.total_bytes)
        made: list[ArenaManifest] = []
        try:  # hashed and written as the pieces are made, with the store's writeback pacing: one pass
            ref = store.put_chunks(portable_chunks(m, src.flat, made), depth=COPY_DEPTH)
        finally:
            src.close()
        pm = made[0]
    layer = {"image": ref.ref(), "image_manifest": store.put_bytes(pm.to_json().encode()).ref(),
             "arena_digest": pm.arena_digest}
    store.layer_remember(key, layer)
    return layer


def _attach(source: Source, rt: Path | None, preload: bool, say: Say, layout: Layout | None = None):
    """Lease the model (a split ``layout``: that shard) in the daemon: (Attachment without tensors, attach reply,
    daemon status)."""
    cfg = source.config
    quant, dtype = cfg.get("quantization", "auto"), cfg.get("dtype", "auto")
    client = DaemonClient(rt)
    try:
        if client.ping(timeout=2.0) is None:
            if not preload:
                raise SnapshotError(f"no keepwarm daemon answers at {client.socket_path}: a snapshot takes the "
                                    "model's packed arena from the daemon (pass --preload to start one and load it)")
            client.close()
            client, _ = ensure_daemon(rt)
        status = client.status()
        try:
            reply = client.attach(str(source.model_dir), quant, dtype, source.fingerprint, preload=preload,
                                  on_event=lambda ev: None, layout=layout)
        except DaemonError as e:
            fp = f", fingerprint {source.fingerprint[:16]}" if source.fingerprint else ""
            if e.code == "not_resident":
                raise SnapshotError(f"{source.model_dir} ({quant}{fp}) is not resident in the daemon at "
                                    f"{client.socket_path}; its packed arena is what a snapshot keeps: pass "
                                    f"--preload to load it now") from None
            raise SnapshotError(f"the daemon refused {source.model_dir} ({quant}{fp}): {e.message}") from None
    finally:
        client.close()
    manifest = ArenaManifest.from_json(reply.manifest)
    att = Attachment(manifest, {}, reply.lease_id, reply.origin, 0.0, True, storage=None,
                     runtime_dir=rt)
    att.keeper = LeaseKeeper(att, rt, reply.lease_ttl, quant, dtype)
    att.keeper.start()
    return att, reply, status


def _daemon_device(rt: Path | None) -> str:
    """"cpu" or "cuda" for the daemon at ``rt`` ("cpu" when none answers: the daemon ``--preload`` starts)."""
    with DaemonClient(rt) as client:
        st = client.ping(timeout=2.0)
    return "cpu" if st is None else str(st.get("device", "cpu")).split(":", 1)[0]


def _capture(store: Store, source: Source, rt: Path | None, preload: bool, say: Say, layout: Layout):
    """Store one arena (the shard of a split ``layout``) as an image: (its manifest, its model-entry fields, its
    layouts, the daemon's status)."""
    att, reply, status = _attach(source, rt, preload, say, layout)
    try:
        m = ArenaManifest.from_json(reply.manifest)
        shard = "" if layout.whole else f", {layout}"
        say(f"capturing {m.model_name} ({m.quantization}/{m.dtype}, {m.total_bytes / 1e6:.1f} MB arena{shard}, "
            f"fingerprint {m.fingerprint[:16]})")
        image, layouts = capture_arena(store, reply.manifest, reply.arena)
        image_manifest = store.put_bytes(reply.manifest.encode())
        portable = capture_portable(store, m, reply.arena, image)
    finally:
        att.close()
    platform = status.get("platform")
    if not isinstance(platform, dict):
        raise SnapshotError(f"the daemon at {rt or paths.runtime_dir()} does not say its platform (an older keepwarm "
                            "daemon?); restart it")
    entry = {"tp_rank": layout.tp_rank, "pp_stage": layout.pp_stage, "fingerprint": m.fingerprint,
             "arena_bytes": m.total_bytes, "portable": portable,
             "platforms": [{"platform": platform, "image": image.ref(), "image_manifest": image_manifest.ref(),
                            "arena_digest": m.arena_digest}]}
    return m, entry, layouts, status


# -- adapters ----------------------------------------------------------------------------------------------------------
def capture_adapter(store: Store, a: dict[str, Any], arena_dir: Path | None) -> dict[str, Any]:
    """An adapter's two files as blobs: from its directory when they still are what the server loaded, else from
    the daemon's resident copy of that version."""
    name, path, want = a["name"], a["path"], a.get("digest")
    config_raw = data = None
    try:
        text, weights = read_adapter_dir(path)
        config_raw, data = (Path(path) / mf.ADAPTER_FILES[0]).read_bytes(), weights.read_bytes()
        got = adapter_digest(text, data)
    except (LoRAError, OSError) as e:
        got, err = None, str(e)
    else:
        err = ""
    if want is not None and got != want and arena_dir is not None:
        lora_file, meta_file = arena_dir / f"{want}.lora", arena_dir / f"{want}.lora-manifest"
        try:
            text = json.loads(meta_file.read_text())["config_json"]
            data = lora_file.read_bytes()
            got, config_raw = adapter_digest(text, data), text.encode()
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if got is None or (want is not None and got != want):
        why = err or "its files changed since the server loaded it"
        raise SnapshotError(f"adapter {name} ({path}): {why}, and the daemon holds no copy of the loaded version")
    files = {mf.ADAPTER_FILES[0]: store.put_bytes(config_raw).ref(), mf.ADAPTER_FILES[1]: store.put_bytes(data).ref()}
    return {"name": name, "digest": got, "rank": a.get("rank"), "source": str(path), "files": files}


# -- create ------------------------------------------------------------------------------------------------------------
def create(name: str, *, server: str | None = None, config_path: str | None = None, api_key: str | None = None,
           preload: bool = False, force: bool = False, store: Store | None = None,
           say: Say = lambda s: None) -> CreateResult:
    t0 = time.perf_counter()
    mf.check_name(name)
    store = (store or Store()).ensure()
    if store.exists(name) and not force:
        raise SnapshotError(f"a snapshot named {name!r} exists; delete it first or pass --force")
    source = from_config(config_path) if config_path else from_server(server or DEFAULT_SERVER, api_key)
    gguf = source.model_dir.suffix == ".gguf" and source.model_dir.is_file()
    if not gguf and not source.model_dir.is_dir():
        raise SnapshotError(f"the model directory {source.model_dir} is gone: its config and tokenizer files are "
                            "part of the snapshot")
    rt_cfg = source.config.get("runtime_dir")
    rt = Path(rt_cfg) if rt_cfg else paths.runtime_dir()
    before = store.stored_bytes()
    # A parallel deployment on a CPU daemon runs on per-(stage, rank) shard arenas; a CUDA daemon keeps one arena.
    tp_size = int(source.config.get("tensor_parallel_size") or 1)
    pp_size = int(source.config.get("pipeline_parallel_size") or 1)
    if _daemon_device(rt) != "cpu":
        tp_size = pp_size = 1
    with store.lock():
        ti = time.perf_counter()
        shards, layouts, status = [], set(), {}
        for stage in range(pp_size):
            for rank in range(tp_size):
                m, shard, shard_layouts, status = _capture(store, source, rt, preload, say,
                                                           Layout(rank, tp_size, stage, pp_size))
                shards.append(shard)
                layouts |= set(shard_layouts)
        image_seconds = time.perf_counter() - ti
        # A GGUF file holds its config and tokenizer: the config as the daemon read it, the tokenizer as a worker
        # serves it (beside the file, or converted from its metadata once)
        files_dir = gguf_tokenizer_dir(source.model_dir) if gguf else source.model_dir
        files = {p.name: store.put_file(p).ref() for p in model_files(files_dir)}
        if gguf:
            files["config.json"] = store.put_bytes(m.config_json.encode()).ref()
        if "config.json" not in files:
            raise SnapshotError(f"{source.model_dir} has no config.json")
        model = {"role": "base", "name": m.model_name, "source": m.model, "fingerprint": m.model_fingerprint,
                 "quantization": m.quantization, "dtype": m.dtype, "device": m.device,
                 "layout_version": m.layout_version, "layouts": sorted(layouts), "files": files}
        if len(shards) == 1:
            model.update({k: shards[0][k] for k in ("arena_bytes", "portable", "platforms")})
        if len(shards) > 1:
            model.update(tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size, shards=shards)
        tok = source.config.get("tokenizer")
        if tok and Path(tok).is_dir() and Path(tok).resolve() != source.model_dir.resolve():
            model["tokenizer_files"] = {p.name: store.put_file(p).ref() for p in model_files(Path(tok))}
        arena_dir = Path(status["arena_dir"]) if status.get("arena_dir") else None
        adapters = [capture_adapter(store, a, arena_dir) for a in source.adapters]
        config = dict(source.config)
        manifest = {
            "schema": mf.SCHEMA, "schema_version": mf.SCHEMA_VERSION, "name": name, "created_at": time.time(),
            "source": {"kind": source.kind, ("url" if source.kind == "server" else "path"): source.where,
                       "api_key_required": source.api_key_required},
            "server_config": config, "models": [model], "adapters": adapters,
            "identity": machine_identity(status.get("device", "cpu")),
        }
        store.save(manifest)
    refs = mf.blobs(manifest)
    new_bytes = max(0, store.stored_bytes() - before)
    return CreateResult(manifest, new_bytes, sum(refs.values()), time.perf_counter() - t0, image_seconds)
