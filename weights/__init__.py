"""The weights library: a checkpoint read into an arena, whole or cut for tensor / pipeline parallel ranks.

- ``checkpoint``: a model directory's safetensors (or GGUF) headers, the fused tensors the model code uses.
- ``prequant`` / ``convert``: pre-quantized checkpoints, what runs exactly, converted into arena layouts.
- ``loader``: plan and build an arena (read, fingerprint, quantize, pack).
- ``sharding``: which slice of each weight a rank or pipeline stage holds; ``slices`` reads a rank's slice straight
  from the file; ``shards`` builds one arena per (stage, rank) in one pass.

A library, no process: the daemon's load jobs and a worker that loads from disk call the same functions, so a
token does not depend on which way the weights came. Imports ``keepwarm.kernels`` and ``keepwarm.formats`` only
(the import-linter layers in pyproject.toml).
"""
