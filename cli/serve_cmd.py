"""`keepwarm serve`: vLLM's flags, a `--config server.toml` with the same keys, flags winning over the file."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

EXAMPLE_QUESTION = "What is the capital of France?"


def _print_example_when_ready(host: str, port: int, model: str, api_key: str | None) -> None:
    """Once the server answers, ask it one question and print the answer: `make run` shows real text."""
    import json
    import threading
    import urllib.request

    def run() -> None:
        base = f"http://{host}:{port}"
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": EXAMPLE_QUESTION}],
                           "max_tokens": 32, "temperature": 0}).encode()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2):
                    pass
                req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers=headers)
                with urllib.request.urlopen(req, timeout=120) as r:
                    answer = json.loads(r.read())["choices"][0]["message"]["content"].strip()
                print(f"  example: {EXAMPLE_QUESTION} -> {answer}", flush=True)
                return
            except OSError:
                time.sleep(0.2)

    threading.Thread(target=run, name="keepwarm-example", daemon=True).start()


def register(app: typer.Typer) -> None:
    @app.command()
    def up(
        model: Annotated[str | None, typer.Argument(help="Model directory (default: bundled SmolLM2).")] = None,
        host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port")] = 8000,
        quantization: Annotated[str, typer.Option("--quantization", "-q")] = "none",
        api_key: Annotated[str | None, typer.Option("--api-key", envvar="KEEPWARM_API_KEY")] = None,
    ) -> None:
        """Start the daemon (if none runs), preload MODEL with a progress bar, and serve it (what `make run` does)."""
        start = time.time()
        from keepwarm.cli.daemon_cmds import preload_model
        from keepwarm.cli.main import fail
        from keepwarm.daemon.client import DaemonError
        from keepwarm.formats.model_config import ModelConfigError
        from keepwarm.worker.api.config import ServerConfig
        from keepwarm.worker.api.server import serve as run_server

        try:
            path = preload_model(model, quantization, "auto")
            names = [Path(path).name] if model is None else None  # the bundled model: its short name
            _print_example_when_ready(host, port, (names or [path])[0], api_key)
            code = run_server(ServerConfig(model=path, host=host, port=port, quantization=quantization,
                                           api_key=api_key, served_model_name=names), process_start=start)
        except (ModelConfigError, DaemonError, FileNotFoundError, ValueError) as e:
            fail(str(e))
            return
        raise typer.Exit(code)

    @app.command(context_settings={"help_option_names": ["-h", "--help"]})
    def serve(
        model: Annotated[str | None, typer.Argument(help="Model directory (default: bundled SmolLM2).")] = None,
        config: Annotated[str | None, typer.Option("--config", help="server.toml: keys are these flags' names "
                                                   "with underscores; flags win.")] = None,
        served_model_name: Annotated[list[str] | None, typer.Option("--served-model-name")] = None,
        tokenizer: Annotated[str | None, typer.Option("--tokenizer")] = None,
        host: Annotated[str | None, typer.Option("--host")] = None,
        port: Annotated[int | None, typer.Option("--port")] = None,
        api_key: Annotated[str | None, typer.Option("--api-key", envvar="KEEPWARM_API_KEY",
                                                    help="Bearer key required on /v1 routes.")] = None,
        dtype: Annotated[str | None, typer.Option("--dtype")] = None,
        max_model_len: Annotated[int | None, typer.Option("--max-model-len")] = None,
        max_num_seqs: Annotated[int | None, typer.Option("--max-num-seqs")] = None,
        max_num_batched_tokens: Annotated[int | None, typer.Option("--max-num-batched-tokens")] = None,
        block_size: Annotated[int | None, typer.Option("--block-size")] = None,
        kv_cache_dtype: Annotated[str | None, typer.Option("--kv-cache-dtype", help="auto or fp8.")] = None,
        enable_prefix_caching: Annotated[bool | None, typer.Option(
            "--enable-prefix-caching/--no-enable-prefix-caching")] = None,
        gpu_memory_utilization: Annotated[float | None, typer.Option("--gpu-memory-utilization")] = None,
        num_gpu_blocks_override: Annotated[int | None, typer.Option("--num-gpu-blocks-override")] = None,
        kv_cache_memory_bytes: Annotated[int | None, typer.Option("--kv-cache-memory-bytes")] = None,
        quantization: Annotated[str | None, typer.Option("--quantization", "-q",
                                                         help="none, int8, fp8 or int4.")] = None,
        seed: Annotated[int | None, typer.Option("--seed")] = None,
        enforce_eager: Annotated[bool | None, typer.Option("--enforce-eager/--no-enforce-eager")] = None,
        device: Annotated[str | None, typer.Option("--device")] = None,
        enable_lora: Annotated[bool | None, typer.Option("--enable-lora/--no-enable-lora")] = None,
        lora_modules: Annotated[list[str] | None, typer.Option("--lora-modules", help="name=path")] = None,
        max_loras: Annotated[int | None, typer.Option("--max-loras")] = None,
        max_lora_rank: Annotated[int | None, typer.Option("--max-lora-rank")] = None,
        max_cpu_loras: Annotated[int | None, typer.Option("--max-cpu-loras")] = None,
        enable_lora_runtime_updates: Annotated[bool | None, typer.Option(
            "--enable-lora-runtime-updates/--no-enable-lora-runtime-updates")] = None,
        enable_auto_tool_choice: Annotated[bool | None, typer.Option(
            "--enable-auto-tool-choice/--no-enable-auto-tool-choice",
            help="Let the model choose to call tools (tool_choice auto); needs --tool-call-parser.")] = None,
        tool_call_parser: Annotated[str | None, typer.Option(
            "--tool-call-parser", help="hermes (Hermes, Qwen), llama3_json or mistral.")] = None,
        daemon: Annotated[bool | None, typer.Option("--daemon/--no-daemon",
                                                    help="Attach to the daemon (default) or load from disk.")
                          ] = None,
        fingerprint: Annotated[str | None, typer.Option("--fingerprint",
                                                        help="Attach only to an arena with this fingerprint.")
                               ] = None,
        grpc: Annotated[bool | None, typer.Option("--grpc/--no-grpc", help="Also serve gRPC.")] = None,
        grpc_port: Annotated[int | None, typer.Option("--grpc-port")] = None,
        shutdown_timeout: Annotated[float | None, typer.Option("--shutdown-timeout",
                                                               help="Seconds to drain on SIGTERM.")] = None,
        threads: Annotated[int | None, typer.Option("--threads", help="torch threads.")] = None,
        uvicorn_log_level: Annotated[str | None, typer.Option("--uvicorn-log-level")] = None,
    ) -> None:
        """Serve the OpenAI-compatible API (and gRPC with --grpc) from weights the daemon keeps warm."""
        start = time.time()
        from keepwarm.cli.main import fail
        from keepwarm.worker.api.config import ConfigError, build_config, load_toml

        flags = {k: v for k, v in locals().items() if k not in ("config", "start", "fail", "ConfigError",
                                                                 "build_config", "load_toml")}
        if flags.get("served_model_name") == []:
            flags["served_model_name"] = None
        if flags.get("lora_modules") == []:
            flags["lora_modules"] = None
        try:
            file_values = load_toml(config) if config else {}
            cfg = build_config(file_values, flags)
        except ConfigError as e:
            fail(str(e), code=2)
            return
        from keepwarm.daemon.client import DaemonError
        from keepwarm.formats.model_config import ModelConfigError
        from keepwarm.worker.api.server import serve as run_server
        from keepwarm.worker.engine import RequestError

        try:
            code = run_server(cfg, process_start=start)
        except (ModelConfigError, RequestError, DaemonError, FileNotFoundError, ValueError) as e:
            fail(str(e))
            return
        raise typer.Exit(code)
