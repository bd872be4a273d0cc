#!/usr/bin/env bash
# `make gpu-check`: on a machine with one NVIDIA GPU and no network, run `pytest -m gpu`, then the benchmark in
# benchmarks/gpu_check.py; everything lands in one JSON file (with a human summary) within 8 minutes.
#
# Python: $PYTHON (default python3), which must have torch (CUDA), triton, transformers, safetensors, tokenizers,
# pytest. Anything else keepwarm needs (pyzmq, at least, on this workplace's GPU image) travels as wheels in .whl/:
# when an import fails they are installed, offline, into a temporary folder put on PYTHONPATH. keepwarm itself
# needs no install: a folder of links lays the repository out as the `keepwarm` package.
#
# Environment: GPU_CHECK_OUT (default bench-out/gpu-check.json), GPU_CHECK_BUDGET (seconds for everything,
# default 480), GPU_CHECK_PYTEST_BUDGET (default 240), GPU_CHECK_TUNE=SECONDS (re-measure the tile table first),
# GPU_CHECK_PHASES=a,b (only these benchmark phases), GPU_CHECK_SMOKE=1 (no GPU: a small run that checks the
# script itself). $OUT, when set, gets a copy of the results file.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
case "$PY" in */*) PY=$(realpath -s "$PY") ;; esac  # a relative path must survive the cd below
OUT_FILE=$(realpath -m "${GPU_CHECK_OUT:-$ROOT/bench-out/gpu-check.json}")
BUDGET=${GPU_CHECK_BUDGET:-480}
PYTEST_BUDGET=${GPU_CHECK_PYTEST_BUDGET:-240}
START=$(date +%s)
SCRATCH=$(mktemp -d /tmp/kw-gpu-check.XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT
export PYTHONUNBUFFERED=1
# The Makefile's OMP_NUM_THREADS=2 is for the 2-core CI machine; a GPU machine's host side may use its cores.
export OMP_NUM_THREADS=${GPU_CHECK_THREADS:-$(nproc)}
# Nothing runs from the repository root: there, its `keepwarm/` folder (the public API only) shadows the package,
# and its `kernels/` folder answers transformers' probe for the `kernels` package (the first H200 run failed both
# ways). Every command runs in an empty folder, and PYTHONSAFEPATH keeps the working and script folders off sys.path.
mkdir -p "$SCRATCH/run"
cd "$SCRATCH/run" || exit 2
export PYTHONSAFEPATH=1

if ! "$PY" -c "import zmq, msgpack, psutil, typer" 2>/dev/null; then
    if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
        echo "[gpu-check] installing the carried wheels from .whl/ (offline)"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SCRATCH/site" \
            "$ROOT"/.whl/*.whl || { echo "[gpu-check] installing .whl/ failed" >&2; exit 2; }
        export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PY" -c "import zmq, msgpack, psutil, typer" \
        || { echo "[gpu-check] missing packages: carry their wheels in .whl/ (see docs/gpu.md)" >&2; exit 2; }
fi
# keepwarm is not installed: a folder of links lays this repository out as the package, first on the path, so the
# check always runs this tree (not an installed keepwarm, not a stray folder).
mkdir -p "$SCRATCH/pkg/keepwarm"
ln -s "$ROOT/keepwarm/__init__.py" "$SCRATCH/pkg/keepwarm/__init__.py"
# The top-level folders, as pyproject.toml's package-dir maps them ("keepwarm.<folder>" = "<folder>").
for d in $(sed -n 's/^"keepwarm\.\([a-z_]*\)" = "\1"$/\1/p' "$ROOT/pyproject.toml"); do
    ln -s "$ROOT/$d" "$SCRATCH/pkg/keepwarm/$d"
done
export PYTHONPATH="$SCRATCH/pkg${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - "$SCRATCH/pkg" "$ROOT" <<'PYEOF' || { echo "[gpu-check] the package does not import from $SCRATCH/pkg" >&2; exit 2; }
import importlib.util, sys
import keepwarm.cli.main, keepwarm.kernels  # noqa: E401  (what the daemon and the tests import first)
pkg, root = sys.argv[1], sys.argv[2]
assert keepwarm.__file__.startswith(pkg), f"keepwarm imported from {keepwarm.__file__}, not {pkg}"
spec = importlib.util.find_spec("kernels")
assert spec is None or not (spec.origin or "").startswith(root), f"`kernels` resolves to {spec.origin}"
print(f"[gpu-check] keepwarm from {keepwarm.__file__}")
PYEOF
if [ "${GPU_CHECK_ENV_ONLY:-0}" = 1 ]; then exit 0; fi  # tests: the import path alone
SMOKE=()
if [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then  # checks this script on a machine without a GPU; the figures mean nothing
    SMOKE=(--smoke)
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"; then
    echo "[gpu-check] torch sees no CUDA device" >&2
    exit 3
fi

# GPU_CHECK_TUNE=SECONDS: first re-measure the quantized matmul tile table (kernels/quant_tiles.json, in this tree)
# within that many seconds, so that the rest of the check runs on it; the time counts against the budget.
if [ -n "${GPU_CHECK_TUNE:-}" ] && [ "${GPU_CHECK_TUNE}" != 0 ]; then
    echo "[gpu-check] tile sweep (${GPU_CHECK_TUNE}s): benchmarks/tune_quant.py"
    TUNE_OUT="$ROOT/kernels/quant_tiles.json"
    [ ${#SMOKE[@]} -gt 0 ] && TUNE_OUT="$SCRATCH/quant_tiles.json"  # a smoke table must never replace the real one
    "$PY" "$ROOT/benchmarks/tune_quant.py" --budget "$GPU_CHECK_TUNE" --out "$TUNE_OUT" "${SMOKE[@]}" \
        >"$SCRATCH/tune.log" 2>&1
    echo "[gpu-check] tile sweep exit $?"; tail -n 25 "$SCRATCH/tune.log"
fi

# Only the files that hold gpu tests: others import packages this machine may lack (openai, fastapi, ...).
GPU_TESTS=$(grep -rl --include="test_*.py" "mark.gpu" "$ROOT"/tests | tr '\n' ' ')
echo "[gpu-check] pytest -m gpu $GPU_TESTS(at most ${PYTEST_BUDGET}s)"
# shellcheck disable=SC2086
timeout --signal=INT --kill-after=20 "$PYTEST_BUDGET" "$PY" -m pytest -c "$ROOT/pyproject.toml" --rootdir "$ROOT" \
    -m gpu -q -p no:cacheprovider -rfEs --continue-on-collection-errors $GPU_TESTS >"$SCRATCH/pytest.log" 2>&1
PYTEST_RC=$?
tail -n 25 "$SCRATCH/pytest.log"

LEFT=$(( BUDGET - ($(date +%s) - START) - 25 ))
echo "[gpu-check] benchmark (${LEFT}s left)"
"$PY" "$ROOT/benchmarks/gpu_check.py" --out "$OUT_FILE" --budget "$LEFT" --pytest-log "$SCRATCH/pytest.log" \
    --pytest-rc "$PYTEST_RC" "${SMOKE[@]}"
RC=$?
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then  # the device tool's folder of files to bring back
    cp "$OUT_FILE" "$OUT/"; cp "$SCRATCH/pytest.log" "$OUT/gpu-check-pytest.log"
    if [ -f "$SCRATCH/tune.log" ]; then cp "$SCRATCH/tune.log" "$TUNE_OUT" "$OUT/"; fi
fi
echo "[gpu-check] done in $(( $(date +%s) - START ))s: $OUT_FILE"
exit $RC
