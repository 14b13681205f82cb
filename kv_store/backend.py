"""The storage backend interface of the block-store connectors (fs, redis): a small batched
key → bytes API that ``kv_store.block_connector.BlockStoreConnector`` turns into a KV
connector (docs/design.md §3, "Connector"). A store's specifics, so it lives beside the
connector interface (``kv_store/base.py``), not in it: the engine never sees a backend.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence

# What ``StorageBackend.put`` accepts: records are built in a ``bytearray`` (one copy out of
# the cache) and must not be copied again into ``bytes`` just to satisfy a type.
Blob = bytes | bytearray | memoryview


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
        backend may refuse to read larger ones (the fs store does, unread). A later call
        may raise the bound, never lower it."""

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
