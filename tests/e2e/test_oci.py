"""Snapshots through an OCI registry (keepwarm.snapshot.oci) against a real one: Debian's docker-registry (the CNCF
distribution server) behind a counting, fault-injecting proxy (tests/support/registry.py). Push and pull of a small
snapshot, no blob uploaded twice, a corrupted blob refused with nothing written, interrupted uploads resumed, Bearer
token auth with docker-config credentials, plain HTTP refused without --insecure, hostile manifests refused. A snapshot
with the two layers is an OCI image index (read back over /v2/ as a client sees it); a pull fetches its portable layer
and only this machine's platform image (counted), one made before the layers is a plain manifest and still pulls; a
layered snapshot made on "a machine of another kind" (a daemon under foreign ISA caps) and given this machine's image
pulls and restores that image on a third store. The end-to-end push -> pull -> restore -> same greedy text is in
test_snapshot.py (it shares that module's daemon)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys

import httpx
import pytest
from support.cli import kw
from support.daemon import Side
from support.registry import registry_env
from support.snapshots import fake_platform, synthetic, synthetic_layered

from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.manifest import SnapshotError
from keepwarm.snapshot.oci import (
    ARTIFACT_TYPE,
    MEDIA_BLOB,
    MEDIA_CONFIG,
    MEDIA_INDEX,
    MEDIA_MANIFEST,
    MEDIA_PLATFORM,
    Credentials,
    Reference,
    Registry,
    descriptor,
    docker_config_credentials,
    parse_oci_index,
    parse_oci_manifest,
    pull,
    push,
)
from keepwarm.snapshot.store import Store


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    yield from registry_env(tmp_path_factory.mktemp("registry"))


@pytest.fixture
def proxy(reg):
    reg.proxy.log.clear()
    yield reg.proxy
    reg.proxy.faults.__init__()  # type: ignore[misc]


@pytest.fixture
def src(tmp_path):
    store = Store(tmp_path / "src").ensure()
    return store, synthetic(store)


def client(proxy, repo: str, **kw) -> Registry:
    return Registry(Reference.parse(f"{proxy.host}/{repo}:v1"), insecure=True, **kw)


def kw_cli(env: dict[str, str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "--log-level", "warning", *args], env=env,
                          input=stdin, capture_output=True, text=True, timeout=120)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def uploads_per_digest(proxy) -> dict[str, int]:
    """Finished uploads (PUT ...?digest=) per blob digest, as the registry saw them."""
    counts: dict[str, int] = {}
    for _, path, _ in proxy.requests("PUT", r"/blobs/uploads/.*digest=sha256"):
        digest = path.rsplit("sha256%3A", 1)[-1].rsplit("sha256:", 1)[-1][:64]
        counts[digest] = counts.get(digest, 0) + 1
    return counts


def test_push_pull_round_trip_uploads_no_blob_twice(proxy, src, tmp_path) -> None:
    store, m = src
    env = {**os.environ, "KEEPWARM_HOME": str(tmp_path / "src-home")}
    (tmp_path / "src-home").mkdir()
    os.symlink(store.root, tmp_path / "src-home" / "store")
    ref = f"{proxy.host}/kw/round:v1"
    r = kw_cli(env, "snapshot", "push", "syn", ref, "--insecure", "--chunk-size", "1000")
    assert r.returncode == 0, r.stderr
    assert "5 blobs" in r.stdout and "5 uploaded" in r.stdout and "MB/s" in r.stdout
    config_digest = hashlib.sha256(mf.dumps(m).encode()).hexdigest()
    assert uploads_per_digest(proxy) == {d: 1 for d in [*mf.blobs(m), config_digest]}
    sizes = [*mf.blobs(m).values(), len(mf.dumps(m).encode())]
    assert len(proxy.requests("PATCH", "/kw/round/")) == sum(-(-s // 1000) for s in sizes)  # 1000-byte chunks

    proxy.log.clear()  # the same snapshot again, then under another tag: no blob uploaded
    assert "0 uploaded" in kw_cli(env, "snapshot", "push", "syn", ref, "--insecure").stdout
    assert "0 uploaded" in kw_cli(env, "snapshot", "push", "syn", f"{proxy.host}/kw/round:v2", "--insecure").stdout
    assert not proxy.requests("POST") and not proxy.requests("PATCH") and len(proxy.requests("PUT")) == 2

    # pull into another KEEPWARM_HOME; again: nothing downloaded; with one blob already there: that one skipped
    other = {**os.environ, "KEEPWARM_HOME": str(tmp_path / "other")}
    r = kw_cli(other, "snapshot", "pull", ref, "--insecure", "--name", "copy")
    assert r.returncode == 0 and "pulled copy" in r.stdout and "4 downloaded" in r.stdout, r.stderr
    dst = Store(tmp_path / "other" / "store")
    assert dst.load("copy") == {**m, "name": "copy"}
    dst.verify(dst.load("copy"))
    assert "already in the store" in kw_cli(other, "snapshot", "pull", ref, "--insecure", "--name", "copy").stdout
    third = Store(tmp_path / "third")
    image = m["models"][0]["image"]
    third.put_bytes(store.read_blob(image["digest"]))
    proxy.log.clear()
    with client(proxy, "kw/round") as c:
        res = pull(third, c)
    assert res.imported.new_blobs == 3 and not proxy.requests("GET", image["digest"])
    assert third.load("syn") == m


def test_corrupted_blob_is_refused_naming_it_and_nothing_is_written(proxy, src, tmp_path) -> None:
    store, m = src
    with client(proxy, "kw/corrupt") as c:
        push(store, "syn", c)
    bad = m["models"][0]["image"]["digest"]
    proxy.faults.corrupt.add(bad)
    dst = Store(tmp_path / "dst")
    with client(proxy, "kw/corrupt") as c, pytest.raises(SnapshotError, match=f"blob {bad} is corrupt.*nothing "
                                                                               "written"):
        pull(dst, c)
    assert [list(d.iterdir()) for d in (dst.blobs_dir, dst.snapshots_dir, dst.tmp_dir)] == [[], [], []]
    env = {**os.environ, "KEEPWARM_HOME": str(tmp_path / "cli")}
    assert bad in one_line_error(kw_cli(env, "snapshot", "pull", f"{proxy.host}/kw/corrupt:v1", "--insecure"))
    assert not (tmp_path / "cli" / "store" / "snapshots").exists() or not any(
        (tmp_path / "cli" / "store" / "snapshots").iterdir())


@pytest.mark.parametrize("mode", ["before", "partial"])
def test_interrupted_chunk_upload_resumes(proxy, src, tmp_path, mode) -> None:
    """The connection breaks on the image's third 1000-byte chunk. "before": the registry got none of it, and the
    upload goes on from byte 2000 (the session's Range). "partial": the registry got half of it, and distribution
    2.8 then invalidates the session: the blob starts again from 0. Either way the push completes and pulls intact."""
    store, m = src
    image = m["models"][0]["image"]["digest"]
    proxy.faults.drop_patch, proxy.faults.drop_range = mode, "2000-2999"
    said: list[str] = []
    repo = f"kw/resume-{mode}"
    with client(proxy, repo, chunk_size=1000, say=said.append) as c:
        push(store, "syn", c)
    assert proxy.faults.drop_patch is None  # the fault fired
    ranges = [cr for _, path, cr in proxy.requests("PATCH", repo) if cr.endswith("-999") or cr.startswith(
        ("1000-", "2000-", "3000-", "4000-"))][-6:]
    if mode == "before":
        assert any("resuming at byte 2000" in s for s in said), said
        assert ranges[-4:] == ["2000-2999", "2000-2999", "3000-3999", "4000-4095"]
    else:
        assert any(image[:12] in s and "from byte 0" in s for s in said), said
        assert ranges[-6:] == ["2000-2999", "0-999", "1000-1999", "2000-2999", "3000-3999", "4000-4095"]
    dst = Store(tmp_path / "dst")
    with client(proxy, repo) as c:
        pull(dst, c)
    assert dst.read_blob(image) == store.read_blob(image)


def test_bearer_token_auth_with_docker_config_credentials(proxy, src, tmp_path) -> None:
    store, m = src
    proxy.faults.bearer = ("alice", "s3cret", "tok-123")
    cfg = tmp_path / "docker"
    cfg.mkdir()
    auth = base64.b64encode(b"alice:s3cret").decode()
    (cfg / "config.json").write_text(json.dumps({"auths": {f"http://{proxy.host}": {"auth": auth}}}))
    assert docker_config_credentials(proxy.host, cfg / "config.json")[0] == Credentials("alice", "s3cret")
    home = tmp_path / "home"
    (home).mkdir()
    os.symlink(store.root, home / "store")
    env = {**os.environ, "KEEPWARM_HOME": str(home), "DOCKER_CONFIG": str(cfg)}
    ref = f"{proxy.host}/kw/auth:v1"
    r = kw_cli(env, "snapshot", "push", "syn", ref, "--insecure")
    assert r.returncode == 0, r.stderr
    assert proxy.requests("GET", "^/token")
    # --username/--password-stdin wins over the config; a wrong password is one line naming the token service
    err = one_line_error(kw_cli(env, "snapshot", "pull", ref, "--insecure", "--name", "x", "--username", "alice",
                                "--password-stdin", stdin="wrong\n"))
    assert "token service" in err and "refused" in err
    r = kw_cli(env, "snapshot", "pull", ref, "--insecure", "--name", "x", "--username", "alice", "--password-stdin",
               stdin="s3cret\n")
    assert r.returncode == 0 and "pulled x" in r.stdout, r.stderr
    no_creds = {**env, "DOCKER_CONFIG": str(tmp_path / "none")}
    assert "no credentials given" in one_line_error(kw_cli(no_creds, "snapshot", "pull", ref, "--insecure"))


def test_plain_http_needs_insecure_and_bad_references_are_one_line(proxy, tmp_path) -> None:
    env = {**os.environ, "KEEPWARM_HOME": str(tmp_path)}
    err = one_line_error(kw_cli(env, "snapshot", "pull", f"{proxy.host}/kw/x:v1"))
    assert f"cannot reach https://{proxy.host}" in err and "--insecure" in err
    assert not proxy.log  # not one byte went over plain HTTP
    for ref, why in [("kw/x", "a tag is required"), ("host:5000/Upper/x:v1", "repository"),
                     ("host:5000/x:bad tag", "tag"), ("a b/x:v1", "registry host")]:
        assert why in one_line_error(kw_cli(env, "snapshot", "pull", ref, "--insecure")), ref
    assert "not found in the registry" in one_line_error(
        kw_cli(env, "snapshot", "pull", f"{proxy.host}/kw/absent:v1", "--insecure"))


def test_hostile_or_foreign_manifests_are_refused(proxy, src, tmp_path) -> None:
    store, m = src
    config = mf.dumps(m).encode()
    good_cfg = descriptor(MEDIA_CONFIG, hashlib.sha256(config).hexdigest(), len(config))
    layers = [descriptor(MEDIA_BLOB, d, s) for d, s in sorted(mf.blobs(m).items())]

    def doc(**kw) -> bytes:
        return json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": good_cfg, "layers": layers, **kw}).encode()

    assert parse_oci_manifest(doc())[1] == mf.blobs(m)
    traversal = [{**layers[0], "digest": "sha256:../../../etc/passwd"}]
    with pytest.raises(SnapshotError, match=r"layers\[0\] has digest .*not sha256:<64 hex>"):
        parse_oci_manifest(doc(layers=traversal))
    with pytest.raises(SnapshotError, match="not sha256:<64 hex>"):
        parse_oci_manifest(doc(layers=[{**layers[0], "digest": "sha512:" + "a" * 128}]))
    with pytest.raises(SnapshotError, match="not a keepwarm snapshot"):
        parse_oci_manifest(doc(config={**good_cfg, "mediaType": "application/vnd.oci.image.config.v1+json"}))
    with pytest.raises(SnapshotError, match="media type"):
        parse_oci_manifest(doc(layers=[{**layers[0], "mediaType": "application/vnd.oci.image.layer.v1.tar"}]))
    # a real artifact in the registry whose layers miss one of the snapshot's blobs: refused naming it
    with client(proxy, "kw/short") as c:
        push(store, "syn", c)
        body = doc(layers=layers[1:])
        r = httpx.put(c.url("manifests/v1"), content=body,
                      headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
        assert r.status_code == 201, r.text
        dst = Store(tmp_path / "dst")
        missing = sorted(mf.blobs(m))[0]
        with pytest.raises(SnapshotError, match=f"blob {missing} of the snapshot is not a layer"):
            pull(dst, c)
    assert not dst.root.exists() or not any(dst.blobs_dir.iterdir())


# -- the OCI image index of a snapshot with the two layers ---------------------------------------------------------
# A machine of another kind: a daemon whose oneDNN and ATen are capped below this CPU (other packs, int4 order).
FOREIGN = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "default"}


def home_with(tmp_path, store: Store, name: str = "home") -> dict[str, str]:
    """A CLI environment whose store is ``store`` and whose runtime dir has no daemon."""
    home = tmp_path / name
    home.mkdir()
    os.symlink(store.root, home / "store")
    return {**os.environ, "KEEPWARM_HOME": str(home), "KEEPWARM_RUNTIME_DIR": str(tmp_path / f"{name}-rt")}


def get_v2(proxy, repo: str, what: str, accept: str) -> httpx.Response:
    r = httpx.get(f"http://{proxy.host}/v2/{repo}/{what}", headers={"Accept": accept})
    assert r.status_code == 200, r.text
    return r


def image_blob(m: dict, key: str) -> str:
    return next(p["image"]["digest"] for p in m["models"][0]["platforms"] if p["platform"]["key"] == key)


def test_layered_push_writes_an_index_as_clients_read_it(proxy, tmp_path) -> None:
    store = Store(tmp_path / "src").ensure()
    arm, cuda = fake_platform("cpu-arm", arch="aarch64"), fake_platform("cuda-sm90", device="cuda")
    m = synthetic_layered(store, "lay", ["cpu-a", arm, cuda])
    env = home_with(tmp_path, store)
    r = kw_cli(env, "snapshot", "push", "lay", f"{proxy.host}/kw/index:v1", "--insecure")
    assert r.returncode == 0, r.stderr
    assert "an OCI index: the portable layer + 3 platform image(s) (cpu-a, cpu-arm, cuda-sm90)" in r.stdout
    # every manifest the index names is PUT by digest, and only then the index by tag
    puts = [path.rsplit("/", 1)[-1] for _, path, _ in proxy.requests("PUT", "/manifests/")]
    assert puts[-1] == "v1" and len(puts) == 5 and all(p.startswith("sha256:") for p in puts[:4])

    got = get_v2(proxy, "kw/index", "manifests/v1", f"{MEDIA_INDEX}, {MEDIA_MANIFEST}")
    assert got.headers["content-type"] == MEDIA_INDEX
    index = got.json()
    assert f"sha256:{hashlib.sha256(got.content).hexdigest()}" in r.stdout  # the digest the push reported
    assert (index["mediaType"], index["artifactType"], index["annotations"]["io.keepwarm.snapshot.name"]) == (
        MEDIA_INDEX, ARTIFACT_TYPE, "lay")
    portable, *plats = index["manifests"]
    assert portable["annotations"] == {"io.keepwarm.platform": "portable"} and "platform" not in portable
    def notes(entry: dict) -> dict:
        assert all(k.startswith("io.keepwarm.platform.") for k in entry["annotations"])
        return {k.removeprefix("io.keepwarm.platform."): v for k, v in entry["annotations"].items()}

    assert plats[0]["platform"] == {"architecture": "amd64", "os": "linux"}
    assert notes(plats[0]) == {"key": fake_platform("cpu-a")["key"], "name": "cpu-a", "device": "cpu",
                               "isa": "avx2,fma", "pack_key": "kcpu-a", "int4_layout": "int4_cpu_x"}
    assert plats[1]["platform"] == {"architecture": "arm64", "os": "linux"} and notes(plats[1])["key"] == arm["key"]
    assert "platform" not in plats[2]  # a CUDA descriptor names no host CPU
    assert notes(plats[2]) == {"key": cuda["key"], "name": "cuda-sm90", "device": "cuda", "capability": "9.0"}

    # the manifests, as a client fetches them by digest: config and layers
    def manifest(entry: dict) -> dict:
        body = get_v2(proxy, "kw/index", f"manifests/{entry['digest']}", MEDIA_MANIFEST)
        assert hashlib.sha256(body.content).hexdigest() == entry["digest"][7:] and entry["mediaType"] == MEDIA_MANIFEST
        return body.json()

    pm = manifest(portable)
    assert pm["config"]["mediaType"] == MEDIA_CONFIG and pm["artifactType"] == ARTIFACT_TYPE
    assert get_v2(proxy, "kw/index", f"blobs/{pm['config']['digest']}", "*/*").content == mf.dumps(m).encode()
    assert {d["digest"][7:] for d in pm["layers"]} == set(mf.blobs(mf.without_platforms(m, set())))
    for entry, p in zip(plats, m["models"][0]["platforms"], strict=True):
        doc = manifest(entry)
        assert doc["config"]["mediaType"] == MEDIA_PLATFORM
        assert get_v2(proxy, "kw/index", f"blobs/{doc['config']['digest']}", "*/*").json() == p["platform"]
        assert [d["digest"][7:] for d in doc["layers"]] == sorted([p["image"]["digest"], p["image_manifest"]["digest"]])
        assert all(d["mediaType"] == MEDIA_BLOB for d in doc["layers"])
    # the same snapshot gives the same bytes: pushed again, the same index digest and no blob uploaded
    again = kw_cli(env, "snapshot", "push", "lay", f"{proxy.host}/kw/index:v2", "--insecure")
    assert f"sha256:{hashlib.sha256(got.content).hexdigest()}" in again.stdout and "0 uploaded" in again.stdout


def test_pull_of_an_index_fetches_the_portable_layer_and_only_this_platform(proxy, tmp_path) -> None:
    src = Store(tmp_path / "src").ensure()
    m = synthetic_layered(src, "lay", ["cpu-a", "cpu-b"])
    a, b = fake_platform("cpu-a")["key"], fake_platform("cpu-b")["key"]
    with client(proxy, "kw/pick") as c:
        push(src, "lay", c)
    portable = mf.blobs(mf.without_platforms(m, set()))
    b_blobs = {p["image"]["digest"] for p in m["models"][0]["platforms"][1:]} | {
        p["image_manifest"]["digest"] for p in m["models"][0]["platforms"][1:]}

    proxy.log.clear()  # on "the other" platform (b): the portable layer and b's image, nothing of a's
    dst = Store(tmp_path / "dst")
    with client(proxy, "kw/pick") as c:
        res = pull(dst, c, platform_key=lambda: b)
    fetched = {path.rsplit("sha256:", 1)[1] for _, path, _ in proxy.requests("GET", "/blobs/sha256:")}
    config = hashlib.sha256(mf.dumps(m).encode()).hexdigest()
    platform_config = hashlib.sha256(json.dumps(fake_platform("cpu-b"), sort_keys=True,
                                                separators=(",", ":")).encode()).hexdigest()
    assert fetched == {*portable, *b_blobs, config, platform_config}
    assert (res.index, res.platform, res.downloaded, res.skipped) == (True, fake_platform("cpu-b"), 7, 0)
    assert res.downloaded_bytes == sum(mf.blobs(m)[d] for d in [*portable, *b_blobs])
    assert not dst.has_blob(image_blob(m, a)) and dst.has_blob(image_blob(m, b))
    assert dst.load("lay") == mf.without_platforms(m, {b})

    # a key matching no platform: the portable layer only; into a store holding it, nothing downloaded
    with client(proxy, "kw/pick") as c:
        res = pull(dst, c, rename="bare", platform_key="0" * 24)
    assert (res.platform, res.downloaded, res.skipped, res.imported.blobs) == (None, 0, 5, 5)
    assert dst.load("bare") == {**mf.without_platforms(m, set()), "name": "bare"}
    # the CLI with no daemon to ask: this CPU's key (cpu-a / cpu-b are not it), said in the pull's line
    env = home_with(tmp_path, Store(tmp_path / "cli").ensure())
    r = kw_cli(env, "snapshot", "pull", f"{proxy.host}/kw/pick:v1", "--insecure")
    assert r.returncode == 0, r.stderr
    assert "pulled lay" in r.stdout and "the portable layer only (no image for this machine's platform" in r.stdout
    assert "5 blobs, 5 downloaded" in r.stdout


def test_a_snapshot_made_before_the_two_layers_is_a_plain_manifest_and_pulls_as_before(proxy, src, tmp_path) -> None:
    store, m = src
    with client(proxy, "kw/plain") as c:
        r = push(store, "syn", c)
    got = get_v2(proxy, "kw/plain", "manifests/v1", f"{MEDIA_INDEX}, {MEDIA_MANIFEST}")
    assert got.headers["content-type"] == MEDIA_MANIFEST and r.platforms == ()
    assert got.json()["config"]["mediaType"] == MEDIA_CONFIG and len(got.json()["layers"]) == 4

    def never() -> str:
        raise AssertionError("a plain manifest needs no platform key")

    dst = Store(tmp_path / "dst")
    with client(proxy, "kw/plain") as c:
        res = pull(dst, c, platform_key=never)
    assert (res.index, res.platform, res.downloaded) == (False, None, 4) and dst.load("syn") == m


def test_hostile_or_inconsistent_indexes_are_refused(proxy, tmp_path) -> None:
    src = Store(tmp_path / "src").ensure()
    synthetic_layered(src, "lay", ["cpu-a", "cpu-b"])
    with client(proxy, "kw/badindex") as c:
        push(src, "lay", c)
        index = json.loads(c.get_manifest((MEDIA_INDEX,))[0])
    entries = index["manifests"]

    def doc(**kw) -> bytes:
        return json.dumps({**index, **kw}).encode()

    assert set(parse_oci_index(doc()).platforms) == {fake_platform(n)["key"] for n in ("cpu-a", "cpu-b")}
    with pytest.raises(SnapshotError, match="not a keepwarm snapshot"):
        parse_oci_index(doc(artifactType="application/vnd.example"))
    with pytest.raises(SnapshotError, match="0 portable manifests"):
        parse_oci_index(doc(manifests=entries[1:]))
    with pytest.raises(SnapshotError, match=r"manifests\[3\] is neither"):
        parse_oci_index(doc(manifests=[*entries, entries[1]]))
    # in the registry: an index naming one of the snapshot's two platforms is refused, nothing written
    with client(proxy, "kw/badindex") as c:
        c.put_manifest(doc(manifests=entries[:2]), media_type=MEDIA_INDEX)
        dst = Store(tmp_path / "dst")
        with pytest.raises(SnapshotError, match="not the snapshot's platforms"):
            pull(dst, c, platform_key=fake_platform("cpu-a")["key"])
        # a platform manifest whose descriptor is another platform's: refused naming it
        swapped = [entries[0], {**entries[1], "digest": entries[2]["digest"], "size": entries[2]["size"]},
                   {**entries[2], "digest": entries[1]["digest"], "size": entries[1]["size"]}]
        c.put_manifest(doc(manifests=swapped), media_type=MEDIA_INDEX)
        with pytest.raises(SnapshotError, match="describes another platform"):
            pull(dst, c, platform_key=fake_platform("cpu-a")["key"])
    assert not dst.root.exists() or not any(dst.blobs_dir.iterdir())


@pytest.mark.slow
def test_layered_snapshot_of_two_machines_pulls_each_platform_and_restores(reg, tiny_llama, tmp_path) -> None:
    """A machine of another kind (A) creates the snapshot, this machine's kind (B) adds its image in the same store;
    pushed as a two-platform index. A third store on B's daemon pulls the portable layer and B's image, never A's,
    and restores B's image as it is; a fourth on A's kind gets A's image."""
    a, b = Side(tmp_path / "AB"), Side(tmp_path / "AB")  # one store, two daemons
    foreign = {**a.env, **FOREIGN}
    a.start_daemon(env=foreign)
    b.start_daemon()
    c, d = Side(tmp_path / "C", runtime_dir=b.rt), Side(tmp_path / "D", runtime_dir=a.rt)  # stores on B's, A's
    try:
        cfg = tmp_path / "server.toml"
        cfg.write_text(f'model = "{tiny_llama}"\nquantization = "int4"\ndtype = "bfloat16"\n')
        kw(foreign, "snapshot", "create", "s1", "--from-config", cfg, "--preload")
        kw(b.env, "snapshot", "add-platform", "s1")
        m = a.store.load("s1")
        key_a, key_b = a.status()["platform"]["key"], b.status()["platform"]["key"]
        assert [p["platform"]["key"] for p in m["models"][0]["platforms"]] == [key_a, key_b]
        img_a, img_b = image_blob(m, key_a), image_blob(m, key_b)
        assert len({img_a, img_b, m["models"][0]["portable"]["image"]["digest"]}) == 3
        ref = f"{reg.host}/kw/two:v1"
        assert "+ 2 platform image(s)" in kw(b.env, "snapshot", "push", "s1", ref, "--insecure").stdout

        r = kw(c.env, "snapshot", "pull", ref, "--insecure")
        name_b = b.status()["platform"]["name"]
        assert f"the portable layer and the {name_b} image (platform {key_b})" in r.stdout
        assert c.store.has_blob(img_b) and not c.store.has_blob(img_a)
        assert c.store.load("s1") == mf.without_platforms(m, {key_b})
        r = kw(c.env, "snapshot", "restore", "s1", "--server-config", tmp_path / "c.toml")
        assert "the image made for this platform loaded" in r.stdout, r.stdout
        assert [x["origin"] for x in c.status()["models"]] == ["image"]

        with Registry(Reference.parse(ref), insecure=True) as registry:  # on A's kind: A's image, not B's
            assert pull(d.store, registry, platform_key=key_a).platform == a.status()["platform"]
        assert d.store.has_blob(img_a) and not d.store.has_blob(img_b)
    finally:
        a.stop()
        b.stop()
