"""Hostile archives for `keepwarm snapshot import` (issue 43 rows 7 and 14).

Each archive is imported by the real CLI in a subprocess (_RUNNER) that, once keepwarm is imported, resets its
peak RSS (VmHWM, through /proc/self/clear_refs) and reports how far above that baseline the import took it and how
long it took. For every hostile file: a non-zero exit, one short line on stderr naming the problem and no
traceback, an answer within TIME_LIMIT_S, a peak under PEAK_LIMIT_MIB above the baseline, and a store holding
nothing new (no snapshot, no blob, no staging directory). A full disk is named "No space left on device", not a
damaged archive. Exports, and the same snapshot repacked the way other tar writers do it (PAX records, GNU long
names, a global header, directory entries), still import.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import zstandard

from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot import store as store_mod
from keepwarm.snapshot.archive import NAME_LIMIT, PAX_LIMIT, ZSTD_MAGIC, export, import_archive
from keepwarm.snapshot.manifest import SnapshotError
from keepwarm.snapshot.store import Store

MiB = 1 << 20
PEAK_LIMIT_MIB = 64  # above the process's RSS once keepwarm is imported
TIME_LIMIT_S = 5.0  # hostile files are refused from a header: milliseconds, with room for a loaded 2-core machine
MESSAGE_LIMIT = 300

# The CLI's import, in a process that imports what the command imports first, then measures only the command.
_RUNNER = r"""
import json, os, sys, time
import httpx, zstandard
import keepwarm.cli.main as cli
import keepwarm.daemon.client, keepwarm.snapshot.archive, keepwarm.snapshot.inspect

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS: the peak from here on
base = status("VmRSS")
t0 = time.monotonic()
try:
    cli.app(args=["--log-level", "warning", "snapshot", "import", sys.argv[1]], prog_name="keepwarm")
    code = 0
except SystemExit as e:
    code = e.code or 0
sys.stdout.write("\n" + json.dumps({"code": code, "seconds": time.monotonic() - t0,
                                    "peak_mib": (status("VmHWM") - base) / 1024}) + "\n")
"""


def run_import(home: Path, archive: Path) -> SimpleNamespace:
    """`keepwarm snapshot import ARCHIVE` with KEEPWARM_HOME=home: code, seconds, peak_mib, stdout, stderr."""
    env = {**os.environ, "KEEPWARM_HOME": str(home), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _RUNNER, str(archive)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.strip(), r.stderr[-3000:]
    return SimpleNamespace(**json.loads(r.stdout.strip().splitlines()[-1]), stdout=r.stdout, stderr=r.stderr)


def error_line(r: SimpleNamespace) -> str:
    assert r.code != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[:3000]
    assert len(lines[0]) < MESSAGE_LIMIT, lines[0][:3000]
    return lines[0]


_SKELETON = {"blobs", "blobs/sha256", "snapshots", "index", "index/arena", "tmp", ".lock"}


def store_additions(root: Path) -> list[str]:
    """Everything under the store but its empty layout: snapshots, blobs, staging left behind."""
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if str(p.relative_to(root)) not in _SKELETON)


# -- writing tar files by hand (hostile ones cannot be written with tarfile) ------------------------------------
def header(name: str, size: int, kind: bytes = b"0", linkname: str = "") -> bytes:
    """A POSIX ustar header block with a valid checksum (sizes below 8 GiB)."""
    h = bytearray(512)
    h[0:100] = name.encode().ljust(100, b"\0")[:100]
    h[100:124] = b"0000644\0" + b"0000000\0" * 2
    h[124:148] = b"%011o\0" % size + b"%011o\0" % 1_700_000_000
    h[148:156] = b" " * 8
    h[156:157] = kind
    h[157:257] = linkname.encode().ljust(100, b"\0")[:100]
    h[257:265] = b"ustar\x0000"
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def pad(n: int) -> bytes:
    return bytes(-n % 512)


def member(name: str, data: bytes, kind: bytes = b"0") -> bytes:
    return header(name, len(data), kind) + data + pad(len(data))


def pax_record(key: str, value: str) -> bytes:
    """``<length> key=value\\n``, the length counting its own digits."""
    rest = f" {key}={value}\n".encode()
    n = len(rest) + 1
    while len(str(n)) + len(rest) != n:
        n = len(str(n)) + len(rest)
    return str(n).encode() + rest


def pax(records: dict[str, str], kind: bytes = b"x") -> bytes:
    return member("././@PaxHeader", b"".join(pax_record(k, v) for k, v in records.items()), kind)


END = bytes(1024)  # tar's end-of-archive blocks


def repeated(n: int, byte: bytes = b"a") -> Iterator[bytes]:
    chunk = byte * MiB
    while n > 0:
        yield chunk[:min(n, MiB)]
        n -= MiB


def write(path: Path, parts: Iterable[bytes | Iterable[bytes]], zstd: bool = False, window_log: int = 0) -> Path:
    """Write the parts (bytes, or iterables of bytes streamed as they come), zstd-compressed if asked."""
    with open(path, "wb") as f:
        sink: io.RawIOBase | zstandard.ZstdCompressionWriter = f
        if zstd:
            params = zstandard.ZstdCompressionParameters.from_level(3, window_log=window_log) if window_log else None
            cctx = zstandard.ZstdCompressor(compression_params=params) if params else zstandard.ZstdCompressor()
            sink = cctx.stream_writer(f, closefd=False)
        for part in parts:
            for piece in [part] if isinstance(part, bytes) else part:
                sink.write(piece)
        if zstd:
            sink.close()
    return path


def huge_extended(kind: bytes, size: int) -> list[bytes | Iterable[bytes]]:
    """A PAX ('x' / 'g') or GNU long name / link ('L' / 'K') header whose payload is ``size`` bytes, then the
    member it would apply to and the end of the archive."""
    if kind in (b"x", b"g"):  # one valid record: "<size> comment=aaa...\n"
        prefix = f"{size} comment=".encode()
        payload: list[bytes | Iterable[bytes]] = [prefix, repeated(size - len(prefix) - 1), b"\n"]
    else:
        payload = [repeated(size)]
    target = header("blobs/sha256/" + "0" * 64, 0, b"2", "x") if kind == b"K" else header("notes.txt", 0)
    return [header("././@PaxHeader" if kind in (b"x", b"g") else "././@LongLink", size, kind), *payload,
            pad(size), target, END]


# -- a small snapshot to export, break and repack ----------------------------------------------------------------
def synthetic_manifest(blobs: dict[str, bytes], name: str = "syn") -> dict:
    """A manifest naming ``blobs`` (role -> content): enough for the archive code, not restorable."""
    def ref(data: bytes) -> dict:
        return {"digest": hashlib.sha256(data).hexdigest(), "size": len(data)}

    return {"schema": mf.SCHEMA, "schema_version": mf.SCHEMA_VERSION, "name": name, "created_at": 1.7e9,
            "source": {"kind": "config", "path": "/x/server.toml", "api_key_required": False},
            "server_config": {"max_num_seqs": 3},
            "models": [{"role": "base", "name": "m", "source": "/x/m", "fingerprint": "a" * 64,
                        "quantization": "none", "dtype": "float32", "device": "cpu", "arena_digest": "b" * 64,
                        "arena_bytes": len(blobs["image"]), "image": ref(blobs["image"]),
                        "image_manifest": ref(blobs["image_manifest"]),
                        "files": {"config.json": ref(blobs["config"])}}],
            "adapters": [{"name": "a", "digest": "c" * 64,
                          "files": {"adapter_config.json": ref(blobs["adapter_config"]),
                                    "adapter_model.safetensors": ref(blobs["adapter"])}}]}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> SimpleNamespace:
    """A snapshot in a store, exported plain and zstd-compressed; its image blob (256 KiB, random) is large enough
    for a cut in the middle of an archive to land inside it."""
    d = tmp_path_factory.mktemp("good")
    blobs = {"image": os.urandom(256 << 10), "image_manifest": b"{}", "config": b'{"x": 1}',
             "adapter_config": b'{"r": 4}', "adapter": b"w" * 100}
    src = Store(d / "store").ensure()
    for data in blobs.values():
        src.put_bytes(data)
    m = synthetic_manifest(blobs)
    src.save(m)
    export(src, "syn", d / "syn.tar")
    export(src, "syn", d / "syn.tar.zst", zstd=True)
    return SimpleNamespace(m=m, blobs={hashlib.sha256(b).hexdigest(): b for b in blobs.values()},
                           manifest=mf.dumps(m).encode(), tar=d / "syn.tar", zst=d / "syn.tar.zst")


# -- the hostile files: name -> (builder(path, good), what the one line must say) --------------------------------
def _window_bomb(path: Path, good: SimpleNamespace) -> Path:
    """A frame asking for a 128 MiB window, then 200 MiB of zeros as a blob the manifest names (with a digest
    they do not hash to): decoding it would fill the whole window."""
    size = 200 * MiB
    m = synthetic_manifest({"image": b"", "image_manifest": b"{}", "config": b"{}", "adapter_config": b"{}",
                            "adapter": b"w"})
    m["models"][0]["image"] = {"digest": "f" * 64, "size": size}
    text = mf.dumps(m).encode()
    return write(path, [member("snapshots/syn.json", text), header("blobs/sha256/" + "f" * 64, size),
                        repeated(size, b"\0"), END], zstd=True, window_log=27)


def _cut(source: str, fraction: float) -> Callable[[Path, SimpleNamespace], Path]:
    def build(path: Path, good: SimpleNamespace) -> Path:
        data = getattr(good, source).read_bytes()
        return write(path, [data[:int(len(data) * fraction)]])
    return build


def _without_end(path: Path, good: SimpleNamespace) -> Path:
    data = good.tar.read_bytes().rstrip(b"\0")
    return write(path, [data + pad(len(data))])


def _longer_than_declared(path: Path, good: SimpleNamespace) -> Path:
    digest, data = next((d, b) for d, b in good.blobs.items() if len(b) == 256 << 10)
    return write(path, [member("snapshots/syn.json", good.manifest), header(f"blobs/sha256/{digest}", len(data)),
                        data, b"Z" * 1024, END])


HOSTILE: dict[str, tuple[Callable[[Path, SimpleNamespace], Path], str]] = {
    # issue 43 row 7: a 7.9 KB file holding a 200 MB PAX header, a 3.4 KB one holding a 100 MB GNU long name
    "pax-200MB.tar.zst": (lambda p, g: write(p, huge_extended(b"x", 200_000_000), zstd=True),
                          f"200000000-byte PAX header at byte 0 (the limit is {PAX_LIMIT})"),
    "gnu-long-name-100MB.tar.zst": (lambda p, g: write(p, huge_extended(b"L", 100_000_000), zstd=True),
                                    f"100000000-byte GNU long name at byte 0 (the limit is {NAME_LIMIT})"),
    "gnu-long-link-100MB.tar.zst": (lambda p, g: write(p, huge_extended(b"K", 100_000_000), zstd=True),
                                    "100000000-byte GNU long link"),
    "global-pax-200MB.tar.zst": (lambda p, g: write(p, huge_extended(b"g", 200_000_000), zstd=True),
                                 "200000000-byte global PAX header"),
    # a header declaring 8 GiB of PAX records followed by a few bytes: refused from the size, not from running out
    "pax-declares-8GiB.tar": (lambda p, g: write(p, [header("././@PaxHeader", (8 << 30) - 1, b"x"), b"9 a=b\n"]),
                              "8589934591-byte PAX header"),
    # many small headers, each within its limit: bounded in number and, for global ones, in total bytes
    "global-pax-2x40KiB.tar": (lambda p, g: write(p, [pax({"comment": "a" * (40 << 10)}, b"g")] * 2 + [END]),
                               f"(the limit is {PAX_LIMIT} in all)"),
    "pax-headers-5-in-a-row.tar": (lambda p, g: write(p, [pax({"comment": "a"})] * 5 + [END]),
                                   "5 PAX / GNU headers in a row"),
    "directory-entry-400k-times.tar.zst": (lambda p, g: write(p, [header("blobs/", 0, b"5")] * 400_000 + [END],
                                                              zstd=True), "unexpected or repeated directory"),
    "pax-malformed-record.tar": (lambda p, g: write(p, [member("././@PaxHeader", b"99 path=x\n", b"x"), END]),
                                 "malformed PAX record"),
    "pax-size-not-a-number.tar": (lambda p, g: write(p, [pax({"size": "1e9"}), header("snapshots/syn.json", 0),
                                                          END]), "PAX size '1e9'"),
    "zstd-magic-then-garbage.tar.zst": (lambda p, g: write(p, [ZSTD_MAGIC + b"\xff" * 4096]),
                                        "zstd data does not decode"),
    "zstd-window-128MiB.tar.zst": (_window_bomb, "zstd frame needs a window above the 32 MiB limit"),
    "zstd-truncated.tar.zst": (_cut("zst", 0.5), "is truncated"),
    "tar-truncated.tar": (_cut("tar", 0.5), "is truncated"),
    "tar-no-end-of-archive.tar": (_without_end, "before tar's end-of-archive block"),
    "member-longer-than-declared.tar": (_longer_than_declared, "bad tar header checksum"),
    # 15 MiB of "[[],[],...]" (under manifest.py's 16 MiB): ~5M lists, ~400 MiB once parsed
    "manifest-15MiB.tar.zst": (lambda p, g: write(p, [member("snapshots/syn.json", b"[" + b"[]," * (5 << 20) + b"[]]"),
                                                      END], zstd=True), "manifest is too large"),
    "manifest-nested.tar": (lambda p, g: write(p, [member("snapshots/syn.json", b"[" * 200_000), END]),
                            "nested too deeply"),
    "not-a-tar.bin": (lambda p, g: write(p, [b"\x00junk" * 200]), "not a tar archive: bad tar header checksum"),
    "empty.tar": (lambda p, g: write(p, []), "is empty"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_archive_is_refused_in_one_line_with_bounded_memory(case, good, tmp_path) -> None:
    build, expected = HOSTILE[case]
    archive = build(tmp_path / case, good)
    assert archive.stat().st_size < 2 * MiB  # each is small on disk, whatever it declares
    home = tmp_path / "home"
    r = run_import(home, archive)
    line = error_line(r)
    assert expected in line, line
    assert r.seconds < TIME_LIMIT_S, (r.seconds, line)
    assert r.peak_mib < PEAK_LIMIT_MIB, (r.peak_mib, line)
    assert store_additions(home / "store") == []


# -- what must still import --------------------------------------------------------------------------------------
def _repacked(path: Path, good: SimpleNamespace) -> Path:
    """The export rewritten as other tar writers do it: a global PAX header, directory entries, the manifest
    under a GNU long name, every blob under a PAX path and size (its ustar size field says 0)."""
    parts = [pax({"comment": "repacked by hand"}, b"g"), header("snapshots/", 0, b"5"), header("blobs/", 0, b"5"),
             header("blobs/sha256/", 0, b"5"), member("././@LongLink", b"snapshots/syn.json\0", b"L"),
             member("x" * 99, good.manifest)]
    for digest, data in sorted(good.blobs.items()):
        parts += [pax({"path": f"blobs/sha256/{digest}", "size": str(len(data))}), header("placeholder", 0),
                  data, pad(len(data))]
    return write(path, [*parts, END])


GOOD = {"export.tar": lambda p, g: g.tar, "export.tar.zst": lambda p, g: g.zst, "repacked.tar": _repacked}


@pytest.mark.parametrize("case", list(GOOD))
def test_exports_and_repacked_archives_still_import(case, good, tmp_path) -> None:
    archive = GOOD[case](tmp_path / case, good)
    if case == "repacked.tar":  # a tar any reader takes, not one shaped for ours
        with tarfile.open(archive) as t:
            names = [(ti.name, ti.size) for ti in t.getmembers() if ti.isreg()]
        assert names == [("snapshots/syn.json", len(good.manifest))] + [
            (f"blobs/sha256/{d}", len(b)) for d, b in sorted(good.blobs.items())]
    home = tmp_path / "home"
    r = run_import(home, archive)
    assert r.code == 0, r.stderr
    assert f"imported syn: {len(good.blobs)} blobs, {len(good.blobs)} new" in r.stdout
    store = Store(home / "store")
    assert store.load("syn") == good.m
    assert store.verify(good.m) == (len(good.blobs), sum(map(len, good.blobs.values())))
    assert list(store.tmp_dir.iterdir()) == []
    assert r.peak_mib < PEAK_LIMIT_MIB, r.peak_mib


# -- a full disk (issue 43 row 14) -------------------------------------------------------------------------------
def test_import_into_a_full_tmpfs_says_no_space_left(good, small_tmpfs) -> None:
    home = small_tmpfs(128 << 10) / "home"  # the 256 KiB image blob cannot fit
    r = run_import(home, good.tar)
    line = error_line(r)
    assert "No space left on device" in line, line
    assert "damaged" not in line and "truncated" not in line, line
    assert store_additions(home / "store") == []


def _enospc(*_args) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_enospc_injected_while_staging_a_blob_or_saving_the_manifest(good, tmp_path, monkeypatch) -> None:
    """In-process, for machines that cannot mount a tmpfs: the disk fills while a blob is written to staging (the
    store gains nothing) or while the manifest is saved (no snapshot; the blobs already landed are named by none
    and gc removes them)."""
    store = Store(tmp_path / "staging-full")
    with monkeypatch.context() as mp:
        mp.setattr(store_mod, "_write_all", _enospc)
        with pytest.raises(SnapshotError, match="No space left on device") as e:
            import_archive(store, good.tar)
    assert "damaged" not in str(e.value) and "\n" not in str(e.value)
    assert store_additions(store.root) == []

    store = Store(tmp_path / "manifest-full")
    with monkeypatch.context() as mp:
        mp.setattr(Store, "save", _enospc)
        with pytest.raises(SnapshotError, match="No space left on device"):
            import_archive(store, good.zst)
    assert store.names() == [] and list(store.tmp_dir.iterdir()) == []
    assert store.gc()[0] == len(good.blobs) and store_additions(store.root) == []
    assert import_archive(store, good.zst).new_blobs == len(good.blobs)  # room again: the import goes through


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_a_blob_above_8GiB_takes_its_size_from_a_pax_record_or_a_base256_field(fmt, tmp_path) -> None:
    """Export writes a size ustar's 11 octal digits cannot hold as a PAX record; GNU tar as base-256. The header
    as tarfile writes it, then 3 bytes of data: the size read is the real one (the manifest's), so the import gets
    as far as staging the blob and finds it short by that size less 3."""
    size = (9 << 30) + 5
    m = synthetic_manifest({"image": b"", "image_manifest": b"{}", "config": b"{}", "adapter_config": b"{}",
                            "adapter": b"w"})
    m["models"][0]["image"] = {"digest": "f" * 64, "size": size}
    ti = tarfile.TarInfo("blobs/sha256/" + "f" * 64)
    ti.size = size
    archive = write(tmp_path / "big.tar", [member("snapshots/syn.json", mf.dumps(m).encode()),
                                           ti.tobuf(fmt, "utf-8", "surrogateescape"), b"abc"])
    store = Store(tmp_path / "store")
    with pytest.raises(SnapshotError, match=f"is truncated \\({size - 3} bytes of 'blobs/sha256/f{{64}}' missing\\)"):
        import_archive(store, archive)
    assert store_additions(store.root) == []


def test_every_manifest_reader_refuses_deep_nesting_and_size_in_one_line() -> None:
    """store.load, pull and import all parse through manifest.loads: a hostile manifest is a SnapshotError there
    (no RecursionError traceback, no 16 MiB parse)."""
    from keepwarm.snapshot import manifest as mf

    with pytest.raises(mf.SnapshotError, match="nested too deeply"):
        mf.loads("[" * 200_000)
    with pytest.raises(mf.SnapshotError, match="more than 1048576"):
        mf.loads(b"[" + b" " * mf.MAX_MANIFEST_BYTES + b"]")
