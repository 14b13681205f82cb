"""``BlockStoreConnector``: a ``KVConnector`` over any ``StorageBackend`` (fs, redis).

Each block of a request is one record under ``pdserve/{fingerprint}/{block_hash}``. Saves
skip blocks the store already holds (content-addressed keys make the store a shared,
deduplicated prefix cache), copy the rest out of the paged cache, encode and put them in
batches. Loads read batch by batch, verify each record and copy it into the cache, stopping
at the first missing or corrupt block: ``num_loaded_blocks`` counts the intact leading
blocks and ``failure_reason`` says why the rest did not load. A record that fails
verification is deleted, so the next save rewrites it instead of every load failing on it.
With a ``RecordMac`` (``--kv-secret``), records are sealed for their key on save and a
record whose MAC does not verify fails like a corrupt one, with reason ``"mac"``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
import torch

from kv_store.backend import Blob, StorageBackend, VectoredBackend
from kv_store.base import KvLayout, KVRecordError, KVStoreError, KVTransfer, TransferResult
from kv_store.connector_common import AsyncConnectorBase, Deadline, TransferDeadline
from kv_store.keys import block_keys
from kv_store.record import (
    HEADER_SIZE,
    RecordChecksumError,
    RecordLayoutError,
    block_parts,
    cache_numpy,
    check_record_parts,
    copy_into,
    decode_block,
    encode_block,
    record_header,
    record_size,
)
from kv_store.record_mac import RecordMac, RecordMacError
from kv_store.staging import Staging

logger = logging.getLogger(__name__)


def record_failure_reason(err: KVRecordError) -> str:
    """``"checksum"`` | ``"mac"`` | ``"layout"`` | ``"corrupt"`` for a record error."""
    if isinstance(err, RecordChecksumError):
        return "checksum"
    if isinstance(err, RecordMacError):
        return "mac"
    if isinstance(err, RecordLayoutError):
        return "layout"
    return "corrupt"


def _drop_bad_record(backend: StorageBackend, key: str, err: KVRecordError) -> None:
    """Best effort; writes are atomic, so a bad record is bad for every reader."""
    logger.warning("deleting bad KV record %s: %s", key, err)
    try:
        backend.delete([key])
    except KVStoreError as e:
        logger.warning("could not delete bad KV record %s: %s", key, e)


class BlockStoreConnector(AsyncConnectorBase):
    """Moves blocks between the bound paged cache and ``backend``: ``num_workers``
    transfers at a time, each split into batches of ``batch_blocks`` records that
    ``io_threads`` threads encode/put or get/verify/copy concurrently."""

    def __init__(
        self,
        backend: StorageBackend,
        *,
        name: str = "block",
        num_workers: int = 2,
        batch_blocks: int = 8,
        transfer_timeout_s: float = 30.0,
        io_threads: int | None = None,
        staged: bool | None = None,
        mac: RecordMac | None = None,
    ) -> None:
        """``staged`` (default: when the bound cache is on a GPU) moves each batch of
        blocks through a per-I/O-thread host staging buffer in one copy per direction;
        tests force it for a CPU cache to run the same path. ``mac``: seal and verify
        records with the deployment's KV secret (None: checksums only)."""
        if batch_blocks < 1:
            raise ValueError(f"batch_blocks must be >= 1, got {batch_blocks}")
        self.name = name
        super().__init__(num_workers=num_workers, transfer_timeout_s=transfer_timeout_s)
        # Default: one I/O thread per core, 2..4 — copies and CRC are CPU work.
        io_threads = io_threads or max(2, min(4, os.cpu_count() or 2))
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.backend = backend
        self.batch_blocks = batch_blocks
        self.mac = mac
        # Batches of one transfer run in parallel here: the copies, CRC and file/socket I/O
        # all release the GIL. Separate from the per-transfer pool so it cannot deadlock.
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix=f"kv-{name}-io")
        self._tls = threading.local()
        self._kv_np: np.ndarray | None = None  # the CPU cache as numpy, for the direct paths
        self._staged_opt = staged
        self._staged = False  # batches go through Staging (GPU cache, fs/redis backend)

    def bind_kv_cache(
        self, kv_cache: torch.Tensor, layout: KvLayout, model_fingerprint: str
    ) -> None:
        super().bind_kv_cache(kv_cache, layout, model_fingerprint)
        self.backend.limit_value_bytes(record_size(layout, layout.block_size))
        # CPU cache: fs records go cache -> file (writev) and file -> cache (readv), Redis
        # ones cache -> socket (sendmsg) and socket -> cache (recvmsg_into), without being
        # assembled in a buffer.
        direct = isinstance(self.backend, VectoredBackend) and self.backend.vectored_io
        on_gpu = kv_cache.device.type == "cuda"
        self._staged = direct and (on_gpu if self._staged_opt is None else self._staged_opt)
        self._kv_np = cache_numpy(kv_cache) if direct and not self._staged else None

    # -- scheduler side ---------------------------------------------------------------------
    def lookup(self, token_ids: list[int], block_hashes: list[bytes]) -> int:
        """Leading blocks held by the store; 0 if it is unreachable (logged, counted)."""
        if not block_hashes:
            return 0
        if not self._fingerprint:
            raise RuntimeError("BlockStoreConnector: bind_kv_cache() must be called first")
        self.counters.record_lookup()
        try:
            present = self.backend.exists(block_keys(self._fingerprint, block_hashes))
        except KVStoreError as e:
            logger.warning("KV lookup failed, treating as a miss: %s", e)
            self.counters.record_failure(e.reason)
            return 0
        for i, ok in enumerate(present):
            if not ok:
                return i
        return len(present)

    # -- worker side ------------------------------------------------------------------------
    def start_save(self, transfer: KVTransfer) -> None:
        self._submit(transfer, "save", lambda d: self._save(transfer, d))

    def start_load(self, transfer: KVTransfer) -> None:
        self._submit(transfer, "load", lambda d: self._load(transfer, d))

    def _save(self, t: KVTransfer, deadline: Deadline) -> TransferResult:
        all_keys = block_keys(self._fingerprint, t.block_hashes)
        idx = list(range(t.start_block, len(t.block_hashes)))
        keys = all_keys[t.start_block :]
        res = TransferResult(t.request_id, "save", True, keys=all_keys)
        skipped = 0
        futures: list[Future[int]] = []  # settled in finally, also when exists() fails
        try:
            present = self.backend.exists(keys) if keys else []
            todo = [(i, k) for i, k, p in zip(idx, keys, present, strict=True) if not p]
            skipped = len(keys) - len(todo)
            batches = [
                todo[b : b + self.batch_blocks] for b in range(0, len(todo), self.batch_blocks)
            ]
            futures = [self._io.submit(self._save_batch, t, batch, deadline) for batch in batches]
            for fut, batch in zip(futures, batches, strict=True):
                res.bytes_moved += fut.result(timeout=max(0.0, deadline.remaining()))
                res.num_saved_blocks += len(batch)
        except KVStoreError as e:
            res.ok, res.error, res.failure_reason = False, str(e), e.reason
        except (TransferDeadline, FutureTimeout):
            res.ok, res.error, res.failure_reason = False, "transfer deadline exceeded", "timeout"
        finally:
            self._settle(t, futures)
        self.counters.record_save(res.num_saved_blocks, res.bytes_moved, skipped)
        return res

    def _save_batch(self, t: KVTransfer, batch: list[tuple[int, str]], deadline: Deadline) -> int:
        """Encode and put one batch (on an I/O thread); returns the bytes written."""
        deadline.check()
        kv, layout = self._bound()
        if self._staged and isinstance(self.backend, VectoredBackend):
            staging = self._staging(kv)
            host = staging.gather(kv, [t.block_ids[i] for i, _ in batch])
            slots = list(range(len(batch)))
            return self._save_batch_direct(host, layout, t, batch, slots)
        if self._kv_np is not None:
            return self._save_batch_direct(self._kv_np, layout, t, batch)
        bufs: list[bytearray] = getattr(self._tls, "bufs", [])
        items = []
        for j, (i, key) in enumerate(batch):
            block = kv[:, :, t.block_ids[i], : t.block_num_tokens[i]]
            buf = bufs[j] if j < len(bufs) else None
            items.append((key, encode_block(block, layout, buf, mac=self.mac, key=key)))
        self.backend.put(items)
        # put() has copied the records out (file write / socket send): reuse the buffers.
        self._tls.bufs = [v for _, v in items]
        return sum(len(v) for _, v in items)

    def _save_batch_direct(
        self,
        kv_np: np.ndarray,
        layout: KvLayout,
        t: KVTransfer,
        batch: list[tuple[int, str]],
        slots: list[int] | None = None,
    ) -> int:
        """``slots[j]``: where batch entry j's block sits in ``kv_np`` (default: its block
        id; a staging buffer holds the batch's blocks at 0, 1, ...)."""
        items: list[tuple[str, list[Blob]]] = []
        nbytes = 0
        for j, (i, key) in enumerate(batch):
            n = t.block_num_tokens[i]
            parts = block_parts(kv_np, t.block_ids[i] if slots is None else slots[j], n)
            head = record_header(layout, n, parts, mac=self.mac, key=key)
            items.append((key, [head, *parts]))
            nbytes += record_size(layout, n)
        self._vectored().put_parts(items)
        return nbytes

    def _load(self, t: KVTransfer, deadline: Deadline) -> TransferResult:
        if t.reshard is not None:
            return self._load_resharded(t, deadline)
        idx = list(range(t.start_block, len(t.block_hashes)))
        keys = block_keys(self._fingerprint, [t.block_hashes[i] for i in idx])
        res = TransferResult(t.request_id, "load", True, keys=keys)
        spans = [
            (b, min(b + self.batch_blocks, len(idx))) for b in range(0, len(idx), self.batch_blocks)
        ]
        # Batches load concurrently; blocks after a failed one may land in the cache too,
        # which is harmless: only the leading ``num_loaded_blocks`` are reported as loaded,
        # and the result waits for every batch (``_settle``), so nothing lands later.
        futures = [
            self._io.submit(self._load_batch, t, idx[a:b], keys[a:b], deadline) for a, b in spans
        ]
        try:
            for fut in futures:
                loaded, nbytes, failure = fut.result(timeout=max(0.0, deadline.remaining()))
                res.num_loaded_blocks += loaded
                res.bytes_moved += nbytes
                if failure is not None:
                    res.ok, (res.failure_reason, res.error) = False, failure
                    break
        except KVStoreError as e:
            res.ok, res.error, res.failure_reason = False, str(e), e.reason
        except (TransferDeadline, FutureTimeout):
            res.ok, res.error, res.failure_reason = False, "transfer deadline exceeded", "timeout"
        finally:
            self._settle(t, futures)
        self.counters.record_load(res.num_loaded_blocks, res.bytes_moved)
        return res

    def _load_resharded(self, t: KVTransfer, deadline: Deadline) -> TransferResult:
        """A load of blocks another grid split (``kv_store/reshard_load.py``), on this
        transfer's worker thread: it reads several records per block."""
        from kv_store.reshard_load import load_resharded

        kv, layout = self._bound()
        res = TransferResult(t.request_id, "load", True)
        try:
            loaded, nbytes, failure = load_resharded(
                self.backend, kv, layout, t, self.mac, self.batch_blocks, deadline, self._bad
            )
            res.num_loaded_blocks, res.bytes_moved = loaded, nbytes
            if failure is not None:
                res.ok, (res.failure_reason, res.error) = False, failure
        except KVStoreError as e:
            res.ok, res.error, res.failure_reason = False, str(e), e.reason
        except TransferDeadline:
            res.ok, res.error, res.failure_reason = False, "transfer deadline exceeded", "timeout"
        self.counters.record_load(res.num_loaded_blocks, res.bytes_moved)
        return res

    def _bad(self, key: str, err: KVRecordError) -> tuple[str, str]:
        """A record that failed verification: delete it; the load's failure."""
        _drop_bad_record(self.backend, key, err)
        return record_failure_reason(err), f"block {key}: {err}"

    def _settle(self, t: KVTransfer, futures: Sequence[Future[Any]]) -> None:
        """Cancel the batches not started and wait for the running ones: a batch reads or
        writes the transfer's cache blocks, and once the result is out the engine
        recomputes into them (after a failed load) or frees them for other requests
        (docs/design.md §3, "loaded blocks join the prefix cache only once verified"). A
        late load would overwrite recomputed KV with unverified bytes; a late save would
        seal another request's KV under this key. Each batch is bounded by its backend's
        I/O timeouts; the wait is bounded by one more transfer timeout."""
        for fut in futures:
            fut.cancel()
        _, running = wait(futures, timeout=self.transfer_timeout_s)
        if running:
            logger.error(
                "KV transfer %s: %d batch(es) still running after %.0f s more; their cache "
                "blocks may change after the result",
                t.request_id,
                len(running),
                self.transfer_timeout_s,
            )

    def _load_batch(
        self, t: KVTransfer, idx: list[int], keys: list[str], deadline: Deadline
    ) -> tuple[int, int, tuple[str, str] | None]:
        """Get, verify and copy in one batch; ``(leading blocks loaded, bytes, failure)``
        where failure is ``(reason, message)`` for the first bad block, else None."""
        deadline.check()
        kv, layout = self._bound()
        if self._staged:
            staging = self._staging(kv)
            host = staging.host(len(idx))
            slots = list(range(len(idx)))
            result = self._load_batch_direct(host, layout, t, idx, keys, slots)
            if result[0]:  # scatter the verified leading blocks into the cache
                full = layout.block_size
                targets = [(t.block_ids[i], t.block_num_tokens[i]) for i in idx[: result[0]]]
                staging.scatter(kv, targets, full, slots=len(idx))
            return result
        if self._kv_np is not None:
            return self._load_batch_direct(self._kv_np, layout, t, idx, keys)
        values = self.backend.get(keys)
        loaded = nbytes = 0
        for i, key, value in zip(idx, keys, values, strict=True):
            n = t.block_num_tokens[i]
            if value is None:
                return loaded, nbytes, ("missing", f"block {key} missing")
            try:
                block = decode_block(value, layout, n, mac=self.mac, key=key)
            except KVRecordError as e:
                _drop_bad_record(self.backend, key, e)
                return loaded, nbytes, (record_failure_reason(e), f"block {key}: {e}")
            copy_into(kv[:, :, t.block_ids[i], :n], block)
            loaded += 1
            nbytes += len(value)
        return loaded, nbytes, None

    def _vectored(self) -> VectoredBackend:
        # _staged and _kv_np are set only for a backend with vectored I/O (bind_kv_cache).
        assert isinstance(self.backend, VectoredBackend)
        return self.backend

    def _load_batch_direct(
        self,
        kv_np: np.ndarray,
        layout: KvLayout,
        t: KVTransfer,
        idx: list[int],
        keys: list[str],
        slots: list[int] | None = None,
    ) -> tuple[int, int, tuple[str, str] | None]:
        """``_load_batch`` receiving each record straight into its cache block (fs:
        ``readv`` key by key; Redis: one pipelined batch), or into ``slots[j]`` of a staging
        buffer. A block that then fails verification holds garbage, but is not counted as
        loaded."""
        headers = [bytearray(HEADER_SIZE) for _ in keys]
        where = [t.block_ids[i] for i in idx] if slots is None else slots
        parts = [
            block_parts(kv_np, w, t.block_num_tokens[i]) for i, w in zip(idx, where, strict=True)
        ]
        bufs: list[list[Blob]] = [[h, *ps] for h, ps in zip(headers, parts, strict=True)]
        backend = self._vectored()
        sizes: Iterable[int | None]
        sizes = backend.read_into(keys, bufs)  # may be lazy: stops at the first bad block
        loaded = nbytes = 0
        for j, (i, key, size) in enumerate(zip(idx, keys, sizes)):
            n = t.block_num_tokens[i]
            try:
                if size is None:
                    return loaded, nbytes, ("missing", f"block {key} missing")
                if size != record_size(layout, n):
                    value = backend.get([key])[0]  # wrong size: decode it whole for the exact error
                    if value is None:
                        return loaded, nbytes, ("missing", f"block {key} missing")
                    decode_block(value, layout, n, mac=self.mac, key=key)
                    raise RecordLayoutError(f"record size {size} does not match {n} tokens")
                check_record_parts(headers[j], parts[j], layout, n, mac=self.mac, key=key)
            except KVRecordError as e:
                _drop_bad_record(backend, key, e)
                return loaded, nbytes, (record_failure_reason(e), f"block {key}: {e}")
            loaded += 1
            nbytes += size
        return loaded, nbytes, None

    def _staging(self, kv: torch.Tensor) -> Staging:
        staging: Staging | None = getattr(self._tls, "staging", None)
        if staging is None:
            staging = self._tls.staging = Staging(kv, self.batch_blocks)
        return staging

    def close(self) -> None:
        super().close()
        self._io.shutdown(wait=True, cancel_futures=True)
        self.backend.close()
