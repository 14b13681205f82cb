"""A circuit breaker for store operations (docs/design.md §3 "Connector", failure rules).

A hung store (SIGSTOPped Redis: connections are accepted, nothing is answered) makes each
operation wait its full socket timeout; with several transfers and lookups in flight they
queue behind each other's timeouts. After ``threshold`` consecutive failures the breaker
opens for ``open_s`` seconds: every operation then fails at once with
``KVStoreCircuitOpen`` (counted by the connector as ``circuit_open``), so prefill still
answers its first token at once and decode computes the prompt itself. When the window
ends, exactly one operation is let through as a probe (the others keep failing fast until
it returns): success closes the breaker, failure opens it for another window.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kv_store.base import KVStoreCircuitOpen, KVStoreError

T = TypeVar("T")


class CircuitBreaker:
    """Thread-safe; ``call(fn)`` runs ``fn`` unless open. Only ``KVStoreError`` counts as a
    failure (a programming error says nothing about the store)."""

    def __init__(
        self,
        name: str,
        *,
        threshold: int = 3,
        open_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {threshold}")
        if open_s <= 0:
            raise ValueError(f"open_s must be > 0, got {open_s}")
        self.name = name
        self.threshold = threshold
        self.open_s = open_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0  # consecutive
        self._open_until = 0.0
        self.rejected = 0  # operations refused without trying
        self.opened = 0  # times the breaker opened

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._failures >= self.threshold

    def _admit(self) -> None:
        with self._lock:
            if self._failures < self.threshold:
                return
            now = self._clock()
            if now >= self._open_until:
                self._open_until = now + self.open_s  # this caller is the window's one probe
                return
            self.rejected += 1
        raise KVStoreCircuitOpen(
            f"{self.name}: store failed {self.threshold}+ times in a row; "
            f"not trying for up to {self.open_s:g} s"
        )

    def _record(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self._failures = 0
                return
            self._failures += 1
            if self._failures == self.threshold:
                self.opened += 1
                self._open_until = self._clock() + self.open_s
            elif self._failures > self.threshold:  # a failed probe: another window
                self._open_until = self._clock() + self.open_s

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``; ``KVStoreCircuitOpen`` without calling it while the breaker is open."""
        self._admit()
        try:
            result = fn()
        except KVStoreError:
            self._record(False)
            raise
        self._record(True)
        return result
