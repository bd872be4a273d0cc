"""The scheduler as a unit, over a real BlockManager: token budget, running first, chunked prefill, admission
limits, preemption of the newest by recompute, prefix-cache hits, finishing from either queue. Fast: no model."""

from __future__ import annotations

from keepwarm.worker.engine.block_manager import BlockManager
from keepwarm.worker.engine.scheduler import Scheduler, SchedulerConfig
from keepwarm.worker.engine.sequence import Sequence, SequenceStatus
from keepwarm.worker.sampling_params import SamplingParams


def seq(name: str, n: int, start: int = 1) -> Sequence:
    return Sequence(name, list(range(start, start + n)), SamplingParams(temperature=0, max_tokens=100))


def make(num_blocks: int = 64, max_seqs: int = 8, budget: int = 64, caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget, 1024), BlockManager(num_blocks, 4, caching))


def step(s: Scheduler, token: int = 7):
    """schedule + advance, then every sequence that finished its prompt gets one output token."""
    batch = s.schedule()
    s.advance(batch)
    for q in batch.seqs:
        if q.num_computed_tokens == q.num_tokens:
            q.append_token(token, None)
    return batch


def test_budget_chunks_prefill_and_running_go_first() -> None:
    s = make(budget=10)
    a, b = seq("a", 6), seq("b", 8, 100)
    s.add(a)
    s.add(b)
    batch = step(s)
    assert [q.seq_id for q in batch.seqs] == ["a", "b"] and batch.num_new_tokens == [6, 4]  # b chunked
    assert sum(batch.num_new_tokens) == 10 and bool(batch) and not batch.preempted
    assert a.status == b.status == SequenceStatus.RUNNING and list(s.running) == [a, b] and not s.waiting
    batch = step(s)
    assert batch.num_new_tokens == [1, 4]  # a decodes first, then b's rest of the prompt
    assert b.num_computed_tokens == 8


def test_max_num_seqs_caps_admission() -> None:
    s = make(max_seqs=2)
    for i in range(3):
        s.add(seq(f"s{i}", 3, 10 * i + 1))
    batch = step(s)
    assert [q.seq_id for q in batch.seqs] == ["s0", "s1"] and [q.seq_id for q in s.waiting] == ["s2"]
    s.finish(batch.seqs[0], SequenceStatus.FINISHED_STOPPED)
    assert [q.seq_id for q in step(s).seqs] == ["s1", "s2"]


def test_zero_budget_left_admits_nobody() -> None:
    s = make(budget=4)
    a, b = seq("a", 4), seq("b", 2, 50)
    s.add(a)
    s.add(b)
    batch = step(s)
    assert batch.seqs == [a] and list(s.waiting) == [b]


def test_out_of_blocks_preempts_the_newest_and_recomputes_it() -> None:
    s = make(num_blocks=4, budget=64)  # 4 blocks of 4 tokens
    a, b = seq("a", 7), seq("b", 7, 100)
    s.add(a)
    s.add(b)
    step(s)  # a and b: 7 prompt tokens each, 2 blocks each: the pool is full
    step(s)  # each computes its 8th token (still 2 blocks)
    batch = step(s)  # a's 9th token needs a third block: b, the newest, gives its blocks back
    assert batch.preempted == [b] and batch.seqs == [a] and s.num_preemptions == 1 and b.num_preemptions == 1
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert a.status == SequenceStatus.RUNNING and a.num_preemptions == 0


def test_preempted_batch_returns_before_admitting() -> None:
    s = make(num_blocks=4, budget=64)
    a, b, c = seq("a", 7), seq("b", 7, 100), seq("c", 2, 200)
    for q in (a, b):
        s.add(q)
    step(s)
    step(s)
    s.add(c)
    batch = s.schedule()
    assert batch.preempted == [b] and c in s.waiting and c.status == SequenceStatus.WAITING
    assert batch.seqs == [a]


def test_the_only_sequence_preempts_itself_when_nothing_fits() -> None:
    s = make(num_blocks=2, budget=64)
    a = seq("a", 8)
    s.add(a)
    step(s)
    batch = s.schedule()  # a needs a third block and there is nobody else to take it from
    assert batch.preempted == [a] and batch.seqs == [] and not bool(batch)
    assert a.status == SequenceStatus.WAITING and s.running == []


def test_prefix_cache_hits_skip_computed_tokens() -> None:
    s = make()
    first = seq("first", 9)
    s.add(first)
    step(s)
    s.finish(first, SequenceStatus.FINISHED_STOPPED)
    again = seq("again", 9)  # same 9 tokens: two full blocks (8 tokens) cached
    s.add(again)
    batch = step(s)
    assert batch.num_new_tokens == [1] and again.num_cached_prompt_tokens == 8
    off = make(caching=False)
    f2 = seq("first", 9)
    off.add(f2)
    step(off)
    off.finish(f2, SequenceStatus.FINISHED_STOPPED)
    a2 = seq("again", 9)
    off.add(a2)
    assert step(off).num_new_tokens == [9] and a2.num_cached_prompt_tokens == 0


def test_finish_from_waiting_or_running_frees_blocks() -> None:
    s = make(max_seqs=1)
    a, b = seq("a", 5), seq("b", 5, 50)
    s.add(a)
    s.add(b)
    step(s)
    bm = s.block_manager
    used = bm.num_blocks - bm.pool.num_free
    assert used > 0
    s.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert b.status == SequenceStatus.FINISHED_ABORTED and not s.waiting
    s.finish(a, SequenceStatus.FINISHED_LENGTH)
    assert a.status == SequenceStatus.FINISHED_LENGTH and s.running == [] and not s.waiting
    assert bm.pool.num_free == bm.num_blocks


class OneSlotLoRA:
    """A stand-in LoRA manager with one adapter slot: records what the scheduler asks of it."""

    def __init__(self) -> None:
        self.holder = None
        self.calls: list[tuple[str, object]] = []

    def acquire(self, lora):
        self.calls.append(("acquire", lora))
        if self.holder not in (None, lora):
            return None
        self.holder = lora
        return 0

    def release(self, slot: int) -> None:
        self.calls.append(("release", slot))
        self.holder = None


def test_lora_slots_admit_wait_and_release() -> None:
    lora = OneSlotLoRA()
    s = Scheduler(SchedulerConfig(8, 64, 1024), BlockManager(64, 4, True), lora)
    a, b, base = seq("a", 3), seq("b", 3, 50), seq("base", 3, 100)
    a.lora, b.lora = "A", "B"
    for q in (a, b, base):
        s.add(q)
    batch = step(s)
    # a holds the slot; b (another adapter) waits while the base-model request behind it passes.
    assert batch.seqs == [a, base] and list(s.waiting) == [b] and a.lora_slot == 0 and b.lora_slot == -1
    assert lora.calls == [("acquire", "A"), ("acquire", "B")]  # the base-model request asks for nothing
    s.finish(base, SequenceStatus.FINISHED_STOPPED)
    assert lora.calls == [("acquire", "A"), ("acquire", "B")]  # nothing released for a request without a slot
    s.finish(a, SequenceStatus.FINISHED_STOPPED)
    assert lora.calls[-1] == ("release", 0) and a.lora_slot == -1
    assert step(s).seqs == [b] and b.lora_slot == 0


def test_a_partial_prefix_hit_computes_exactly_the_rest() -> None:
    s = make()
    first = seq("first", 9)
    s.add(first)
    step(s)
    s.finish(first, SequenceStatus.FINISHED_STOPPED)
    other = Sequence("other", [1, 2, 3, 4, 300, 301, 302, 303, 304, 305], SamplingParams(temperature=0))
    s.add(other)  # shares one block (4 tokens) with first, then differs
    batch = s.schedule()
    assert other.num_cached_prompt_tokens == 4 and batch.num_new_tokens == [6]


def test_prompt_logprobs_skip_the_prefix_cache() -> None:
    """A request asking for prompt logprobs computes its whole prompt even when its prefix is cached (the cached
    tokens' logprobs were never kept)."""
    s = make()
    first = seq("first", 9)
    s.add(first)
    step(s)
    s.finish(first, SequenceStatus.FINISHED_STOPPED)
    again = Sequence("again", list(range(1, 10)), SamplingParams(temperature=0, max_tokens=100, prompt_logprobs=1))
    s.add(again)
    assert step(s).num_new_tokens == [9] and again.num_cached_prompt_tokens == 0
