"""Finished transfers on their way from a connector's worker threads to the engine."""

from __future__ import annotations

import queue
import time

from kv_store.base import TransferResult


class ResultQueue:
    """Workers ``put`` results; the engine's ``poll`` drains them without blocking; tests
    and tools ``wait`` for a number of them with a deadline."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()

    def put(self, result: TransferResult) -> None:
        self._queue.put(result)

    def drain(self) -> list[TransferResult]:
        """Every result so far (non-blocking)."""
        out: list[TransferResult] = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def wait(self, count: int, timeout_s: float) -> list[TransferResult]:
        """Block until ``count`` results arrived or ``timeout_s`` passed."""
        out: list[TransferResult] = []
        end = time.monotonic() + timeout_s
        while len(out) < count and (left := end - time.monotonic()) > 0:
            try:
                out.append(self._queue.get(timeout=left))
            except queue.Empty:
                break
        return out
