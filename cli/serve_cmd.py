"""`keepwarm serve`, `restart` and `up`: vLLM's command line, a `--config` file (server.toml, or vLLM's YAML) with
the same keys, flags winning over the file.

Rules:
- every `vllm serve` flag has a status (worker/process/vllm_flags.py): implemented with vLLM's meaning, accepted
  with one log line saying it has no effect here and why, or refused with one line naming it and what to use
  instead (exit status 2).
  vLLM's spellings are taken as its parser takes them (``--max_model_len``, ``--model X``, ``-tp 2``).
- checks before work: conflicting flags, the model path (a Hugging Face id: the local cache), the runtime dir and the
  port(s) each fail in well under a second with one line and exit status 2, before torch is imported, before attach
  or warm-up.
- `serve --help` is click's plain help (rich's boxes cut long option names at 80 columns).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import os
import socket
import threading
import time
import types
import typing
import urllib.request
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from keepwarm.cli.daemon_cmds import preload_model
from keepwarm.cli.errors import fail
from keepwarm.formats import paths
from keepwarm.worker.default_model import resolve_model
from keepwarm.worker.process import ipc
from keepwarm.worker.process.config import ConfigError, ServerConfig, build_config, flag_of, load_toml
from keepwarm.worker.process.supervisor import Supervisor
from keepwarm.worker.process.vllm_flags import FlagRefused, chat_template_text, normalize

# A prompt whose first greedy token wins by a clear margin (1.5 logits in float32): the bare question's first
# token wins by 0.1, and bfloat16 rounding on a CPU without AVX512-BF16 turned it into a tie (and a French
# ramble instead of Paris).
EXAMPLE_QUESTION = "What is the capital of France? Answer in one sentence."
EPILOG = ("Every other `vllm serve` flag is accepted with one line saying it has no effect here, or refused with one "
          "line saying what to use instead: docs/vllm-compat.md, \"Flags\".")


class PreflightError(ValueError):
    """A check before work failed; the message is the one line to print."""


def _print_example_when_ready(host: str, port: int, model: str, api_key: str | None) -> None:
    """Once the server answers, ask it one question and print the answer: `make run` shows real text."""
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


class VllmCommand(TyperCommand):
    """A command taking serve flags: vLLM's command line normalised before click parses it (ignored flags logged,
    refused ones one line and exit 2), and click's plain help."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        own, takes_value, lists = set(), set(), set()
        for p in self.params:
            if p.param_type_name == "option":
                own.update(p.opts + p.secondary_opts)
                if not getattr(p, "is_flag", False):
                    takes_value.update(p.opts)
                if p.multiple:
                    lists.update(p.opts)
        if "--help" in args or "-h" in args:
            return super().parse_args(ctx, args)
        try:
            parsed = normalize(args, own, lists, takes_value.__contains__)
        except FlagRefused as e:
            typer.echo(f"error: {e}", err=True)
            ctx.exit(2)
        if parsed.log_level:  # vLLM's serve flag; keepwarm's own is `keepwarm --log-level` before the command
            level = parsed.log_level.upper()
            if level not in ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET"):
                typer.echo(f"error: --log-level {parsed.log_level!r} is not a log level", err=True)
                ctx.exit(2)
            logging.getLogger().setLevel(level)
        return super().parse_args(ctx, parsed.args)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        super(TyperCommand, self).format_help(ctx, formatter)  # click's own (typer vendors click), not rich's


def _option(f: dataclasses.Field, hints: dict[str, Any]) -> inspect.Parameter:
    """The `serve` option of one ServerConfig field (``hints``: ServerConfig's type hints): its type made optional
    (None = not given, the file or the default decides), with the spellings and help its Flag declares."""
    flag = flag_of(f)
    hint = hints[f.name]
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
    (~2 ms): `serve`, `restart` and `up` share it, and every command line pays for it before it runs."""
    params = [
        inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=Annotated[
            str | None, typer.Argument(help="Model directory, .gguf file or Hugging Face id in the local cache "
                                            "(default: bundled SmolLM2); `--model X` works too.")]),
        inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=Annotated[
            str | None, typer.Option("--config", help="server.toml, or vLLM's YAML (.yaml/.yml): keys are these "
                                                      "flags' names (underscores or dashes); flags win.")]),
    ]
    hints = typing.get_type_hints(ServerConfig)  # once: each call evaluates every annotation (~0.4 ms)
    params += [_option(f, hints) for f in dataclasses.fields(ServerConfig) if flag_of(f).cli]
    return inspect.Signature(params, return_annotation=None)


def _command(app: typer.Typer, fn: Any) -> None:
    app.command(cls=VllmCommand, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})(fn)


def register(app: typer.Typer) -> None:
    def up(model: str | None = None, config: str | None = None, **options: Any) -> None:
        """Start the daemon (if none runs), preload MODEL with a progress bar, and serve it with these serve flags
        (what `make run` does)."""
        start = time.time()
        # deferred, these two: zmq, psutil and torch, which `keepwarm --help` must not pay
        from keepwarm.daemon.client import DaemonError
        from keepwarm.formats.model_config import ModelConfigError  # deferred (above)

        flags = _given_flags(model, options)
        cfg = _checked_config(config, flags)
        try:
            device = cfg.device if cfg.device.startswith("cuda") else "cpu"
            path = preload_model(cfg.model, cfg.quantization, cfg.dtype, device=device,
                                 tensor_parallel_size=cfg.tensor_parallel_size,
                                 pipeline_parallel_size=cfg.pipeline_parallel_size, revision=cfg.revision,
                                 download_dir=cfg.download_dir)
        except (ModelConfigError, DaemonError, FileNotFoundError, ValueError) as e:
            fail(str(e))
            return
        if cfg.model is None:  # the bundled model: its path, served under its short name
            flags.update(model=path, served_model_name=cfg.served_model_name or [Path(path).name])
            cfg = cfg.replace(model=path, served_model_name=flags["served_model_name"])
        names = cfg.served_model_name or [cfg.model or path]
        _print_example_when_ready(cfg.host, cfg.port, names[0], cfg.api_key)
        _run(cfg, config, flags, start)

    def serve(model: str | None = None, config: str | None = None, **options: Any) -> None:
        """Serve the OpenAI-compatible API (and gRPC with --grpc) from weights the daemon keeps warm."""
        start = time.time()
        flags = _given_flags(model, options)
        _run(_checked_config(config, flags), config, flags, start)

    up.__signature__ = serve_signature()  # type: ignore[attr-defined]  # what typer reads
    serve.__signature__ = serve_signature()  # type: ignore[attr-defined]
    _command(app, up)
    _command(app, serve)
    _register_restart(app)


def _checked_config(config: str | None, flags: dict[str, Any]) -> ServerConfig:
    """The config from the file and the flags, checked before any work (one line and exit 2 otherwise)."""
    try:
        cfg = build_config(load_toml(config) if config else {}, flags)
        if cfg.api_key is None and os.environ.get("VLLM_API_KEY"):  # vLLM's variable, as `vllm serve` reads it
            flags["api_key"] = os.environ["VLLM_API_KEY"]
            cfg = cfg.replace(api_key=flags["api_key"])
        preflight(cfg)
    except (ConfigError, PreflightError) as e:
        fail(str(e), code=2)
        raise AssertionError from None  # unreachable: fail() exits
    return cfg


def _run(cfg: ServerConfig, config: str | None, flags: dict[str, Any], start: float) -> None:
    if cfg.zygote:
        _supervise(config, flags)
        return
    if cfg.node_rank != 0:
        raise typer.Exit(_serve_node(cfg))
    # deferred, these four: torch and the API stack (~2 s), after the checks that fail in well under a second
    from keepwarm.daemon.client import DaemonError
    from keepwarm.formats.model_config import ModelConfigError  # deferred (above)
    from keepwarm.worker.engine import RequestError  # deferred (above)
    from keepwarm.worker.serve import serve as run_server  # deferred (above)

    try:
        code = run_server(cfg, process_start=start)
    except (ModelConfigError, RequestError, DaemonError, FileNotFoundError, ValueError) as e:
        fail(str(e))
        return
    raise typer.Exit(code)


# -- checks before work ----------------------------------------------------------------------------------------------
def preflight(cfg: ServerConfig) -> None:
    """What can be known wrong before attaching or warming up, each in one line: conflicting flags, the model and
    tokenizer paths, the chat template, the daemon's runtime dir, and the port(s) (a probe bind)."""
    _check_conflicts(cfg)
    _check_paths(cfg)
    if cfg.daemon:
        rt = Path(cfg.runtime_dir) if cfg.runtime_dir else paths.runtime_dir()
        try:
            paths.ensure_private_dir(rt)
            paths.socket_path(rt)
        except (paths.RuntimeDirError, OSError) as e:
            raise PreflightError(f"runtime dir {rt}: {e}") from None
    if cfg.node_rank == 0 and not os.environ.get("LISTEN_FDS"):  # systemd's socket: nothing to bind here
        check_port(cfg.host, cfg.port, "--port")
        if cfg.grpc:
            check_port(cfg.host, cfg.grpc_port, "--grpc-port")


def _check_conflicts(cfg: ServerConfig) -> None:
    rules = [
        (cfg.standby and not cfg.zygote, "--standby needs --zygote (the standby is a worker the supervisor keeps "
                                         "warm beside the one serving)"),
        (bool(cfg.lora_modules) and not cfg.enable_lora, "--lora-modules needs --enable-lora"),
        (cfg.enable_auto_tool_choice and cfg.tool_call_parser is None,
         "--enable-auto-tool-choice needs --tool-call-parser"),
        (cfg.grpc and cfg.grpc_port == cfg.port, f"--grpc-port {cfg.grpc_port} is --port too: give them two ports"),
        (cfg.node_rank < 0 or cfg.node_rank >= max(cfg.nnodes, 1),
         f"--node-rank {cfg.node_rank} is not one of the --nnodes {cfg.nnodes} machines (0 to {cfg.nnodes - 1})"),
        (cfg.fingerprint is not None and not cfg.daemon, "--fingerprint picks a daemon's arena: it needs the daemon "
                                                         "(drop --no-daemon)"),
    ]
    for broken, message in rules:
        if broken:
            raise PreflightError(message)


def _check_paths(cfg: ServerConfig) -> None:
    try:
        model = resolve_model(cfg.model, cfg.revision, cfg.download_dir) if cfg.model else None
        if cfg.tokenizer:
            tokenizer = Path(resolve_model(cfg.tokenizer, cfg.tokenizer_revision, cfg.download_dir))
            if not tokenizer.exists():
                raise PreflightError(f"tokenizer {cfg.tokenizer!r} does not exist")
    except FileNotFoundError as e:
        raise PreflightError(str(e)) from None
    if model is not None:
        p = Path(model)
        if not (p.suffix == ".gguf" and p.is_file()):  # a model directory: the words of formats/model_config.py
            if not p.exists():
                raise PreflightError(f"model directory {model!r} does not exist")
            if not p.is_dir():
                raise PreflightError(f"{model!r} is not a directory")
            if not (p / "config.json").is_file():
                raise PreflightError(f"{model!r} is not a model directory: config.json is missing")
    if cfg.chat_template is not None:
        try:
            chat_template_text(cfg.chat_template)
        except ValueError as e:
            raise PreflightError(str(e)) from None


def check_port(host: str, port: int, flag: str) -> None:
    """A probe bind of (host, port), as uvicorn binds (SO_REUSEADDR): a port something listens on fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise PreflightError(f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror or e}); is another "
                                 f"server running there?") from None


def _serve_node(cfg: Any) -> int:
    """`keepwarm serve --node-rank K` (K > 0): this machine's tensor-parallel ranks only; rank 0 (node 0) sends
    them the model and every step. Exits with the worst of their exit codes."""
    # deferred, these three: torch (~1.2 s), which `keepwarm --help` must not pay
    from keepwarm.weights.sharding import TensorParallelError
    from keepwarm.worker.engine.config import EngineConfig, resolve_device  # deferred (above)
    from keepwarm.worker.parallel.launch import serve_node  # deferred (above)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    engine = EngineConfig(**cfg.engine_kwargs())
    device = resolve_device(engine.device).type
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
    _command(app, restart)


def _given_flags(model: str | None, options: dict[str, Any]) -> dict[str, Any]:
    flags = {"model": model, **options}
    for key in ("served_model_name", "lora_modules"):
        if flags.get(key) == []:
            flags[key] = None
    return flags


def _supervise(config_file: str | None, flags: dict[str, Any]) -> None:
    """`serve --zygote`: the supervisor (keepwarm.worker.process.supervisor) until SIGTERM; its worker's status."""
    try:
        sup = Supervisor(config_file, flags, logging.getLevelName(logging.getLogger().getEffectiveLevel()))
        code = sup.run()
    except (ConfigError, OSError) as e:
        fail(str(e))
        return
    raise typer.Exit(code)
