"""LoRA adapters resident in the daemon: the adapter's safetensors bytes in a tmpfs file, keyed by content digest.

The daemon checks only what needs no model (the path, the PEFT files, no pickle); the worker checks the adapter
against its model when it maps it. A restarted worker asks again by path and gets the resident copy: the
adapter's files are not read again while their size, mtime and inode are unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from keepwarm.formats.adapter import LoRAError, adapter_digest, read_adapter_dir

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


class AdapterStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.entries: dict[str, AdapterEntry] = {}
        self.file_reads = 0

    @property
    def nbytes(self) -> int:
        return sum(e.size for e in self.entries.values())

    def load(self, path: str) -> tuple[AdapterEntry, bool]:
        """(entry, cached). Raises LoRAError for a path that is not a usable PEFT adapter."""
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
        target = self.directory / f"{digest}{DATA_SUFFIX}"
        tmp = target.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
        entry = AdapterEntry(digest, str(adapter_dir), adapter_dir.name, config_text, len(data), sig, time.time(),
                             str(target))
        mpath = self.directory / f"{digest}{MANIFEST_SUFFIX}"
        mtmp = mpath.with_suffix(".tmp")
        mtmp.write_text(json.dumps(asdict(entry)))
        os.replace(mtmp, mpath)  # last: marks the adapter complete
        self.entries[digest] = entry
        log.info("adapter %s (%s) resident: %.1f MB, digest %s", entry.name, entry.path, entry.size / 1e6,
                 digest[:16])
        return entry, False

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
        """Re-adopt adapters a killed daemon left behind when their bytes still hash to their digest."""
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
