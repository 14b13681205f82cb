"""Block tables per request on top of the BlockPool: prefix lookup, slot allocation, freeing.

Mechanism only: ``allocate_slots`` returns None when the pool is short and never preempts;
the scheduler decides what to do about it.
"""

from __future__ import annotations

from engine.block_pool import BlockPool, KVCacheBlock
from engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
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

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of leading full blocks already in the prefix cache, and their tokens.

        At least one token is always left to compute, so the model produces logits.
        """
        if not self.enable_caching:
            return [], 0
        request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.pool.record_lookup(max_blocks, len(hits))
        return hits, len(hits) * self.block_size

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
            self.pool.register(blocks[i], request.block_hashes[i])
        if end > start:
            self._num_cached_blocks[request.request_id] = end

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        self._epochs.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
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
