"""Which candidates hold how much of a prompt: the event index where an instance's stream is
live, the guessing index where it is not (docs/design.md §5, "KV events and the global block
index").

The guessing index (``router/routing/prefix_index.py``) records what the router sent where; it is
what routing knows of an instance whose engine does not publish events (an older engine,
``--no-kv-events``, or its stream is down). Its guesses count as device blocks.

Where the stream is live, events lag the routes: a conversation's next turn can arrive
before the engine has reported (or even computed) the blocks of the turn before, and the
event index alone then sends it elsewhere, splitting the conversation's cache over two
instances (one router, colocated: hit rate 0.51 against the guess's 0.63). So the blocks
routed to a live instance within the last ``pending_s`` seconds count as held there too
(as device blocks; ``source`` "routed") when they reach further than its events.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from router.routing.kv_index import KvBlockIndex, Match
from router.routing.prefix_index import PrefixIndex


class PrefixMatcher:
    """Per-instance :class:`Match` of a prompt's block hashes, from the best source known."""

    def __init__(
        self,
        index: KvBlockIndex,
        guess: PrefixIndex,
        live: Callable[[str], bool],
        pending_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if pending_s < 0:
            raise ValueError(f"pending_s must be >= 0, got {pending_s}")
        self.index = index
        self.guess = guess
        self.live = live
        self.pending_s = pending_s
        self.clock = clock

    def matches(self, urls: Sequence[str], hashes: Sequence[bytes]) -> dict[str, Match]:
        live = [url for url in urls if self.live(url)]
        out = self.index.match(live, hashes) if live else {}
        weight = self.index.weights.device
        if self.pending_s > 0:
            since = self.clock() - self.pending_s
            for url in live:
                routed = self.guess.matched_blocks(url, hashes, since)
                held = out[url]
                if routed > held.blocks:
                    extra = routed - held.blocks
                    held.blocks, held.device = routed, held.device + extra
                    held.weighted += extra * weight
                    held.source = "routed"
        for url in urls:
            if url not in out:
                k = self.guess.matched_blocks(url, hashes)
                out[url] = Match(k, device=k, weighted=k * weight, source="guess")
        return out
