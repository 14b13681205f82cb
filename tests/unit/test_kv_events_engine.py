"""KV events and the host KV tier inside the engine (docs/design.md §3 "KV events",
"Host KV tier"): the event log, snapshots, the publisher's numbering and bounds, and an
engine on the tiny model whose events, replayed strictly, always equal its snapshot."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from common.block_hash import compute_block_hashes
from engine.config import EngineConfig
from engine.core.kv_events import (
    CLEARED,
    REMOVED,
    STORED,
    TIER_DEVICE,
    TIER_HOST,
    KvEventLog,
    chains,
)
from engine.core.sampling_params import SamplingParams
from engine.kv.events import (
    KvEventBatch,
    KvEventPublisher,
    PublisherClosed,
    SubscriberBehind,
    snapshot_held,
)
from engine.kv.host_tier import HostKvTier
from engine.llm_engine import LLMEngine
from service.kv_events_rpc import to_proto
from tests.kv_events_support import Replica

BS = 4


# -- the log and snapshots -----------------------------------------------------------------


def test_log_coalesces_runs_per_tier_and_keeps_order_within_a_tier() -> None:
    log = KvEventLog()
    log.stored(TIER_DEVICE, b"a", b"")
    log.stored(TIER_DEVICE, b"b", b"a")
    log.stored(TIER_HOST, b"y", b"x")  # another tier in between does not break the run
    log.stored(TIER_DEVICE, b"c", b"b")
    log.stored(TIER_HOST, b"x", b"w")  # evicted deepest first: the run grows forward
    log.removed(TIER_DEVICE, b"c")
    log.removed(TIER_DEVICE, b"b")
    log.stored(TIER_DEVICE, b"q", b"")  # unrelated: a new event
    log.cleared(TIER_HOST)
    events = [(e.kind, e.tier, e.block_hashes, e.parent_hash) for e in log.drain()]
    assert events == [
        (STORED, TIER_DEVICE, [b"a", b"b", b"c"], b""),
        (STORED, TIER_HOST, [b"x", b"y"], b"w"),
        (REMOVED, TIER_DEVICE, [b"c", b"b"], b""),
        (STORED, TIER_DEVICE, [b"q"], b""),
        (CLEARED, TIER_HOST, [], b""),
    ]
    assert not log and log.drain() == []


def test_chains_describe_a_branching_cache_in_few_events() -> None:
    parents = {b"r": b"", b"a": b"r", b"b": b"a", b"c": b"a", b"d": b"c", b"z": b"gone"}
    events = chains(parents, TIER_HOST)
    rebuilt: dict[bytes, bytes] = {}
    for event in events:
        assert event.kind == STORED and event.tier == TIER_HOST
        parent = event.parent_hash
        for h in event.block_hashes:
            rebuilt[h] = parent
            parent = h
    assert rebuilt == parents
    assert len(events) == 3  # r-a-b, c-d, z


# -- the publisher -------------------------------------------------------------------------


async def test_publisher_numbers_batches_snapshots_cuts_off_and_closes() -> None:
    log = KvEventLog()
    state: dict[bytes, bytes] = {}
    publisher = KvEventPublisher(log, lambda: [(TIER_DEVICE, dict(state))], max_queue=2)
    loop = asyncio.get_running_loop()
    log.stored(TIER_DEVICE, b"a", b"")
    state[b"a"] = b""
    publisher.pump()  # seq 1, nobody listening
    sub = publisher.subscribe(loop)
    publisher.pump()
    first = (await sub.next(5)).expand()
    assert first.snapshot and first.seq == 1
    assert [e.block_hashes for e in first.events] == [[b"a"]]
    for i in range(2):
        log.removed(TIER_DEVICE, b"a" if i == 0 else b"b")
        publisher.pump()
    assert [(await sub.next(5)).seq for _ in range(2)] == [2, 3]
    slow = publisher.subscribe(loop)
    publisher.pump()
    for _ in range(3):  # its snapshot + 2 batches fill it; the third cuts it off
        log.stored(TIER_DEVICE, b"c", b"")
        publisher.pump()
        await sub.next(5)
    with pytest.raises(SubscriberBehind):
        await slow.next(5)
    assert publisher.stats.cut_off == 1 and publisher.stats.subscribers == 1
    assert publisher.stats.batches == 6
    publisher.close()
    with pytest.raises(PublisherClosed):
        await sub.next(5)
    with pytest.raises(PublisherClosed):
        await publisher.subscribe(loop).next(5)


# -- an engine on the tiny model -------------------------------------------------------------


def _engine(
    model: Path, blocks: int, host_blocks: int = 0, events: bool = True, kv_dtype: str = "auto"
) -> LLMEngine:
    # tiny model: 2 layers x K,V x 4 tokens x 2 KV heads x 16 x fp32 = 2 KiB per block
    return LLMEngine(
        EngineConfig(
            model=str(model),
            kv_cache_dtype=kv_dtype,
            block_size=BS,
            num_kv_blocks=blocks,
            kv_events=events,
            kv_offloading_size=host_blocks * 2048,
            max_num_seqs=4,
        )
    )


def _run(
    engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int = 4
) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return out
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    raise AssertionError("requests did not finish")


def _prompt(seed: int, n: int) -> list[int]:
    return [500 + (seed * 131 + i * 17) % 9000 for i in range(n)]


class _Tracker:
    """Replays an engine's events (drained like the publisher does) into a strict
    ``Replica`` and compares it with the engine's own snapshot."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.seq, self.replica = engine, 0, Replica()
        self.replica.apply(to_proto(self._snapshot(0)))

    def _snapshot(self, seq: int) -> KvEventBatch:
        host = self.engine.host_tier
        held = snapshot_held(self.engine.kv, host.parents() if host else None)
        return KvEventBatch("e", seq, True, held=held).expand()

    def sync(self) -> Replica:
        assert self.engine.kv_events is not None
        if self.engine.kv_events:
            self.seq += 1
            self.replica.apply(
                to_proto(KvEventBatch("e", self.seq, False, self.engine.kv_events.drain()))
            )
        fresh = Replica()
        fresh.apply(to_proto(self._snapshot(self.seq)))
        assert fresh.tiers.get(TIER_DEVICE, {}) == self.replica.tiers.get(TIER_DEVICE, {})
        assert fresh.tiers.get(TIER_HOST, {}) == self.replica.tiers.get(TIER_HOST, {})
        return self.replica


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_host_tier_serves_an_evicted_prompt_with_the_cold_text(
    tiny_model_dir: Path, kv_dtype: str
) -> None:
    engine = _engine(tiny_model_dir, blocks=12, host_blocks=64, kv_dtype=kv_dtype)
    tracker = _Tracker(engine)
    a = _prompt(1, 30)  # 7 full blocks; the pool has 11
    cold = _run(engine, {"a": a})["a"]
    tracker.sync()
    _run(engine, {"b": _prompt(2, 30)})  # takes the blocks a left behind
    replica = tracker.sync()
    assert engine.host_tier is not None and engine.host_tier.stats.offloaded >= 6
    assert set(replica.removed[TIER_DEVICE]) <= set(replica.held(TIER_HOST))
    hits_before = engine.kv.pool.prefix_hits
    warm = _run(engine, {"a2": a})["a2"]
    # Every block a lookup may reuse (7: one token is always computed) was found: the
    # head still on the device, the 5 that b pushed out copied back from the host.
    assert engine.kv.pool.prefix_hits - hits_before == 7
    assert engine.host_tier.stats.hits == 5
    assert warm == cold
    tracker.sync()
    reference = _run(_engine(tiny_model_dir, 12, events=False, kv_dtype=kv_dtype), {"a": a})["a"]
    assert warm == reference


def test_host_tier_is_bounded_and_drops_its_oldest(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, blocks=12, host_blocks=4)
    tracker = _Tracker(engine)
    chains_of = []
    for seed in range(5):
        prompt = _prompt(10 + seed, 30)
        out = _run(engine, {f"r{seed}": prompt})[f"r{seed}"]
        chains_of.append(set(compute_block_hashes(prompt + out, BS)))
        replica = tracker.sync()
    assert engine.host_tier is not None
    assert engine.host_tier.stats.capacity_blocks == 4
    held = set(replica.held(TIER_HOST))
    assert len(held) == engine.host_tier.stats.blocks == 4
    dropped = replica.removed[TIER_HOST]
    assert len(dropped) == engine.host_tier.stats.evicted > 0
    # Each run pushes the previous one's blocks out of the device (8 > 4): the tier keeps
    # the newest (the run before last), and every older block it took in was dropped.
    assert held <= chains_of[3]
    older = set().union(*chains_of[:3]) & set(replica.stored[TIER_HOST])
    assert older and older <= set(dropped)


def test_preemption_and_reset_keep_the_replica_exact(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, blocks=16, host_blocks=8)
    tracker = _Tracker(engine)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"p{i}", _prompt(20 + i, 18), params)
    preempted = 0
    while engine.has_unfinished():
        engine.step()
        preempted = max(
            preempted, sum(r.num_preemptions for r in engine.scheduler.requests.values())
        )
        tracker.sync()
    assert preempted > 0, "the pool was meant to force preemption"
    replica = tracker.sync()
    assert replica.held(TIER_DEVICE) and replica.held(TIER_HOST)
    engine.reset_prefix_cache()
    events = engine.kv_events.drain() if engine.kv_events is not None else []
    assert [(e.kind, e.tier) for e in events] == [(CLEARED, TIER_DEVICE), (CLEARED, TIER_HOST)]
    assert not engine.kv.pool.cached and engine.host_tier is not None
    assert engine.host_tier.stats.blocks == 0


def test_host_tier_settings_are_checked(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="parallel_size 1 only"):
        EngineConfig(model=str(tiny_model_dir), kv_offloading_size=1 << 20, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="parallel_size 1 only"):
        EngineConfig(
            model=str(tiny_model_dir), kv_offloading_size=1 << 20, pipeline_parallel_size=2
        )
    with pytest.raises(ValueError, match="prefix cache"):
        EngineConfig(
            model=str(tiny_model_dir), kv_offloading_size=1 << 20, enable_prefix_caching=False
        )
    kv_cache = _engine(tiny_model_dir, blocks=8).runner.kv_cache
    with pytest.raises(ValueError, match="holds no KV block"):
        HostKvTier(kv_cache, 100)


def test_lookup_mixing_tiers_never_takes_more_blocks_than_are_free() -> None:
    """Blocks 0 and 2 of a prompt are in the host tier, 1, 3 and 4 idle on the device,
    and those 3 are all the pool has free: holding the device hits leaves no block for
    the copies, so the lookup gives back the tail (3, 4) to make room for them; the
    copies bring back the bytes that were offloaded."""
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.request import Request

    cache = torch.zeros((1, 2, 7, BS, 1, 4))  # a real (tiny) paged cache of 7 blocks
    kv = KVCacheManager(7, BS, enable_caching=True)  # 6 usable blocks
    tier = HostKvTier(cache, 1 << 20)
    kv.attach_lower_tier(tier)
    request = Request("q", list(range(100, 100 + 6 * BS + 1)), SamplingParams(max_tokens=1))
    request.update_block_hashes(BS)
    h = request.block_hashes
    for i in (0, 2):  # block 6 held bytes i + 1 under h[i], then went to the host
        cache[:, :, 6] = i + 1.0
        tier.offload(6, h[i], h[i - 1] if i else b"")
    blocks = kv.pool.take(6)  # 3 stay held by "another request"
    for i, block in zip((1, 3, 4), blocks[:3], strict=True):
        kv.pool.register(block, h[i], h[i - 1])
    kv.pool.release(blocks[:3])
    assert kv.pool.num_free_blocks == 3
    hits, tokens_hit = kv.get_computed_blocks(request)
    assert [b.block_hash for b in hits] == h[:3]
    assert tokens_hit == 3 * BS and tier.stats.hits == 2
    assert (cache[:, :, hits[0].block_id] == 1.0).all()
    assert (cache[:, :, hits[2].block_id] == 3.0).all()
    assert h[3] in tier and h[4] in tier  # evicted to make room: offloaded on the way
    assert all(b.ref_cnt == 0 for b in hits) and kv.pool.num_free_blocks == 3
