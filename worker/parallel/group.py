"""The tensor-parallel process group: starting the ranks, the collectives the model uses, the control channel and
the watchdog.

Two groups over the same ranks: the default group (gloo on CPU, NCCL on CUDA) carries the model's all-reduces and
the logits gather, with ``timeout`` (a rank stuck or gone fails the step instead of hanging it); a gloo group
carries rank 0's typed messages (``messages.py``) with a longer timeout, since ranks wait there while the engine
is idle (rank 0 pings it every ``PING_INTERVAL_S`` of silence).

Rank 0 starts the other ranks of its node (``launch``) with torchrun's environment; a rank started that way joins
through ``from_env``. Rank 0's watchdog thread polls its children: one that exits makes ``dead`` say so, and the
engine raises at its next step or idle check. A rank other than 0 exits when its parent is gone.

Several machines (``Nodes``: torchrun's ``--nnodes``, ``--node-rank``, ``MASTER_ADDR``, ``MASTER_PORT``): the
``world_size`` ranks are split evenly, node k holding ranks ``[k * L, (k + 1) * L)``. Node 0 holds the store at
``MASTER_ADDR:MASTER_PORT`` and rank 0 (the engine and the API); node k > 0 only starts its ranks
(``serve_node``) and exits with the worst of their exit codes. A rank on another node that dies fails rank 0's
next collective (gloo sees the closed connection; at worst ``timeout``), so the engine stops as for a local one.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from keepwarm.daemon.sharding import TensorParallelError
from keepwarm.worker.parallel import messages
from keepwarm.worker.parallel.messages import Message

log = logging.getLogger("keepwarm.worker")

DEFAULT_TIMEOUT_S = 120.0  # compute collectives and the rendezvous
CONTROL_TIMEOUT_S = 600.0  # a rank's wait for rank 0's next message
PING_INTERVAL_S = 60.0
WATCHDOG_INTERVAL_S = 0.2


@dataclass
class CommStats:
    """Time rank 0 spent inside the model's all-reduces (waiting for the other ranks included)."""

    all_reduce_seconds: float = 0.0
    all_reduce_calls: int = 0
    steps: int = 0


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


@dataclass
class RankProcess:
    rank: int
    proc: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class TensorParallelGroup:
    rank: int
    world_size: int
    backend: str
    device: torch.device
    control: Any  # the gloo control group (a ProcessGroup)
    timeout: float = DEFAULT_TIMEOUT_S
    children: list[RankProcess] = field(default_factory=list)
    stats: CommStats = field(default_factory=CommStats)
    dead: str | None = None  # why the group cannot go on (a rank exited, a collective failed)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _last_sent: float = field(default_factory=time.monotonic)
    _stop: threading.Event = field(default_factory=threading.Event)
    serving: bool = False  # set once every rank is loaded: pings only then, never between setup messages
    pp_size: int = 1  # pipeline stages (pipeline.py); the ranks are tensor-parallel when 1
    stage_group: Any = None  # under TP x PP: this stage's tensor-parallel ranks (None: every rank is one stage)
    _watchdog: threading.Thread | None = None

    # -- starting ------------------------------------------------------------------------------------------------
    @classmethod
    def launch(cls, world_size: int, device: torch.device, timeout: float = DEFAULT_TIMEOUT_S,
               threads: int = 1, nodes: Nodes = Nodes()) -> TensorParallelGroup:
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
            _stop_children(children, grace=0.0)
            raise RuntimeError(f"tensor parallel: the ranks did not join ({'; '.join(exits) or e})") from None
        group = cls(0, world_size, backend, device, control, timeout, children)
        group._watchdog = threading.Thread(target=group._watch, name="keepwarm-tp-watchdog", daemon=True)
        group._watchdog.start()
        log.info("tensor parallel: %d ranks (%s) on %d node(s), this node's rank pids %s", world_size, backend,
                 nodes.nnodes, [os.getpid(), *(c.pid for c in children)])
        return group

    @classmethod
    def from_env(cls) -> TensorParallelGroup:
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
        return cls(rank, world, backend, device, control, timeout)

    @property
    def tp_size(self) -> int:
        """Ranks a weight is cut over: a pipeline stage's ranks (rank = stage * tp_size + tp_rank)."""
        return self.world_size // self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def stage_index(self) -> int:
        return self.rank // self.tp_size

    @property
    def stage_leader(self) -> int:
        """The stage's tensor-parallel rank 0 (a global rank): where its logits are gathered."""
        return self.stage_index * self.tp_size

    def make_stage_groups(self, pp_size: int) -> None:
        """Every rank, at the same point (after Setup): ``pp_size`` stages; under TP x PP one process group per
        stage for its all-reduces and logits gather (``new_group`` is collective: all ranks make every group)."""
        self.pp_size = pp_size
        if pp_size == 1 or self.tp_size == 1:
            return
        for s in range(pp_size):
            ranks = list(range(s * self.tp_size, (s + 1) * self.tp_size))
            g = dist.new_group(ranks, timeout=timedelta(seconds=self.timeout))
            if s == self.stage_index:
                self.stage_group = g

    # -- the model's collectives ---------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; every rank gets the same values."""
        t0 = time.perf_counter()
        if self.backend == "gloo" and x.dtype in (torch.bfloat16, torch.float16):
            y = x.float()  # summed in float32, rounded once
            dist.all_reduce(y, group=self.stage_group)
            x.copy_(y)
        else:
            dist.all_reduce(x, group=self.stage_group)
        self.stats.all_reduce_seconds += time.perf_counter() - t0
        self.stats.all_reduce_calls += 1
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """The stage leader (rank 0 without pipeline stages): the full [R, vocab] logits from every rank's [R, V/N]
        columns; other ranks: None."""
        local = local.contiguous()
        if self.rank != self.stage_leader:
            dist.gather(local, None, dst=self.stage_leader, group=self.stage_group)
            return None
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.gather(local, parts, dst=self.stage_leader, group=self.stage_group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    # -- the control channel -------------------------------------------------------------------------------------
    def send(self, msg: Message) -> None:
        """Rank 0: broadcast one message to the other ranks."""
        payload = messages.encode(msg)
        with self._lock:
            dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), 0, group=self.control)
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, group=self.control)
            self._last_sent = time.monotonic()

    def receive(self) -> Message:
        """A rank other than 0: the next message from rank 0."""
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.control)
        buf = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.control)
        return messages.decode(buf.numpy().tobytes())

    def agree(self, ok: bool) -> list[int]:
        """Every rank says whether its part (e.g. the load) succeeded; returns the ranks that failed."""
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        with self._lock:
            dist.all_gather(flags, torch.tensor([0 if ok else 1], dtype=torch.int64), group=self.control)
        return [r for r, f in enumerate(flags) if int(f[0])]

    # -- watchdog and shutdown -----------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(WATCHDOG_INTERVAL_S):
            for c in self.children:
                code = c.proc.poll()
                if code is not None and self.dead is None and not self._stop.is_set():  # not a close()'s exit
                    self.dead = f"tensor-parallel rank {c.rank} (pid {c.pid}) exited with status {code}"
                    log.critical("%s: the engine cannot go on", self.dead)
            if self.serving and self.dead is None and time.monotonic() - self._last_sent > PING_INTERVAL_S:
                try:
                    self.send(messages.Ping())
                except RuntimeError as e:
                    self.dead = f"tensor parallel: the control channel failed: {e}"

    def check(self) -> None:
        """Raise if a rank is gone (the engine calls this before each step and while idle)."""
        if self.dead is not None:
            raise RuntimeError(self.dead)

    def rank_pids(self) -> list[int]:
        return [os.getpid(), *(c.pid for c in self.children)]

    def close(self) -> None:
        """Rank 0: tell the ranks to exit, wait for them (killing any that do not), leave the group. Once."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self.rank == 0 and self.dead is None and all(c.proc.poll() is None for c in self.children):
            try:
                self.send(messages.Shutdown())
            except RuntimeError as e:
                log.warning("tensor parallel: shutdown message not delivered: %s", e)
        _stop_children(self.children, grace=10.0 if self.dead is None else 0.0)
        if dist.is_initialized():
            dist.destroy_process_group()


def _backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


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
        _stop_children(children, grace=5.0)
        return 1
    return next((code for code in codes.values() if code), 0)


def _stop_children(children: list[RankProcess], grace: float = 10.0) -> None:
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("tensor-parallel rank %d (pid %d) did not exit; killing it", c.rank, c.pid)
            c.proc.kill()
            c.proc.wait()
