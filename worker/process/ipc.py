"""The messages between `keepwarm serve --zygote`'s processes: supervisor, zygote, workers, `keepwarm restart`.

Rules:
- one message per ``SOCK_SEQPACKET`` datagram: a keepwarm.formats.wire frame (msgpack, never pickle)
  ``{"v": IPC_VERSION, "type": <name>, ...fields}``; each type is a frozen dataclass below, checked on arrival
  (``CODEC``: a missing or mistyped field is a ``ProtocolError`` naming it; unknown fields are ignored);
- file descriptors (the listening socket, a worker's status socket) travel beside a message as ``SCM_RIGHTS``
  and arrive non-inheritable;
- the supervisor's links to its zygotes and workers are socketpairs (no name anyone could connect to); the one
  named socket, the supervisor's control socket ``$KEEPWARM_RUNTIME_DIR/serve-<port>.sock``, lives in the 0700
  runtime directory and answers only peers of our own uid (``SO_PEERCRED``).
"""

from __future__ import annotations

import os
import select
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keepwarm.formats import paths
from keepwarm.formats.wire import Codec, ProtocolError

IPC_VERSION = 2  # 1: JSON frames
MAX_MESSAGE_BYTES = 1 << 20
MAX_FDS = 4


# -- zygote <-> supervisor ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    """The zygote's first message, once its imports are done."""

    pid: int
    python: str
    version: str
    import_s: float


@dataclass(frozen=True)
class Fork:
    """Fork a worker serving ``config`` (``ServerConfig.to_dict()``); fds: [listening socket, status socket]."""

    config: dict[str, Any]
    restarts: dict[str, Any]  # the supervisor's restart history (shown in /metrics and /health)
    log_level: str = "INFO"
    standby: bool = False  # warm up, say Standing, and accept only once told Go (``serve --standby``)


@dataclass(frozen=True)
class Forked:
    pid: int


@dataclass(frozen=True)
class Probe:
    """Ask the zygote what it holds (the tests' proof that it never built an engine or touched a GPU)."""


@dataclass(frozen=True)
class ProbeReply:
    pid: int
    threads: int
    cuda_initialized: bool
    engines: int  # LLMEngine objects alive in the zygote
    modules: int  # torch.nn.Module objects alive in the zygote
    event_loop: bool  # an asyncio event loop exists
    tokenizers: list[str] = field(default_factory=list)  # tokenizer directories preloaded for the workers


# -- worker <-> supervisor (the worker's status socket) -----------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The worker attached, warmed its first step and accepts on the listening socket."""

    pid: int
    ready_s: float  # fork to ready
    weights_source: str
    cuda_initialized: bool
    phases: dict[str, float] = field(default_factory=dict)  # seconds per startup phase (serve.serve)


@dataclass(frozen=True)
class Standing:
    """A standby worker attached and warmed its first step; it does not accept until Go (then it says Ready)."""

    pid: int
    ready_s: float  # fork to standing
    phases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Go:
    """Supervisor -> standby worker: start accepting on the listening socket and say Ready."""


@dataclass(frozen=True)
class Failed:
    """The worker could not start (its config, the weights, the warm-up); it exits."""

    error: str


@dataclass(frozen=True)
class Drain:
    """Supervisor -> old worker: stop accepting now, finish what is in flight, exit."""


@dataclass(frozen=True)
class Draining:
    """Old worker -> supervisor: its listeners are closed (the new worker alone accepts)."""

    pid: int


@dataclass(frozen=True)
class ExportPrefixes:
    """Supervisor -> old worker, before its Drain: its cached prefix blocks into a memfd
    (keepwarm.worker.prefix_handover); it answers CarriedPrefixes, with fds: [the memfd] when ``blocks`` > 0."""


@dataclass(frozen=True)
class AdoptPrefixes:
    """Supervisor -> new worker: adopt the blocks of the export beside (fds: [the memfd]); it answers
    CarriedPrefixes."""

    blocks: int


@dataclass(frozen=True)
class CarriedPrefixes:
    """What a worker's prefix handover did (keepwarm.worker.prefix_handover returns it): the blocks it exported
    or adopted (0, and ``reason`` why, when it did nothing), their bytes, the seconds it took."""

    blocks: int
    nbytes: int
    seconds: float
    reason: str = ""


@dataclass(frozen=True)
class Exit:
    code: int


@dataclass(frozen=True)
class Restarts:
    """Supervisor -> worker: the restart history, after each handoff."""

    history: dict[str, Any]


# -- `keepwarm restart` <-> supervisor (the control socket) -------------------------------------------------------
@dataclass(frozen=True)
class RestartRequest:
    flags: dict[str, Any] = field(default_factory=dict)  # serve flags given (None = not given), merged over the last
    config_file: str | None = None  # a server.toml to use from now on ("" = none)
    replace_flags: bool = False  # the running flags are dropped (but for host, port and runtime_dir, where the
    # server listens and which daemon it uses): config_file and ``flags`` alone (a restored snapshot's config)
    python: str | None = None  # the Python (another venv, another keepwarm) to fork the new worker from
    prepare: bool = False  # only start that Python's zygote in the background
    timeout: float = 300.0  # seconds the new worker has to become ready


@dataclass(frozen=True)
class RestartReply:
    ok: bool
    message: str
    mode: str = ""  # "standby" (the standby took over), "zygote" (forked from a warm zygote) or "cold" (a zygote had
    # to be started first)
    handoff_s: float = 0.0  # the request to the new worker accepting
    old_pid: int = 0
    new_pid: int = 0


TYPES: dict[str, type] = {cls.__name__.lower(): cls for cls in (
    Hello, Fork, Forked, Probe, ProbeReply, Ready, Standing, Go, Failed, Drain, Draining, ExportPrefixes,
    AdoptPrefixes, CarriedPrefixes, Exit, Restarts, RestartRequest, RestartReply)}
CODEC = Codec("keepwarm", IPC_VERSION, TYPES, tag="type", code="bad_message", max_bytes=MAX_MESSAGE_BYTES,
              unicode_errors="surrogatepass")  # both ends are keepwarm: a path's undecodable bytes travel


def send(sock: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    data = CODEC.encode(message)
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv(sock: socket.socket, timeout: float | None = None) -> tuple[Any, list[int]]:
    """The next message and the fds beside it; EOFError when the peer is gone, TimeoutError after ``timeout``."""
    if timeout is not None and not select.select([sock], [], [], max(0.0, timeout))[0]:
        raise TimeoutError(f"no message within {timeout:.1f}s")
    try:
        data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, MAX_FDS)
    except ConnectionResetError:
        raise EOFError("peer gone") from None
    for fd in fds:
        os.set_inheritable(fd, False)
    if not data:
        for fd in fds:
            os.close(fd)
        raise EOFError("peer gone")
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ProtocolError("bad_message", "message or its fds truncated")
        if data[:1] == b"{":  # no msgpack map starts so: an older keepwarm's JSON (a zygote of another Python)
            raise ProtocolError("version_mismatch", f"message has protocol version 1 (JSON); this keepwarm speaks "
                                                    f"{IPC_VERSION}")
        return CODEC.decode(data), fds
    except ProtocolError:
        for fd in fds:  # a refused message's fds are nobody's
            os.close(fd)
        raise


def expect(sock: socket.socket, cls: Any, timeout: float | None = None) -> Any:
    """The next message, which must be a ``cls`` (a type or a union; any fds beside it are closed)."""
    msg, fds = recv(sock, timeout)
    for fd in fds:
        os.close(fd)
    if not isinstance(msg, cls):
        raise ProtocolError("bad_message", f"expected {getattr(cls, '__name__', cls)}, got {type(msg).__name__}")
    return msg


def pair() -> tuple[socket.socket, socket.socket]:
    """A private message link (no name anyone else could connect to)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return a, b


def peer_uid(conn: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
    return uid


def control_path(port: int, rt: Path | None = None) -> Path:
    """The control socket of the supervised server on ``port`` (in the 0700 runtime directory)."""
    path = (rt or paths.runtime_dir()) / f"serve-{port}.sock"
    if len(str(path)) > paths.MAX_SOCKET_PATH:
        raise paths.RuntimeDirError(f"socket path {path} is longer than {paths.MAX_SOCKET_PATH} bytes; "
                                    "set KEEPWARM_RUNTIME_DIR to a shorter directory")
    return path


def request_restart(port: int, request: RestartRequest | Probe, rt: Path | None = None) -> Any:
    """Ask the supervised server on ``port`` for a restart (blocks until it is done or failed): a RestartReply; or,
    for a Probe, the zygote's ProbeReply (a RestartReply with ok false when there is none)."""
    path = control_path(port, rt)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        try:
            s.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise ConnectionError(f"no supervised server on port {port} (no {path}; is it running with "
                                  "`keepwarm serve --zygote`, with the same KEEPWARM_RUNTIME_DIR?)") from None
        send(s, request)
        try:
            return expect(s, RestartReply | ProbeReply, timeout=getattr(request, "timeout", 0.0) + 120)
        except EOFError:
            raise ConnectionError(f"the server on port {port} closed the control connection without an "
                                  "answer") from None
