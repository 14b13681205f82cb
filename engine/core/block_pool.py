"""The pool of KV blocks: free-block queue, reference counts, prefix-cache map, LRU eviction.

The free queue is a doubly linked list threaded through the blocks themselves, so taking,
returning and un-freeing a block (on a prefix hit) are O(1) with no allocation on the hot
path. A free block may still hold a cached hash: it is evicted (hash forgotten) only when it
is taken for new data, oldest-freed first — that is the LRU order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.core.kv_events import TIER_DEVICE, KvEventLog


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set while the block is registered in the prefix cache
    parent_hash: bytes = b""  # the hash before block_hash in its chain (b"": a prompt's first)
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks; head = next to evict, tail = most recently freed."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("no free KV blocks (caller must check num_free first)")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, "block is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterable[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns every KVCacheBlock. Block 0 is never handed out: padded block tables point at
    it, so a stray write there can never corrupt a request's data."""

    def __init__(
        self, num_blocks: int, enable_caching: bool, events: KvEventLog | None = None
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Where registrations, evictions and resets are recorded (None: KV events off).
        self.events = events
        # With events: every cached hash's parent, kept beside ``cached`` so a snapshot is
        # one C-level dict copy, not a Python loop over the blocks (docs/design.md §3).
        self._parents: dict[bytes, bytes] = {}
        # Called with a cached block about to lose its data (the host tier copies it out).
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def take(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` free blocks (caller checked ``num_free_blocks``); evicts cached data."""
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        if self.on_evict is not None:
            self.on_evict(block)
        del self.cached[block.block_hash]
        if self.events is not None:
            del self._parents[block.block_hash]
            self.events.removed(TIER_DEVICE, block.block_hash)
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to blocks found in the prefix cache (un-freeing them if idle)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero go to the free queue's tail in the
        given order (callers pass a request's blocks tail-first so its tail evicts first)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} released too often"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def register(self, block: KVCacheBlock, block_hash: bytes, parent_hash: bytes = b"") -> None:
        """Publish a full block's content hash (``parent_hash``: the previous block's in
        its chain, b"" for a prompt's first) so later requests can reuse it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # another block already holds this content; keep the first
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        self.cached[block_hash] = block
        if self.events is not None:
            self._parents[block_hash] = parent_hash
            self.events.stored(TIER_DEVICE, block_hash, parent_hash)

    def record_lookup(self, queried: int, hit: int) -> None:
        self.prefix_queries += queried
        self.prefix_hits += hit

    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self._parents.clear()
        if self.events is not None:
            self.events.cleared(TIER_DEVICE)

    def parents(self) -> dict[bytes, bytes]:
        """Every cached hash and its parent (a snapshot of the device tier)."""
        if self.events is not None:
            return dict(self._parents)
        return {h: b.parent_hash for h, b in self.cached.items()}
