"""``NixlConnector``: prompt KV handed from the prefill's paged cache into the decode's by
a NIXL READ (UCX: RDMA over InfiniBand/RoCE between nodes, CUDA IPC on one node, shared
memory or TCP between processes on the CPU).

Each engine registers its whole KV pool with one NIXL agent at start. Prefill side:
``start_save`` copies nothing; it holds the request's blocks under a lease (the same
``LeaseTable`` as ``p2p``: a deadline, ended by abort, by the pull, by close) and reports at
once a held save whose handle carries this engine's card and the blocks' descriptors
(``card.py``). Decode side: ``start_load`` queues a pull; the progress thread pins, READs
and reports (``puller.py``), while the prefill's thread answers pins (``holder.py``). The
engine's step never waits: it only queues work and drains results. Protocol and failure
rules: docs/design.md §3 "nixl".

``lookup`` is 0: compose it with a store for prefix reuse (``--kv-store``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from kv_store.base import KVConnector, KvLayout, KVTransfer, TransferResult
from kv_store.nixl.agent import PoolAgent, layout_dict, load_nixl
from kv_store.nixl.card import CardError, transfer_id
from kv_store.nixl.holder import Holder
from kv_store.nixl.puller import Pull, Puller
from kv_store.nixl.recut import Recut
from kv_store.nixl.seal import Seal
from kv_store.p2p.leases import Lease, LeaseTable
from kv_store.p2p.mover import record_ready
from kv_store.p2p.stats import P2PCounters, P2PStats
from kv_store.results import ResultQueue
from kv_store.stats import ConnectorStats

logger = logging.getLogger(__name__)

ACTIVE_POLL_S = 0.0005  # while pulls or pins are in flight
IDLE_POLL_S = 0.002  # otherwise: how soon a pin from a peer is answered
REAP_EVERY_S = 0.25


class NixlConnector(KVConnector):
    """See the module docstring. ``token``: the control-plane token (the services'
    ``--grpc-token``); with one, every notification must carry its MAC, bound to both
    agents, with a time and a nonce (``seal.py``)."""

    name = "nixl"

    def __init__(self, *, lease_s: float = 30.0, timeout_s: float = 10.0, token: str = "") -> None:
        if timeout_s <= 0:
            raise ValueError(f"nixl timeout must be > 0 seconds, got {timeout_s}")
        load_nixl()  # fail at start, with the install hint, not on the first request
        self.timeout_s, self._token = timeout_s, token
        self.counters = ConnectorStats()
        self.p2p = P2PCounters(self.counters)
        self._results = ResultQueue()
        self.leases = LeaseTable(lease_s, self.p2p, self._lease_ended)
        self._inbox: queue.SimpleQueue[Pull] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._agent: PoolAgent | None = None
        self._kv: torch.Tensor | None = None
        self._layout: KvLayout | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """The card peers reach this engine by (what ``source_address`` carries)."""
        return self._bound_agent().card.encode()

    @property
    def agent_name(self) -> str:
        return self._bound_agent().name

    def bind_kv_cache(
        self, kv_cache: torch.Tensor, layout: KvLayout, model_fingerprint: str
    ) -> None:
        """Check the cache, register it with a new agent and start the progress thread."""
        expect = (
            layout.num_layers,
            layout.planes,  # 1 for an MLA latent cache (docs/design.md §3)
            layout.block_size,
            layout.num_kv_heads,
            layout.head_dim,
        )
        shape = tuple(kv_cache.shape)
        if kv_cache.dim() != 6 or shape[:2] + shape[3:] != expect:
            raise ValueError(f"kv_cache shape {shape} does not match layout {layout}")
        if not kv_cache.is_contiguous() or not model_fingerprint:
            raise ValueError("kv_cache must be contiguous and the fingerprint non-empty")
        if self._agent is not None:
            raise RuntimeError("NixlConnector: bind_kv_cache() was called already")
        self._kv, self._layout = kv_cache, layout
        self._agent = agent = PoolAgent(kv_cache, layout_dict(layout), model_fingerprint)
        self._card_text = agent.card.encode()
        # A notification is good for as long as a pin waits for its ``done`` (seal.py).
        self._seal = seal = Seal(self._token, agent.name, 2 * self.timeout_s)
        self._holder = Holder(agent, self.leases, self.p2p, seal, self.timeout_s)
        self._puller = Puller(agent, self.p2p, self._results.put, seal, self.timeout_s)
        self._thread = threading.Thread(target=self._run, name="kv-nixl", daemon=True)
        self._thread.start()

    # -- scheduler side ---------------------------------------------------------------------
    def lookup(self, token_ids: list[int], block_hashes: list[bytes]) -> int:
        return 0

    # -- prefill side -----------------------------------------------------------------------
    def start_save(self, transfer: KVTransfer) -> None:
        kv = self._bound()
        self._check_ids(transfer, kv)
        lease = self.leases.offer(
            transfer.request_id, transfer.block_ids, transfer.block_hashes, record_ready(kv)
        )
        result = TransferResult(transfer.request_id, "save", True)
        result.held = True
        result.transfer_id = transfer_id(lease.transfer_id, lease.block_ids)
        result.source_address = self._card_text
        self._results.put(result)

    def release_held(self, request_id: str) -> bool:
        return self.leases.end_request(request_id, "aborted")

    def _lease_ended(self, lease: Lease, reason: str) -> None:
        result = TransferResult(lease.request_id, "release", reason == "pulled")
        if reason != "pulled":
            result.failure_reason = reason
        result.transfer_id = transfer_id(lease.transfer_id, lease.block_ids)
        self._results.put(result)

    # -- decode side ------------------------------------------------------------------------
    def start_load(self, transfer: KVTransfer) -> None:
        """Queue a pull of blocks ``start_block..`` named by the handle (of another grid:
        a re-cut, ``recut.py``); never blocks."""
        kv = self._bound()
        self._check_ids(transfer, kv)
        if self._closed.is_set():
            raise RuntimeError("NixlConnector is closed")
        if not transfer.source_address or not transfer.transfer_id:
            result = TransferResult(transfer.request_id, "load", False, failure_reason="missing")
            result.error = "the KV handle names no nixl source (source_address, transfer_id)"
            self._results.put(result)
            return
        self._inbox.put(Pull(transfer, time.monotonic() + self.timeout_s, record_ready(kv)))
        self._wake.set()

    # -- both -------------------------------------------------------------------------------
    def poll(self) -> list[TransferResult]:
        return self._results.drain()

    def wait(self, count: int, timeout_s: float) -> list[TransferResult]:
        """Block until ``count`` results arrived or ``timeout_s`` passed (tests, tools)."""
        return self._results.wait(count, timeout_s)

    def stats(self) -> ConnectorStats:
        return self.counters.snapshot()

    def transport_stats(self) -> P2PStats:
        return self.p2p.snapshot()

    def close(self) -> None:
        """Stop; pulls in flight fail as ``closed`` and every held lease ends ``closed``."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10.0)
        self.leases.end_all("closed")

    # -- the progress thread ------------------------------------------------------------------
    def _run(self) -> None:
        next_reap = 0.0
        try:
            while not self._closed.is_set():
                busy = self._tick()
                now = time.monotonic()
                if now >= next_reap:
                    self.leases.reap()
                    self._holder.reap(now)
                    next_reap = now + REAP_EVERY_S
                self._wake.wait(ACTIVE_POLL_S if busy else IDLE_POLL_S)
                self._wake.clear()
        except Exception:  # noqa: BLE001 - log it; the pulls fail below
            logger.exception("nixl progress thread failed")
        finally:
            self._puller.close()
            self._holder.close()
            while not self._inbox.empty():
                pull = self._inbox.get_nowait()
                res = TransferResult(pull.transfer.request_id, "load", False)
                res.failure_reason, res.error = "closed", "nixl connector closed"
                self._results.put(res)
            assert self._agent is not None
            self._agent.close()

    def _tick(self) -> bool:
        assert self._agent is not None
        while not self._inbox.empty():
            pull = self._inbox.get_nowait()
            if pull.transfer.reshard is None:
                self._puller.start(pull)
            else:  # blocks another grid split: read each source's part (recut.py)
                assert self._kv is not None and self._layout is not None
                kv, layout, agent = self._kv, self._layout, self._agent
                Recut(pull, agent, self._puller, kv, layout, self._results.put).start()
        for sender, messages in self._agent.notifications().items():
            for raw in messages:
                try:
                    msg = self._seal.unpack(bytes(raw), sender)
                except CardError as e:
                    self.p2p.failed(e.reason)
                    logger.warning("nixl: notification from %s dropped: %s", sender, e)
                    continue
                if msg["op"] == "pinned":
                    self._puller.on_pinned(sender, msg)
                else:
                    self._holder.on_message(sender, msg)
        self._puller.progress(time.monotonic())
        return len(self._puller) > 0 or self._holder.busy

    # -- internals ----------------------------------------------------------------------------
    def _bound(self) -> torch.Tensor:
        if self._kv is None:
            raise RuntimeError("NixlConnector: bind_kv_cache() must be called first")
        return self._kv

    def _bound_agent(self) -> PoolAgent:
        if self._agent is None:
            raise RuntimeError("NixlConnector: bind_kv_cache() must be called first")
        return self._agent

    @staticmethod
    def _check_ids(t: KVTransfer, kv: torch.Tensor) -> None:
        n = len(t.block_hashes)
        if len(t.block_ids) != n or not 0 <= t.start_block <= n:
            raise ValueError(f"transfer {t.request_id}: malformed (ids/hashes/start_block)")
        bad = [b for b in t.block_ids[t.start_block :] if not 0 <= b < kv.shape[2]]
        if bad:
            raise ValueError(f"transfer {t.request_id}: block ids {bad[:4]} out of range")
