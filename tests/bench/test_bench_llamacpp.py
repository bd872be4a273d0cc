"""`keepwarm bench llamacpp`: its smoke form runs end to end as a real command (keepwarm's rows, llama.cpp said to
be skipped where no build is found, the floor row), only a finished llama.cpp build of today's flags is taken from
the cache, and the table's cells (ratios, refusals, a peer not run) come from the rows. Figures are never
asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from keepwarm.cli import bench_llamacpp as bl


@pytest.mark.slow
def test_smoke_runs_keepwarm_alone_without_a_llama_cpp_build(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {**os.environ, "KEEPWARM_HOME": str(home), "KEEPWARM_RUNTIME_DIR": str(tmp_path / "rt"),
           "OMP_NUM_THREADS": "1"}
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "bench", "llamacpp", "--smoke", "--threads",
                           "1", "--json", str(out)], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "# smoke run" in proc.stdout and "# llama.cpp skipped: no build found" in proc.stdout
    assert "| SmolLM2-135M-Instruct | Q4_1 (bundled) |" in proc.stdout and "| not run |" in proc.stdout
    assert not (home / "cache" / "llama.cpp").exists()  # a smoke run never builds llama.cpp
    data = json.loads(out.read_text())
    assert data["llama_cpp"] is None and data["read_bandwidth_bytes_per_s"] > 0
    [res] = data["results"]
    assert res["type"] == "Q4_1 (bundled)" and res["file"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert [(r["server"], r["concurrency"]) for r in res["rows"]] == [("keepwarm", 1), ("keepwarm", 2)]
    assert all(r["output_tokens"] == 4 * r["concurrency"] and r["tokens_per_s"] > 0 and r["ttft_p50_s"] > 0
               for r in res["rows"])
    # SmolLM2 ties its embedding to the head: a token reads every tensor of the file.
    assert 0 < res["bytes_per_token"] == res["file_weight_bytes"] < Path(res["file"]).stat().st_size
    [floor] = data["floors"]
    assert floor["keepwarm_fraction_of_floor"] > 0 and "llamacpp_fraction_of_floor" not in floor


def _tree(root: Path, binaries: tuple[str, ...]) -> Path:
    (root / "build" / "bin").mkdir(parents=True)
    (root / "convert_hf_to_gguf.py").write_text("")
    for b in binaries:
        (root / "build" / "bin" / b).write_text("")
    return root


def test_only_a_finished_build_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEPWARM_HOME", str(tmp_path))
    src = bl.source_dir()
    _tree(src, bl.TARGETS[:1])  # a build under way: llama-server linked, the others not yet
    assert bl.find_llama(None) is None
    (bl.cache_root() / bl.LLAMA_CPP_VERSION).symlink_to(src)  # even linked, a tree lacking a binary is not taken
    assert bl.find_llama(None) is None
    for b in bl.TARGETS[1:]:
        (src / "build" / "bin" / b).write_text("")
    assert bl.find_llama(None) is None  # every binary there, but no stamp: not known to be finished
    (src / "build" / bl.STAMP).write_text("-DGGML_NATIVE=ON")  # finished, with other flags: built again
    assert bl.find_llama(None) is None
    (src / "build" / bl.STAMP).write_text("\n".join(bl.CMAKE_FLAGS))
    assert bl.find_llama(None) == src.resolve()
    other = _tree(tmp_path / "mine", bl.TARGETS)
    assert bl.find_llama(other) == other.resolve()  # --llama-dir wins over the cache
    with pytest.raises(typer.BadParameter, match="not a built llama.cpp source tree"):
        bl.find_llama(tmp_path / "nothing")


def test_gguf_cache_key_follows_the_model_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    key = bl.model_key(tmp_path)
    assert key.startswith(tmp_path.name + "-") and bl.model_key(tmp_path) == key
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert bl.model_key(tmp_path) != key


def _row(server: str, n: int, tps: float, ttft: float = 0.1) -> dict:
    return {"server": server, "concurrency": n, "tokens_per_s": tps, "ttft_p50_s": ttft, "tpot_mean_s": 0.01}


def test_table_cells() -> None:
    both = {"model": "m", "type": "Q8_0", "rows": [_row("keepwarm", 1, 50), _row("keepwarm", 8, 300),
                                                    _row("llama.cpp", 1, 100, 0.02), _row("llama.cpp", 8, 200)]}
    refused = {"model": "m", "type": "BF16", "rows": [{"server": "keepwarm", "error": "x\nunknown quantization"},
                                                      _row("llama.cpp", 1, 60), _row("llama.cpp", 8, 180)]}
    alone = {"model": "m", "type": "Q4_1", "rows": [_row("keepwarm", 1, 40), _row("keepwarm", 8, 150)]}
    died = {"model": "m", "type": "Q4_0", "rows": [_row("keepwarm", 1, 60), _row("keepwarm", 8, 240),
                                                    _row("llama.cpp", 1, 90),
                                                    {"server": "llama.cpp", "concurrency": 8, "error": "exited"}]}
    lines = bl.table([both, refused, alone, died], [1, 8])
    assert lines[2] == "| m | Q8_0 | 50.0 / 300.0 | 100.0 / 200.0 | 0.50 / 1.50 | 100 / 20 |"
    assert lines[3] == "| m | BF16 | failed: unknown quantization | 60.0 / 180.0 | - / - | - / 100 |"
    assert lines[4] == "| m | Q4_1 | 40.0 / 150.0 | not run | - / - | 100 / - |"
    assert lines[5] == "| m | Q4_0 | 60.0 / 240.0 | 90.0 / - | 0.67 / - | 100 / 100 |"  # a load that failed: "-"
