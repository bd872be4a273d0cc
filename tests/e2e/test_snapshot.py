"""Snapshots: create / restore with real daemons and servers, export / import across "machines" (another
KEEPWARM_HOME and daemon runtime dir, the original files gone), dedup, corruption, hostile archives."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import tarfile
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from support.cli import kw, one_line_error
from support.daemon import Side
from support.serve import ServeProcess
from support.snapshots import flip_byte, synthetic

from keepwarm.daemon.client import DaemonClient, DaemonError
from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.archive import export, import_archive
from keepwarm.snapshot.manifest import SnapshotError
from keepwarm.snapshot.restore import REWRITTEN_KEYS
from keepwarm.snapshot.store import Store

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 41))]


# -- helpers -----------------------------------------------------------------------------------------------------------
class Server(ServeProcess):
    def __init__(self, env: dict[str, str], *args: str, port: int | None = None) -> None:
        super().__init__(*args, "--threads", "1", env=env, timeout=120, port=port)

    def config(self) -> dict:
        return httpx.get(self.base + "/keepwarm/config").json()

    def names(self) -> list[str]:
        return [m["id"] for m in httpx.get(self.base + "/v1/models").json()["data"]]

    def outputs(self, models: list[str]) -> dict[str, list[str]]:
        out = {}
        for model in models:
            out[model] = []
            for p in PROMPTS:
                body = {"model": model, "prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
                r = httpx.post(self.base + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
                out[model].append(r.json()["choices"][0]["text"])
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        Path(self.log_path).unlink(missing_ok=True)


def store_bytes(store: Store) -> int:
    return sum(p.stat().st_size for p in store.blobs_dir.iterdir()) if store.blobs_dir.is_dir() else 0



def config_without_rewritten(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in (*REWRITTEN_KEYS, "port")}


# -- the snapshot every end-to-end test starts from -------------------------------------------------------------------
@pytest.fixture(scope="module")
def prod(tiny_llama, lora_adapters, tmp_path_factory):
    """Daemon A + a server with a non-default config and two adapters; `snapshot create prod`; the server stopped.
    Model and adapters are private copies, so tests may move them away."""
    root = tmp_path_factory.mktemp("snap")
    model = Path(shutil.copytree(tiny_llama, root / "model"))
    ad_a = Path(shutil.copytree(lora_adapters["ad_qv"], root / "ad_a"))
    ad_b = Path(shutil.copytree(lora_adapters["ad_all"], root / "ad_b"))
    side = Side(root / "A").start_daemon()
    try:
        server = Server(side.env, model, "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "7",
                        "--block-size", "32", "--enable-lora", "--lora-modules", f"a={ad_a}", f"b={ad_b}",
                        "--max-lora-rank", "16")
        try:
            names = server.names()
            assert names == [str(model), "a", "b"]
            ref = SimpleNamespace(config=server.config(), names=names, outputs=server.outputs(names))
            assert ref.outputs["a"] != ref.outputs[str(model)] != ref.outputs["b"]  # the adapters matter
            r = kw(side.env, "snapshot", "create", "prod", "--server", server.base)
            assert "snapshot prod:" in r.stdout
        finally:
            server.stop()
        yield SimpleNamespace(side=side, model=model, ad_a=ad_a, ad_b=ad_b, ad_other=lora_adapters["ad_mlp"],
                              ref=ref, root=root, fingerprint=ref.config["weights"]["fingerprint"])
    finally:
        side.stop()


# -- 1. round trip -----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_round_trip_restores_config_adapters_and_greedy_output(prod, tmp_path) -> None:
    side = prod.side
    # The bad change: int8, other flags, another adapter under the name "a", no "b"; the good arena evicted.
    other = Path(shutil.copytree(prod.ad_other, tmp_path / "ad_other"))
    bad = Server(side.env, prod.model, "--dtype", "float32", "--max-model-len", "256", "-q", "int8",
                 "--max-num-seqs", "3", "--enable-lora", "--lora-modules", f"a={other}", "--max-lora-rank", "16")
    try:
        assert bad.config()["weights"]["fingerprint"] != prod.fingerprint
        assert bad.outputs(["a"])["a"] != prod.ref.outputs["a"]
        kw(side.env, "evict", prod.fingerprint)
        # The adapter's files change on disk after the server loaded it: the snapshot takes the loaded version
        # (the daemon's copy), not the files.
        served_digest = bad.config()["adapters"][0]["digest"]
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy(prod.ad_a / f, other / f)
        kw(side.env, "snapshot", "create", "bad", "--server", bad.base)
        assert side.store.load("bad")["adapters"][0]["digest"] == served_digest
        changes = json.loads(kw(side.env, "snapshot", "diff", "prod", "bad", "--json").stdout)
        keys = {(c["what"], c["key"]) for c in changes}
        assert {("config", "max_num_seqs"), ("config", "quantization"), ("config", "block_size"),
                ("config", "lora_modules"), ("model", "base.fingerprint"), ("model", "base.quantization"),
                ("adapter", "a"), ("adapter", "b")} <= keys
        assert prod.fingerprint not in {m["fingerprint"] for m in side.status()["models"]}

        # A systemd unit (a stand-in systemctl) whose server reads etc/server.toml.
        unit_config = tmp_path / "etc" / "server.toml"
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        calls = tmp_path / "systemctl.log"
        (bin_dir / "systemctl").write_text(
            "#!/bin/sh\n"
            f'echo "$@" >> {calls}\n'
            'case "$*" in *show*) printf "LoadState=loaded\\nActiveState=active\\nExecStart={ path=/usr/bin/env ; '
            f'argv[]=/usr/bin/env keepwarm serve --config {unit_config} ; }}\\n";; esac\n')
        (bin_dir / "systemctl").chmod(0o755)
        env = {**side.env, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        before = side.status()["counters"]
        r = kw(env, "snapshot", "restore", "prod", "--restart-server")
        assert "server restarted" in r.stdout and "restart keepwarm-server.service" in calls.read_text()
        after = side.status()["counters"]
        assert after["images_loaded"] == before["images_loaded"] + 1
        assert after["preloads"] == before["preloads"]  # no re-quantization, no checkpoint read
        resident = {m["fingerprint"]: m for m in side.status()["models"]}
        assert resident[prod.fingerprint]["origin"] == "image"
        image = mf.platform_images(side.store.load("prod")["models"][0])[0]["image"]  # this machine's
        assert resident[prod.fingerprint]["source_bytes"] == image["size"]  # the image read, not the checkpoint
        assert resident[prod.fingerprint]["arena_bytes"] == image["size"]
    finally:
        bad.stop()
    good = Server(side.env, "--config", unit_config)  # what the unit's restart runs
    try:
        cfg = good.config()
        assert config_without_rewritten(cfg["config"]) == config_without_rewritten(prod.ref.config["config"])
        assert cfg["config"]["max_num_seqs"] == 7 and cfg["config"]["block_size"] == 32
        assert cfg["weights"]["fingerprint"] == prod.fingerprint and cfg["weights"]["source"] == "daemon"
        strip = [{k: a[k] for k in ("name", "digest", "rank")} for a in prod.ref.config["adapters"]]
        assert [{k: a[k] for k in ("name", "digest", "rank")} for a in cfg["adapters"]] == strip
        assert good.names() == prod.ref.names  # clients keep their model names
        assert good.outputs(prod.ref.names) == prod.ref.outputs
    finally:
        good.stop()
    assert side.status()["counters"]["preloads"] == after["preloads"]


def restore_and_serve_the_same(other: Side, prod) -> None:
    """`snapshot restore prod` on another machine, a server from the written config: prod's greedy outputs, from
    the image alone (no preload)."""
    kw(other.env, "snapshot", "restore", "prod")
    server = Server(other.env, "--config", other.home / "server.toml")
    try:
        assert server.config()["weights"]["fingerprint"] == prod.fingerprint
        assert server.outputs(prod.ref.names) == prod.ref.outputs
    finally:
        server.stop()
    counters = other.status()["counters"]
    assert counters["images_loaded"] == 1 and counters["preloads"] == 0


@pytest.mark.slow
def test_restore_restarts_a_running_zygote_server_in_place(prod, tmp_path) -> None:
    """`snapshot restore --restart-server` with a `serve --zygote` server on the snapshot config's port: the same
    supervisor (no downtime) then serves the snapshot's config, adapters and greedy outputs. The flags it was
    started with (another served name, another max_num_seqs) would override the restored config: they are
    dropped, but for where it listens."""
    port = prod.ref.config["config"]["port"]  # the server listens where the restored config says
    server = Server(prod.side.env, prod.model, "--zygote", "--dtype", "float32", "--max-model-len", "128",
                    "--max-num-seqs", "3", "--served-model-name", "placeholder", port=port)
    try:
        assert server.names() == ["placeholder"] and server.config()["config"]["max_num_seqs"] == 3
        target = tmp_path / "server.toml"
        r = kw(prod.side.env, "snapshot", "restore", "prod", "--restart-server", "--server-config", str(target))
        assert f"server restarted (the serve --zygote server on port {port}, in place:" in r.stdout, r.stdout
        assert server.proc.poll() is None  # the same supervisor, still listening
        cfg = server.config()
        assert cfg["config"]["max_num_seqs"] == 7 and cfg["config"]["block_size"] == 32
        assert cfg["weights"]["fingerprint"] == prod.fingerprint
        assert server.names() == prod.ref.names
        assert server.outputs(prod.ref.names) == prod.ref.outputs
    finally:
        server.stop()


# -- 2. across machines ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_export_import_restore_on_another_machine(prod, tmp_path) -> None:
    archive = tmp_path / "prod.tar.zst"
    kw(prod.side.env, "snapshot", "export", "prod", "-o", archive, "--zstd")
    other = Side(tmp_path / "B")  # no daemon: restore starts one
    moved = [(p, p.with_name(p.name + "-away")) for p in (prod.model, prod.ad_a, prod.ad_b)]
    for src, dst in moved:
        src.rename(dst)
    try:
        assert "imported prod" in kw(other.env, "snapshot", "import", archive).stdout
        assert "ok" in kw(other.env, "snapshot", "verify", "prod").stdout
        restore_and_serve_the_same(other, prod)
        # nothing of the original machine was read: its files are gone
        assert not prod.model.exists()
    finally:
        for src, dst in moved:
            dst.rename(src)
        other.stop()


@pytest.mark.slow
def test_push_pull_through_a_registry_restores_on_another_machine(prod, tmp_path) -> None:
    """prod pushed to a real OCI registry (docker-registry), pulled into another KEEPWARM_HOME, restored there by a
    fresh daemon: the same greedy text, with no checkpoint read."""
    from support.registry import registry_env

    env_gen = registry_env(tmp_path / "registry")
    reg = next(env_gen)
    other = Side(tmp_path / "B")
    try:
        ref = f"{reg.host}/keepwarm/prod:v1"
        assert "uploaded" in kw(prod.side.env, "snapshot", "push", "prod", ref, "--insecure").stdout
        assert "pulled prod" in kw(other.env, "snapshot", "pull", ref, "--insecure").stdout
        assert other.store.load("prod") == prod.side.store.load("prod")
        restore_and_serve_the_same(other, prod)
    finally:
        other.stop()
        env_gen.close()


# -- 3. dedup ----------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_config_only_snapshot_adds_under_100kb(prod, tmp_path) -> None:
    from keepwarm.worker.process.config import ServerConfig, to_toml

    side = prod.side
    if prod.fingerprint not in {m["fingerprint"] for m in side.status()["models"]}:
        kw(side.env, "preload", prod.model, "--dtype", "float32")
    cfg = dict(prod.ref.config["config"], max_num_seqs=5)
    toml = tmp_path / "server.toml"
    toml.write_text(to_toml(ServerConfig(**cfg)))
    store = side.store
    before = store_bytes(store)
    kw(side.env, "snapshot", "create", "prod-cfg", "--from-config", toml)
    added = store_bytes(store) - before
    assert added < 100_000, added
    changes = json.loads(kw(side.env, "snapshot", "diff", "prod", "prod-cfg", "--json").stdout)
    assert [(c["what"], c["key"], c["a"], c["b"]) for c in changes] == [("config", "max_num_seqs", 7, 5)]
    rows = {r["name"]: r for r in json.loads(kw(side.env, "snapshot", "list", "--json").stdout)}
    assert rows["prod-cfg"]["unique_size"] == 0 and rows["prod"]["size"] > 1_000_000
    kw(side.env, "snapshot", "delete", "prod-cfg")
    assert "removed 0 blob(s)" in kw(side.env, "snapshot", "gc").stdout  # every blob is still prod's
    kw(side.env, "snapshot", "verify", "prod")
    # --from-config of a model the daemon does not hold: a clear refusal (no silent preload)
    other_model = Path(shutil.copytree(prod.model, tmp_path / "other-model"))
    with open(other_model / "config.json", "r+") as f:  # another model: its fingerprint differs
        c = json.load(f)
        c["rms_norm_eps"] = 1e-5
        f.seek(0)
        f.truncate()
        json.dump(c, f)
    toml.write_text(to_toml(ServerConfig(model=str(other_model), dtype="float32")))
    err = one_line_error(kw(side.env, "snapshot", "create", "x", "--from-config", toml, check=False))
    assert "not resident" in err and "--preload" in err


# -- 4. corruption -----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_flipped_byte_fails_verify_import_and_restore_naming_the_blob(prod, tmp_path) -> None:
    archive = tmp_path / "prod.tar"
    kw(prod.side.env, "snapshot", "export", "prod", "-o", archive)
    c = Side(tmp_path / "C", runtime_dir=prod.side.rt)  # restores would go into daemon A
    kw(c.env, "snapshot", "import", archive)
    m = c.store.load("prod")
    mod = m["models"][0]
    img = mf.platform_images(mod)[0]  # this machine's image: the one restore loads here
    victims = {"arena image": img["image"]["digest"], "arena manifest": img["image_manifest"]["digest"],
               "config.json": mod["files"]["config.json"]["digest"],
               "adapter weights": m["adapters"][0]["files"]["adapter_model.safetensors"]["digest"]}
    server_toml = c.home / "server.toml"
    server_toml.write_text('# the current config\nmodel = "/somewhere"\n')
    daemon_before = {x["fingerprint"]: x["origin"] for x in prod.side.status()["models"]}
    with tarfile.open(archive) as t:
        offsets = {d: t.getmember(f"blobs/sha256/{d}").offset_data for d in victims.values()}
    for what, digest in victims.items():
        blob = c.store.blob_path(digest)
        middle = blob.stat().st_size // 2
        flip_byte(blob, middle)
        try:
            assert digest in one_line_error(kw(c.env, "snapshot", "verify", "prod", check=False)), what
            assert digest in one_line_error(kw(c.env, "snapshot", "restore", "prod", check=False)), what
            assert server_toml.read_text().startswith("# the current config")
            assert not (c.home / "restored").exists()
            assert {x["fingerprint"]: x["origin"] for x in prod.side.status()["models"]} == daemon_before
        finally:
            flip_byte(blob, middle)
        bad_archive = tmp_path / f"bad-{digest[:8]}.tar"
        shutil.copy(archive, bad_archive)
        flip_byte(bad_archive, offsets[digest] + middle)
        d = Side(tmp_path / f"D-{digest[:8]}", runtime_dir=prod.side.rt)
        err = one_line_error(kw(d.env, "snapshot", "import", bad_archive, check=False))
        assert digest in err and "nothing imported" in err, what
        assert not list(d.store.blobs_dir.iterdir()) and d.store.names() == []
    kw(c.env, "snapshot", "verify", "prod")  # flipped back: whole again


# -- restore refusals: device, memory budget (nothing evicted, nothing written) ----------------------------------------
@pytest.mark.slow
def test_restore_refuses_what_the_daemon_cannot_hold(prod, tmp_path) -> None:
    e = Side(tmp_path / "E").start_daemon("--memory-budget", "1M")  # the arena is ~1.7 MB
    try:
        archive = tmp_path / "prod.tar"
        kw(prod.side.env, "snapshot", "export", "prod", "-o", archive)
        kw(e.env, "snapshot", "import", archive)
        err = one_line_error(kw(e.env, "snapshot", "restore", "prod", check=False))
        assert "memory budget" in err
        assert not (e.home / "server.toml").exists()
        assert not [p for p in (e.home / "restored").rglob("*") if p.is_file()]  # staged files removed
        st = e.status()
        assert st["models"] == [] and st["adapters"] == [] and st["counters"]["images_loaded"] == 0
        # A CUDA image on a CPU daemon, in a snapshot made before the portable layer (so nothing to build this
        # machine's arena from): refused before anything is staged.
        m = e.store.load("prod")
        m["name"] = "prod-cuda"
        mod = m["models"][0]
        (img,) = mf.platform_images(mod)
        for k in ("portable", "platforms"):
            del mod[k]
        mod.update({k: img[k] for k in ("image", "image_manifest", "arena_digest")},
                   device="cuda:GPU-00000000-0000-0000-0000-000000000000")
        e.store.save(m)
        err = one_line_error(kw(e.env, "snapshot", "restore", "prod-cuda", check=False))
        assert "cuda arena image" in err and "keeps cpu arenas" in err
        # The server needed an API key: restore wants one (snapshots never store it) before touching anything.
        m = e.store.load("prod")
        m["name"] = "prod-key"
        m["source"]["api_key_required"] = True
        e.store.save(m)
        err = one_line_error(kw(e.env, "snapshot", "restore", "prod-key", check=False))
        assert "API key" in err
        err = one_line_error(kw(e.env, "snapshot", "restore", "prod-key", "--api-key", "k", check=False))
        assert "memory budget" in err  # past the key check, refused by the daemon as before
        assert not (e.home / "server.toml").exists() and e.status()["models"] == []
    finally:
        e.stop()


@pytest.mark.slow
def test_load_image_verb(prod, tmp_path) -> None:
    from keepwarm.formats.arena import ArenaManifest

    store = prod.side.store
    mod = mf.platform_images(store.load("prod")["models"][0])[0]  # this machine's image
    manifest_json = store.read_blob(mod["image_manifest"]["digest"]).decode()
    image = store.blob_path(mod["image"]["digest"])
    f = Side(tmp_path / "F").start_daemon()
    try:
        arena_dir = Path(f.status()["arena_dir"])
        with DaemonClient(f.rt) as c:
            bad = json.loads(manifest_json)
            bad["arena_digest"] = "0" * 64
            with pytest.raises(DaemonError) as err:
                c.load_image(json.dumps(bad), image)
            assert err.value.code == "bad_image"
            cuda = dict(json.loads(manifest_json), device="cuda:GPU-1234")
            with pytest.raises(DaemonError) as err:
                c.load_image(json.dumps(cuda), image)
            assert err.value.code == "incompatible_image"
            with pytest.raises(DaemonError) as err:
                c.load_image(manifest_json, tmp_path / "missing")
            assert err.value.code == "bad_image"
            # the file checked against the snapshot's blob digest in the same pass as the load
            with pytest.raises(DaemonError) as err:
                c.load_image(manifest_json, image, sha256="1" * 64)
            assert err.value.code == "bad_image" and f"hashes to {mod['image']['digest']}, not " in err.value.message
            with pytest.raises(DaemonError) as err:
                c.load_image(manifest_json, image, sha256="../etc")
            assert err.value.code == "bad_request"
            assert f.status()["models"] == [] and sorted(p.name for p in arena_dir.iterdir()) == []
            reply = c.load_image(manifest_json, image, sha256=mod["image"]["digest"])
            assert reply["cached"] is False and reply["origin"] == "image"
            assert c.load_image(manifest_json, image)["cached"] is True
            # attach by fingerprint from a directory without weights (a restored model dir), without preload
            nowt = tmp_path / "nowt"
            nowt.mkdir()
            shutil.copy(prod.model / "config.json", nowt)
            att = c.attach(str(nowt), dtype="float32", fingerprint=prod.fingerprint, preload=False)
            assert ArenaManifest.from_json(att["manifest"]).fingerprint == prod.fingerprint
            c.detach(att["lease_id"])
        counters = f.status()["counters"]
        assert counters["images_loaded"] == 1 and counters["preloads"] == 0
        assert sorted(p.suffix for p in arena_dir.iterdir()) == [".arena", ".json"]
    finally:
        f.stop()


# -- fast: the store, manifests, hostile archives ----------------------------------------------------------------------
def test_blobs_are_written_once_atomically_and_shared(tmp_path) -> None:
    store = Store(tmp_path / "store").ensure()
    a = store.put_bytes(b"hello")
    b = store.put_bytes(b"hello")
    assert a.digest == hashlib.sha256(b"hello").hexdigest() and a.new and not b.new
    assert store.blob_path(a.digest).read_bytes() == b"hello"
    assert not stat.S_IMODE(store.blob_path(a.digest).stat().st_mode) & 0o222  # read-only

    def failing():
        yield memoryview(b"x" * 1000)
        raise OSError("disk gone")

    with pytest.raises(OSError):
        store.put_chunks(failing())
    assert sorted(p.name for p in store.blobs_dir.iterdir()) == [a.digest]  # no half blob, no temp file
    with pytest.raises(SnapshotError, match="corrupt"):
        store.put_chunks([memoryview(b"abc")], expect_digest="0" * 64)
    assert sorted(p.name for p in store.blobs_dir.iterdir()) == [a.digest]


def test_manifest_validation_refuses_unsafe_fields(tmp_path) -> None:
    store = Store(tmp_path / "store").ensure()
    m = synthetic(store)
    assert store.load("syn") == m
    for bad_name in ("../x", ".hidden", "a/b", "", "x" * 200):
        with pytest.raises(SnapshotError):
            mf.check_name(bad_name)
    cases = [("models", 0, "files", {"../config.json": m["models"][0]["files"]["config.json"]}),
             ("models", 0, "fingerprint", "../../etc"),
             ("adapters", 0, "digest", "zz"),
             ("adapters", 0, "files", {"adapter_config.json": {"digest": "d" * 64, "size": 1}, "x.py":
                                       {"digest": "d" * 64, "size": 1}})]
    for top, i, key, value in cases:
        bad = json.loads(json.dumps(m))
        bad[top][i][key] = value
        with pytest.raises(SnapshotError):
            mf.validate(bad)
    bad = dict(m, schema_version=2)
    with pytest.raises(SnapshotError, match="schema version"):
        mf.validate(bad)
    bad = dict(m, server_config={"no_such_key": 1})
    with pytest.raises(SnapshotError, match="no_such_key"):
        mf.validate(bad)


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        for ti, data in members:
            t.addfile(ti, io.BytesIO(data) if data is not None else None)
    return path


def _reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    return ti, data


def test_export_import_round_trip_and_hostile_archives(tmp_path) -> None:
    src = Store(tmp_path / "src").ensure()
    m = synthetic(src)
    for zstd in (False, True):
        dst = Store(tmp_path / f"dst{zstd}")
        export(src, "syn", tmp_path / f"syn{zstd}.tar", zstd=zstd)
        r = import_archive(dst, tmp_path / f"syn{zstd}.tar")
        assert r.name == "syn" and r.new_blobs == len(mf.blobs(m)) and dst.load("syn") == m
        assert import_archive(dst, tmp_path / f"syn{zstd}.tar").already_present

    manifest = _reg("snapshots/syn.json", mf.dumps(m).encode())
    digest, size = next(iter(mf.blobs(m).items()))
    good_blob = _reg(f"blobs/sha256/{digest}", src.blob_path(digest).read_bytes())
    outside = tmp_path / "outside"

    def link(name: str, kind: bytes, target: str = "/etc/passwd") -> tuple[tarfile.TarInfo, None]:
        ti = tarfile.TarInfo(name)
        ti.type = kind
        ti.linkname = target
        return ti, None

    dev = tarfile.TarInfo("blobs/sha256/" + digest)
    dev.type, dev.devmajor, dev.devminor = tarfile.CHRTYPE, 1, 3
    hostile = {
        "traversal": [manifest, _reg("../outside/evil", b"x")],
        "traversal-inside": [manifest, _reg("blobs/sha256/../../../outside/evil", b"x")],
        "absolute": [manifest, _reg(str(outside / "evil"), b"x")],
        "symlink": [manifest, link(f"blobs/sha256/{digest}", tarfile.SYMTYPE)],
        "hardlink": [manifest, link(f"blobs/sha256/{digest}", tarfile.LNKTYPE, "snapshots/syn.json")],
        "device": [manifest, (dev, None)],
        "blob-first": [good_blob, manifest],
        "unknown-path": [manifest, _reg("notes.txt", b"x")],
        "wrong-content": [manifest, _reg(f"blobs/sha256/{digest}", b"y" * size)],
        "not-named": [manifest, _reg("blobs/sha256/" + "e" * 64, b"x")],
        "duplicate": [manifest, good_blob, good_blob],
        "missing-blobs": [manifest, good_blob],
    }
    for case, members in hostile.items():
        dst = Store(tmp_path / f"h-{case}")
        with pytest.raises(SnapshotError) as e:
            import_archive(dst, _tar(tmp_path / f"{case}.tar", members))
        assert "\n" not in str(e.value), case
        assert dst.names() == [] and list(dst.blobs_dir.iterdir()) == [], case
        assert list(dst.tmp_dir.iterdir()) == [], case  # staging removed
        assert not outside.exists() and not (tmp_path / "evil").exists(), case
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00junk" * 100)
    with pytest.raises(SnapshotError):
        import_archive(Store(tmp_path / "junk"), junk)
    # a name clash: refused unless renamed or forced
    clash = Store(tmp_path / "clash").ensure()
    clash.save(synthetic(clash) | {"server_config": {"max_num_seqs": 9}})
    with pytest.raises(SnapshotError, match="different snapshot"):
        import_archive(clash, tmp_path / "synFalse.tar")
    assert import_archive(clash, tmp_path / "synFalse.tar", rename="syn2").name == "syn2"
    assert import_archive(clash, tmp_path / "synFalse.tar", force=True).name == "syn"
    assert clash.load("syn") == m


def test_gc_keeps_named_blobs_and_unique_sizes(tmp_path) -> None:
    store = Store(tmp_path / "store").ensure()
    m = synthetic(store, "one")
    two = json.loads(json.dumps(m)) | {"name": "two"}
    two["models"][0]["image"] = store.put_bytes(b"other image").ref()
    store.save(two)
    orphan = store.put_bytes(b"nobody names me")
    sizes = store.unique_sizes(store.manifests())
    assert sizes == {"one": m["models"][0]["image"]["size"], "two": len(b"other image")}
    assert store.gc() == (1, orphan.size)
    store.delete("one")
    removed, freed = store.gc()
    assert removed == 1 and freed == m["models"][0]["image"]["size"]
    assert set(p.name for p in store.blobs_dir.iterdir()) == set(mf.blobs(two))
    # An unreadable manifest: listed as such, gc refuses to guess, delete still removes it.
    (store.snapshots_dir / "broken.json").write_text("{not json")
    from keepwarm.snapshot.inspect import list_rows

    assert [r["name"] for r in list_rows(store)] == ["broken", "two"]
    with pytest.raises(SnapshotError, match="not valid JSON"):
        store.gc()
    store.delete("broken")
    assert store.gc() == (0, 0)


def test_packed_image_refused_on_another_cpu_layout(tiny_llama) -> None:
    """An mkldnn_packed descriptor that oneDNN would not pick here (another ISA) makes the image incompatible."""
    import torch

    from keepwarm.daemon.image import ImageError, check_compatible
    from keepwarm.formats.arena import ArenaManifest
    from keepwarm.kernels.cpu_packed import packing_available
    from keepwarm.weights.checkpoint import Checkpoint
    from keepwarm.weights.loader import build_arena, plan_arena

    if not packing_available(torch.bfloat16):
        pytest.skip("this CPU does not pack bfloat16 weights")
    ckpt = Checkpoint(tiny_llama)
    _, total = plan_arena(ckpt, "none", torch.bfloat16)
    manifest = build_arena(ckpt, "none", "bfloat16", torch.empty(total, dtype=torch.uint8), "cpu", threads=2)
    check_compatible(manifest, torch.device("cpu"))  # this CPU's own image is fine
    d = json.loads(manifest.to_json())
    weight = next(w for w, q in d["quant"].items() if q["layout"] == "mkldnn_packed")
    # An image packed with the batch hint of earlier versions is still this CPU's: oneDNN runs its format.
    from keepwarm.formats.packed import LEGACY_HINTS, packed_layout

    legacy = json.loads(json.dumps(d))
    shape = tuple(legacy["quant"][weight]["shape"])
    legacy["quant"][weight]["descriptor"] = packed_layout(shape, torch.bfloat16, LEGACY_HINTS[0])[1].hex()
    check_compatible(ArenaManifest.from_json(json.dumps(legacy)), torch.device("cpu"))
    desc = bytearray.fromhex(d["quant"][weight]["descriptor"])
    desc[len(desc) // 2] ^= 0x01
    d["quant"][weight]["descriptor"] = desc.hex()
    with pytest.raises(ImageError, match="packed layout differs"):
        check_compatible(ArenaManifest.from_json(json.dumps(d)), torch.device("cpu"))
    with pytest.raises(ImageError, match="cuda"):
        check_compatible(manifest, torch.device("cuda", 0))


@pytest.mark.slow
def test_packed_bfloat16_image_restores_and_generates_the_same(tiny_llama, tmp_path) -> None:
    """The CPU bfloat16 arena holds oneDNN-packed weights: its image restores as is and computes the same."""
    import torch

    from keepwarm import LLM, SamplingParams
    from keepwarm.kernels.cpu_packed import packing_available
    from keepwarm.worker.process.config import ServerConfig, to_toml

    if not packing_available(torch.bfloat16):
        pytest.skip("this CPU does not pack bfloat16 weights")
    g = Side(tmp_path / "G").start_daemon()
    try:
        toml = tmp_path / "server.toml"
        toml.write_text(to_toml(ServerConfig(model=tiny_llama, dtype="bfloat16")))
        kw(g.env, "snapshot", "create", "bf16", "--from-config", toml, "--preload")
        mod = g.store.load("bf16")["models"][0]
        assert "mkldnn_packed" in mod["layouts"] and g.status()["counters"]["preloads"] == 1
        kw(g.env, "evict", mod["fingerprint"])
        kw(g.env, "snapshot", "restore", "bf16")
        counters = g.status()["counters"]
        assert counters["images_loaded"] == 1 and counters["preloads"] == 1
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        restored = LLM(model=str(g.home / "restored" / mod["fingerprint"]), dtype="bfloat16", max_model_len=128,
                       daemon=True, runtime_dir=str(g.rt), fingerprint=mod["fingerprint"])
        assert restored.llm_engine.weights_source == "daemon"
        got = [o.outputs[0].token_ids for o in restored.generate(PROMPTS, params)]
        restored.close()
        disk = LLM(model=tiny_llama, dtype="bfloat16", max_model_len=128, daemon=False)
        assert got == [o.outputs[0].token_ids for o in disk.generate(PROMPTS, params)]
        disk.close()
    finally:
        g.stop()


@pytest.mark.slow
def test_tensor_parallel_snapshot_keeps_each_ranks_image_and_refuses_another_size(tiny_llama, tmp_path) -> None:
    """A TP=2 config's snapshot holds both ranks' shard images; after both are evicted, restore loads the two
    images (no preload) and a TP=2 engine on the restored directory gives one process's tokens; serving the
    restored config at TP=1 is refused in one line naming the sizes."""
    from keepwarm import LLM, SamplingParams
    from keepwarm.worker.process.config import ServerConfig, to_toml

    g = Side(tmp_path / "T").start_daemon()
    try:
        toml = tmp_path / "server.toml"
        toml.write_text(to_toml(ServerConfig(model=tiny_llama, dtype="float32", quantization="int8",
                                             tensor_parallel_size=2)))
        kw(g.env, "snapshot", "create", "tp2", "--from-config", toml, "--preload")
        mod = g.store.load("tp2")["models"][0]
        shards = mod["shards"]
        assert mod["tensor_parallel_size"] == 2 and [x["tp_rank"] for x in shards] == [0, 1]
        images = [mf.platform_images(x)[0]["image"] for x in shards]
        assert len({i["digest"] for i in images}) == 2 and "image" not in mod  # each rank's, none on the model
        assert [x["portable"]["image"] for x in shards] == images  # int8: nothing machine-specific, one blob each
        resident = sorted(g.status()["models"], key=lambda m: m["tp_rank"])
        assert [m["fingerprint"] for m in resident] == [x["fingerprint"] for x in shards]
        assert {m["source_fingerprint"] for m in resident} == {mod["fingerprint"]}
        assert "tp2: ok" in kw(g.env, "snapshot", "verify", "tp2").stdout  # both images checked
        kw(g.env, "evict", mod["fingerprint"])  # the whole model's fingerprint: both shards
        assert g.status()["models"] == []
        kw(g.env, "snapshot", "restore", "tp2")
        st = g.status()
        assert (st["counters"]["images_loaded"], st["counters"]["preloads"]) == (2, 1)
        assert sorted((m["tp_rank"], m["origin"]) for m in st["models"]) == [(0, "image"), (1, "image")]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        restored = LLM(model=str(g.home / "restored" / mod["fingerprint"]), dtype="float32", quantization="int8",
                       max_model_len=128, tensor_parallel_size=2, daemon=True, runtime_dir=str(g.rt),
                       fingerprint=mod["fingerprint"])
        assert restored.llm_engine.weights_source == "daemon"
        got = [o.outputs[0].token_ids for o in restored.generate(PROMPTS, params)]
        restored.close()
        disk = LLM(model=tiny_llama, dtype="float32", quantization="int8", max_model_len=128, daemon=False)
        assert got == [o.outputs[0].token_ids for o in disk.generate(PROMPTS, params)]
        disk.close()
        r = kw(g.env, "serve", "--config", g.home / "server.toml", "--tensor-parallel-size", "1", check=False,
               timeout=120)
        err = one_line_error(r)
        assert "resident as 2 tensor-parallel shards, not as one arena" in err, err
        assert g.status()["counters"]["preloads"] == 1
    finally:
        g.stop()


# -- 6. what README.md and docs/snapshots.md claim for the CLI ------------------------------------------------------
@pytest.mark.slow
def test_cli_create_force_show_import_name_force_restore_prev_and_no_api_key_stored(prod, tmp_path) -> None:
    side, env, store = prod.side, prod.side.env, prod.side.store
    secret, restore_key = "sk-never-stored-7f3a9c", "sk-restore-only-41d2"
    toml = tmp_path / "server.toml"
    toml.write_text(f'model = "{prod.model}"\ndtype = "float32"\nmax_model_len = 256\napi_key = "{secret}"\n')
    kw(env, "snapshot", "create", "keyed", "--from-config", toml, "--preload")
    assert store.load("keyed")["source"]["api_key_required"] is True
    assert "api_key" not in store.load("keyed")["server_config"]

    # create: refused over an existing name, replaced with --force.
    toml.write_text(toml.read_text() + "max_num_seqs = 5\n")
    assert "exists; delete it first or pass --force" in one_line_error(
        kw(env, "snapshot", "create", "keyed", "--from-config", toml, check=False))
    assert store.load("keyed")["server_config"]["max_num_seqs"] == 256  # the default: not replaced
    kw(env, "snapshot", "create", "keyed", "--from-config", toml, "--force")
    assert store.load("keyed")["server_config"]["max_num_seqs"] == 5

    # show: the manifest, as text and as JSON.
    assert json.loads(kw(env, "snapshot", "show", "keyed", "--json").stdout) == store.load("keyed")
    text = kw(env, "snapshot", "show", "keyed").stdout
    assert "(an API key was required)" in text and f"fingerprint {prod.fingerprint}" in text
    assert "    max_num_seqs = 5" in text

    # import --name (a copy under another name) and --force (replacing a different snapshot of that name).
    archive = tmp_path / "keyed.tar"
    kw(env, "snapshot", "export", "keyed", "-o", archive)
    kw(env, "snapshot", "import", archive, "--name", "keyed-copy")
    copy = store.load("keyed-copy")
    assert copy["name"] == "keyed-copy" and copy["server_config"] == store.load("keyed")["server_config"]
    assert "import it under another name (--name) or replace it (--force)" in one_line_error(
        kw(env, "snapshot", "import", archive, "--name", "prod", check=False))
    assert store.load("prod")["models"][0]["fingerprint"] == prod.fingerprint  # untouched
    toml.write_text(f'model = "{prod.model}"\ndtype = "float32"\nmax_model_len = 128\n')
    kw(env, "snapshot", "create", "scratch", "--from-config", toml)
    kw(env, "snapshot", "import", archive, "--name", "scratch", "--force")
    assert store.load("scratch")["server_config"]["max_num_seqs"] == 5

    # restore keeps the config it replaces as <config>.prev; the key given at restore goes only into the config.
    target = tmp_path / "etc" / "server.toml"
    kw(env, "snapshot", "restore", "keyed", "--server-config", target, "--api-key", restore_key)
    first = target.read_text()
    assert f'api_key = "{restore_key}"' in first and not target.with_name("server.toml.prev").exists()
    kw(env, "snapshot", "restore", "prod", "--server-config", target)
    assert target.with_name("server.toml.prev").read_text() == first
    assert "max_num_seqs = 7" in target.read_text()
    assert oct(target.with_name("server.toml.prev").stat().st_mode & 0o777) == "0o600"

    # A snapshot of two models is refused by restore, naming the count, before anything changes.
    two = store.load("keyed")
    two["name"], two["models"] = "two-models", two["models"] * 2
    store.save(two)
    assert "holds 2 models; this keepwarm restores one" in one_line_error(
        kw(env, "snapshot", "restore", "two-models", "--server-config", target, check=False))
    assert target.with_name("server.toml.prev").read_text() == first

    # No API key, neither the server's nor the one given at restore, is anywhere in the store or the export.
    files = [archive, *(p for p in (side.home / "store").rglob("*") if p.is_file())]
    for f in files:
        data = f.read_bytes()
        assert secret.encode() not in data and restore_key.encode() not in data, f
    for name in ("keyed", "keyed-copy", "scratch", "two-models"):
        kw(env, "snapshot", "delete", name)
