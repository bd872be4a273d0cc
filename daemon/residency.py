"""Residency: the arenas the daemon holds, the memory budget, eviction, and adoption of a dead daemon's arenas.

Rules:
- ``memory_budget`` bounds the total of resident arenas and adapters plus the arenas jobs are building: a load past
  it first evicts the least recently used models without leases, else fails with code ``memory_budget``.
- A model with live leases is evicted only with ``force`` (the caller checks; eviction drops its leases).
- A freshly built CPU arena is installed under its fingerprint's name, sealed read-only, and its manifest is
  written last (the manifest marks it complete); if the manifest cannot be written, the arena is removed too.
- On start, CPU arenas left by a daemon that died (SIGKILL) are re-adopted when their manifest parses and their
  bytes hash to the manifest's ``arena_digest``; anything else in the arena directory is removed.
Touched only by the daemon's socket loop, except ``install_cpu_arena`` (a job thread, on files of its own).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from keepwarm.daemon.adapters import AdapterStore, write_file_atomic
from keepwarm.daemon.leases import Leases
from keepwarm.formats.arena import (
    ArenaManifest,
    CpuArenaFile,
    CudaArena,
    arena_digest_of,
    iter_manifest_files,
)
from keepwarm.formats.layout import Layout
from keepwarm.formats.wire import ProtocolError
from keepwarm.weights.loader import checkpoint_changed

WHOLE = Layout()

log = logging.getLogger("keepwarm.daemon")


def parse_memory_budget(text: str | None, device: torch.device) -> int | None:
    """Bytes ("8G", "512MiB", "1000000") or a fraction of device memory ("0.5")."""
    if text is None or text == "":
        return None
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        value = float(t)
    except ValueError:
        raise ValueError(f"invalid memory budget {text!r}: use bytes (e.g. 8G, 512M) or a fraction (0.5)") from None
    if 0 < value <= 1 and "." in t:
        total = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                 else psutil.virtual_memory().total)
        return int(total * value)
    return int(value)


@dataclass
class Resident:
    manifest: ArenaManifest
    storage: CpuArenaFile | CudaArena
    origin: str  # "preload" | "adopted" | "image" | "portable" (built from a snapshot's portable layer)
    loaded_at: float
    load_seconds: float
    last_used: float
    manifest_path: Path | None = None
    source_bytes: int = 0  # bytes read to build it: the checkpoint's files (preload), the image (image), 0 (adopted)

    @property
    def arena_bytes(self) -> int:
        """The arena's allocation (what the memory budget counts)."""
        return self.storage.size

    @property
    def nbytes(self) -> int:
        return self.manifest.total_bytes


class Residency:
    """The resident arenas by fingerprint, within ``memory_budget`` bytes (None: unbounded)."""

    def __init__(self, arena_dir: Path, device: torch.device, memory_budget: int | None, threads: int,
                 adapters: AdapterStore, leases: Leases, counters: dict[str, int],
                 pending_bytes: Callable[[], int]) -> None:
        self.arena_dir = arena_dir
        self.device = device
        self.memory_budget = memory_budget
        self.threads = threads
        self.adapters = adapters
        self.leases = leases
        self.counters = counters
        self.pending_bytes = pending_bytes  # the arenas jobs are building
        self.residents: dict[str, Resident] = {}

    def resident_bytes(self) -> int:
        return sum(r.nbytes for r in self.residents.values()) + self.adapters.nbytes

    def find(self, key: tuple[str, str, str], fingerprint: str | None, layout: Layout = WHOLE) -> Resident | None:
        """The resident of ``fingerprint`` (a whole model's: for a ``layout`` part of it, that shard), else of
        (model, quantization, dtype) and ``layout`` whose checkpoint is unchanged."""
        if fingerprint and layout.whole:
            return self.residents.get(fingerprint)
        for r in self.residents.values():
            m = r.manifest
            if m.layout != layout:
                continue
            if fingerprint:
                if m.source_fingerprint == fingerprint:
                    return r
            elif (m.model, m.quantization, m.dtype) == key and not checkpoint_changed(m):
                return r
        return None

    # -- the budget ----------------------------------------------------------------------------------------------
    def make_room(self, needed: int, name: str) -> None:
        for r in self.room_plan(needed, name):
            self.evict(r.manifest.fingerprint, reason="memory budget (least recently used)")

    def room_plan(self, needed: int, name: str) -> list[Resident]:
        """The least recently used models without leases to evict so that ``needed`` bytes fit the budget (oldest
        first); raises ProtocolError ``memory_budget`` when they cannot. Evicts nothing itself."""
        if self.memory_budget is None:
            return []
        pending = self.pending_bytes()
        if needed + pending > self.memory_budget:
            raise ProtocolError("memory_budget", f"{name} needs {needed / 1e6:.1f} MB but the memory budget is "
                                                 f"{self.memory_budget / 1e6:.1f} MB")
        free = self.memory_budget - self.resident_bytes() - pending
        if needed <= free:
            return []
        candidates = sorted((r for fp, r in self.residents.items() if not self.leases.held(fp)),
                            key=lambda r: r.last_used)
        reclaimable = sum(r.nbytes for r in candidates)
        if needed > free + reclaimable:
            raise ProtocolError(
                "memory_budget", f"{name} needs {needed / 1e6:.1f} MB; the budget of {self.memory_budget / 1e6:.1f} MB "
                                 f"has {free / 1e6:.1f} MB free and {reclaimable / 1e6:.1f} MB held by models without "
                                 "leases; evict a model with live leases first (keepwarm evict --force)")
        victims = []
        for r in candidates:
            if needed <= free:
                break
            free += r.nbytes
            victims.append(r)
        return victims

    # -- coming and going ----------------------------------------------------------------------------------------
    def add_preloaded(self, r: Resident, bytes_read: int, count: bool = True) -> Resident:
        """Make a preload's arena resident; if the same bytes are resident already, keep that one. ``count``: the
        first arena of a preload (the counters count preloads, not the shards of one)."""
        existing = self.residents.get(r.manifest.fingerprint)
        if existing is not None:  # same bytes already resident (e.g. files touched): keep the old one
            self._drop_duplicate(r, existing)
            return existing
        self.residents[r.manifest.fingerprint] = r
        if count:
            self.counters["preloads"] += 1
            self.counters["preload_bytes_read"] += bytes_read
        self._drop_stale(r)
        return r

    def add_image(self, r: Resident, arena_bytes: int) -> Resident:
        """Make a checked image resident, evicting for the budget only now (a failed load evicted nothing).
        Raises ProtocolError ``memory_budget`` (and drops the arena) when it no longer fits."""
        existing = self.residents.get(r.manifest.fingerprint)
        if existing is not None:  # loaded meanwhile (a preload of the same bytes): keep that one
            self._drop_duplicate(r, existing)
            return existing
        try:
            victims = self.room_plan(arena_bytes, r.manifest.model_name)
        except ProtocolError:
            self.drop_storage(r)
            raise
        for v in victims:
            self.evict(v.manifest.fingerprint, reason="memory budget (least recently used)")
        self.residents[r.manifest.fingerprint] = r
        self.counters["images_loaded"] += 1
        return r

    @staticmethod
    def _drop_duplicate(r: Resident, existing: Resident) -> None:
        if isinstance(r.storage, CpuArenaFile) and isinstance(existing.storage, CpuArenaFile) \
                and r.storage.path != existing.storage.path:
            r.storage.close()
            r.storage.unlink()

    def _drop_stale(self, fresh: Resident) -> None:
        """An older arena of the same model/quantization (and shard) whose checkpoint changed on disk: evict it if
        unleased. A sibling shard (the same source fingerprint) is not stale."""
        m = fresh.manifest
        for fp, r in list(self.residents.items()):
            o = r.manifest
            same_model = (o.model, o.quantization, o.dtype, o.layout) == (m.model, m.quantization, m.dtype, m.layout)
            if o.model_fingerprint != m.model_fingerprint and same_model and not self.leases.held(fp):
                self.evict(fp, reason="checkpoint changed on disk")

    def evict(self, fingerprint: str, reason: str) -> None:
        r = self.residents.get(fingerprint)
        if r is None:
            return
        self.leases.drop_all(fingerprint)
        self.drop(fingerprint)
        self.counters["evictions"] += 1
        log.info("evicted %s (%s): %s", r.manifest.model_name, fingerprint[:16], reason)

    def drop(self, fingerprint: str) -> None:
        self.drop_storage(self.residents.pop(fingerprint))

    @staticmethod
    def drop_storage(r: Resident) -> None:
        if isinstance(r.storage, CpuArenaFile):
            r.storage.close()
            r.storage.unlink()
            if r.manifest_path is not None:
                r.manifest_path.unlink(missing_ok=True)
        else:
            r.storage.flat = None  # type: ignore[assignment]  # frees the device memory
            torch.cuda.ipc_collect()  # release blocks whose IPC consumers are gone (killed workers included)
            torch.cuda.empty_cache()

    def clear(self) -> None:
        """A clean shutdown: every arena, every adapter and the arena directory go."""
        for fp in list(self.residents):
            self.drop(fp)
        self.adapters.clear()
        if self.device.type == "cpu" and self.arena_dir.is_dir():
            for f in self.arena_dir.iterdir():
                f.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.arena_dir.rmdir()

    # -- files ---------------------------------------------------------------------------------------------------
    def install_cpu_arena(self, storage: CpuArenaFile, manifest: ArenaManifest,
                          ) -> tuple[CpuArenaFile, Path | None]:
        """Give a freshly built CPU arena its fingerprint's name, seal it read-only and write its manifest last (the
        manifest marks the arena complete). If a file of that fingerprint exists already (another job of the same
        bytes got there first), ours keeps its temporary name and is dropped when the job finishes."""
        final = self.arena_dir / f"{manifest.fingerprint}.arena"
        mpath = None
        if not final.exists():
            os.replace(storage.path, final)
            storage.path = final
            mpath = self.arena_dir / f"{manifest.fingerprint}.json"
        storage = storage.seal()
        if mpath is not None:
            try:
                write_file_atomic(mpath, manifest.to_json().encode())
            except BaseException:  # no manifest (ENOSPC): the arena under its final name must not stay either
                storage.close()
                storage.unlink()
                raise
        return storage, mpath

    def adopt(self) -> None:
        """Re-adopt arenas a killed daemon left behind, if they check out; remove everything else."""
        keep: set[Path] = self.adapters.adopt()
        for mpath in iter_manifest_files(self.arena_dir):
            apath = mpath.with_suffix(".arena")
            try:
                manifest = ArenaManifest.from_json(mpath.read_text())
                if manifest.fingerprint != mpath.stem:
                    raise ValueError("manifest name does not match its fingerprint")
                if manifest.device != "cpu":
                    raise ValueError(f"arena was on {manifest.device}")
                t0 = time.perf_counter()
                storage = CpuArenaFile.open_readonly(apath, manifest.total_bytes, populate=True)
                digest = arena_digest_of(storage.flat, manifest.tensors, self.threads, manifest.arena_digest_scheme)
                if digest != manifest.arena_digest:
                    storage.close()
                    raise ValueError("arena bytes do not match the manifest's digest")
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("removing arena %s: %s", mpath.stem[:16], e)
                continue
            now = time.time()
            self.residents[manifest.fingerprint] = Resident(manifest, storage, "adopted", now,
                                                            time.perf_counter() - t0, now, mpath)
            self.counters["adopted"] += 1
            keep |= {mpath, apath}
            log.info("re-adopted arena %s (%s, %s, %.1f MB) in %.2fs", manifest.fingerprint[:16],
                     manifest.model_name, manifest.quantization, manifest.total_bytes / 1e6, time.perf_counter() - t0)
        for f in self.arena_dir.iterdir():
            if f not in keep:
                log.info("removing stray file %s from the arena directory", f.name)
                f.unlink(missing_ok=True)
