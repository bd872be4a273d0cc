"""`keepwarm serve`: vLLM's flags, a `--config server.toml` with the same keys, flags winning over the file."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
import types
import typing
from pathlib import Path
from typing import Annotated, Any

import typer

from keepwarm.worker.api.config import ConfigError, ServerConfig, build_config, flag_of, load_toml

# A prompt whose first greedy token wins by a clear margin (1.5 logits in float32): the bare question's first
# token wins by 0.1, and bfloat16 rounding on a CPU without AVX512-BF16 turned it into a tie (and a French
# ramble instead of Paris).
EXAMPLE_QUESTION = "What is the capital of France? Answer in one sentence."


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


def _option(f: dataclasses.Field) -> inspect.Parameter:
    """The `serve` option of one ServerConfig field: its type made optional (None = not given, the file or the
    default decides), with the spellings and help its Flag declares."""
    flag = flag_of(f)
    hint = typing.get_type_hints(ServerConfig)[f.name]
    base = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    (kind,) = [t for t in base if t is not type(None)]
    dashed = "--" + f.name.replace("_", "-")
    names = flag.names or ((f"{dashed}/--no-{dashed[2:]}",) if kind is bool else (dashed,))
    option = typer.Option(*names, help=flag.help, envvar=flag.envvar)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[kind | None, option])


@functools.cache
def serve_signature() -> inspect.Signature:
    """`keepwarm serve MODEL --config FILE` plus one option per ServerConfig key (except file-only ones). Built once
    (~20 ms): `serve` and `restart` share it, and every command line pays for it before it runs."""
    params = [
        inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=Annotated[
            str | None, typer.Argument(help="Model directory (default: bundled SmolLM2).")]),
        inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=Annotated[
            str | None, typer.Option("--config", help="server.toml: keys are these flags' names with underscores; "
                                                      "flags win.")]),
    ]
    params += [_option(f) for f in dataclasses.fields(ServerConfig) if flag_of(f).cli]
    return inspect.Signature(params, return_annotation=None)


def register(app: typer.Typer) -> None:
    @app.command()
    def up(
        model: Annotated[str | None, typer.Argument(help="Model directory (default: bundled SmolLM2).")] = None,
        host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port")] = 8000,
        quantization: Annotated[str, typer.Option("--quantization", "-q")] = "auto",
        api_key: Annotated[str | None, typer.Option("--api-key", envvar="KEEPWARM_API_KEY")] = None,
    ) -> None:
        """Start the daemon (if none runs), preload MODEL with a progress bar, and serve it (what `make run` does)."""
        start = time.time()
        from keepwarm.cli.daemon_cmds import preload_model
        from keepwarm.cli.main import fail
        from keepwarm.daemon.client import DaemonError
        from keepwarm.formats.model_config import ModelConfigError
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

    def serve(model: str | None = None, config: str | None = None, **options: Any) -> None:
        """Serve the OpenAI-compatible API (and gRPC with --grpc) from weights the daemon keeps warm."""
        start = time.time()
        from keepwarm.cli.main import fail

        flags = _given_flags(model, options)
        try:
            file_values = load_toml(config) if config else {}
            cfg = build_config(file_values, flags)
        except ConfigError as e:
            fail(str(e), code=2)
            return
        if cfg.standby and not cfg.zygote:
            fail("--standby needs --zygote (the standby is a worker the supervisor keeps warm beside the one "
                 "serving)", code=2)
            return
        if cfg.zygote:
            _supervise(config, flags)
            return
        if cfg.node_rank != 0:
            raise typer.Exit(_serve_node(cfg))
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

    serve.__signature__ = serve_signature()  # type: ignore[attr-defined]  # what typer reads
    app.command(context_settings={"help_option_names": ["-h", "--help"]})(serve)
    _register_restart(app)


def _serve_node(cfg: Any) -> int:
    """`keepwarm serve --node-rank K` (K > 0): this machine's tensor-parallel ranks only; rank 0 (node 0) sends
    them the model and every step. Exits with the worst of their exit codes."""
    import logging

    from keepwarm.cli.main import fail
    from keepwarm.daemon.sharding import TensorParallelError
    from keepwarm.worker.engine import EngineConfig, _resolve_device
    from keepwarm.worker.parallel.group import serve_node

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    engine = EngineConfig(**cfg.engine_kwargs())
    device = _resolve_device(engine.device).type
    threads = cfg.threads or 1
    try:
        ranks = engine.tensor_parallel_size * engine.pipeline_parallel_size
        return serve_node(ranks, device, engine.nodes(), engine.distributed_timeout, threads)
    except TensorParallelError as e:
        fail(str(e), code=2)
        return 2


def _register_restart(app: typer.Typer) -> None:
    def restart(model: str | None = None, config: str | None = None, python: str | None = None,
                prepare: bool = False, timeout: float = 300.0, **options: Any) -> None:
        """Restart a `serve --zygote` server with no downtime: a new worker (these flags merged over the running
        ones) starts beside the old one, takes the listening socket once warm, and the old one drains."""
        from keepwarm.cli.main import fail
        from keepwarm.worker.api import ipc

        flags = {k: v for k, v in _given_flags(model, options).items() if v is not None}
        port = flags.get("port", ServerConfig.port)
        if config:
            try:
                load_toml(config)
            except ConfigError as e:
                fail(str(e), code=2)
                return
        request = ipc.RestartRequest(flags=flags, config_file=str(Path(config).absolute()) if config else None,
                                     python=python, prepare=prepare, timeout=timeout)
        t0 = time.monotonic()
        try:
            reply = ipc.request_restart(port, request)
        except (ConnectionError, OSError) as e:
            fail(str(e))
            return
        if not reply.ok:
            fail(f"restart failed: {reply.message}")
            return
        if prepare:
            typer.echo(f"prepared for port {port}: {reply.message}")
            return
        if reply.mode == "cold":
            typer.echo(f"keepwarm: warning: {reply.message.split('; cold start: ', 1)[-1]}: this restart was a "
                       "cold start", err=True)
        typer.echo(f"restarted port {port}: {reply.message} (command: {time.monotonic() - t0:.3f}s)")

    extra = [
        inspect.Parameter("python", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
            str | None, typer.Option("--python", help="Fork the new worker from this Python's keepwarm (an "
                                                      "upgrade); its zygote starts now unless --prepare'd.")]),
        inspect.Parameter("prepare", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
            bool, typer.Option("--prepare", help="Only start --python's zygote in the background.")]),
        inspect.Parameter("timeout", inspect.Parameter.KEYWORD_ONLY, default=300.0, annotation=Annotated[
            float, typer.Option("--timeout", help="Seconds the new worker has to become ready.")]),
    ]
    sig = serve_signature()
    restart.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *extra])  # type: ignore[attr-defined]
    app.command(context_settings={"help_option_names": ["-h", "--help"]})(restart)


def _given_flags(model: str | None, options: dict[str, Any]) -> dict[str, Any]:
    flags = {"model": model, **options}
    for key in ("served_model_name", "lora_modules"):
        if flags.get(key) == []:
            flags[key] = None
    return flags


def _supervise(config_file: str | None, flags: dict[str, Any]) -> None:
    """`serve --zygote`: the supervisor (keepwarm.worker.api.supervisor) until SIGTERM; its worker's status."""
    import logging

    from keepwarm.cli.main import fail
    from keepwarm.worker.api.supervisor import Supervisor

    try:
        sup = Supervisor(config_file, flags, logging.getLevelName(logging.getLogger().getEffectiveLevel()))
        code = sup.run()
    except (ConfigError, OSError) as e:
        fail(str(e))
        return
    raise typer.Exit(code)
