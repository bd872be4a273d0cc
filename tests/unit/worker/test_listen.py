"""The listening socket a server (or its supervisor) binds: accepted connections have Nagle's algorithm off."""

from __future__ import annotations

import socket

from keepwarm.worker.process.listen import bind_listener


def test_accepted_connections_have_tcp_nodelay() -> None:
    # asyncio sets TCP_NODELAY only on sockets whose proto says TCP; create_server's says 0, so without the option on
    # the listener every kept-alive response waited ~40 ms for the client's delayed ACK.
    listener = bind_listener("127.0.0.1", 0)
    listener.setblocking(True)
    try:
        client = socket.create_connection(listener.getsockname()[:2], timeout=5)
        accepted, _ = listener.accept()
        with client, accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        listener.close()
