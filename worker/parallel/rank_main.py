"""A tensor-parallel rank other than 0: ``python -m keepwarm.worker.parallel.rank_main``, torchrun's environment.

It joins the group, loads its shard (or its pipeline stage's layers) as rank 0's ``Setup`` says, allocates the KV
cache of its own KV heads, then runs every ``Step`` rank 0 broadcasts until ``Shutdown``, writing LoRA slots as rank
0's ``LoRASlot`` messages say. It has no scheduler, sampler or API.

Exit (rules): 0 after ``Shutdown``; 1 when its load fails (rank 0 learns it through ``agree``), when a collective
fails (rank 0 gone or a timeout) or when its parent (rank 0, when keepwarm started it) is gone. SIGINT and SIGTERM
are ignored: a Ctrl-C or a service stop reaches rank 0, which drains its requests (they need this rank) and then
sends ``Shutdown``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from keepwarm.formats.model_config import parse_dtype
from keepwarm.weights.sharding import Shard, local_config, stage_of
from keepwarm.worker.lora import LoRAAdapter, LoRAManager
from keepwarm.worker.model_loader import load_model
from keepwarm.worker.model_runner import CacheConfig, ModelRunner, allocate_kv_cache
from keepwarm.worker.parallel.group import ParallelGroup
from keepwarm.worker.parallel.launch import join_group
from keepwarm.worker.parallel.messages import CacheSpec, LoRASlot, Ping, Setup, Shutdown, Step, lora_tensors

log = logging.getLogger("keepwarm.worker")

PARENT_ENV = "KEEPWARM_TP_PARENT"  # rank 0's pid, set when keepwarm started this rank


def _watch_parent(parent: int) -> None:
    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                log.critical("tensor-parallel rank %s: rank 0 (pid %d) is gone; exiting", os.environ.get("RANK"),
                             parent)
                os._exit(1)

    threading.Thread(target=watch, name="keepwarm-tp-parent", daemon=True).start()


def _expect(tp: ParallelGroup, kind: type) -> object:
    msg = tp.receive()
    if not isinstance(msg, kind):
        raise RuntimeError(f"expected a {kind.__name__} message, got {type(msg).__name__}")
    return msg


def serve_rank(tp: ParallelGroup) -> int:
    setup = _expect(tp, Setup)
    assert isinstance(setup, Setup)
    tp.make_stage_groups(setup.pp_size)
    torch.set_num_threads(setup.threads)
    torch.manual_seed(setup.seed)
    device = tp.device
    try:
        loaded = load_model(Path(setup.model), setup.dtype, setup.quantization, device, setup.max_position,
                            setup.daemon, Path(setup.runtime_dir) if setup.runtime_dir else None, setup.fingerprint,
                            tp=tp)
    except Exception as e:  # noqa: BLE001 - said once, then every rank learns it through agree()
        print(f"keepwarm: tensor-parallel rank {tp.rank} could not load {setup.model}: {e}", file=sys.stderr,
              flush=True)
        tp.agree(False)
        return 1
    if tp.agree(True):
        return 1  # another rank failed; it says why
    spec = tp.receive()
    if isinstance(spec, Shutdown):  # rank 0 failed after the load (it says why)
        return 0
    if not isinstance(spec, CacheSpec):
        raise RuntimeError(f"expected a CacheSpec message, got {type(spec).__name__}")
    stage = stage_of(loaded.config, tp.pp_size, tp.stage_index) if tp.pp_size > 1 else None
    kv = allocate_kv_cache(local_config(loaded.config, tp.tp_size),
                           CacheConfig(spec.num_blocks, spec.block_size, parse_dtype_or_fp8(spec.kv_dtype)), device,
                           layers=stage.layers if stage is not None else None)
    lora = None
    if setup.max_loras:
        lora = LoRAManager(loaded.model, loaded.config, setup.max_loras, setup.max_lora_rank,
                           parse_dtype(setup.model_dtype), device,
                           Shard(tp.tp_rank, tp.tp_size) if tp.tp_size > 1 else None,
                           stage.layers if stage is not None else None)
    runner = ModelRunner(loaded.model, kv, spec.block_size, lambda seq: [], device, lora_manager=lora, tp=tp,
                         vocab_size=loaded.config.vocab_size, stage=stage, act_dtype=parse_dtype(setup.model_dtype))
    log.info("tensor-parallel rank %d ready: %s, %.1f MB of weights", tp.rank, loaded.source, loaded.nbytes / 1e6)
    try:
        while True:
            msg = tp.receive()
            if isinstance(msg, Step):
                runner.run(msg)
            elif isinstance(msg, LoRASlot) and lora is not None:
                lora.write(msg.slot, _adapter(msg))
            elif isinstance(msg, Shutdown):
                return 0
            elif not isinstance(msg, Ping):
                raise RuntimeError(f"unexpected {type(msg).__name__} message while serving")
    finally:
        loaded.close()


def _adapter(msg: LoRASlot) -> LoRAAdapter | None:
    """The full adapter rank 0 put in a slot (this rank's manager cuts its part as it writes), or None."""
    if not msg.name:
        return None
    weights = lora_tensors(msg.weights)
    return LoRAAdapter(msg.name, "", msg.digest, msg.rank, float(msg.scaling), frozenset(m for _, m in weights),
                       weights, source="rank 0")


def parse_dtype_or_fp8(name: str) -> torch.dtype:
    return torch.float8_e4m3fn if name == "float8_e4m3fn" else parse_dtype(name)


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s tp-rank {os.environ.get('RANK', '?')} %(levelname)s %(message)s")
    log.setLevel(logging.INFO)  # its load and ready lines; the kernels' choices are rank 0's to log
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get(PARENT_ENV):
        _watch_parent(int(os.environ[PARENT_ENV]))
    tp = join_group()
    try:
        return serve_rank(tp)
    except Exception as e:  # noqa: BLE001 - a collective failed: rank 0 is gone or stuck
        print(f"keepwarm: tensor-parallel rank {tp.rank} stops: {type(e).__name__}: {str(e).splitlines()[0]}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
