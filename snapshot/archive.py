"""``export`` / ``import``: a snapshot as one tar file (optionally zstd-compressed), read back without ``tarfile``.

Export mirrors the store (``snapshots/<name>.json`` first, then ``blobs/sha256/<digest>`` for each blob), plain
files with fixed mode, owner and mtime: the same snapshot exports to the same bytes. Import rules (docs/snapshots.md,
"Export / import"; the bounds in docs/reliability.md):
- a member is a regular file named exactly the manifest (the first member) or a blob it names, at its size; anything
  else (an absolute path, ``..``, another name, a link, a device, a FIFO, a sparse file, a duplicate) refuses it all;
- memory is bounded from headers alone (PAX_LIMIT, NAME_LIMIT, MANIFEST_LIMIT, ZSTD_WINDOW_LIMIT; blobs stream in
  CHUNK pieces) and time by what the manifest declares; every header's checksum and tar's end-of-archive block are
  checked, so a truncated archive or zstd stream is refused even between two members;
- whatever is wrong with the archive is one ArchiveError line naming the file; an OSError is the store's (a full
  disk, "No space left on device" included);
- blobs are hashed into a staging directory inside the store and land (blobs, then the manifest) only when every one
  checked out; a refusal removes the staging directory, so the store gains nothing."""

from __future__ import annotations

import io
import os
import re
import shutil
import struct
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import zstandard

from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.manifest import SnapshotError
from keepwarm.snapshot.store import CHUNK, Store, file_chunks, fsync_dir, pipe_hashing

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_BLOB_MEMBER = re.compile(r"blobs/sha256/([0-9a-f]{64})")
_MANIFEST_MEMBER = re.compile(r"snapshots/(" + mf.NAME_RE.pattern + r")\.json")
_DIR_MEMBERS = {"snapshots", "blobs", "blobs/sha256"}

BLOCK = 512
PAX_LIMIT = 64 << 10  # export writes PAX records only for what ustar cannot hold (a size >= 8 GiB): ~30 bytes
NAME_LIMIT = 4 << 10  # valid member names are under 160 bytes
MANIFEST_LIMIT = mf.MAX_MANIFEST_BYTES  # real manifests are KBs; 1 MiB of "[]," parses to ~27 MiB of lists
ZSTD_WINDOW_LIMIT = 1 << 25  # export (level 3) uses a 2 MiB window; zstd levels up to 20 stay within 32 MiB
_REGULAR = (b"0", b"\x00", b"7")  # tar's regular, old regular, contiguous
_KINDS = {b"1": "a hard link", b"2": "a symlink", b"3": "a character device", b"4": "a block device",
          b"6": "a FIFO", b"S": "a sparse file"}
_EXTENDED = {b"x": "PAX header", b"g": "global PAX header", b"L": "GNU long name", b"K": "GNU long link"}
_PAX_RECORD = re.compile(rb"([0-9]{1,6}) ")
_PAX_SIZE = re.compile(r"[0-9]{1,20}")


class ArchiveError(SnapshotError):
    """The archive is malformed, hostile or unreadable (as opposed to the store failing while it is imported)."""


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


def _show(name: str) -> str:
    """A member name fit for a one-line message (a hostile one can be kilobytes long)."""
    return repr(name if len(name) <= 80 else name[:80] + "...")


class _Source:
    """The archive's bytes, decompressed when they start with zstd's magic, and how many were read. A failure to
    read or decode them is an ArchiveError naming the file, so an OSError leaving the import is the store's."""

    def __init__(self, path: Path, raw: BinaryIO) -> None:
        self.path, self.offset = path, 0
        self.stream: Any = raw  # a binary file, or zstd's stream reader: both have readinto
        self.decode_errors: tuple[type[Exception], ...] = ()
        try:
            head = raw.read(4)
            raw.seek(0)
        except OSError as e:
            raise ArchiveError(f"cannot read {path}: {e.strerror or e}; nothing imported") from None
        if not head:
            raise ArchiveError(f"{path} is empty; nothing imported")
        if head == ZSTD_MAGIC:
            # the window bound is checked from the frame header, before the decoder allocates the window
            dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_WINDOW_LIMIT)
            self.stream = dctx.stream_reader(raw, read_size=CHUNK, read_across_frames=True)
            self.decode_errors = (zstandard.ZstdError,)

    def readinto(self, buf: memoryview) -> int:
        try:
            n = self.stream.readinto(buf)
        except OSError as e:
            raise ArchiveError(f"cannot read {self.path}: {e.strerror or e}; nothing imported") from None
        except self.decode_errors as e:
            if "too much memory" in str(e):  # libzstd's words for a window above max_window_size
                raise ArchiveError(f"{self.path}: its zstd frame needs a window above the {ZSTD_WINDOW_LIMIT >> 20} "
                                   "MiB limit; refusing it, nothing imported") from None
            raise ArchiveError(f"{self.path} is damaged: its zstd data does not decode ({e}); nothing imported"
                               ) from None
        self.offset += n
        return n

    def read_exact(self, n: int, what: str) -> bytearray:
        """``n`` bytes (callers bound ``n`` first); an ArchiveError naming ``what`` when the archive ends before."""
        buf = bytearray(n)
        got = 0
        while got < n:
            k = self.readinto(memoryview(buf)[got:])
            if not k:
                raise ArchiveError(f"{self.path} is truncated (it ends inside {what}); nothing imported")
            got += k
        return buf


@dataclass
class Member:
    name: str
    kind: bytes  # tar's type flag
    size: int
    linkname: str
    offset: int  # of its header in the (decompressed) archive


class _MemberData:
    """One member's data, for file_chunks and the manifest read: exactly ``member.size`` bytes."""

    def __init__(self, src: _Source, member: Member) -> None:
        self.src, self.member, self.left = src, member, member.size

    def readinto(self, buf: memoryview) -> int:
        if self.left <= 0:
            return 0
        n = self.src.readinto(buf[:min(len(buf), self.left)])
        if not n:
            raise ArchiveError(f"{self.src.path} is truncated ({self.left} bytes of {_show(self.member.name)} "
                               "missing); nothing imported")
        self.left -= n
        return n

    def read_all(self) -> bytearray:
        data = self.src.read_exact(self.left, _show(self.member.name))
        self.left = 0
        return data

    def drain(self) -> None:
        buf = memoryview(bytearray(min(CHUNK, max(self.left, 1))))
        while self.readinto(buf):
            pass


def _text(field: bytes) -> str:
    return bytes(field).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _number(field: bytes, path: Path, offset: int) -> int:
    if field[0] == 0x80:  # GNU / star base-256, for what 11 octal digits cannot hold (>= 8 GiB)
        return int.from_bytes(field[1:], "big")
    digits = bytes(field).split(b"\0", 1)[0].strip(b" ")
    if not re.fullmatch(rb"[0-7]*", digits):
        raise ArchiveError(f"{path} is damaged: a tar header at byte {offset} holds a bad number; nothing imported")
    return int(digits, 8) if digits else 0


def _header(block: bytes, path: Path, offset: int) -> Member:
    """Parse one 512-byte ustar / GNU header, its checksum checked (unsigned or, as old tars wrote, signed)."""
    digits = bytes(block[148:156]).split(b"\0", 1)[0].strip(b" ")
    stored = int(digits, 8) if re.fullmatch(rb"[0-7]+", digits) else -1
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
    signed = sum(struct.unpack("148b8x356b", block)) + 8 * 32
    if stored not in (unsigned, signed):
        what = "not a tar archive" if offset == 0 else "damaged"
        raise ArchiveError(f"{path} is {what}: bad tar header checksum at byte {offset}; nothing imported")
    name = _text(block[0:100])
    if block[257:263] == b"ustar\x00" and block[345]:  # POSIX prefix (GNU's "ustar  " uses these bytes otherwise)
        name = _text(block[345:500]) + "/" + name
    kind = block[156:157]
    if kind == b"\x00" and name.endswith("/"):  # old tars mark directories by the slash alone
        kind = b"5"
    return Member(name, kind, _number(block[124:136], path, offset), _text(block[157:257]), offset)


def _pax_records(data: bytes, path: Path, offset: int) -> dict[str, str]:
    """``<length> <key>=<value>\\n`` records (the length counts the whole record, in bytes)."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        m = _PAX_RECORD.match(data, pos)
        end = pos + int(m.group(1)) if m else -1
        if m is None or not m.end() < end <= len(data) or data[end - 1] != 0x0A or b"=" not in data[m.end():end]:
            raise ArchiveError(f"{path} is damaged: a malformed PAX record in the header at byte {offset}; nothing "
                               "imported")
        key, _, value = data[m.end():end - 1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = end
    return out


def _extended(src: _Source, h: Member, into: dict[str, str], used: int = 0) -> None:
    """Read a PAX header ('x': the next member, 'g': every later one) or a GNU long name / link ('L' / 'K') into
    ``into``, refused from its declared size alone when it (with ``used`` bytes of global ones before it, which all
    stay in memory) is larger than any export writes."""
    pax = h.kind in (b"x", b"g")
    limit = PAX_LIMIT if pax else NAME_LIMIT
    what = _EXTENDED[h.kind]
    if used + h.size > limit:
        raise ArchiveError(f"{src.path} holds a {h.size}-byte {what} at byte {h.offset} (the limit is {limit}"
                           f"{' in all' if used else ''}); refusing it, nothing imported")
    data = bytes(src.read_exact(h.size + (-h.size % BLOCK), f"the {what} at byte {h.offset}")[:h.size])
    if pax:
        into.update(_pax_records(data, src.path, h.offset))
    else:
        into["path" if h.kind == b"L" else "linkpath"] = _text(data)


def _apply(h: Member, ext: dict[str, str], path: Path) -> Member:
    """The member a header describes once PAX / GNU records override its fields (an empty value: no override)."""
    size = h.size
    if ext.get("size"):
        if not _PAX_SIZE.fullmatch(ext["size"]):
            raise ArchiveError(f"{path} is damaged: PAX size {ext['size'][:40]!r} at byte {h.offset}; nothing "
                               "imported")
        size = int(ext["size"])
    kind = b"S" if any(k.startswith("GNU.sparse.") for k in ext) else h.kind
    return Member(ext.get("path") or h.name, kind, size, ext.get("linkpath") or h.linkname, h.offset)


def _members(src: _Source) -> Iterator[tuple[Member, _MemberData]]:
    """The archive's members up to tar's end-of-archive block, PAX and GNU records applied; the caller reads each
    one's data (what it leaves is skipped)."""
    glob: dict[str, str] = {}
    local: dict[str, str] = {}
    in_a_row = glob_bytes = 0  # both bounded, or endless small headers would take endless time (or memory)
    while True:
        offset = src.offset
        block = bytearray(BLOCK)
        n = src.readinto(memoryview(block))
        if not n:
            raise ArchiveError(f"{src.path} is truncated (it ends at byte {offset}, before tar's end-of-archive "
                               "block); nothing imported")
        block[n:] = src.read_exact(BLOCK - n, f"the tar header at byte {offset}")
        if block == bytes(BLOCK):
            return
        h = _header(bytes(block), src.path, offset)
        if h.kind in _EXTENDED:
            in_a_row += 1
            if in_a_row > len(_EXTENDED):
                raise ArchiveError(f"{src.path} holds {in_a_row} PAX / GNU headers in a row at byte {offset}; "
                                   "refusing it, nothing imported")
            is_global = h.kind == b"g"
            _extended(src, h, glob if is_global else local, glob_bytes if is_global else 0)
            glob_bytes += h.size if is_global else 0
            continue
        member = _apply(h, {**glob, **local}, src.path)
        local, in_a_row = {}, 0
        data = _MemberData(src, member)
        yield member, data
        data.drain()
        src.read_exact(-member.size % BLOCK, f"the padding of {_show(member.name)}")


def _refuse(m: Member) -> None:
    kind = _KINDS.get(m.kind)
    if kind is not None:
        raise ArchiveError(f"the archive holds {kind} ({_show(m.name)}); refusing it, nothing imported")
    name = m.name
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise ArchiveError(f"the archive holds an absolute path {_show(name)}; refusing it, nothing imported")
    if ".." in name.replace("\\", "/").split("/"):
        raise ArchiveError(f"the archive holds a path with '..' ({_show(name)}); refusing it, nothing imported")
    if m.kind not in _REGULAR and m.kind != b"5":
        raise ArchiveError(f"unexpected member {_show(name)} (tar type {m.kind!r}); nothing imported")


def import_archive(store: Store, path: Path, rename: str | None = None, force: bool = False) -> ImportResult:
    """Check everything, then land blobs and the manifest in the store; on any failure the store gains nothing."""
    try:
        store.ensure()
        with store.lock():
            staging = store.staging_dir("import")
            try:
                return _import(store, path, staging, rename, force)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:  # the archive's read errors are ArchiveErrors: this is the store failing (a full disk)
        raise SnapshotError(f"cannot import into the store {store.root}: {e.strerror or e}; the snapshot was not "
                            "imported") from None


def _take_blob(store: Store, data: _MemberData, digest: str, expected: dict[str, int], received: dict[str, bool],
               staging: Path) -> None:
    """Check one blob member against the manifest and stage it (or, already in the store, only check it)."""
    size = data.member.size
    if digest not in expected:
        raise ArchiveError(f"blob {digest} in the archive is not named by the snapshot; nothing imported")
    if digest in received:
        raise ArchiveError(f"blob {digest} appears twice in the archive; nothing imported")
    if size != expected[digest]:
        raise ArchiveError(f"blob {digest} has {size} bytes in the archive, the manifest says {expected[digest]}; "
                           "nothing imported")
    if store.has_blob(digest, size):  # check it anyway: a bad archive is refused whole
        got, _ = pipe_hashing(file_chunks(data, size), None)
        if got != digest:
            raise ArchiveError(f"blob {digest} is corrupt in the archive (hashes to {got}); nothing imported")
        received[digest] = False
        return
    try:
        store.put_chunks(file_chunks(data, size), expect_digest=digest, staging=staging)
    except ArchiveError:
        raise
    except SnapshotError as e:
        raise ArchiveError(f"{e} (in the archive); nothing imported") from None
    received[digest] = True


def _read_manifest(data: _MemberData, name: str) -> dict[str, Any]:
    member = data.member
    if member.size > MANIFEST_LIMIT:
        raise ArchiveError(f"{member.name}: a {member.size}-byte manifest is too large (the limit is "
                           f"{MANIFEST_LIMIT}); nothing imported")
    try:
        m = mf.loads(bytes(data.read_all()))  # nesting too deep for a manifest is its SnapshotError
    except mf.SnapshotError as e:
        raise ArchiveError(f"{member.name}: {e}; nothing imported") from None
    if m["name"] != name:
        raise ArchiveError(f"{member.name} holds snapshot {m['name']!r}; nothing imported")
    return m


def _import(store: Store, path: Path, staging: Path, rename: str | None, force: bool) -> ImportResult:
    try:
        raw = open(path, "rb")  # noqa: SIM115
    except OSError as e:
        raise ArchiveError(f"cannot read {path}: {e.strerror}") from None
    m: dict[str, Any] | None = None
    expected: dict[str, int] = {}
    received: dict[str, bool] = {}  # digest -> staged (False: already in the store, only checked)
    dirs: set[str] = set()  # each at most once: every member then costs the manifest a name, so time is bounded
    with raw:
        for member, data in _members(_Source(path, raw)):
            _refuse(member)
            if member.kind == b"5":
                d = member.name.rstrip("/")
                if d not in _DIR_MEMBERS or d in dirs or member.size:
                    raise ArchiveError(f"unexpected or repeated directory {_show(member.name)} in the archive; "
                                       "nothing imported")
                dirs.add(d)
                continue
            mm = _MANIFEST_MEMBER.fullmatch(member.name)
            bm = _BLOB_MEMBER.fullmatch(member.name)
            if mm:
                if m is not None:
                    raise ArchiveError("the archive holds more than one snapshot manifest; nothing imported")
                m = _read_manifest(data, mm.group(1))
                expected = mf.blobs(m)
            elif bm:
                if m is None:
                    raise ArchiveError("the archive's first file must be the snapshot manifest; nothing imported")
                _take_blob(store, data, bm.group(1), expected, received, staging)
            else:
                raise ArchiveError(f"unexpected path {_show(member.name)} in the archive; nothing imported")
    if m is None:
        raise ArchiveError(f"{path} holds no snapshot manifest; nothing imported")
    return commit_staged(store, m, expected, received, staging, rename, force)


def target_name(store: Store, m: dict[str, Any], rename: str | None, force: bool) -> tuple[str, bool]:
    """The name the snapshot lands under and whether that exact snapshot is there already (or the same snapshot
    with more platform images: a pull of one platform into the store that pushed them all); a different one of
    that name is refused unless ``force``."""
    name = mf.check_name(rename) if rename else m["name"]
    if store.exists(name):
        have, new = store.load(name), {**m, "name": name}
        keys = {p["platform"]["key"] for mod in new["models"] for a in mf.images(mod) if mf.layered(a)
                for p in a["platforms"]}
        if mf.dumps(have) == mf.dumps(new) or mf.dumps(mf.without_platforms(have, keys)) == mf.dumps(new):
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
