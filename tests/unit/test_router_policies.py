"""Routing policies, the prefix index and the auto-mode estimator (pure logic, no network)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from common.block_hash import compute_block_hashes
from router.routing.estimator import AutoEstimator, SideLoad
from router.routing.kv_index import KvBlockIndex
from router.routing.policies import (
    LeastLoadPolicy,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    RouteContext,
    SessionPolicy,
    make_policy,
)
from router.routing.prefix_index import PrefixIndex
from router.routing.prefix_match import PrefixMatcher


def guess_matcher(index: PrefixIndex) -> PrefixMatcher:
    """A matcher with no live event stream: the guessing index alone."""
    return PrefixMatcher(KvBlockIndex(), index, lambda url: False)


@dataclass
class Inst:
    url: str
    waiting: int = 0
    running: int = 0

    def load_score(self) -> float:
        return self.waiting * 4 + self.running


def hashes(tokens: list[int]) -> list[bytes]:
    return compute_block_hashes(tokens, 4)


def test_least_load_scores_waiting_four_times_running() -> None:
    a, b, c = (
        Inst("a", waiting=1, running=0),
        Inst("b", waiting=0, running=3),
        Inst("c", waiting=0, running=5),
    )
    # a: 4, b: 3, c: 5
    assert LeastLoadPolicy().select([a, b, c], RouteContext()).url == "b"
    b.running = 4  # tie a=4, b=4 → lowest url
    assert LeastLoadPolicy().select([c, b, a], RouteContext()).url == "a"


def test_round_robin_cycles_in_url_order() -> None:
    policy = RoundRobinPolicy()
    insts = [Inst("b"), Inst("a"), Inst("c")]
    picks = [policy.select(insts, RouteContext()).url for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_prefix_index_counts_leading_blocks() -> None:
    index = PrefixIndex(blocks_per_instance=100)
    prompt = list(range(20))  # 5 blocks of 4
    index.record("x", hashes(prompt[:12]))  # first 3 blocks
    assert index.matched_blocks("x", hashes(prompt)) == 3
    assert index.matched_blocks("y", hashes(prompt)) == 0
    # Same tokens after a different first block: chained hashes differ → no match.
    other = [99] + prompt[1:]
    assert index.matched_blocks("x", hashes(other)) == 0
    index.forget("x")
    assert index.matched_blocks("x", hashes(prompt)) == 0


def test_prefix_index_evicts_least_recent() -> None:
    index = PrefixIndex(blocks_per_instance=4)
    old, new = list(range(100, 116)), list(range(200, 216))
    index.record("x", hashes(old))
    index.record("x", hashes(new))
    assert index.size("x") == 4
    assert index.matched_blocks("x", hashes(new)) == 4
    assert index.matched_blocks("x", hashes(old)) == 0
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_prefix_aware_prefers_cached_instance_and_falls_back_when_skewed() -> None:
    index = PrefixIndex()
    policy = PrefixAwarePolicy(
        guess_matcher(index), load_weight=1.0, skew_ratio=2.0, skew_slack=4.0
    )
    a, b = Inst("a", running=2), Inst("b", running=0)
    prompt = hashes(list(range(32)))
    ctx = RouteContext(block_hashes=prompt)
    assert policy.select([a, b], ctx).url == "b"  # nothing cached anywhere → least load
    index.record("a", prompt[:6])
    assert policy.select([a, b], ctx).url == "a"  # a holds 6 blocks, load 2 vs 0 is fine
    a.waiting = 3  # score 14 > 0 * 2 + 4 → too skewed
    assert policy.select([a, b], ctx).url == "b"
    index.record("b", prompt[:2])
    a.waiting = 0
    assert policy.select([a, b], ctx).url == "a"  # longer match wins
    assert policy.select([a, b], RouteContext()).url == "b"  # no hashes → least load


def test_prefix_aware_default_keeps_a_conversation_one_request_busier() -> None:
    """The tuned default load weight (benchmarks/README.md "kv_routing"): a conversation's
    next turn stays on the instance holding its last turn (10 blocks) though it runs one
    request more than the other, which holds only the shared system prompt (6 blocks). At
    the old weight of 4 the one request of load cancelled the 4 extra blocks and the turn
    moved, splitting the conversation's cache."""
    index = PrefixIndex()
    policy = PrefixAwarePolicy(guess_matcher(index))
    holder, other = Inst("a", running=2), Inst("b", running=1)
    turn = hashes(list(range(48)))  # 12 blocks of 4
    index.record("a", turn[:10])
    index.record("b", turn[:6])
    ctx = RouteContext(block_hashes=turn)
    assert policy.select([holder, other], ctx).url == "a"
    assert ctx.note is not None and ctx.note.reason == "prefix_guess"
    holder.running = 6  # 5 requests more than the other: the 4 extra blocks no longer pay
    assert policy.select([holder, other], ctx).url == "b"


def test_session_policy_is_sticky_and_moves_few_users() -> None:
    policy = SessionPolicy()
    insts = [Inst(f"10.0.0.{i}:50052") for i in range(4)]
    users = [f"user-{i}" for i in range(400)]
    first = {u: policy.select(insts, RouteContext(user=u)).url for u in users}
    again = {u: policy.select(list(reversed(insts)), RouteContext(user=u)).url for u in users}
    assert first == again
    spread = Counter(first.values())
    assert len(spread) == 4 and min(spread.values()) > 40  # roughly balanced
    # Removing one instance moves only that instance's users.
    removed = insts[0].url
    after = {u: policy.select(insts[1:], RouteContext(user=u)).url for u in users}
    moved = [u for u in users if first[u] != after[u]]
    assert moved and all(first[u] == removed for u in moved)
    # No user → least load.
    insts[2].running = -1
    assert policy.select(insts, RouteContext()).url == insts[2].url


def test_make_policy_names() -> None:
    index = PrefixIndex()
    for name in ("least_load", "round_robin", "prefix_aware", "session"):
        assert make_policy(name, guess_matcher(index)).name == name
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", guess_matcher(index))


def test_estimator_prefers_local_for_idle_decode_and_short_prompt() -> None:
    est = AutoEstimator(prefill_tokens_per_s=1000.0, kv_bytes_per_s=1e6, rpc_overhead_s=0.002)
    idle = SideLoad(waiting=0, running=0, cached_blocks=0)
    e = est.estimate(
        prompt_tokens=32, block_size=16, kv_bytes_per_token=1000, prefill=idle, decode=idle
    )
    # Remote adds RPC overhead and moving 32 KB at 1 MB/s; local does the same compute.
    assert e.decision == "local_prefill"
    assert e.remote_s > e.local_s


def test_estimator_prefers_remote_when_decode_is_busy() -> None:
    est = AutoEstimator(prefill_tokens_per_s=1000.0, kv_bytes_per_s=1e9, interference=0.1)
    busy = SideLoad(waiting=4, running=32, cached_blocks=0)
    idle = SideLoad(waiting=0, running=0, cached_blocks=0)
    e = est.estimate(
        prompt_tokens=512, block_size=16, kv_bytes_per_token=1000, prefill=idle, decode=busy
    )
    assert e.decision == "remote_prefill"


def test_estimator_uses_prefix_hits_and_learned_rates() -> None:
    est = AutoEstimator(prefill_tokens_per_s=1000.0, kv_bytes_per_s=1e9, interference=0.1)
    prefill_cached = SideLoad(waiting=0, running=0, cached_blocks=32)  # all 512 tokens cached there
    decode = SideLoad(waiting=0, running=8, cached_blocks=0)
    e = est.estimate(
        prompt_tokens=512,
        block_size=16,
        kv_bytes_per_token=100,
        prefill=prefill_cached,
        decode=decode,
    )
    assert e.decision == "remote_prefill"
    # If decode already holds the prompt, local costs nothing to compute.
    decode_cached = SideLoad(waiting=0, running=8, cached_blocks=32)
    assert (
        est.estimate(
            prompt_tokens=512,
            block_size=16,
            kv_bytes_per_token=100,
            prefill=prefill_cached,
            decode=decode_cached,
        ).decision
        == "local_prefill"
    )
    # No prefill instance → local, always.
    assert (
        est.estimate(
            prompt_tokens=512, block_size=16, kv_bytes_per_token=100, prefill=None, decode=decode
        ).decision
        == "local_prefill"
    )
    # Learning: a very slow measured link makes the transfer dominate.
    for _ in range(100):
        est.observe_transfer(1000, 1.0)  # 1 KB/s
    assert est.kv_bandwidth.value < 2000
    assert (
        est.estimate(
            prompt_tokens=512,
            block_size=16,
            kv_bytes_per_token=100,
            prefill=prefill_cached,
            decode=decode,
        ).decision
        == "local_prefill"
    )
    before = est.prefill_rate.value
    est.observe_prefill(5000, 1.0)
    assert est.prefill_rate.value > before
    est.observe_prefill(0, 1.0)  # ignored: nothing computed
    est.observe_transfer(100, 0.0)  # ignored: no duration
