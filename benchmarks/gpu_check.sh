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
# default 480), GPU_CHECK_PYTEST_BUDGET (default 240), GPU_CHECK_SMOKE=1 (no GPU: a small run that checks the
# script itself). $OUT, when set, gets a copy of the results file.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT_FILE=${GPU_CHECK_OUT:-bench-out/gpu-check.json}
BUDGET=${GPU_CHECK_BUDGET:-480}
PYTEST_BUDGET=${GPU_CHECK_PYTEST_BUDGET:-240}
START=$(date +%s)
SCRATCH=$(mktemp -d /tmp/kw-gpu-check.XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT
export PYTHONUNBUFFERED=1
# The Makefile's OMP_NUM_THREADS=2 is for the 2-core CI machine; a GPU machine's host side may use its cores.
export OMP_NUM_THREADS=${GPU_CHECK_THREADS:-$(nproc)}

if ! "$PY" -c "import zmq, msgpack, psutil, typer" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "[gpu-check] installing the carried wheels from .whl/ (offline)"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SCRATCH/site" .whl/*.whl \
            || { echo "[gpu-check] installing .whl/ failed" >&2; exit 2; }
        export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PY" -c "import zmq, msgpack, psutil, typer" \
        || { echo "[gpu-check] missing packages: carry their wheels in .whl/ (see docs/gpu.md)" >&2; exit 2; }
fi
if ! "$PY" -c "import keepwarm.kernels" 2>/dev/null; then
    mkdir -p "$SCRATCH/pkg/keepwarm"
    ln -s "$ROOT/keepwarm/__init__.py" "$SCRATCH/pkg/keepwarm/__init__.py"
    for d in daemon worker kernels snapshot cli; do ln -s "$ROOT/$d" "$SCRATCH/pkg/keepwarm/$d"; done
    export PYTHONPATH="$SCRATCH/pkg${PYTHONPATH:+:$PYTHONPATH}"
fi
SMOKE=()
if [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then  # checks this script on a machine without a GPU; the figures mean nothing
    SMOKE=(--smoke)
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"; then
    echo "[gpu-check] torch sees no CUDA device" >&2
    exit 3
fi

# Only the files that hold gpu tests: others import packages this machine may lack (openai, fastapi, ...).
GPU_TESTS=$(grep -l "mark.gpu" tests/test_*.py | tr '\n' ' ')
echo "[gpu-check] pytest -m gpu $GPU_TESTS(at most ${PYTEST_BUDGET}s)"
# shellcheck disable=SC2086
timeout --signal=INT --kill-after=20 "$PYTEST_BUDGET" "$PY" -m pytest -m gpu -q -p no:cacheprovider -rfEs \
    --continue-on-collection-errors $GPU_TESTS >"$SCRATCH/pytest.log" 2>&1
PYTEST_RC=$?
tail -n 25 "$SCRATCH/pytest.log"

LEFT=$(( BUDGET - ($(date +%s) - START) - 25 ))
echo "[gpu-check] benchmark (${LEFT}s left)"
"$PY" benchmarks/gpu_check.py --out "$OUT_FILE" --budget "$LEFT" --pytest-log "$SCRATCH/pytest.log" \
    --pytest-rc "$PYTEST_RC" "${SMOKE[@]}"
RC=$?
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then cp "$OUT_FILE" "$OUT/"; fi
echo "[gpu-check] done in $(( $(date +%s) - START ))s: $OUT_FILE"
exit $RC
