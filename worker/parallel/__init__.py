"""Tensor and pipeline parallelism on torch.distributed: one worker process per rank, rank 0 the engine.

Rules (the whole design: docs/architecture.md, "Tensor parallelism"):
- Rank 0 (the process that builds the ``LLMEngine``) starts ranks 1..N-1 (``launch.py``) as ``python -m
  keepwarm.worker.parallel.rank_main`` with torchrun's environment; gloo on CPU, NCCL on CUDA. One
  ``ParallelGroup`` (``group.py``) carries tensor and pipeline parallelism alike.
- Nothing crosses processes as pickle: rank 0 broadcasts typed messages (``messages.py``) on a gloo control
  group: the load settings, the KV cache size, then each step's flattened batch.
- Rank 0 alone schedules and samples; every rank runs the forward on its shard (``keepwarm.weights.sharding``)
  and its own KV heads; logits are gathered to rank 0. Under pipeline parallelism (``pipeline.py``) rank s is
  stage s: it runs its layers of each micro-batch, activations pass by send/recv, the last stage sends the logits.
- A rank that dies takes the engine down: rank 0's watchdog sees the child exit and the engine raises
  ``EngineDeadError`` at its next step or idle check; compute collectives have a timeout; a worker rank exits when
  rank 0's connection closes or its parent is gone. No hang.
"""
