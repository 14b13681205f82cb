"""``BlockStoreConnector``: a ``KVConnector`` over any ``StorageBackend`` (fs, redis).

Each block of a request is one record under ``pdserve/{fingerprint}/{block_hash}``. Saves
skip blocks the store already holds (content-addressed keys make the store a shared,
deduplicated prefix cache), copy the rest out of the paged cache, encode and put them in
batches. Loads read batch by batch, verify each record and copy it into the cache, stopping
at the first missing or corrupt block: ``num_loaded_blocks`` counts the intact leading
blocks and ``failure_reason`` says why the rest did not load.
"""

from __future__ import annotations

import logging

from kv_store.base import KVRecordError, KVStoreError, KVTransfer, StorageBackend, TransferResult
from kv_store.connector_common import AsyncConnectorBase, Deadline, TransferDeadline
from kv_store.keys import block_keys
from kv_store.record import RecordChecksumError, RecordLayoutError, decode_block, encode_block

logger = logging.getLogger(__name__)


def record_failure_reason(err: KVRecordError) -> str:
    """``"checksum"`` | ``"layout"`` | ``"corrupt"`` for a record error."""
    if isinstance(err, RecordChecksumError):
        return "checksum"
    if isinstance(err, RecordLayoutError):
        return "layout"
    return "corrupt"


class BlockStoreConnector(AsyncConnectorBase):
    """Moves blocks between the bound paged cache and ``backend`` on ``num_workers``
    threads; ``batch_blocks`` records go to the backend per call."""

    def __init__(
        self,
        backend: StorageBackend,
        *,
        name: str = "block",
        num_workers: int = 2,
        batch_blocks: int = 8,
        transfer_timeout_s: float = 30.0,
    ) -> None:
        if batch_blocks < 1:
            raise ValueError(f"batch_blocks must be >= 1, got {batch_blocks}")
        self.name = name
        super().__init__(num_workers=num_workers, transfer_timeout_s=transfer_timeout_s)
        self.backend = backend
        self.batch_blocks = batch_blocks

    # -- scheduler side ---------------------------------------------------------------------
    def lookup(self, token_ids: list[int], block_hashes: list[bytes]) -> int:
        """Leading blocks held by the store; 0 if it is unreachable (logged, counted)."""
        if not block_hashes:
            return 0
        if not self._fingerprint:
            raise RuntimeError("BlockStoreConnector: bind_kv_cache() must be called first")
        self.stats.record_lookup()
        try:
            present = self.backend.exists(block_keys(self._fingerprint, block_hashes))
        except KVStoreError as e:
            logger.warning("KV lookup failed, treating as a miss: %s", e)
            self.stats.record_failure("unreachable")
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
        kv, layout = self._bound()
        idx = list(range(t.start_block, len(t.block_hashes)))
        keys = block_keys(self._fingerprint, [t.block_hashes[i] for i in idx])
        res = TransferResult(t.request_id, "save", True, keys=keys)
        written = skipped = 0
        try:
            present = self.backend.exists(keys) if keys else []
            todo = [(i, k) for i, k, p in zip(idx, keys, present, strict=True) if not p]
            skipped = len(keys) - len(todo)
            for b in range(0, len(todo), self.batch_blocks):
                deadline.check()
                items = []
                for i, key in todo[b : b + self.batch_blocks]:
                    block = kv[:, :, t.block_ids[i], : t.block_num_tokens[i]]
                    items.append((key, encode_block(block, layout)))
                self.backend.put(items)
                written += len(items)
                res.bytes_moved += sum(len(v) for _, v in items)
        except KVStoreError as e:
            res.ok, res.error, res.failure_reason = False, str(e), "unreachable"
        except TransferDeadline as e:
            res.ok, res.error, res.failure_reason = False, str(e), "timeout"
        self.stats.record_save(written, res.bytes_moved, skipped)
        return res

    def _load(self, t: KVTransfer, deadline: Deadline) -> TransferResult:
        kv, layout = self._bound()
        idx = list(range(t.start_block, len(t.block_hashes)))
        keys = block_keys(self._fingerprint, [t.block_hashes[i] for i in idx])
        res = TransferResult(t.request_id, "load", True, keys=keys)
        try:
            for b in range(0, len(idx), self.batch_blocks):
                deadline.check()
                values = self.backend.get(keys[b : b + self.batch_blocks])
                for i, key, value in zip(idx[b:], keys[b:], values, strict=False):
                    n = t.block_num_tokens[i]
                    if value is None:
                        res.ok, res.error, res.failure_reason = (
                            False,
                            f"block {key} missing",
                            "missing",
                        )
                        return self._finish_load(res)
                    try:
                        block = decode_block(value, layout, expected_tokens=n)
                    except KVRecordError as e:
                        reason = record_failure_reason(e)
                        res.ok, res.error, res.failure_reason = False, f"block {key}: {e}", reason
                        return self._finish_load(res)
                    dst = kv[:, :, t.block_ids[i], :n]
                    dst.copy_(block)
                    res.num_loaded_blocks += 1
                    res.bytes_moved += len(value)
        except KVStoreError as e:
            res.ok, res.error, res.failure_reason = False, str(e), "unreachable"
        except TransferDeadline as e:
            res.ok, res.error, res.failure_reason = False, str(e), "timeout"
        return self._finish_load(res)

    def _finish_load(self, res: TransferResult) -> TransferResult:
        self.stats.record_load(res.num_loaded_blocks, res.bytes_moved)
        return res

    def close(self) -> None:
        super().close()
        self.backend.close()
