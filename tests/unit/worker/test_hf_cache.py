"""A Hugging Face id as the model resolves offline in the local Hugging Face cache, as vLLM does with
``HF_HUB_OFFLINE=1`` (issue 46): the cache is laid out as huggingface_hub lays it out (blobs, snapshot symlinks,
refs), huggingface_hub itself reads it back (``scan_cache_dir``, ``try_to_load_from_cache``, ``snapshot_download``
with ``local_files_only``), and keepwarm finds the same directory for a branch, a tag and a commit, under
``HF_HUB_CACHE``, ``HF_HOME`` and ``--download-dir``; an id that is not there is one line saying where it looked; a
real `keepwarm serve ORG/NAME` serves it under the id.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.ports import free_port
from support.serve import wait_healthy

from keepwarm.worker.default_model import hf_cache_dir, resolve_model

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def lay_out(cache: Path, repo_id: str, files_dir: str, commit: str, refs: tuple[str, ...]) -> Path:
    """One revision of a model repo in huggingface_hub's cache layout: file contents in blobs/ by hash, the snapshot
    a folder of relative symlinks into blobs/, each ref a file holding the commit."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(Path(files_dir).iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hf_cache(tmp_path: Path, tiny_llama: str) -> tuple[Path, Path, Path]:
    cache = tmp_path / "hub"
    main = lay_out(cache, REPO, tiny_llama, "a" * 40, ("main",))
    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 512}))
    tagged = lay_out(cache, REPO, str(other), "b" * 40, ("v1",))
    return cache, main, tagged


def test_huggingface_hub_reads_the_layout_back(hf_cache) -> None:
    from huggingface_hub import scan_cache_dir, snapshot_download, try_to_load_from_cache

    cache, main, tagged = hf_cache
    info = scan_cache_dir(cache)
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {"a" * 40: {"main"}, "b" * 40: {"v1"}}
    assert try_to_load_from_cache(REPO, "config.json", cache_dir=cache) == str(main / "config.json")
    assert try_to_load_from_cache(REPO, "config.json", cache_dir=cache, revision="v1") == str(tagged / "config.json")
    for rev, want in ((None, main), ("main", main), ("v1", tagged), ("b" * 40, tagged)):
        hub = snapshot_download(REPO, cache_dir=cache, revision=rev, local_files_only=True)
        assert hub == str(want) == resolve_model(REPO, rev, str(cache)), rev


def test_the_cache_directory_is_huggingface_hubs(tmp_path, monkeypatch) -> None:
    """HF_HUB_CACHE over HF_HOME over XDG_CACHE_HOME over ~/.cache, as huggingface_hub's constants decide."""
    cases = [{"HF_HUB_CACHE": str(tmp_path / "a")}, {"HF_HOME": str(tmp_path / "b")},
             {"HF_HOME": str(tmp_path / "b"), "HF_HUB_CACHE": str(tmp_path / "c")},
             {"XDG_CACHE_HOME": str(tmp_path / "x")}, {}]
    for case in cases:
        env = {k: v for k, v in os.environ.items()
               if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")}
        env.update(case)
        hub = subprocess.run([sys.executable, "-c", "import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)"],
                             env=env, capture_output=True, text=True, check=True).stdout.strip()
        for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
            monkeypatch.delenv(k, raising=False)
        for k, v in case.items():
            monkeypatch.setenv(k, v)
        assert str(hf_cache_dir()) == hub, case
    assert hf_cache_dir("/data/models") == Path("/data/models")


def test_resolution_from_the_environment_and_what_is_not_there(hf_cache, monkeypatch, tmp_path) -> None:
    cache, main, tagged = hf_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_model(REPO) == str(main)
    assert resolve_model(REPO, "v1") == str(tagged)
    assert resolve_model(str(tmp_path)) == str(tmp_path)  # a local path is itself
    with pytest.raises(FileNotFoundError) as e:
        resolve_model(REPO, "v2")
    assert str(e.value) == (f"model {REPO!r} is not a local path, and the Hugging Face cache has no revision 'v2' of "
                            f"it (looked for {cache}/models--HuggingFaceTB--SmolLM2-135M-Instruct/refs/v2; keepwarm "
                            f"does not download: fetch it with `hf download {REPO}` or give --download-dir / "
                            "HF_HUB_CACHE)")
    with pytest.raises(FileNotFoundError, match="looked for .*models--org--missing/refs/main"):
        resolve_model("org/missing")


def _kw(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "keepwarm.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def test_serve_of_an_id_not_in_the_cache_is_one_line(tmp_path) -> None:
    t = time.monotonic()
    r = _kw("serve", "org/missing", "--port", str(free_port()), "--download-dir", str(tmp_path), env={})
    assert r.returncode == 2 and time.monotonic() - t < 2.0
    assert r.stderr.strip().splitlines() == [
        f"error: model 'org/missing' is not a local path, and the Hugging Face cache has no revision 'main' of it "
        f"(looked for {tmp_path}/models--org--missing/refs/main; keepwarm does not download: fetch it with "
        "`hf download org/missing` or give --download-dir / HF_HUB_CACHE)"]


@pytest.mark.slow
def test_serve_an_id_from_the_cache(hf_cache, tmp_path) -> None:
    """`keepwarm serve ORG/NAME --revision v1 --tokenizer ORG/NAME --tokenizer-revision main` with the cache in
    HF_HOME: the model from the tagged snapshot, served as ORG/NAME, the tokenizer from main's."""
    cache, main, tagged = hf_cache
    home = tmp_path / "hf-home"
    home.mkdir()
    (home / "hub").symlink_to(cache)
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "keepwarm.cli.main", "serve", REPO, "--revision", "v1",
                                 "--tokenizer", REPO, "--tokenizer-revision", "main", "--no-daemon", "--dtype",
                                 "float32", "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "HF_HOME": str(home),
                                                               "OMP_NUM_THREADS": "1"})
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, log.read_text, 120)
        assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == REPO
        got = httpx.get(base + "/keepwarm/config").json()
        assert got["config"]["model"] == str(home / "hub" / tagged.relative_to(cache))
        assert got["engine"]["max_model_len"] == 512  # the tagged revision's config.json
        assert got["engine"]["tokenizer"] == str(home / "hub" / main.relative_to(cache))
        r = httpx.post(base + "/v1/completions", json={"model": REPO, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
