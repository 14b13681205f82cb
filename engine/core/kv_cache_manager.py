"""Block tables per request on top of the BlockPool: prefix lookup, slot allocation, freeing.

Mechanism only: ``allocate_slots`` returns None when the pool is short and never preempts;
the scheduler decides what to do about it.

With a sliding window on every layer (``window`` > 0, docs/design.md §3 "Sliding windows")
a request's blocks that lie wholly before the window of its next query are released as it
advances: no later query of the request can read them. Their table entries become block 0
(the never-handed-out padding block), so positions and block indices stay as they were.
"""

from __future__ import annotations

from typing import Protocol

from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.kv_events import KvEventLog
from engine.core.request import Request


class LowerTier(Protocol):
    """A tier below the device pool that keeps evicted blocks (``engine/kv/host_tier.py``)."""

    def __contains__(self, block_hash: bytes) -> bool: ...

    def touch(self, block_hash: bytes) -> bool:
        """Whether the tier holds ``block_hash``; if so it becomes the newest there."""
        ...

    def offload(self, block_id: int, block_hash: bytes, parent_hash: bytes) -> None: ...

    def reload(self, block_hash: bytes, block_id: int) -> bool: ...

    def clear(self) -> None: ...


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        window: int = 0,
        events: KvEventLog | None = None,
    ) -> None:
        self.block_size = block_size
        self.window = window
        # How many leading blocks of each request were released as out of the window.
        self._num_dropped: dict[str, int] = {}
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, events)
        self.lower: LowerTier | None = None  # the host tier, when on (attach_lower_tier)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as plain block ids, kept alongside so that handing them to the
        # model runner every step is a list copy, not a Python loop over blocks.
        self._block_ids: dict[str, list[int]] = {}
        # How many of a request's blocks are already registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # A request's block table only grows (append) until it is freed; a new table gets a
        # new epoch. The model runner keeps each table's host copy across steps and, while
        # the epoch is unchanged, copies only the appended ids instead of the whole table.
        self._epochs: dict[str, int] = {}
        self._next_epoch = 0

    def attach_lower_tier(self, tier: LowerTier) -> None:
        """Evicted cached blocks go to ``tier``; prefix lookups find them there too."""
        self.lower = tier

        def offload(block: KVCacheBlock) -> None:
            assert block.block_hash is not None
            tier.offload(block.block_id, block.block_hash, block.parent_hash)

        self.pool.on_evict = offload

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of leading full blocks already in the prefix cache, and their tokens.

        At least one token is always left to compute, so the model produces logits.
        """
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return (
                [],
                0,
            )  # cached positions would have no logits (engine/sampling/prompt_logprobs.py)
        request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        hits: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.lower is not None and len(hits) < len(hashes) and hashes[len(hits)] in self.lower:
            self._extend_from_lower(hashes, hits)
        self.pool.record_lookup(max_blocks, len(hits))
        return hits, len(hits) * self.block_size

    def _extend_from_lower(self, hashes: list[bytes], hits: list[KVCacheBlock]) -> None:
        """Continue ``hits`` past the device cache: each next block from the device if it
        is there, else from the lower tier, copied into a free block and registered.

        Everything found is held meanwhile (device blocks referenced, lower-tier entries
        made newest), so taking blocks for the copies evicts none of it; the blocks are
        taken in one go, so a run of evictions makes one REMOVED event. Afterwards the
        hits are held as before (idle ones back in the free queue, as its newest)."""
        assert self.lower is not None
        self.pool.touch(hits)
        plan: list[KVCacheBlock | int] = []  # a device block, or the index of a lower hash
        wanted = 0
        for i in range(len(hits), len(hashes)):
            block = self.pool.get_cached_block(hashes[i])
            if block is not None:
                self.pool.touch([block])
                plan.append(block)
            elif wanted < self.pool.num_free_blocks and self.lower.touch(hashes[i]):
                wanted += 1
                plan.append(i)
            else:
                break
        while wanted > self.pool.num_free_blocks:  # device hits held after a copy planned
            step = plan.pop()
            if isinstance(step, KVCacheBlock):
                self.pool.release([step])
            else:
                wanted -= 1
        fresh = self.pool.take(wanted)  # may evict (and offload) idle blocks
        for k, step in enumerate(plan):
            if isinstance(step, KVCacheBlock):
                block = step
            else:
                block = fresh.pop()
                if not self.lower.reload(hashes[step], block.block_id):
                    # Dropped to make room after all: the hits end before it; the rest of
                    # the plan is let go (the copies' blocks unregistered, so free).
                    rest = [b for b in plan[k + 1 :] if isinstance(b, KVCacheBlock)]
                    self.pool.release([block, *fresh, *rest])
                    break
                self.pool.register(block, hashes[step], hashes[step - 1] if step else b"")
            hits.append(block)
        self.pool.release(reversed(hits))

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, in the device pool and the lower tier."""
        self.pool.reset_prefix_cache()
        if self.lower is not None:
            self.lower.clear()

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` are prefix-cache hits to adopt first (a fresh request).
        Returns the newly taken blocks, or None (changing nothing) if the pool is short.
        """
        if self.window and request.request_id in self.req_to_blocks:
            self._drop_outside_window(request)
        if not new_computed_blocks:
            # Hot path (decode): the tail block still has room; nothing to take.
            held = self.req_to_blocks.get(request.request_id)
            if held and request.num_computed_tokens + num_new_tokens <= len(held) * self.block_size:
                return []
        computed = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(blocks) - len(computed)
        # Hits sitting idle in the free queue stop being free once adopted.
        idle_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - idle_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        ids = self._block_ids.get(request.request_id)
        if ids is None:
            ids = self._block_ids[request.request_id] = []
            self._epochs[request.request_id] = self._next_epoch
            self._next_epoch += 1
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
            ids.extend(b.block_id for b in computed)
            self._num_cached_blocks[request.request_id] = len(blocks)
        new_blocks = self.pool.take(max(need, 0))
        blocks.extend(new_blocks)
        ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    def _drop_outside_window(self, request: Request) -> None:
        """Release the blocks no query from ``num_computed_tokens`` on can see: a query at
        position p reads keys from p - window + 1 on, and positions only grow."""
        rid = request.request_id
        first_visible = request.num_computed_tokens - self.window + 1
        dead = max(0, first_visible) // self.block_size
        done = self._num_dropped.get(rid, 0)
        blocks = self.req_to_blocks[rid]
        dead = min(dead, len(blocks))
        if dead <= done:
            return
        null = self.pool.blocks[0]
        ids = self._block_ids[rid]
        released = blocks[done:dead]
        blocks[done:dead] = [null] * (dead - done)
        ids[done:dead] = [0] * (dead - done)
        self.pool.release(reversed([b for b in released if b is not null]))
        self._num_dropped[rid] = dead
        # Entries changed in place: a new epoch makes the runner copy the whole table.
        self._epochs[rid] = self._next_epoch
        self._next_epoch += 1

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks the request still holds (its table minus the released window blocks)."""
        return self.num_blocks_of(request_id) - self._num_dropped.get(request_id, 0)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register every full block whose KV is (or is being, this step) computed."""
        if not self.enable_caching:
            return
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_computed_tokens // self.block_size <= start:
            return  # no newly completed block (most decode steps)
        request.update_block_hashes(self.block_size)
        blocks = self.req_to_blocks.get(request.request_id, [])
        end = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(start, end):
            if blocks[i].block_id:  # not a released window block
                parent = request.block_hashes[i - 1] if i else b""
                self.pool.register(blocks[i], request.block_hashes[i], parent)
        if end > start:
            self._num_cached_blocks[request.request_id] = end

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        self._epochs.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if self._num_dropped.pop(request.request_id, 0):
            blocks = [b for b in blocks if b.block_id]  # released window blocks are gone
        self.pool.release(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (block ids, in token order)."""
        return list(self._block_ids.get(request_id, ()))

    def table_epoch(self, request_id: str) -> int:
        """Identity of the request's current block table (see ``_epochs``); -1 if none."""
        return self._epochs.get(request_id, -1)

    def block_table(self, request_id: str) -> tuple[list[int], int]:
        """``(block_ids(request_id), table_epoch(request_id))`` in one call (per-step path)."""
        ids = self._block_ids.get(request_id)
        if ids is None:
            return [], -1
        return list(ids), self._epochs[request_id]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, []))
