"""Every `keepwarm serve` flag and `server.toml` key shown to take effect.

Engine settings are read back from the engine's own live parts (``engine`` in GET /keepwarm/config is built by
``LLMEngine.effective_config()`` from the scheduler, block manager, KV pool and weights, never from the server's
config), so a flag that stops reaching the engine turns these tests red. Every value used here differs from what
the engine runs with by default (checked), so none of them can pass by accident. Settings the server itself
acts on are shown by behaviour; ``EFFECT_TESTS`` names, for every config key, the test that shows its effect, and a
test keeps that table complete.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
import torch
from support.ports import free_port
from support.serve import ServeProcess

from keepwarm.worker.process.config import FIELDS, ServerConfig, build_config, load_toml

# flag -> (value given, what the engine must report for it)
ENGINE_FLAGS = {
    "dtype": ("bfloat16", {"dtype": "bfloat16"}),
    "max_model_len": (200, {"max_model_len": 200}),
    "max_num_seqs": (3, {"max_num_seqs": 3}),
    "max_num_batched_tokens": (96, {"max_num_batched_tokens": 96}),
    "block_size": (32, {"block_size": 32, "kv_pool_block_size": 32}),
    "kv_cache_dtype": ("fp8", {"kv_cache_dtype": "float8_e4m3fn"}),
    "enable_prefix_caching": (False, {"enable_prefix_caching": False}),
    "num_gpu_blocks_override": (40, {"num_kv_blocks": 40}),
    "quantization": ("int8", {"quantization": "int8"}),
    "seed": (1234, {"seed": 1234}),
    "enable_lora": (True, {"enable_lora": True}),
    "max_loras": (2, {"max_loras": 2}),
    "max_lora_rank": (8, {"max_lora_rank": 8}),
    "max_cpu_loras": (3, {"max_cpu_loras": 3}),
}

# Where every config key's effect is shown: "module::test". Engine keys above are shown here; the rest by behaviour.
EFFECT_TESTS = {
    **{k: "test_serve_flags::test_serve_flags_reach_the_engine" for k in ENGINE_FLAGS},
    "tokenizer": "test_serve_flags::test_serve_flags_reach_the_engine",
    "threads": "test_serve_flags::test_serve_flags_reach_the_engine",
    "host": "test_serve_flags::test_serve_flags_reach_the_engine",
    "port": "test_serve_flags::test_serve_flags_reach_the_engine",
    "uvicorn_log_level": "test_serve_flags::test_serve_flags_reach_the_engine",
    "kv_cache_memory_bytes": "test_serve_flags::test_config_file_keys_reach_the_engine",
    "model": "test_server::test_openai_client_completions_and_chat",
    "revision": "test_hf_cache::test_serve_an_id_from_the_cache",
    "tokenizer_revision": "test_hf_cache::test_serve_an_id_from_the_cache",
    "download_dir": "test_hf_cache::test_serve_of_an_id_not_in_the_cache_is_one_line",
    "chat_template": "test_vllm_flags::test_a_vllm_launch_script_starts_keepwarm_unchanged",
    "served_model_name": "test_server::test_config_file_and_flags",
    "api_key": "test_server::test_api_key",
    "shutdown_timeout": "test_server::test_sigterm_drains_in_flight_requests",
    "daemon": "test_serve_flags::test_runtime_dir_and_fingerprint_flags",
    "runtime_dir": "test_serve_flags::test_runtime_dir_and_fingerprint_flags",
    "fingerprint": "test_serve_flags::test_runtime_dir_and_fingerprint_flags",
    "grpc": "test_grpc::test_greedy_stream_matches_http",
    "grpc_port": "test_grpc::test_greedy_stream_matches_http",
    "lora_modules": "test_lora_server::test_models_and_adapter_selection",
    "enable_lora_runtime_updates": "test_lora_server::test_load_use_unload_at_runtime",
    "max_request_body_mb": "test_hostile_requests::test_item3_a_huge_body_is_413_at_once_and_memory_stays",
    "max_queued_requests": "test_hostile_requests::test_past_the_queue_bound_is_429",
    "max_request_sequences": "test_request_budget::test_a_request_past_its_sequence_budget_is_refused_at_once",
    "max_request_prompt_tokens": "test_request_budget::test_prompt_tokens_are_bounded",
    "client_timeout": "test_hostile_requests::test_a_stalled_client_gets_408",
    "trust_request_chat_template": "test_hostile_requests::test_item5_a_request_chat_template_needs_the_trust_flag",
    "enable_auto_tool_choice": "test_tool_calls::test_tool_choice_rules",
    "tool_call_parser": "test_tool_calls::test_tool_choice_rules",
    "enable_responses_store": "test_request_fields::test_the_store_off_refuses_in_one_line_naming_the_switch",
    "zygote": "test_restart::test_restarts_under_load",
    "standby": "test_standby::test_restarts_take_over_the_warmed_standby_under_load",
    "tensor_parallel_size": "test_tensor_parallel::test_serve_tp_dies_with_a_killed_rank_and_restarts_warm",
    "pipeline_parallel_size": "test_tensor_parallel::test_pp2_greedy_tokens_equal_one_process",
    "nnodes": "test_tensor_parallel::test_two_nodes_on_localhost_give_one_process_tokens",
    "node_rank": "test_tensor_parallel::test_two_nodes_on_localhost_give_one_process_tokens",
    "master_addr": "test_tensor_parallel::test_two_nodes_on_localhost_give_one_process_tokens",
    "master_port": "test_tensor_parallel::test_two_nodes_on_localhost_give_one_process_tokens",
    # Effective only on a CUDA device (on a CPU the engine has no graphs and no device memory to size by).
    "enforce_eager": "test_gpu_reference::test_gpu_flags_reach_the_engine",
    "gpu_memory_utilization": "test_gpu_reference::test_gpu_flags_reach_the_engine",
    "device": "test_gpu_reference::test_gpu_flags_reach_the_engine",
}


def test_every_config_key_names_a_test_that_shows_its_effect() -> None:
    assert set(EFFECT_TESTS) == FIELDS, sorted(set(EFFECT_TESTS) ^ FIELDS)
    tests = Path(__file__).resolve().parents[1]
    defined = {p.stem: {f.name for f in ast.parse(p.read_text()).body if isinstance(f, ast.FunctionDef)}
               for p in tests.rglob("test_*.py")}  # read, not imported: a test module imports no other
    for key, where in EFFECT_TESTS.items():
        module, name = where.split("::")
        assert name in defined.get(module, ()), f"{key}: {where} does not exist"


def _flag(key: str, value) -> list[str]:
    name = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return [name if value else name.replace("--", "--no-", 1)]
    return [name, str(value)]


@pytest.fixture(scope="module")
def default_engine(tiny_llama):
    """What the engine runs with when no flag is given (in-process, through the server's own create_engine)."""
    from keepwarm.worker.serve import create_engine

    engine = create_engine(ServerConfig(model=tiny_llama, daemon=False))
    try:
        yield engine.effective_config()
    finally:
        engine.close()


def test_flag_values_differ_from_the_defaults(default_engine) -> None:
    for key, (_, expected) in ENGINE_FLAGS.items():
        for field, value in expected.items():
            assert default_engine[field] != value, f"{key}: the default engine already has {field}={value!r}"


@pytest.mark.slow
def test_serve_flags_reach_the_engine(tiny_llama, tmp_path, default_engine) -> None:
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    for f in Path(tiny_llama).glob("*token*"):
        shutil.copy(f, tok / f.name)
    args = [a for key, (value, _) in ENGINE_FLAGS.items() for a in _flag(key, value)]
    # --threads 2 while ServeProcess sets OMP_NUM_THREADS=1: only the flag makes the engine's thread use 2.
    s = ServeProcess(tiny_llama, "--no-daemon", *args, "--tokenizer", tok, "--threads", "2", "--host", "127.0.0.2",
                     "--uvicorn-log-level", "info")
    try:
        engine = httpx.get(s.base + "/keepwarm/config").json()["engine"]
        for key, (_, expected) in ENGINE_FLAGS.items():
            for field, value in expected.items():
                assert engine[field] == value, f"--{key}: engine has {field}={engine[field]!r}, expected {value!r}"
        assert engine["tokenizer"] == str(tok) != default_engine["tokenizer"]
        assert engine["threads"] == 2
        assert engine["weights_source"] == "disk"  # --no-daemon (the default attaches: test_runtime_dir_...)
        # --host: bound to 127.0.0.2 only; --uvicorn-log-level info: uvicorn's own startup lines are printed.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{s.port}/health")
        assert f"Uvicorn running on http://127.0.0.2:{s.port}" in s.output()
    finally:
        assert s.stop() == 0


@pytest.mark.slow
def test_runtime_dir_and_fingerprint_flags(tiny_llama, tmp_path) -> None:
    """``runtime_dir`` (a server.toml key; snapshot restore writes it) picks the daemon while KEEPWARM_RUNTIME_DIR
    points elsewhere, --daemon (the default) attaches to it, and --fingerprint attaches only to exactly that arena
    (a wrong one is a one-line error)."""
    from keepwarm.daemon.client import start_daemon

    rt = Path(tempfile.mkdtemp(prefix="kwfl-", dir="/tmp"))  # short: unix socket paths are limited
    client = start_daemon(rt)
    try:
        fp = client.preload(tiny_llama, "none", "float32")["fingerprint"]
        elsewhere = {"KEEPWARM_RUNTIME_DIR": str(tmp_path / "no-daemon-here")}
        toml = tmp_path / "server.toml"
        toml.write_text(f'runtime_dir = "{rt}"\n')
        s = ServeProcess(tiny_llama, "--config", toml, "--fingerprint", fp, "--dtype", "float32",
                         "--max-model-len", "128", "--threads", "1", env=elsewhere)
        try:
            engine = httpx.get(s.base + "/keepwarm/config").json()["engine"]
            assert engine["weights_source"] == "daemon" and engine["fingerprint"] == fp
        finally:
            assert s.stop() == 0
        bad = subprocess.run([sys.executable, "-m", "keepwarm.cli.main", "serve", tiny_llama, "--config", str(toml),
                              "--fingerprint", "0" * 64, "--dtype", "float32", "--port", str(free_port())],
                             env={**os.environ, **elsewhere}, capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0
        last = bad.stderr.strip().splitlines()[-1]
        assert last.startswith("error:") and "0" * 16 in last, bad.stderr[-2000:]
        assert client.status()["counters"]["attaches"] == 1
    finally:
        client.shutdown()
        client.close()


def test_config_file_keys_reach_the_engine(tiny_llama, tmp_path, default_engine) -> None:
    """The same keys through server.toml (no flags), into the engine the server builds (create_engine)."""
    from keepwarm.formats.model_config import load_model_config
    from keepwarm.worker.model_runner import kv_bytes_per_block
    from keepwarm.worker.serve import create_engine

    toml = [f"model = \"{tiny_llama}\""]
    for key, (value, _) in ENGINE_FLAGS.items():
        if key != "num_gpu_blocks_override":
            toml.append(f"{key} = {str(value).lower() if isinstance(value, bool) else repr(value)}".replace("'", '"'))
    kv_bytes = 48 * kv_bytes_per_block(load_model_config(tiny_llama), 32, torch.float8_e4m3fn)
    toml.append(f"kv_cache_memory_bytes = {kv_bytes}")
    toml.append("daemon = false")  # a daemon started here would outlive the test and be attached by later ones
    path = tmp_path / "server.toml"
    path.write_text("\n".join(toml) + "\n")
    engine = create_engine(build_config(load_toml(path), {}))
    try:
        got = engine.effective_config()
    finally:
        engine.close()
    for key, (_, expected) in ENGINE_FLAGS.items():
        for field, value in expected.items():
            if key != "num_gpu_blocks_override":
                assert got[field] == value, f"{key}: engine has {field}={got[field]!r}, expected {value!r}"
    assert got["num_kv_blocks"] == 48 != default_engine["num_kv_blocks"]

