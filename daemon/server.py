"""The keepwarm daemon: keeps models resident in arenas and hands them to workers under leases.

One thread runs the socket loop (a pyzmq ROUTER on ``ipc://$KEEPWARM_RUNTIME_DIR/daemon.sock``), so ``status``
answers at once even while a model loads; each preload runs in a thread of its own and reports progress through
shared counters that the loop forwards to the clients waiting on it.

Rules:
- Peers must have our uid (``IPC_FILTER_UID``, enforced by the kernel's SO_PEERCRED) and the socket lives in a
  0700 directory. Messages are msgpack (see ``protocol.py``), never pickle.
- A lease is dropped when its pid is gone or it missed renewals for ``lease_ttl`` seconds. A model with live
  leases is evicted only with ``force``.
- ``memory_budget`` bounds the total of resident arenas: a preload past it first evicts the least recently used
  models without leases, else fails with code ``memory_budget``.
- ``load_image`` makes a model resident from an arena image (a snapshot's blob): the bytes are copied into a new
  arena and checked against the manifest's ``arena_digest``; nothing is re-quantized and the checkpoint is not read.
  Models it would evict for the memory budget are evicted only once the new arena checked out.
- On start, CPU arenas left by a daemon that died (SIGKILL) are re-adopted when their manifest parses and their
  bytes hash to the manifest's ``arena_digest``; anything else in the arena directory is removed. A clean
  shutdown (``shutdown`` verb, SIGTERM, SIGINT) removes every arena and the arena directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
import zmq

from keepwarm.daemon.adapters import AdapterStore
from keepwarm.daemon.checkpoint import Checkpoint
from keepwarm.daemon.image import ImageError, check_cpu_layouts, check_device, fill_cpu, fill_cuda, image_size
from keepwarm.daemon.loader import build_arena, checkpoint_changed, plan_arena, resolve_dtype
from keepwarm.daemon.protocol import (
    PROTOCOL_VERSION,
    AttachArgs,
    EvictArgs,
    LeaseArgs,
    LoadAdapterArgs,
    LoadImageArgs,
    PreloadArgs,
    ProtocolError,
    UnloadAdapterArgs,
    decode_request,
    encode,
    event,
    reply_error,
    reply_ok,
)
from keepwarm.formats import paths
from keepwarm.formats.arena import (
    ArenaManifest,
    CpuArenaFile,
    CudaArena,
    arena_digest_of,
    cuda_device_by_uuid,
    cuda_uuid,
    iter_manifest_files,
)
from keepwarm.formats.model_config import ModelConfigError
from keepwarm.formats.quant import QuantizationError, validate_scheme
from keepwarm.formats.version import __version__

log = logging.getLogger("keepwarm.daemon")

PROGRESS_INTERVAL_S = 0.25
REAP_INTERVAL_S = 1.0


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
class Lease:
    lease_id: str
    pid: int
    fingerprint: str
    created: float
    last_seen: float


@dataclass
class Resident:
    manifest: ArenaManifest
    storage: CpuArenaFile | CudaArena
    origin: str  # "preload" | "adopted" | "image"
    loaded_at: float
    load_seconds: float
    last_used: float
    manifest_path: Path | None = None

    @property
    def nbytes(self) -> int:
        return self.manifest.total_bytes


@dataclass
class PreloadJob:
    key: tuple[str, str, str]
    ckpt: Checkpoint
    quantization: str
    dtype: str
    total_bytes: int  # source bytes to read (progress)
    arena_bytes: int  # size of the arena being built (memory budget)
    started: float = field(default_factory=time.monotonic)
    bytes_done: int = 0
    waiters: list[tuple[bytes, str, str, Any]] = field(default_factory=list)  # (identity, rid, verb, args)
    result: Resident | None = None
    error: ProtocolError | None = None
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_bytes(self, n: int) -> None:
        with self.lock:
            self.bytes_done += n


@dataclass
class ImageJob:
    """Loading an arena image (``load_image``): the same shape as a PreloadJob for the socket loop."""

    key: tuple[str, str, str]  # (source model, "image:<fingerprint>", dtype)
    manifest: ArenaManifest
    image: Path
    total_bytes: int  # bytes to copy (progress)
    arena_bytes: int  # size of the arena being filled (memory budget)
    started: float = field(default_factory=time.monotonic)
    bytes_done: int = 0
    waiters: list[tuple[bytes, str, str, Any]] = field(default_factory=list)
    result: Resident | None = None
    error: ProtocolError | None = None
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def quantization(self) -> str:
        return self.manifest.quantization

    def add_bytes(self, n: int) -> None:
        with self.lock:
            self.bytes_done += n


class Daemon:
    def __init__(self, runtime_dir: Path | None = None, memory_budget: str | None = None, lease_ttl: float = 15.0,
                 device: str = "cpu", threads: int = 4) -> None:
        self.runtime_dir = runtime_dir or paths.runtime_dir()
        self.device = self._pick_device(device)
        self.memory_budget = parse_memory_budget(memory_budget, self.device)
        self.lease_ttl = lease_ttl
        self.threads = threads
        self.residents: dict[str, Resident] = {}  # fingerprint -> resident model
        self.leases: dict[str, Lease] = {}
        self.jobs: dict[tuple[str, str, str], PreloadJob | ImageJob] = {}
        self.counters = {"preloads": 0, "preload_bytes_read": 0, "adopted": 0, "attaches": 0, "evictions": 0,
                         "leases_dropped": 0, "images_loaded": 0, "rejected_requests": 0, "adapter_file_reads": 0,
                         "adapter_loads": 0}
        self.started_at = time.time()
        self._stop = False
        self._lock_fd: int | None = None
        self.arena_dir = paths.shm_dir(self.runtime_dir)
        self.adapters = AdapterStore(self.arena_dir)
        # A preload thread writes a byte here when it finishes, waking the socket loop at once.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)

    @staticmethod
    def _pick_device(name: str) -> torch.device:
        if name.startswith("cuda"):
            uuid = name.split(":", 1)[1] if ":" in name and not name.split(":", 1)[1].isdigit() else None
            return cuda_device_by_uuid(uuid) if uuid else torch.device(name)
        return torch.device("cpu")

    @property
    def device_name(self) -> str:
        return "cpu" if self.device.type == "cpu" else f"cuda:{cuda_uuid(self.device)}"

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def acquire_lock(self) -> None:
        paths.ensure_private_dir(self.runtime_dir)
        fd = os.open(self.runtime_dir / paths.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = (self.runtime_dir / "daemon.pid").read_text().strip() if \
                (self.runtime_dir / "daemon.pid").is_file() else "?"
            raise RuntimeError(f"a keepwarm daemon already runs for {self.runtime_dir} (pid {pid})") from None
        self._lock_fd = fd

    def run(self) -> None:
        """Serve until ``shutdown`` or SIGTERM/SIGINT; clean up arenas on the way out."""
        self.acquire_lock()
        if self.device.type == "cpu":
            paths.ensure_private_dir(self.arena_dir)
            self.adopt_arenas()
        sock_path = paths.socket_path(self.runtime_dir)
        sock_path.unlink(missing_ok=True)  # stale: we hold the lock, so no daemon owns it
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.IPC_FILTER_UID, os.getuid())
        router.setsockopt(zmq.LINGER, 500)
        router.bind(paths.endpoint(self.runtime_dir))
        os.chmod(sock_path, 0o600)
        (self.runtime_dir / "daemon.pid").write_text(f"{os.getpid()}\n")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        log.info("keepwarm daemon %s ready: pid %d, socket %s, device %s, arenas in %s, budget %s",
                 __version__, os.getpid(), sock_path, self.device_name, self.arena_dir,
                 "none" if self.memory_budget is None else f"{self.memory_budget / 1e9:.2f} GB")
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        # Under systemd (Type=notify), READY=1 goes out only once a `status` sent through the socket, exactly
        # as a client sends it, has been answered by this loop: units ordered After= us can use us at once.
        probe: zmq.Socket | None = None
        if os.environ.get("NOTIFY_SOCKET"):
            probe = ctx.socket(zmq.DEALER)
            probe.setsockopt(zmq.LINGER, 0)
            probe.connect(paths.endpoint(self.runtime_dir))
            probe.send(encode({"v": PROTOCOL_VERSION, "id": "sd-ready-probe", "verb": "status", "args": {}}))
            poller.register(probe, zmq.POLLIN)
        last_reap = last_progress = time.monotonic()
        try:
            while not self._stop:
                events = dict(poller.poll(timeout=int(PROGRESS_INTERVAL_S * 1000)))
                if probe is not None and probe in events:
                    probe.recv()  # our own status answered: the socket serves clients
                    poller.unregister(probe)
                    probe.close(linger=0)
                    probe = None
                    sd_notify(f"READY=1\nSTATUS=serving on {sock_path}\nMAINPID={os.getpid()}")
                if router in events:
                    while True:
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(router, frames)
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                now = time.monotonic()
                self._finish_jobs(router)
                if now - last_progress >= PROGRESS_INTERVAL_S:
                    self._send_progress(router)
                    last_progress = now
                if now - last_reap >= REAP_INTERVAL_S:
                    self.reap_leases()
                    last_reap = now
        finally:
            sd_notify("STOPPING=1")
            if probe is not None:
                probe.close(linger=0)
            self.shutdown_cleanup()
            router.close(linger=500)
            ctx.term()
            sock_path.unlink(missing_ok=True)
            (self.runtime_dir / "daemon.pid").unlink(missing_ok=True)
            log.info("keepwarm daemon stopped")

    def _on_signal(self, signum: int, _frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        self._stop = True

    def shutdown_cleanup(self) -> None:
        for job in self.jobs.values():
            job.done.wait()
        for fp in list(self.residents):
            self._drop_resident(fp)
        self.adapters.clear()
        if self.device.type == "cpu" and self.arena_dir.is_dir():
            for f in self.arena_dir.iterdir():
                f.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.arena_dir.rmdir()

    # -- adoption --------------------------------------------------------------------------------------------------
    def adopt_arenas(self) -> None:
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
                digest = arena_digest_of(storage.flat, manifest.tensors, self.threads)
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

    # -- dispatch --------------------------------------------------------------------------------------------------
    def _handle(self, router: zmq.Socket, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.counters["rejected_requests"] += 1
            return
        identity, payload = frames
        rid = ""
        try:
            rid, verb, args = decode_request(payload)
            reply = getattr(self, f"_verb_{verb}")(identity, rid, args)
        except ProtocolError as e:
            self.counters["rejected_requests"] += 1
            log.info("request refused: %s: %s", e.code, e.message)
            reply = reply_error(rid, e.code, e.message)
        except Exception as e:  # a bug must not take the daemon (and everyone's weights) down
            log.error("internal error: %s\n%s", e, traceback.format_exc())
            reply = reply_error(rid, "internal", f"{type(e).__name__}: {e}")
        if reply is not None:
            router.send_multipart([identity, encode(reply)])

    def _resolve_model(self, model: str, quantization: str, dtype: str) -> tuple[Checkpoint, tuple[str, str, str]]:
        try:
            quantization = validate_scheme(quantization)
            ckpt = Checkpoint(model)
            target = resolve_dtype(ckpt, dtype)
        except (QuantizationError, ModelConfigError) as e:
            code = "bad_quantization" if isinstance(e, QuantizationError) else "bad_model"
            raise ProtocolError(code, str(e)) from None
        from keepwarm.formats.arena import dtype_name

        return ckpt, (str(ckpt.model_dir), quantization, dtype_name(target))

    def _find_resident(self, key: tuple[str, str, str], fingerprint: str | None) -> Resident | None:
        if fingerprint:
            return self.residents.get(fingerprint)
        for r in self.residents.values():
            m = r.manifest
            if (m.model, m.quantization, m.dtype) == key and not checkpoint_changed(m):
                return r
        return None

    def _model_info(self, r: Resident) -> dict[str, Any]:
        m = r.manifest
        leases = [lease for lease in self.leases.values() if lease.fingerprint == m.fingerprint]
        return {"model": m.model, "name": m.model_name, "fingerprint": m.fingerprint, "quantization": m.quantization,
                "dtype": m.dtype, "device": m.device, "bytes": m.total_bytes, "origin": r.origin,
                "load_seconds": round(r.load_seconds, 4), "loaded_at": r.loaded_at, "last_used": r.last_used,
                "leases": [{"lease_id": x.lease_id, "pid": x.pid} for x in leases]}

    def _verb_status(self, _identity: bytes, rid: str, _args: Any) -> dict:
        return reply_ok(rid, pid=os.getpid(), version=__version__, socket=str(paths.socket_path(self.runtime_dir)),
                        runtime_dir=str(self.runtime_dir), arena_dir=str(self.arena_dir), device=self.device_name,
                        memory_budget=self.memory_budget, resident_bytes=self._resident_bytes(),
                        adapters=[e.info() for e in self.adapters.entries.values()],
                        uptime_s=round(time.time() - self.started_at, 3), counters=dict(self.counters),
                        models=[self._model_info(r) for r in self.residents.values()],
                        loading=[{"model": j.key[0], "quantization": j.quantization, "bytes_done": j.bytes_done,
                                  "bytes_total": j.total_bytes} for j in self.jobs.values()],
                        leases=len(self.leases))

    def _verb_list(self, _identity: bytes, rid: str, _args: Any) -> dict:
        return reply_ok(rid, models=[self._model_info(r) for r in self.residents.values()])

    def _verb_load_adapter(self, _identity: bytes, rid: str, args: LoadAdapterArgs) -> dict:
        from keepwarm.formats.adapter import LoRAError

        if self.device.type != "cpu":
            raise ProtocolError("unsupported", "adapters are kept on CPU daemons only for now")
        paths.ensure_private_dir(self.arena_dir)
        reads = self.adapters.file_reads
        try:
            entry, cached = self.adapters.load(args.path)
        except LoRAError as e:
            raise ProtocolError("bad_adapter", str(e)) from None
        self.counters["adapter_file_reads"] += self.adapters.file_reads - reads
        self.counters["adapter_loads"] += 1
        return reply_ok(rid, cached=cached, digest=entry.digest, path=entry.path, config_json=entry.config_json,
                        data_file=entry.data_file, size=entry.size)

    def _verb_unload_adapter(self, _identity: bytes, rid: str, args: UnloadAdapterArgs) -> dict:
        matches = self.adapters.find(args.adapter)
        if not matches:
            raise ProtocolError("not_resident", f"no resident adapter matches {args.adapter!r}")
        for e in matches:
            self.adapters.unload(e.digest)
        return reply_ok(rid, unloaded=[e.digest for e in matches])

    def _verb_shutdown(self, _identity: bytes, rid: str, _args: Any) -> dict:
        self._stop = True
        return reply_ok(rid, leases=len(self.leases))

    def _verb_preload(self, identity: bytes, rid: str, args: PreloadArgs) -> dict | None:
        return self._load_or_wait(identity, rid, "preload", args, args.model, args.quantization, args.dtype,
                                  args.fingerprint)

    def _verb_attach(self, identity: bytes, rid: str, args: AttachArgs) -> dict | None:
        if args.pid <= 0:
            raise ProtocolError("bad_request", "attach: pid must be positive")
        if not args.preload:
            if args.fingerprint:  # no checkpoint needed (a snapshot's restored model directory has no weights)
                r = self.residents.get(args.fingerprint)
            else:
                _, key = self._resolve_model(args.model, args.quantization, args.dtype)
                r = self._find_resident(key, None)
            if r is None:
                raise ProtocolError("not_resident", f"{args.model} ({args.quantization}) is not resident")
            return self._attach_reply(rid, r, args)
        return self._load_or_wait(identity, rid, "attach", args, args.model, args.quantization, args.dtype,
                                  args.fingerprint)

    def _attach_reply(self, rid: str, r: Resident, args: AttachArgs) -> dict:
        now = time.time()
        lease = Lease(secrets.token_hex(8), args.pid, r.manifest.fingerprint, now, time.monotonic())
        self.leases[lease.lease_id] = lease
        r.last_used = now
        self.counters["attaches"] += 1
        if isinstance(r.storage, CudaArena):
            arena = {"kind": "cuda", **r.storage.export_handle()}
        else:
            arena = {"kind": "cpu", "path": str(r.storage.path), "size": r.storage.size}
        log.info("lease %s: pid %d attached %s", lease.lease_id, args.pid, r.manifest.model_name)
        return reply_ok(rid, lease_id=lease.lease_id, lease_ttl=self.lease_ttl, manifest=r.manifest.to_json(),
                        arena=arena, origin=r.origin)

    def _verb_detach(self, _identity: bytes, rid: str, args: LeaseArgs) -> dict:
        lease = self.leases.pop(args.lease_id, None)
        if lease is None:
            raise ProtocolError("unknown_lease", f"no lease {args.lease_id!r}")
        log.info("lease %s: pid %d detached", lease.lease_id, lease.pid)
        return reply_ok(rid)

    def _verb_heartbeat(self, _identity: bytes, rid: str, args: LeaseArgs) -> dict:
        lease = self.leases.get(args.lease_id)
        if lease is None:
            raise ProtocolError("unknown_lease", f"no lease {args.lease_id!r} (dropped, or the daemon restarted)")
        lease.last_seen = time.monotonic()
        return reply_ok(rid)

    def _verb_evict(self, _identity: bytes, rid: str, args: EvictArgs) -> dict:
        target = args.model
        resolved = str(Path(target).resolve()) if Path(target).exists() else target
        matches = [fp for fp, r in self.residents.items()
                   if r.manifest.model == resolved or r.manifest.model_name == target
                   or (len(target) >= 8 and fp.startswith(target))]
        if not matches:
            raise ProtocolError("not_resident", f"no resident model matches {target!r}")
        for fp in matches:
            held = [x for x in self.leases.values() if x.fingerprint == fp]
            if held and not args.force:
                raise ProtocolError("in_use", f"{self.residents[fp].manifest.model_name} has {len(held)} live "
                                              f"lease(s) (pids {', '.join(str(x.pid) for x in held)}); use force")
        for fp in matches:
            self._evict(fp, reason="requested")
        return reply_ok(rid, evicted=matches)

    def _verb_load_image(self, identity: bytes, rid: str, args: LoadImageArgs) -> dict | None:
        try:
            manifest = ArenaManifest.from_json(args.manifest)
        except (ValueError, KeyError, TypeError) as e:
            raise ProtocolError("bad_image", f"load_image: the manifest does not parse: {e}") from None
        r = self.residents.get(manifest.fingerprint)
        if r is not None:  # the same model is resident already: kept as it is
            return self._done_reply(rid, "load_image", args, r, cached=True)
        image = Path(args.image)
        if not image.is_absolute():
            raise ProtocolError("bad_request", "load_image: the image path must be absolute")
        try:
            check_device(manifest, self.device)  # the CPU layouts are checked in the job's thread
            size = image_size(manifest, image)
        except ImageError as e:
            raise ProtocolError(e.code, e.message) from None
        key = (manifest.model, f"image:{manifest.fingerprint}", manifest.dtype)
        job = self.jobs.get(key)
        if job is None:
            arena_bytes = size if self.device.type == "cpu" else manifest.total_bytes
            self._room_plan(arena_bytes, manifest.model_name)  # refuse now if it can never fit; evict later
            job = ImageJob(key, manifest, image, arena_bytes, arena_bytes)
            self.jobs[key] = job
            threading.Thread(target=self._run_image_job, args=(job,), name=f"image-{manifest.fingerprint[:12]}",
                             daemon=True).start()
        job.waiters.append((identity, rid, "load_image", args))
        return None  # answered when the job finishes

    def _run_image_job(self, job: ImageJob) -> None:
        t0 = time.perf_counter()
        m = job.manifest
        storage: CpuArenaFile | CudaArena | None = None
        tmp = None
        try:
            if self.device.type == "cpu":
                check_cpu_layouts(m)
                paths.ensure_private_dir(self.arena_dir)
                tmp = self.arena_dir / f".image-{secrets.token_hex(6)}.arena"
                storage = CpuArenaFile.create(tmp, job.arena_bytes)
                fill_cpu(storage, job.image, job.arena_bytes, job.add_bytes)
                if arena_digest_of(storage.flat, m.tensors, self.threads) != m.arena_digest:
                    raise ProtocolError("bad_image", f"the image {job.image} does not match its manifest's "
                                                     "arena_digest (corrupt or not this model's image)")
                storage, mpath = self._install_cpu_arena(storage, m)
            else:
                mpath = None
                storage = CudaArena.create(job.arena_bytes, self.device)
                fill_cuda(storage, job.image, image_size(m, job.image), m, self.threads, job.add_bytes)
            seconds = time.perf_counter() - t0
            now = time.time()
            job.result = Resident(m, storage, "image", now, seconds, now, mpath)
            log.info("loaded the image of %s (%s, %s): %.1f MB in %.2fs (%.2f GB/s), fingerprint %s", m.model_name,
                     m.quantization, m.dtype, job.arena_bytes / 1e6, seconds,
                     job.arena_bytes / max(seconds, 1e-9) / 1e9, m.fingerprint[:16])
        except ProtocolError as e:
            job.error = e
        except ImageError as e:
            job.error = ProtocolError(e.code, e.message)
        except Exception as e:
            log.error("loading the image %s failed: %s\n%s", job.image, e, traceback.format_exc())
            job.error = ProtocolError("load_failed", f"loading the image {job.image} failed: {e}")
        finally:
            self._end_job(job, storage, tmp)

    # -- loading ---------------------------------------------------------------------------------------------------
    def _load_or_wait(self, identity: bytes, rid: str, verb: str, args: Any, model: str, quantization: str,
                      dtype: str, fingerprint: str | None) -> dict | None:
        if fingerprint and fingerprint in self.residents:
            r = self.residents[fingerprint]
            return self._done_reply(rid, verb, args, r, cached=True)
        ckpt, key = self._resolve_model(model, quantization, dtype)
        r = self._find_resident(key, fingerprint)
        if r is not None:
            return self._done_reply(rid, verb, args, r, cached=True)
        job = self.jobs.get(key)
        if job is None:
            _, total = plan_arena(ckpt, key[1], resolve_dtype(ckpt, dtype), self.device.type)
            self._make_room(total, ckpt.model_dir.name)
            job = PreloadJob(key, ckpt, key[1], dtype, ckpt.nbytes, total)
            self.jobs[key] = job
            threading.Thread(target=self._run_job, args=(job, fingerprint), name=f"preload-{ckpt.model_dir.name}",
                             daemon=True).start()
        job.waiters.append((identity, rid, verb, args))
        return None  # answered when the job finishes

    def _done_reply(self, rid: str, verb: str, args: Any, r: Resident, cached: bool) -> dict:
        if getattr(args, "fingerprint", None) and r.manifest.fingerprint != args.fingerprint:
            raise ProtocolError("fingerprint_mismatch",
                                f"{r.manifest.model_name} is resident with fingerprint {r.manifest.fingerprint[:16]}, "
                                f"not the requested {args.fingerprint[:16]}")
        r.last_used = time.time()
        if verb == "attach":
            return self._attach_reply(rid, r, args)
        return reply_ok(rid, cached=cached, **self._model_info(r))

    def _run_job(self, job: PreloadJob, fingerprint: str | None) -> None:
        t0 = time.perf_counter()
        storage: CpuArenaFile | CudaArena | None = None
        tmp = None
        try:
            target = resolve_dtype(job.ckpt, job.dtype)
            planned, total = plan_arena(job.ckpt, job.quantization, target, self.device.type)
            if self.device.type == "cpu":
                tmp = self.arena_dir / f".building-{secrets.token_hex(6)}.arena"
                storage = CpuArenaFile.create(tmp, total)
            else:
                storage = CudaArena.create(total, self.device)
            manifest = build_arena(job.ckpt, job.quantization, job.dtype, storage.flat, self.device_name,
                                   progress=job.add_bytes, threads=self.threads, planned=planned)
            if fingerprint and manifest.fingerprint != fingerprint:
                raise ProtocolError("fingerprint_mismatch", f"{job.ckpt.model_dir.name} on disk has fingerprint "
                                                            f"{manifest.fingerprint[:16]}, not {fingerprint[:16]}")
            mpath = None
            if isinstance(storage, CpuArenaFile):
                storage, mpath = self._install_cpu_arena(storage, manifest)
            seconds = time.perf_counter() - t0
            now = time.time()
            job.result = Resident(manifest, storage, "preload", now, seconds, now, mpath)
            log.info("preloaded %s (%s, %s): %.1f MB read, %.1f MB arena in %.2fs (%.2f GB/s), fingerprint %s",
                     job.ckpt.model_dir.name, job.quantization, manifest.dtype, job.total_bytes / 1e6,
                     manifest.total_bytes / 1e6, seconds, job.total_bytes / max(seconds, 1e-9) / 1e9,
                     manifest.fingerprint[:16])
        except ProtocolError as e:
            job.error = e
        except Exception as e:
            log.error("preload of %s failed: %s\n%s", job.ckpt.model_dir, e, traceback.format_exc())
            job.error = ProtocolError("load_failed", f"preload of {job.ckpt.model_dir} failed: {e}")
        finally:
            self._end_job(job, storage, tmp)

    def _install_cpu_arena(self, storage: CpuArenaFile, manifest: ArenaManifest,
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
            tmp_manifest = mpath.with_suffix(".json.tmp")
            tmp_manifest.write_text(manifest.to_json())
            os.replace(tmp_manifest, mpath)
        return storage, mpath

    def _end_job(self, job: PreloadJob | ImageJob, storage: CpuArenaFile | CudaArena | None, tmp: Path | None) -> None:
        """A job thread's last step: on failure remove what it built, then wake the socket loop to answer."""
        if job.error is not None:
            if isinstance(storage, CpuArenaFile):
                storage.close()
                storage.unlink()
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        job.done.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _finish_jobs(self, router: zmq.Socket) -> None:
        for key, job in list(self.jobs.items()):
            if not job.done.is_set():
                continue
            del self.jobs[key]
            r = job.result
            if r is not None and isinstance(job, ImageJob):
                r = self._register_image(job, r)
            elif r is not None:
                existing = self.residents.get(r.manifest.fingerprint)
                if existing is not None:  # same bytes already resident (e.g. files touched): keep the old one
                    if isinstance(r.storage, CpuArenaFile) and r.storage.path != existing.storage.path:
                        r.storage.close()
                        r.storage.unlink()
                    r = existing
                else:
                    self.residents[r.manifest.fingerprint] = r
                    self.counters["preloads"] += 1
                    self.counters["preload_bytes_read"] += job.total_bytes
                    self._drop_stale(r)
            for identity, rid, verb, args in job.waiters:
                try:
                    if job.error is not None:
                        raise job.error
                    reply = self._done_reply(rid, verb, args, r, cached=False)
                except ProtocolError as e:
                    reply = reply_error(rid, e.code, e.message)
                router.send_multipart([identity, encode(reply)])

    def _register_image(self, job: ImageJob, r: Resident) -> Resident | None:
        """Make a checked image resident, evicting for the budget only now (a failed load evicted nothing)."""
        existing = self.residents.get(r.manifest.fingerprint)
        if existing is not None:  # loaded meanwhile (a preload of the same bytes): keep that one
            if isinstance(r.storage, CpuArenaFile) and r.storage.path != existing.storage.path:
                r.storage.close()
                r.storage.unlink()
            return existing
        try:
            victims = self._room_plan(job.arena_bytes, r.manifest.model_name)
        except ProtocolError as e:
            self._drop_storage(r)
            job.error = e
            return None
        for v in victims:
            self._evict(v.manifest.fingerprint, reason="memory budget (least recently used)")
        self.residents[r.manifest.fingerprint] = r
        self.counters["images_loaded"] += 1
        return r

    def _drop_stale(self, fresh: Resident) -> None:
        """An older arena of the same model/quantization whose checkpoint changed on disk: evict it if unleased."""
        m = fresh.manifest
        for fp, r in list(self.residents.items()):
            o = r.manifest
            same_model = (o.model, o.quantization, o.dtype) == (m.model, m.quantization, m.dtype)
            if fp != m.fingerprint and same_model and not any(x.fingerprint == fp for x in self.leases.values()):
                self._evict(fp, reason="checkpoint changed on disk")

    def _send_progress(self, router: zmq.Socket) -> None:
        for job in self.jobs.values():
            elapsed = time.monotonic() - job.started
            for identity, rid, _verb, _args in job.waiters:
                router.send_multipart([identity, encode(event(
                    rid, "progress", model=job.key[0], bytes_done=job.bytes_done, bytes_total=job.total_bytes,
                    seconds=round(elapsed, 3)))])

    # -- memory ----------------------------------------------------------------------------------------------------
    def _resident_bytes(self) -> int:
        return sum(r.nbytes for r in self.residents.values()) + self.adapters.nbytes

    def _make_room(self, needed: int, name: str) -> None:
        for r in self._room_plan(needed, name):
            self._evict(r.manifest.fingerprint, reason="memory budget (least recently used)")

    def _room_plan(self, needed: int, name: str) -> list[Resident]:
        """The least recently used models without leases to evict so that ``needed`` bytes fit the budget (oldest
        first); raises ProtocolError ``memory_budget`` when they cannot. Evicts nothing itself."""
        if self.memory_budget is None:
            return []
        pending = sum(j.arena_bytes for j in self.jobs.values())
        if needed + pending > self.memory_budget:
            raise ProtocolError("memory_budget", f"{name} needs {needed / 1e6:.1f} MB but the memory budget is "
                                                 f"{self.memory_budget / 1e6:.1f} MB")
        free = self.memory_budget - self._resident_bytes() - pending
        if needed <= free:
            return []
        candidates = sorted((r for fp, r in self.residents.items()
                             if not any(x.fingerprint == fp for x in self.leases.values())),
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

    def _evict(self, fingerprint: str, reason: str) -> None:
        r = self.residents.get(fingerprint)
        if r is None:
            return
        for lease_id in [k for k, x in self.leases.items() if x.fingerprint == fingerprint]:
            del self.leases[lease_id]
        self._drop_resident(fingerprint)
        self.counters["evictions"] += 1
        log.info("evicted %s (%s): %s", r.manifest.model_name, fingerprint[:16], reason)

    def _drop_resident(self, fingerprint: str) -> None:
        self._drop_storage(self.residents.pop(fingerprint))

    @staticmethod
    def _drop_storage(r: Resident) -> None:
        if isinstance(r.storage, CpuArenaFile):
            r.storage.close()
            r.storage.unlink()
            if r.manifest_path is not None:
                r.manifest_path.unlink(missing_ok=True)
        else:
            r.storage.flat = None
            torch.cuda.ipc_collect()  # release blocks whose IPC consumers are gone (killed workers included)
            torch.cuda.empty_cache()

    # -- leases ----------------------------------------------------------------------------------------------------
    def reap_leases(self) -> None:
        now = time.monotonic()
        for lease_id, lease in list(self.leases.items()):
            reason = None
            if not pid_alive(lease.pid):
                reason = f"pid {lease.pid} is gone"
            elif now - lease.last_seen > self.lease_ttl:
                reason = f"no renewal for {now - lease.last_seen:.1f}s"
            if reason:
                del self.leases[lease_id]
                self.counters["leases_dropped"] += 1
                log.info("lease %s dropped: %s", lease_id, reason)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped by its parent) holds no lease
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sd_notify(state: str) -> bool:
    """Tell systemd (Type=notify) our state, when it started us; a no-op otherwise.

    ``state`` is newline-separated ``KEY=value`` pairs (``READY=1``, ``STOPPING=1``, ``STATUS=...``). A notify
    socket that cannot be reached is logged, never fatal: the daemon keeps serving (systemd will time it out).
    """
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as e:
        log.warning("sd_notify(%s) to %s failed: %s", state.split("\n", 1)[0], os.environ["NOTIFY_SOCKET"], e)
        return False
    return True
