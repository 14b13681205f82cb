"""Compiled grammars shared by the instances of a deployment through a directory
(``--guided-cache-dir``; docs/guided-and-speculative.md, "Budget").

A guided request is compiled by the prefill instance that computes its first token and
again by the decode instance that continues it, and by every instance a retry or a
failover reaches: a grammar that takes seconds costs that much on each. With a directory
every instance can read (the fs store's volume, or `pdserve up`'s run directory), the
first compile leaves its serialized result there and the others load it instead.

Entries are ``<dir>/<tokenizer digest>/<guide digest>.json.z``, the serialized grammar
zlib-compressed (xgrammar's JSON of a large grammar is tens of MB and compresses about
tenfold): a different tokenizer never sees another's grammars. The directory is bounded
(``max_total_bytes``, 1 GiB by default): after each store the least recently used entries
(a load touches its file) are removed until the rest fit. Written to a temporary name and renamed, so a reader sees
a whole file or none; read only as a regular file (no symlinks) under a size cap; and a
file that does not deserialize (truncated, corrupted, or written by another xgrammar) is
ignored and the guide compiled again. The directory holds what any instance may write:
keep it as private to the services as the KV store.

Used inside the grammar helper's forked compile child (``grammar_worker.py``), so loading a
shared grammar runs under the same memory and time budget as compiling one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import zlib
from collections.abc import Callable
from pathlib import Path

MAX_ENTRY_BYTES = 1 << 30  # an entry's serialized (uncompressed) text
MAX_TOTAL_BYTES = 1 << 30  # the compressed entries of one tokenizer together


class GrammarShare:
    """One tokenizer's view of a shared grammar directory (``root`` empty: off)."""

    def __init__(
        self,
        root: str,
        tokenizer_info: str,
        max_bytes: int = MAX_ENTRY_BYTES,
        max_total_bytes: int = MAX_TOTAL_BYTES,
    ) -> None:
        digest = hashlib.sha256(tokenizer_info.encode()).hexdigest()[:32]
        self.dir = Path(root) / digest if root else None
        self.max_bytes = max_bytes
        self.max_total_bytes = max_total_bytes

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def path(self, kind: str, value: str) -> Path:
        assert self.dir is not None
        key = hashlib.sha256(f"{kind}\0{value}".encode()).hexdigest()
        return self.dir / f"{key}.json.z"

    def load(self, kind: str, value: str, check: Callable[[str], object]) -> str | None:
        """The shared compile of this guide, if a whole, valid one is there; else None.
        ``check`` deserializes the text (raises if it is not a compiled grammar)."""
        if self.dir is None:
            return None
        try:
            fd = os.open(self.path(kind, value), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > self.max_bytes:
                return None
            with os.fdopen(fd, "rb", closefd=False) as f:
                packed = f.read(self.max_bytes + 1)
            unpack = zlib.decompressobj()
            raw = unpack.decompress(packed, self.max_bytes + 1)  # bounded: no zip bomb
            if len(raw) > self.max_bytes or not unpack.eof:
                return None
            text = raw.decode()
            check(text)
            os.utime(fd)  # most recently used: the last to go when the directory is full
            return text
        except Exception:  # noqa: BLE001 - any unreadable entry just means "compile it"
            return None
        finally:
            os.close(fd)

    def store(self, kind: str, value: str, text: str) -> None:
        """Leave this compile for the other instances (best effort: a full or read-only
        directory costs them a compile, never a request)."""
        if self.dir is None or len(text) > self.max_bytes:
            return
        target = self.path(kind, value)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(tmp, "wb") as f:
                f.write(zlib.compress(text.encode(), 6))
            os.replace(tmp, target)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            return
        self.trim()

    def trim(self) -> None:
        """Remove the least recently used entries until the rest fit ``max_total_bytes``
        (best effort: another instance may be trimming or writing at the same time)."""
        if self.dir is None:
            return
        entries: list[tuple[float, int, Path]] = []
        with contextlib.suppress(OSError):
            for item in os.scandir(self.dir):
                if item.name.endswith(".json.z") and item.is_file(follow_symlinks=False):
                    info = item.stat(follow_symlinks=False)
                    entries.append(
                        (max(info.st_atime, info.st_mtime), info.st_size, Path(item.path))
                    )
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_total_bytes:
                return
            with contextlib.suppress(OSError):
                path.unlink()
            total -= size
