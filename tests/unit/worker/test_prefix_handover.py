"""A prefix cache carried from one engine to another (keepwarm.worker.prefix_handover), as a restart does: exact
block ids and free order, the KV's bytes, greedy tokens against an engine that computed everything, and refusals
that name what differs with nothing adopted."""

from __future__ import annotations

import os

import pytest
import torch

from keepwarm.worker.engine.block_manager import BlockPool, hash_block_tokens
from keepwarm.worker.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(5, 5 + 53))  # three full 16-token blocks and 5 tokens more


def _keys(n: int, first: int = 0):
    out, parent = [], None
    for i in range(n):
        parent = hash_block_tokens(parent, [first + i] * 4)
        out.append(parent)
    return out


def test_adopted_blocks_come_from_the_queue_head_and_are_freed_most_recent_last() -> None:
    pool = BlockPool(6)
    own = pool.get_new_blocks(2)  # blocks 0, 1: this pool's own, cached, then freed
    pool.cache_full_blocks(own, _keys(2, first=100))
    pool.free_blocks(reversed(own))
    keys = _keys(3)
    adopted = pool.adopt([keys[2], keys[0], keys[2], keys[1]])  # most recent first; a repeat is taken once
    assert [(i, b.block_id) for i, b in adopted] == [(0, 2), (1, 3), (3, 4)]
    assert all(b.ref_cnt == 0 for _, b in adopted)
    # free order, head (evicted first) to tail: the untouched block 5, this pool's own, then the adopted ones with
    # the most recent (keys[2], block 2) last
    assert [b.block_id for b in pool.free_queue.get_all_free_blocks()] == [5, 1, 0, 4, 3, 2]
    assert pool.get_cached_block(keys[2]).block_id == 2 and pool.get_cached_block(keys[1]).block_id == 4
    # a hash cached here already, and no more than the free blocks
    assert pool.adopt([keys[0]]) == []
    more = pool.adopt(_keys(9, first=50))
    assert len(more) == 6 and pool.get_cached_block(_keys(2, first=100)[0]) is None  # evicted from the head
    assert [b.block_id for b in pool.cached_by_recency()[:2]] == [more[0][1].block_id, more[1][1].block_id]


def test_cached_by_recency_puts_blocks_in_use_first_then_the_free_from_the_tail() -> None:
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a, b, c], _keys(3))
    pool.free_blocks([a, b])  # c stays in use
    assert [x.block_id for x in pool.cached_by_recency()] == [c.block_id, b.block_id, a.block_id]
    pool.forget([b])
    assert [x.block_id for x in pool.cached_by_recency()] == [c.block_id, a.block_id]


@pytest.fixture(scope="module")
def engines(tiny_llama):
    from keepwarm.worker.engine import EngineConfig, LLMEngine

    made = {}

    def make(name: str, **kw):
        made[name] = LLMEngine(EngineConfig(model=tiny_llama, dtype="float32", max_model_len=128, daemon=False,
                                            **kw))
        return made[name]

    yield make
    for e in made.values():
        e.close()


def _generate(engine, prompt=PROMPT) -> list[int]:
    rid = f"r{engine.stats.steps}-{len(engine.output_processor.requests)}"
    engine.add_request(rid, list(prompt), GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return tokens


def test_an_engine_adopts_another_ones_blocks_and_answers_as_a_fresh_one(engines) -> None:
    from keepwarm.worker.prefix_handover import adopt_prefixes, export_prefixes

    old, new, fresh = engines("old"), engines("new"), engines("fresh")
    reference = _generate(fresh)
    assert _generate(old) == reference
    fd, exported = export_prefixes(old)
    assert fd is not None and exported.blocks >= 3 and not exported.reason
    try:
        adopted = adopt_prefixes(new, fd)
    finally:
        os.close(fd)
    assert adopted.blocks == exported.blocks and not adopted.reason, adopted
    # the adopted blocks hold the old engine's KV, byte for byte
    for block_hash in (b.block_hash for b in old.block_manager.pool.cached_by_recency()):
        src = old.block_manager.pool.get_cached_block(block_hash).block_id
        dst = new.block_manager.pool.get_cached_block(block_hash).block_id
        for side in ("key", "value"):
            for a, b in zip(getattr(old.runner.kv_cache, side), getattr(new.runner.kv_cache, side), strict=True):
                assert torch.equal(a[:, src], b[:, dst])
    hits = new.block_manager.prefix_cache_hits
    assert _generate(new) == reference
    assert new.block_manager.prefix_cache_hits - hits == 3 * 16  # the prompt's three full blocks, not recomputed
    # an engine that holds the first block already adopts the others (a gather of some of the export's blocks)
    partial = engines("partial")
    _generate(partial, PROMPT[:20])
    fd, exported = export_prefixes(old)
    try:
        assert adopt_prefixes(partial, fd).blocks == exported.blocks - 1
    finally:
        os.close(fd)
    hits = partial.block_manager.prefix_cache_hits
    assert _generate(partial) == reference and partial.block_manager.prefix_cache_hits - hits == 3 * 16


def test_an_fp8_kv_pool_is_carried_bit_for_bit(engines) -> None:
    from keepwarm.worker.prefix_handover import adopt_prefixes, export_prefixes

    old, new = engines("old8", kv_cache_dtype="fp8"), engines("new8", kv_cache_dtype="fp8")
    reference = _generate(old)
    fd, exported = export_prefixes(old)
    assert fd is not None
    try:
        assert adopt_prefixes(new, fd).blocks == exported.blocks
    finally:
        os.close(fd)
    h = old.block_manager.pool.cached_by_recency()[0].block_hash
    src, dst = old.block_manager.pool.get_cached_block(h).block_id, new.block_manager.pool.get_cached_block(h).block_id
    assert old.runner.kv_cache.key[0].dtype == torch.float8_e4m3fn
    assert torch.equal(old.runner.kv_cache.key[0][:, src].view(torch.uint8),
                       new.runner.kv_cache.key[0][:, dst].view(torch.uint8))
    assert _generate(new) == reference


def test_an_engine_of_other_kv_refuses_naming_the_field_and_adopts_nothing(engines) -> None:
    from keepwarm.worker.prefix_handover import adopt_prefixes, export_prefixes

    old = engines("old2")
    _generate(old)
    fd, _ = export_prefixes(old)
    assert fd is not None
    try:
        other = engines("other", block_size=32)
        before = dict(other.block_manager.pool.cached)
        carried = adopt_prefixes(other, fd)
        assert carried.blocks == 0 and "block_size differs (16 there, 32 here)" in carried.reason, carried
        assert other.block_manager.pool.cached == before
        off = engines("off", enable_prefix_caching=False)
        assert adopt_prefixes(off, fd).reason == "prefix caching is off"
    finally:
        os.close(fd)


def test_a_malformed_export_is_refused_and_adopts_nothing(engines) -> None:
    from keepwarm.worker.prefix_handover import adopt_prefixes, export_prefixes

    old, new = engines("old3"), engines("new3")
    _generate(old)
    fd, _ = export_prefixes(old)
    assert fd is not None
    try:
        os.ftruncate(fd, os.fstat(fd).st_size - 4096)  # one page of KV missing
        before = dict(new.block_manager.pool.cached)
        carried = adopt_prefixes(new, fd)
        assert carried.blocks == 0 and carried.reason.startswith("a malformed export: "), carried
        assert new.block_manager.pool.cached == before
        os.ftruncate(fd, 4)
        assert "has no header" in adopt_prefixes(new, fd).reason
    finally:
        os.close(fd)
    assert export_prefixes(engines("empty"))[1].reason == "no cached blocks"
