"""The zygote's serving half: what keepwarm.worker.process.zygote (the fork loop, no torch in it) runs with.

    python -m keepwarm.worker.zygote FD LOG_LEVEL SPAWN_TIME   (started by keepwarm.worker.process.supervisor)

``HOOKS``: the modules a worker imports on its way to its first token (``PREIMPORT``: imported only, no module runs
a torch op at import), the tokenizer preloaded per server before the forks (``prepare``), the probe of what the
zygote holds, and the forked child's server (keepwarm.worker.serve.serve). The modules that need torch are imported
inside these functions: by then the fork loop has turned the garbage collector off and imported them (PREIMPORT).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import sys
import time
from typing import Any

from keepwarm.worker.process import ipc
from keepwarm.worker.process.config import ServerConfig
from keepwarm.worker.process.link import WorkerLink
from keepwarm.worker.process.zygote import Hooks, main, thread_count
from keepwarm.worker.tokenizer import preload_tokenizer, preloaded_tokenizers

log = logging.getLogger("keepwarm.zygote")

# What a worker imports on its way to its first token (measured: the child of a zygote that imports these loads no
# further module of any size).
PREIMPORT = (
    "torch", "keepwarm.worker.serve", "keepwarm.worker.http.app", "keepwarm.worker.engine",
    "keepwarm.worker.model_loader", "keepwarm.worker.attach", "keepwarm.worker.models.registry",
    "keepwarm.worker.tokenizer", "keepwarm.daemon.client", "keepwarm.worker.grpc.server", "uvicorn",
    "uvicorn.lifespan.on", "uvicorn.protocols.http.h11_impl", "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.auto", "uvicorn.loops.auto", "uvicorn.loops.uvloop", "prometheus_client",
    "tokenizers", "pydantic.v1",  # imported lazily by the tokenizer load and by FastAPI's first route
)


def prepare(config: dict[str, Any]) -> None:
    """What a worker of ``config`` (``ServerConfig.to_dict()``) needs that is per server, not per device, done once
    here before the forks: its tokenizer (CPU work, no torch op, no thread; keyed by the tokenizer's files, so a
    restart that changes the model, the tokenizer or its files loads the new one). A failure here is left to the
    worker, which loads the tokenizer itself and reports what goes wrong (Failed)."""
    path = config.get("tokenizer") or config.get("model")
    if config.get("skip_tokenizer_init") or not isinstance(path, str):
        return
    t = time.perf_counter()
    try:
        kept = preload_tokenizer(path)
    except Exception as e:  # noqa: BLE001  (the worker meets the same error and reports it)
        log.info("zygote: the tokenizer of %s is not preloaded (%s); each worker loads it", path, e)
        return
    if kept:
        log.debug("zygote: tokenizer of %s ready for the workers in %.3fs", path, time.perf_counter() - t)


def probe() -> ipc.ProbeReply:
    """What this process holds: threads, CUDA, engines and modules, an event loop."""
    # deferred, as every import here that needs torch: preimported with the collector off
    import torch

    from keepwarm.worker.engine import LLMEngine  # deferred: needs torch (above)

    gc.unfreeze()  # the frozen objects are not in get_objects(); fork() freezes them again
    objects = gc.get_objects()
    loop = asyncio.get_event_loop_policy()._local._loop  # type: ignore[attr-defined]  # no get_event_loop(): it makes one
    return ipc.ProbeReply(pid=os.getpid(), threads=thread_count(), cuda_initialized=torch.cuda.is_initialized(),
                          engines=sum(isinstance(o, LLMEngine) for o in objects),
                          modules=sum(isinstance(o, torch.nn.Module) for o in objects), event_loop=loop is not None,
                          tokenizers=preloaded_tokenizers())


def serve(config: ServerConfig, fork_time: float, listener: socket.socket, link: WorkerLink) -> int:
    """The forked child's server, on the supervisor's listening socket."""
    from keepwarm.worker.serve import serve as run  # deferred: preimported with the collector off

    return run(config, process_start=fork_time, listener=listener, link=link)


HOOKS = Hooks(PREIMPORT, prepare, probe, serve)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], HOOKS))
