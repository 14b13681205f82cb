"""The global block index of one pool: which instance holds which KV block, in which tier
(docs/design.md §5, "KV events and the global block index").

Fed by the engines' KV events (``router/routing/kv_events.py``), not guessed: an entry is
(block hash, instance) with a bitmask of the tiers the instance reports holding it in.
Block hashes are chained (``common/block_hash.py``), so an instance serves a prompt's first
k blocks from cache exactly when it holds each of hashes 0..k-1; the engine's own lookup
stops at its first miss, and so does :meth:`KvBlockIndex.match`.

Memory is bounded by ``max_entries`` (hash, instance) pairs over the pool. When a STORED
event would pass the bound, the instance holding the most entries loses its oldest-stored
ones (the ones its own LRU most likely evicted already): an entry dropped this way costs a
missed hit in routing, never a route to a block that is not there. Not thread-safe: the
event loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve_api.v1 import pdserve_pb2

# Tier bits of an entry's mask, in the order of the proto's KvTier values.
DEVICE, HOST, STORE = 1, 2, 4
TIER_BITS = {
    pdserve_pb2.KV_TIER_DEVICE: DEVICE,
    pdserve_pb2.KV_TIER_HOST: HOST,
    pdserve_pb2.KV_TIER_STORE: STORE,
}
TIER_NAMES = {DEVICE: "device", HOST: "host", STORE: "store"}


@dataclass(frozen=True, slots=True)
class TierWeights:
    """What a held block is worth to routing, by the fastest tier holding it: a device
    block is reused as is, a host block is copied back first, a store block is loaded over
    the network (``--prefix-weight-device|host|store``)."""

    device: float = 1.0
    host: float = 0.8
    store: float = 0.5

    def __post_init__(self) -> None:
        if min(self.device, self.host, self.store) < 0:
            raise ValueError("tier weights must be >= 0")

    def of(self, mask: int) -> float:
        if mask & DEVICE:
            return self.device
        if mask & HOST:
            return self.host
        return self.store if mask & STORE else 0.0


@dataclass(slots=True)
class Match:
    """How much of a prompt one instance holds: the leading run of blocks held in any
    tier, those blocks by their fastest tier, and the run weighted by tier. ``source``:
    ``events`` (this index) or ``guess`` (``router/routing/prefix_index.py``, for an instance
    without a live event stream)."""

    blocks: int = 0
    device: int = 0
    host: int = 0
    store: int = 0
    weighted: float = 0.0
    source: str = "events"

    @property
    def fast_blocks(self) -> int:
        """Leading blocks held in device or host memory (reused without the store)."""
        return self.device + self.host

    def as_dict(self) -> dict[str, object]:
        return {
            "hit_blocks": self.blocks,
            "device": self.device,
            "host": self.host,
            "store": self.store,
            "weighted": round(self.weighted, 3),
            "source": self.source,
        }

    def add(self, mask: int, weights: TierWeights) -> None:
        self.blocks += 1
        if mask & DEVICE:
            self.device += 1
        elif mask & HOST:
            self.host += 1
        else:
            self.store += 1
        self.weighted += weights.of(mask)


@dataclass(slots=True)
class _Instance:
    epoch: str = ""
    # hash → tier mask, in store order (oldest first): what the bound drops first.
    entries: OrderedDict[bytes, int] = field(default_factory=OrderedDict)


class KvBlockIndex:
    """hash → {instance: tier mask} for one pool, with each instance's entries in store
    order for forgetting and for the memory bound."""

    def __init__(self, max_entries: int = 500_000, weights: TierWeights | None = None) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.weights = weights or TierWeights()
        self._holders: dict[bytes, dict[str, int]] = {}
        self._instances: dict[str, _Instance] = {}
        self._entries = 0
        self.dropped = 0  # entries dropped for the bound, ever (a metric)

    # -- feeding -------------------------------------------------------------------------
    def apply(self, instance: str, batch: pdserve_pb2.KvEventBatch) -> None:
        """Apply one batch the caller has checked for order (``kv_events_client``): a
        snapshot, or a batch of a new epoch, first forgets everything of ``instance``."""
        state = self._instances.get(instance)
        if batch.snapshot or state is None or state.epoch != batch.instance_epoch:
            self.forget(instance)
            state = self._instances[instance] = _Instance(batch.instance_epoch)
        for event in batch.events:
            bit = TIER_BITS.get(event.tier)
            if bit is None:
                continue  # a tier this router does not know (a newer engine): skip it
            if event.kind == pdserve_pb2.KvBlockEvent.STORED:
                for h in event.block_hashes:
                    self._store(instance, state, bytes(h), bit)
            elif event.kind == pdserve_pb2.KvBlockEvent.REMOVED:
                for h in event.block_hashes:
                    self._remove(instance, state, bytes(h), bit)
            elif event.kind == pdserve_pb2.KvBlockEvent.CLEARED:
                for h in [h for h, mask in state.entries.items() if mask & bit]:
                    self._remove(instance, state, h, bit)

    def _store(self, instance: str, state: _Instance, h: bytes, bit: int) -> None:
        mask = state.entries.pop(h, 0)
        if not mask:
            self._entries += 1
            self._holders.setdefault(h, {})[instance] = 0
        state.entries[h] = mask | bit  # (re)inserted last: the newest entry
        self._holders[h][instance] = mask | bit
        while self._entries > self.max_entries:
            self._drop_oldest()

    def _remove(self, instance: str, state: _Instance, h: bytes, bit: int) -> None:
        mask = state.entries.get(h, 0)
        if not mask & bit:
            return  # not held there in this tier (or dropped for the bound)
        mask &= ~bit
        if mask:
            state.entries[h] = mask
            self._holders[h][instance] = mask
            return
        del state.entries[h]
        self._unhold(instance, h)

    def _unhold(self, instance: str, h: bytes) -> None:
        self._entries -= 1
        holders = self._holders[h]
        del holders[instance]
        if not holders:
            del self._holders[h]

    def _drop_oldest(self) -> None:
        name, state = max(self._instances.items(), key=lambda kv: len(kv[1].entries))
        h, _ = state.entries.popitem(last=False)
        self._unhold(name, h)
        self.dropped += 1

    def forget(self, instance: str) -> None:
        """Drop everything known of ``instance`` (it left, restarted or lost its stream)."""
        state = self._instances.pop(instance, None)
        if state is None:
            return
        for h in state.entries:
            self._unhold(instance, h)

    # -- reading -------------------------------------------------------------------------
    def knows(self, instance: str) -> bool:
        return instance in self._instances

    def match(self, instances: Iterable[str], hashes: Sequence[bytes]) -> dict[str, Match]:
        """Each instance's leading run of ``hashes`` held (any tier), weighted by tier.

        One pass over the prompt for all instances: it stops once every instance missed."""
        out = {url: Match() for url in instances}
        alive = set(out)
        for h in hashes:
            holders: Mapping[str, int] = self._holders.get(h, {})
            for url in list(alive):
                mask = holders.get(url, 0)
                if mask:
                    out[url].add(mask, self.weights)
                else:
                    alive.discard(url)
            if not alive:
                break
        return out

    def holds(self, instance: str, h: bytes) -> int:
        """The tier mask ``instance`` holds ``h`` in (0: not held)."""
        return self._holders.get(h, {}).get(instance, 0)

    def blocks_of(self, instance: str) -> dict[bytes, int]:
        """Every entry of ``instance`` (hash → tier mask); for tests and debugging."""
        state = self._instances.get(instance)
        return dict(state.entries) if state is not None else {}

    @property
    def entries(self) -> int:
        """(hash, instance) pairs held: what ``max_entries`` bounds."""
        return self._entries

    @property
    def blocks(self) -> int:
        """Distinct block hashes held by any instance."""
        return len(self._holders)
