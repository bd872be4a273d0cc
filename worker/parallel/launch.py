"""Parallel start-up: rank 0 starts the other ranks of its node and every rank loads its part; a rank started that
way joins; a node other than 0 only starts its ranks.

Rules:
- Whatever tensor or pipeline parallelism cannot run is refused (``start_engine_ranks``), before a process starts.
- Rank 0 starts ranks as ``python -m keepwarm.worker.parallel.rank_main`` with torchrun's environment, watching this
  process as their parent; they share its cores (its torch threads, given back on ``close``).
- A daemon that must be started is started here, once, before the ranks (they would race to start it); when that
  fails and a disk load is allowed, every rank loads from disk (``daemon_for_ranks``).
- Every rank loads, then all agree (``agree``) before any raises, so a rank that failed never leaves the others
  waiting. A failed start stops every rank it started.
- Several machines (``Nodes``: torchrun's ``--nnodes``, ``--node-rank``): node k holds ranks ``[k * L, (k + 1) * L)``;
  node 0 the store and rank 0 (engine, API); node k > 0 only starts its ranks (``serve_node``) and exits with the
  worst of their exit codes. A rank on another node that dies fails rank 0's next collective.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from keepwarm.daemon.client import DaemonError, ensure_daemon
from keepwarm.formats.model_config import ModelConfig
from keepwarm.formats.paths import RuntimeDirError
from keepwarm.weights.sharding import TensorParallelError, check_pipeline, check_supported
from keepwarm.worker.model_loader import LoadedModel, load_model
from keepwarm.worker.parallel.group import (
    DEFAULT_TIMEOUT_S,
    WATCHDOG_INTERVAL_S,
    ParallelGroup,
    RankProcess,
    stop_children,
)
from keepwarm.worker.parallel.messages import Setup

log = logging.getLogger("keepwarm.worker")

CONTROL_TIMEOUT_S = 600.0  # a rank's wait for rank 0's next message


@dataclass(frozen=True)
class Nodes:
    """Where the ranks run: ``nnodes`` machines, this one ``node_rank``, node 0's store at master_addr:port
    (port 0 on one node: any free port)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def local_ranks(self, world_size: int) -> range:
        """The ranks this node runs; refuses (one line) a split that is not even."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise TensorParallelError(f"--node-rank {self.node_rank} is not in [0, --nnodes {self.nnodes})")
        if world_size % self.nnodes:
            raise TensorParallelError(f"--nnodes {self.nnodes} does not divide the {world_size} ranks "
                                      "(tensor-parallel size)")
        if self.nnodes > 1 and not self.master_port:
            raise TensorParallelError("several nodes need MASTER_PORT (or --master-port): the port of node 0's "
                                      "store, the same on every node")
        per = world_size // self.nnodes
        return range(self.node_rank * per, (self.node_rank + 1) * per)


# -- rank 0: the engine's ranks ---------------------------------------------------------------------------------------
def start_engine_ranks(setup: Setup, device: torch.device, model_config: ModelConfig, tp_size: int, timeout: float,
                       nodes: Nodes, loaded: LoadedModel | None = None) -> tuple[ParallelGroup, LoadedModel]:
    """Start ranks 1..N-1, have every rank load its shard or pipeline stage as ``setup`` says (this one too; its
    ``daemon`` and ``threads`` are settled here), and return the group and this rank's model."""
    pp = setup.pp_size
    n = tp_size * pp
    check_pipeline(model_config, pp)
    check_supported(model_config, tp_size)
    if loaded is not None:
        raise TensorParallelError("tensor parallelism loads its own shards: a preloaded model cannot be given")
    daemon = daemon_for_ranks(setup.daemon, setup.runtime_dir, device)
    threads_before = torch.get_num_threads()
    threads = max(1, threads_before // n)  # the ranks share this process's cores; close() gives them back
    torch.set_num_threads(threads)
    try:
        tp = launch_group(n, device, timeout, threads, nodes)
    except BaseException:
        torch.set_num_threads(threads_before)
        raise
    tp.threads_before = threads_before
    setup = dataclasses.replace(setup, daemon=daemon, threads=threads)
    model_dir = Path(setup.model)
    try:
        tp.send(setup)
        tp.make_stage_groups(pp)
        error: BaseException | None = None
        model = None
        try:
            model = load_model(model_dir, setup.dtype, setup.quantization, device, setup.max_position, daemon,
                               Path(setup.runtime_dir) if setup.runtime_dir else None, setup.fingerprint, tp)
        except Exception as e:  # noqa: BLE001 - every rank must still agree before this one raises
            error = e
        failed = tp.agree(error is None)
        if error is not None:
            raise error
        if failed or model is None:
            raise TensorParallelError(f"tensor-parallel rank(s) {failed} could not load {model_dir.name} "
                                      "(their error is in the log)")
    except BaseException:
        tp.dead = tp.dead or "tensor parallel: the start failed"  # no Shutdown message: stop the ranks now
        tp.close()
        raise
    log.info("%s parallel: rank 0 of %d, %d torch thread(s) per rank, %.1f MB of weights on this rank",
             "pipeline" if pp > 1 else "tensor", n, threads, model.nbytes / 1e6)
    return tp, model


def daemon_for_ranks(daemon: bool | str, runtime_dir: str | None, device: torch.device) -> bool | str:
    """The daemon setting every rank loads with (see the module docstring)."""
    if daemon is not True and daemon not in ("on", "start"):
        return daemon
    try:
        client, _ = ensure_daemon(Path(runtime_dir) if runtime_dir else None,
                                  device="cuda" if device.type == "cuda" else "cpu")
        client.close()
        return True
    except (DaemonError, RuntimeDirError) as e:
        if daemon == "start":
            log.warning("tensor parallel: no daemon (%s); every rank loads from disk", getattr(e, "message", e))
            return False
        raise


def launch_group(world_size: int, device: torch.device, timeout: float = DEFAULT_TIMEOUT_S, threads: int = 1,
                 nodes: Nodes = Nodes()) -> ParallelGroup:
    """Rank 0: start the other ranks of this node (this process stays rank 0) and join every rank."""
    backend = _backend(device.type)
    if dist.is_initialized():
        raise TensorParallelError("a tensor-parallel engine already runs in this process (torch.distributed's "
                                  "default group is taken): close it first")
    if nodes.node_rank != 0:
        raise TensorParallelError(f"node {nodes.node_rank} runs no engine: start it with `keepwarm serve "
                                  f"--node-rank {nodes.node_rank}` (it starts that node's ranks)")
    local = nodes.local_ranks(world_size)
    try:
        store = dist.TCPStore(nodes.master_addr, nodes.master_port, world_size, is_master=True,
                              timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise TensorParallelError(f"tensor parallel: cannot listen on {nodes.master_addr}:{nodes.master_port} "
                                  f"(MASTER_ADDR:MASTER_PORT): {str(e).splitlines()[0]}") from None
    children = start_ranks(local[1:], len(local), world_size, backend, timeout, threads, nodes.master_addr,
                           store.port)
    try:
        # The prefix env:// gives the default group's keys on the other ranks.
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=0,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(timeout, CONTROL_TIMEOUT_S)))
    except Exception as e:
        exits = [f"rank {c.rank} exited with {c.proc.poll()}" for c in children if c.proc.poll() is not None]
        stop_children(children, grace=0.0)
        raise RuntimeError(f"tensor parallel: the ranks did not join ({'; '.join(exits) or e})") from None
    group = ParallelGroup(0, world_size, backend, device, control, timeout, children)
    group.start_watchdog()
    log.info("tensor parallel: %d ranks (%s) on %d node(s), this node's rank pids %s", world_size, backend,
             nodes.nnodes, [os.getpid(), *(c.pid for c in children)])
    return group


# -- the other ranks ------------------------------------------------------------------------------------------------
def join_group() -> ParallelGroup:
    """A rank other than 0, started with torchrun's variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
    LOCAL_RANK); the backend from KEEPWARM_TP_BACKEND (default: NCCL when CUDA is there, else gloo)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = float(os.environ.get("KEEPWARM_TP_TIMEOUT", DEFAULT_TIMEOUT_S))
    backend = os.environ.get("KEEPWARM_TP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(timeout, CONTROL_TIMEOUT_S)))
    return ParallelGroup(rank, world, backend, device, control, timeout)


def start_ranks(ranks: range, per_node: int, world_size: int, backend: str, timeout: float, threads: int,
                master_addr: str, master_port: int) -> list[RankProcess]:
    """Start ``ranks`` of this node as ``rank_main`` processes with torchrun's environment (LOCAL_RANK from 0 on
    each node), watching this process as their parent."""
    env = {**os.environ, "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
           "WORLD_SIZE": str(world_size), "KEEPWARM_TP_BACKEND": backend, "KEEPWARM_TP_TIMEOUT": str(timeout),
           "OMP_NUM_THREADS": str(threads), "KEEPWARM_TP_PARENT": str(os.getpid())}
    children = []
    for rank in ranks:
        cmd = [sys.executable, "-m", "keepwarm.worker.parallel.rank_main"]
        local = str(rank % per_node)
        proc = subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": local}, close_fds=True)
        children.append(RankProcess(rank, proc))
    return children


def serve_node(world_size: int, device_type: str, nodes: Nodes, timeout: float = DEFAULT_TIMEOUT_S,
               threads: int = 1) -> int:
    """Node k > 0: start this node's ranks, which join node 0's store and serve rank 0's steps; wait for them.
    Returns 0 when every rank exited 0, else the first non-zero exit code (a rank that fails takes the others down
    through rank 0). SIGINT / SIGTERM stop the ranks here at once (rank 0 then fails its next step)."""
    if nodes.node_rank == 0:
        raise TensorParallelError("node 0 runs the engine and the API, not `serve_node`")
    ranks = nodes.local_ranks(world_size)
    children = start_ranks(ranks, len(ranks), world_size, _backend(device_type), timeout, threads, nodes.master_addr,
                           nodes.master_port)
    log.info("tensor parallel: node %d of %d, ranks %d-%d (pids %s), joining %s:%d", nodes.node_rank, nodes.nnodes,
             ranks.start, ranks.stop - 1, [c.pid for c in children], nodes.master_addr, nodes.master_port)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    codes: dict[int, int] = {}
    while len(codes) < len(children) and not stop.is_set():
        for c in children:
            code = c.proc.poll()
            if code is not None and c.rank not in codes:
                codes[c.rank] = code
                if code:
                    log.error("tensor-parallel rank %d (pid %d) exited with status %d", c.rank, c.pid, code)
        stop.wait(WATCHDOG_INTERVAL_S)
    if stop.is_set():
        log.warning("tensor parallel: node %d stopping its ranks (signal)", nodes.node_rank)
        for c in children:
            if c.proc.poll() is None:
                c.proc.kill()
        stop_children(children, grace=5.0)
        return 1
    return next((code for code in codes.values() if code), 0)


def _backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"
