"""A real OCI registry for tests (Debian's `docker-registry`, the CNCF distribution server) and a small HTTP proxy in
front of it that counts requests and injects faults: a corrupted blob, a connection dropped in the middle of an
upload chunk, Bearer token auth."""

from __future__ import annotations

import base64
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from support.ports import free_port
from support.procs import stop_process
from support.wait import wait_until

REGISTRY_BIN = "docker-registry"
SKIP_WHY = ("the OCI registry tests need Debian's docker-registry package (/usr/bin/docker-registry); `make test` "
            "installs it when run as root")


@dataclass
class Registry:
    proc: subprocess.Popen
    root: Path
    port: int

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_process(self.proc, timeout=10)


def start_registry(root: Path) -> Registry:
    """`docker-registry serve` on a free 127.0.0.1 port, storing under ``root``; skips when it is not installed."""
    exe = shutil.which(REGISTRY_BIN)
    if exe is None:
        pytest.skip(SKIP_WHY)
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (root / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {root / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n")
    log = open(root / "registry.log", "wb")  # noqa: SIM115 (kept open by the process)
    proc = subprocess.Popen([exe, "serve", str(root / "config.yml")], stdout=log, stderr=log)

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"docker-registry exited: {(root / 'registry.log').read_text()[-2000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, 30, interval=0.1,
                   message=lambda: f"docker-registry did not start: {(root / 'registry.log').read_text()[-2000:]}")
    except AssertionError:
        proc.kill()
        raise
    return Registry(proc, root, port)


@dataclass
class Faults:
    corrupt: set[str] = field(default_factory=set)  # blob digests (hex) whose GET body gets one byte flipped
    drop_patch: str | None = None  # "before": drop a PATCH unforwarded; "partial": forward half of it, then drop
    drop_range: str = ""  # only a PATCH with this Content-Range is dropped (any, when empty)
    bearer: tuple[str, str, str] | None = None  # (user, password, token): /v2/ wants `Bearer token`


class Proxy:
    """HTTP proxy to the registry; ``log`` holds (method, path, Content-Range) of every request it got."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.faults = Faults()
        self.log: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        self.client = httpx.Client(timeout=60)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def handle_one(self) -> None:
                proxy.handle(self)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = handle_one

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()

    def requests(self, method: str, pattern: str = "") -> list[tuple[str, str, str]]:
        return [e for e in self.log if e[0] == method and re.search(pattern, e[1])]

    def _reply(self, h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        if h.command != "HEAD" or "Content-Length" not in headers:
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _auth_ok(self, h: BaseHTTPRequestHandler) -> bool:
        f = self.faults.bearer
        if f is None:
            return True
        user, password, token = f
        if h.path.startswith("/token"):
            basic = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
            if h.headers.get("Authorization") == basic:
                self._reply(h, 200, {"Content-Type": "application/json"}, b'{"token": "%s"}' % token.encode())
            else:
                self._reply(h, 401, {}, b'{"errors": [{"code": "UNAUTHORIZED", "message": "bad credentials"}]}')
            return False
        if h.headers.get("Authorization") != f"Bearer {token}":
            realm = f'Bearer realm="http://{self.host}/token",service="test",scope="repository:x:pull,push"'
            self._reply(h, 401, {"WWW-Authenticate": realm},
                        b'{"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]}')
            return False
        return True

    def _maybe_drop(self, h: BaseHTTPRequestHandler, body: bytes, headers: dict[str, str]) -> bool:
        """Fault injection on PATCH: True when the connection was dropped (nothing answered)."""
        with self.lock:
            if self.faults.drop_patch is None:
                return False
            if self.faults.drop_range and h.headers.get("Content-Range") != self.faults.drop_range:
                return False
            mode, self.faults.drop_patch = self.faults.drop_patch, None
        if mode == "partial":  # the registry gets the first half of the chunk, the client hears nothing
            start = int(h.headers["Content-Range"].split("-")[0])
            half = body[: len(body) // 2]
            rest = {k: v for k, v in headers.items() if k.lower() != "content-range"}
            self.client.request("PATCH", self.upstream + h.path, content=half,
                                headers={**rest, "Content-Range": f"{start}-{start + len(half) - 1}"})
        h.close_connection = True
        h.connection.shutdown(socket.SHUT_RDWR)
        return True

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        with self.lock:
            self.log.append((h.command, h.path, h.headers.get("Content-Range", "")))
        if not self._auth_ok(h):
            return
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("content-length", "connection",
                                                                          "authorization")}
        if h.command == "PATCH" and self._maybe_drop(h, body, headers):
            return
        r = self.client.request(h.command, self.upstream + h.path, content=body or None, headers=headers)
        out = r.content
        m = re.search(r"/blobs/sha256:([0-9a-f]{64})$", h.path)
        if h.command == "GET" and m and m.group(1) in self.faults.corrupt and out:
            out = bytes([out[0] ^ 0xFF]) + out[1:]
        drop = ("transfer-encoding", "connection", "content-encoding") + (() if h.command == "HEAD" else
                                                                            ("content-length",))
        keep = {k.title(): v for k, v in r.headers.items() if k.lower() not in drop}
        self._reply(h, r.status_code, keep, out)


@dataclass
class RegistryEnv:
    registry: Registry
    proxy: Proxy

    @property
    def host(self) -> str:
        return self.proxy.host


def registry_env(root: Path) -> Iterator[RegistryEnv]:
    reg = start_registry(root)
    proxy = Proxy(f"http://{reg.host}")
    try:
        yield RegistryEnv(reg, proxy)
    finally:
        proxy.close()
        reg.stop()
