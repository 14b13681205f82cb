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
from kv_store.nixl.agent import PoolAgent
from kv_store.nixl.card import Card, CardError, hashes_digest, pack, parse_transfer_id
from kv_store.p2p.stats import P2PCounters

logger = logging.getLogger(__name__)

CANCEL_GRACE = 3.0  # pull timeouts to wait for an uncancellable READ before reporting


@dataclass(slots=True)
class Pull:
    transfer: KVTransfer
    deadline: float
    ready: Any  # CUDA event: the engine is done with the destination blocks (None: CPU)
    pull_id: str = ""
    card: Card | None = None
    lease_id: str = ""
    src_ids: list[int] | None = None
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
        token: str,
        timeout_s: float,
    ) -> None:
        self._agent, self._counters, self._on_result = agent, counters, on_result
        self._token, self._timeout_s = token, timeout_s
        self._pulls: dict[str, Pull] = {}
        self._greeted: set[str] = set()  # peers that have this agent's metadata

    def __len__(self) -> int:
        return len(self._pulls)

    def start(self, pull: Pull) -> None:
        t = pull.transfer
        pull.pull_id, pull.t0 = secrets.token_hex(8), time.perf_counter()
        try:
            pull.card = card = Card.decode(t.source_address)
            pull.lease_id, ids = parse_transfer_id(t.transfer_id)
        except CardError as e:
            self._fail(pull, e.reason, str(e))
            return
        mine = self._agent.card
        if card.fingerprint != mine.fingerprint or card.layout != mine.layout:
            self._fail(pull, "layout", "the prefill runs a different model or KV layout")
            return
        want = len(t.block_ids) - t.start_block
        pull.src_ids = ids[t.start_block :] if len(ids) == len(t.block_ids) else None
        if (
            pull.src_ids is None
            or len(pull.src_ids) != want
            or max(ids, default=0) >= card.num_blocks
        ):
            self._fail(pull, "protocol", "the handle's descriptors do not fit the request")
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
            if self._agent.notify(card.agent, pack({"op": "hello", "md": md}, self._token)):
                self._greeted.add(card.agent)
        pin = {
            "op": "pin",
            "lease": pull.lease_id,
            "pull": pull.pull_id,
            "start": t.start_block,
            "ids": pull.src_ids,
            "digest": hashes_digest(t.block_hashes[t.start_block :]),
            "fp": mine.fingerprint,
            "layout": mine.layout,
        }
        if not self._agent.notify(card.agent, pack(pin, self._token)):
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
        t = pull.transfer
        assert pull.src_ids is not None
        done = {"op": "done", "lease": pull.lease_id, "pull": pull.pull_id}
        if not pull.src_ids:  # nothing to read (all cached here, or aborted): just release
            self._agent.notify(sender, pack(done, self._token))
            self._succeed(pull)
            return
        try:
            pull.handle, status = self._agent.read(
                pull.card, pull.src_ids, t.block_ids[t.start_block :], pack(done, self._token)
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
        t = pull.transfer
        n = len(t.block_ids) - t.start_block
        nbytes = n * self._agent.block_bytes
        seconds = time.perf_counter() - pull.t0
        self._counters.transferred("recv", n, nbytes, seconds)
        res = TransferResult(t.request_id, "load", True, num_loaded_blocks=n)
        res.bytes_moved, res.seconds = nbytes, seconds
        self._on_result(res)

    def _abandon(self, pull: Pull, reason: str, error: str) -> None:
        """Fail a pull the prefill pinned: tell it, and stop the READ before reporting."""
        assert pull.card is not None
        msg = {"op": "fail", "lease": pull.lease_id, "pull": pull.pull_id}
        self._agent.notify(pull.card.agent, pack(msg, self._token))
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
        self._on_result(res)

    def close(self) -> None:
        for pull in list(self._pulls.values()):
            if pull.handle is not None:
                self._agent.release(pull.handle)
            self._fail(pull, "closed", "nixl connector closed")
