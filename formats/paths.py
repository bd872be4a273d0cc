"""Where keepwarm keeps things: the daemon's runtime directory (socket, lock, log), its shared-memory arena
directory, and the data home (``keepwarm_home``: models, the snapshot store, restored state).

``KEEPWARM_RUNTIME_DIR`` (default ``$XDG_RUNTIME_DIR/keepwarm``, else ``/tmp/keepwarm-$UID``) names one daemon:
tests and several users run isolated daemons side by side by giving each its own runtime directory. The CPU
arenas of that daemon live in ``/dev/shm/keepwarm-$UID-<hash of the runtime dir>``, so they are tied to it.
Both directories are created 0700 and must be owned by the current user.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

SOCKET_NAME = "daemon.sock"
LOCK_NAME = "daemon.lock"
LOG_NAME = "daemon.log"
# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


class RuntimeDirError(RuntimeError):
    """The runtime or shared-memory directory is unusable (not private, not ours, path too long)."""


def runtime_dir() -> Path:
    env = os.environ.get("KEEPWARM_RUNTIME_DIR")
    if env:
        return Path(env).absolute()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "keepwarm"
    return Path(f"/tmp/keepwarm-{os.getuid()}")


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` with mode 0700, or check that an existing one is ours and not open to others."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise RuntimeDirError(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()})")
    if st.st_mode & 0o077:
        raise RuntimeDirError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; keepwarm needs 0700 "
                              f"(chmod 700 {path})")
    return path


def socket_path(rt: Path | None = None) -> Path:
    path = (rt or runtime_dir()) / SOCKET_NAME
    if len(str(path)) > MAX_SOCKET_PATH:
        raise RuntimeDirError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; "
                              "set KEEPWARM_RUNTIME_DIR to a shorter directory")
    return path


def endpoint(rt: Path | None = None) -> str:
    return f"ipc://{socket_path(rt)}"


def shm_dir(rt: Path | None = None) -> Path:
    """The CPU arenas' directory: on tmpfs (/dev/shm) when there is one, else inside the runtime dir."""
    rt = (rt or runtime_dir()).absolute()
    tag = hashlib.sha256(str(rt).encode()).hexdigest()[:12]
    base = Path("/dev/shm")
    if base.is_dir() and os.access(base, os.W_OK):
        return base / f"keepwarm-{os.getuid()}-{tag}"
    return rt / "arenas"


def keepwarm_home() -> Path:
    """``$KEEPWARM_HOME``, else ``$XDG_DATA_HOME/keepwarm``, else ``~/.local/share/keepwarm``."""
    if os.environ.get("KEEPWARM_HOME"):
        return Path(os.environ["KEEPWARM_HOME"])
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "keepwarm"
