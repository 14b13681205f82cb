"""What happened to the prefix cache's blocks during one engine step, in order
(docs/design.md §3 "KV events").

The block pool and the host tier record into one ``KvEventLog`` as they register, evict
and clear hashes; the publisher (``engine/kv/events.py``) drains it once per step and
hands the batch to its subscribers. Recording is a list append (runs of blocks coalesce
into one event as they come), so the step loop pays nothing per block beyond that. The
kinds and tiers are the numbers of the gRPC contract's ``KvBlockEvent.Kind`` and
``KvTier``; the engine imports no protobuf, the service converts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# KvBlockEvent.Kind
STORED = 0
REMOVED = 1
CLEARED = 2
# KvTier
TIER_DEVICE = 0
TIER_HOST = 1
TIER_STORE = 2


@dataclass(slots=True)
class KvEvent:
    """``STORED``: ``block_hashes`` (a chain, each the parent of the next) are now held in
    ``tier``; ``parent_hash`` precedes the first (b"" when it starts a prompt).
    ``REMOVED``: they are no longer held there. ``CLEARED``: nothing is held there."""

    kind: int
    tier: int
    block_hashes: list[bytes] = field(default_factory=list)
    parent_hash: bytes = b""


class KvEventLog:
    """The events recorded since the last ``drain``. Owned by the engine thread: the pool
    and host tier append, the publisher drains, all between steps.

    Order is kept within each tier; across tiers it carries no meaning (each tier's set of
    hashes is its own state), which lets a block that moves from the device to the host
    extend the host's open STORED run and the device's open REMOVED run instead of
    alternating one-block events."""

    __slots__ = ("_events", "_open", "_run_end")

    def __init__(self) -> None:
        self._events: list[KvEvent] = []
        self._open: dict[int, KvEvent] = {}  # tier -> its newest event
        # tier -> the hash that ends its open STORED run: a block whose parent it is
        # extends the run (a request's blocks register in chain order).
        self._run_end: dict[int, bytes] = {}

    def stored(self, tier: int, block_hash: bytes, parent_hash: bytes) -> None:
        last = self._open.get(tier)
        if last is not None and last.kind == STORED and parent_hash:
            if parent_hash == self._run_end.get(tier):
                last.block_hashes.append(block_hash)
                self._run_end[tier] = block_hash
                return
            if block_hash == last.parent_hash:
                # The pool evicts a request's blocks deepest first: grow the run forward.
                last.block_hashes.insert(0, block_hash)
                last.parent_hash = parent_hash
                return
        self._add(KvEvent(STORED, tier, [block_hash], parent_hash))
        self._run_end[tier] = block_hash

    def removed(self, tier: int, block_hash: bytes) -> None:
        last = self._open.get(tier)
        if last is not None and last.kind == REMOVED:
            last.block_hashes.append(block_hash)
        else:
            self._add(KvEvent(REMOVED, tier, [block_hash]))

    def cleared(self, tier: int) -> None:
        # Earlier events of the tier are moot, but they stay: a subscriber applies them in
        # order and ends with the same (empty) state either way.
        self._add(KvEvent(CLEARED, tier))

    def _add(self, event: KvEvent) -> None:
        self._events.append(event)
        self._open[event.tier] = event

    def __bool__(self) -> bool:
        return bool(self._events)

    def extend(self, events: list[KvEvent]) -> None:
        """Events drained from another process's log (engine/kv/event_relay.py), after
        these; none of them is extended by a later local event."""
        self._events.extend(events)
        self._open.clear()
        self._run_end.clear()

    def drain(self) -> list[KvEvent]:
        events, self._events = self._events, []
        self._open.clear()
        self._run_end.clear()
        return events


def chains(parents: dict[bytes, bytes], tier: int) -> list[KvEvent]:
    """``STORED`` events that describe every ``hash -> parent`` of ``parents`` (a
    snapshot): each event is a run of blocks that follow one another, so the chains of a
    cache with shared prefixes cost about one event per branch, not one per block."""
    children: dict[bytes, list[bytes]] = {}
    roots: list[bytes] = []
    for block_hash, parent in parents.items():
        if parent and parent in parents:
            children.setdefault(parent, []).append(block_hash)
        else:
            roots.append(block_hash)
    events: list[KvEvent] = []
    stack = [(root, parents[root]) for root in reversed(roots)]
    while stack:
        block_hash, parent = stack.pop()
        run = [block_hash]
        while True:
            kids = children.get(run[-1])
            if not kids:
                break
            # The first child continues the run; the others start runs of their own.
            stack.extend((kid, run[-1]) for kid in kids[1:])
            run.append(kids[0])
        events.append(KvEvent(STORED, tier, run, parent))
    return events
