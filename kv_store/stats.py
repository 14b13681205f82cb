"""Plain transfer counters kept by every connector; the services export them as metrics."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(slots=True)
class ConnectorStats:
    """Cumulative counters. Updated from worker threads through ``record_*`` (locked);
    read them with ``snapshot()`` for a consistent copy."""

    blocks_saved: int = 0
    bytes_saved: int = 0
    blocks_skipped: int = 0  # already in the store: deduplicated, not written again
    save_seconds: float = 0.0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    lookups: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __getstate__(self) -> tuple[object, ...]:
        """The counters without the lock: a snapshot crosses a process boundary (the
        engine process's stats, engine/engine_process.py)."""
        with self._lock:
            return (
                *(self.blocks_saved, self.bytes_saved, self.blocks_skipped, self.save_seconds),
                *(self.blocks_loaded, self.bytes_loaded, self.load_seconds, self.lookups),
                dict(self.failures),
            )

    def __setstate__(self, state: tuple[object, ...]) -> None:
        (
            self.blocks_saved, self.bytes_saved, self.blocks_skipped, self.save_seconds,
            self.blocks_loaded, self.bytes_loaded, self.load_seconds, self.lookups,
            self.failures,
        ) = state  # type: ignore[assignment]  # fmt: skip
        self._lock = threading.Lock()

    def record_save(self, blocks: int, nbytes: int, skipped: int) -> None:
        with self._lock:
            self.blocks_saved += blocks
            self.bytes_saved += nbytes
            self.blocks_skipped += skipped

    def record_load(self, blocks: int, nbytes: int) -> None:
        with self._lock:
            self.blocks_loaded += blocks
            self.bytes_loaded += nbytes

    def record_seconds(self, kind: str, seconds: float) -> None:
        """Wall time of one finished transfer of ``kind`` ("save" | "load")."""
        with self._lock:
            if kind == "save":
                self.save_seconds += seconds
            else:
                self.load_seconds += seconds

    def record_lookup(self) -> None:
        with self._lock:
            self.lookups += 1

    def record_failure(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] = self.failures.get(reason, 0) + 1

    def snapshot(self) -> ConnectorStats:
        """A consistent copy (with its own lock)."""
        with self._lock:
            return ConnectorStats(
                self.blocks_saved,
                self.bytes_saved,
                self.blocks_skipped,
                self.save_seconds,
                self.blocks_loaded,
                self.bytes_loaded,
                self.load_seconds,
                self.lookups,
                dict(self.failures),
            )
