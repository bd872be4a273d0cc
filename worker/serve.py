"""`keepwarm serve`: build the engine, then run the HTTP app (and gRPC with ``--grpc``) until SIGTERM.

This module is the serving half: the engine from the config, the app (keepwarm.worker.http.app), uvicorn and the
gRPC front end; the process half, the same for a plain server and a supervised worker (the listening socket,
systemd socket activation, the drain on SIGTERM, the handoff, the exit with status 70 when the engine cannot go
on), is keepwarm.worker.process (``listen``, ``lifecycle``).

The listening socket is bound first, before the engine is built: a port in use is one line at once, never found
after an attach and a warm-up. A Hugging Face id resolves to its snapshot in the local cache (served under the id);
``--chat-template`` replaces the tokenizer's template.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from keepwarm.formats import paths
from keepwarm.formats.version import __version__
from keepwarm.worker.async_engine import AdoptPrefixes, AsyncEngine, ExportPrefixes
from keepwarm.worker.default_model import DEFAULT_MODEL_NAME, default_model, resolve_model
from keepwarm.worker.engine import EngineConfig, LLMEngine
from keepwarm.worker.http.app import build_app
from keepwarm.worker.http.state import ServerState
from keepwarm.worker.lora import parse_lora_modules
from keepwarm.worker.lora_loader import register_adapter
from keepwarm.worker.openai.tool_calls import PARSERS
from keepwarm.worker.process import ipc, lifecycle
from keepwarm.worker.process.config import ServerConfig
from keepwarm.worker.process.link import WorkerLink
from keepwarm.worker.process.listen import listen, listen_backlog, systemd_socket
from keepwarm.worker.process.vllm_flags import chat_template_text
from keepwarm.worker.sampling_params import SamplingParams

log = logging.getLogger("keepwarm.server")

SWITCH_INTERVAL_S = 0.0005
PREFIX_CALL_TIMEOUT_S = 30.0  # an export or adoption waits for the step in flight, then copies the cached blocks


def resolved_config(config: ServerConfig) -> ServerConfig:
    """The model and tokenizer as local paths (a Hugging Face id: its snapshot in the local cache, served under the
    id, as vLLM names it); FileNotFoundError says where it looked."""
    changes: dict[str, Any] = {}
    if config.model is not None:
        path = resolve_model(config.model, config.revision, config.download_dir)
        if path != config.model:
            changes.update(model=path, served_model_name=config.served_model_name or [config.model])
    if config.tokenizer is not None:
        tok = resolve_model(config.tokenizer, config.tokenizer_revision, config.download_dir)
        if tok != config.tokenizer:
            changes["tokenizer"] = tok
    return config.replace(**changes) if changes else config


def create_engine(config: ServerConfig) -> LLMEngine:
    """The engine ``config`` describes, with the ``--lora-modules`` adapters registered (runs in the engine thread;
    under the supervisor ``warm_up`` follows there, beside the app's build)."""
    config = resolved_config(config)
    model = config.model
    if model is None:
        model = str(default_model())
    # the runtime dir by name: a daemon started for it is logged with its real directory (KEEPWARM_RUNTIME_DIR)
    runtime_dir = config.runtime_dir or str(paths.runtime_dir())
    engine = LLMEngine(EngineConfig(**{**config.engine_kwargs(), "model": model, "runtime_dir": runtime_dir}))
    if config.chat_template is not None and engine.tokenizer is not None:
        engine.tokenizer.chat_template = chat_template_text(config.chat_template)
    if config.lora_modules and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if config.enable_lora:
        for name, path in parse_lora_modules(config.lora_modules):
            register_adapter(engine, name, path)  # a refused adapter leaves nothing resident in the daemon
    return engine


def warm_up(engine: LLMEngine) -> None:
    """A prefill and a decode step through the whole engine (kernels' first-call setup, oneDNN primitives, CUDA
    lazy init), so a worker handed the listening socket answers its first request at full speed. The prompt is
    shorter than a KV block: nothing enters the prefix cache. It counts in the engine's statistics (one request)."""
    engine.add_request("keepwarm-warm-up", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0,
                                                                      ignore_eos=True))
    names = iter(("warm_prefill", "warm_decode"))
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        name = next(names, "warm_decode")
        engine.startup_phases[name] = engine.startup_phases.get(name, 0.0) + time.perf_counter() - t


def _check_tool_flags(config: ServerConfig) -> None:
    if config.tool_call_parser is not None and config.tool_call_parser not in PARSERS:
        raise ValueError(f"--tool-call-parser {config.tool_call_parser!r} is not one of {', '.join(PARSERS)}")
    if config.enable_auto_tool_choice and config.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


def serve(config: ServerConfig, process_start: float | None = None, listener: socket.socket | None = None,
          link: WorkerLink | None = None) -> int:
    """Load or attach, then serve until SIGTERM/SIGINT; drains in-flight requests for ``shutdown_timeout``.

    Under the supervisor (``keepwarm serve --zygote``) a forked worker gets the supervisor's ``listener`` and its
    ``link``: it warms one step before serving, says Ready once it accepts, and on Drain (a handoff) closes its
    listeners at once and finishes what is in flight, without refusing requests that already arrived."""
    import uvicorn  # deferred: `keepwarm serve`'s own import; create_engine's callers do without it

    _check_tool_flags(config)
    if config.threads:
        torch.set_num_threads(config.threads)
    # The engine thread and the event loop hand the GIL back and forth every token; Python's default 5 ms switch
    # interval would add up to 5 ms of waiting per hand-off (measured: 32 vs 19 ms per token at concurrency 1).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    t0 = time.perf_counter()
    config = resolved_config(config)
    # Take systemd's socket (and drop LISTEN_*) before anything can start a child process.
    inherited = listener or systemd_socket()
    own = None if inherited else listen(config.host, config.port)  # before the engine: a taken port fails now
    fatal_hook: list[Callable[[BaseException], None]] = []  # set once the server exists

    def on_fatal(error: BaseException) -> None:
        for hook in fatal_hook:
            hook(error)

    state = _build_state(config, link, on_fatal, process_start, t0)
    t_app = time.perf_counter()
    app = build_app(state)
    uv_options: dict[str, Any] = {"host": config.host, "port": config.port, "log_level": config.uvicorn_log_level,
                                  "timeout_graceful_shutdown": config.shutdown_timeout, "access_log": False,
                                  # an idle keep-alive connection is closed after this (uvicorn's default: 5 s)
                                  "timeout_keep_alive": 5}
    if inherited or own:
        uv_options["backlog"] = listen_backlog()
    uv_config = uvicorn.Config(app, **uv_options)
    state.startup["app"] = time.perf_counter() - t_app
    if link is not None:
        _wait_warm(state.async_engine, state.startup)
        if link.standby and not _standby_wait(link, state.startup):
            log.info("standby worker %d dropped by the supervisor before serving: exiting", os.getpid())
            return 0
    grpc_server = None
    if config.grpc:
        from keepwarm.worker.grpc.server import start_grpc_server  # deferred: grpc only with --grpc

        grpc_server = start_grpc_server(state, config.host, config.grpc_port)
    server = lifecycle.uvicorn_server(uv_config, state, config.shutdown_timeout, _supervised(state, link),
                                      _stopping_grpc(grpc_server, config.shutdown_timeout), log_started=own is not None)
    fatal_hook.append(lambda e: lifecycle.exit_on_fatal(state, server, e))
    if state.async_engine.errored is not None:
        lifecycle.exit_on_fatal(state, server, state.async_engine.errored)
    where = (f"the supervisor's socket ({listener.getsockname()})" if listener else
             f"systemd socket fd 3 ({inherited.getsockname()})" if inherited else None)
    _announce(state, where, (time.perf_counter() - t0) if process_start is None else (time.time() - process_start))
    lifecycle.quiet_reraised_signals()
    try:
        server.run(sockets=[inherited or own] if inherited or own else None)
    finally:
        if grpc_server is not None:
            grpc_server.stop(grace=1.0)
    if state.fatal is not None:
        print(f"keepwarm: the engine failed ({type(state.fatal).__name__}: {state.fatal}); exiting with status "
              f"{lifecycle.FATAL_EXIT_CODE} so the supervisor restarts the server", file=sys.stderr, flush=True)
        return lifecycle.FATAL_EXIT_CODE
    return 0


def _build_state(config: ServerConfig, link: WorkerLink | None, on_fatal: Callable[[BaseException], None],
                 process_start: float | None, t0: float) -> ServerState:
    """The engine (attached or loaded; under the supervisor it warms up in its thread while this one builds the
    app: the warm-up's kernels release the GIL, and the worker listens only once both are done) and the state the
    front ends share, with the startup phases so far."""
    t_engine = time.perf_counter()
    async_engine = AsyncEngine(lambda: create_engine(config), on_fatal=on_fatal,
                               warm_up=warm_up if link is not None else None)
    names = config.served_model_name or [config.model or DEFAULT_MODEL_NAME]
    assert async_engine.engine is not None  # built before AsyncEngine() returns (or it raised)
    state = ServerState(config, async_engine.engine, async_engine, names, link=link)
    startup = state.startup
    if process_start is not None:  # the process's start (or its fork) to here: imports, or nothing after a fork
        startup["to_serve"] = max(0.0, time.time() - process_start - (time.perf_counter() - t0))
    # a copy first: the engine thread adds the warm-up's phases meanwhile
    built = {k: v for k, v in dict(async_engine.engine.startup_phases).items() if not k.startswith("warm_")}
    startup.update(built)
    startup["engine_other"] = max(0.0, time.perf_counter() - t_engine - sum(built.values()))
    return state


def _wait_warm(async_engine: AsyncEngine, startup: dict[str, float]) -> None:
    """Wait for the engine's warm-up (run beside the app's build); its failure is the worker's (Failed)."""
    t = time.perf_counter()
    async_engine.warmed.wait()
    startup["warm_wait"] = time.perf_counter() - t
    if async_engine.errored is not None:
        raise async_engine.errored
    assert async_engine.engine is not None
    startup.update({k: v for k, v in async_engine.engine.startup_phases.items() if k.startswith("warm_")})


def _standby_wait(link: WorkerLink, startup: dict[str, float]) -> bool:
    """``serve --standby``: warmed, wait (not accepting) until the supervisor says Go; False if it dropped us."""
    t = time.perf_counter()
    go = link.await_go(startup)
    startup["standby_wait"] = time.perf_counter() - t
    return go


def _supervised(state: ServerState, link: WorkerLink | None) -> lifecycle.Supervised | None:
    """Under the supervisor: the Ready this worker says, and its answers to ExportPrefixes / AdoptPrefixes (run in
    the engine thread; keepwarm.worker.prefix_handover)."""
    if link is None:
        return None
    engine = state.async_engine

    def ready() -> ipc.Ready:
        return ipc.Ready(pid=os.getpid(), ready_s=time.time() - link.fork_time,
                         weights_source=str(state.weights_info()["source"]),
                         cuda_initialized=torch.cuda.is_initialized(), phases=dict(state.startup))

    def export() -> tuple[int | None, ipc.CarriedPrefixes]:
        return engine.call_blocking(ExportPrefixes(), PREFIX_CALL_TIMEOUT_S)

    def adopt(fd: int) -> ipc.CarriedPrefixes:
        return engine.call_blocking(AdoptPrefixes(fd), PREFIX_CALL_TIMEOUT_S)

    return lifecycle.Supervised(link, ready, export, adopt)


def _stopping_grpc(grpc_server: Any, grace: float) -> Callable[[], None] | None:
    """On a handoff, in-flight RPCs get the drain's time; new ones go to the new worker."""
    if grpc_server is None:
        return None
    return lambda: threading.Thread(target=grpc_server.stop, args=(grace,), daemon=True).start()


def _announce(state: ServerState, where: str | None, started: float) -> None:
    """The "serving" line (and, on a socket of its own, a curl to try)."""
    config, name, info = state.config, state.served_names[0], state.weights_info()
    source = (f"weights from the daemon, attached in {info['attach_seconds'] * 1e3:.0f} ms" if info["source"] ==
              "daemon" else f"weights from disk in {info['attach_seconds']:.2f}s "
                            f"({info['fallback_reason'] or 'daemon disabled'})")
    print(f"keepwarm {__version__} serving {name} on {where or f'http://{config.host}:{config.port}'}; {source}; "
          f"ready {started:.2f}s after start", flush=True)
    if where is None:
        print(f"  try: curl http://{config.host}:{config.port}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{name}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}}'",
              flush=True)
