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


@pytest.fixture
def engine_factory(tiny_model_dir: Path) -> Iterator[Any]:
    """``make(**config)`` builds an ``LLMEngine`` on the tiny model with 64 KV blocks and
    the given ``EngineConfig`` fields; all are shut down after the test."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    made: list[LLMEngine] = []

    def make(**kw: object) -> LLMEngine:
        made.append(LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, **kw)))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown()
