"""How an arena image gets into a tmpfs arena: the ways `daemon/image.py` could copy it, against `cp`, in rounds.

    .venv/bin/python benchmarks/image_fill.py FILE [--rounds 3] [--dest /dev/shm]

Per round, with the page cache dropped before each (root: ``/proc/sys/vm/drop_caches``): 1 MiB chunks read straight
into a writable mapping of a ``posix_fallocate``-d file (the image load before 2026-12-03); read into one of 8
buffers and ``pwrite``-n into the file (``fill_cpu`` now); the same with ``posix_fallocate`` first; ``cp``. Every
variant but ``cp`` hashes each chunk with sha256 in a second thread, as the arena digest is fed. Nothing asserted.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

CHUNK = 1 << 20
RING = 8


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def through_mapping(src: Path, dst: Path, size: int) -> None:
    fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.posix_fallocate(fd, 0, size)
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    view, h = memoryview(m), hashlib.sha256()
    with open(src, "rb", buffering=0) as f, ThreadPoolExecutor(1) as pool:
        os.posix_fadvise(f.fileno(), 0, size, os.POSIX_FADV_WILLNEED)
        off, fed = 0, []
        while off < size:
            n = f.readinto(view[off:off + CHUNK])
            fed.append(pool.submit(h.update, view[off:off + n]))
            off += n
        for x in fed:
            x.result()
    view.release()
    m.close()


def through_pwrite(src: Path, dst: Path, size: int, reserve: bool = False) -> None:
    fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    if reserve:
        os.posix_fallocate(fd, 0, size)
    bufs = [memoryview(bytearray(CHUNK)) for _ in range(RING)]
    fed: list[Future | None] = [None] * RING
    h = hashlib.sha256()
    with open(src, "rb", buffering=0) as f, ThreadPoolExecutor(1) as pool:
        os.posix_fadvise(f.fileno(), 0, size, os.POSIX_FADV_WILLNEED)
        off, slot = 0, 0
        while off < size:
            if (prev := fed[slot]) is not None:
                prev.result()
            n = f.readinto(bufs[slot])
            os.pwrite(fd, bufs[slot][:n], off)
            fed[slot] = pool.submit(h.update, bufs[slot][:n])
            off, slot = off + n, (slot + 1) % RING
        for x in fed:
            if x is not None:
                x.result()
    os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dest", type=Path, default=Path("/dev/shm"))
    args = ap.parse_args()
    size = args.file.stat().st_size
    dst = args.dest / f"image-fill-{os.getpid()}.arena"
    variants = {"mapping (fallocate + faults)": through_mapping, "pwrite from 8 buffers": through_pwrite,
                "pwrite after fallocate": lambda s, d, n: through_pwrite(s, d, n, reserve=True),
                "cp": lambda s, d, n: subprocess.run(["cp", str(s), str(d)], check=True)}
    for r in range(args.rounds):
        for name, fn in variants.items():
            drop_caches()
            t = time.perf_counter()
            fn(args.file, dst, size)
            dt = time.perf_counter() - t
            dst.unlink()
            print(f"round {r}  {name:30s} {dt:6.2f} s  {size / dt / 1e9:5.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
