"""A worker rank's end of the tensor-parallel KV messages (docs/design.md §3, "KV with
tensor parallelism"; rank 0's end is ``kv_store/tp_connector.py``).

The engine's worker process hands every message rank 0 sent (``bind | save | load |
release | close``) to ``TPRankWorker.handle`` and sends back what it returns and what
``poll`` finds; how messages travel between the ranks is the engine's
(``engine/kv/tp.py``). On ``bind`` the rank builds its own connector from rank 0's
``rank_spec`` and binds it to its own cache under its rank's fingerprint; a save or load
then moves this rank's shard only, and a p2p load pulls from the same rank of the source.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kv_store.base import KVConnector, KvLayout, TransferResult, rank_fingerprint
from kv_store.tp_connector import result_to_json, transfer_from_json

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class TPRankWorker:
    """Rank ``rank``'s connector, built at ``bind``; see the module docstring."""

    def __init__(
        self,
        rank: int,
        build: Callable[[dict[str, Any], int], KVConnector],
        host: str | None = None,
    ) -> None:
        """``build``: how this rank makes its connector from rank 0's ``rank_spec``
        (``kv_store.factory.build_worker_connector``, handed in so that this module never
        imports the factory that imports it)."""
        self.rank, self.build = rank, build
        self.host = host  # this rank's own address (another host than rank 0's), or None
        self.connector: KVConnector | None = None

    def handle(self, msg: dict[str, Any], kv_cache: torch.Tensor) -> list[dict[str, Any]]:
        """Act on one message from rank 0; returns the replies to send it now. Starts
        transfers, never waits for them."""
        op = msg["op"]
        if op == "bind":
            return [self._bind(msg, kv_cache)]
        if op == "close":
            self.close()
            return []
        if self.connector is None:
            raise RuntimeError(f"KV message {op!r} before the connector was bound")
        if op == "release":
            self.connector.release_held(msg["request_id"])
            return []
        if op not in ("save", "load"):
            raise ValueError(f"unknown KV message {op!r}")
        t = transfer_from_json(msg["transfer"])
        if t.reshard is not None:  # a load re-cut from another grid: this rank's part of it
            t.reshard = dict(t.reshard, dest_rank=self.rank)
        if "sources" in msg:  # p2p: this rank pulls from the same rank of the source
            t.source_address = msg["sources"][self.rank]
            t.transfer_id = msg["transfer_ids"][self.rank]
        try:
            if op == "save":
                self.connector.start_save(t)
            else:
                self.connector.start_load(t)
        except Exception as e:  # noqa: BLE001 - a failed transfer, not a dead rank
            logger.exception("rank %d: KV %s of %s refused", self.rank, op, t.request_id)
            failed = TransferResult(t.request_id, op, False, failure_reason="layout")
            failed.error = f"{type(e).__name__}: {e}"
            return [{"op": "result", "result": result_to_json(failed)}]
        return []

    def _bind(self, msg: dict[str, Any], kv: torch.Tensor) -> dict[str, Any]:
        try:
            spec = msg["spec"]
            if self.host:  # a pipeline stage on another host serves its pulls there
                settings = dict(spec["settings"], p2p_host=self.host)
                spec = dict(spec, host=self.host, settings=settings)
            connector = self.build(spec, self.rank)
            layout = KvLayout(
                int(msg["layout"]["version"]),
                str(msg["layout"]["dtype"]),
                int(kv.shape[3]),
                int(kv.shape[0]),
                int(kv.shape[4]),
                int(kv.shape[5]),
                planes=int(kv.shape[1]),
            )
            fingerprint = rank_fingerprint(msg["fingerprint"], self.rank, int(msg["size"]))
            connector.bind_kv_cache(kv, layout, fingerprint)
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which fails start-up
            logger.exception("KV connector of rank %d failed to start", self.rank)
            return {"op": "bound", "ok": False, "error": f"{type(e).__name__}: {e}"}
        self.connector = connector
        return {"op": "bound", "ok": True}

    def poll(self) -> list[dict[str, Any]]:
        """Results of the transfers this rank finished since the last call."""
        connector = self.connector
        if connector is None:
            return []
        return [{"op": "result", "result": result_to_json(r)} for r in connector.poll()]

    def close(self) -> None:
        connector, self.connector = self.connector, None
        if connector is not None:
            connector.close()
