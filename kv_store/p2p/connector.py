"""``P2PConnector``: prompt KV handed from the prefill's paged cache straight into the
decode's, over a per-pair process group (NCCL between GPUs, gloo otherwise).

Prefill side: ``start_save`` copies nothing. It offers the request's blocks under a lease and
reports at once a save result with ``held=True``, the transfer id and this instance's
address, so the engine streams ``kv_committed`` right after the first token while keeping
the blocks allocated. The lease ends — pulled, expired, aborted (``release_held``) or closed
— with a result of kind ``"release"``; only then does the engine free the blocks.

Decode side: ``start_load`` queues a pull on the link to the source instance (handle:
``source_address``, ``transfer_id``). The load result counts the leading blocks that
arrived; anything else — the lease ended, the prefill died, a deadline — is a failed load
with a reason, and the engine applies ``kv_load_failure`` (recompute or fail).

``lookup`` is always 0: p2p keeps no store to reuse prefixes from (compose it with one for
that). This package imports only torch and the standard library.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import torch

from kv_store.base import KVConnector, KvLayout, KVTransfer, TransferResult, layout_wire_dict
from kv_store.p2p.client import LinkConfig, PeerLink, PullJob
from kv_store.p2p.group import BACKENDS, device_identity
from kv_store.p2p.leases import Lease, LeaseTable
from kv_store.p2p.mover import DEFAULT_BATCH_BYTES, record_ready
from kv_store.p2p.server import PullServer, ServeConfig
from kv_store.p2p.stats import P2PCounters, P2PStats
from kv_store.results import ResultQueue
from kv_store.stats import ConnectorStats

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
DEFAULT_TIMEOUT_S = 10.0


def advertised_host(host: str) -> str:
    """The address peers reach a server bound to ``host`` on: ``host`` itself unless it is a
    wildcard, then this machine's address by name (a pod's IP in Kubernetes)."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class P2PConnector(KVConnector):
    """See the module docstring. ``host``/``port``: the control server (0 = a free port);
    ``advertise_host``: what goes into handles (default: ``advertised_host(host)``)."""

    name = "p2p"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        backend: str = "auto",
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        idle_s: float = 60.0,
        token: str = "",
    ) -> None:
        """``token``: the control-plane token (the services' ``--grpc-token``); with one,
        the control server refuses peers that do not prove it (reason ``auth``), and pulls
        refuse a source that does not."""
        if backend not in BACKENDS:
            raise ValueError(f"p2p backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if timeout_s <= 0:
            raise ValueError(f"p2p timeout must be > 0 seconds, got {timeout_s}")
        if not 0 <= port <= 65535:
            raise ValueError(f"p2p port must be in 0..65535, got {port}")
        self.host, self.port = host, port
        self.advertise_host = advertise_host or advertised_host(host)
        self.timeout_s, self.backend, self.batch_bytes, self.idle_s = (
            timeout_s,
            backend,
            batch_bytes,
            idle_s,
        )
        self._token = token
        self.counters = ConnectorStats()
        self.p2p = P2PCounters(self.counters)
        self._results = ResultQueue()
        self.leases = LeaseTable(lease_s, self.p2p, self._lease_ended)
        self._kv: torch.Tensor | None = None
        self._layout: KvLayout | None = None
        self._server: PullServer | None = None
        self._link_config: LinkConfig | None = None
        self._links: dict[str, PeerLink] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="kv-p2p-leases", daemon=True)
        self._reaper.start()

    @property
    def address(self) -> str:
        """``host:port`` of this instance's control server (after ``bind_kv_cache``)."""
        if self._server is None:
            raise RuntimeError("P2PConnector: bind_kv_cache() must be called first")
        return self._server.address

    def bind_kv_cache(
        self, kv_cache: torch.Tensor, layout: KvLayout, model_fingerprint: str
    ) -> None:
        """Check the cache against ``layout`` and start the control server."""
        shape = tuple(kv_cache.shape)
        expect = (
            layout.num_layers,
            layout.planes,
            layout.block_size,
            layout.num_kv_heads,
            layout.head_dim,
        )
        if kv_cache.dim() != 6 or shape[:2] + shape[3:] != expect:
            raise ValueError(f"kv_cache shape {shape} does not match layout {layout}")
        if str(kv_cache.dtype) != f"torch.{layout.dtype}":
            raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not the layout's {layout.dtype}")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous")
        if not model_fingerprint:
            raise ValueError("model_fingerprint must be non-empty")
        if self._server is not None:
            raise RuntimeError("P2PConnector: bind_kv_cache() was called already")
        # An MLA latent cache (one plane) names its planes: a K/V peer's hello lacks the key
        # and is refused by name (server.py).
        layout_dict = layout_wire_dict(layout)
        identity = device_identity(kv_cache.device)
        self._kv, self._layout = kv_cache, layout
        serve = ServeConfig(
            kv_cache,
            layout_dict,
            model_fingerprint,
            identity,
            self.backend,
            self.timeout_s,
            self.batch_bytes,
            self._token,
        )
        self._server = PullServer(
            self.host, self.port, serve, self.leases, self.p2p, self.advertise_host
        )
        hello = {
            "layout": layout_dict,
            "fingerprint": model_fingerprint,
            "device": identity,
            "backend": self.backend,
        }
        self._link_config = LinkConfig(
            kv_cache, hello, self.batch_bytes, self.timeout_s, self._token
        )

    # -- scheduler side ---------------------------------------------------------------------
    def lookup(self, token_ids: list[int], block_hashes: list[bytes]) -> int:
        return 0

    # -- prefill side -----------------------------------------------------------------------
    def start_save(self, transfer: KVTransfer) -> None:
        """Hold the blocks under a lease; the save result (``held``) is ready at once."""
        kv = self._bound()
        self._check_ids(transfer, kv)
        lease = self.leases.offer(
            transfer.request_id, transfer.block_ids, transfer.block_hashes, record_ready(kv)
        )
        result = TransferResult(transfer.request_id, "save", True)
        result.held, result.transfer_id = True, lease.transfer_id
        result.source_address = self.address
        self._results.put(result)

    def release_held(self, request_id: str) -> bool:
        """Abort: end the request's lease now (or when the pull in progress finishes; the
        puller is told its data is void). False when the request holds no lease."""
        return self.leases.end_request(request_id, "aborted")

    def _lease_ended(self, lease: Lease, reason: str) -> None:
        result = TransferResult(lease.request_id, "release", reason == "pulled")
        if reason != "pulled":
            result.failure_reason = reason
        result.transfer_id = lease.transfer_id
        self._results.put(result)

    # -- decode side ------------------------------------------------------------------------
    def start_load(self, transfer: KVTransfer) -> None:
        """Queue a pull of blocks ``start_block..`` from ``transfer.source_address``."""
        kv = self._bound()
        self._check_ids(transfer, kv)
        if not transfer.source_address or not transfer.transfer_id:
            result = TransferResult(transfer.request_id, "load", False, failure_reason="missing")
            result.error = "the KV handle names no p2p source (source_address, transfer_id)"
            self._results.put(result)
            return
        if transfer.reshard is not None:  # blocks another grid split: pull and re-cut them
            from kv_store.p2p.reshard_pull import ReshardPull

            assert self._link_config is not None and self._layout is not None
            lc, layout = self._link_config, self._layout
            ReshardPull(transfer, kv, layout, lc, self.p2p, self._results.put, self.timeout_s)
            return
        job = PullJob(
            transfer, transfer.transfer_id, time.monotonic() + self.timeout_s, record_ready(kv)
        )
        while True:
            with self._lock:
                if self._closed.is_set():
                    raise RuntimeError("P2PConnector is closed")
                link = self._links.get(transfer.source_address)
                if link is None:
                    assert self._link_config is not None
                    link = PeerLink(
                        transfer.source_address,
                        self._link_config,
                        self.p2p,
                        self._results.put,
                        self._link_exited,
                        self.idle_s,
                    )
                    self._links[transfer.source_address] = link
            if link.submit(job):
                return
            self._link_exited(link)  # it went idle just now: make a fresh one

    def _link_exited(self, link: PeerLink) -> None:
        with self._lock:
            if self._links.get(link.address) is link:
                del self._links[link.address]

    # -- both -------------------------------------------------------------------------------
    def poll(self) -> list[TransferResult]:
        return self._results.drain()

    def wait(self, count: int, timeout_s: float) -> list[TransferResult]:
        """Block until ``count`` results arrived or ``timeout_s`` passed (tests, tools)."""
        return self._results.wait(count, timeout_s)

    def stats(self) -> ConnectorStats:
        return self.counters.snapshot()

    def transport_stats(self) -> P2PStats:
        """Leases (held, pinned, blocks held, ends by reason) and transfer times."""
        return self.p2p.snapshot()

    def close(self) -> None:
        """Stop serving and pulling; every held lease ends as ``closed``."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._server is not None:
            self._server.close()
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.close()
        self.leases.end_all("closed")

    # -- internals ----------------------------------------------------------------------------
    def _bound(self) -> torch.Tensor:
        if self._kv is None:
            raise RuntimeError("P2PConnector: bind_kv_cache() must be called first")
        return self._kv

    @staticmethod
    def _check_ids(t: KVTransfer, kv: torch.Tensor) -> None:
        n = len(t.block_hashes)
        if len(t.block_ids) != n or not 0 <= t.start_block <= n:
            raise ValueError(f"transfer {t.request_id}: malformed (ids/hashes/start_block)")
        bad = [b for b in t.block_ids[t.start_block :] if not 0 <= b < kv.shape[2]]
        if bad:
            raise ValueError(f"transfer {t.request_id}: block ids {bad[:4]} out of range")

    def _reap(self) -> None:
        interval = min(1.0, self.leases.lease_s / 4)
        while not self._closed.wait(interval):
            try:
                self.leases.reap()
            except Exception:  # noqa: BLE001 - keep reaping
                logger.exception("p2p lease reaper failed")
