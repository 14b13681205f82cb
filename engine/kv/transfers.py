"""Engine side of KV transfer: starts loads and saves through the connector's worker side
(``KVConnectorWorker``: this process's connector, or its fan-out over tensor-parallel
ranks) and turns its completions into outcomes (``TransferOutcomes``) that the engine acts
on; it finishes and frees nothing itself. Owns the in-flight transfer tables and the
engine's held/finished bookkeeping of blocks (docs/design.md §3, "Connector")."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.block_hash import hash_block_tokens
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import KvSaveResult
from engine.core.request import Request, RequestStatus
from kv_store.base import KVConnector, KVConnectorWorker, KVTransfer, TransferResult

if TYPE_CHECKING:
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TransferStats:
    loads_started: int = 0
    blocks_loaded: int = 0
    blocks_recomputed: int = 0
    # Handoffs: prompt blocks the decode already held (its prefix cache), which no load
    # moved (docs/design.md §3 "Delta handoffs").
    blocks_local: int = 0
    load_fallbacks: Counter[str] = field(default_factory=Counter)
    saves_started: int = 0
    save_failures: int = 0


@dataclass(slots=True)
class LoadOutcome:
    """A finished load. ``aborted``: the request was aborted while its blocks were being
    written; the engine finishes it now (its blocks may be freed)."""

    request: Request
    ok: bool
    seconds: float
    blocks_loaded: int
    blocks_recomputed: int
    error: str | None = None
    aborted: bool = False
    bytes_loaded: int = 0


@dataclass(slots=True)
class TransferOutcomes:
    """What one ``poll`` found; the engine acts on it (the coordinator finishes nothing)."""

    loads: list[LoadOutcome] = field(default_factory=list)
    saves: list[tuple[Request, KvSaveResult]] = field(default_factory=list)
    released: list[Request] = field(default_factory=list)  # held blocks the peer let go


def prompt_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """The prompt's block hashes, partial tail included, reusing the request's own chain
    (computed once as its blocks fill) instead of hashing the prompt again."""
    prompt = request.prompt_token_ids
    request.update_block_hashes(block_size)  # no-op when already current
    n_full = len(prompt) // block_size
    hashes = request.block_hashes[:n_full]
    if len(prompt) % block_size:
        parent = hashes[-1] if hashes else request.hash_root
        hashes.append(hash_block_tokens(parent, prompt[n_full * block_size :]))
    return hashes


def kv_worker(connector: KVConnector, config: EngineConfig, executor: object) -> KVConnectorWorker:
    """The worker side the engine moves bytes through (not yet bound): the connector itself,
    or with N > 1 ranks its fan-out over ``executor`` (the ``MultiprocExecutor``; untyped
    here, the executor sits above this package), every rank moving its own KV shard
    (docs/design.md §3, "KV with tensor parallelism")."""
    if config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1:
        return connector
    # Only grids need it; with P > 1 its ranks are the P x N processes (stage-major).
    from engine.kv.tp import across_ranks

    return across_ranks(connector, executor)


class KVTransferCoordinator:
    def __init__(
        self, connector: KVConnectorWorker, kv: KVCacheManager, failure_policy: str
    ) -> None:
        self.connector = connector
        self.kv = kv
        self.failure_policy = failure_policy
        self.block_size = kv.block_size
        self.stats = TransferStats()
        self._awaiting_blocks: list[Request] = []  # remote-KV requests not yet allocated
        self._loading: dict[str, tuple[Request, float, int]] = {}  # id -> (req, t0, start_block)
        self._saving: dict[str, tuple[Request, float]] = {}
        self._aborted: set[str] = set()
        # Saves the connector holds for a peer to pull (p2p): their blocks stay allocated
        # until its "release" result. Aborted before the save was reported: end at once.
        self._held: dict[str, Request] = {}
        self._release_when_saved: set[str] = set()

    def has_work(self) -> bool:
        return bool(self._awaiting_blocks or self._loading or self._saving or self._held)

    def num_waiting_for_kv(self) -> int:
        return len(self._awaiting_blocks) + len(self._loading)

    def _transfer(self, request: Request, start_block: int) -> KVTransfer:
        prompt = request.prompt_token_ids
        hashes = prompt_block_hashes(request, self.block_size)
        ids = self.kv.block_ids(request.request_id)[: len(hashes)]
        sizes = [
            min(self.block_size, len(prompt) - i * self.block_size) for i in range(len(hashes))
        ]
        t = KVTransfer(request.request_id, list(prompt), hashes, ids, sizes, start_block)
        if request.remote_kv is not None:
            t.source_address = request.remote_kv.source_address
            t.transfer_id = request.remote_kv.transfer_id
            t.reshard = request.remote_kv.reshard
        return t

    # -- consumer -------------------------------------------------------------------------
    def add_remote(self, request: Request) -> None:
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._awaiting_blocks.append(request)

    def start_pending_loads(self) -> list[Request]:
        """Allocate blocks for remote-KV requests and start their loads. Returns requests
        that need no load at all (everything was in the local prefix cache)."""
        ready, still = [], []
        for request in self._awaiting_blocks:
            hits, hit_tokens = self.kv.get_computed_blocks(request)
            prompt_len = request.num_prompt_tokens
            if self.kv.allocate_slots(request, prompt_len - hit_tokens, hits) is None:
                still.append(request)
                continue
            request.num_computed_tokens = hit_tokens
            request.num_cached_tokens = hit_tokens
            # The delta: the load moves only the blocks after what this instance holds.
            request.kv_blocks_local = len(hits)
            self.stats.blocks_local += len(hits)
            n_remote = -(
                -min(prompt_len, request.remote_kv.num_tokens if request.remote_kv else 0)
                // self.block_size
            )
            # A held (p2p) source is pulled even when nothing is missing: the pull of no
            # blocks is what tells the prefill side to free them now, not at lease end.
            if len(hits) >= n_remote and not _held_remotely(request):
                ready.append(request)
                continue
            self.connector.start_load(self._transfer(request, len(hits)))
            self._loading[request.request_id] = (request, time.monotonic(), len(hits))
            self.stats.loads_started += 1
        self._awaiting_blocks = still
        return ready

    def _finish_load(self, result: TransferResult) -> LoadOutcome:
        request, t0, start = self._loading.pop(result.request_id)
        if result.request_id in self._aborted:
            self._aborted.discard(result.request_id)
            return LoadOutcome(request, False, time.monotonic() - t0, 0, 0, aborted=True)
        n_remote = -(
            -min(
                request.num_prompt_tokens, request.remote_kv.num_tokens if request.remote_kv else 0
            )
            // self.block_size
        )
        loaded = result.num_loaded_blocks
        covered = min((start + loaded) * self.block_size, request.num_prompt_tokens)
        request.num_computed_tokens = min(
            max(covered, request.num_computed_tokens), request.num_tokens - 1
        )
        missing = max(0, n_remote - start - loaded)
        self.stats.blocks_loaded += loaded
        self.stats.blocks_recomputed += missing
        if missing:
            reason = result.failure_reason or "missing"
            self.stats.load_fallbacks[reason] += 1
            logger.warning(
                "request %s: %d KV blocks not loaded (%s): %s",
                request.request_id,
                missing,
                reason,
                "failing" if self.failure_policy == "fail" else "recomputing",
            )
        self.kv.cache_blocks(request, request.num_computed_tokens)
        ok = not (missing and self.failure_policy == "fail")
        error = (
            None if ok else f"KV load failed ({result.failure_reason or 'missing'}): {result.error}"
        )
        outcome = LoadOutcome(request, ok, time.monotonic() - t0, loaded, missing, error)
        outcome.bytes_loaded = result.bytes_moved
        return outcome

    # -- producer -------------------------------------------------------------------------
    def start_save(self, request: Request) -> None:
        self.connector.start_save(self._transfer(request, 0))
        self._saving[request.request_id] = (request, time.monotonic())
        self.stats.saves_started += 1

    def _finish_save(self, result: TransferResult) -> tuple[Request, KvSaveResult]:
        request, t0 = self._saving.pop(result.request_id)
        if not result.ok:
            self.stats.save_failures += 1
            logger.warning("request %s: KV save failed: %s", request.request_id, result.error)
        saved = KvSaveResult(
            result.keys,
            request.num_prompt_tokens if result.ok else 0,
            result.num_saved_blocks if result.ok else 0,
            time.monotonic() - t0,
            None if result.ok else (result.error or "save failed"),
        )
        if result.ok and result.held:
            saved.held, saved.transfer_id = True, result.transfer_id
            saved.source_address = result.source_address
            self._held[request.request_id] = request
            if request.request_id in self._release_when_saved:
                self.connector.release_held(request.request_id)
        self._release_when_saved.discard(request.request_id)
        return request, saved

    def release_held(self, request_id: str) -> bool:
        """Abort of a finished prefill whose blocks a peer may still pull: end the hold
        (the blocks are freed when the connector reports the release)."""
        if request_id in self._held:
            return self.connector.release_held(request_id)
        if request_id in self._saving:
            self._release_when_saved.add(request_id)
            return True
        return False

    # -- both -----------------------------------------------------------------------------
    def poll(self) -> TransferOutcomes:
        """The connector's finished transfers, as outcomes for the engine to act on."""
        found = TransferOutcomes()
        for result in self.connector.poll():
            if result.kind == "load" and result.request_id in self._loading:
                found.loads.append(self._finish_load(result))
            elif result.kind == "save" and result.request_id in self._saving:
                found.saves.append(self._finish_save(result))
            elif result.kind == "release" and result.request_id in self._held:
                found.released.append(self._held.pop(result.request_id))
        return found

    def abort(self, request: Request) -> bool:
        """Returns True if the request's blocks may be freed now (no transfer reads or
        writes them); otherwise they are freed when the transfer completes."""
        if request in self._awaiting_blocks:
            self._awaiting_blocks.remove(request)
            if _held_remotely(request):  # a pull of no blocks ends the peer's hold now
                remote = request.remote_kv
                assert remote is not None
                drop = KVTransfer(f"{request.request_id}#drop", [], [], [], [])
                drop.source_address, drop.transfer_id = remote.source_address, remote.transfer_id
                drop.reshard = remote.reshard  # another grid's leases: each process ends its own
                self.connector.start_load(drop)
            return True
        if request.request_id in self._loading:
            self._aborted.add(request.request_id)
            return False
        return request.request_id not in self._saving


def _held_remotely(request: Request) -> bool:
    """The request's KV waits in a peer's cache under a lease (p2p), not in a store."""
    return request.remote_kv is not None and bool(request.remote_kv.transfer_id)
