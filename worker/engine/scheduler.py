"""Continuous batching with a per-step token budget, chunked prefill and preemption by recompute.

Rules (after vLLM v1's unified scheduler):
- Each step spends at most ``max_num_batched_tokens`` tokens. Running sequences are served first, in arrival
  order; a sequence's pending tokens (``num_tokens - num_computed_tokens``) may be cut to fit the budget, so
  one step mixes decodes (1 token) and prefill chunks.
- When the KV pool cannot give a running sequence its blocks, the newest running sequence is preempted: its
  blocks are freed and it returns to the front of the waiting queue with ``num_computed_tokens = 0``; it will be
  recomputed (prompt and the tokens it already produced), so its output does not change.
- Waiting sequences are admitted only in steps with no preemption, while ``len(running) < max_num_seqs``;
  their cached prefix (prefix caching) counts as computed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from keepwarm.worker.engine.block_manager import BlockManager
from keepwarm.worker.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass
class ScheduledBatch:
    """One step's work: ``num_new_tokens[i]`` tokens of ``seqs[i]`` starting at its ``num_computed_tokens``."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, lora_manager=None) -> None:
        self.config = config
        self.block_manager = block_manager
        # With LoRA, a waiting sequence is admitted only when its adapter holds (or gets) a slot; it keeps the
        # slot until it finishes or is preempted. Sequences that cannot get one wait, and later ones may pass.
        self.lora_manager = lora_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert num_new > 0, f"running {seq} has nothing to compute"
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
                continue
            break  # the sequence itself was preempted: nothing after it can run either

        if batch.preempted:
            return batch
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora is not None and self.lora_manager is not None:
                slot = self.lora_manager.acquire(seq.lora)
                if slot is None:  # every adapter slot is busy: let requests for other adapters go first
                    skipped.append(self.waiting.popleft())
                    continue
                seq.lora_slot = slot
            computed_blocks, num_cached = ([], 0)
            if seq.num_computed_tokens == 0 and seq.prompt_logprobs is None:
                computed_blocks, num_cached = self.block_manager.get_computed_blocks(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(seq, num_new, computed_blocks):
                self._release_lora(seq)
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0 and seq.num_output_tokens == 0:
                seq.num_cached_prompt_tokens = num_cached
            seq.num_computed_tokens += num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))  # back in arrival order, ahead of later arrivals
        return batch

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0 and self.lora_manager is not None:
            self.lora_manager.release(seq.lora_slot)
        seq.lora_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self._release_lora(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def recompute(self, seq: Sequence) -> None:
        """Drop a running sequence's KV and queue it first, to be recomputed from its first token (not counted
        as a preemption: the engine asks for it, e.g. when longrope switches to its long factors)."""
        self.running.remove(seq)
        self._preempt(seq)
        seq.num_preemptions -= 1
        self.num_preemptions -= 1

    def advance(self, batch: ScheduledBatch) -> None:
        """Record that the batch ran: its tokens' K/V are now in the cache."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence (stopped, length or aborted) wherever it is, and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = status
        self.block_manager.free(seq)
        self._release_lora(seq)
