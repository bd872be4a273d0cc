"""Paged KV-cache block manager with automatic prefix caching, after vLLM v1's block pool.

Rules, in one place:
* Each block has a reference count: the number of live sequences whose block table holds it. A block with
  ``ref_cnt == 0`` is in the free queue, exactly once; a block with ``ref_cnt > 0`` is never in it.
* A full block whose tokens have been scheduled for compute gets a ``BlockHash`` and is entered in the
  cache. Freeing does not drop the hash: a freed block keeps its KV and can still be hit by a later prefix
  lookup ("touch" takes it back out of the free queue). Its hash is dropped only when the block is popped
  from the free queue for reuse (lazy eviction).
* Eviction order is the free queue order: blocks are taken from the head, freed blocks are appended to the
  tail. A sequence's blocks are freed in reverse, so its tail blocks (the least shareable ones) are evicted
  before its prefix blocks.
* The last token of a sequence is always recomputed (a forward pass needs at least one token to produce
  logits), so prefix lookups only consider blocks lying entirely within ``all_token_ids[:-1]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import NamedTuple

from keepwarm.worker.engine.sequence import Sequence

# Parent "hash" of a sequence's first block. Fixed so that hashes of int-only keys are reproducible; keys
# holding strings (cache salts) still vary per process with PYTHONHASHSEED, which is fine for a
# process-local cache.
_ROOT_HASH_SEED = 0x6B65_6570_7761_726D  # "keepwarm"


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class BlockHash(NamedTuple):
    """Prefix-cache key of one full block.

    ``hash_value`` chains over the whole prefix; ``token_ids`` and ``extra_keys`` are part of the dict key,
    so a lookup only succeeds when this block's tokens really match (a colliding ``hash_value`` alone
    cannot return a block with other tokens or another salt).
    """

    hash_value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple | None


def hash_block_tokens(parent: BlockHash | None, token_ids: SequenceABC[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    """Hash of one full block, chained from its parent block's hash (``None`` for the first block)."""
    tokens = tuple(token_ids)
    parent_value = _ROOT_HASH_SEED if parent is None else parent.hash_value
    return BlockHash(hash((parent_value, tokens, extra_keys)), tokens, extra_keys)


@dataclass(eq=False, slots=True)
class KVBlock:
    """One KV-cache block. Identity equality: the free-queue links would make field equality recursive."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set only while the block is full and entered in the cache
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinel head/tail, so removal from the middle is O(1).

    A prefix-cache hit on a free block must take it out of the queue wherever it sits; ``deque.remove``
    would be O(n).
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        self.append_n(blocks)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        if n > self.num_free:
            raise ValueError(f"asked for {n} free blocks, have {self.num_free}")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def append_n(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVBlock]:
        """Free blocks from head (evicted first) to tail. O(n); for tests and debugging."""
        out = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free
        return out


class BlockPool:
    """All KV blocks, the free queue (initially ids 0..N-1 in order) and the prefix-cache map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop ``n`` blocks from the queue head, evicting any hash they still carry; ref_cnt becomes 1."""
        blocks = self.free_queue.popleft_n(n)
        for block in blocks:
            assert block.ref_cnt == 0, block
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one (ref_cnt 0) leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching 0 go to the queue tail in the given order (hash kept)."""
        released = []
        for block in ordered:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        self.free_queue.append_n(released)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def cache_full_blocks(self, blocks: SequenceABC[KVBlock], block_hashes: SequenceABC[BlockHash]) -> None:
        """Enter full blocks in the cache under the given hashes (pairwise).

        A block that already has a hash (a prefix hit) is left alone. If another block already holds the
        hash (two sequences computed the same prefix concurrently), the existing entry wins and this block
        stays uncached: it is freed like any private block.
        """
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None:
                assert block.block_hash == block_hash, (block, block_hash)
                continue
            if block_hash in self.cached:
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def cached_by_recency(self) -> list[KVBlock]:
        """Every cached block, the most recently used first: those in use, then the free ones from the queue's tail
        (freed last) to its head (evicted next)."""
        in_use = [b for b in self.cached.values() if b.ref_cnt > 0]
        free = [b for b in reversed(self.free_queue.get_all_free_blocks())
                if b.block_hash is not None and self.cached.get(b.block_hash) is b]
        return in_use + free

    def adopt(self, block_hashes: SequenceABC[BlockHash]) -> list[tuple[int, KVBlock]]:
        """Enter blocks computed elsewhere (another worker's, most recent first) in the cache: each hash not cached
        yet takes a block from the free queue's head, as any allocation (evicting what it held), while free blocks
        last. They are freed again at once, the least recent first, so the most recent sit nearest the tail (evicted
        last) and every block this pool had freed before is evicted before them. Returns (index in
        ``block_hashes``, block) for each adopted; the caller fills their KV before the next step."""
        wanted: dict[BlockHash, int] = {}  # the first index of each hash not cached here, up to the free blocks
        for i, h in enumerate(block_hashes):
            if len(wanted) == self.num_free:
                break
            if h not in self.cached and h not in wanted:
                wanted[h] = i
        taken = self.get_new_blocks(len(wanted))
        for block_hash, block in zip(wanted, taken, strict=True):
            block.block_hash = block_hash
            self.cached[block_hash] = block
        self.free_blocks(reversed(taken))
        return list(zip(wanted.values(), taken, strict=True))

    def forget(self, blocks: Iterable[KVBlock]) -> None:
        """Drop these blocks' hashes (their KV is not what the hash says: an adoption that failed half way)."""
        for block in blocks:
            self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_free != len(self.blocks):
            return False
        self.cached.clear()
        for block in self.blocks:
            block.block_hash = None
        return True


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found in the cache
    query_requests: int = 0
    hit_requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """The scheduler's view of the KV cache: per-sequence block tables over a shared ``BlockPool``.

    Typical use per sequence: ``get_computed_blocks`` (only when ``num_computed_tokens == 0``), then
    ``allocate_slots`` each step with the tokens to compute, then ``free`` when it finishes or is preempted.
    This class never modifies the ``Sequence``; the scheduler advances ``num_computed_tokens`` after a step.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.stats = PrefixCacheStats()
        self._seq_blocks: dict[str, list[KVBlock]] = {}
        # Hashes of a sequence's full blocks, computed once (tokens of a full block never change).
        self._seq_hashes: dict[str, list[BlockHash]] = {}
        # How many of a sequence's leading blocks have been offered to the cache already.
        self._num_cached_blocks: dict[str, int] = {}

    # --- scheduler interface -------------------------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVBlock], int]:
        """Longest chain of cached full blocks matching ``seq`` from its first token.

        Returns ``(blocks, num_computed_tokens)``. Only blocks entirely within ``all_token_ids[:-1]`` are
        looked up, because the last token is always recomputed: a prompt of exactly ``k`` full blocks hits
        at most ``k - 1``. Takes no references; pass the blocks to ``allocate_slots`` right away, before any
        other allocation could evict them.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in self._block_hashes(seq, max_blocks)[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_computed = len(hits) * self.block_size
        self.stats.query_requests += 1
        self.stats.queries += seq.num_tokens
        self.stats.hits += num_computed
        if hits:
            self.stats.hit_requests += 1
        return hits, num_computed

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for ``num_new_tokens`` tokens after the computed ones (and ``new_computed_blocks``).

        Returns False, changing nothing, if the free queue cannot supply the missing blocks (prefix-hit
        blocks with ref_cnt 0 sit in the free queue, so they count against it). Otherwise takes a reference
        on the hit blocks, extends the block table and, with prefix caching on, caches every block that the
        tokens of this step fill.
        """
        new_computed = new_computed_blocks or []
        blocks = self._seq_blocks.get(seq.seq_id, [])
        if new_computed and (blocks or seq.num_computed_tokens):
            raise ValueError("new_computed_blocks is only valid for a sequence without computed tokens")
        num_computed_after = seq.num_computed_tokens + len(new_computed) * self.block_size + num_new_tokens
        num_required = cdiv(num_computed_after, self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed))
        num_free_hits = sum(1 for b in new_computed if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free - num_free_hits:
            return False

        # Touch first, so that get_new_blocks cannot pop (and evict) the hit blocks.
        self.pool.touch(new_computed)
        blocks = self._seq_blocks.setdefault(seq.seq_id, blocks)
        blocks.extend(new_computed)
        blocks.extend(self.pool.get_new_blocks(num_new_blocks))

        if self.enable_prefix_caching:
            num_full = min(num_computed_after, seq.num_tokens) // self.block_size
            num_cached = self._num_cached_blocks.get(seq.seq_id, 0)
            if num_full > num_cached:
                hashes = self._block_hashes(seq, num_full)
                self.pool.cache_full_blocks(blocks[num_cached:num_full], hashes[num_cached:num_full])
                self._num_cached_blocks[seq.seq_id] = num_full
        return True

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks tail first (so those are evicted first) and forget it. Idempotent."""
        blocks = self._seq_blocks.pop(seq.seq_id, [])
        self._seq_hashes.pop(seq.seq_id, None)
        self._num_cached_blocks.pop(seq.seq_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, seq: Sequence) -> list[int]:
        """The sequence's block table."""
        return [b.block_id for b in self._seq_blocks.get(seq.seq_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes; only possible (True) when no block is in use."""
        return self.pool.reset_prefix_cache()

    # --- accounting ----------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0); free-but-cached blocks count as unused."""
        return 1.0 - self.pool.num_free / self.num_blocks

    @property
    def prefix_cache_queries(self) -> int:
        return self.stats.queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.stats.hits

    @property
    def prefix_cache_query_requests(self) -> int:
        return self.stats.query_requests

    @property
    def prefix_cache_hit_requests(self) -> int:
        return self.stats.hit_requests

    # --- internals -----------------------------------------------------------------------------------------

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Hashes of the sequence's first ``num_blocks`` full blocks, extending the per-sequence list."""
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        # Salt and adapter go into every block's key, not only the first: a cheap guard on top of the chaining.
        extra = seq.block_hash_extra
        tokens = seq.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], extra))
        return hashes
