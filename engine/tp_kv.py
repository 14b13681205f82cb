"""KV connectors on every tensor-parallel rank (docs/design.md §3, "KV with tensor
parallelism"; the merging rules are ``kv_store/tp_connector.py``'s).

Rank 0 → workers: a KV message is a step header of op ``OP_KV`` followed by its JSON on
each worker's stdin (``MultiprocExecutor.send_kv``), so it reaches a worker in order with
the steps: a save is read after the step that wrote its blocks. Workers → rank 0: each
result is a key ``pdserve-tp/kv/{rank}/{seq}`` in the executor's private ``TCPStore``
(``seq`` counting from 0 per rank); rank 0 reads and deletes them in order, and only
while it waits for something (``TPConnector.poll``), so idle steps cost no round trip.

A worker builds its connector when rank 0's ``bind`` arrives (from the recipe rank 0's
connector was built with), binds it to its own cache under its rank's fingerprint, and a
thread forwards the connector's results.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from engine.tp_group import timedelta
from kv_store.base import KVConnector, KvLayout, TransferResult
from kv_store.tp_connector import (
    TPConnector,
    rank_fingerprint,
    result_to_json,
    transfer_from_json,
)

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner
    from engine.tp_executor import MultiprocExecutor

logger = logging.getLogger(__name__)

RESULT_KEY = "pdserve-tp/kv/{rank}/{seq}"
_POLL_S = 0.002  # how often a worker forwards its connector's results


def _client(port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, False, timedelta(timeout_s), use_libuv=True)


class ExecutorChannel:
    """``RankChannel`` over a ``MultiprocExecutor``'s worker pipes and store."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        self.size = executor.size
        self._executor = executor
        self._store = _client(executor.store_port, executor.timeout_s)
        self._next = dict.fromkeys(range(1, self.size), 0)

    def send(self, message: dict[str, Any]) -> None:
        self._executor.send_kv(json.dumps(message).encode())

    def receive(self) -> list[tuple[int, dict[str, Any]]]:
        out = []
        for rank in self._next:
            while True:
                key = RESULT_KEY.format(rank=rank, seq=self._next[rank])
                if not self._store.check([key]):
                    break
                out.append((rank, json.loads(self._store.get(key))))
                self._store.delete_key(key)
                self._next[rank] += 1
        return out


def attach_tp_connector(connector: KVConnector, executor: object) -> TPConnector:
    """Rank 0's connector for a tensor-parallel engine (not yet bound); ``executor`` is its
    ``MultiprocExecutor``."""
    from engine.tp_executor import MultiprocExecutor

    assert isinstance(executor, MultiprocExecutor)
    recipe = connector.worker_recipe
    if recipe is None:
        raise ValueError(tp_refusal(connector))
    return TPConnector(connector, ExecutorChannel(executor), recipe, executor.timeout_s)


def tp_refusal(connector: KVConnector) -> str:
    return (
        f"the {connector.name!r} KV connector cannot serve tensor_parallel_size > 1 (it keys "
        "KV by token prefix, not per-rank records); use --connector fs, redis or p2p"
    )


class WorkerKV:
    """A worker rank's connector and the thread that reports its results to rank 0."""

    def __init__(self, runner: ModelRunner, rank: int, store_port: int, timeout_s: float) -> None:
        self.runner, self.rank = runner, rank
        self._store_port, self._timeout_s = store_port, timeout_s
        self._store: dist.TCPStore | None = None  # connected at bind: most engines have no KV
        self._lock = threading.Lock()  # the store client and the sequence number
        self._seq = 0
        self.connector: KVConnector | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def handle(self, payload: bytes) -> None:
        """Act on one message from rank 0; starts transfers, never waits for them."""
        msg = json.loads(payload)
        op = msg["op"]
        if op == "bind":
            self._bind(msg)
            return
        if op == "close":
            self.close()
            return
        if self.connector is None:
            raise RuntimeError(f"KV message {op!r} before the connector was bound")
        if op == "release":
            self.connector.release_held(msg["request_id"])
            return
        if op not in ("save", "load"):
            raise ValueError(f"unknown KV message {op!r}")
        t = transfer_from_json(msg["transfer"])
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
            self._send({"op": "result", "result": result_to_json(failed)})

    def _bind(self, msg: dict[str, Any]) -> None:
        from kv_store.factory import build_worker_connector

        self._store = _client(self._store_port, self._timeout_s)
        try:
            connector = build_worker_connector(msg["recipe"], self.rank)
            kv = self.runner.kv_cache
            layout = KvLayout(
                int(msg["layout"]["version"]),
                str(msg["layout"]["dtype"]),
                int(kv.shape[3]),
                int(kv.shape[0]),
                int(kv.shape[4]),
                int(kv.shape[5]),
            )
            fingerprint = rank_fingerprint(msg["fingerprint"], self.rank, int(msg["size"]))
            connector.bind_kv_cache(kv, layout, fingerprint)
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which fails start-up
            logger.exception("KV connector of rank %d failed to start", self.rank)
            self._send({"op": "bound", "ok": False, "error": f"{type(e).__name__}: {e}"})
            return
        self.connector = connector
        self._thread = threading.Thread(target=self._forward, name="tp-kv-results", daemon=True)
        self._thread.start()
        self._send({"op": "bound", "ok": True})

    def _send(self, message: dict[str, Any]) -> None:
        with self._lock:
            assert self._store is not None  # connected in _bind, before any message
            key = RESULT_KEY.format(rank=self.rank, seq=self._seq)
            self._seq += 1
            self._store.set(key, json.dumps(message))

    def _forward(self) -> None:
        while not self._stop.wait(_POLL_S):
            connector = self.connector
            if connector is None:
                return
            try:
                for result in connector.poll():
                    self._send({"op": "result", "result": result_to_json(result)})
            except Exception:  # noqa: BLE001 - rank 0 is gone or the store is down
                logger.exception("rank %d could not report KV results", self.rank)
                return

    def close(self) -> None:
        self._stop.set()
        connector, self.connector = self.connector, None
        if connector is not None:
            connector.close()
