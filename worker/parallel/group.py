"""The parallel process group of rank 0 and its ranks: the collectives the model uses, the control channel, the
watchdog and shutdown. One group carries both tensor and pipeline parallelism (``pp_size`` stages of ``tp_size``
ranks each); ``launch.py`` starts and joins it.

Two groups over the same ranks: the default group (gloo on CPU, NCCL on CUDA) carries the model's all-reduces and
the logits gather, with ``timeout`` (a rank stuck or gone fails the step instead of hanging it); a gloo group
carries rank 0's typed messages (``messages.py``) with a longer timeout, since ranks wait there while the engine
is idle (rank 0 pings it every ``PING_INTERVAL_S`` of silence).

Rank 0's watchdog thread polls its children: one that exits makes ``dead`` say so, and the engine raises at its
next step or idle check. ``close`` stops the ranks (``Shutdown``, then a kill after a grace time) and gives this
process back the torch threads launch took from it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from keepwarm.worker.parallel import messages
from keepwarm.worker.parallel.messages import Message

log = logging.getLogger("keepwarm.worker")

DEFAULT_TIMEOUT_S = 120.0  # compute collectives and the rendezvous
PING_INTERVAL_S = 60.0
WATCHDOG_INTERVAL_S = 0.2


@dataclass
class CommStats:
    """Time rank 0 spent inside the model's all-reduces (waiting for the other ranks included)."""

    all_reduce_seconds: float = 0.0
    all_reduce_calls: int = 0
    steps: int = 0


@dataclass
class RankProcess:
    rank: int
    proc: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class ParallelGroup:
    """Tensor and pipeline parallel ranks as one group: rank ``stage * tp_size + tp_rank``."""

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
    threads_before: int | None = None  # rank 0: its torch threads before launch shared them out (close restores)
    _watchdog: threading.Thread | None = None

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
    def start_watchdog(self) -> None:
        """Rank 0: watch the children (see the module docstring)."""
        self._watchdog = threading.Thread(target=self._watch, name="keepwarm-tp-watchdog", daemon=True)
        self._watchdog.start()

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
        stop_children(self.children, grace=10.0 if self.dead is None else 0.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)


def stop_children(children: list[RankProcess], grace: float = 10.0) -> None:
    """Wait up to ``grace`` seconds for the rank processes to exit; kill those that do not."""
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("tensor-parallel rank %d (pid %d) did not exit; killing it", c.rank, c.pid)
            c.proc.kill()
            c.proc.wait()
