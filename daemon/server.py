"""The keepwarm daemon: the socket loop and its verbs. It keeps models resident and hands them to workers.

One thread runs the socket loop (a pyzmq ROUTER on ``ipc://$KEEPWARM_RUNTIME_DIR/daemon.sock``), so ``status``
answers at once even while a model loads. The rooms around it (loads, jobs, residency, leases) and what each owns:
docs/architecture.md, "The daemon"; the weights are read, converted and packed by keepwarm.weights. Rules:
- Peers must have our uid (``IPC_FILTER_UID``: SO_PEERCRED), in a 0700 directory; messages are msgpack, never pickle.
- Only this loop touches residency, leases and the job table; job threads touch their own job and files.
- ``load_image`` copies a snapshot's arena image into a new arena, checked against the manifest's ``arena_digest``
  (nothing re-quantized, no checkpoint read); models it evicts for the budget go only once the new arena checked out.
- A failed operation leaves nothing resident (no ``status`` entry, no arena file, nothing a restarted daemon
  re-adopts): ``adapters.py`` checks before it writes a byte, ``jobs.py`` removes every file a failed job made.
- A clean shutdown (``shutdown`` verb, SIGTERM, SIGINT) removes every arena and the arena directory.
- A CPU daemon pays a preload's one-time costs (the packing probe, the native library: ``weights.loader.warm_up``)
  at start, in a thread that touches only those process-wide caches, so its first preload does not.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import re
import signal
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import zmq

from keepwarm.daemon.adapters import AdapterStore
from keepwarm.daemon.leases import Leases
from keepwarm.daemon.loads import Loads, resolve_model, waiter_arena
from keepwarm.daemon.protocol import (
    AdapterReply,
    AttachArgs,
    AttachReply,
    EvictArgs,
    LeaseArgs,
    LoadAdapterArgs,
    LoadImageArgs,
    LoadReply,
    PreloadArgs,
    UnloadAdapterArgs,
    decode_request,
    encode,
    encode_request,
    reply_error,
    reply_ok,
)
from keepwarm.daemon.residency import Residency, Resident, parse_memory_budget
from keepwarm.formats import paths
from keepwarm.formats.adapter import LoRAError
from keepwarm.formats.arena import (
    ArenaManifest,
    CudaArena,
    cuda_device_by_uuid,
    cuda_uuid,
)
from keepwarm.formats.layout import Layout
from keepwarm.formats.version import __version__
from keepwarm.formats.wire import ProtocolError
from keepwarm.kernels.cpu_malloc import keep_freed_memory
from keepwarm.weights.loader import warm_up
from keepwarm.weights.portable import PORTABLE_DEVICE, PortableError, platform_descriptor, pm_of

log = logging.getLogger("keepwarm.daemon")

PROGRESS_INTERVAL_S = 0.25
REAP_INTERVAL_S = 1.0


class Daemon:
    def __init__(self, runtime_dir: Path | None = None, memory_budget: str | None = None, lease_ttl: float = 15.0,
                 device: str = "cpu", threads: int = 4) -> None:
        self.runtime_dir = runtime_dir or paths.runtime_dir()
        self.device = self._pick_device(device)
        self.memory_budget = parse_memory_budget(memory_budget, self.device)
        self.lease_ttl = lease_ttl
        self.threads = threads
        self.counters = {"preloads": 0, "preload_bytes_read": 0, "adopted": 0, "attaches": 0, "evictions": 0,
                         "leases_dropped": 0, "images_loaded": 0, "rejected_requests": 0, "adapter_file_reads": 0,
                         "adapter_loads": 0}
        self.started_at = time.time()
        self._stop = False
        self._lock_fd: int | None = None
        self.arena_dir = paths.shm_dir(self.runtime_dir)
        self.adapters = AdapterStore(self.arena_dir)
        self.leases = Leases(lease_ttl, self.counters)
        self.residency = Residency(self.arena_dir, self.device, self.memory_budget, threads, self.adapters,
                                   self.leases, self.counters, lambda: self.loads.building_bytes())
        self.loads = Loads(self.residency, self.device_name)

    @staticmethod
    def _pick_device(name: str) -> torch.device:
        if name.startswith("cuda"):
            uuid = name.split(":", 1)[1] if ":" in name and not name.split(":", 1)[1].isdigit() else None
            return cuda_device_by_uuid(uuid) if uuid else torch.device(name)
        return torch.device("cpu")

    @property
    def device_name(self) -> str:
        return "cpu" if self.device.type == "cpu" else f"cuda:{cuda_uuid(self.device)}"

    @functools.cached_property
    def platform(self) -> dict[str, Any]:
        """What this daemon's arena layouts depend on (``weights.portable.platform_descriptor``): a snapshot's
        image made on a platform of the same ``key`` loads as it is. Found at the first ``status`` (a packing
        probe, ~0.1 s), not at start."""
        return platform_descriptor(self.device)

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
        keep_freed_memory()  # a load's packs and scratch reuse freed pages (kernels/cpu_malloc.py); trimmed after it
        if self.device.type == "cpu":
            paths.ensure_private_dir(self.arena_dir)
            self.residency.adopt()
            threading.Thread(target=self._warm_up, name="warm-up", daemon=True).start()
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
        poller.register(self.loads.wake_fd, zmq.POLLIN)
        # Under systemd (Type=notify), READY=1 goes out only once a `status` sent through the socket, exactly
        # as a client sends it, has been answered by this loop: units ordered After= us can use us at once.
        probe: zmq.Socket | None = None
        if os.environ.get("NOTIFY_SOCKET"):
            probe = ctx.socket(zmq.DEALER)
            probe.setsockopt(zmq.LINGER, 0)
            probe.connect(paths.endpoint(self.runtime_dir))
            probe.send(encode_request("sd-ready-probe", "status", {}))
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
                if self.loads.wake_fd in events:
                    self.loads.woken()
                now = time.monotonic()
                self._finish_jobs(router)
                if now - last_progress >= PROGRESS_INTERVAL_S:
                    self._send_progress(router)
                    last_progress = now
                if now - last_reap >= REAP_INTERVAL_S:
                    self.leases.reap()
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

    @staticmethod
    def _warm_up() -> None:
        """A CPU daemon's one-time costs (``weights.loader.warm_up``) paid at start, beside the socket loop, not
        inside the first preload; a failure here only logs: the preload then pays them, or says what fails."""
        try:
            log.info("warm-up: the packing probe, native kernels and hashes ready in %.2fs", warm_up())
        except Exception as e:  # noqa: BLE001 - the first preload meets the same failure and reports it
            log.warning("warm-up failed (the first preload will pay it): %s", e)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        self._stop = True

    def shutdown_cleanup(self) -> None:
        self.loads.wait_all()
        self.residency.clear()

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

    def _model_info(self, r: Resident) -> dict[str, Any]:
        m = r.manifest
        leases = self.leases.holders(m.fingerprint)
        return {"model": m.model, "name": m.model_name, "fingerprint": m.fingerprint, "quantization": m.quantization,
                "dtype": m.dtype, "device": m.device, "bytes": m.total_bytes, "origin": r.origin,
                "load_seconds": round(r.load_seconds, 4), "loaded_at": r.loaded_at, "last_used": r.last_used,
                "leases": [{"lease_id": x.lease_id, "pid": x.pid} for x in leases],
                "source_bytes": r.source_bytes, "arena_bytes": r.arena_bytes, "tp_rank": m.tp_rank,
                "tp_size": m.tp_size, "pp_stage": m.pp_stage, "pp_size": m.pp_size,
                "source_fingerprint": m.source_fingerprint}

    def _verb_status(self, _identity: bytes, rid: str, _args: Any) -> dict:
        return reply_ok(rid, pid=os.getpid(), version=__version__, socket=str(paths.socket_path(self.runtime_dir)),
                        runtime_dir=str(self.runtime_dir), arena_dir=str(self.arena_dir), device=self.device_name,
                        platform=self.platform,
                        memory_budget=self.memory_budget, resident_bytes=self.residency.resident_bytes(),
                        adapters=[e.info() for e in self.adapters.entries.values()],
                        uptime_s=round(time.time() - self.started_at, 3), counters=dict(self.counters),
                        models=[self._model_info(r) for r in self.residency.residents.values()],
                        loading=self.loads.loading(),
                        leases=len(self.leases))

    def _verb_list(self, _identity: bytes, rid: str, _args: Any) -> dict:
        return reply_ok(rid, models=[self._model_info(r) for r in self.residency.residents.values()])

    def _verb_load_adapter(self, _identity: bytes, rid: str, args: LoadAdapterArgs) -> dict:
        if self.device.type != "cpu":
            raise ProtocolError("unsupported", "adapters are kept on CPU daemons only for now")
        paths.ensure_private_dir(self.arena_dir)
        reads = self.adapters.file_reads
        try:
            entry, cached = self.adapters.load(args.path)
        except LoRAError as e:
            raise ProtocolError("bad_adapter", str(e)) from None
        except OSError as e:  # unreadable files, or no room in the arena directory (what it wrote is removed)
            raise ProtocolError("load_failed", f"adapter {args.path}: {e.strerror or e}"
                                               f"{f' ({e.filename})' if e.filename else ''}") from None
        self.counters["adapter_file_reads"] += self.adapters.file_reads - reads
        self.counters["adapter_loads"] += 1
        return reply_ok(rid, **AdapterReply(cached, entry.digest, entry.path, entry.config_json, entry.data_file,
                                            entry.size).to_dict())

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
        r = self.loads.load_or_wait((identity, rid, "preload", args), args.model, args.quantization, args.dtype,
                                    args.fingerprint, self._layout(Layout(0, args.tp_size, 0, args.pp_size)))
        return None if r is None else self._done_reply(rid, "preload", args, r, cached=True)

    def _layout(self, layout: Layout) -> Layout:
        """``layout`` checked: shard arenas are built by CPU daemons only."""
        try:
            layout.check()
        except ValueError as e:
            raise ProtocolError("bad_request", str(e)) from None
        if not layout.whole and self.device.type != "cpu":
            raise ProtocolError("unsupported", f"shard arenas (tensor or pipeline parallel) are built by CPU daemons "
                                               f"only (this daemon holds {self.device_name}); attach the whole arena")
        return layout

    def _verb_attach(self, identity: bytes, rid: str, args: AttachArgs) -> dict | None:
        if args.pid <= 0:
            raise ProtocolError("bad_request", "attach: pid must be positive")
        layout = self._layout(Layout(args.tp_rank, args.tp_size, args.pp_stage, args.pp_size))
        if not args.preload:
            if args.fingerprint:  # no checkpoint needed (a snapshot's restored model directory has no weights)
                r = self.residency.find(("", "", ""), args.fingerprint, layout)
            else:
                _, key = resolve_model(args.model, args.quantization, args.dtype)
                r = self.residency.find(key, None, layout)
            if r is None:
                shard = "" if layout.whole else f", {layout}"
                raise ProtocolError("not_resident", f"{args.model} ({args.quantization}{shard}) is not resident")
            return self._attach_reply(rid, r, args, cached=True)
        r = self.loads.load_or_wait((identity, rid, "attach", args), args.model, args.quantization, args.dtype,
                                    args.fingerprint, layout)
        return None if r is None else self._done_reply(rid, "attach", args, r, cached=True)

    def _attach_reply(self, rid: str, r: Resident, args: AttachArgs, cached: bool) -> dict:
        lease = self.leases.grant(args.pid, r.manifest.fingerprint)
        r.last_used = lease.created
        self.counters["attaches"] += 1
        if isinstance(r.storage, CudaArena):
            arena = {"kind": "cuda", **r.storage.export_handle()}
        else:
            arena = {"kind": "cpu", "path": str(r.storage.path), "size": r.storage.size}
        log.info("lease %s: pid %d attached %s", lease.lease_id, args.pid, r.manifest.model_name)
        return reply_ok(rid, **AttachReply(lease.lease_id, self.lease_ttl, r.manifest.to_json(), arena, r.origin,
                                           cached).to_dict())

    def _verb_detach(self, _identity: bytes, rid: str, args: LeaseArgs) -> dict:
        lease = self.leases.pop(args.lease_id)
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
        residents = self.residency.residents
        matches = [fp for fp, r in residents.items()
                   if r.manifest.model == resolved or r.manifest.model_name == target
                   or (len(target) >= 8 and (fp.startswith(target) or
                                             r.manifest.model_fingerprint.startswith(target)))]
        if not matches:
            raise ProtocolError("not_resident", f"no resident model matches {target!r}")
        for fp in matches:
            held = self.leases.holders(fp)
            if held and not args.force:
                raise ProtocolError("in_use", f"{residents[fp].manifest.model_name} has {len(held)} live "
                                              f"lease(s) (pids {', '.join(str(x.pid) for x in held)}); use force")
        for fp in matches:
            self.residency.evict(fp, reason="requested")
        return reply_ok(rid, evicted=matches)

    def _verb_load_image(self, identity: bytes, rid: str, args: LoadImageArgs) -> dict | None:
        try:
            manifest = pm_of(args.manifest) if args.portable else ArenaManifest.from_json(args.manifest)
        except PortableError as e:
            raise ProtocolError(e.code, f"load_image: {e.message}") from None
        except (ValueError, KeyError, TypeError) as e:
            raise ProtocolError("bad_image", f"load_image: the manifest does not parse: {e}") from None
        if not args.portable and manifest.device == PORTABLE_DEVICE:
            raise ProtocolError("bad_image", "load_image: the image is a portable layer: load it with portable set")
        r = self.residency.residents.get(manifest.fingerprint)
        if r is not None:  # the same model is resident already: kept as it is
            return self._done_reply(rid, "load_image", args, r, cached=True)
        image = Path(args.image)
        if not image.is_absolute():
            raise ProtocolError("bad_request", "load_image: the image path must be absolute")
        if args.sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", args.sha256):
            raise ProtocolError("bad_request", "load_image: sha256 must be 64 lowercase hex digits")
        self.loads.load_image((identity, rid, "load_image", args), manifest, image, args.sha256, args.portable)
        return None  # answered when the job finishes

    # -- answers -----------------------------------------------------------------------------------------------------
    def _done_reply(self, rid: str, verb: str, args: Any, r: Resident, cached: bool) -> dict:
        m = r.manifest
        if getattr(args, "fingerprint", None) and m.model_fingerprint != args.fingerprint:
            raise ProtocolError("fingerprint_mismatch",
                                f"{m.model_name} is resident with fingerprint {m.model_fingerprint[:16]}, "
                                f"not the requested {args.fingerprint[:16]}")
        r.last_used = time.time()
        if verb == "attach":
            return self._attach_reply(rid, r, args, cached)
        shards = []
        if not m.layout.whole:  # a split preload: every shard, stage-major
            siblings = [x for x in self.residency.residents.values() if x.manifest.source_fingerprint ==
                        m.source_fingerprint and x.manifest.layout.sizes == m.layout.sizes]
            shards = [self._model_info(x) for x in sorted(siblings, key=lambda x: (x.manifest.pp_stage,
                                                                                    x.manifest.tp_rank))]
        return reply_ok(rid, **LoadReply(cached=cached, shards=shards, **self._model_info(r)).to_dict())

    def _finish_jobs(self, router: zmq.Socket) -> None:
        for (identity, rid, verb, args), made, error in self.loads.finished():
            try:
                if error is not None:
                    raise error
                reply = self._done_reply(rid, verb, args, waiter_arena(made, args), cached=False)
            except ProtocolError as e:
                reply = reply_error(rid, e.code, e.message)
            except Exception as e:  # a bug answers its waiter; it must not leave it waiting
                log.error("internal error answering %s: %s\n%s", verb, e, traceback.format_exc())
                reply = reply_error(rid, "internal", f"{type(e).__name__}: {e}")
            router.send_multipart([identity, encode(reply)])

    def _send_progress(self, router: zmq.Socket) -> None:
        for identity, progress in self.loads.progress():
            router.send_multipart([identity, encode(progress)])

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
