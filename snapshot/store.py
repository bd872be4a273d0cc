"""The content-addressed snapshot store under ``$KEEPWARM_HOME/store``.

```
store/
  blobs/sha256/<digest>     content, named by its sha256; written once, shared by every snapshot naming it
  snapshots/<name>.json     manifests (see manifest.py)
  index/arena/<key>         cache: an arena (by its arena_digest and layout) -> the blob holding its image
  tmp/                      staging for writes and imports (gc empties it)
  .lock                     flock: shared while a command reads or adds; exclusive for gc
```

Every file lands by ``write to a temp name in the same directory -> fsync -> rename -> fsync the directory``, so a
crash leaves either nothing or a complete file under its real name, never half a blob under a digest.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import fcntl
import functools
import hashlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from keepwarm.formats.paths import keepwarm_home
from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.manifest import DIGEST_RE, SnapshotError

# 1 MiB: each chunk is still in cache while it is hashed, written and (create) fed to the arena digest. Measured
# here (docs/benchmarks.md): 8 MiB chunks read, hash and write 1.5-3x slower than 1 MiB ones.
CHUNK = 1 << 20


def default_root() -> Path:
    return keepwarm_home() / "store"


@dataclass(frozen=True)
class BlobRef:
    digest: str
    size: int
    new: bool = False  # written by this call (not already in the store)

    def ref(self) -> dict[str, Any]:
        return {"digest": self.digest, "size": self.size}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Copies to the store's disk (create, put_file): this many chunks in flight, and the kernel told to start writing
# back every WRITEBACK bytes. Without both, the final fsync waited 1.1-1.5 s for a 2 GB blob after the copy, with
# them the writes overlap the hashing (docs/benchmarks.md: create of the 1B 4.4 -> 3.0-3.3 s, `cp` + sync 2.2 s).
COPY_DEPTH = 64
WRITEBACK = 64 * CHUNK


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


@functools.cache
def _start_writeback() -> Callable[[int, int, int], int] | None:
    """libc's sync_file_range (Linux), or None where there is none: then the final fsync does all the waiting."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, off, n: fn(fd, off, n, 2)  # SYNC_FILE_RANGE_WRITE: start writing, do not wait


class _Writer:
    """Writes chunks to ``fd`` in order (one thread) and, with ``writeback``, asks the kernel every that many bytes
    to start writing them to disk."""

    def __init__(self, fd: int, writeback: int) -> None:
        self.fd, self.writeback = fd, writeback
        self.kick = _start_writeback() if writeback else None
        self.written = self.flushed = 0

    def __call__(self, data: memoryview) -> None:
        _write_all(self.fd, data)
        self.written += len(data)
        if self.kick is not None and self.written - self.flushed >= self.writeback:
            self.kick(self.fd, self.flushed, self.written - self.flushed)
            self.flushed = self.written


def file_chunks(f: BinaryIO, limit: int | None = None, depth: int = 2) -> Iterator[memoryview]:
    """Read ``f`` in chunks into a ring of ``depth`` buffers (made as needed). A consumer must be done with chunk i
    before it asks for chunk i + depth (:func:`pipe_hashing` with the same ``depth`` is)."""
    bufs: list[bytearray] = []
    i = 0
    left = limit
    while left is None or left > 0:
        if len(bufs) < depth:
            bufs.append(bytearray(CHUNK))
        buf = memoryview(bufs[i % depth])
        want = CHUNK if left is None else min(CHUNK, left)
        n = f.readinto(buf[:want])
        if not n:
            if left:
                raise SnapshotError(f"unexpected end of data ({left} bytes missing)")
            return
        if left is not None:
            left -= n
        yield buf[:n]
        i += 1


Consumer = Callable[[int, memoryview], None]  # (offset in the stream, the chunk)


def pipe_hashing(chunks: Iterable[memoryview], fd: int | None, also: Consumer | None = None, depth: int = 2,
                 writeback: int = 0) -> tuple[str, int]:
    """sha256 and size of the chunks, hashing them in a second thread, writing them to ``fd`` (if given; see
    :class:`_Writer` for ``writeback``) in a third and handing them to ``also`` (if given; e.g. the arena digest) in
    a fourth, while this thread reads the next ones: one pass over the bytes, each chunk used by all of them while
    it is in cache, and the sha256 (the slowest, and sequential) never waits for a read. A chunk's buffer is
    released (the chunk ``depth`` later may be read into it) once all of them are done with it: ``chunks`` must come
    from a ring of at least ``depth`` buffers."""
    h = hashlib.sha256()
    size = 0
    write = _Writer(fd, writeback) if fd is not None else None
    with ThreadPoolExecutor(max_workers=1) as hasher, ThreadPoolExecutor(max_workers=1) as writer, \
            ThreadPoolExecutor(max_workers=1) as other:
        pending: collections.deque[list[Future]] = collections.deque()
        for mv in chunks:
            pending.append([hasher.submit(h.update, mv)] + ([writer.submit(write, mv)] if write is not None else []) +
                           ([other.submit(also, size, mv)] if also is not None else []))
            size += len(mv)
            while len(pending) >= depth:  # the oldest chunk used by everyone: its buffer may be refilled
                for f in pending.popleft():
                    f.result()
        for futs in pending:
            for f in futs:
                f.result()
    return h.hexdigest(), size


def hash_file(path: Path) -> tuple[str, int]:
    with open(path, "rb", buffering=0) as f:
        return pipe_hashing(file_chunks(f), None)


class Store:
    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.blobs_dir = self.root / "blobs" / "sha256"
        self.snapshots_dir = self.root / "snapshots"
        self.index_dir = self.root / "index" / "arena"
        self.tmp_dir = self.root / "tmp"

    # -- layout and locking ----------------------------------------------------------------------------------------
    def ensure(self) -> Store:
        for d in (self.root, self.blobs_dir, self.snapshots_dir, self.index_dir, self.tmp_dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self

    @contextlib.contextmanager
    def lock(self, exclusive: bool = False) -> Iterator[None]:
        """Shared: readers and writers that add (create, import, restore). Exclusive: gc, which removes blobs."""
        self.ensure()
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except BlockingIOError:
                if exclusive:
                    raise SnapshotError(f"the store {self.root} is in use (a create, restore or import runs); "
                                        "try gc again when it is done") from None
                fcntl.flock(fd, fcntl.LOCK_SH)  # a gc runs: wait for it
            yield
        finally:
            os.close(fd)

    # -- blobs -----------------------------------------------------------------------------------------------------
    def blob_path(self, digest: str) -> Path:
        if not DIGEST_RE.fullmatch(digest):
            raise SnapshotError(f"not a sha256 digest: {digest!r}")
        return self.blobs_dir / digest

    def has_blob(self, digest: str, size: int | None = None) -> bool:
        try:
            st = os.stat(self.blob_path(digest))
        except FileNotFoundError:
            return False
        return size is None or st.st_size == size

    def _temp(self, directory: Path, prefix: str = ".tmp-") -> tuple[int, Path]:
        path = directory / f"{prefix}{secrets.token_hex(8)}"
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), path

    def _land(self, tmp: Path, digest: str) -> bool:
        """Move a complete, fsynced temp file to its digest's name; False if the blob was there already."""
        final = self.blob_path(digest)
        if final.exists():
            tmp.unlink(missing_ok=True)
            return False
        os.chmod(tmp, 0o444)
        os.replace(tmp, final)
        fsync_dir(self.blobs_dir)
        return True

    def put_chunks(self, chunks: Iterable[memoryview], expect_digest: str | None = None,
                   staging: Path | None = None, also: Consumer | None = None,
                   check: Callable[[], None] | None = None, depth: int = 2) -> BlobRef:
        """Stream chunks into a blob, hashing as they are written. ``expect_digest``: refuse other content.
        ``staging``: leave the checked file there (named by digest) instead of landing it (import). ``also``: gets
        every chunk in the same pass (see :func:`pipe_hashing`); ``check``: runs before the blob lands and refuses
        it by raising (create checks the arena digest ``also`` computed). ``depth``: the chunks come from a ring of
        that many buffers (:func:`file_chunks`); at COPY_DEPTH, writeback starts as the copy goes."""
        self.ensure()
        fd, tmp = self._temp(staging or self.blobs_dir)
        try:
            try:
                digest, size = pipe_hashing(chunks, fd, also, depth, WRITEBACK if depth >= COPY_DEPTH else 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            if expect_digest is not None and digest != expect_digest:
                raise SnapshotError(f"blob {expect_digest} is corrupt: its content hashes to {digest}")
            if check is not None:
                check()
            if staging is not None:
                os.replace(tmp, staging / digest)
                return BlobRef(digest, size, True)
            return BlobRef(digest, size, self._land(tmp, digest))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def put_file(self, path: Path) -> BlobRef:
        with open(path, "rb", buffering=0) as f:
            return self.put_chunks(file_chunks(f, depth=COPY_DEPTH), depth=COPY_DEPTH)

    def put_bytes(self, data: bytes) -> BlobRef:
        digest = hashlib.sha256(data).hexdigest()
        if self.has_blob(digest, len(data)):
            return BlobRef(digest, len(data), False)
        return self.put_chunks([memoryview(data)])

    def read_blob(self, digest: str) -> bytes:
        return self.blob_path(digest).read_bytes()

    def verify_blob(self, digest: str, size: int, what: str = "", also: Consumer | None = None) -> None:
        """Re-hash one blob (``also`` gets its chunks in the same pass); SnapshotError naming it when it is
        missing, truncated or altered."""
        label = f"blob {digest}" + (f" ({what})" if what else "")
        path = self.blob_path(digest)
        try:
            actual_size = path.stat().st_size
        except FileNotFoundError:
            raise SnapshotError(f"{label} is missing from the store {self.root}") from None
        if actual_size != size:
            raise SnapshotError(f"{label} is corrupt: {actual_size} bytes, the manifest says {size}")
        with open(path, "rb", buffering=0) as f:
            actual, _ = pipe_hashing(file_chunks(f), None, also)
        if actual != digest:
            raise SnapshotError(f"{label} is corrupt: its content hashes to {actual}")

    def verify(self, m: dict[str, Any], threads: int = 2, skip: frozenset[str] = frozenset()) -> tuple[int, int]:
        """Re-hash every blob a manifest names but those in ``skip`` (a few at once); (blobs, bytes). Raises on
        the first bad one."""
        seen: dict[str, tuple[int, str]] = {}
        for digest, size, what in mf.blob_refs(m):
            if digest not in skip:
                seen.setdefault(digest, (size, what))
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            futures = [pool.submit(self.verify_blob, d, s, w) for d, (s, w) in seen.items()]
            for f in futures:
                f.result()
        return len(seen), sum(s for s, _ in seen.values())

    # -- arena index (a cache: a resident arena already in the store is not copied again) ---------------------------
    @staticmethod
    def arena_key(arena_digest: str, layout: list, size: int) -> str:
        h = hashlib.sha256(b"keepwarm-arena-image-v1\0")
        h.update(json.dumps([arena_digest, layout, size], sort_keys=True).encode())
        return h.hexdigest()

    def arena_lookup(self, key: str, size: int) -> BlobRef | None:
        try:
            d = json.loads((self.index_dir / key).read_text())
        except (OSError, ValueError):
            return None
        digest = d.get("digest") if isinstance(d, dict) else None
        if isinstance(digest, str) and DIGEST_RE.fullmatch(digest) and self.has_blob(digest, size):
            return BlobRef(digest, size, False)
        return None

    def arena_remember(self, key: str, ref: BlobRef) -> None:
        self.write_atomic(self.index_dir / key, json.dumps(ref.ref()).encode())

    def layer_lookup(self, key: str) -> dict[str, Any] | None:
        """A remembered arena layer (``{image, image_manifest, arena_digest}``, e.g. the portable layer made from
        an arena) whose blobs are both still in the store, or None."""
        try:
            d = json.loads((self.index_dir / key).read_text())
            blobs = [(d[k]["digest"], d[k]["size"]) for k in ("image", "image_manifest")]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if all(isinstance(g, str) and DIGEST_RE.fullmatch(g) and self.has_blob(g, s) for g, s in blobs):
            return d
        return None

    def layer_remember(self, key: str, layer: dict[str, Any]) -> None:
        self.write_atomic(self.index_dir / key, json.dumps(layer).encode())

    # -- manifests -------------------------------------------------------------------------------------------------
    def write_atomic(self, path: Path, data: bytes, mode: int = 0o600) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = self._temp(path.parent)
        try:
            try:
                _write_all(fd, memoryview(data))
                os.fchmod(fd, mode)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)

    def manifest_path(self, name: str) -> Path:
        return self.snapshots_dir / f"{mf.check_name(name)}.json"

    def exists(self, name: str) -> bool:
        return self.manifest_path(name).is_file()

    def load(self, name: str) -> dict[str, Any]:
        path = self.manifest_path(name)
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            raise SnapshotError(f"no snapshot named {name!r} in {self.snapshots_dir}") from None
        m = mf.loads(text)
        if m["name"] != name:
            raise SnapshotError(f"{path} holds snapshot {m['name']!r}, not {name!r}")
        return m

    def load_complete(self, name: str) -> tuple[dict[str, Any], dict[str, int]]:
        """A manifest and its blobs (digest -> size), refused when one is missing or truncated (export, push)."""
        m = self.load(name)
        blobs = mf.blobs(m)
        for digest, size in blobs.items():
            if not self.has_blob(digest, size):
                raise SnapshotError(f"blob {digest} of snapshot {name} is missing or truncated; run "
                                    f"`keepwarm snapshot verify {name}`")
        return m, blobs

    def save(self, m: dict[str, Any]) -> None:
        mf.validate(m)
        mf.blobs(m)
        self.write_atomic(self.manifest_path(m["name"]), mf.dumps(m).encode())

    def names(self) -> list[str]:
        if not self.snapshots_dir.is_dir():
            return []
        return sorted(p.stem for p in self.snapshots_dir.glob("*.json") if mf.NAME_RE.fullmatch(p.stem))

    def manifests(self) -> dict[str, dict[str, Any]]:
        """Every manifest; an unreadable one raises (gc must not guess which blobs it names)."""
        return {name: self.load(name) for name in self.names()}

    def readable_manifests(self) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """(readable manifests, name -> why the others are not): for list and delete."""
        good, bad = {}, {}
        for name in self.names():
            try:
                good[name] = self.load(name)
            except SnapshotError as e:
                bad[name] = str(e)
        return good, bad

    def delete(self, name: str) -> None:
        path = self.manifest_path(name)
        if not path.is_file():
            raise SnapshotError(f"no snapshot named {name!r} in {self.snapshots_dir}")
        path.unlink()
        fsync_dir(self.snapshots_dir)

    # -- sizes and gc ----------------------------------------------------------------------------------------------
    def unique_sizes(self, manifests: dict[str, dict[str, Any]]) -> dict[str, int]:
        """Per snapshot: bytes of the blobs no other snapshot names (what deleting it + gc would free)."""
        users: dict[str, int] = {}
        per = {name: mf.blobs(m) for name, m in manifests.items()}
        for b in per.values():
            for d in b:
                users[d] = users.get(d, 0) + 1
        return {name: sum(s for d, s in b.items() if users[d] == 1) for name, b in per.items()}

    def stored_bytes(self) -> int:
        if not self.blobs_dir.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.blobs_dir.iterdir() if p.is_file())

    def gc(self) -> tuple[int, int]:
        """Remove blobs no snapshot names, stale index entries and staging leftovers; (blobs removed, bytes)."""
        with self.lock(exclusive=True):
            keep: set[str] = set()
            for m in self.manifests().values():
                keep |= set(mf.blobs(m))
            removed = freed = 0
            for p in self.blobs_dir.iterdir():
                if p.name not in keep:
                    freed += p.stat().st_size if p.is_file() else 0
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)
                    removed += DIGEST_RE.fullmatch(p.name) is not None
            for p in self.index_dir.iterdir():
                try:
                    d = json.loads(p.read_text())["digest"]
                except (OSError, ValueError, KeyError, TypeError):
                    d = None
                if d not in keep:
                    p.unlink(missing_ok=True)
            for p in self.tmp_dir.iterdir():
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            fsync_dir(self.blobs_dir)
        return removed, freed

    def staging_dir(self, prefix: str) -> Path:
        self.ensure()
        d = self.tmp_dir / f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        d.mkdir(mode=0o700)
        return d


def iso(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
