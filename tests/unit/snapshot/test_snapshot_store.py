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


@pytest.mark.parametrize(("limit", "depth"), [(None, 2), (5 * 4096 + 123, 2), (None, 4), (5 * 4096 + 123, 4)])
def test_chunks_written_intact_by_a_slow_writer(tmp_path, monkeypatch: pytest.MonkeyPatch, limit, depth) -> None:
    """file_chunks reads ahead into its other buffers while pipe_hashing's thread still writes the first: with a
    writer slower than the reader, too few buffers (or no wait for the oldest write) corrupt the copy. With
    writeback every 2 chunks, the kernel is asked to write each finished stretch, in order, once."""
    import time

    from keepwarm.snapshot import store as store_mod

    monkeypatch.setattr(store_mod, "CHUNK", 4096)  # many chunks from a small file
    data = os.urandom(5 * 4096 + 123 + (777 if limit is None else 4096))
    src = tmp_path / "src"
    src.write_bytes(data)
    real_write = store_mod._write_all

    def slow_write(fd: int, mv: memoryview) -> None:
        time.sleep(0.02)  # the reader refills the other buffer meanwhile
        real_write(fd, mv)

    monkeypatch.setattr(store_mod, "_write_all", slow_write)
    kicks: list[tuple[int, int]] = []
    real_kick = store_mod._start_writeback()
    assert real_kick is not None  # Linux: libc has sync_file_range

    def kick(fd: int, off: int, n: int) -> int:
        kicks.append((off, n))
        return real_kick(fd, off, n)

    monkeypatch.setattr(store_mod, "_start_writeback", lambda: kick)
    writeback = 2 * 4096 if depth > 2 else 0
    fd = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with open(src, "rb", buffering=0) as f:
            digest, size = store_mod.pipe_hashing(store_mod.file_chunks(f, limit, depth), fd, depth=depth,
                                                  writeback=writeback)
    finally:
        os.close(fd)
    want = data if limit is None else data[:limit]
    assert (digest, size) == (hashlib.sha256(want).hexdigest(), len(want))
    assert (tmp_path / "dst").read_bytes() == want
    assert kicks == ([(off, 2 * 4096) for off in range(0, len(want) - 2 * 4096 + 1, 2 * 4096)] if writeback else [])


def test_file_chunks_refuses_short_data(tmp_path) -> None:
    from keepwarm.snapshot.store import file_chunks

    (tmp_path / "src").write_bytes(b"abc")
    with open(tmp_path / "src", "rb", buffering=0) as f, pytest.raises(SnapshotError, match="2 bytes missing"):
        list(file_chunks(f, 5))


def test_default_root_dirs_modes_and_empty_sizes(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEPWARM_HOME", str(tmp_path / "home"))
    store = Store()
    assert store.root == tmp_path / "home" / "store"
    assert store.stored_bytes() == 0  # nothing made yet: zero, not an error
    store.ensure()
    for d in (store.root, store.blobs_dir, store.snapshots_dir, store.index_dir, store.tmp_dir):
        assert oct(d.stat().st_mode & 0o777) == "0o700", d


def test_gc_refuses_while_a_create_holds_the_store(store: Store) -> None:
    """gc removes blobs, so it takes the store exclusively: a create/restore/import (shared) holding it stops it."""
    with store.lock(), pytest.raises(SnapshotError, match="is in use"):
        store.gc()
    assert store.gc() == (0, 0)  # free again
