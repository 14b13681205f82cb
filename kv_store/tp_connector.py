"""KV handoff between tensor-parallel instances: each rank moves its own shard
(docs/design.md §3, "KV with tensor parallelism"). With pipeline parallelism the ranks are
the P x N processes of the grid (global rank ``stage * N + tp_rank``), each moving its
stage's layers of its heads ("KV with pipeline parallelism"): the same code, more ranks.

With ``tensor_parallel_size`` N > 1 every rank's paged cache holds only its KV heads, so
every rank runs a connector of its own over its own cache: rank r of the prefill saves
(or, over p2p, offers) its shard, and rank r of the decode loads (pulls) it. Nothing is
gathered on rank 0.

- Store connectors (fs, redis): one record per block per rank, under the rank's own
  fingerprint ``{fingerprint}-r{rank}`` (``rank_fingerprint``); the engine fingerprint
  already names N (``-tp{N}``), and a record's header carries the shard's head count.
- p2p: rank r serves and pulls over its own control port and group; the handle's
  ``source_address`` and ``transfer_id`` list the N ranks' values in rank order, joined by
  ``,`` (``split_ranks``), and decode rank r pulls entry r from prefill rank r.

``TPConnector`` is rank 0's worker side (``KVConnectorWorker.across_ranks`` builds it): it
wraps rank 0's own worker, hands every save, load and release to the worker ranks through
the engine's ``RankChannel`` (in order with the steps, so a save reads blocks the step
before it wrote) and reports a transfer once every rank has: a load counts the blocks
*every* rank loaded (the engine recomputes the rest on all ranks), a save is held only when
every rank holds it, a release comes after the last rank's. The scheduler side (lookup,
counters) stays rank 0's connector. A worker rank's end of the messages is
``kv_store/tp_worker.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from kv_store.base import (
    KVConnectorWorker,
    KvLayout,
    KVTransfer,
    RankChannel,
    TransferResult,
    rank_fingerprint,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

RANK_SEP = ","


def split_ranks(value: str, size: int) -> list[str] | None:
    """The per-rank entries of a handle's ``source_address`` / ``transfer_id`` (rank order,
    ``,``-joined); None when their number is not ``size``."""
    parts = value.split(RANK_SEP) if value else []
    return parts if len(parts) == size else None


# -- what travels between the ranks (JSON) ---------------------------------------------------
def transfer_to_json(t: KVTransfer) -> dict[str, Any]:
    d = dataclasses.asdict(t)
    d["block_hashes"] = [h.hex() for h in t.block_hashes]
    return d


def transfer_from_json(d: dict[str, Any]) -> KVTransfer:
    d = dict(d)
    d["block_hashes"] = [bytes.fromhex(h) for h in d["block_hashes"]]
    return KVTransfer(**d)


def result_to_json(r: TransferResult) -> dict[str, Any]:
    return dataclasses.asdict(r)


def result_from_json(d: dict[str, Any]) -> TransferResult:
    return TransferResult(**d)


def merge_results(kind: str, parts: list[TransferResult]) -> TransferResult:
    """One result for the engine from every rank's (rank order) for the same transfer."""
    out = dataclasses.replace(parts[0], keys=list(parts[0].keys))
    out.ok = all(p.ok for p in parts)
    for rank, p in enumerate(parts):
        if not p.ok:
            out.failure_reason = p.failure_reason
            out.error = f"rank {rank}: {p.error}"
            break
    out.num_loaded_blocks = min(p.num_loaded_blocks for p in parts)
    out.num_saved_blocks = min(p.num_saved_blocks for p in parts)
    out.bytes_moved = sum(p.bytes_moved for p in parts)
    out.seconds = max(p.seconds for p in parts)
    if kind == "save":
        out.held = out.ok and all(p.held for p in parts)
        if out.held:
            out.transfer_id = RANK_SEP.join(p.transfer_id for p in parts)
            out.source_address = RANK_SEP.join(p.source_address for p in parts)
        else:
            out.transfer_id = out.source_address = ""
    return out


@dataclasses.dataclass(slots=True)
class _Pending:
    parts: dict[int, TransferResult] = dataclasses.field(default_factory=dict)


class TPConnector(KVConnectorWorker):
    """Rank 0's worker side of a tensor-parallel engine; see the module docstring."""

    def __init__(self, local: KVConnectorWorker, channel: RankChannel, timeout_s: float) -> None:
        """``local``: rank 0's own worker, which has a ``rank_spec`` (how a worker rank
        builds one of the same kind); ``timeout_s``: how long binding may take on the
        workers."""
        if local.rank_spec is None:
            raise ValueError(f"the {local.name!r} KV connector has no rank_spec")
        self.local, self.channel, self.timeout_s = local, channel, timeout_s
        self.spec: dict[str, Any] = local.rank_spec
        self.size = channel.size
        self.name = local.name
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._held: set[str] = set()  # saves held on every rank: a release follows

    def bind_kv_cache(
        self, kv_cache: torch.Tensor, layout: KvLayout, model_fingerprint: str
    ) -> None:
        """Bind rank 0's connector, then have every worker build and bind its own; raises
        ``RuntimeError`` naming the rank whose connector failed, or the deadline."""
        self.local.bind_kv_cache(
            kv_cache, layout, rank_fingerprint(model_fingerprint, 0, self.size)
        )
        self.channel.send(
            {
                "op": "bind",
                "spec": self.spec,
                "fingerprint": model_fingerprint,
                "size": self.size,
                "layout": dataclasses.asdict(layout),
            }
        )
        bound: set[int] = set()
        deadline = time.monotonic() + self.timeout_s
        while len(bound) < self.size - 1:
            for rank, msg in self.channel.receive():
                if msg.get("op") != "bound":
                    continue
                if not msg.get("ok"):
                    raise RuntimeError(f"KV connector of grid rank {rank}: {msg['error']}")
                bound.add(rank)
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.size)) - bound)
                raise RuntimeError(
                    f"KV connectors of grid ranks {missing} not bound within {self.timeout_s} s"
                )
            time.sleep(0.005)

    def start_save(self, transfer: KVTransfer) -> None:
        self._start((transfer.request_id, "save"), transfer, {})

    def _start(self, key: tuple[str, str], transfer: KVTransfer, extra: dict[str, Any]) -> None:
        """Rank 0 first: a transfer its connector refuses (raises) reaches no worker."""
        self._pending[key] = _Pending()
        try:
            if key[1] == "save":
                self.local.start_save(transfer)
            else:
                self.local.start_load(transfer)
        except Exception:
            del self._pending[key]
            raise
        self.channel.send({"op": key[1], "transfer": transfer_to_json(transfer), **extra})

    def start_load(self, transfer: KVTransfer) -> None:
        """A p2p handle names every rank's source; rank r pulls entry r. A handle listing
        another number of ranks fails the load (reason ``layout``): never a wrong shard."""
        extra: dict[str, Any] = {}
        # A re-cut load (another grid) names the prefill grid's sources: every rank reads
        # the whole list and pulls what it needs (kv_store/p2p/reshard_pull.py).
        if transfer.transfer_id and transfer.reshard is None:
            sources = split_ranks(transfer.source_address, self.size)
            ids = split_ranks(transfer.transfer_id, self.size)
            if sources is None or ids is None:
                self._refuse_load(transfer)
                return
            extra = {"sources": sources, "transfer_ids": ids}
            transfer = dataclasses.replace(transfer, source_address=sources[0], transfer_id=ids[0])
        self._start((transfer.request_id, "load"), transfer, extra)

    def _refuse_load(self, transfer: KVTransfer) -> None:
        error = (
            f"the KV handle lists {len(transfer.transfer_id.split(RANK_SEP))} p2p sources; "
            f"this instance moves its KV over {self.size} processes (its tensor- x "
            "pipeline-parallel grid)"
        )
        result = TransferResult(transfer.request_id, "load", False, failure_reason="layout")
        result.error = error
        parts = {r: result for r in range(self.size)}
        self._pending[(transfer.request_id, "load")] = _Pending(parts)

    def release_held(self, request_id: str) -> bool:
        self.channel.send({"op": "release", "request_id": request_id})
        return self.local.release_held(request_id)

    def poll(self) -> list[TransferResult]:
        """Transfers every rank has finished (non-blocking)."""
        arrived = [(0, r) for r in self.local.poll()]
        if self._pending or self._held:  # the workers have something to report
            arrived += [
                (rank, result_from_json(msg["result"]))
                for rank, msg in self.channel.receive()
                if msg.get("op") == "result"
            ]
        for rank, result in arrived:
            key = (result.request_id, result.kind)
            if key not in self._pending:
                # A release follows a save held on every rank; one of a save that failed on
                # some rank (its lease ended early, above) concerns nobody.
                expected = result.request_id in self._held or (result.request_id, "save") in (
                    self._pending
                )
                if result.kind != "release" or not expected:
                    if result.kind != "release":
                        logger.warning("result from rank %d for an unknown transfer %s", rank, key)
                    continue
                self._pending[key] = _Pending()
            self._pending[key].parts[rank] = result
        done = []
        for key, pending in list(self._pending.items()):
            if len(pending.parts) < self.size:
                continue
            del self._pending[key]
            merged = merge_results(key[1], [pending.parts[r] for r in range(self.size)])
            if not merged.ok:
                logger.info(
                    "KV %s %s failed (%s): %s", key[1], key[0], merged.failure_reason, merged.error
                )
            if key[1] == "save" and merged.held:
                self._held.add(key[0])
            elif key[1] == "save" and any(p.held for p in pending.parts.values()):
                self.release_held(key[0])  # some ranks hold a save that failed elsewhere
            elif key[1] == "release":
                self._held.discard(key[0])
            done.append(merged)
        return done

    def close(self) -> None:
        try:
            self.channel.send({"op": "close"})
        except Exception as e:  # noqa: BLE001 - the workers may be gone already
            logger.info("could not tell the workers to close their KV connectors: %s", e)
        self.local.close()
