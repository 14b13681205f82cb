"""The KV connector interface (docs/design.md §3), split like vLLM's.

Scheduler side: ``lookup`` — side-effect free, how many leading blocks the store holds.
Worker side: ``start_save`` / ``start_load`` move blocks between the paged cache and the
store on background threads; ``poll`` reports finished transfers, so the engine's step loop
never blocks on I/O.

Storage backends (fs, redis) implement the small batched ``StorageBackend`` API; the
``BlockStoreConnector`` turns any backend into a connector. LMCache is a connector of its
own because LMCache addresses KV by token prefix rather than by our block keys.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kv_store.stats import ConnectorStats

if TYPE_CHECKING:
    import torch

    from kv_store.p2p.stats import P2PStats


# What ``StorageBackend.put`` accepts: records are built in a ``bytearray`` (one copy out of
# the cache) and must not be copied again into ``bytes`` just to satisfy a type.
Blob = bytes | bytearray | memoryview


class KVStoreError(RuntimeError):
    """The store could not be reached or refused an operation."""

    reason = "unreachable"  # the transfer's failure reason (pdserve_kv_failures_total)


class KVStoreCircuitOpen(KVStoreError):
    """Refused without trying: the store failed repeatedly just now (``kv_store.breaker``)."""

    reason = "circuit_open"


class KVRecordError(ValueError):
    """A stored record is corrupt (bad magic, version, layout or checksum)."""


@dataclass(frozen=True, slots=True)
class KvLayout:
    """What a reader must agree on to interpret a block record."""

    version: int
    dtype: str  # the cache's storage dtype: float32 | bfloat16 | float16 | float8_e4m3fn
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(slots=True)
class KVTransfer:
    """One request's blocks to move between the paged cache and the store.

    ``block_hashes[i]`` / ``block_ids[i]`` / ``block_num_tokens[i]`` describe block ``i`` of
    the request (the last one may be partial). Only blocks ``start_block..`` are moved.
    A load from a peer (p2p) also names where the blocks are held: ``source_address``
    (host:port of the prefill instance) and ``transfer_id`` (its lease).
    """

    request_id: str
    token_ids: list[int]
    block_hashes: list[bytes]
    block_ids: list[int]
    block_num_tokens: list[int]
    start_block: int = 0
    source_address: str = ""
    transfer_id: str = ""


@dataclass(slots=True)
class TransferResult:
    """A finished save or load. For a load, ``num_loaded_blocks`` counts the leading blocks
    (from ``start_block``) that arrived intact; the engine recomputes the rest.

    A save with ``held=True`` is committed but not copied: the connector holds the blocks
    for a peer to pull under ``transfer_id`` at ``source_address``, and the engine keeps
    them allocated until a later result of kind ``"release"`` (pulled, or the hold ended:
    ``failure_reason`` expired | aborted | closed) for the same request.
    """

    request_id: str
    kind: str  # "save" | "load" | "release"
    ok: bool
    num_loaded_blocks: int = 0
    num_saved_blocks: int = 0  # for a save: blocks actually written (the rest were present)
    keys: list[str] = field(default_factory=list)  # for a save: the keys of all blocks
    bytes_moved: int = 0
    seconds: float = 0.0
    error: str | None = None
    failure_reason: str | None = None  # "missing" | "checksum" | "unreachable" | ...
    held: bool = False
    transfer_id: str = ""
    source_address: str = ""


class StorageBackend(abc.ABC):
    """Batched key → bytes storage. Every method may raise ``KVStoreError``."""

    @abc.abstractmethod
    def exists(self, keys: list[str]) -> list[bool]: ...

    @abc.abstractmethod
    def get(self, keys: list[str]) -> list[bytes | None]:
        """Values in order; ``None`` for a missing (or expired) key."""

    @abc.abstractmethod
    def put(self, items: Sequence[tuple[str, Blob]]) -> None:
        """Write all items; a reader never sees a torn value."""

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None: ...

    def limit_value_bytes(self, max_bytes: int) -> None:  # noqa: B027 - optional hook
        """No valid value is larger than ``max_bytes`` (the connector's largest record): a
        backend may refuse to read larger ones (the fs store does, unread)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class VectoredBackend(StorageBackend):
    """A backend that moves records straight between the paged cache's memory and the
    store (scatter/gather I/O: ``writev``/``readv`` on files, ``sendmsg``/``recvmsg_into``
    on sockets), without assembling each record in a buffer first.

    The block connector uses these methods only when ``vectored_io`` is True; any other
    ``StorageBackend`` goes through ``get``/``put`` with whole records.
    """

    @property
    def vectored_io(self) -> bool:
        """Whether the vectored methods work with this backend's current settings."""
        return True

    @abc.abstractmethod
    def put_parts(self, items: Sequence[tuple[str, Sequence[Blob]]]) -> None:
        """Write each record as the concatenation of its parts; atomic per record."""

    @abc.abstractmethod
    def read_into(self, keys: list[str], parts: Sequence[Sequence[Blob]]) -> Iterable[int | None]:
        """Receive each record straight into its writable buffers ``parts[i]`` when its size
        equals their total. Yields per key the record's size (when it differs from the
        total nothing was written: fall back to ``get``) or None when missing. May be lazy:
        a caller that stops iterating stops the reads."""


class KVConnector(abc.ABC):
    """Moves prompt KV between an engine's paged cache and a shared store.

    ``counters`` is updated by the connector's workers; readers (the service metrics) take
    ``stats()``, a consistent snapshot, and never reach into the connector otherwise.
    """

    name: str = "base"
    counters: ConnectorStats
    # How a tensor-parallel worker rank builds a connector of the same kind for its own
    # shard (JSON; set by ``kv_store.factory.build_connector``). None: this connector
    # cannot serve an engine with tensor_parallel_size > 1 (``kv_store/tp_connector.py``).
    worker_recipe: dict[str, Any] | None = None

    def stats(self) -> ConnectorStats:
        """A consistent snapshot of the transfer counters (exported as ``pdserve_kv_*``)."""
        return self.counters.snapshot()

    @abc.abstractmethod
    def bind_kv_cache(
        self, kv_cache: torch.Tensor, layout: KvLayout, model_fingerprint: str
    ) -> None:
        """Called once by the engine with its cache ``[layers, 2, blocks, block, heads, dim]``."""

    # -- scheduler side -------------------------------------------------------------------
    @abc.abstractmethod
    def lookup(self, token_ids: list[int], block_hashes: list[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` the store holds. No side effects."""

    # -- worker side ----------------------------------------------------------------------
    @abc.abstractmethod
    def start_save(self, transfer: KVTransfer) -> None:
        """Begin writing blocks ``start_block..`` that the store lacks. The engine keeps the
        blocks alive and unchanged until ``poll`` reports the save."""

    @abc.abstractmethod
    def start_load(self, transfer: KVTransfer) -> None:
        """Begin reading blocks ``start_block..`` into ``block_ids``. The engine does not
        touch those blocks until ``poll`` reports the load."""

    @abc.abstractmethod
    def poll(self) -> list[TransferResult]:
        """Finished transfers since the last call (non-blocking)."""

    def p2p_stats(self) -> P2PStats | None:
        """Leases and pulls of a connector that hands KV peer to peer (p2p); None for a
        store connector (exported as ``pdserve_kv_p2p_*``)."""
        return None

    def release_held(self, request_id: str) -> bool:
        """End the hold of a save reported ``held`` (the request was aborted); its
        ``"release"`` result follows. False when the request holds nothing."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop worker threads and release the store."""
