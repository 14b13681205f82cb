"""The host-memory KV tier (docs/design.md §3 "Host KV tier"): prefix-cache blocks the
device pool evicts are copied here (pinned memory on CUDA) and copied back on a later
prefix hit, so a prompt whose blocks fell out of the device cache is not recomputed.

Inclusive and LRU: a block copied back stays here too (moved to the newest end), so
evicting it from the device again costs no copy; a full tier drops its least recently
used block. It records STORED/REMOVED/CLEARED with tier HOST into the engine's KV event
log, so routers see what it holds.

Copies run on the engine thread, in the order the pool asks for them: on CUDA they are
queued (non-blocking) on the current stream before the step's forward pass that would
overwrite an evicted block, and a copy back is queued behind any copy out of the same
slot, so stream order keeps every block's bytes right without a synchronisation. One
rank's cache only: tensor parallelism refuses the tier at start-up (EngineConfig).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_events import TIER_HOST, KvEventLog
from kv_store.base import byte_view

if TYPE_CHECKING:
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)


def build_kv_cache(
    config: EngineConfig, runner: Any, window: int
) -> tuple[KVCacheManager, KvEventLog | None, HostKvTier | None]:
    """The engine's block manager over ``runner``'s paged cache (``ModelRunner``; untyped,
    the executor sits above this package), with the KV event log when
    ``config.kv_events`` and the host tier when ``config.kv_offloading_size``."""
    events = KvEventLog() if config.kv_events else None
    kv = KVCacheManager(
        runner.num_blocks, config.block_size, config.enable_prefix_caching, window, events
    )
    if not config.kv_offloading_size:
        return kv, events, None
    tier = HostKvTier(runner.kv_cache, config.kv_offloading_size, events)
    kv.attach_lower_tier(tier)
    return kv, events, tier


@dataclass(slots=True)
class HostTierStats:
    """Counters of the tier (the service exports them: pdserve_kv_host_*)."""

    capacity_blocks: int = 0
    blocks: int = 0  # held now
    offloaded: int = 0  # blocks copied in from the device
    hits: int = 0  # blocks copied back to the device for a prefix hit
    evicted: int = 0  # blocks dropped to make room (LRU)


class HostKvTier:
    """Pinned host copies of evicted prefix-cache blocks, keyed by block hash.

    ``kv_cache`` is the device pool ``[layers, 2, blocks, block_size, heads, head_dim]``;
    ``size_bytes`` bounds the tier (``ValueError`` when it holds less than one block).
    """

    def __init__(
        self, kv_cache: torch.Tensor, size_bytes: int, events: KvEventLog | None = None
    ) -> None:
        block_shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
        per_block = kv_cache.element_size() * int(torch.Size(block_shape).numel())
        capacity = size_bytes // per_block
        if capacity < 1:
            raise ValueError(
                f"kv_offloading_size {size_bytes} bytes holds no KV block of {per_block} "
                "bytes; raise it or set 0 to turn the host tier off"
            )
        self._kv = kv_cache
        pin = kv_cache.device.type == "cuda"
        self._buffer = torch.empty(
            (capacity, *block_shape), dtype=kv_cache.dtype, device="cpu", pin_memory=pin
        )
        self._non_blocking = pin
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, oldest first
        self._parents: dict[bytes, bytes] = {}  # hash -> parent (a snapshot is one copy)
        self._free = list(range(capacity - 1, -1, -1))
        self._events = events
        self.stats = HostTierStats(capacity_blocks=capacity)
        logger.info(
            "host KV tier: %d blocks (%.1f MiB%s)",
            capacity,
            capacity * per_block / 2**20,
            ", pinned" if pin else "",
        )

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def touch(self, block_hash: bytes) -> bool:
        """Held? Then it becomes the newest (kept over older blocks while it is reloaded)."""
        if block_hash not in self._slots:
            return False
        self._slots.move_to_end(block_hash)
        return True

    def offload(self, block_id: int, block_hash: bytes, parent_hash: bytes) -> None:
        """Keep a copy of device block ``block_id`` (about to be overwritten) under its hash."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)  # the same bytes are here already
            return
        if not self._free:
            self._drop_oldest()
        slot = self._free.pop()
        byte_view(self._buffer[slot]).copy_(
            byte_view(self._kv[:, :, block_id]), non_blocking=self._non_blocking
        )
        self._slots[block_hash] = slot
        self._parents[block_hash] = parent_hash
        self.stats.offloaded += 1
        self.stats.blocks = len(self._slots)
        if self._events is not None:
            self._events.stored(TIER_HOST, block_hash, parent_hash)

    def reload(self, block_hash: bytes, block_id: int) -> bool:
        """Copy the block held under ``block_hash`` into device block ``block_id``; False
        (nothing copied) when the tier does not hold it."""
        slot = self._slots.get(block_hash)
        if slot is None:
            return False
        self._slots.move_to_end(block_hash)
        byte_view(self._kv[:, :, block_id]).copy_(
            byte_view(self._buffer[slot]), non_blocking=self._non_blocking
        )
        self.stats.hits += 1
        return True

    def _drop_oldest(self) -> None:
        block_hash, slot = self._slots.popitem(last=False)
        del self._parents[block_hash]
        self._free.append(slot)
        self.stats.evicted += 1
        if self._events is not None:
            self._events.removed(TIER_HOST, block_hash)

    def clear(self) -> None:
        """Forget every block (``reset_prefix_cache``)."""
        self._free.extend(self._slots.values())
        self._slots.clear()
        self._parents.clear()
        self.stats.blocks = 0
        if self._events is not None:
            self._events.cleared(TIER_HOST)

    def parents(self) -> dict[bytes, bytes]:
        """Every held hash and its parent (a snapshot of this tier)."""
        return dict(self._parents)
