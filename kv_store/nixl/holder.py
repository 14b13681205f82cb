"""The prefill side of a nixl handoff: answering pins, ending leases on ``done``.

A decode instance that wants a request's blocks sends ``pin`` naming the lease and the
source blocks (the descriptors from the handle) with the digest of the block hashes it
expects. The holder pins the lease (so neither its expiry nor an abort frees the blocks
while they are read) when the lease is live, the descriptors are exactly the lease's and
the digest matches; anything else — an unknown, ended or busy lease, other blocks, another
prompt, another model — is refused with a reason and nothing is pinned. The READ then
runs without this side doing anything; its ``done`` notification ends the lease as
``pulled`` (or as the abort that came meanwhile). A pin that sees neither ``done`` nor
``fail`` within twice the pull timeout (the decode died mid-READ) is dropped, and the
lease then ends at its own expiry. A lease that several decode processes of another grid
each read a part of (``pullers`` in the pin, docs/design.md §3 "KV between unlike grids")
takes that many pins, at once, and ends with the last ``done``. Rules: docs/design.md §3
"nixl".
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass
from typing import Any

from kv_store.nixl.agent import PoolAgent
from kv_store.nixl.card import CardError, hashes_digest
from kv_store.nixl.seal import Seal
from kv_store.p2p.leases import Lease, LeaseTable
from kv_store.p2p.stats import P2PCounters
from kv_store.p2p.wire import PeerError

logger = logging.getLogger(__name__)

MAX_PULLERS = 1024  # decode processes that may share one lease (as p2p's server)


@dataclass(slots=True)
class _Pin:
    lease: Lease
    agent: str  # the decode agent reading it
    pull: str  # its pull id
    until: float
    t0: float
    nblocks: int
    nbytes: int


class Holder:
    """See the module docstring. Driven by the connector's progress thread only."""

    def __init__(
        self,
        agent: PoolAgent,
        leases: LeaseTable,
        counters: P2PCounters,
        seal: Seal,
        timeout_s: float,
    ) -> None:
        self._agent, self._leases, self._counters = agent, leases, counters
        self._seal, self._timeout_s = seal, timeout_s
        self._pins: dict[tuple[str, str], _Pin] = {}  # (decode agent, pull id) -> pin

    @property
    def busy(self) -> bool:
        return bool(self._pins)

    def on_message(self, sender: str, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "hello":
            self._hello(sender, msg)
        elif op == "pin":
            self._pin(sender, msg)
        elif op in ("done", "fail"):
            self._finish(sender, msg, op == "done")

    def _hello(self, sender: str, msg: dict[str, Any]) -> None:
        try:
            name = self._agent.add_peer(base64.b64decode(str(msg.get("md", ""))))
        except Exception as e:  # noqa: BLE001 - bad metadata: the peer's pins go unanswered
            logger.warning("nixl: metadata from %s refused: %s", sender, e)
            return
        if name != sender:
            logger.warning("nixl: %s sent the metadata of %s; dropped", sender, name)
            self._agent.forget(name)
            return
        self._counters.pair(made=True)

    def _pin(self, sender: str, msg: dict[str, Any]) -> None:
        pull = str(msg.get("pull", ""))
        try:
            if (sender, pull) in self._pins:  # a repeated pin: one pin per pull
                raise PeerError(f"pull {pull!r} holds a pin already", "busy")
            lease = self._claim(msg)
        except (PeerError, CardError) as e:
            self._counters.failed(e.reason)
            refusal = {"op": "pinned", "pull": pull, "ok": False, "reason": e.reason}
            self._agent.notify(sender, self._seal.pack({**refusal, "error": str(e)}, sender))
            return
        if lease.ready is not None:
            lease.ready.synchronize()  # the KV is written before anyone reads it
        nblocks = len(msg["ids"])
        # The reader's count (a re-cut reads some layers); only a statistic.
        nbytes = msg.get("bytes")
        if not isinstance(nbytes, int) or not 0 <= nbytes <= nblocks * self._agent.block_bytes:
            nbytes = nblocks * self._agent.block_bytes
        now = time.monotonic()
        until = now + 2 * self._timeout_s
        key = (sender, pull)
        self._pins[key] = _Pin(lease, sender, pull, until, time.perf_counter(), nblocks, nbytes)
        reply = self._seal.pack({"op": "pinned", "pull": pull, "ok": True}, sender)
        if not self._agent.notify(sender, reply):
            del self._pins[key]
            self._leases.unpin(lease, None)

    def _claim(self, msg: dict[str, Any]) -> Lease:
        """The pinned lease the message names, after every check; raises the refusal."""
        lay = self._agent.card
        if msg.get("fp") != lay.fingerprint or msg.get("layout") != lay.layout:
            raise PeerError("the peer runs a different model or KV layout", "layout")
        ids, start, pullers = msg.get("ids"), msg.get("start"), msg.get("pullers", 1)
        if not isinstance(ids, list) or not isinstance(start, int) or start < 0:
            raise CardError("malformed pin")
        if not isinstance(pullers, int) or not 1 <= pullers <= MAX_PULLERS:
            raise CardError(f"pullers must be 1..{MAX_PULLERS}, got {pullers!r}")
        lease = self._leases.pin(str(msg.get("lease", "")), pullers)
        try:
            if ids != lease.block_ids[start:]:
                raise PeerError("the descriptors are not the lease's blocks", "forged")
            if msg.get("digest") != hashes_digest(lease.block_hashes[start:]):
                raise PeerError("the lease holds another prompt's blocks", "mismatch")
        except PeerError:
            self._leases.unpin(lease, None)
            raise
        return lease

    def _finish(self, sender: str, msg: dict[str, Any], done: bool) -> None:
        key = (sender, str(msg.get("pull", "")))
        pin = self._pins.get(key)
        if pin is None or pin.lease.transfer_id != msg.get("lease"):
            return  # late (the pin expired) or not this peer's
        del self._pins[key]
        if done:
            seconds = time.perf_counter() - pin.t0
            self._counters.transferred("send", pin.nblocks, pin.nbytes, seconds)
        self._leases.unpin(pin.lease, "pulled" if done else None)

    def reap(self, now: float) -> None:
        for key in [k for k, p in self._pins.items() if p.until <= now]:
            pin = self._pins.pop(key)
            lease_id = pin.lease.transfer_id
            logger.warning("nixl: the pull of %s by %s never finished", lease_id, pin.agent)
            self._counters.failed("timeout")
            self._leases.unpin(pin.lease, None)

    def close(self) -> None:
        for pin in self._pins.values():
            self._leases.unpin(pin.lease, "closed")
        self._pins.clear()
