"""``P2PWithStore``: the p2p handoff composed with a store connector (``--connector p2p
--kv-store fs|redis|lmcache``); the nixl handoff composes the same way (``--connector
nixl --kv-store ...``: same lease contract, so the same rules).

- Save: the blocks are offered for a pull (the engine streams the handle at once) *and*
  written to the store, whose keys ride in the same handle. The engine frees them only when
  both are done: the lease has ended and the store has its copy.
- Load: a handle with a transfer id is pulled; whatever the pull did not bring (the peer is
  gone, the lease ended, a deadline) is loaded from the store; what neither has is
  recomputed by the engine as usual. A handle without a transfer id loads from the store.
- Lookup: the store's, so decode instances reuse prefixes across requests and instances.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kv_store.base import KVConnector, KvLayout, KVTransfer, TransferResult
from kv_store.keys import block_keys
from kv_store.p2p.stats import P2PStats
from kv_store.stats import ConnectorStats

if TYPE_CHECKING:
    from kv_store.nixl.connector import NixlConnector
    from kv_store.p2p.connector import P2PConnector

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Save:
    keys: list[str]
    held: bool = True  # the p2p lease has not ended yet
    storing: bool = True  # the store save is in flight
    release: TransferResult | None = None  # the p2p release, passed on once both are done


class P2PWithStore(KVConnector):
    """See the module docstring. Results reach the engine as if from one connector."""

    def __init__(self, p2p: P2PConnector | NixlConnector, store: KVConnector) -> None:
        """``p2p``: the handoff, either p2p connector or nixl (the same lease contract)."""
        self.p2p, self.store = p2p, store
        self.name = f"{p2p.name}+{store.name}"
        self._fingerprint = ""
        self._lock = threading.Lock()
        self._saves: dict[str, _Save] = {}
        self._pulls: dict[str, KVTransfer] = {}  # loads in flight over p2p
        self._fallbacks: dict[str, int] = {}  # store loads after a short pull -> blocks pulled

    @property
    def address(self) -> str:
        return self.p2p.address

    def bind_kv_cache(
        self, kv_cache: torch.Tensor, layout: KvLayout, model_fingerprint: str
    ) -> None:
        self.p2p.bind_kv_cache(kv_cache, layout, model_fingerprint)
        self.store.bind_kv_cache(kv_cache, layout, model_fingerprint)
        self._fingerprint = model_fingerprint

    def lookup(self, token_ids: list[int], block_hashes: list[bytes]) -> int:
        return self.store.lookup(token_ids, block_hashes)

    # -- save: offer and store; released when both are done ------------------------------------
    def start_save(self, transfer: KVTransfer) -> None:
        keys = block_keys(self._fingerprint, transfer.block_hashes)
        with self._lock:
            self._saves[transfer.request_id] = _Save(keys)
        self.p2p.start_save(transfer)
        self.store.start_save(transfer)

    def release_held(self, request_id: str) -> bool:
        return self.p2p.release_held(request_id)

    def _save_part_done(
        self, request_id: str, p2p_release: TransferResult | None
    ) -> list[TransferResult]:
        """The lease ended (``p2p_release``) or the store save finished (None); the engine
        hears "release" once both have."""
        with self._lock:
            save = self._saves.get(request_id)
            if save is None:
                return [p2p_release] if p2p_release is not None else []
            if p2p_release is not None:
                save.held, save.release = False, p2p_release
            else:
                save.storing = False
            if save.held or save.storing:
                return []
            del self._saves[request_id]
        return [save.release or TransferResult(request_id, "release", True)]

    # -- load: pull, then the store for what the pull did not bring ----------------------------
    def start_load(self, transfer: KVTransfer) -> None:
        if not transfer.transfer_id:
            self.store.start_load(transfer)
            return
        with self._lock:
            self._pulls[transfer.request_id] = transfer
        self.p2p.start_load(transfer)

    def poll(self) -> list[TransferResult]:
        out: list[TransferResult] = []
        for r in self.p2p.poll():
            out += self._from_p2p(r)
        for r in self.store.poll():
            out += self._from_store(r)
        return out

    def _from_p2p(self, r: TransferResult) -> list[TransferResult]:
        if r.kind == "save":
            with self._lock:
                save = self._saves.get(r.request_id)
            r.keys = list(save.keys) if save is not None else []  # the decode's fallback
            return [r]
        if r.kind == "release":
            return self._save_part_done(r.request_id, r)
        with self._lock:
            transfer = self._pulls.pop(r.request_id, None)
        if r.ok or transfer is None:
            return [r]
        logger.info(
            "p2p pull of %s fell short (%s); loading the rest from the store",
            r.request_id,
            r.failure_reason,
        )
        pulled = r.num_loaded_blocks
        with self._lock:
            self._fallbacks[r.request_id] = pulled
        rest = dataclasses.replace(transfer, start_block=transfer.start_block + pulled)
        self.store.start_load(rest)
        return []

    def _from_store(self, r: TransferResult) -> list[TransferResult]:
        if r.kind == "save":
            if not r.ok:
                logger.warning("store copy of %s failed: %s", r.request_id, r.error)
            return self._save_part_done(r.request_id, None)
        with self._lock:
            pulled = self._fallbacks.pop(r.request_id, 0)
        r.num_loaded_blocks += pulled
        return [r]

    def stats(self) -> ConnectorStats:
        """The two connectors' counters, summed (per-connector figures: ``transport_stats``
        and the store's own)."""
        a, b = self.p2p.stats(), self.store.stats()
        failures = dict(a.failures)
        for reason, n in b.failures.items():
            failures[reason] = failures.get(reason, 0) + n
        summed = {f: getattr(a, f) + getattr(b, f) for f in _NUMERIC}
        return ConnectorStats(**summed, failures=failures)

    def transport_stats(self) -> P2PStats:
        return self.p2p.transport_stats()

    def close(self) -> None:
        self.p2p.close()
        self.store.close()


_NUMERIC = (
    "blocks_saved",
    "bytes_saved",
    "blocks_skipped",
    "save_seconds",
    "blocks_loaded",
    "bytes_loaded",
    "load_seconds",
    "lookups",
)
