"""The router's global block index (router/routing/kv_index.py) fed with KvEventBatch messages:
snapshots, stores and removals per tier, epochs, the leading-run match, the memory bound."""

from __future__ import annotations

import pytest

from common.block_hash import compute_block_hashes
from pdserve_api.v1 import pdserve_pb2
from router.routing.kv_index import DEVICE, HOST, STORE, KvBlockIndex, TierWeights
from router.routing.policies import PrefixAwarePolicy, RouteContext
from router.routing.prefix_index import PrefixIndex
from router.routing.prefix_match import PrefixMatcher

Ev = pdserve_pb2.KvBlockEvent


def hashes(tokens: list[int]) -> list[bytes]:
    return compute_block_hashes(tokens, 4)


PROMPT = hashes(list(range(40)))  # 10 blocks


def stored(hs: list[bytes], tier: int = pdserve_pb2.KV_TIER_DEVICE) -> pdserve_pb2.KvBlockEvent:
    return Ev(kind=Ev.STORED, tier=tier, block_hashes=hs)


def removed(hs: list[bytes], tier: int = pdserve_pb2.KV_TIER_DEVICE) -> pdserve_pb2.KvBlockEvent:
    return Ev(kind=Ev.REMOVED, tier=tier, block_hashes=hs)


def batch(
    seq: int, *events: pdserve_pb2.KvBlockEvent, snapshot: bool = False, epoch: str = "e1"
) -> pdserve_pb2.KvEventBatch:
    return pdserve_pb2.KvEventBatch(
        instance_epoch=epoch, seq=seq, snapshot=snapshot, events=list(events)
    )


def test_stores_removals_and_the_leading_run() -> None:
    index = KvBlockIndex()
    index.apply("a", batch(0, stored(PROMPT[:6]), snapshot=True))
    index.apply("b", batch(0, stored(PROMPT[:3]), snapshot=True))
    m = index.match(["a", "b", "c"], PROMPT)
    assert (m["a"].blocks, m["b"].blocks, m["c"].blocks) == (6, 3, 0)
    # A removed block in the middle ends the run there, as the engine's lookup stops.
    index.apply("a", batch(1, removed([PROMPT[2]])))
    assert index.match(["a"], PROMPT)["a"].blocks == 2
    assert index.entries == 5 + 3 and index.blocks == 6  # block 2 is still b's
    # Removing what is not held (or from another tier) changes nothing.
    index.apply("b", batch(1, removed([PROMPT[7]]), removed(PROMPT[:3], pdserve_pb2.KV_TIER_HOST)))
    assert index.match(["b"], PROMPT)["b"].blocks == 3


def test_tiers_weigh_the_run_and_clear_is_per_tier() -> None:
    weights = TierWeights(device=1.0, host=0.5, store=0.25)
    index = KvBlockIndex(weights=weights)
    index.apply(
        "a",
        batch(
            0,
            stored(PROMPT[:2]),
            stored(PROMPT[2:4], pdserve_pb2.KV_TIER_HOST),
            stored(PROMPT[:6], pdserve_pb2.KV_TIER_STORE),
            snapshot=True,
        ),
    )
    m = index.match(["a"], PROMPT)["a"]
    assert (m.blocks, m.device, m.host, m.store) == (6, 2, 2, 2)
    assert m.weighted == pytest.approx(2 * 1.0 + 2 * 0.5 + 2 * 0.25)
    assert m.fast_blocks == 4
    assert index.holds("a", PROMPT[0]) == DEVICE | STORE
    assert index.holds("a", PROMPT[3]) == HOST | STORE
    # Evicted from the device to the host tier: removed there, stored here.
    index.apply("a", batch(1, removed(PROMPT[:2]), stored(PROMPT[:2], pdserve_pb2.KV_TIER_HOST)))
    assert index.holds("a", PROMPT[0]) == HOST | STORE
    # The device cache reset: CLEARED drops that tier only.
    index.apply("a", batch(2, stored(PROMPT[6:8])))
    index.apply("a", batch(3, Ev(kind=Ev.CLEARED, tier=pdserve_pb2.KV_TIER_DEVICE)))
    assert index.holds("a", PROMPT[6]) == 0
    assert index.match(["a"], PROMPT)["a"].blocks == 6
    index.apply("a", batch(4, Ev(kind=Ev.CLEARED, tier=pdserve_pb2.KV_TIER_STORE)))
    assert index.match(["a"], PROMPT)["a"].blocks == 4
    assert index.entries == 4


def test_snapshot_and_new_epoch_replace_an_instance() -> None:
    index = KvBlockIndex()
    index.apply("a", batch(0, stored(PROMPT[:5]), snapshot=True))
    index.apply("a", batch(0, stored(PROMPT[:2]), snapshot=True))  # resubscribed
    assert index.match(["a"], PROMPT)["a"].blocks == 2 and index.entries == 2
    index.apply("a", batch(0, stored(PROMPT[5:7]), epoch="e2"))  # restarted
    assert index.match(["a"], PROMPT)["a"].blocks == 0
    assert set(index.blocks_of("a")) == set(PROMPT[5:7])
    index.forget("a")
    assert index.entries == 0 and index.blocks == 0 and not index.knows("a")


def test_memory_bound_drops_the_fullest_instances_oldest_entries() -> None:
    index = KvBlockIndex(max_entries=6)
    index.apply("a", batch(0, stored(PROMPT[:4]), snapshot=True))
    index.apply("b", batch(0, stored(PROMPT[:2]), snapshot=True))
    index.apply("a", batch(1, stored(PROMPT[4:6])))  # 8 entries: a (6) loses its 2 oldest
    assert index.entries == 6 and index.dropped == 2
    assert set(index.blocks_of("a")) == set(PROMPT[2:6])
    assert index.match(["a", "b"], PROMPT)["b"].blocks == 2
    # Re-storing a block makes it the newest: it survives the next drop.
    index.apply("a", batch(2, stored([PROMPT[2]]), stored(PROMPT[6:7])))
    assert PROMPT[2] in index.blocks_of("a") and PROMPT[3] not in index.blocks_of("a")
    with pytest.raises(ValueError):
        KvBlockIndex(max_entries=0)


def test_two_indexes_fed_the_same_streams_are_identical() -> None:
    streams = {
        "a": [
            batch(0, stored(PROMPT[:3]), snapshot=True),
            batch(1, stored(PROMPT[3:8]), removed(PROMPT[1:2])),
            batch(2, removed(PROMPT[5:8]), stored(PROMPT[5:8], pdserve_pb2.KV_TIER_HOST)),
        ],
        "b": [batch(0, snapshot=True), batch(1, stored(PROMPT[:9]))],
    }
    one, two = KvBlockIndex(max_entries=12), KvBlockIndex(max_entries=12)
    for url, batches in streams.items():
        for b in batches:
            one.apply(url, b)
    # The other router receives the two streams interleaved: per-instance order is all
    # that the streams promise, and all the index depends on.
    a, b = streams["a"], streams["b"]
    for url, item in [("a", a[0]), ("b", b[0]), ("a", a[1]), ("b", b[1]), ("a", a[2])]:
        two.apply(url, item)
    for url in streams:
        assert one.blocks_of(url) == two.blocks_of(url)
    assert one.match(["a", "b"], PROMPT) == two.match(["a", "b"], PROMPT)


class _Inst:
    def __init__(self, url: str, load: float = 0.0) -> None:
        self.url, self.load = url, load

    def load_score(self) -> float:
        return self.load


def test_prefix_aware_scores_held_blocks_by_tier_against_load() -> None:
    index, guess = KvBlockIndex(weights=TierWeights(1.0, 0.5, 0.25)), PrefixIndex()
    live = {"a", "b"}
    policy = PrefixAwarePolicy(PrefixMatcher(index, guess, live.__contains__), load_weight=1.0)
    a, b, c = _Inst("a"), _Inst("b"), _Inst("c")
    index.apply("a", batch(0, stored(PROMPT[:8], pdserve_pb2.KV_TIER_HOST), snapshot=True))
    index.apply("b", batch(0, stored(PROMPT[:6]), snapshot=True))
    ctx = RouteContext(block_hashes=PROMPT)
    # b: 6 device blocks = 6.0 beats a: 8 host blocks = 4.0.
    assert policy.select([a, b, c], ctx).url == "b"
    assert ctx.note is not None and ctx.note.reason == "prefix_events"
    assert ctx.note.match is not None and ctx.note.match.blocks == 6
    b.load = 3.0  # 6 - 3 = 3 < 4
    assert policy.select([a, b, c], ctx).url == "a"
    # c has no stream: the guessing index speaks for it (its guesses count as device).
    guess.record("c", PROMPT)
    assert policy.select([a, b, c], ctx).url == "c"
    assert ctx.note.reason == "prefix_guess"
    # A live instance's recent routes count where they reach past its events.
    guess.record("a", PROMPT)
    guess.forget("c")
    assert policy.select([a, b, c], ctx).url == "a"
    assert ctx.note.match is not None and ctx.note.match.source == "routed"


def test_recent_routes_stand_in_for_events_not_yet_reported() -> None:
    """A conversation's next turn arrives before its instance reported the last turn's
    blocks: the route counts (as device blocks) within the pending window, then only the
    events do; events that reach further win."""
    now = [100.0]
    index, guess = KvBlockIndex(), PrefixIndex()
    matcher = PrefixMatcher(index, guess, {"a", "b"}.__contains__, 10.0, lambda: now[0])
    index.apply("a", batch(0, snapshot=True))
    index.apply("b", batch(0, stored(PROMPT[:3]), snapshot=True))
    guess.record("a", PROMPT[:6], now=95.0)
    m = matcher.matches(["a", "b"], PROMPT)
    assert (m["a"].blocks, m["a"].device, m["a"].source) == (6, 6, "routed")
    assert (m["b"].blocks, m["b"].source) == (3, "events")
    now[0] = 106.0  # the route is older than the window: the events speak alone
    assert matcher.matches(["a"], PROMPT)["a"].blocks == 0
    guess.record("b", PROMPT[:2], now=105.0)  # shorter than b's events: nothing changes
    assert matcher.matches(["b"], PROMPT)["b"].source == "events"
    off = PrefixMatcher(index, guess, {"a"}.__contains__, 0.0, lambda: now[0])
    guess.record("a", PROMPT, now=106.0)
    assert off.matches(["a"], PROMPT)["a"].blocks == 0  # window 0: events only
    with pytest.raises(ValueError):
        PrefixMatcher(index, guess, {"a"}.__contains__, -1.0)
