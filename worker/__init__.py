"""The serving worker: what `keepwarm serve` and the offline ``LLM`` run on top of weights a daemon (or the disk) holds.

Owns, by room: ``engine/`` (the core loop, input and output processing, scheduler, paged KV blocks), the model side
(``model_loader`` / ``attach``: weights from the daemon or the disk, ``model_runner``, ``models/``, ``sampler``,
``lora*``, ``structured``, ``cuda_graphs``), ``parallel/`` (tensor and pipeline ranks), the front ends (``http/``,
``grpc/``, with ``openai/`` for what requests mean, ``async_engine`` between them and the engine), ``process/`` (the
supervisor, zygote and standby: never torch), and the entry points ``serve`` / ``zygote`` / ``llm``.
May import: keepwarm.weights, keepwarm.daemon.client (never another daemon module), keepwarm.kernels,
keepwarm.formats; nothing in it imports keepwarm.snapshot or keepwarm.cli (import-linter contracts in pyproject.toml).
"""
