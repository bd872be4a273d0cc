"""The snapshot store as a unit (keepwarm.snapshot.store): blobs, verification, the arena index, gc of index
entries and staging leftovers, file modes. Fast, no daemon; written to kill surviving mutants (docs/testing.md)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from keepwarm.snapshot.store import BlobRef, SnapshotError, Store


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "store").ensure()


def test_blob_round_trip_modes_and_verify(store: Store) -> None:
    data = b"keepwarm" * 1000
    ref = store.put_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    assert ref == BlobRef(digest, len(data), True) and store.put_bytes(data).new is False
    assert store.read_blob(digest) == data and store.has_blob(digest, len(data))
    assert not store.has_blob(digest, len(data) + 1)
    assert oct(os.stat(store.blob_path(digest)).st_mode & 0o777) == "0o444"
    store.verify_blob(digest, len(data))  # a good blob verifies (equal digests, not the same object)
    with pytest.raises(SnapshotError, match="is corrupt: 1 bytes, the manifest says 8000"):
        path = store.blob_path(hashlib.sha256(b"x").hexdigest())
        path.write_bytes(b"y")
        store.verify_blob(path.name, 8000)
    with pytest.raises(SnapshotError, match=f"is corrupt: its content hashes to {hashlib.sha256(b'y').hexdigest()}"):
        store.verify_blob(path.name, 1)
    with pytest.raises(SnapshotError, match="is missing from the store"):
        store.verify_blob("0" * 64, 1)


def test_write_atomic_mode(store: Store, tmp_path) -> None:
    target = tmp_path / "store" / "x" / "cfg.toml"
    store.write_atomic(target, b"a = 1\n")
    assert target.read_bytes() == b"a = 1\n" and oct(target.stat().st_mode & 0o777) == "0o600"
    store.write_atomic(target, b"a = 2\n", 0o644)
    assert oct(target.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in target.parent.iterdir()] == ["cfg.toml"]  # no temp file left behind


def test_arena_index_remembers_and_checks_the_blob(store: Store) -> None:
    key = Store.arena_key("d" * 64, [["x", 1]], 5)
    assert key != Store.arena_key("d" * 64, [["x", 1]], 6)
    assert store.arena_lookup(key, 5) is None  # nothing remembered: None, not an error
    ref = store.put_bytes(b"arena")
    store.arena_remember(key, ref)
    assert json.loads((store.index_dir / key).read_text())["digest"] == ref.digest
    assert store.arena_lookup(key, 5) == BlobRef(ref.digest, 5, False)
    assert store.arena_lookup(key, 6) is None  # another size: not that blob
    (store.index_dir / key).write_text("not json")
    assert store.arena_lookup(key, 5) is None


def test_gc_drops_unnamed_blobs_stale_index_entries_and_staging(store: Store) -> None:
    orphan = store.put_bytes(b"orphan")
    store.arena_remember("k1", orphan)
    (store.index_dir / "k2").write_text("{}")
    staged_dir = store.staging_dir("create")
    (staged_dir / "part").write_bytes(b"x")
    staged_file = store.tmp_dir / "loose"
    staged_file.write_bytes(b"y")
    removed, freed = store.gc()
    assert (removed, freed) == (1, len(b"orphan"))
    assert not store.has_blob(orphan.digest)
    assert list(store.index_dir.iterdir()) == [] and list(store.tmp_dir.iterdir()) == []
