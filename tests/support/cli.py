"""The `keepwarm` command line run the way a user runs it, and its one-line errors."""

from __future__ import annotations

import subprocess
import sys


def kw(env: dict[str, str], *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """`keepwarm --log-level warning ARGS` with ``env``; with ``check`` its exit status must be 0."""
    r = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "--log-level", "warning", *map(str, args)],
                       env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"keepwarm {' '.join(map(str, args))}: {r.stderr[-3000:]}"
    return r


def one_line_error(r: subprocess.CompletedProcess) -> str:
    """The one ``error: ...`` line a failed command printed (asserting it failed with exactly that)."""
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]
