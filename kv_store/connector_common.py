"""Plumbing shared by the connectors: cache binding checks, transfer validation, a small
worker pool with a result queue for ``poll``, and deadline bookkeeping."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kv_store.base import KVConnector, KvLayout, KVTransfer, TransferResult
from kv_store.record import torch_dtype
from kv_store.results import ResultQueue
from kv_store.stats import ConnectorStats

logger = logging.getLogger(__name__)


class TransferDeadline(Exception):
    """A transfer ran past its deadline (checked between batches)."""


class Deadline:
    """Absolute monotonic deadline; ``check()`` raises ``TransferDeadline`` once past it."""

    __slots__ = ("at",)

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def check(self) -> None:
        if time.monotonic() > self.at:
            raise TransferDeadline("transfer deadline exceeded")


class AsyncConnectorBase(KVConnector):
    """Runs each transfer as one job on a small thread pool; ``poll`` drains results."""

    def __init__(self, *, num_workers: int = 2, transfer_timeout_s: float = 30.0) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {transfer_timeout_s}")
        self.transfer_timeout_s = transfer_timeout_s
        self.counters = ConnectorStats()
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix=f"kv-{self.name}")
        self._results = ResultQueue()
        self._kv: torch.Tensor | None = None
        self._layout: KvLayout | None = None
        self._fingerprint = ""
        self._closed = False

    # -- binding ----------------------------------------------------------------------------
    def bind_kv_cache(
        self, kv_cache: torch.Tensor, layout: KvLayout, model_fingerprint: str
    ) -> None:
        """Check ``kv_cache`` is ``[layers, planes, blocks, block_size, kv_heads, head_dim]`` of
        the layout's dtype, contiguous; ``ValueError`` otherwise."""
        if not model_fingerprint:
            raise ValueError("model_fingerprint must be non-empty")
        want_dtype = torch_dtype(layout.dtype)
        shape = tuple(kv_cache.shape)
        expect = (
            layout.num_layers,
            layout.planes,
            layout.block_size,
            layout.num_kv_heads,
            layout.head_dim,
        )
        if kv_cache.dim() != 6 or (shape[:2] + shape[3:]) != expect:
            raise ValueError(
                f"kv_cache shape {shape} does not match layout [{layout.num_layers}, "
                f"{layout.planes}, blocks, {layout.block_size}, {layout.num_kv_heads}, "
                f"{layout.head_dim}]"
            )
        if kv_cache.dtype != want_dtype:
            raise ValueError(
                f"kv_cache dtype {kv_cache.dtype} does not match layout dtype {layout.dtype}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous")
        self._kv, self._layout, self._fingerprint = kv_cache, layout, model_fingerprint

    def _bound(self) -> tuple[torch.Tensor, KvLayout]:
        if self._kv is None or self._layout is None:
            raise RuntimeError(f"{type(self).__name__}: bind_kv_cache() must be called first")
        return self._kv, self._layout

    def _validate(self, t: KVTransfer) -> None:
        """``ValueError`` for a malformed transfer (engine bug or bad handle)."""
        kv, layout = self._bound()
        n = len(t.block_hashes)
        if len(t.block_ids) != n or len(t.block_num_tokens) != n:
            raise ValueError(
                f"transfer {t.request_id}: block_hashes/block_ids/block_num_tokens lengths differ "
                f"({n}/{len(t.block_ids)}/{len(t.block_num_tokens)})"
            )
        if not 0 <= t.start_block <= n:
            raise ValueError(f"transfer {t.request_id}: start_block {t.start_block} not in 0..{n}")
        num_blocks = kv.shape[2]
        for i in range(t.start_block, n):
            if not 0 <= t.block_ids[i] < num_blocks:
                raise ValueError(
                    f"transfer {t.request_id}: block id {t.block_ids[i]} not in 0..{num_blocks - 1}"
                )
            if not 1 <= t.block_num_tokens[i] <= layout.block_size:
                raise ValueError(
                    f"transfer {t.request_id}: block {i} has {t.block_num_tokens[i]} tokens "
                    f"(block size {layout.block_size})"
                )

    # -- jobs -------------------------------------------------------------------------------
    def _submit(self, t: KVTransfer, kind: str, job: Callable[[Deadline], TransferResult]) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        self._validate(t)
        self._pool.submit(self._run, t, kind, job)

    def _run(self, t: KVTransfer, kind: str, job: Callable[[Deadline], TransferResult]) -> None:
        start = time.perf_counter()
        try:
            result = job(Deadline(self.transfer_timeout_s))
        except Exception as e:  # a bug must surface as a failed transfer, never a lost one
            logger.exception("KV %s for %s failed unexpectedly", kind, t.request_id)
            result = TransferResult(
                t.request_id, kind, False, error=repr(e), failure_reason="error"
            )
        result.seconds = time.perf_counter() - start
        self.counters.record_seconds(kind, result.seconds)
        if result.failure_reason:
            self.counters.record_failure(result.failure_reason)
        self._results.put(result)

    def poll(self) -> list[TransferResult]:
        return self._results.drain()

    def wait(self, count: int, timeout_s: float) -> list[TransferResult]:
        """Block until ``count`` results arrived or ``timeout_s`` passed (tests, tools)."""
        return self._results.wait(count, timeout_s)

    def close(self) -> None:
        """Finish queued transfers (each bounded by its deadline) and stop the workers."""
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
