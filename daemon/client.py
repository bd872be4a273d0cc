"""Talking to the daemon: a small synchronous client, and starting a daemon when none answers.

The worker reaches the daemon through this module only (an import-linter contract): what it needs of the
protocol comes back as the client's replies and ``DaemonError``, and the lease rule it shares with the daemon
(``pid_alive``: a zombie holds no lease) lives here.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import zmq

from keepwarm.daemon.protocol import (
    AdapterReply,
    AttachReply,
    LoadReply,
    R,
    decode_answer,
    decode_reply,
    encode_request,
)
from keepwarm.formats import paths
from keepwarm.formats.layout import Layout
from keepwarm.formats.wire import ProtocolError

ProgressCallback = Callable[[dict[str, Any]], None]


class DaemonError(RuntimeError):
    """The daemon refused a request (``code`` says why) or did not answer (code ``unavailable``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class DaemonClient:
    """One DEALER socket to the daemon. Not thread-safe: use one client per thread.

    ZeroMQ reconnects by itself and says nothing when the peer goes away, so a request to a daemon that died would
    wait out its whole timeout (60 s for a preload). A monitor on the socket reports the connection's end: a request
    in flight then fails at once, naming the daemon's log."""

    def __init__(self, runtime_dir: Path | None = None, timeout: float = 10.0) -> None:
        self.runtime_dir = runtime_dir or paths.runtime_dir()
        self.timeout = timeout
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._ids = itertools.count()

    @property
    def socket_path(self) -> Path:
        return paths.socket_path(self.runtime_dir)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            self._monitor = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            s.connect(paths.endpoint(self.runtime_dir))
            self._sock = s
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(linger=0)
            self._sock = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    def _drain_disconnects(self) -> None:
        """Forget ends of earlier connections (a daemon restarted between requests: ZeroMQ has reconnected)."""
        assert self._monitor is not None
        while self._monitor.poll(0):
            self._monitor.recv_multipart()

    def _wait(self, sock: zmq.Socket, verb: str, wait: float) -> None:
        """Until ``sock`` has a message; DaemonError ``unavailable`` on ``wait`` seconds of silence, or at once when
        the connection ends (the daemon exited or was killed while answering)."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        ready = dict(poller.poll(int(wait * 1000)))
        if sock in ready:
            return
        self.close()  # the socket may hold a half-sent request now; start afresh next time
        if ready:
            raise DaemonError("unavailable", f"the keepwarm daemon at {self.socket_path} closed the connection "
                                             f"before answering {verb!r} (it exited; its log: "
                                             f"{self.runtime_dir / paths.LOG_NAME})")
        raise DaemonError("unavailable", f"the keepwarm daemon at {self.socket_path} did not answer "
                                         f"{verb!r} within {wait:.0f}s")

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, verb: str, args: dict[str, Any] | None = None, timeout: float | None = None,
                on_event: ProgressCallback | None = None) -> dict[str, Any]:
        """Send one request; return its reply (``ok`` true) or raise :class:`DaemonError`.

        ``timeout`` bounds the silence between messages: a preload streams progress events, so a long load
        does not time out while the daemon works.
        """
        try:
            present = self.socket_path.exists()
        except PermissionError:
            raise DaemonError("unavailable", f"permission denied reaching {self.socket_path} "
                                             "(another user's daemon?)") from None
        if not present:
            raise DaemonError("unavailable", f"no keepwarm daemon socket at {self.socket_path}")
        rid = f"{os.getpid()}-{next(self._ids)}"
        sock = self._socket()
        self._drain_disconnects()
        try:
            frame = encode_request(rid, verb, args or {})
        except ProtocolError as e:  # a request the daemon would refuse unread (too big): refused here, as it would be
            raise DaemonError(e.code, e.message) from None
        sock.send(frame)
        wait = self.timeout if timeout is None else timeout
        while True:
            self._wait(sock, verb, wait)
            msg = decode_answer(sock.recv())
            if msg.get("id") != rid:
                continue  # a late answer to an earlier, timed-out request
            if "event" in msg:
                if on_event is not None:
                    on_event(msg)
                continue
            if msg.get("ok"):
                return msg
            err = msg.get("error") or {}
            raise DaemonError(err.get("code", "error"), err.get("message", "the daemon refused the request"))

    def typed(self, cls: type[R], verb: str, args: dict[str, Any] | None = None, timeout: float | None = None,
              on_event: ProgressCallback | None = None) -> R:
        """``request``, its reply decoded as ``cls``; DaemonError ``bad_reply`` if the reply does not fit."""
        msg = self.request(verb, args, timeout, on_event)
        try:
            return decode_reply(cls, msg)
        except ProtocolError as e:
            raise DaemonError(e.code, f"the daemon's {verb!r} reply: {e.message}") from None

    def ping(self, timeout: float = 2.0) -> dict[str, Any] | None:
        try:
            return self.request("status", timeout=timeout)
        except DaemonError:
            return None

    def status(self) -> dict[str, Any]:
        return self.request("status")

    def preload(self, model: str, quantization: str = "auto", dtype: str = "auto", fingerprint: str | None = None,
                on_event: ProgressCallback | None = None, tp_size: int = 1, pp_size: int = 1) -> LoadReply:
        """``tp_size`` / ``pp_size`` > 1: one shard arena per (pipeline stage, tensor-parallel rank) (the reply's
        ``shards``)."""
        args: dict[str, Any] = {"model": model, "quantization": quantization, "dtype": dtype}
        if fingerprint:
            args["fingerprint"] = fingerprint
        if tp_size != 1:
            args["tp_size"] = tp_size
        if pp_size != 1:
            args["pp_size"] = pp_size
        return self.typed(LoadReply, "preload", args, timeout=60.0, on_event=on_event)

    def attach(self, model: str, quantization: str = "auto", dtype: str = "auto", fingerprint: str | None = None,
               preload: bool = True, on_event: ProgressCallback | None = None,
               pid: int | None = None, layout: Layout | None = None) -> AttachReply:
        """Lease ``model`` for ``pid`` (default: this process; a lease keeper attaches for its worker); a split
        ``layout``: that (stage, rank)'s shard arena (``fingerprint`` is the whole model's)."""
        args: dict[str, Any] = {"model": model, "quantization": quantization, "dtype": dtype,
                                "pid": pid or os.getpid(), "preload": preload}
        if fingerprint:
            args["fingerprint"] = fingerprint
        if layout is not None and not layout.whole:
            args.update(tp_rank=layout.tp_rank, tp_size=layout.tp_size, pp_stage=layout.pp_stage,
                        pp_size=layout.pp_size)
        return self.typed(AttachReply, "attach", args, timeout=60.0, on_event=on_event)

    def load_image(self, manifest_json: str, image: str | Path, sha256: str | None = None,
                   on_event: ProgressCallback | None = None, portable: bool = False) -> LoadReply:
        """Make an arena image resident (no re-quantization); ``image`` is read by the daemon, which checks it
        against ``sha256`` (when given) in the same pass. ``portable``: the image is a portable layer, from which
        the daemon builds this machine's layout (the reply's ``origin`` is then "portable", or "image" where the
        portable layout is this machine's)."""
        args: dict[str, Any] = {"manifest": manifest_json, "image": str(Path(image).absolute())}
        if sha256 is not None:
            args["sha256"] = sha256
        if portable:
            args["portable"] = True
        return self.typed(LoadReply, "load_image", args, timeout=60.0, on_event=on_event)

    def load_adapter(self, path: str | Path) -> AdapterReply:
        """Make a LoRA adapter resident in the daemon's shared memory (read and checked once per content)."""
        return self.typed(AdapterReply, "load_adapter", {"path": str(path)})

    def heartbeat(self, lease_id: str) -> dict[str, Any]:
        return self.request("heartbeat", {"lease_id": lease_id})

    def detach(self, lease_id: str) -> dict[str, Any]:
        return self.request("detach", {"lease_id": lease_id})

    def evict(self, model: str, force: bool = False) -> dict[str, Any]:
        return self.request("evict", {"model": model, "force": force})

    def shutdown(self) -> dict[str, Any]:
        return self.request("shutdown")


def start_daemon(runtime_dir: Path | None = None, memory_budget: str | None = None, device: str = "cpu",
                 wait: float = 30.0, extra_args: list[str] | None = None) -> DaemonClient:
    """Start a detached daemon (its own session, log in the runtime dir) and wait until it answers ``status``."""
    rt = runtime_dir or paths.runtime_dir()
    paths.ensure_private_dir(rt)
    cmd = [sys.executable, "-m", "keepwarm.cli.main", "daemon", "run", "--device", device]
    if memory_budget:
        cmd += ["--memory-budget", memory_budget]
    cmd += extra_args or []
    env = {**os.environ, "KEEPWARM_RUNTIME_DIR": str(rt)}
    with open(rt / paths.LOG_NAME, "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=env,
                                start_new_session=True, close_fds=True)
    client = DaemonClient(rt)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if client.ping(timeout=0.5) is not None:
            return client
        if proc.poll() is not None:
            tail = (rt / paths.LOG_NAME).read_text(errors="replace").strip().splitlines()[-1:] or ["?"]
            raise DaemonError("unavailable", f"the daemon exited with status {proc.returncode}: {tail[0]}")
        time.sleep(0.05)
    raise DaemonError("unavailable", f"the daemon did not answer within {wait:.0f}s (log: {rt / paths.LOG_NAME})")


def ensure_daemon(runtime_dir: Path | None = None, memory_budget: str | None = None,
                  device: str = "cpu") -> tuple[DaemonClient, bool]:
    """A client to a running daemon, starting one if none answers. Returns (client, started)."""
    client = DaemonClient(runtime_dir)
    if client.ping(timeout=1.0) is not None:
        return client, False
    client.close()
    return start_daemon(runtime_dir, memory_budget, device), True


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` can hold a lease: it exists and is not a zombie (killed, not yet reaped by its parent). The
    daemon drops the leases of pids that are not; a lease keeper stops renewing for its worker by the same rule."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
