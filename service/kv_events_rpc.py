"""``SubscribeKvEvents`` of both services (docs/design.md §3 "KV events"): the engine's
KV event batches as a server stream, a snapshot first, then one batch per engine step
that changed what the instance holds.

Deadlines: a subscription has none of its own (the caller may set one; the stream then
ends DEADLINE_EXCEEDED and the caller resubscribes). The first batch (the snapshot) must
come within ``SNAPSHOT_TIMEOUT_S``, or the call ends UNAVAILABLE: the engine thread takes
it between steps, and one that cannot is stuck. Liveness of an idle stream is the
transport's: the server pings every idle connection (``service/runtime.py``
keepalive options), so a vanished subscriber's stream ends and its queue is dropped.

Endings: RESOURCE_EXHAUSTED when the subscriber fell ``--kv-events-max-queue`` batches
behind; UNAVAILABLE when the instance shuts down; UNIMPLEMENTED when it runs with
``--no-kv-events`` (the same answer as a server that predates the RPC).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from engine.kv.events import KvEventBatch, KvEventPublisher, PublisherClosed, SubscriberBehind
from pdserve_api.v1 import pdserve_pb2 as pb
from service.core import EngineServiceCore
from service.errors import EngineFull, ServiceUnavailable

SNAPSHOT_TIMEOUT_S = 30.0


def to_proto(batch: KvEventBatch) -> pb.KvEventBatch:
    return pb.KvEventBatch(
        instance_epoch=batch.instance_epoch,
        seq=batch.seq,
        snapshot=batch.snapshot,
        events=[
            pb.KvBlockEvent(
                kind=pb.KvBlockEvent.Kind.ValueType(e.kind),
                tier=pb.KvTier.ValueType(e.tier),
                block_hashes=e.block_hashes,
                parent_hash=e.parent_hash,
            )
            for e in batch.events
        ],
    )


async def subscribe_kv_events(
    core: EngineServiceCore, context: grpc.aio.ServicerContext
) -> AsyncIterator[pb.KvEventBatch]:
    publisher: KvEventPublisher | None = getattr(core.engine, "kv_events", None)
    if publisher is None:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "KV events are off on this instance (started with --no-kv-events)",
        )
        return
    subscription = publisher.subscribe(asyncio.get_running_loop())
    try:
        try:
            first = await subscription.next(SNAPSHOT_TIMEOUT_S)
        except TimeoutError:
            raise ServiceUnavailable(
                f"the engine gave no KV snapshot within {SNAPSHOT_TIMEOUT_S:.0f} s"
            ) from None
        # A big snapshot takes a while to build: off the loop, so streams keep flowing.
        yield await asyncio.to_thread(lambda: to_proto(first.expand()))
        while True:
            yield to_proto(await subscription.next())
    except SubscriberBehind as exc:
        raise EngineFull(f"{exc}; resubscribe for a fresh snapshot") from None
    except PublisherClosed as exc:
        raise ServiceUnavailable(str(exc)) from None
    finally:
        subscription.close()
