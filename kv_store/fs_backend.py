"""Directory-backed block store (docs/design.md §3 ``fs``): local disk, NFS or a Kubernetes volume.

- Atomic writes: each value goes to a uniquely named temp file in the target directory and
  is ``os.replace``d into place, so a reader sees the old value, the new one, or nothing —
  never a torn one — with any number of writer and reader processes.
- TTL: a file's mtime is its write time; older than ``ttl_s`` counts as missing and GC
  deletes it. Reads do not extend it (like Redis ``SET EX``).
- Capacity: reads set the file's atime to now (explicitly, so ``noatime`` mounts work);
  when this process's running estimate of the directory's bytes passes ``capacity_bytes``
  the writer runs GC, which rescans, drops expired files, then the least recently used
  ones down to ``low_watermark`` of the capacity. The low watermark spaces GC runs apart.
- Keys map to paths component by component (``a/b/c`` → ``root/a/b/<shard>/c``), each
  component percent-encoded so no key can escape the root or collide with a temp file.
- Nothing found at a record path is trusted (``kv_store/fs_files.py``): reads open it
  non-blocking without following a symlink, refuse anything but a regular file and any
  file over ``max_value_bytes`` (set by the connector to the largest valid record) without
  reading it, and remove what they refuse; lookups report such entries as missing, so the
  next save writes a good record in their place.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from kv_store.backend import Blob, VectoredBackend
from kv_store.base import KVStoreError
from kv_store.fs_files import Refused, discard, looks_like_record, open_record

logger = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 600.0  # a temp file this old belongs to a writer that died mid-write


@dataclass(slots=True)
class _Entry:
    path: str
    size: int
    atime: float
    mtime: float


# A component ``quote`` would leave unchanged (the usual case: a fingerprint, a hex hash).
_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


def _encode_component(p: str) -> str:
    if _PLAIN.fullmatch(p):
        return p  # skips quote(), a few µs per key on every read and write
    return quote(p, safe="-_.").replace(".", "%2E") if p.startswith(".") else quote(p, safe="-_.")


def key_to_relpath(key: str) -> str:
    """Relative file path of ``key``. ``ValueError`` for an empty key or component."""
    parts = key.split("/")
    if not key or any(not p for p in parts):
        raise ValueError(f"invalid store key {key!r}: empty path component")
    enc = [_encode_component(p) for p in parts]
    leaf = enc[-1]
    # Shard the leaf's directory (block hashes are uniform hex) so no directory grows huge.
    return "/".join([*enc[:-1], leaf[:2], leaf])  # POSIX paths; no component is empty


class FsBackend(VectoredBackend):
    """A ``StorageBackend`` over a directory shared by any number of processes."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        ttl_s: float | None = None,
        capacity_bytes: int | None = None,
        low_watermark: float = 0.8,
        key_prefix: str = "",
        fsync: bool = False,
        max_value_bytes: int | None = None,
    ) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 (or None for no TTL), got {ttl_s}")
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0 (or None), got {capacity_bytes}")
        if not 0.0 < low_watermark <= 1.0:
            raise ValueError(f"low_watermark must be in (0, 1], got {low_watermark}")
        self.root = Path(root)
        self._root = str(self.root)  # paths are built as str: pathlib costs µs per block
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KVStoreError(f"cannot create KV directory {self.root}: {e}") from e
        self.ttl_s = ttl_s
        self.capacity_bytes = capacity_bytes
        self.low_watermark = low_watermark
        self.key_prefix = key_prefix
        self.fsync = fsync
        self.max_value_bytes = max_value_bytes
        self._lock = threading.Lock()
        self._gc_lock = threading.Lock()
        self._estimated_bytes = self._scan_total() if capacity_bytes else 0
        # Without capacity pressure, expired records are still swept at this interval.
        self._gc_interval_s = ttl_s / 2 if ttl_s is not None else None
        self._next_gc_at = time.monotonic() + (self._gc_interval_s or 0.0)

    # -- paths ------------------------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        """The file that holds ``key`` (it may not exist)."""
        return Path(self._file(key))

    def _file(self, key: str) -> str:
        return f"{self._root}/{key_to_relpath(self.key_prefix + key)}"

    def _expired(self, mtime: float, now: float) -> bool:
        return self.ttl_s is not None and now - mtime > self.ttl_s

    def limit_value_bytes(self, max_bytes: int) -> None:
        """Refuse (and remove) anything at a record path larger than ``max_bytes``. Only
        ever raised after it is set: a load re-cut from another grid reads that grid's
        records, which may be larger than this process's own (docs/design.md §3 "KV
        between unlike grids"), and must not have them removed as oversized."""
        if self.max_value_bytes is None or max_bytes > self.max_value_bytes:
            self.max_value_bytes = max_bytes

    # -- StorageBackend ---------------------------------------------------------------------
    def exists(self, keys: list[str]) -> list[bool]:
        now = time.time()
        out = []
        for key in keys:
            try:
                st = looks_like_record(self._file(key), self.max_value_bytes)
            except OSError as e:
                raise KVStoreError(f"fs store: stat {key}: {e}") from e
            out.append(st is not None and not self._expired(st.st_mtime, now))
        return out

    def get(self, keys: list[str]) -> list[bytes | None]:
        return [self._get_one(k) for k in keys]

    def _open(self, path: str) -> tuple[int, os.stat_result] | None:
        """``open_record`` of ``path``; a refused entry is removed and reads as missing."""
        try:
            return open_record(path, self.max_value_bytes)
        except Refused as why:
            discard(path, str(why))
            return None

    def _get_one(self, key: str) -> bytes | None:
        path = self._file(key)
        try:
            opened = self._open(path)
            if opened is None:
                return None
            fd, st = opened
            try:
                now = time.time()
                if self._expired(st.st_mtime, now):
                    return None
                data = _read_upto(fd, st.st_size)  # bounded by what fstat said
                # Mark as recently used for LRU GC; keep mtime (= write time, for TTL).
                os.utime(fd, (now, st.st_mtime))
                return data
            finally:
                os.close(fd)
        except OSError as e:
            raise KVStoreError(f"fs store: read {path}: {e}") from e

    def put(self, items: Sequence[tuple[str, Blob]]) -> None:
        self.put_parts([(key, [value]) for key, value in items])

    def put_parts(self, items: Sequence[tuple[str, Sequence[Blob]]]) -> None:
        """Like ``put``, each value given as pieces written back to back (``writev``), so a
        record can go from the cache to the file without being assembled first."""
        written = 0
        for key, parts in items:
            written += self._put_one(key, parts)
        with self._lock:
            self._estimated_bytes += written
            over = self.capacity_bytes is not None and self._estimated_bytes > self.capacity_bytes
            due = self._gc_interval_s is not None and time.monotonic() >= self._next_gc_at
        if over or due:
            self.gc()

    def _put_one(self, key: str, parts: Sequence[Blob]) -> int:
        path = self._file(key)
        parent = path.rpartition("/")[0]
        tmp = f"{parent}/{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            try:
                fd = os.open(tmp, flags, 0o644)
            except FileNotFoundError:  # first block in this shard directory
                os.makedirs(parent, exist_ok=True)
                fd = os.open(tmp, flags, 0o644)
            try:
                size = _write_all(fd, parts)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
            except IsADirectoryError:  # a directory planted at the record path
                discard(path, "a directory at a record path")
                os.replace(tmp, path)
        except OSError as e:
            _unlink_quiet(tmp)
            raise KVStoreError(f"fs store: write {path}: {e}") from e
        return size

    def read_into(self, keys: list[str], parts: Sequence[Sequence[Blob]]) -> Iterator[int | None]:
        """Lazily, key by key (``get_into``): a caller stops reading at the first bad block."""
        return (self.get_into(k, p) for k, p in zip(keys, parts, strict=True))

    def get_into(self, key: str, parts: Sequence[Blob]) -> int | None:
        """Read ``key`` straight into the writable buffers ``parts`` (``readv``) when the
        file is exactly their total size. Returns the file size (compare it with the
        total: on a mismatch nothing was read — fall back to ``get``), or None when the
        key is missing or expired."""
        path = self._file(key)
        want = sum(memoryview(p).nbytes for p in parts)
        try:
            opened = self._open(path)
            if opened is None:
                return None
            fd, st = opened
            try:
                now = time.time()
                if self._expired(st.st_mtime, now):
                    return None
                if st.st_size != want:
                    return int(st.st_size)
                got = os.readv(fd, parts)
                if got != want:  # shrank under us: cannot happen with atomic replace
                    raise KVStoreError(f"fs store: short read of {path}: {got} of {want} bytes")
                os.utime(fd, (now, st.st_mtime))
                return want
            finally:
                os.close(fd)
        except OSError as e:
            raise KVStoreError(f"fs store: read {path}: {e}") from e

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                os.unlink(self._file(key))
            except FileNotFoundError:
                pass
            except OSError as e:
                raise KVStoreError(f"fs store: delete {key}: {e}") from e

    # -- garbage collection -----------------------------------------------------------------
    def _scan(self) -> list[_Entry]:
        """All record files under the root; removes stale temp files on the way."""
        entries: list[_Entry] = []
        now = time.time()
        stack = [str(self.root)]
        while stack:
            d = stack.pop()
            try:
                it = os.scandir(d)
            except FileNotFoundError:
                continue
            with it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                            continue
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed by another process meanwhile
                    if e.name.startswith(_TMP_PREFIX):
                        if now - st.st_mtime > _STALE_TMP_S:
                            _unlink_quiet(e.path)
                        continue
                    entries.append(_Entry(e.path, st.st_size, st.st_atime, st.st_mtime))
        return entries

    def _scan_total(self) -> int:
        return sum(e.size for e in self._scan())

    def gc(self) -> int:
        """Delete expired records, then least recently used ones until the store is under
        ``low_watermark × capacity``. Returns the bytes freed. One GC at a time per
        process; concurrent GCs in other processes only race to delete the same files."""
        if not self._gc_lock.acquire(blocking=False):
            return 0
        try:
            now = time.time()
            entries = self._scan()
            total = sum(e.size for e in entries)
            freed = 0
            live = []
            for e in entries:
                if self._expired(e.mtime, now):
                    freed += e.size if _unlink_quiet(e.path) else 0
                else:
                    live.append(e)
            if self.capacity_bytes is not None:
                target = int(self.capacity_bytes * self.low_watermark)
                live.sort(key=lambda e: max(e.atime, e.mtime))
                for e in live:
                    if total - freed <= target:
                        break
                    freed += e.size if _unlink_quiet(e.path) else 0
            with self._lock:
                self._estimated_bytes = total - freed
                if self._gc_interval_s is not None:
                    self._next_gc_at = time.monotonic() + self._gc_interval_s
            if freed:
                logger.info("fs store GC freed %d bytes under %s", freed, self.root)
            return freed
        finally:
            self._gc_lock.release()


def _write_all(fd: int, parts: Sequence[Blob]) -> int:
    """``writev`` every byte of ``parts`` (resuming after a short write); returns the size."""
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(v.nbytes for v in views)
    while views:
        n = os.writev(fd, views[:1024])  # IOV_MAX
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return total


def _read_upto(fd: int, size: int) -> bytes:
    """At most ``size`` bytes from ``fd`` (fewer if the file is shorter by now)."""
    chunks = []
    while size > 0:
        chunk = os.read(fd, size)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _unlink_quiet(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
