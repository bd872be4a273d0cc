"""The listening socket a server serves on (the supervisor's, or a plain server's own).

Rules: a socket systemd passes (socket activation) is taken before anything can start a child process, and
``LISTEN_*`` is dropped so no child inherits it; every listening socket is non-inheritable (a daemon or lease
keeper the worker starts must not hold it); an inherited socket is re-``listen()``-ed with the kernel's maximum
backlog so connections that arrive during a restart wait in the kernel's queue.
"""

from __future__ import annotations

import os
import socket


class ListenError(ValueError):
    """The port cannot be listened on; one line naming it."""


def systemd_socket() -> socket.socket | None:
    """The listening socket systemd passes (socket activation: LISTEN_PID is us, LISTEN_FDS >= 1, fd 3)."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    try:
        n = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return None
    if n < 1:
        return None
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)  # not inherited by children
    sock = socket.socket(fileno=3)
    sock.set_inheritable(False)  # e.g. a daemon the engine starts must not hold the listening socket
    sock.setblocking(False)
    return sock


def listen_backlog() -> int:
    """The backlog to re-``listen()`` an inherited socket with: the kernel's maximum (``net.core.somaxconn``).

    asyncio calls ``listen()`` again on a socket it is given, which replaces the queue length systemd set
    (``Backlog=``); asking for the maximum never shrinks it, so connections that arrive while the server restarts
    keep waiting in the kernel's queue.
    """
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return int(f.read())
    except (OSError, ValueError):
        return socket.SOMAXCONN


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP listening socket on (host, port) with the kernel's maximum backlog (what the supervisor hands to
    each worker it starts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=listen_backlog())
    # Accepted sockets inherit it. asyncio sets TCP_NODELAY only where the socket's proto says TCP, and this one's is
    # 0: without it every kept-alive response waits ~40 ms for the client's delayed ACK (headers and body are two
    # writes).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.set_inheritable(False)
    sock.setblocking(False)
    return sock


def listen(host: str, port: int) -> socket.socket:
    """``bind_listener``, with a port in use as one ListenError line (said before anything is loaded)."""
    try:
        return bind_listener(host, port)
    except OSError as e:
        raise ListenError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); is another server "
                          "running there?") from None
