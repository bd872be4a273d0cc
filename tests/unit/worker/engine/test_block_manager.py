"""Block manager and prefix cache: exact block ids, ref counts and free-queue order on tiny pools."""

from __future__ import annotations

import random

import pytest

from keepwarm.worker.engine.block_manager import (
    BlockHash,
    BlockManager,
    BlockPool,
    FreeBlockQueue,
    KVBlock,
    cdiv,
    hash_block_tokens,
)
from keepwarm.worker.engine.sequence import Sequence
from keepwarm.worker.sampling_params import SamplingParams

BS = 4


def make_seq(seq_id: str, tokens: list[int], cache_salt: str | None = None) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(), cache_salt=cache_salt)


def free_ids(bm: BlockManager) -> list[int]:
    return [b.block_id for b in bm.pool.free_queue.get_all_free_blocks()]


def ref_cnts(bm: BlockManager, ids: list[int]) -> list[int]:
    return [bm.pool.blocks[i].ref_cnt for i in ids]


def prefill(bm: BlockManager, seq: Sequence) -> int:
    """Schedule the whole prompt as one step the way the scheduler does; returns the prefix-hit tokens."""
    hits, num_hit = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - num_hit, hits)
    seq.num_computed_tokens = seq.num_tokens
    return num_hit


def decode(bm: BlockManager, seq: Sequence, token: int) -> None:
    """Sample ``token`` (appended), then schedule it for the next step and run that step."""
    seq.append_token(token)
    assert bm.allocate_slots(seq, 1)
    seq.num_computed_tokens += 1


def check_invariants(bm: BlockManager, tables: dict[str, list[int]] | None = None) -> None:
    queue = bm.pool.free_queue.get_all_free_blocks()
    queued_ids = [b.block_id for b in queue]
    assert len(queued_ids) == len(set(queued_ids)) == bm.num_free_blocks
    queued = set(queued_ids)
    for block in bm.pool.blocks:
        if block.block_id in queued:
            assert block.ref_cnt == 0
        else:
            assert block.ref_cnt > 0
            assert block.prev_free is None and block.next_free is None
    for key, block in bm.pool.cached.items():
        assert block.block_hash == key
    hashed = [b for b in bm.pool.blocks if b.block_hash is not None]
    assert len(hashed) == len(bm.pool.cached)
    if tables is not None:
        # ref_cnt is exactly the number of block tables holding the block.
        counts = [0] * bm.num_blocks
        for ids in tables.values():
            for i in ids:
                counts[i] += 1
        assert counts == [b.ref_cnt for b in bm.pool.blocks]


# --- FreeBlockQueue ---


def ids_of(q: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in q.get_all_free_blocks()]


def test_free_queue_popleft_and_append() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids_of(q) == [0, 1, 2, 3, 4] and q.num_free == 5
    assert q.popleft() is blocks[0]
    assert [b.block_id for b in q.popleft_n(2)] == [1, 2]
    assert ids_of(q) == [3, 4] and q.num_free == 2
    q.append(blocks[1])
    q.append_n([blocks[0], blocks[2]])
    assert ids_of(q) == [3, 4, 1, 0, 2] and q.num_free == 5
    with pytest.raises(ValueError):
        q.append(blocks[3])  # already queued
    with pytest.raises(ValueError):
        q.popleft_n(6)
    assert ids_of(q) == [3, 4, 1, 0, 2]  # a refused popleft_n pops nothing
    assert [b.block_id for b in q.popleft_n(5)] == [3, 4, 1, 0, 2]
    assert q.num_free == 0 and ids_of(q) == []
    with pytest.raises(ValueError):
        q.popleft()


def test_free_queue_remove_middle_head_tail() -> None:
    blocks = [KVBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[3])  # middle
    assert ids_of(q) == [0, 1, 2, 4, 5]
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    q.remove(blocks[0])  # head
    assert ids_of(q) == [1, 2, 4, 5]
    q.remove(blocks[5])  # tail
    assert ids_of(q) == [1, 2, 4]
    assert q.num_free == 3
    with pytest.raises(ValueError):
        q.remove(blocks[3])  # not queued
    q.append(blocks[3])
    assert ids_of(q) == [1, 2, 4, 3]
    assert q.popleft() is blocks[1]
    q.remove(blocks[3])
    q.remove(blocks[2])
    q.remove(blocks[4])
    assert ids_of(q) == [] and q.num_free == 0
    q.append_n(blocks[:2])
    assert ids_of(q) == [0, 1]


# --- hashing and pool ---


def test_block_hash_chains_and_keys_include_tokens() -> None:
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert h0 == hash_block_tokens(None, (1, 2, 3, 4))
    assert h1.token_ids == (5, 6, 7, 8) and h1.extra_keys is None
    # Same tokens after a different parent: different chain value.
    assert hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8]) != h1
    assert hash_block_tokens(None, [1, 2, 3, 4], ("a",)) != h0
    # A colliding hash value with other tokens is a different key, so it cannot hit.
    pool = BlockPool(2)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [h0])
    assert pool.get_cached_block(h0) is block
    assert pool.get_cached_block(BlockHash(h0.hash_value, (0, 0, 0, 0), None)) is None


def test_pool_duplicate_hash_keeps_existing_entry() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_full_blocks([a], [h])
    pool.cache_full_blocks([b], [h])
    assert pool.cached == {h: a} and a.block_hash == h and b.block_hash is None
    # Freeing and reusing the duplicate does not disturb the cached entry.
    pool.free_blocks([b])
    assert [x.block_id for x in pool.free_queue.get_all_free_blocks()] == [2, 3, 1]
    pool.get_new_blocks(3)
    assert pool.get_cached_block(h) is a


# --- BlockManager ---


def test_allocate_prompt() -> None:
    bm = BlockManager(10, BS)
    a = make_seq("a", list(range(10)))
    assert prefill(bm, a) == 0
    assert bm.get_block_ids(a) == [0, 1, 2]
    assert ref_cnts(bm, [0, 1, 2]) == [1, 1, 1]
    assert free_ids(bm) == [3, 4, 5, 6, 7, 8, 9]
    assert bm.num_free_blocks == 7 and bm.num_blocks == 10
    assert bm.usage == pytest.approx(0.3)
    # Two full blocks are cached, the partial third is not.
    blocks = bm.pool.blocks
    assert blocks[0].block_hash is not None and blocks[1].block_hash is not None
    assert blocks[2].block_hash is None
    assert blocks[0].block_hash.token_ids == (0, 1, 2, 3)
    assert blocks[1].block_hash == hash_block_tokens(blocks[0].block_hash, [4, 5, 6, 7])
    assert len(bm.pool.cached) == 2
    check_invariants(bm)


def test_chunked_prefill_allocates_per_chunk() -> None:
    bm = BlockManager(10, BS)
    a = make_seq("a", list(range(10)))
    assert bm.get_computed_blocks(a) == ([], 0)
    assert bm.allocate_slots(a, 5)
    assert bm.get_block_ids(a) == [0, 1]
    assert [b.block_hash is not None for b in bm.pool.blocks[:2]] == [True, False]
    a.num_computed_tokens = 5
    assert bm.allocate_slots(a, 5)
    assert bm.get_block_ids(a) == [0, 1, 2]
    assert [b.block_hash is not None for b in bm.pool.blocks[:3]] == [True, True, False]
    check_invariants(bm)


def test_decode_fills_block_then_takes_new_one() -> None:
    bm = BlockManager(10, BS)
    a = make_seq("a", list(range(10)))
    prefill(bm, a)
    decode(bm, a, 100)  # token 10 -> slot 2 of block 2
    assert bm.get_block_ids(a) == [0, 1, 2]
    assert bm.pool.blocks[2].block_hash is None
    decode(bm, a, 101)  # token 11 fills block 2: now cached
    assert bm.get_block_ids(a) == [0, 1, 2]
    assert bm.pool.blocks[2].block_hash is not None
    assert bm.pool.blocks[2].block_hash.token_ids == (8, 9, 100, 101)
    assert free_ids(bm) == [3, 4, 5, 6, 7, 8, 9]
    decode(bm, a, 102)  # token 12 needs a fourth block
    assert bm.get_block_ids(a) == [0, 1, 2, 3]
    assert free_ids(bm) == [4, 5, 6, 7, 8, 9]
    assert bm.pool.blocks[3].block_hash is None
    check_invariants(bm)


def test_free_releases_in_reverse_order_and_is_idempotent() -> None:
    bm = BlockManager(10, BS)
    a = make_seq("a", list(range(10)))
    prefill(bm, a)
    bm.free(a)
    assert free_ids(bm) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert ref_cnts(bm, [0, 1, 2]) == [0, 0, 0]
    assert bm.get_block_ids(a) == []
    assert bm.usage == 0.0
    # Freed full blocks keep their hashes until evicted.
    assert len(bm.pool.cached) == 2
    bm.free(a)
    assert free_ids(bm) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    check_invariants(bm)


def test_shared_prefix_reuses_blocks() -> None:
    bm = BlockManager(10, BS)
    prefix = list(range(12))
    a = make_seq("a", prefix + [50, 51])
    b = make_seq("b", prefix + [60, 61, 62])
    assert prefill(bm, a) == 0
    assert bm.get_block_ids(a) == [0, 1, 2, 3]
    hits, num_hit = bm.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1, 2] and num_hit == 12
    assert ref_cnts(bm, [0, 1, 2]) == [1, 1, 1]  # lookup takes no references
    assert bm.allocate_slots(b, b.num_tokens - num_hit, hits)
    b.num_computed_tokens = b.num_tokens
    assert bm.get_block_ids(b) == [0, 1, 2, 4]
    assert ref_cnts(bm, [0, 1, 2, 3, 4]) == [2, 2, 2, 1, 1]
    assert free_ids(bm) == [5, 6, 7, 8, 9]
    assert bm.prefix_cache_hits == 12
    assert bm.prefix_cache_queries == 14 + 15
    assert bm.prefix_cache_query_requests == 2
    assert bm.prefix_cache_hit_requests == 1
    assert bm.stats.hit_rate == pytest.approx(12 / 29)
    # Freeing one sharer keeps the shared blocks in use; only a's private tail block is released.
    bm.free(a)
    assert ref_cnts(bm, [0, 1, 2, 3]) == [1, 1, 1, 0]
    assert free_ids(bm) == [5, 6, 7, 8, 9, 3]
    bm.free(b)
    assert free_ids(bm) == [5, 6, 7, 8, 9, 3, 4, 2, 1, 0]
    check_invariants(bm)


def test_hit_on_freed_blocks_removes_them_from_queue_middle() -> None:
    bm = BlockManager(10, BS)
    prefix = list(range(8))
    a = make_seq("a", prefix + [20, 21, 22, 23, 24])
    prefill(bm, a)
    assert bm.get_block_ids(a) == [0, 1, 2, 3]
    bm.free(a)
    assert free_ids(bm) == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]
    b = make_seq("b", prefix + [30, 31])
    hits, num_hit = bm.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    assert bm.allocate_slots(b, b.num_tokens - num_hit, hits)
    # Blocks 1 (middle) and 0 (tail) left the queue; the new block came from the head.
    assert bm.get_block_ids(b) == [0, 1, 4]
    assert ref_cnts(bm, [0, 1, 4]) == [1, 1, 1]
    assert free_ids(bm) == [5, 6, 7, 8, 9, 3, 2]
    # Block 2 is still cached and a third sequence can hit all three blocks of a.
    c = make_seq("c", prefix + [20, 21, 22, 23, 99])
    hits, num_hit = bm.get_computed_blocks(c)
    assert [blk.block_id for blk in hits] == [0, 1, 2] and num_hit == 12
    assert bm.allocate_slots(c, 1, hits)
    assert bm.get_block_ids(c) == [0, 1, 2, 5]
    assert ref_cnts(bm, [0, 1, 2, 5]) == [2, 2, 1, 1]
    assert free_ids(bm) == [6, 7, 8, 9, 3]
    check_invariants(bm)


def test_lazy_eviction_pops_cached_blocks_from_head() -> None:
    bm = BlockManager(10, BS)
    prompt = list(range(13))
    a = make_seq("a", prompt)
    prefill(bm, a)
    bm.free(a)
    assert free_ids(bm) == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]
    assert len(bm.pool.cached) == 3
    old_hash = bm.pool.blocks[2].block_hash
    assert old_hash is not None
    # 8 new blocks: 4..9, then 3 (uncached) and 2 (cached: evicted).
    d = make_seq("d", [1000 + i for i in range(32)])
    prefill(bm, d)
    assert bm.get_block_ids(d) == [4, 5, 6, 7, 8, 9, 3, 2]
    assert free_ids(bm) == [1, 0]
    assert bm.pool.get_cached_block(old_hash) is None
    assert bm.pool.blocks[2].block_hash is not None  # re-cached under d's tokens
    assert bm.pool.blocks[2].block_hash.token_ids == (1028, 1029, 1030, 1031)
    b = make_seq("b", prompt)
    hits, num_hit = bm.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    check_invariants(bm)


def test_last_token_is_always_recomputed() -> None:
    bm = BlockManager(10, BS)
    prompt = list(range(12))  # exactly 3 full blocks
    a = make_seq("a", prompt)
    prefill(bm, a)
    assert bm.get_block_ids(a) == [0, 1, 2]
    assert len(bm.pool.cached) == 3
    b = make_seq("b", prompt)
    hits, num_hit = bm.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    assert bm.allocate_slots(b, 4, hits)
    assert bm.get_block_ids(b) == [0, 1, 3]
    # Block 3 holds the same tokens as the cached block 2: the existing entry wins, 3 stays uncached.
    assert bm.pool.blocks[3].block_hash is None
    assert bm.pool.get_cached_block(bm.pool.blocks[2].block_hash) is bm.pool.blocks[2]
    # A longer sequence with the same 12 tokens does hit all three blocks.
    c = make_seq("c", prompt + [7])
    assert [blk.block_id for blk in bm.get_computed_blocks(c)[0]] == [0, 1, 2]
    # A one-token prompt looks nothing up.
    assert bm.get_computed_blocks(make_seq("d", [0])) == ([], 0)
    check_invariants(bm)


def test_cache_salt_isolates_prefixes() -> None:
    bm = BlockManager(10, BS)
    prompt = list(range(9))
    a = make_seq("a", prompt, cache_salt="lora-x")
    prefill(bm, a)
    assert bm.get_computed_blocks(make_seq("b", prompt, cache_salt="lora-y")) == ([], 0)
    assert bm.get_computed_blocks(make_seq("c", prompt)) == ([], 0)
    hits, num_hit = bm.get_computed_blocks(make_seq("d", prompt, cache_salt="lora-x"))
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    assert bm.pool.blocks[0].block_hash.extra_keys == ("lora-x",)
    # Unsalted and salted copies of the same prefix coexist in the cache.
    c = make_seq("c2", prompt)
    prefill(bm, c)
    assert bm.get_block_ids(c) == [3, 4, 5]
    assert len(bm.pool.cached) == 4
    check_invariants(bm)


def test_failed_allocation_changes_nothing() -> None:
    bm = BlockManager(10, BS)
    a = make_seq("a", list(range(30)))
    prefill(bm, a)
    assert bm.get_block_ids(a) == [0, 1, 2, 3, 4, 5, 6, 7]
    cached_before = dict(bm.pool.cached)
    b = make_seq("b", [500 + i for i in range(9)])  # needs 3 blocks, 2 free
    hits, num_hit = bm.get_computed_blocks(b)
    assert not bm.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert bm.num_free_blocks == 2 and free_ids(bm) == [8, 9]
    assert bm.get_block_ids(b) == []
    assert bm.pool.cached == cached_before
    # A decode step that needs a new block while the pool is exhausted also fails cleanly.
    assert bm.allocate_slots(b, 8)
    assert bm.get_block_ids(b) == [8, 9] and free_ids(bm) == []
    a.num_computed_tokens = 30
    a.append_token(1)
    a.append_token(2)
    a.num_computed_tokens = 31
    assert bm.allocate_slots(a, 1)  # token 31 still fits in block 7
    a.num_computed_tokens = 32
    a.append_token(3)
    assert not bm.allocate_slots(a, 1)
    assert bm.get_block_ids(a) == [0, 1, 2, 3, 4, 5, 6, 7]
    check_invariants(bm)


def test_failed_allocation_counts_free_prefix_hits() -> None:
    bm = BlockManager(4, BS)
    prefix = list(range(8))
    a = make_seq("a", prefix + [40])
    prefill(bm, a)
    bm.free(a)
    assert free_ids(bm) == [3, 2, 1, 0]
    # b hits blocks 0 and 1, which sit in the free queue; it needs 3 more, but only 2 others are free.
    b = make_seq("b", prefix + list(range(100, 112)))
    hits, num_hit = bm.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert not bm.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert free_ids(bm) == [3, 2, 1, 0]
    assert ref_cnts(bm, [0, 1, 2, 3]) == [0, 0, 0, 0]
    assert len(bm.pool.cached) == 2
    # Scheduling only part of the rest (chunked prefill) fits: 2 hits + 2 new blocks.
    assert bm.allocate_slots(b, 8, hits)
    assert bm.get_block_ids(b) == [0, 1, 3, 2]
    assert free_ids(bm) == []
    check_invariants(bm)


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    prompt = list(range(13))
    a = make_seq("a", prompt)
    prefill(bm, a)
    bm.free(a)
    b = make_seq("b", prompt)
    assert prefill(bm, b) == 0
    assert bm.get_block_ids(b) == [4, 5, 6, 7]
    assert bm.pool.cached == {}
    assert all(blk.block_hash is None for blk in bm.pool.blocks)
    assert bm.prefix_cache_queries == 0 and bm.prefix_cache_hits == 0
    assert bm.prefix_cache_query_requests == 0 and bm.prefix_cache_hit_requests == 0
    check_invariants(bm)


def test_reset_prefix_cache() -> None:
    bm = BlockManager(10, BS)
    prompt = list(range(9))
    a = make_seq("a", prompt)
    prefill(bm, a)
    assert not bm.reset_prefix_cache()
    assert len(bm.pool.cached) == 2
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.pool.cached == {}
    assert all(blk.block_hash is None for blk in bm.pool.blocks)
    assert free_ids(bm) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert bm.get_computed_blocks(make_seq("b", prompt)) == ([], 0)


def test_preempted_sequence_recomputes_with_prefix_hits() -> None:
    bm = BlockManager(10, BS)
    a = make_seq("a", list(range(10)))
    prefill(bm, a)
    decode(bm, a, 100)
    decode(bm, a, 101)
    assert bm.get_block_ids(a) == [0, 1, 2]
    # Preemption: the scheduler frees the blocks and resets num_computed_tokens; the KV stays cached.
    bm.free(a)
    a.num_computed_tokens = 0
    a.append_token(102)  # 13 tokens: 3 full cached blocks before the last token
    hits, num_hit = bm.get_computed_blocks(a)
    assert [blk.block_id for blk in hits] == [0, 1, 2] and num_hit == 12
    assert bm.allocate_slots(a, a.num_tokens - num_hit, hits)
    assert bm.get_block_ids(a) == [0, 1, 2, 3]
    check_invariants(bm)


# --- randomized stress ---


@pytest.mark.parametrize("seed", range(8))
def test_random_stress(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks, bs = 24, 4
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=seed % 4 != 3)
    # Simulated KV content: (salt, token) per slot, written by each step, so a prefix hit can be checked
    # against what the hit blocks really hold.
    content: list[list[tuple[str | None, int] | None]] = [[None] * bs for _ in range(num_blocks)]
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    running: dict[str, Sequence] = {}
    waiting: list[Sequence] = []
    next_id = 0

    def run_step(seq: Sequence, start: int, n: int) -> None:
        table = bm.get_block_ids(seq)
        assert len(table) == cdiv(start + n, bs)
        for pos in range(start, start + n):
            content[table[pos // bs]][pos % bs] = (seq.cache_salt, seq.all_token_ids[pos])
        seq.num_computed_tokens = start + n

    def schedule(seq: Sequence) -> bool:
        hits, num_hit = bm.get_computed_blocks(seq)
        assert num_hit == len(hits) * bs < seq.num_tokens
        for i, blk in enumerate(hits):
            assert blk.block_hash is not None
            for j in range(bs):
                assert content[blk.block_id][j] == (seq.cache_salt, seq.all_token_ids[i * bs + j])
        # Sometimes chunked: schedule only part of the remaining prompt.
        n = seq.num_tokens - num_hit
        if rng.random() < 0.3:
            n = rng.randrange(1, n + 1)
        if not bm.allocate_slots(seq, n, hits):
            assert bm.get_block_ids(seq) == []
            return False
        run_step(seq, num_hit, n)
        return True

    for _ in range(400):
        op = rng.random()
        if op < 0.25:
            salt = rng.choice([None, None, "x"])
            tokens = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(0, 10))]
            waiting.append(make_seq(f"s{next_id}", tokens or [0], cache_salt=salt))
            next_id += 1
        elif op < 0.4 and waiting:
            seq = waiting.pop(rng.randrange(len(waiting)))
            if schedule(seq):
                running[seq.seq_id] = seq
            else:
                waiting.append(seq)
        elif op < 0.85 and running:
            seq = running[rng.choice(sorted(running))]
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(rng.randrange(5))
            start = seq.num_computed_tokens
            n = seq.num_tokens - start
            before = (bm.get_block_ids(seq), free_ids(bm), dict(bm.pool.cached))
            if bm.allocate_slots(seq, n):
                run_step(seq, start, n)
            else:
                assert (bm.get_block_ids(seq), free_ids(bm), dict(bm.pool.cached)) == before
                # Preempt (recompute later).
                bm.free(seq)
                seq.num_computed_tokens = 0
                del running[seq.seq_id]
                waiting.append(seq)
        elif running:
            seq = running.pop(rng.choice(sorted(running)))
            bm.free(seq)
            bm.free(seq)
        tables = {sid: bm.get_block_ids(s) for sid, s in running.items()}
        check_invariants(bm, tables)
        assert bm.usage == pytest.approx(1 - bm.num_free_blocks / num_blocks)
        for key, blk in bm.pool.cached.items():
            assert all(c is not None and c[1] == t for c, t in zip(content[blk.block_id], key.token_ids,
                                                                   strict=True))

    for seq in running.values():
        bm.free(seq)
    check_invariants(bm, {})
    assert bm.num_free_blocks == num_blocks
    if bm.enable_prefix_caching:
        assert bm.prefix_cache_hits > 0
    assert bm.reset_prefix_cache()
