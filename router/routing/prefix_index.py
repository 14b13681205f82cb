"""Which instance recently served which prompt blocks (for prefix-aware routing and auto mode).

Block hashes are chained (hash k commits to every token before it), so "instance X holds the
first k blocks of this prompt" is "X's set contains hash k-1". Each instance keeps a bounded
LRU of the hashes routed to it, approximating what its prefix cache still holds, with the
time of each block's last route: where an instance's KV events are live, routes younger
than the pending window stand for blocks being computed that no event has reported yet
(``router/routing/prefix_match.py``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    """Per-instance LRU sets of block hashes with the time each was last routed; not
    thread-safe (used from the event loop)."""

    def __init__(self, blocks_per_instance: int = 16384) -> None:
        if blocks_per_instance < 1:
            raise ValueError(f"blocks_per_instance must be >= 1, got {blocks_per_instance}")
        self._capacity = blocks_per_instance
        self._sets: dict[str, OrderedDict[bytes, float]] = {}

    def record(self, instance: str, hashes: Sequence[bytes], now: float | None = None) -> None:
        """Note that ``instance`` now holds these blocks (most recent use, at ``now``)."""
        at = time.monotonic() if now is None else now
        entries = self._sets.setdefault(instance, OrderedDict())
        for h in hashes:
            entries[h] = at
            entries.move_to_end(h)
        while len(entries) > self._capacity:
            entries.popitem(last=False)

    def matched_blocks(
        self, instance: str, hashes: Sequence[bytes], since: float | None = None
    ) -> int:
        """How many leading blocks of ``hashes`` the instance is believed to hold (routed
        there at ``since`` or later, when given)."""
        entries = self._sets.get(instance)
        if not entries:
            return 0
        # Chained hashes: the longest held prefix ends at the last hash present (a route
        # stamps every block of its prompt, so the blocks before it are as recent). Scan
        # from the end so a long match costs one lookup.
        for k in range(len(hashes), 0, -1):
            at = entries.get(hashes[k - 1])
            if at is not None and (since is None or at >= since):
                return k
        return 0

    def matches(self, instances: Iterable[str], hashes: Sequence[bytes]) -> dict[str, int]:
        return {url: self.matched_blocks(url, hashes) for url in instances}

    def forget(self, instance: str) -> None:
        self._sets.pop(instance, None)

    def size(self, instance: str) -> int:
        return len(self._sets.get(instance, ()))
