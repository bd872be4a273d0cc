"""What README.md says the `keepwarm` command does, run as a user would: `preload` starting a daemon, `-q
int8|fp8|int4` through `preload` and `serve`, `status` (plain and `--json`), `daemon stop`; and the serve path never
importing transformers (a poisoned `transformers` on the path: serving still works and nobody touched it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
from support.serve import ServeProcess

from keepwarm.formats import paths

pytestmark = pytest.mark.slow


def kw(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "keepwarm.cli.main", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_preload_starts_a_daemon_quantizes_and_status_reports_it(tiny_llama) -> None:
    rt = Path(tempfile.mkdtemp(prefix="kwcli-", dir="/tmp"))  # short: unix socket paths are limited
    env = {**os.environ, "KEEPWARM_RUNTIME_DIR": str(rt), "OMP_NUM_THREADS": "1"}
    try:
        no = kw(env, "status", "--json")
        assert no.returncode == 1 and json.loads(no.stdout)["running"] is False
        first = kw(env, "preload", tiny_llama, "-q", "int8", "--dtype", "float32")
        assert first.returncode == 0, first.stderr
        assert "started the keepwarm daemon" in first.stderr and paths.socket_path(rt).exists()
        rate = re.search(r"read ([0-9.]+) GB of checkpoint at ([0-9.]+) GB/s", first.stderr)
        assert rate and float(rate.group(2)) > 0, first.stderr
        for scheme in ("fp8", "int4"):
            r = kw(env, "preload", tiny_llama, "--quantization", scheme, "--dtype", "float32")
            assert r.returncode == 0 and "started the keepwarm daemon" not in r.stderr, r.stderr
            assert f", {scheme}, float32, fingerprint " in r.stderr
        st = json.loads(kw(env, "status", "--json").stdout)
        assert st["running"] is True and st["counters"]["preloads"] == 3
        by_scheme = {m["quantization"]: m for m in st["models"]}
        assert sorted(by_scheme) == ["fp8", "int4", "int8"]
        # Each arena holds the scheme's layout: int4 < int8 < fp8 = int8 in bytes, fingerprints all distinct.
        assert by_scheme["int4"]["bytes"] < by_scheme["int8"]["bytes"]
        assert len({m["fingerprint"] for m in st["models"]}) == 3
        # Per model: the checkpoint's tensor bytes read (every safetensors file less its header), the arena's
        # allocation (at least the packed bytes; int4 packs into less than it read) and the time the load took.
        tensor_bytes = sum(f.stat().st_size - 8 - int.from_bytes(f.read_bytes()[:8], "little")
                           for f in Path(tiny_llama).glob("*.safetensors"))
        for m in st["models"]:
            assert m["source_bytes"] == tensor_bytes and m["arena_bytes"] >= m["bytes"] and m["load_seconds"] > 0
        assert by_scheme["int4"]["arena_bytes"] < tensor_bytes
        assert f"read {tensor_bytes / 1e9:.3f} GB" in first.stderr

        # serve -q int4 attaches to that arena (no new preload) and runs int4 weights.
        s = ServeProcess(tiny_llama, "-q", "int4", "--dtype", "float32", "--max-model-len", "128", "--threads", "1",
                         env=env)
        try:
            cfg = httpx.get(s.base + "/keepwarm/config").json()
            assert cfg["engine"]["quantization"] == "int4" and cfg["engine"]["weights_source"] == "daemon"
            assert cfg["engine"]["fingerprint"] == by_scheme["int4"]["fingerprint"]
            plain = kw(env, "status")
            assert plain.returncode == 0
            assert f"daemon pid {st['pid']} (keepwarm " in plain.stdout
            assert sum("leases: " in ln for ln in plain.stdout.splitlines()) == 3
            int4_line = next(ln for ln in plain.stdout.splitlines() if "int4/float32" in ln)
            assert f"leases: 1 (pids {s.proc.pid})" in int4_line
            int8_line = next(ln for ln in plain.stdout.splitlines() if "int8/float32" in ln)
            assert int8_line.endswith("leases: 0 (pids none)")
        finally:
            assert s.stop() == 0
        assert json.loads(kw(env, "status", "--json").stdout)["counters"]["preloads"] == 3
        stop = kw(env, "daemon", "stop")
        assert stop.returncode == 0 and "stopped" in stop.stdout
        assert kw(env, "status").returncode == 1
    finally:
        if paths.socket_path(rt).exists():
            kw(env, "daemon", "stop")


def test_serve_path_never_imports_transformers(tiny_llama, tmp_path) -> None:
    poison = tmp_path / "poison" / "transformers"
    poison.mkdir(parents=True)
    marker = tmp_path / "imported"
    (poison / "__init__.py").write_text(
        f"import pathlib, traceback\npathlib.Path({str(marker)!r}).write_text(''.join(traceback.format_stack()))\n"
        "raise RuntimeError('transformers imported on the serve path')\n")
    env = {"PYTHONPATH": str(poison.parent)}
    s = ServeProcess(tiny_llama, "--no-daemon", "--dtype", "float32", "--max-model-len", "128", "--threads", "1",
                     "--served-model-name", "tiny", env=env)
    try:
        r = httpx.post(s.base + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, "messages": [
            {"role": "user", "content": "hello"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert httpx.post(s.base + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                             "logprobs": 1}).status_code == 200
    finally:
        assert s.stop() == 0
    assert not marker.exists(), marker.read_text()
    # The poison works: a process that does import transformers trips it.
    out = subprocess.run([sys.executable, "-c", "import transformers"], env={**os.environ, **env},
                         capture_output=True, text=True)
    assert out.returncode != 0 and marker.exists()
