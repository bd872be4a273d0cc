"""What the front ends (HTTP routers, gRPC) share: the config, the engine pair, the served names, the metrics.

Rule (see keepwarm.worker.async_engine): front ends read only what the engine fixed when it was built (tokenizer,
model config, context length, model directory, where its weights came from); everything that changes (requests,
adapters) goes through ``AsyncEngine`` commands and comes back through what its thread publishes (``snapshot``,
``adapters``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any

from keepwarm.worker.async_engine import AsyncEngine
from keepwarm.worker.engine import LLMEngine
from keepwarm.worker.http.budget import RequestBudget
from keepwarm.worker.http.limits import Admission, longest_token_chars
from keepwarm.worker.http.metrics import ServerMetrics
from keepwarm.worker.process.config import ServerConfig
from keepwarm.worker.process.link import WorkerLink


@dataclass
class ServerState:
    config: ServerConfig
    engine: LLMEngine  # for its construction-time facts only (see the module docstring)
    async_engine: AsyncEngine
    served_names: list[str]
    started_at: float = field(default_factory=time.time)
    draining: bool = False
    metrics: ServerMetrics | None = None
    fatal: BaseException | None = None  # the engine died: the process is exiting non-zero (70)
    link: WorkerLink | None = None  # under the supervisor (`serve --zygote`), else None
    handing_over: bool = False  # a new worker took the socket: responses close their connection (app.py)
    startup: dict[str, float] = field(default_factory=dict)  # seconds per startup phase (serve.serve; /health)
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.config.max_num_seqs, self.config.max_queued_requests)

    @functools.cached_property
    def token_chars(self) -> int:
        """The most characters one token stands for (bounds a prompt's characters before tokenizing)."""
        return longest_token_chars(self.engine.tokenizer)

    @functools.cached_property
    def budget(self) -> RequestBudget:
        """What one request may cost (keepwarm.worker.http.budget); defaults from --max-num-seqs and the KV pool."""
        c, cache = self.config, self.engine.cache_config
        return RequestBudget(c.max_request_sequences or c.max_num_seqs,
                             c.max_request_prompt_tokens or cache.num_blocks * cache.block_size, self.token_chars)

    def stop_accepting(self) -> None:
        """Draining or dead: new requests are refused (keepwarm.worker.process.lifecycle)."""
        self.async_engine.stop_accepting()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    def restart_history(self) -> dict[str, Any] | None:
        """The supervisor's restart history (None when this server has no supervisor)."""
        return None if self.link is None else self.link.restarts

    def weights_info(self) -> dict[str, Any]:
        loaded = self.engine.loaded
        # preload: how the weights were read and built (the daemon's figures, or this worker's disk load); None
        # when nothing was read for them (an adopted arena)
        preload = None if loaded.preload is None else dataclasses.asdict(loaded.preload)
        return {"source": loaded.source, "attach_seconds": loaded.seconds, "bytes": loaded.nbytes,
                "fingerprint": loaded.fingerprint, "fallback_reason": loaded.fallback_reason, "preload": preload}
