"""The CPU dispatch table (kernels/dispatch.py), the one place a CPU kernel is chosen:
- each instruction-set level takes the rows it should, in order, and a call no row takes gets the op's torch path;
- the switch (``KEEPWARM_CPU_NATIVE=0``) and the tiles (`set_amx`) change the choice at once;
- a float32 model never builds the C library (the cheap fits come first);
- `describe()` lists this machine's rows and a default per op, `keepwarm kernels` prints it, and the first CPU call
  of a process logs it once;
- kernels/ has no import cycle, imports inside functions counted."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from keepwarm.formats.quant import quantize
from keepwarm.kernels import cpu_native, dispatch
from keepwarm.kernels.quant import QuantizedWeight

ROOT = Path(__file__).resolve().parents[3]


def _weights() -> dict[str, QuantizedWeight]:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    return {s: QuantizedWeight.from_parts(*quantize(w, s, torch.bfloat16)) for s in ("int8", "fp8")}


@pytest.mark.parametrize(("level", "rows", "scheme", "want"), [
    ("amx", 1, "int8", dispatch.INT8_OP), ("amx", 4, "int8", dispatch.INT8_OP), ("amx", 5, "int8", dispatch.INT8_AMX),
    ("amx", 512, "int8", dispatch.INT8_AMX), ("amx", 513, "int8", dispatch.CODES_WIDE),
    ("avx512", 5, "int8", dispatch.INT8_NATIVE), ("avx512-vbmi", 513, "int8", dispatch.INT8_NATIVE),
    ("avx2", 1, "int8", dispatch.INT8_AVX2), ("avx2", 600, "int8", dispatch.INT8_AVX2),
    ("none", 8, "int8", dispatch.INT8_OP), ("none", 9, "int8", dispatch.INT8_CAST),
    ("amx", 1, "fp8", dispatch.FP8_NATIVE), ("amx", 2, "fp8", dispatch.FP8_AMX), ("avx2", 3, "fp8", dispatch.FP8_AVX2),
    ("none", 3, "fp8", dispatch.FP8_BITS),
])
def test_each_level_takes_its_rows(monkeypatch: pytest.MonkeyPatch, level: str, rows: int, scheme: str,
                                   want: str) -> None:
    monkeypatch.setattr(dispatch, "isa", lambda: level)
    monkeypatch.setattr(dispatch, "_simd", lambda: True)
    x = torch.zeros(rows, 256, dtype=torch.bfloat16)
    assert dispatch.select_linear(scheme, x, _weights()[scheme]) == want
    # float32 x: every row but the torch path's wants bfloat16 (ATen's op is a scalar loop for float32)
    assert dispatch.select_linear(scheme, x.float(), _weights()[scheme]) == dispatch.DEFAULTS[f"linear_{scheme}"]


def test_calls_no_row_takes_get_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "isa", lambda: "amx")
    x = torch.zeros(3, 576)
    assert dispatch.select("rms_norm", 0, x, torch.ones(576)) == dispatch.TORCH  # float32
    assert dispatch.select("rms_norm", 0, x.bfloat16()[:, :570], torch.ones(570).bfloat16()) == dispatch.TORCH
    assert dispatch.select("rms_norm", 0, x.bfloat16(), torch.ones(576).bfloat16()) == dispatch.C_RMS_NORM
    assert dispatch.select_linear("int8", x.bfloat16().double(), _weights()["int8"]) == dispatch.REFERENCE
    monkeypatch.setattr(dispatch, "isa", lambda: "none")
    assert dispatch.select("rms_norm", 0, x.bfloat16(), torch.ones(576).bfloat16()) == dispatch.TORCH


@pytest.mark.skipif(cpu_native.level() == "none", reason=f"no C kernels here: {cpu_native.reasons()[1]}")
def test_the_switch_and_the_tiles_change_the_choice_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = torch.zeros(1, 576, dtype=torch.bfloat16), torch.ones(576, dtype=torch.bfloat16)
    assert dispatch.select("rms_norm", 0, x, w) == dispatch.C_RMS_NORM
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    assert dispatch.isa() == "none" and dispatch.select("rms_norm", 0, x, w) == dispatch.TORCH
    monkeypatch.delenv(cpu_native.ENV_VAR)
    if cpu_native.level() == "amx":
        try:
            cpu_native.set_amx(False)
            assert dispatch.isa() in ("avx512", "avx512-vbmi")
            assert dispatch.select_linear("int8", torch.zeros(9, 256, dtype=torch.bfloat16), _weights()["int8"]) \
                == dispatch.INT8_NATIVE
        finally:
            cpu_native.set_amx(True)
        assert dispatch.isa() == "amx"


_FLOAT32_STEP = """
import torch
from keepwarm import kernels
from keepwarm.kernels import cpu_native
x = torch.randn(3, 64)
kernels.rms_norm(x, torch.ones(64), 1e-6)
kernels.linear(x, torch.randn(8, 64))
print(cpu_native.loaded())
"""


def test_a_float32_model_never_builds_the_library(tmp_path: Path) -> None:
    env = {**os.environ, "KEEPWARM_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _FLOAT32_STEP], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tempfile.gettempdir())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"] and not (tmp_path / "cache" / "native").exists()


def test_describe_lists_this_machines_rows() -> None:
    table = dispatch.describe()
    assert table.isa == dispatch.isa()
    ops = [r[0] for r in table.rows]
    assert sorted(set(ops), key=ops.index) == list(dispatch.DEFAULTS)  # every op, in the table's order
    for op, default in dispatch.DEFAULTS.items():
        last = [r for r in table.rows if r[0] == op][-1]
        assert last[1:4] == ("any", "otherwise", default)
    kernels = {r[3] for r in table.rows}
    if table.isa == "amx":
        assert {dispatch.INT8_AMX, dispatch.INT4_AMX, dispatch.CODES_WIDE} <= kernels
    if table.isa == "avx2":
        assert {dispatch.INT8_AVX2, dispatch.INT4_AVX2} <= kernels and dispatch.INT8_AMX not in kernels
    lines = table.lines()
    assert lines[0].startswith(f"CPU kernels here: {table.isa}") and len(lines) == len(table.rows) + 2
    assert "\n" not in table.summary()


def test_keepwarm_kernels_prints_it() -> None:
    from keepwarm.cli.main import app

    result = CliRunner().invoke(app, ["kernels"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == dispatch.describe().lines()


def test_the_first_cpu_call_logs_the_table_once(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(dispatch, "_logged", [False])
    caplog.set_level(logging.INFO, logger="keepwarm.kernels.dispatch")
    for _ in range(3):
        dispatch.select("rms_norm", 0, torch.zeros(2, 64), torch.ones(64))
    logged = [r.getMessage() for r in caplog.records if r.name == "keepwarm.kernels.dispatch"]
    assert len(logged) == 1 and logged[0].startswith("CPU kernels (") and "rms_norm [" in logged[0]


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The kernels/ modules a module imports, anywhere in it (functions included); "__init__" for the package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {"__init__" for a in node.names if a.name.startswith("keepwarm.kernels")}
        elif not isinstance(node, ast.ImportFrom):
            continue
        elif node.level == 1 or (node.module or "").startswith("keepwarm.kernels"):
            rest = (node.module or "").removeprefix("keepwarm.kernels").lstrip(".")
            names = [rest.split(".")[0]] if rest else [a.name for a in node.names]
            found |= {n if n in modules else "__init__" for n in names}
        elif node.module == "keepwarm" and any(a.name == "kernels" for a in node.names):
            found.add("__init__")
    return found


def test_kernels_has_no_import_cycle() -> None:
    files = list((ROOT / "kernels").glob("*.py"))
    modules = {p.stem for p in files}
    graph = {p.stem: {d for d in _imports(p, modules) if d != p.stem} for p in files}
    assert not any("__init__" in deps for deps in graph.values()), "a kernels module imports the package"
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        assert m not in path, "import cycle: " + " -> ".join([*path[path.index(m):], m])
        if m not in done:
            for d in sorted(graph[m]):
                visit(d, [*path, m])
            done.add(m)

    for m in sorted(graph):
        visit(m, [])
