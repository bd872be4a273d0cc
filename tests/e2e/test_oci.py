"""Snapshots through an OCI registry (keepwarm.snapshot.oci) against a real one: Debian's docker-registry (the CNCF
distribution server) behind a counting, fault-injecting proxy (tests/support/registry.py). Push and pull of a small
snapshot, no blob uploaded twice, a corrupted blob refused with nothing written, interrupted uploads resumed, Bearer
token auth with docker-config credentials, plain HTTP refused without --insecure, hostile manifests refused. The
end-to-end push -> pull -> restore -> same greedy text is in test_snapshot.py (it shares that module's daemon)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys

import httpx
import pytest
from support.registry import registry_env
from support.snapshots import synthetic

from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.manifest import SnapshotError
from keepwarm.snapshot.oci import (
    MEDIA_BLOB,
    MEDIA_CONFIG,
    Credentials,
    Reference,
    Registry,
    descriptor,
    docker_config_credentials,
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
