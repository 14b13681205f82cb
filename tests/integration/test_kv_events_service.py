"""``SubscribeKvEvents`` against real service processes (docs/design.md §3 "KV events").

One decode service on the tiny model with a small KV pool (31 blocks of 16 tokens) and a
small host tier (16 blocks), so eviction, preemption and the host tier's LRU all happen
within a few requests. A ``Replica`` applies every batch strictly (seq without gaps,
STORED only of absent hashes, REMOVED only of held ones) and must end equal to a fresh
snapshot; the hashes must be those the router computes (``common.block_hash``).
"""

from __future__ import annotations

import concurrent.futures
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.block_hash import compute_block_hashes
from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc
from tests.kv_events_support import DEVICE, HOST, SLOW_LINK, Replica, Subscriber, snapshot
from tests.service_fixtures import ServiceProcess, start_service

TOKEN = "kv-events-test-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
BLOCK = 16
# 256 KiB of 8 KiB blocks (tiny model: 2 layers x K,V x 16 tokens x 2 heads x 16 x fp32)
# = 31 usable; the host tier holds 64 such blocks.
ENGINE_ARGS = (
    "--kv-cache-memory", "256Ki", "--kv-offloading-size", "512Ki",
    "--kv-events-max-queue", "4", "--grpc-token", TOKEN,
)  # fmt: skip


@pytest.fixture(scope="module")
def services(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[dict[str, ServiceProcess]]:
    """The decode service the tests watch, and a prefill service with events off (started
    together: a start is mostly imports and the model load, which overlap)."""
    log_dir = tmp_path_factory.mktemp("kv-events-logs")
    starts = {
        "decode": lambda: start_service("decode", tiny_model_dir, log_dir, extra_args=ENGINE_ARGS),
        "prefill_off": lambda: start_service(
            "prefill",
            tiny_model_dir,
            log_dir,
            connector_args=("--connector", "fs", "--kv-path", str(log_dir / "kv")),
            extra_args=("--no-kv-events",),
        ),
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(start) for name, start in starts.items()}
        started = {}
        try:
            for name, future in futures.items():
                started[name] = future.result()
            yield started
        finally:
            for svc in started.values():
                svc.stop()


@pytest.fixture(scope="module")
def decode(services: dict[str, ServiceProcess]) -> ServiceProcess:
    return services["decode"]


def _prompt(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 31) % 20000 for i in range(n)]


def _generate(svc: ServiceProcess, prompt: list[int], max_tokens: int = 4) -> list[int]:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(svc.address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        request = pb.DecodeRequest(prompt_token_ids=prompt, params=params)
        return [
            t for chunk in stub.Decode(request, timeout=60, metadata=AUTH) for t in chunk.token_ids
        ]


def _metric(svc: ServiceProcess, name: str) -> float:
    text = urllib.request.urlopen(svc.metrics_url, timeout=10).read().decode()
    found = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_snapshot_then_live_batches_match_router_hashes(decode: ServiceProcess) -> None:
    sub = Subscriber(decode.address, AUTH).start()
    try:
        replica = Replica()
        first = sub.next()
        assert first.snapshot and first.instance_epoch
        replica.apply(first)
        prompt = _prompt(1, 100)
        _generate(decode, prompt)
        sub.drain_into(replica)
        assert replica.seq > first.seq
        # The router's hashes of the prompt's full blocks are all held, chained in order.
        hashes = compute_block_hashes(prompt, BLOCK)
        held = replica.held(DEVICE)
        assert all(h in held for h in hashes)
        assert [held[h] for h in hashes] == [b"", *hashes[:-1]]
        # A fresh subscriber's snapshot is what the live stream built.
        fresh = snapshot(decode.address, AUTH)
        again = Replica()
        again.apply(fresh)
        assert fresh.instance_epoch == first.instance_epoch and fresh.seq == replica.seq
        assert again.held(DEVICE) == held and again.held(HOST) == replica.held(HOST)
        assert _metric(decode, "pdserve_kv_events_subscribers") >= 1
        assert _metric(decode, "pdserve_kv_events_batches_total") >= replica.seq
        assert _metric(decode, "pdserve_kv_events_published_total") > 0
    finally:
        sub.close()


def test_eviction_preemption_and_host_tier_keep_the_replica_exact(decode: ServiceProcess) -> None:
    """Concurrent long requests overflow the 31-block pool (preemption), later prompts
    evict earlier ones to the host tier, and its 64 blocks overflow too (LRU)."""
    sub = Subscriber(decode.address, AUTH).start()
    try:
        replica = Replica()
        replica.apply(sub.next())
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda s: _generate(decode, _prompt(s, 150), 60), (11, 12, 13)))
        for seed in range(14, 28):
            _generate(decode, _prompt(seed, 120))
        sub.drain_into(replica)
        assert replica.removed.get(DEVICE), "no device eviction was published"
        assert replica.removed.get(HOST), "the host tier never dropped a block (LRU)"
        fresh = Replica()
        fresh.apply(snapshot(decode.address, AUTH))
        assert fresh.seq == replica.seq
        assert fresh.held(DEVICE) == replica.held(DEVICE)
        assert fresh.held(HOST) == replica.held(HOST)
        assert len(replica.held(HOST)) <= 64
    finally:
        sub.close()


def test_host_tier_serves_a_prompt_the_device_evicted(decode: ServiceProcess) -> None:
    first = _prompt(40, 100)  # 6 full blocks
    cold = _generate(decode, first, max_tokens=8)
    for seed in (41, 42, 43):  # 45 blocks of other prompts: more than the pool, less than the host
        _generate(decode, _prompt(seed, 240), max_tokens=2)
    fresh = Replica()
    fresh.apply(snapshot(decode.address, AUTH))
    hashes = compute_block_hashes(first, BLOCK)
    assert not set(hashes) & set(fresh.held(DEVICE)), "the first prompt is still on the device"
    assert set(hashes) <= set(fresh.held(HOST))
    hits_before = _metric(decode, "pdserve_kv_host_hits_total")
    assert _generate(decode, first, max_tokens=8) == cold
    assert _metric(decode, "pdserve_kv_host_hits_total") - hits_before == len(hashes)


def test_slow_subscriber_is_cut_off_and_resyncs(decode: ServiceProcess) -> None:
    slow = Subscriber(decode.address, AUTH, options=SLOW_LINK)  # reads nothing until started
    try:
        cut_before = _metric(decode, "pdserve_kv_events_subscribers_cut_off_total")
        for seed in range(30, 90):
            _generate(decode, _prompt(seed, 200), max_tokens=2)
            if _metric(decode, "pdserve_kv_events_subscribers_cut_off_total") > cut_before:
                break
        else:
            pytest.fail("a subscriber that read nothing was never cut off")
        slow.start()
        assert slow.done.wait(30), "the cut-off stream did not end"
        assert slow.error is not None and slow.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "resubscribe" in (slow.error.details() or "")
        replica = Replica()
        resync = snapshot(decode.address, AUTH)
        replica.apply(resync)
        assert resync.snapshot and resync.seq > 0
    finally:
        slow.close()


def test_needs_the_token(decode: ServiceProcess) -> None:
    sub = Subscriber(decode.address).start()
    assert sub.done.wait(30)
    assert sub.error is not None and sub.error.code() == grpc.StatusCode.UNAUTHENTICATED
    sub.close()


def test_events_off_answer_unimplemented(services: dict[str, ServiceProcess]) -> None:
    sub = Subscriber(services["prefill_off"].address, role="prefill").start()
    assert sub.done.wait(30)
    assert sub.error is not None and sub.error.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "--no-kv-events" in (sub.error.details() or "")
    sub.close()


def test_restart_starts_a_new_epoch(decode: ServiceProcess) -> None:
    sub = Subscriber(decode.address, AUTH).start()
    before = sub.next()
    decode.restart()
    # The old stream ends (the instance shut down) ...
    assert sub.done.wait(30), "the stream outlived its instance"
    assert sub.error is not None
    assert sub.error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    sub.close()
    # ... and the new one starts over: another epoch, an empty cache.
    after = snapshot(decode.address, AUTH)
    assert after.snapshot and after.instance_epoch != before.instance_epoch
    assert after.seq == 0 and not any(e.block_hashes for e in after.events)
