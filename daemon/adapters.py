"""LoRA adapters resident in the daemon: the adapter's safetensors bytes in a tmpfs file, keyed by content digest.

Rules:
- The daemon checks what needs no model (the path, the PEFT files, no pickle, ``adapter_config.json``'s rank, the
  safetensors structure, every lora_A / lora_B of that rank) before it writes anything: a refused adapter leaves no
  entry and no file. The worker checks the adapter against its model when it maps it, and asks the daemon to unload
  an adapter its own request made resident when that check (or registering it) fails.
- An adapter is published data file first, manifest last (the manifest marks it complete), each written to a
  temporary name and renamed; a failure (ENOSPC) removes what that load wrote.
- A restarted worker asks again by path and gets the resident copy: the adapter's files are not read again while
  their size, mtime and inode are unchanged.
- A daemon restarted after a crash re-adopts an adapter only when its bytes still hash to its digest and pass the
  same checks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from keepwarm.formats.adapter import LoRAError, adapter_digest, read_adapter_dir
from keepwarm.weights.checkpoint import SAFETENSORS_DTYPES

log = logging.getLogger("keepwarm.daemon")

DATA_SUFFIX = ".lora"
MANIFEST_SUFFIX = ".lora-manifest"


@dataclass(frozen=True)
class AdapterEntry:
    digest: str
    path: str  # the adapter directory it was read from, resolved
    name: str  # the directory's name (for status)
    config_json: str
    size: int
    signature: tuple[tuple[str, int, int, int], ...]  # (file, size, mtime_ns, inode) of the two adapter files
    loaded_at: float
    data_file: str

    def info(self) -> dict:
        return {"digest": self.digest, "path": self.path, "name": self.name, "bytes": self.size,
                "loaded_at": self.loaded_at}


def _signature(adapter_dir: Path) -> tuple[tuple[str, int, int, int], ...]:
    out = []
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        st = (adapter_dir / name).stat()
        out.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def write_file_atomic(path: Path, data: bytes) -> None:
    """``data`` under ``path``, whole or not at all: written beside it under a temporary name, then renamed; the
    temporary file is removed if the write fails (ENOSPC on a full tmpfs)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _safetensors_shapes(where: str, data: bytes) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a safetensors file held in ``data``, after checking the header describes tensors
    that lie inside the file with the sizes their dtype and shape give; LoRAError otherwise."""
    def bad(why: str) -> LoRAError:
        return LoRAError(f"{where}: adapter_model.safetensors is not a safetensors file ({why})")

    if len(data) < 8:
        raise bad(f"{len(data)} bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise bad(f"header size {n} in a file of {len(data)} bytes")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise bad("the header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    shapes = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} lacks a known dtype, a shape or two data offsets") from None
        if min(shape, default=0) < 0 or not 0 <= begin <= end or 8 + n + end > len(data):
            raise bad(f"tensor {name!r} lies outside the file")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise bad(f"tensor {name!r} has {end - begin} bytes, its shape {list(shape)} needs "
                      f"{math.prod(shape) * dtype.itemsize}")
        shapes[name] = shape
    return shapes


def check_adapter(where: str, config_text: str, data: bytes) -> None:
    """The checks that need no model: ``adapter_config.json`` holds a rank, the weights file is whole safetensors
    and its lora_A [r, in] / lora_B [out, r] have that rank. Raises LoRAError naming the problem."""
    try:
        cfg = json.loads(config_text)
    except json.JSONDecodeError as e:
        raise LoRAError(f"{where}: adapter_config.json is not valid JSON: {e}") from None
    try:
        r = int(cfg["r"])
    except (KeyError, TypeError, ValueError):
        raise LoRAError(f"{where}: adapter_config.json lacks a valid r") from None
    for name, shape in _safetensors_shapes(where, data).items():
        side = 0 if name.endswith(".lora_A.weight") else 1 if name.endswith(".lora_B.weight") else None
        if side is not None and (len(shape) != 2 or shape[side] != r):
            need = "[r, in]" if side == 0 else "[out, r]"
            raise LoRAError(f"{where}: tensor {name!r} has shape {list(shape)}; adapter_config.json's r={r} needs "
                            f"{need}")


class AdapterStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.entries: dict[str, AdapterEntry] = {}
        self.file_reads = 0

    @property
    def nbytes(self) -> int:
        return sum(e.size for e in self.entries.values())

    def load(self, path: str) -> tuple[AdapterEntry, bool]:
        """(entry, cached). Raises LoRAError for a path that is not a usable PEFT adapter (nothing written), OSError
        when its files cannot be read or written (what this call wrote is removed)."""
        adapter_dir = Path(path).resolve() if Path(path).exists() else Path(path)
        config_text, weights_file = read_adapter_dir(adapter_dir)
        sig = _signature(adapter_dir)
        for e in self.entries.values():
            if e.path == str(adapter_dir) and e.signature == sig:
                return e, True
        data = weights_file.read_bytes()
        self.file_reads += 1
        digest = adapter_digest(config_text, data)
        if digest in self.entries:
            return self.entries[digest], True
        check_adapter(repr(str(adapter_dir)), config_text, data)
        entry = AdapterEntry(digest, str(adapter_dir), adapter_dir.name, config_text, len(data), sig, time.time(),
                             str(self.directory / f"{digest}{DATA_SUFFIX}"))
        self._publish(entry, data)
        self.entries[digest] = entry
        log.info("adapter %s (%s) resident: %.1f MB, digest %s", entry.name, entry.path, entry.size / 1e6,
                 digest[:16])
        return entry, False

    def _publish(self, entry: AdapterEntry, data: bytes) -> None:
        """Data file, then manifest (which marks the adapter complete); if either write fails, neither stays."""
        mpath = self.directory / f"{entry.digest}{MANIFEST_SUFFIX}"
        try:
            write_file_atomic(Path(entry.data_file), data)
            write_file_atomic(mpath, json.dumps(asdict(entry)).encode())
        except BaseException:
            Path(entry.data_file).unlink(missing_ok=True)
            mpath.unlink(missing_ok=True)
            raise

    def find(self, key: str) -> list[AdapterEntry]:
        resolved = str(Path(key).resolve()) if Path(key).exists() else key
        return [e for d, e in self.entries.items()
                if e.path == resolved or e.name == key or (len(key) >= 8 and d.startswith(key))]

    def unload(self, digest: str) -> None:
        e = self.entries.pop(digest)
        Path(e.data_file).unlink(missing_ok=True)
        (self.directory / f"{digest}{MANIFEST_SUFFIX}").unlink(missing_ok=True)
        log.info("adapter %s unloaded", e.name)

    def adopt(self) -> set[Path]:
        """Re-adopt adapters a killed daemon left behind when their bytes still hash to their digest and pass the
        checks a load makes (an older daemon may have kept adapters without them)."""
        keep: set[Path] = set()
        for mpath in sorted(self.directory.glob(f"*{MANIFEST_SUFFIX}")):
            try:
                d = json.loads(mpath.read_text())
                d["signature"] = tuple(tuple(x) for x in d["signature"])
                entry = AdapterEntry(**d)
                data = Path(entry.data_file).read_bytes()
                if adapter_digest(entry.config_json, data) != entry.digest or mpath.name != \
                        f"{entry.digest}{MANIFEST_SUFFIX}":
                    raise ValueError("bytes do not match the digest")
                check_adapter(repr(entry.path), entry.config_json, data)
            except (OSError, ValueError, KeyError, TypeError, LoRAError) as e:
                log.warning("removing adapter %s: %s", mpath.name[:16], e)
                continue
            self.entries[entry.digest] = entry
            keep |= {mpath, Path(entry.data_file)}
            log.info("re-adopted adapter %s (%s)", entry.name, entry.digest[:16])
        return keep

    def clear(self) -> None:
        for digest in list(self.entries):
            self.unload(digest)
