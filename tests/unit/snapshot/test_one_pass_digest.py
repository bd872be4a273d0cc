"""One pass over the bytes (issue 14), as units: the streaming arena digest equals the whole-arena one whatever the
chunking, the store hands every chunk to a second consumer in the same pass and lands nothing a check refuses, the
arena manifest names its digest scheme (old manifests read, unknown schemes refused), and the daemon's image fill
returns the file's sha256 and the arena digest from one read."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random

import blake3
import pytest
import torch

from keepwarm.formats.arena import (
    ARENA_DIGEST_SCHEME,
    ArenaHasher,
    ArenaManifest,
    CpuArenaFile,
    TensorEntry,
    align,
    arena_digest_of,
)
from keepwarm.snapshot.manifest import SnapshotError
from keepwarm.snapshot.store import Store, file_chunks, pipe_hashing


def _entries(sizes: list[int]) -> tuple[tuple[TensorEntry, ...], int]:
    out, off = [], 0
    for i, n in enumerate(sizes):
        out.append(TensorEntry(f"w{i}", "", off, n, "uint8", (n,)))
        off = align(off + n)
    return tuple(out), off


@pytest.mark.parametrize("scheme", ["blake3-tensors", "sha256-tensors"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_arena_digest_equals_the_whole_arena_one(seed: int, scheme: str) -> None:
    rng = random.Random(seed)
    entries, total = _entries([rng.choice([0, 1, 255, 256, 257, 5000, 70000]) for _ in range(40)])
    flat = torch.randint(0, 256, (total + 100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    want = arena_digest_of(flat, entries, 2, scheme)
    data = memoryview(flat.numpy())
    h, off = ArenaHasher(entries, scheme), 0
    while off < len(data):  # random chunk boundaries, some inside entries, some in the padding
        n = rng.choice([1, 7, 256, 1000, 4096, 65536])
        h.feed(off, data[off:off + n])
        off += n
    assert h.hexdigest() == want
    flat[entries[-2].offset] ^= 1  # one flipped byte inside an entry changes the digest
    h2 = ArenaHasher(entries, scheme)
    h2.feed(0, memoryview(flat.numpy()))
    assert h2.hexdigest() != want


@pytest.mark.parametrize(("scheme", "leaf"), [("blake3-tensors", blake3.blake3), ("sha256-tensors", hashlib.sha256)])
def test_arena_digest_is_sha256_over_the_label_and_each_entry_leaf(scheme: str, leaf) -> None:
    """Computed here from the definition (the hash packages directly), not through keepwarm's helpers; the two
    schemes give different digests of the same bytes."""
    entries, total = _entries([0, 300, 70000, 5])
    flat = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    data = bytes(flat.numpy())
    h = hashlib.sha256(b"arena")
    for e in entries:
        h.update(leaf(data[e.offset:e.offset + e.nbytes]).digest())
    assert arena_digest_of(flat, entries, 2, scheme) == h.hexdigest()
    other = "sha256-tensors" if scheme == "blake3-tensors" else "blake3-tensors"
    assert arena_digest_of(flat, entries, 2, other) != h.hexdigest()


def test_pipe_hashing_hands_every_chunk_in_order_to_the_second_consumer(tmp_path, monkeypatch) -> None:
    import keepwarm.snapshot.store as store_mod

    monkeypatch.setattr(store_mod, "CHUNK", 1000)  # many chunks through the two alternating buffers
    data = os.urandom(10_500)
    got = bytearray()
    offsets = []

    def also(offset: int, mv: memoryview) -> None:
        offsets.append(offset)
        got.extend(mv)

    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        digest, size = pipe_hashing(file_chunks(io.BytesIO(data)), fd, also)
    finally:
        os.close(fd)
    assert (digest, size) == (hashlib.sha256(data).hexdigest(), len(data))
    assert bytes(got) == data and offsets == list(range(0, len(data), 1000))
    assert (tmp_path / "out").read_bytes() == data


def test_a_refusing_check_lands_nothing(tmp_path) -> None:
    store = Store(tmp_path / "store").ensure()

    def refuse() -> None:
        raise SnapshotError("arena digest differs")

    with pytest.raises(SnapshotError, match="arena digest differs"):
        store.put_chunks([memoryview(b"x" * 5000)], check=refuse)
    assert list(store.blobs_dir.iterdir()) == []


def _manifest_json(**extra) -> str:
    m = ArenaManifest(1, "f" * 64, "a" * 64, "/m", "none", "float32", "cpu", 0, (), {}, "{}", None, ())
    d = json.loads(m.to_json())
    d.update(extra)
    return json.dumps(d)


def test_arena_manifest_names_its_digest_scheme() -> None:
    assert json.loads(_manifest_json())["arena_digest_scheme"] == ARENA_DIGEST_SCHEME == "blake3-tensors"
    old = json.loads(_manifest_json())
    del old["arena_digest_scheme"]  # written before the field existed: sha256 leaves
    assert ArenaManifest.from_json(json.dumps(old)).arena_digest_scheme == "sha256-tensors"
    assert ArenaManifest.from_json(_manifest_json(arena_digest_scheme="sha256-tensors")).arena_digest_scheme == \
        "sha256-tensors"
    with pytest.raises(ValueError, match="arena digest scheme 'blake3-tree'"):
        ArenaManifest.from_json(_manifest_json(arena_digest_scheme="blake3-tree"))


@pytest.mark.parametrize("scheme", ["blake3-tensors", "sha256-tensors"])  # the latter: images made before BLAKE3
def test_image_fill_checks_file_and_arena_in_one_read(tmp_path, scheme: str) -> None:
    from keepwarm.daemon.image import fill_cpu

    entries, total = _entries([3000, 0, 2_500_000, 17])
    image = tmp_path / "image"
    image.write_bytes(os.urandom(total))
    flat = torch.frombuffer(bytearray(image.read_bytes()), dtype=torch.uint8)
    m = ArenaManifest(1, "f" * 64, arena_digest_of(flat, entries, 2, scheme), "/m", "none", "float32", "cpu", total,
                      entries, {}, "{}", None, (), arena_digest_scheme=scheme)
    storage = CpuArenaFile.create(tmp_path / "arena", total)
    try:
        file_digest, arena_digest = fill_cpu(storage, image, total, m, file_digest=True)
        assert file_digest == hashlib.sha256(image.read_bytes()).hexdigest()
        assert arena_digest == m.arena_digest
        assert bytes(storage.flat.numpy()) == image.read_bytes()
        assert fill_cpu(storage, image, total, m)[0] is None  # no file digest asked: none computed
    finally:
        storage.close()


def test_image_fill_into_an_unreserved_arena_over_more_chunks_than_buffers(tmp_path) -> None:
    """The image path's arena is not fallocated (fill_cpu writes every byte): an image of more chunks than fill_cpu
    has buffers comes out byte-equal with the right digests; a short image is refused naming where it ended."""
    from keepwarm.daemon.image import CHUNK, RING, ImageError, fill_cpu

    entries, total = _entries([3000, (RING + 2) * CHUNK + 12345, 17])
    image = tmp_path / "image"
    image.write_bytes(os.urandom(total))
    flat = torch.frombuffer(bytearray(image.read_bytes()), dtype=torch.uint8)
    m = ArenaManifest(1, "f" * 64, arena_digest_of(flat, entries), "/m", "none", "float32", "cpu", total, entries,
                      {}, "{}", None, ())
    storage = CpuArenaFile.create(tmp_path / "arena", total, reserve=False)
    try:
        file_digest, arena_digest = fill_cpu(storage, image, total, m, file_digest=True)
        assert file_digest == hashlib.sha256(image.read_bytes()).hexdigest()
        assert arena_digest == m.arena_digest
        assert bytes(storage.flat.numpy()) == image.read_bytes()
    finally:
        storage.close()
    short = tmp_path / "short"
    short.write_bytes(image.read_bytes()[:total - 100])
    storage = CpuArenaFile.create(tmp_path / "arena2", total, reserve=False)
    try:
        with pytest.raises(ImageError, match=f"ended after {total - 100} of {total} bytes"):
            fill_cpu(storage, short, total, m)
    finally:
        storage.close()


def test_image_bytes_between_tensors_must_be_zero(tmp_path) -> None:
    from keepwarm.daemon.image import ImageError, check_gaps_zero, gaps

    entries, total = _entries([3000, 0, 2_500_000, 17])
    m = ArenaManifest(1, "f" * 64, "0" * 64, "/m", "none", "float32", "cpu", total, entries, {}, "{}", None, ())
    holes = gaps(m, total)
    covered = sorted((e.offset, e.offset + e.nbytes) for e in entries if e.nbytes)
    assert holes and all(lo < hi for lo, hi in holes)  # alignment padding after 3000, 2,500,000 and 17 bytes
    assert sum(hi - lo for lo, hi in holes) + sum(hi - lo for lo, hi in covered) == total
    assert not any(lo < c_hi and c_lo < hi for lo, hi in holes for c_lo, c_hi in covered)
    storage = CpuArenaFile.create(tmp_path / "arena", total)
    try:
        storage.flat.fill_(7)
        for lo, hi in holes:
            storage.flat[lo:hi] = 0
        check_gaps_zero(storage, m, total, tmp_path / "image")  # tensors may hold anything; the padding is zero
        lo, hi = holes[-1]
        storage.flat[hi - 1] = 1
        with pytest.raises(ImageError, match=f"is corrupt: a byte between its tensors is not zero \\(in {lo}"):
            check_gaps_zero(storage, m, total, tmp_path / "image")
    finally:
        storage.close()


def test_a_cuda_image_is_checked_in_host_memory_the_same_way_before_any_copy(tmp_path) -> None:
    from keepwarm.daemon.image import ImageError, fill_cuda, gaps

    entries, total = _entries([3000, 2_500_000, 17])
    data = bytearray(os.urandom(total))
    m0 = ArenaManifest(1, "f" * 64, "0" * 64, "/m", "none", "float32", "cpu", total, entries, {}, "{}", None, ())
    for lo, hi in gaps(m0, total):
        data[lo:hi] = bytes(hi - lo)
    lo, hi = gaps(m0, total)[0]
    data[lo] = 9  # padding, outside every tensor: the arena digest cannot see it
    image = tmp_path / "image"
    image.write_bytes(bytes(data))
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    m = ArenaManifest(1, "f" * 64, arena_digest_of(flat, entries), "/m", "none", "float32", "cuda:0", total, entries,
                      {}, "{}", None, ())
    # refused from the host mapping, before the (here absent) device arena is touched
    with pytest.raises(ImageError, match=f"a byte between its tensors is not zero \\(in {lo}"):
        fill_cuda(None, image, total, m, 1)  # type: ignore[arg-type]
