"""The decode side of a nixl handoff: pin, READ, report — many pulls at once.

A pull (from ``start_load``) goes: ``pin`` to the prefill's agent (after ``hello`` with
this agent's metadata, once per peer) → ``pinned`` back → one READ of exactly the blocks
the handle names into the blocks the engine allocated, carrying the ``done`` notification
→ the READ completes → a load result. A refusal, an error or the pull's deadline ends it
as a failed load (the engine recomputes); after a ``pinned`` the prefill is told ``fail``
so it lets go at once. A READ that cannot be cancelled at its deadline is reported only
once the backend lets it go (up to ``CANCEL_GRACE`` timeouts later): a failed load's
blocks go back to the engine, and nothing may still write into them.
"""

from __future__ import annotations

import base64
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kv_store.base import KVTransfer, TransferResult
from kv_store.nixl.agent import PoolAgent, Span
from kv_store.nixl.card import Card, CardError, hashes_digest, parse_transfer_id
from kv_store.nixl.seal import Seal
from kv_store.p2p.stats import P2PCounters

logger = logging.getLogger(__name__)

CANCEL_GRACE = 3.0  # pull timeouts to wait for an uncancellable READ before reporting


@dataclass(slots=True)
class Pull:
    """One READ from one prefill agent. A plain load is one; a re-cut load (``recut.py``)
    is one per prefill process it reads, each reporting to its ``sink``."""

    transfer: KVTransfer
    deadline: float
    ready: Any  # CUDA event: the engine is done with the destination blocks (None: CPU)
    pull_id: str = ""
    card: Card | None = None
    lease_id: str = ""
    src_ids: list[int] | None = None  # the lease's blocks to read (empty: release it only)
    start: int = 0  # index of src_ids[0] in the lease (the pin's "start")
    dst: Span | None = None  # where the READ lands
    src_regions: Any = None  # the source's region rows read (None: all)
    expect: tuple[str, dict[str, Any]] | None = None  # the prefill's (fingerprint, layout)
    pullers: int = 1  # decode processes sharing the lease (a re-cut)
    sink: Callable[[TransferResult], None] | None = None  # None: the connector's results
    nbytes: int = 0
    state: str = "new"  # new | pinning | reading | cancelling
    handle: Any = None
    t0: float = 0.0
    failure: tuple[str, str] | None = None  # (reason, error) once it failed


class Puller:
    """See the module docstring. Driven by the connector's progress thread only."""

    def __init__(
        self,
        agent: PoolAgent,
        counters: P2PCounters,
        on_result: Callable[[TransferResult], None],
        seal: Seal,
        timeout_s: float,
    ) -> None:
        self._agent, self._counters, self._on_result = agent, counters, on_result
        self._seal, self._timeout_s = seal, timeout_s
        self._pulls: dict[str, Pull] = {}
        self._greeted: set[str] = set()  # peers that have this agent's metadata

    def __len__(self) -> int:
        return len(self._pulls)

    def start(self, pull: Pull) -> None:
        """A load between like grids: the handle's one card, the blocks into the pool. A
        load of no blocks (the engine dropped the request) pins nothing to read and only
        ends the prefill's hold."""
        t = pull.transfer
        pull.t0 = time.perf_counter()
        try:
            pull.card = card = Card.decode(t.source_address)
            pull.lease_id, ids = parse_transfer_id(t.transfer_id)
        except CardError as e:
            self._fail(pull, e.reason, str(e))
            return
        want = len(t.block_ids) - t.start_block
        if not t.block_ids:
            pull.src_ids, pull.start = [], len(ids)
        elif len(ids) == len(t.block_ids):
            pull.src_ids, pull.start = ids[t.start_block :], t.start_block
        if (
            pull.src_ids is None
            or len(pull.src_ids) != want
            or max(ids, default=0) >= card.num_blocks
        ):
            self._fail(pull, "protocol", "the handle's descriptors do not fit the request")
            return
        pull.dst = self._agent.pool_span(t.block_ids[t.start_block :])
        pull.nbytes = want * self._agent.block_bytes
        self.begin(pull)

    def begin(self, pull: Pull) -> None:
        """Pin ``pull``'s blocks at its prefill (``card``, ``lease_id``, ``src_ids`` and
        ``dst`` set); the READ follows the ``pinned`` answer."""
        t, card, mine = pull.transfer, pull.card, self._agent.card
        assert card is not None and pull.src_ids is not None
        pull.pull_id, pull.t0 = secrets.token_hex(8), pull.t0 or time.perf_counter()
        fingerprint, layout = pull.expect or (mine.fingerprint, mine.layout)
        if card.fingerprint != fingerprint or card.layout != layout:
            self._fail(pull, "layout", "the prefill runs a different model or KV layout")
            return
        if pull.ready is not None:
            pull.ready.synchronize()  # the engine's last use of the destination blocks
        self._pulls[pull.pull_id] = pull
        try:
            self._agent.remote_dlist(card)
        except Exception as e:  # noqa: BLE001 - unusable metadata or unreachable peer
            self._fail(pull, "unreachable", f"nixl peer {card.agent}: {e}")
            return
        if card.agent not in self._greeted:
            md = base64.b64encode(self._agent.card.metadata).decode()
            if self._agent.notify(
                card.agent, self._seal.pack({"op": "hello", "md": md}, card.agent)
            ):
                self._greeted.add(card.agent)
        pin = {
            "op": "pin",
            "lease": pull.lease_id,
            "pull": pull.pull_id,
            "start": pull.start,
            "ids": pull.src_ids,
            "digest": hashes_digest(t.block_hashes[pull.start :]),
            "fp": fingerprint,
            "layout": layout,
            "bytes": pull.nbytes,
        }
        if pull.pullers > 1:
            pin["pullers"] = pull.pullers
        if not self._agent.notify(card.agent, self._seal.pack(pin, card.agent)):
            self._fail(pull, "unreachable", f"nixl peer {card.agent} cannot be notified")
            return
        pull.state = "pinning"

    def on_pinned(self, sender: str, msg: dict[str, Any]) -> None:
        pull = self._pulls.get(str(msg.get("pull", "")))
        if pull is None or pull.card is None or pull.card.agent != sender:
            return  # late (the pull ended) or not from its prefill
        if pull.state != "pinning":
            return
        if not msg.get("ok", False):
            reason = str(msg.get("reason", "missing"))
            self._fail(pull, reason, str(msg.get("error", "pin refused")))
            return
        assert pull.src_ids is not None and pull.dst is not None
        done = {"op": "done", "lease": pull.lease_id, "pull": pull.pull_id}
        if not pull.src_ids:  # nothing to read (all cached here, or aborted): just release
            self._agent.notify(sender, self._seal.pack(done, sender))
            self._succeed(pull)
            return
        try:
            pull.handle, status = self._agent.read(
                pull.card, pull.src_ids, pull.dst, self._seal.pack(done, sender), pull.src_regions
            )
        except Exception as e:  # noqa: BLE001 - the backend refused the descriptors
            self._abandon(pull, "protocol", f"nixl READ refused: {e}")
            return
        pull.state = "reading"
        if status == "DONE":
            self._succeed(pull)
        elif status == "ERR":
            self._abandon(pull, "unreachable", "nixl READ failed to start")

    def progress(self, now: float) -> None:
        """Finished READs, failed ones, deadlines."""
        for pull in list(self._pulls.values()):
            if pull.state == "reading":
                status = self._agent.state(pull.handle)
                if status == "DONE":
                    self._succeed(pull)
                    continue
                if status == "ERR":
                    self._abandon(pull, "unreachable", "nixl READ failed (the prefill is gone?)")
                    continue
            if pull.state == "cancelling":
                self._try_cancel(pull, now)
            elif now >= pull.deadline:
                self._abandon(pull, "timeout", "nixl pull passed its deadline")

    # -- ends -----------------------------------------------------------------------------------
    def _succeed(self, pull: Pull) -> None:
        if pull.handle is not None:
            self._agent.release(pull.handle)
        del self._pulls[pull.pull_id]
        assert pull.src_ids is not None
        n, seconds = len(pull.src_ids), time.perf_counter() - pull.t0
        self._counters.transferred("recv", n, pull.nbytes, seconds)
        res = TransferResult(pull.transfer.request_id, "load", True, num_loaded_blocks=n)
        res.bytes_moved, res.seconds = pull.nbytes, seconds
        (pull.sink or self._on_result)(res)

    def _abandon(self, pull: Pull, reason: str, error: str) -> None:
        """Fail a pull the prefill pinned: tell it, and stop the READ before reporting."""
        assert pull.card is not None
        msg = {"op": "fail", "lease": pull.lease_id, "pull": pull.pull_id}
        self._agent.notify(pull.card.agent, self._seal.pack(msg, pull.card.agent))
        if reason in ("timeout", "unreachable"):
            self._greeted.discard(pull.card.agent)
            self._agent.forget(pull.card.agent)
        pull.failure = (reason, error)
        if pull.handle is None:
            self._fail(pull, reason, error)
            return
        pull.state = "cancelling"
        self._try_cancel(pull, time.monotonic())

    def _try_cancel(self, pull: Pull, now: float) -> None:
        assert pull.failure is not None
        released = self._agent.state(pull.handle) != "PROC" and self._agent.release(pull.handle)
        released = released or self._agent.release(pull.handle)
        overdue = now >= pull.deadline + CANCEL_GRACE * self._timeout_s
        if released or overdue:
            if overdue and not released:
                logger.error("nixl: a READ into %s could not be stopped", pull.transfer.request_id)
            self._fail(pull, *pull.failure)

    def _fail(self, pull: Pull, reason: str, error: str) -> None:
        self._pulls.pop(pull.pull_id, None)
        self._counters.failed(reason)
        logger.warning("nixl pull for %s failed (%s): %s", pull.transfer.request_id, reason, error)
        res = TransferResult(pull.transfer.request_id, "load", False, failure_reason=reason)
        res.error = error
        (pull.sink or self._on_result)(res)

    def close(self) -> None:
        for pull in list(self._pulls.values()):
            if pull.handle is not None:
                self._agent.release(pull.handle)
            self._fail(pull, "closed", "nixl connector closed")
