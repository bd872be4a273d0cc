"""systemd integration: the unit files verify, socket activation queues connections across a server restart, and
the daemon's Type=notify READY=1 comes only once its socket answers."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from keepwarm.daemon.client import DaemonClient
from keepwarm.formats import paths

# End-to-end: real server processes. CI runs them (make test); skip locally with -m "not slow".
pytestmark = pytest.mark.slow

UNIT_DIR = Path(__file__).resolve().parents[2] / "systemd"
UNITS = ("keepwarm-daemon.service", "keepwarm-server.service", "keepwarm.socket")
VENV_KEEPWARM = Path(sys.executable).parent / "keepwarm"


# -- the unit files ----------------------------------------------------------------------------------------------------
def _systemd_analyze() -> str:
    """The systemd-analyze binary, installing systemd when we are root with apt; else skip with the reason."""
    found = shutil.which("systemd-analyze") or ("/usr/bin/systemd-analyze"
                                                if os.access("/usr/bin/systemd-analyze", os.X_OK) else None)
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        r = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "systemd"], env=env,
                           capture_output=True, text=True, timeout=600)
        found = shutil.which("systemd-analyze")
        if found:
            return found
        pytest.skip(f"systemd-analyze is not installed and `apt-get install systemd` failed: "
                    f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    pytest.skip("systemd-analyze is not installed (and installing it needs root and apt-get)")


@pytest.mark.parametrize("variant", ["as-shipped", "venv"])
def test_units_verify(variant: str, tmp_path: Path) -> None:
    """`systemd-analyze verify` accepts the three units with no warning at all.

    ``as-shipped`` checks the files as installed (ExecStart through /usr/bin/env); ``venv`` rewrites ExecStart to
    this venv's ``keepwarm``, as README.md tells venv installs to do, so verify also checks that it is executable.
    """
    analyze = _systemd_analyze()
    for name in UNITS:
        text = (UNIT_DIR / name).read_text()
        if variant == "venv":
            assert VENV_KEEPWARM.is_file(), f"no keepwarm executable next to {sys.executable}"
            text, n = re.subn(r"^ExecStart=/usr/bin/env keepwarm ", f"ExecStart={VENV_KEEPWARM} ", text, flags=re.M)
            assert n == (0 if name.endswith(".socket") else 1), name
        (tmp_path / name).write_text(text)
    # Our copies first, so names such as keepwarm-daemon.service resolve to them, not to installed units.
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:", "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""}
    r = subprocess.run([analyze, "--man=no", "verify", *(str(tmp_path / n) for n in UNITS)], env=env,
                       capture_output=True, text=True, timeout=120)
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 0, out
    assert out == "", f"systemd-analyze verify warned:\n{out}"


def test_unit_settings() -> None:
    """The settings the deployment relies on (verify accepts files that lack them)."""
    daemon = (UNIT_DIR / "keepwarm-daemon.service").read_text()
    server = (UNIT_DIR / "keepwarm-server.service").read_text()
    sock = (UNIT_DIR / "keepwarm.socket").read_text()
    for line in ("Type=notify", "NotifyAccess=main", "ExecStart=/usr/bin/env keepwarm daemon run",
                 "Restart=on-failure", "Environment=KEEPWARM_RUNTIME_DIR=%t/keepwarm", "RuntimeDirectory=keepwarm",
                 "RuntimeDirectoryMode=0700", "RuntimeDirectoryPreserve=yes", "KillSignal=SIGTERM"):
        assert re.search(rf"^{re.escape(line)}$", daemon, re.M), line
    for line in ("After=keepwarm-daemon.service", "BindsTo=keepwarm-daemon.service", "Requires=keepwarm.socket",
                 "After=keepwarm.socket", "Restart=always", "Environment=KEEPWARM_RUNTIME_DIR=%t/keepwarm",
                 "ExecStart=/usr/bin/env keepwarm serve --zygote --config /etc/keepwarm/server.toml",
                 "ExecReload=/bin/kill -HUP $MAINPID", "KillMode=mixed", "KillSignal=SIGTERM"):
        assert re.search(rf"^{re.escape(line)}$", server, re.M), line
    for line in ("ListenStream=127.0.0.1:8000", "Service=keepwarm-server.service"):
        assert re.search(rf"^{re.escape(line)}$", sock, re.M), line
    assert int(re.search(r"^Backlog=(\d+)$", sock, re.M).group(1)) >= 1024
    from keepwarm.worker.process.config import ServerConfig

    stop = int(re.search(r"^TimeoutStopSec=(\d+)$", server, re.M).group(1))
    assert stop > ServerConfig().shutdown_timeout + 10


def test_server_toml_example_has_every_key() -> None:
    """Uncommenting every `# key = value` line of the example gives a valid server.toml naming each ServerConfig key."""
    from keepwarm.worker.process.config import FIELDS, build_config, load_toml

    lines = [m.group(1) for line in (UNIT_DIR / "server.toml.example").read_text().splitlines()
             if (m := re.match(r"^# ?([a-z_]+ = .*)$", line))]
    keys = [line.split(" = ", 1)[0] for line in lines]
    assert sorted(keys) == sorted(FIELDS)
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write("\n".join(lines) + "\n")
        f.flush()
        build_config(load_toml(f.name), {})  # raises ConfigError naming a bad key or value


# -- socket activation -------------------------------------------------------------------------------------------------
def _keepwarm_cmd() -> list[str]:
    return [str(VENV_KEEPWARM)] if VENV_KEEPWARM.is_file() else [sys.executable, "-m", "keepwarm.cli.main"]


def _spawn_activated(listener: socket.socket, model: str, log: Path) -> subprocess.Popen:
    """Start `keepwarm serve` the way systemd does: the listening socket as fd 3, LISTEN_FDS=1, LISTEN_PID=its pid.

    ``sh`` exports LISTEN_PID=$$ and execs keepwarm, so the pid is the server's own after exec.
    """
    fd = listener.fileno()
    cmd = ["sh", "-c", 'LISTEN_PID=$$; export LISTEN_PID; exec "$@"', "sh", *_keepwarm_cmd(), "serve", model,
           "--no-daemon", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--threads", "1",
           "--port", "9", "--shutdown-timeout", "5"]  # --port is ignored: the socket comes from "systemd"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}
    env.update(LISTEN_FDS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, pass_fds=(3,),
                                preexec_fn=lambda: os.dup2(fd, 3))


def _send(port: int, method: str, path: str, body: bytes = b"") -> socket.socket:
    """Connect and send one HTTP/1.1 request; the reply is read later with :func:`_reply`."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    s.sendall(head + body)
    return s


def _reply(s: socket.socket, timeout: float, log: Path) -> tuple[int, bytes]:
    s.settimeout(timeout)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except TimeoutError:
        pytest.fail(f"no complete reply within {timeout:.0f}s (got {data[:200]!r}); server log:\n{log.read_text()}")
    except ConnectionError as e:
        pytest.fail(f"connection failed ({e}) after {data[:200]!r}; server log:\n{log.read_text()}")
    finally:
        s.close()
    assert data.startswith(b"HTTP/1.1 "), (data[:200], log.read_text())
    return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[-1]


def _stop(proc: subprocess.Popen, log: Path) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the server did not exit within 60s of SIGTERM; log:\n{log.read_text()}")


def test_socket_activation_queues_connections_across_restart(tiny_llama: str, tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)  # systemd's copy, open for the whole test
    port = listener.getsockname()[1]
    log = tmp_path / "server.log"
    body = b'{"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}'
    procs: list[subprocess.Popen] = []
    try:
        # 1. Connections made before the server is up are queued by the kernel and answered once it is.
        first = _spawn_activated(listener, tiny_llama, log)
        procs.append(first)
        early = [_send(port, "GET", "/health"), _send(port, "POST", "/v1/completions", body)]
        status, reply = _reply(early[0], 180, log)
        assert status == 200 and b'"ok"' in reply, reply
        status, reply = _reply(early[1], 60, log)
        assert status == 200 and b'"text_completion"' in reply, reply
        assert "systemd socket fd 3" in log.read_text(), log.read_text()

        # 2. Stop it (SIGTERM drains, then exits 0); our copy of the socket keeps listening.
        assert _stop(first, log) == 0, log.read_text()

        # 3. A request sent in the gap, with no server process at all (first has exited), is queued, not refused:
        # the connection stands with nothing read from it, neither answered nor reset ...
        assert first.poll() is not None
        gap = _send(port, "POST", "/v1/completions", body)
        gap.settimeout(0.5)
        with pytest.raises(TimeoutError):
            gap.recv(1, socket.MSG_PEEK)

        # 4. ... and answered by the next server on the same socket.
        second = _spawn_activated(listener, tiny_llama, log)
        procs.append(second)
        status, reply = _reply(gap, 180, log)
        assert status == 200 and b'"text_completion"' in reply, reply
        assert second.poll() is None
        assert _stop(second, log) == 0, log.read_text()
        assert log.read_text().count("on systemd socket fd 3") == 2, log.read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        listener.close()


# -- Type=notify -------------------------------------------------------------------------------------------------------
def _recv_notify(sock: socket.socket, timeout: float) -> tuple[str, int]:
    """One sd_notify datagram and the pid that sent it (SCM_CREDENTIALS)."""
    sock.settimeout(timeout)
    msg, ancdata, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
    pid = -1
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = struct.unpack("3i", data[:struct.calcsize("3i")])[0]
    return msg.decode(), pid


def test_daemon_notifies_ready_only_once_status_answers() -> None:
    rt = Path(tempfile.mkdtemp(prefix="kwsd-", dir="/tmp"))  # short: unix socket paths are limited to 107 bytes
    notify_path = rt / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    notify.bind(str(notify_path))
    env = {**os.environ, "KEEPWARM_RUNTIME_DIR": str(rt / "run"), "NOTIFY_SOCKET": str(notify_path),
           "OMP_NUM_THREADS": "1"}
    log = rt / "daemon.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "keepwarm.cli.main", "daemon", "run", "--threads", "1"],
                                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        try:
            msg, sender = _recv_notify(notify, 120)
        except TimeoutError:
            pytest.fail(f"no sd_notify datagram within 120s; daemon log:\n{log.read_text()}")
        fields = dict(line.split("=", 1) for line in msg.splitlines())
        assert fields.get("READY") == "1", msg
        # NotifyAccess=main: systemd accepts it only from the main pid, which is the process it started.
        assert sender == proc.pid
        assert fields.get("MAINPID") == str(proc.pid)
        # It was sent once the socket listens: connecting right now succeeds (a premature READY=1 would meet
        # "no such file" or "connection refused"), and the daemon answers `status` on it.
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(paths.socket_path(rt / "run")))
        probe.close()
        with DaemonClient(rt / "run", timeout=30.0) as client:
            st = client.status()
        assert st["pid"] == proc.pid
        # Nothing else was sent while running (READY=1 exactly once).
        notify.settimeout(0.3)
        with pytest.raises(TimeoutError):
            notify.recv(4096)

        # KillSignal=SIGTERM is a clean stop: STOPPING=1, exit 0, socket and arena directory gone.
        proc.send_signal(signal.SIGTERM)
        msg, sender = _recv_notify(notify, 30)
        assert msg == "STOPPING=1" and sender == proc.pid
        assert proc.wait(timeout=30) == 0, log.read_text()
        assert not paths.socket_path(rt / "run").exists()
        assert not paths.shm_dir(rt / "run").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
        shutil.rmtree(paths.shm_dir(rt / "run"), ignore_errors=True)
        shutil.rmtree(rt, ignore_errors=True)


def test_ready_follows_a_status_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """In process: when READY=1 goes out, the loop has already answered a `status` sent through the socket."""
    from keepwarm.daemon import server as dserver

    rt = Path(tempfile.mkdtemp(prefix="kwsd-", dir="/tmp"))
    daemon = dserver.Daemon(runtime_dir=rt / "run", threads=1)
    answered: list[str] = []
    sent: list[tuple[str, list[str]]] = []
    verb_status = dserver.Daemon._verb_status

    def status(self, identity: bytes, rid: str, args: object) -> dict:
        reply = verb_status(self, identity, rid, args)
        answered.append(rid)
        return reply

    def notify(state: str) -> bool:
        sent.append((state, list(answered)))
        if state.startswith("READY=1"):
            daemon._stop = True
        return True

    monkeypatch.setattr(dserver.Daemon, "_verb_status", status)
    monkeypatch.setattr(dserver, "sd_notify", notify)
    monkeypatch.setattr(dserver.signal, "signal", lambda *_args: None)  # keep pytest's own handlers
    monkeypatch.setenv("NOTIFY_SOCKET", str(rt / "unused.sock"))
    try:
        daemon.run()
    finally:
        shutil.rmtree(paths.shm_dir(rt / "run"), ignore_errors=True)
        shutil.rmtree(rt, ignore_errors=True)
    assert [s for s, _ in sent] == [f"READY=1\nSTATUS=serving on {paths.socket_path(rt / 'run')}\n"
                                    f"MAINPID={os.getpid()}", "STOPPING=1"]
    assert sent[0][1], "READY=1 was sent before any status request had been answered"
