"""The router's KV event subscriber (router/routing/kv_events.py) against a real gRPC server
that plays scripted streams: what the engines never do on purpose (skip a seq, change the
epoch without a snapshot, start without one, answer UNIMPLEMENTED) is scripted here, over
real gRPC, and the index must resynchronise from a new subscription's snapshot each time.
The real engines' streams are tested end to end in tests/e2e/test_router_kv_index.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from common.block_hash import compute_block_hashes
from pdserve_api.v1 import pdserve_pb2, pdserve_pb2_grpc
from router.metrics import RouterMetrics
from router.routing.kv_events import KvEventFeeds, KvEventSubscriber
from router.routing.kv_index import KvBlockIndex

Ev = pdserve_pb2.KvBlockEvent
PROMPT = compute_block_hashes(list(range(64)), 4)  # 16 blocks


def batch(seq: int, hs: list[bytes], *, snapshot: bool = False, epoch: str = "e1") -> Any:
    events = [Ev(kind=Ev.STORED, tier=pdserve_pb2.KV_TIER_DEVICE, block_hashes=hs)]
    return pdserve_pb2.KvEventBatch(instance_epoch=epoch, seq=seq, snapshot=snapshot, events=events)


class ScriptedEvents(pdserve_pb2_grpc.DecodeServiceServicer):
    """Each subscription plays the next script; a script ending in None keeps the stream
    open (an idle engine), otherwise the stream ends after its batches."""

    def __init__(self, scripts: list[list[Any]]) -> None:
        self.scripts = scripts
        self.subscriptions = 0

    async def SubscribeKvEvents(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        script = self.scripts[min(self.subscriptions, len(self.scripts) - 1)]
        self.subscriptions += 1
        for item in script:
            if item is None:
                await asyncio.sleep(3600)
            if isinstance(item, grpc.StatusCode):  # the engine ends the stream so
                await context.abort(item, "scripted")
            yield item


async def _serve(servicer: Any) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    if servicer is not None:
        pdserve_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    else:  # an older engine: the service without the events RPC
        pdserve_pb2_grpc.add_DecodeServiceServicer_to_server(
            pdserve_pb2_grpc.DecodeServiceServicer(), server
        )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached within the deadline")
        await asyncio.sleep(0.02)


async def _run(scripts: list[list[Any]] | None, check: Callable[..., Any]) -> None:
    servicer = ScriptedEvents(scripts) if scripts is not None else None
    server, address = await _serve(servicer)
    channel = grpc.aio.insecure_channel(address)
    index = KvBlockIndex()
    metrics = RouterMetrics()
    sub = KvEventSubscriber(
        address,
        "decode",
        pdserve_pb2_grpc.DecodeServiceStub(channel),
        index,
        metrics=metrics,
        backoff_s=(0.05, 0.1),
        unsupported_retry_s=0.2,
    )
    task = asyncio.create_task(sub.run())
    try:
        await check(sub, index, servicer, metrics)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await channel.close()
        await server.stop(None)


def _counter(metrics: RouterMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(f"pdserve_kv_index_{name}_total", {"pool": "decode"})
    return value or 0.0


async def test_in_order_stream_follows_batches() -> None:
    async def check(sub: Any, index: KvBlockIndex, servicer: Any, metrics: Any) -> None:
        await _until(lambda: sub.seq == 2)
        assert sub.live and sub.epoch == "e1" and sub.gaps == 0
        assert index.match([sub.url], PROMPT)[sub.url].blocks == 6
        assert sub.lag_s() < 60 and servicer.subscriptions == 1
        assert _counter(metrics, "batches") == 3 and _counter(metrics, "resyncs") == 1

    await _run(
        [[batch(0, PROMPT[:2], snapshot=True), batch(1, PROMPT[2:4]), batch(2, PROMPT[4:6]), None]],
        check,
    )


async def test_cut_off_for_falling_behind_resubscribes_at_once() -> None:
    async def check(sub: Any, index: KvBlockIndex, servicer: Any, metrics: Any) -> None:
        await _until(lambda: sub.live and sub.seq == 5)
        assert sub.gaps == 1 and servicer.subscriptions == 2
        assert set(index.blocks_of(sub.url)) == set(PROMPT[:3])

    await _run(
        [
            [batch(0, PROMPT[:8], snapshot=True), grpc.StatusCode.RESOURCE_EXHAUSTED],
            [batch(5, PROMPT[:3], snapshot=True), None],
        ],
        check,
    )


@pytest.mark.parametrize(
    "bad",
    [
        [batch(3, PROMPT[:2])],  # no snapshot first
        [batch(0, [], snapshot=True), batch(2, PROMPT[:2])],  # seq skipped
        [batch(0, [], snapshot=True), batch(0, PROMPT[:2])],  # seq repeated
        [batch(0, [], snapshot=True), batch(1, PROMPT[:2], epoch="e2")],  # epoch, no snapshot
    ],
    ids=["no-snapshot", "skipped", "repeated", "epoch"],
)
async def test_gap_resubscribes_and_resyncs_from_the_snapshot(bad: list[Any]) -> None:
    good = [batch(0, PROMPT[:8], snapshot=True, epoch="e2"), batch(1, PROMPT[8:9], epoch="e2")]

    async def check(sub: Any, index: KvBlockIndex, servicer: Any, metrics: Any) -> None:
        await _until(lambda: sub.live and sub.epoch == "e2" and sub.seq == 1)
        assert sub.gaps == 1 and _counter(metrics, "gaps") == 1
        assert servicer.subscriptions == 2
        # Exactly the snapshot's state plus what followed: nothing of the bad stream.
        assert set(index.blocks_of(sub.url)) == set(PROMPT[:9])

    await _run([[*bad, None], [*good, None]], check)


async def test_stream_end_forgets_then_reconnects_to_a_restarted_instance() -> None:
    async def check(sub: Any, index: KvBlockIndex, servicer: Any, metrics: Any) -> None:
        await _until(lambda: sub.epoch == "e2" and sub.live)
        assert set(index.blocks_of(sub.url)) == set(PROMPT[:1])
        assert servicer.subscriptions == 2 and sub.gaps == 0 and sub.resyncs == 2

    # The first stream ends (the engine stopped): its entries must not outlive it.
    await _run(
        [
            [batch(0, PROMPT[:5], snapshot=True)],
            [batch(0, PROMPT[:1], snapshot=True, epoch="e2"), None],
        ],
        check,
    )


async def test_unimplemented_is_an_older_engine() -> None:
    async def check(sub: Any, index: KvBlockIndex, servicer: Any, metrics: Any) -> None:
        await _until(lambda: sub.unsupported)
        assert not sub.live and index.entries == 0 and sub.lag_s() == float("inf")
        await asyncio.sleep(0.5)  # asked again only every unsupported_retry_s
        assert sub.unsupported and not sub.live

    await _run(None, check)


async def test_feeds_start_and_stop_with_the_pool_and_publish_metrics() -> None:
    servicer = ScriptedEvents([[batch(0, PROMPT[:4], snapshot=True), None]])
    server, address = await _serve(servicer)
    channel = grpc.aio.insecure_channel(address)
    metrics = RouterMetrics()
    index = KvBlockIndex()
    feeds = KvEventFeeds("decode", index, metrics)
    try:
        feeds.add(address, pdserve_pb2_grpc.DecodeServiceStub(channel), ())
        await _until(lambda: feeds.live(address))
        feeds.publish_gauges()
        sample = metrics.registry.get_sample_value
        assert sample("pdserve_kv_index_blocks", {"pool": "decode"}) == 4
        assert sample("pdserve_kv_index_live", {"pool": "decode", "instance": address}) == 1
        await feeds.remove(address)
        assert not feeds.live(address) and index.entries == 0
    finally:
        await channel.close()
        await server.stop(None)
