"""``export`` / ``import``: a snapshot as one tar file (optionally zstd-compressed).

The archive mirrors the store: ``snapshots/<name>.json`` first, then ``blobs/sha256/<digest>`` for every blob the
manifest names, as plain files (mode 0644, uid/gid 0, mtime = the snapshot's creation time: the same snapshot
exports to the same bytes).

Import reads the archive as a stream and never extracts it with tarfile: every member must be a regular file named
exactly ``snapshots/<valid name>.json`` (the first member) or ``blobs/sha256/<64 hex>`` naming a blob of that
manifest with the manifest's size; directory entries for those two directories are skipped. Anything else (an
absolute path, ``..``, another name, a symlink, a hard link, a device, a FIFO, a duplicate) refuses the whole
archive. Blobs are hashed as they are read into a staging directory inside the store; only when every digest
checked out and every blob is there do they move into ``blobs/sha256/`` and the manifest into ``snapshots/``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.manifest import SnapshotError
from keepwarm.snapshot.store import CHUNK, Store, file_chunks, fsync_dir, pipe_hashing

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_BLOB_MEMBER = re.compile(r"blobs/sha256/([0-9a-f]{64})")
_MANIFEST_MEMBER = re.compile(r"snapshots/(" + mf.NAME_RE.pattern + r")\.json")
_DIR_MEMBERS = {"snapshots", "blobs", "blobs/sha256"}


@dataclass
class ImportResult:
    name: str
    blobs: int
    new_blobs: int
    new_bytes: int
    already_present: bool


def _tarinfo(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mode = 0o644
    ti.mtime = int(mtime)
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def export(store: Store, name: str, out: Path, zstd: bool = False, level: int = 3) -> int:
    """Write the snapshot and its blobs to ``out`` (atomically: a temp file renamed at the end); returns bytes."""
    with store.lock():
        m, blobs = store.load_complete(name)
        out = out.absolute()
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as raw:
                sink: BinaryIO = raw
                zw = None
                if zstd:
                    import zstandard

                    zw = zstandard.ZstdCompressor(level=level, threads=-1).stream_writer(raw, closefd=False)
                    sink = zw
                with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                    data = mf.dumps(m).encode()
                    tar.addfile(_tarinfo(f"snapshots/{name}.json", len(data), m["created_at"]), io.BytesIO(data))
                    for digest in sorted(blobs):
                        with open(store.blob_path(digest), "rb") as f:
                            tar.addfile(_tarinfo(f"blobs/sha256/{digest}", blobs[digest], m["created_at"]), f)
                if zw is not None:
                    zw.close()
                raw.flush()
                os.fsync(raw.fileno())
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return out.stat().st_size


def _open_stream(f: BinaryIO) -> tuple[BinaryIO, bool]:
    head = f.read(4)
    f.seek(0)
    if head == ZSTD_MAGIC:
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(f, read_size=CHUNK), True
    return f, False


def _refuse(member: tarfile.TarInfo) -> None:
    kinds = [(member.issym(), "a symlink"), (member.islnk(), "a hard link"), (member.ischr(), "a character device"),
             (member.isblk(), "a block device"), (member.isfifo(), "a FIFO")]
    kind = next((k for cond, k in kinds if cond), None)
    if kind is not None:
        raise SnapshotError(f"the archive holds {kind} ({member.name!r}); refusing it, nothing imported")
    name = member.name
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise SnapshotError(f"the archive holds an absolute path {name!r}; refusing it, nothing imported")
    if ".." in name.replace("\\", "/").split("/"):
        raise SnapshotError(f"the archive holds a path with '..' ({name!r}); refusing it, nothing imported")


def import_archive(store: Store, path: Path, rename: str | None = None, force: bool = False) -> ImportResult:
    """Check everything, then land blobs and the manifest in the store; on any failure the store is unchanged."""
    store.ensure()
    with store.lock():
        staging = store.staging_dir("import")
        try:
            return _import(store, path, staging, rename, force)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _take_blob(store: Store, tar: tarfile.TarFile, member: tarfile.TarInfo, digest: str, expected: dict[str, int],
               received: dict[str, bool], staging: Path) -> None:
    """Check one blob member against the manifest and stage it (or, already in the store, only check it)."""
    if digest not in expected:
        raise SnapshotError(f"blob {digest} in the archive is not named by the snapshot; nothing imported")
    if digest in received:
        raise SnapshotError(f"blob {digest} appears twice in the archive; nothing imported")
    if member.size != expected[digest]:
        raise SnapshotError(f"blob {digest} has {member.size} bytes in the archive, the manifest "
                            f"says {expected[digest]}; nothing imported")
    f = tar.extractfile(member)
    if store.has_blob(digest, member.size):  # check it anyway: a bad archive is refused whole
        got, _ = pipe_hashing(file_chunks(f, member.size), None)
        if got != digest:
            raise SnapshotError(f"blob {digest} is corrupt in the archive (hashes to {got}); nothing imported")
        received[digest] = False
    else:
        try:
            store.put_chunks(file_chunks(f, member.size), expect_digest=digest, staging=staging)
        except SnapshotError as e:
            raise SnapshotError(f"{e} (in the archive); nothing imported") from None
        received[digest] = True


def _import(store: Store, path: Path, staging: Path, rename: str | None, force: bool) -> ImportResult:
    try:
        raw = open(path, "rb")  # noqa: SIM115
    except OSError as e:
        raise SnapshotError(f"cannot read {path}: {e.strerror}") from None
    m: dict[str, Any] | None = None
    expected: dict[str, int] = {}
    received: dict[str, bool] = {}  # digest -> staged (False: already in the store, only checked)
    with raw:
        stream, _ = _open_stream(raw)
        try:
            tar = tarfile.open(fileobj=stream, mode="r|")  # noqa: SIM115 (closed in the finally below)
        except tarfile.TarError as e:
            raise SnapshotError(f"{path} is not a tar archive ({e})") from None
        try:
            for member in tar:
                _refuse(member)
                name = member.name.rstrip("/") if member.isdir() else member.name
                if member.isdir():
                    if name not in _DIR_MEMBERS:
                        raise SnapshotError(f"unexpected directory {member.name!r} in the archive; nothing imported")
                    continue
                if not member.isreg():
                    raise SnapshotError(f"unexpected member {member.name!r} (not a regular file); nothing imported")
                mm = _MANIFEST_MEMBER.fullmatch(name)
                bm = _BLOB_MEMBER.fullmatch(name)
                if mm:
                    if m is not None:
                        raise SnapshotError("the archive holds more than one snapshot manifest; nothing imported")
                    if member.size > mf.MAX_MANIFEST_BYTES:
                        raise SnapshotError(f"{name}: a {member.size}-byte manifest is too large; nothing imported")
                    f = tar.extractfile(member)
                    m = mf.loads(f.read() if f else b"")
                    if m["name"] != mm.group(1):
                        raise SnapshotError(f"{name} holds snapshot {m['name']!r}; nothing imported")
                    expected = mf.blobs(m)
                elif bm:
                    if m is None:
                        raise SnapshotError("the archive's first file must be the snapshot manifest; nothing "
                                            "imported")
                    _take_blob(store, tar, member, bm.group(1), expected, received, staging)
                else:
                    raise SnapshotError(f"unexpected path {member.name!r} in the archive; nothing imported")
        except (tarfile.TarError, EOFError, OSError) as e:
            raise SnapshotError(f"{path} is damaged or truncated ({type(e).__name__}: {e}); nothing imported"
                                ) from None
        finally:
            with contextlib.suppress(Exception):
                tar.close()
    if m is None:
        raise SnapshotError(f"{path} holds no snapshot manifest; nothing imported")
    return commit_staged(store, m, expected, received, staging, rename, force)


def target_name(store: Store, m: dict[str, Any], rename: str | None, force: bool) -> tuple[str, bool]:
    """The name the snapshot lands under and whether that exact snapshot is there already; a different one of
    that name is refused unless ``force``."""
    name = mf.check_name(rename) if rename else m["name"]
    if store.exists(name):
        if mf.dumps(store.load(name)) == mf.dumps({**m, "name": name}):
            return name, True
        if not force:
            raise SnapshotError(f"a different snapshot named {name!r} exists; import it under another name "
                                "(--name) or replace it (--force)")
    return name, False


def commit_staged(store: Store, m: dict[str, Any], expected: dict[str, int], received: dict[str, bool],
                  staging: Path, rename: str | None, force: bool) -> ImportResult:
    """Land checked blobs (``received``: digest -> staged in ``staging``) and the manifest, once nothing is
    missing (import and pull)."""
    missing = [d for d in expected if d not in received and not store.has_blob(d, expected[d])]
    if missing:
        raise SnapshotError(f"blob {missing[0]} ({len(missing)} in all) is neither in the archive nor in the store; "
                            "nothing imported")
    name, already = target_name(store, m, rename, force)
    m = {**m, "name": name}
    new_bytes = 0
    for digest, staged in received.items():
        if staged:
            src = staging / digest
            if store.has_blob(digest, expected[digest]):
                continue
            os.chmod(src, 0o444)
            os.replace(src, store.blob_path(digest))
            new_bytes += expected[digest]
    fsync_dir(store.blobs_dir)
    if not already:
        store.save(m)
    return ImportResult(name, len(expected), sum(received.values()), new_bytes, already)
