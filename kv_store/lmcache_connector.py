"""``LMCacheConnector``: the real LMCache engine (PyPI ``lmcache``) as a ``KVConnector``.

LMCache addresses KV by token prefix in chunks; with ``chunk_size`` = our block size one
chunk is one of our blocks, and ``save_unfull_chunk`` makes the partial tail travel too.
Its remote backend is an ``lmcache_server`` (``lm://host:port``) or Redis
(``redis://host:port``), with a local CPU buffer in front (required by LMCache).

Traps handled here (see shared notes/LMCACHE.md):
- usage telemetry: ``LMCACHE_TRACK_USAGE=false`` and ``DO_NOT_TRACK=1`` are set before
  the (lazy, ~2-5 s) import;
- its chunk keys use Python's ``hash()`` of token tuples: every process sharing a store
  must run with ``PYTHONHASHSEED=0`` — enforced, with a clear error;
- on an unreachable remote it only warns and goes local-only: we probe the remote at start
  and after ``post_init`` check that a connection exists, else ``KVStoreError``;
- it forces ``multiprocessing`` start method ``spawn`` for the whole process;
- remote puts are asynchronous: a save waits for them to drain (bounded) before reporting;
- ``lmcache_server`` never evicts. TTL is not available there; what bounds it is ours: the
  local CPU buffer is capped (``local_cpu_bytes``), saves skip chunks the remote already
  holds, and operators restart the server or use ``redis://`` with ``maxmemory`` +
  ``allkeys-lru``.

All engine calls go through one dedicated thread and are waited on with a deadline, so a
hung remote yields a failed transfer ("timeout"), never a hung caller.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any
from urllib.parse import urlparse

import torch

from kv_store.base import KVStoreError, KVTransfer, TransferResult
from kv_store.connector_common import AsyncConnectorBase, Deadline
from kv_store.keys import block_keys

logger = logging.getLogger(__name__)


class _PartialStore(KVStoreError):
    """LMCache accepted only part of a store."""


def check_hash_seed() -> None:
    """``KVStoreError`` unless this interpreter runs with ``PYTHONHASHSEED=0``."""
    if os.environ.get("PYTHONHASHSEED") != "0" or sys.flags.hash_randomization:
        raise KVStoreError(
            "the lmcache connector needs PYTHONHASHSEED=0 in the environment of every process "
            "that shares the store (LMCache keys chunks by Python hash()); start the process "
            "with PYTHONHASHSEED=0"
        )


def parse_remote(url: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of an ``lm://`` or ``redis://`` URL; ``ValueError`` else."""
    u = urlparse(url)
    if u.scheme not in ("lm", "redis") or not u.hostname or not u.port:
        raise ValueError(
            f"LMCache remote URL must be lm://host:port or redis://host:port, got {url!r}"
        )
    return u.scheme, u.hostname, u.port


def probe_remote(url: str, timeout_s: float = 2.0) -> None:
    """Connect to the remote (and PING a Redis); ``KVStoreError`` if it does not answer."""
    scheme, host, port = parse_remote(url)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            if scheme == "redis":
                s.settimeout(timeout_s)
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                if not s.recv(64).startswith(b"+PONG"):
                    raise KVStoreError(f"LMCache remote {url} did not answer PING")
    except OSError as e:
        raise KVStoreError(f"LMCache remote {url} unreachable: {e}") from e


def _import_lmcache() -> Any:
    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    os.environ["DO_NOT_TRACK"] = "1"
    # LMCache logs every store/retrieve at INFO; keep it to warnings unless asked.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    from lmcache.v1 import cache_engine, config, metadata

    from kv_store import _lmcache_gpu

    return cache_engine, config, metadata, _lmcache_gpu


class LMCacheConnector(AsyncConnectorBase):
    """KV connector over an LMCache engine created at ``bind_kv_cache``."""

    name = "lmcache"

    def __init__(
        self,
        remote_url: str,
        *,
        local_cpu_bytes: int | None = 1 << 30,
        transfer_timeout_s: float = 30.0,
        lookup_timeout_s: float = 2.0,
        num_workers: int = 1,
    ) -> None:
        parse_remote(remote_url)
        check_hash_seed()
        probe_remote(remote_url)
        super().__init__(num_workers=num_workers, transfer_timeout_s=transfer_timeout_s)
        self.remote_url = remote_url
        self.local_cpu_bytes = local_cpu_bytes or (1 << 30)
        self.lookup_timeout_s = lookup_timeout_s
        self._instance_id = f"pdserve-{uuid.uuid4().hex[:12]}"
        self._engine: Any = None
        self._builder: Any = None
        self._remote: Any = None
        # LMCache is not documented thread-safe: every engine call runs on this one thread.
        self._io = ThreadPoolExecutor(1, thread_name_prefix="lmcache-io")

    # -- binding ----------------------------------------------------------------------------
    def bind_kv_cache(self, kv_cache: torch.Tensor, layout: Any, model_fingerprint: str) -> None:
        if self._engine is not None:
            raise RuntimeError("LMCacheConnector.bind_kv_cache() may be called only once")
        super().bind_kv_cache(kv_cache, layout, model_fingerprint)
        cache_engine, config, metadata, gpu = _import_lmcache()
        cfg = config.LMCacheEngineConfig.from_defaults(
            chunk_size=layout.block_size,
            local_cpu=True,
            max_local_cpu_size=self.local_cpu_bytes / 1024**3,
            remote_url=self.remote_url,
            remote_serde="naive",
            save_unfull_chunk=True,
            blocking_timeout_secs=max(1, int(self.transfer_timeout_s)),
        )
        md = metadata.LMCacheMetadata(
            model_name=f"pdserve-{model_fingerprint}-v{layout.version}",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=kv_cache.dtype,
            kv_shape=(
                layout.num_layers,
                layout.planes,
                layout.block_size,
                layout.num_kv_heads,
                layout.head_dim,
            ),
            # A DeepSeek latent cache: one plane (LMCache's own MLA format).
            use_mla=layout.planes == 1,
            chunk_size=layout.block_size,
        )
        connector = gpu.PagedCacheConnector(
            layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.planes
        )
        self._builder = cache_engine.LMCacheEngineBuilder
        engine = self._builder.get_or_create(
            self._instance_id, cfg, md, connector, lambda t, r: None, lambda o, r: o
        )
        engine.post_init()
        backends = getattr(engine.storage_manager, "storage_backends", {})
        remote = backends.get("RemoteBackend")
        if remote is None or getattr(remote, "connection", None) is None:
            self._builder.destroy(self._instance_id)
            raise KVStoreError(
                f"LMCache could not connect to its remote {self.remote_url} (it went local-only)"
            )
        self._engine, self._remote = engine, remote

    # -- helpers ----------------------------------------------------------------------------
    def _call(self, timeout_s: float, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on the LMCache thread; ``TimeoutError`` past ``timeout_s``."""
        fut = self._io.submit(fn, *args, **kwargs)
        try:
            return fut.result(timeout=max(0.01, timeout_s))
        except FutureTimeout:
            raise TimeoutError(f"LMCache call did not finish within {timeout_s:.1f} s") from None

    def _call_on_cache(self, timeout_s: float, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``_call`` for a call that reads or writes the paged cache (store, retrieve). On a
        timeout it still waits, up to one more transfer timeout, for the call to end before
        raising: the engine frees or recomputes the blocks once the result is out, and a
        late retrieve would overwrite recomputed KV, a late store would save blocks already
        reused by another request under this prompt's keys."""
        fut = self._io.submit(fn, *args, **kwargs)
        try:
            return fut.result(timeout=max(0.01, timeout_s))
        except FutureTimeout:
            done, _ = wait([fut], timeout=self.transfer_timeout_s)
            if not done:
                logger.error(
                    "LMCache call still running %.0f s past its deadline; its blocks are "
                    "reported and may be reused while it runs",
                    self.transfer_timeout_s,
                )
            raise TimeoutError(f"LMCache call did not finish within {timeout_s:.1f} s") from None

    def _request_tensors(self, t: KVTransfer) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Tokens, slot mapping (one slot per token) and the block size, for ``t``."""
        _, layout = self._bound()
        bs = layout.block_size
        total = sum(t.block_num_tokens)
        if len(t.token_ids) < total:
            raise ValueError(
                f"transfer {t.request_id}: {len(t.token_ids)} token ids < {total} block tokens"
            )
        pos = torch.arange(total, dtype=torch.long)
        ids = torch.tensor(t.block_ids, dtype=torch.long)
        slots = ids[pos // bs] * bs + pos % bs
        return torch.tensor(t.token_ids[:total], dtype=torch.long), slots, bs

    def _unreachable(self) -> bool:
        try:
            probe_remote(self.remote_url, timeout_s=1.0)
            return False
        except KVStoreError:
            return True

    # -- scheduler side ---------------------------------------------------------------------
    def lookup(self, token_ids: list[int], block_hashes: list[bytes]) -> int:
        """Leading blocks LMCache holds: its token-prefix length, rounded down to whole
        blocks (a held partial tail counts when it is the last block)."""
        _, layout = self._bound()
        total = min(len(token_ids), len(block_hashes) * layout.block_size)
        if total == 0:
            return 0
        self.counters.record_lookup()
        try:
            held = int(
                self._call(
                    self.lookup_timeout_s, self._engine.lookup, torch.tensor(token_ids[:total])
                )
            )
        except Exception as e:
            logger.warning("LMCache lookup failed, treating as a miss: %s", e)
            self.counters.record_failure("unreachable")
            return 0
        return len(block_hashes) if held >= total else held // layout.block_size

    # -- worker side ------------------------------------------------------------------------
    def start_save(self, transfer: KVTransfer) -> None:
        self._submit(transfer, "save", lambda d: self._save(transfer, d))

    def start_load(self, transfer: KVTransfer) -> None:
        self._submit(transfer, "load", lambda d: self._load(transfer, d))

    def _save(self, t: KVTransfer, deadline: Deadline) -> TransferResult:
        kv, _ = self._bound()
        res = TransferResult(
            t.request_id, "save", True, keys=block_keys(self._fingerprint, t.block_hashes)
        )
        tokens, slots, bs = self._request_tensors(t)
        total = len(tokens)
        try:
            # Dedup against the remote only: the local buffer may hold what the remote lost.
            held = self._call(
                deadline.remaining(), self._engine.lookup, tokens, search_range=["RemoteBackend"]
            )
            skip = max(t.start_block * bs, (held // bs) * bs if held < total else total)
            if skip < total:
                mask = torch.zeros(total, dtype=torch.bool)
                mask[skip:] = True
                failed_before = self._remote.put_failed_count
                self._call_on_cache(
                    deadline.remaining(),
                    self._engine.store,
                    tokens,
                    mask=mask,
                    kvcaches=kv,
                    slot_mapping=slots,
                )
                self._await_remote(tokens, failed_before, deadline)
                res.bytes_moved = (total - skip) * self._token_bytes()
            written = (len(t.block_hashes) - skip // bs) if skip < total else 0
            res.num_saved_blocks = written
            self.counters.record_save(
                written, res.bytes_moved, len(t.block_hashes) - t.start_block - written
            )
        except _PartialStore as e:
            res.ok, res.error, res.failure_reason = False, str(e), "capacity"
        except (KVStoreError, TimeoutError) as e:
            unreachable = self._unreachable()
            res.ok, res.error = False, str(e)
            res.failure_reason = "unreachable" if unreachable else "timeout"
        return res

    def _await_remote(self, tokens: torch.Tensor, failed_before: int, deadline: Deadline) -> None:
        """Return once the remote holds every token of ``tokens``. LMCache's remote puts are
        asynchronous (and its batched put path tracks no pending tasks), so poll the
        remote's own lookup. ``KVStoreError`` if puts failed or LMCache stored only part
        of the request (it does that silently when its local buffer is full)."""
        total = len(tokens)
        local = self._call(deadline.remaining(), self._engine.lookup, tokens)
        if local < total:
            raise _PartialStore(
                f"LMCache stored only {local} of {total} tokens (local buffer full? raise --kv-capacity)"
            )
        while True:
            held = self._call(
                deadline.remaining(), self._engine.lookup, tokens, search_range=["RemoteBackend"]
            )
            if held >= total:
                return
            if self._remote.put_failed_count != failed_before:
                raise KVStoreError(f"LMCache remote {self.remote_url} rejected puts")
            if deadline.remaining() <= 0:
                raise TimeoutError(f"LMCache remote holds {held} of {total} tokens at the deadline")
            time.sleep(0.005)

    def _token_bytes(self) -> int:
        kv, layout = self._bound()
        per_layer = layout.planes * layout.num_kv_heads * layout.head_dim * kv.element_size()
        return layout.num_layers * per_layer

    def _load(self, t: KVTransfer, deadline: Deadline) -> TransferResult:
        kv, _ = self._bound()
        res = TransferResult(t.request_id, "load", True)
        tokens, slots, bs = self._request_tensors(t)
        total = len(tokens)
        start = t.start_block * bs
        if start >= total:
            return res
        mask = torch.zeros(total, dtype=torch.bool)
        mask[start:] = True
        try:
            got = self._call_on_cache(
                deadline.remaining(),
                self._engine.retrieve,
                tokens,
                mask=mask,
                kvcaches=kv,
                slot_mapping=slots,
            )
        except TimeoutError as e:
            res.ok, res.error, res.failure_reason = False, str(e), "timeout"
            return res
        loaded = 0
        for i in range(t.start_block, len(t.block_hashes)):
            lo = i * bs
            if not bool(got[lo : lo + t.block_num_tokens[i]].all()):
                break
            loaded += 1
        res.num_loaded_blocks = loaded
        res.bytes_moved = (
            sum(t.block_num_tokens[t.start_block : t.start_block + loaded]) * self._token_bytes()
        )
        if loaded < len(t.block_hashes) - t.start_block:
            res.ok = False
            res.failure_reason = "unreachable" if self._unreachable() else "missing"
            res.error = f"LMCache returned {loaded} of {len(t.block_hashes) - t.start_block} blocks"
        self.counters.record_load(loaded, res.bytes_moved)
        return res

    def close(self) -> None:
        super().close()
        self._io.shutdown(wait=False, cancel_futures=True)
        if self._engine is not None:
            self._builder.destroy(self._instance_id)
            self._engine = None
