"""Fixtures shared by the integration tests."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.p2p_support import Worker


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Any]:
    """``make(name, **config)`` starts a p2p ``Worker`` process; all are stopped after the
    test (a paused one is resumed first, so it can exit)."""
    made: list[Worker] = []

    def make(name: str, **config: Any) -> Worker:
        w = Worker(tmp_path / "logs", name, **config)
        made.append(w)
        return w

    try:
        yield make
    finally:
        for w in made:
            if w.proc.poll() is None:
                w.kill(signal.SIGCONT)
            w.stop()
