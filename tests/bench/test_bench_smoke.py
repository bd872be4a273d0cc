"""`keepwarm bench ... --smoke`: every benchmark's code path runs in CI (`make gpu-check`'s:
tests/bench/test_gpu_check.py).

The figures of a smoke run mean nothing (a tiny random model, a few tokens); what is checked is that each tool
runs end to end and writes the rows docs/benchmarks.md's figures come from, with the vLLM peer skipped with a
printed reason (its venv is not one of keepwarm's dependencies).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench_env(tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("bench-home")
    return {**os.environ, "KEEPWARM_HOME": str(home), "KEEPWARM_RUNTIME_DIR": str(home / "rt"),
            "OMP_NUM_THREADS": "1"}


def _bench(env: dict[str, str], tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "bench", *args, "--smoke", "--threads", "1",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "# smoke run" in proc.stdout
    return json.loads(out.read_text()), proc.stdout


def test_bench_throughput_smoke(bench_env, tmp_path) -> None:
    data, out = _bench(bench_env, tmp_path, "throughput", "--vllm-python", "/nonexistent/python")
    assert "vLLM peer skipped" in out
    rows = {(r["engine"], r["concurrency"]) for r in data["rows"]}
    assert rows == {("keepwarm", 1), ("keepwarm", 2), ("transformers", 1), ("transformers", 2)}
    assert all(r["output_tokens"] == 4 * r["concurrency"] and r["tokens_per_s"] > 0 for r in data["rows"])


def test_bench_quality_smoke(bench_env, tmp_path) -> None:
    data, _ = _bench(bench_env, tmp_path, "quality")
    got = [(r["quantization"], r["kv_cache_dtype"]) for r in data["rows"]]
    assert got == [("none", "auto"), ("int8", "auto"), ("fp8", "auto"), ("int4", "auto"), ("none", "fp8")]
    assert data["rows"][0]["greedy_token_agreement"] == 1.0  # the unquantized model agrees with itself
    assert all(r["perplexity"] > 1 and r["tokens"] == 127 for r in data["rows"])
    assert data["rows"][1]["weight_bytes"] < data["rows"][0]["weight_bytes"]


def test_bench_attach_smoke(bench_env, tmp_path) -> None:
    data, _ = _bench(bench_env, tmp_path, "attach", "-q", "int8")
    [row] = data["rows"]
    assert row["daemon_preloads"] == 1 and [a["source"] for a in row["attaches"]] == ["daemon"]
    assert row["quantization"] == "int8" and 0 < row["arena_bytes"] < row["checkpoint_bytes"] and row["attach_s"] > 0


def test_bench_restart_smoke(bench_env, tmp_path) -> None:
    data, out = _bench(bench_env, tmp_path, "restart")
    assert "vLLM peer skipped" in out
    [row] = data["rows"]
    assert len(row["cold_start_s"]) == 1 and len(row["warm_restart_s"]) == 1
    assert row["daemon_preloads"] == 1 and row["daemon_attaches"] == 1
    assert not any(k.startswith("vllm_") for k in row)
    # the zygote rows: one restart of `serve --zygote` under load, no load request failed
    # (idle, each repeat restarts twice: a prompt no worker computed, then the one the old worker served)
    assert len(row["zygote_restart_to_first_token_s"]) == 1 and len(row["handoff_s"]) == 2
    assert len(row["carried_restart_to_first_token_s"]) == 1 and row["prefix_blocks_carried"][0] > 0, row
    assert len(row["handoff_under_load_s"]) == 1
    assert 0 < row["handoff_s"][0] < row["zygote_restart_to_first_token_s"][0]
    assert row["load_requests"] > 0 and row["load_failed"] == 0
    assert row["max_gap_under_restarts_s"] > 0 and row["max_gap_steady_s"] > 0
    # the per-phase breakdowns (the workers' /health "startup"): the forked worker warmed up, the plain one did not
    assert {"attach", "model_build", "warm_prefill", "warm_decode", "uvicorn_start"} <= set(row["zygote_phases_s"])
    assert "to_serve" in row["warm_phases_s"] and "warm_prefill" not in row["warm_phases_s"]
    assert 0 < row["zygote_first_request_s"][0] < row["zygote_restart_to_first_token_s"][0]
    assert "new worker's phases" in out
    # the same with --standby: the restart took over a warmed standby (its phases say it waited for Go)
    assert len(row["standby_zygote_restart_to_first_token_s"]) == 1 and len(row["standby_standby_rearm_s"]) == 2
    assert row["standby_prefix_blocks_carried"][0] > 0  # into the standby too
    assert row["standby_load_requests"] > 0 and row["standby_load_failed"] == 0
    assert "standby_wait" in row["standby_zygote_phases_s"] and "standby restart to first token" in out


def test_bench_serving_smoke(bench_env, tmp_path) -> None:
    data, out = _bench(bench_env, tmp_path, "serving")
    assert "vLLM peer skipped" in out
    assert [(r["server"], r["concurrency"]) for r in data["rows"]] == [("keepwarm", 1), ("keepwarm", 2)]
    assert all(r["output_tokens"] == 4 * r["concurrency"] for r in data["rows"])
    # Each concurrency times prompts of its own, none of them the start / warm-up prompt (index 0): a prompt the
    # server saw before would be served from its prefix cache.
    assert [r["prompts"] for r in data["rows"]] == [[1, 2], [2, 4]]


def test_bench_profile_smoke(bench_env, tmp_path) -> None:
    from keepwarm.cli.bench_profile import PHASES

    data, out = _bench(bench_env, tmp_path, "profile")
    assert [r["batch"] for r in data["rows"]] == [1, 2] and "API per token" in out
    for r in data["rows"]:
        phases = r["phases"]
        assert tuple(phases) == PHASES
        # Every phase a plain decode step runs was reached by its timer; LoRA is off, so it stays at zero.
        ran = [p for p in PHASES if p != "forward: LoRA"]
        assert all(phases[p]["wall"] > 0 for p in ran), phases
        assert phases["forward: LoRA"]["wall"] == 0
        # Exclusive phases inside the timed steps cannot add up to more than those steps.
        assert sum(v["wall"] for v in phases.values()) <= r["step_ms_timed"]["wall"]
        assert r["step_ms"]["wall"] > 0
        assert r["api_us_per_token"]["wall"] > 0 and r["api_handoff_ms_per_step"]["wall"] > 0


def test_bench_lora_smoke(bench_env, tmp_path) -> None:
    data, _ = _bench(bench_env, tmp_path, "lora")
    got = [(r["variant"], r["adapters"]) for r in data["rows"]]
    assert got == [("base model, LoRA disabled", 0), ("stacked", 0), ("stacked", 1), ("stacked", 2),
                   ("loop", 0), ("loop", 1), ("loop", 2)]
    assert all(r["tokens_per_s"] > 0 for r in data["rows"])


def test_bench_snapshot_smoke(bench_env, tmp_path) -> None:
    """With a local docker-registry (tests/support/registry.py, when installed), push and pull are timed. The model is
    preloaded as int8 (a restore skips the quantization: no row may come from a bf16 arena)."""
    import shutil

    from support.registry import REGISTRY_BIN, registry_env

    env_gen = registry_env(tmp_path / "registry") if shutil.which(REGISTRY_BIN) else None
    reg = next(env_gen) if env_gen is not None else None
    try:
        data, out = _bench(bench_env, tmp_path, "snapshot", "--quantization", "int8",
                           *(["--registry", reg.host] if reg else []))
    finally:
        if env_gen is not None:
            env_gen.close()
    [row] = data["rows"]
    assert row["quantization"] == "int8" and "(int8, " in out
    assert row["images_loaded"] == 1 and row["create_config_only_new_bytes"] < row["image_bytes"]
    # the three ways to the arena in one run: an int8 arena has nothing machine-specific, so its portable layer is
    # the image's blob, and the portable restore (no platform image in its manifest) loads it as the portable layer
    assert row["portable_same_blob"] and row["portable_blob_bytes"] == row["image_blob_bytes"] > 0
    assert row["snapshot_blob_bytes"] == row["image_blob_bytes"]
    assert row["restore_origin"] == "image" and row["restore_portable_origin"] == "portable"
    assert row["restore_portable_said"] and row["restore_said"]  # the path restore said it took, for the doc
    assert row["portable_vs_image"] == row["restore_portable_s"] / row["restore_s"] > 0
    # each kind restored twice (ABBA), the faster run kept
    assert all(len(row[f"{k}_runs_s"]) == 2 and row[f"{k}_s"] == min(row[f"{k}_runs_s"])
               for k in ("restore", "restore_portable"))
    assert row["portable_vs_preload"] == row["restore_portable_s"] / row["preload_s"] > 0
    assert row["restore_to_first_token_s"] > 0 and row["cold_preload_to_first_token_s"] > 0
    # into a running serve --zygote: restore --restart-server (the restart in place), against a restart onto the
    # checkpoint; the bench raises if either restart was a cold start (the zygote gone)
    assert 0 < row["zygote_restore_snapshot_s"] < row["zygote_restore_to_first_token_s"]
    assert 0 < row["zygote_cold_restart_s"] < row["zygote_cold_to_first_token_s"]
    if reg is not None:
        # push: every blob and the config (the snapshot manifest); pull: every blob, the image included
        assert row["push_bytes"] > row["pull_bytes"] >= row["image_bytes"] and row["pull_mbps"] > 0
        assert reg.proxy.requests("PATCH") and reg.proxy.requests("GET", "/blobs/sha256:")
