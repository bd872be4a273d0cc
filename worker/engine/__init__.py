"""The engine room (vLLM v1's shape): requests in, tokens out, one scheduler step at a time.

It owns: the core loop (``core.py``: schedule -> execute -> sample -> advance), input processing (``input.py``),
output processing (``output.py``), request state (``sequence.py``), the scheduler and the paged KV blocks
(``scheduler.py``, ``block_manager.py``), KV sizing, the LoRA registry, the statistics, ``EngineConfig`` and the
errors callers catch. Its public names are re-exported here.

It may import: ``formats``, ``kernels``, ``weights``, and the worker's lower modules (model loading, model runner,
models, sampler, LoRA slots, structured outputs, tokenizer, detokenizer, outputs, ``parallel``); never the API
(``worker/http``, ``worker/grpc``, ``worker/openai``, ``worker/process``) nor ``async_engine.py``, which drive it.

Rule: a module this package imports (model runner, sampler, outputs, ...) must not import it at run time (Python
would run this package's ``__init__`` and find that module half-built): it names the engine's types under
``TYPE_CHECKING``.
"""

from keepwarm.worker.engine.config import EngineConfig
from keepwarm.worker.engine.core import LLMEngine
from keepwarm.worker.engine.errors import EngineDeadError, RequestError, RequestFailed

__all__ = ["EngineConfig", "EngineDeadError", "LLMEngine", "RequestError", "RequestFailed"]
