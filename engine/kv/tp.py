"""The engine's side of KV with tensor parallelism (docs/design.md §3, "KV with tensor
parallelism"): how KV messages travel between the ranks. What they say, how a worker rank
builds its connector and how the ranks' results merge is the connector's
(``kv_store.factory.across_ranks`` on rank 0, ``rank_worker`` on the others).

Rank 0 → workers: a KV message is a step header of op ``OP_KV`` followed by its JSON on
each worker's stdin (``MultiprocExecutor.send_kv``), so it reaches a worker in order with
the steps: a save is read after the step that wrote its blocks. Workers → rank 0: each
message is a key ``pdserve-tp/kv/{rank}/{seq}`` in the executor's private ``TCPStore``
(``seq`` counting from 0 per rank); rank 0 reads and deletes them in order, and only
while it waits for something, so idle steps cost no round trip. On a worker a thread
forwards what its connector finished.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from engine.distributed.tp_group import timedelta
from kv_store.base import KVConnectorWorker
from kv_store.factory import across_ranks as fan_out
from kv_store.factory import rank_worker

logger = logging.getLogger(__name__)

RESULT_KEY = "pdserve-tp/kv/{rank}/{seq}"
_POLL_S = 0.002  # how often a worker forwards its connector's results


@runtime_checkable
class WorkerPipes(Protocol):
    """What rank 0's channel needs of the ``MultiprocExecutor``: typed structurally, so the
    executor (whose workers build ``WorkerKV``) and this module do not import each other."""

    @property
    def size(self) -> int: ...

    @property
    def store_port(self) -> int: ...

    @property
    def timeout_s(self) -> float: ...

    def send_kv(self, payload: bytes) -> None: ...


class HasKvCache(Protocol):
    """A rank's model runner, as far as its connector is concerned: the paged cache."""

    kv_cache: torch.Tensor


def _client(port: int, timeout_s: float, host: str = "127.0.0.1") -> dist.TCPStore:
    return dist.TCPStore(host, port, None, False, timedelta(timeout_s), use_libuv=True)


class ExecutorChannel:
    """``RankChannel`` over a ``MultiprocExecutor``'s worker pipes and store."""

    def __init__(self, executor: WorkerPipes) -> None:
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


def across_ranks(connector: KVConnectorWorker, executor: object) -> KVConnectorWorker:
    """Rank 0's worker side of a tensor-parallel engine (not yet bound); ``executor`` is its
    ``MultiprocExecutor``."""
    assert isinstance(executor, WorkerPipes)
    return fan_out(connector, ExecutorChannel(executor), executor.timeout_s)


class WorkerKV:
    """A worker rank's KV messages: hands rank 0's to the connector's rank end and sends
    back its replies and, from a thread, its finished transfers."""

    def __init__(
        self,
        runner: HasKvCache,
        rank: int,
        store_port: int,
        timeout_s: float,
        store_host: str = "127.0.0.1",
        kv_host: str | None = None,
    ) -> None:
        """``store_host``: where rank 0's store is (another host for a pipeline stage that
        joined over the network); ``kv_host``: this process's own address for p2p pulls
        there (None: rank 0's, the same host)."""
        self.runner, self.rank = runner, rank
        self._store_port, self._timeout_s = store_port, timeout_s
        self._store_host = store_host
        self._store: dist.TCPStore | None = None  # connected at bind: most engines have no KV
        self._lock = threading.Lock()  # the store client and the sequence number
        self._seq = 0
        self._kv = rank_worker(rank, kv_host)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def handle(self, payload: bytes) -> None:
        """Act on one message from rank 0; starts transfers, never waits for them."""
        msg = json.loads(payload)
        if msg["op"] == "bind" and self._store is None:
            self._store = _client(self._store_port, self._timeout_s, self._store_host)
        for reply in self._kv.handle(msg, self.runner.kv_cache):
            if reply.get("op") == "bound" and reply.get("ok") and self._thread is None:
                self._thread = threading.Thread(
                    target=self._forward, name="tp-kv-results", daemon=True
                )
                self._thread.start()
            self._send(reply)
        if msg["op"] == "close":
            self._stop.set()

    def _send(self, message: dict[str, Any]) -> None:
        with self._lock:
            assert self._store is not None  # connected at bind, before any message
            key = RESULT_KEY.format(rank=self.rank, seq=self._seq)
            self._seq += 1
            self._store.set(key, json.dumps(message))

    def _forward(self) -> None:
        while not self._stop.wait(_POLL_S):
            try:
                for message in self._kv.poll():
                    self._send(message)
            except Exception:  # noqa: BLE001 - rank 0 is gone or the store is down
                logger.exception("rank %d could not report KV results", self.rank)
                return

    def close(self) -> None:
        self._stop.set()
        self._kv.close()
