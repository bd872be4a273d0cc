"""What the daemon, the worker, kernels and snapshots share: on-disk and in-memory formats, and where things live.

- ``arena``: the arena manifest (tensor entries, fingerprint, digests) and its storage (tmpfs file, CUDA IPC).
- ``quant``: quantization schemes, the layouts a quantized weight is stored in (``QuantMeta``), the quantizer.
- ``packed``: the oneDNN packed layout (bytes and descriptor of a weight, its size before any data is read).
- ``model_config``: ``ModelConfig`` from a checkpoint's ``config.json``.
- ``adapter``: a LoRA adapter directory on disk and its identity (``adapter_digest``).
- ``paths``: the daemon's runtime and shared-memory directories, keepwarm's data home.
- ``wire``: the one codec of every process boundary (typed frozen dataclasses <-> msgpack frames).
- ``errors``: errors more than one of these modules raises (``QuantizationError``); ``version``: keepwarm's version.

Rule: modules here import nothing from keepwarm outside ``keepwarm.formats`` (torch, numpy, msgpack and the
standard library only), so every other package can depend on them; the import-linter contract in pyproject.toml
checks it. ``wire`` imports no torch: the process side that must not load torch uses it.
"""
