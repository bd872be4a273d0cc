"""Tensor and pipeline parallelism on torch.distributed: one worker process per rank, rank 0 the engine.

Rules:
- Rank 0 (the process that builds the ``LLMEngine``) starts ranks 1..N-1 as ``python -m
  keepwarm.worker.parallel.rank_main`` with torch.distributed's environment (``MASTER_ADDR``, ``MASTER_PORT``,
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), the variables torchrun sets. Backend: gloo on CPU, NCCL on CUDA.
- Nothing crosses processes as pickle: rank 0 broadcasts typed messages (``messages.py``: msgpack bytes in a uint8
  tensor) on a gloo control group: the load settings, the KV cache size, then each step's flattened batch.
- Rank 0 alone schedules and samples; every rank runs the forward on its shard (``keepwarm.daemon.sharding``:
  vLLM's column / row / vocab rules; a CPU daemon cuts per-rank shard arenas with it) and its own KV heads; logits
  are gathered to rank 0. Under pipeline parallelism (``pipeline.py``) rank s is stage s: it runs its layers of
  each micro-batch, activations pass by send/recv, and the last stage sends the logits to rank 0.
- A rank that dies takes the engine down: rank 0's watchdog sees the child exit and the engine raises
  ``EngineDeadError`` at its next step or idle check; compute collectives have a timeout; a worker rank exits when
  rank 0's connection closes or its parent is gone. No hang.
"""
