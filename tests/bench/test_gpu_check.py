"""`make gpu-check` runs the same wherever it is started from, with no installed keepwarm.

The first H200 run failed at import: started from the repository root, the root's `keepwarm/` folder (the public
API only) shadowed the package, and the root's `kernels/` folder answered transformers' probe for a `kernels`
package; on a machine with an editable install nothing of this shows. So these tests run the check's import path
with a Python that has no editable install: `python -S` (no .pth files, so no editable finder) with only the
venv's site-packages on PYTHONPATH, started from the repository root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def bare_python(tmp_path: Path) -> Path:
    """A `python` that sees site-packages but not the editable install (and not the user site)."""
    site = sysconfig.get_paths()["purelib"]
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site}" exec {sys.executable} -S "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def _env(bare_python: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "TRITON_INTERPRET")}
    return {**env, "PYTHON": str(bare_python), "OMP_NUM_THREADS": "1", **extra}


def test_the_root_shadows_the_package_for_a_bare_python(bare_python: Path) -> None:
    """The hazard is real: from the root, a Python without the editable install finds the root's `keepwarm/`."""
    r = subprocess.run([str(bare_python), "-c", "import keepwarm.kernels"], cwd=ROOT, capture_output=True,
                       text=True, env=_env(bare_python))
    # The root's keepwarm/ holds only __init__.py: the first subpackage it or the caller imports is missing.
    assert r.returncode != 0 and "No module named 'keepwarm." in r.stderr, r.stderr[-2000:]


def test_check_imports_the_tree_from_the_root_without_an_install(bare_python: Path) -> None:
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=_env(bare_python, GPU_CHECK_ENV_ONLY="1", GPU_CHECK_SMOKE="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    line = next(ln for ln in r.stdout.splitlines() if "keepwarm from" in ln)
    assert "/pkg/keepwarm/__init__.py" in line and str(ROOT) not in line


@pytest.mark.slow
def test_smoke_check_passes_from_the_root_without_an_install(bare_python: Path, tmp_path: Path) -> None:
    """`GPU_CHECK_SMOKE=1 make gpu-check` from the root, no install: pytest -m gpu collects every gpu test file, the
    daemon starts (`python -m keepwarm.cli.main`), workers load from it and from disk (the import paths the H200
    run broke), and every benchmark phase runs, small, on the CPU."""
    out = tmp_path / "check.json"
    r = subprocess.run(["make", "-C", str(ROOT), "gpu-check"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=_env(bare_python, GPU_CHECK_SMOKE="1", GPU_CHECK_OUT=str(out), GPU_CHECK_THREADS="1",
                                GPU_CHECK_BUDGET="400", GPU_CHECK_PYTEST_BUDGET="120"))
    assert out.is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["smoke"] is True
    errors = {name: p for name, p in res["phases"].items() if "result" not in p}
    assert not errors, errors
    assert set(res["phases"]) == {"bandwidth", "model", "load", "decode", "decode_int4", "decode_fp8", "serve",
                                  "attention", "matmul", "moe"}
    assert "error" not in res["pytest"]["summary"] and "skipped" in res["pytest"]["summary"]
    assert res["pytest"]["returncode"] == 0, res["pytest"]["log_tail"]
    load = res["phases"]["load"]["result"]
    assert load["attach"]["source"] == "daemon" and load["disk_warm"]["source"] == "disk"
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
