"""Test helpers for ``SubscribeKvEvents`` (docs/design.md §3 "KV events"): a subscriber
that reads a real stream on a thread, and a strict replica of one instance's tiers.

``Replica`` applies batches the way a router's index must and asserts the contract as it
goes: snapshot first, seq + 1 per batch within an epoch, STORED only for a hash the tier
does not hold, REMOVED only for one it holds, parent chains as stated.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import grpc

from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc

STORED, REMOVED, CLEARED = pb.KvBlockEvent.STORED, pb.KvBlockEvent.REMOVED, pb.KvBlockEvent.CLEARED
DEVICE, HOST = pb.KV_TIER_DEVICE, pb.KV_TIER_HOST


@dataclass
class Replica:
    """What one instance holds per tier (hash -> parent), rebuilt from its batches."""

    epoch: str = ""
    seq: int = -1
    tiers: dict[int, dict[bytes, bytes]] = field(default_factory=dict)
    removed: dict[int, list[bytes]] = field(default_factory=dict)  # every REMOVED, in order
    stored: dict[int, list[bytes]] = field(default_factory=dict)  # every live STORED

    def apply(self, batch: pb.KvEventBatch) -> None:
        if batch.snapshot:
            self.epoch, self.tiers = batch.instance_epoch, {}
        else:
            assert batch.instance_epoch == self.epoch, "a live batch of another epoch"
            assert batch.seq == self.seq + 1, f"seq gap: {self.seq} -> {batch.seq}"
        self.seq = batch.seq
        for event in batch.events:
            tier = self.tiers.setdefault(event.tier, {})
            if event.kind == CLEARED:
                tier.clear()
                continue
            if event.kind == REMOVED:
                for h in event.block_hashes:
                    assert h in tier, f"REMOVED of a hash tier {event.tier} does not hold"
                    del tier[h]
                self.removed.setdefault(event.tier, []).extend(event.block_hashes)
                continue
            parent = event.parent_hash
            for h in event.block_hashes:
                assert h not in tier, f"STORED of a hash tier {event.tier} already holds"
                tier[h] = parent
                parent = h
            if not batch.snapshot:
                self.stored.setdefault(event.tier, []).extend(event.block_hashes)

    def held(self, tier: int) -> dict[bytes, bytes]:
        return dict(self.tiers.get(tier, {}))


# A receive window of 1 KiB and no window growth: what a subscriber on a slow link (or
# one that stopped reading) looks like to the server, without waiting for 64 KiB.
SLOW_LINK = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))


class Subscriber:
    """One ``SubscribeKvEvents`` stream read on a thread into a queue (``read=False``: a
    subscriber that reads nothing until ``start_reading``)."""

    def __init__(
        self,
        address: str,
        metadata: tuple[tuple[str, str], ...] = (),
        role: str = "decode",
        options: tuple[tuple[str, int], ...] = (),
    ) -> None:
        self.channel = grpc.insecure_channel(address, options=list(options))
        stub_type = pb_grpc.DecodeServiceStub if role == "decode" else pb_grpc.PrefillServiceStub
        self.call = stub_type(self.channel).SubscribeKvEvents(
            pb.KvEventsRequest(), metadata=metadata
        )
        self.batches: queue.Queue[pb.KvEventBatch] = queue.Queue()
        self.error: grpc.RpcError | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def start(self) -> Subscriber:
        self._thread.start()
        return self

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.batches.put(batch)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.done.set()

    def next(self, timeout: float = 30.0) -> pb.KvEventBatch:
        try:
            return self.batches.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no KV event batch within {timeout} s ({self.error})") from None

    def drain_into(self, replica: Replica, quiet_s: float = 0.5, deadline_s: float = 30.0) -> None:
        """Apply batches until none came for ``quiet_s`` (the engine is idle)."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                replica.apply(self.batches.get(timeout=quiet_s))
            except queue.Empty:
                return
        raise AssertionError(f"KV event batches kept coming for {deadline_s} s")

    def close(self) -> None:
        self.call.cancel()
        self.done.wait(10)
        self.channel.close()


def snapshot(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> pb.KvEventBatch:
    """A fresh subscription's first batch (the snapshot), then unsubscribe."""
    sub = Subscriber(address, metadata).start()
    try:
        return sub.next()
    finally:
        sub.close()
