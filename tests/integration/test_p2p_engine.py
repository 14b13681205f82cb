"""The engine over the p2p connector: a producer engine in its own process holds the
prompt's blocks under a lease; a consumer engine (this process) pulls them and continues.

Greedy tokens equal a colocated engine's; the producer frees its blocks when the lease
ends however it ends (pulled, aborted, expired); a consumer whose pull finds nothing
applies ``kv_load_failure``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core.request import RemoteKV
from engine.llm_engine import LLMEngine
from kv_store.p2p import P2PConnector
from tests.integration.test_engine_kv import GREEDY, PROMPT, _colocated

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]


class Producer:
    """``p2p_engine_worker``: prefills PROMPT and holds its KV for a pull."""

    def __init__(self, model: Path, settings: dict[str, Any]) -> None:
        env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.p2p_engine_worker",
                str(model),
                json.dumps(PROMPT),
                json.dumps(settings),
            ],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def next(self, timeout: float = 120.0) -> dict[str, Any]:
        line = self._lines.get(timeout=timeout)
        if line is None:
            assert self.proc.stderr is not None
            raise RuntimeError(f"producer exited:\n{self.proc.stderr.read()[-3000:]}")
        return dict(json.loads(line))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture
def producer(tiny_model_dir: Path) -> Iterator[Any]:
    made: list[Producer] = []

    def make(**settings: Any) -> Producer:
        p = Producer(tiny_model_dir, settings)
        made.append(p)
        return p

    try:
        yield make
    finally:
        for p in made:
            p.stop()


def consume(
    model: Path, handle: dict[str, Any], policy: str = "recompute", connector: Any = None
) -> tuple[list[int], LLMEngine, str | None]:
    connector = connector or P2PConnector(timeout_s=20.0)
    engine = LLMEngine(
        EngineConfig(model=str(model), num_kv_blocks=64, kv_load_failure=policy), connector
    )
    remote = RemoteKV([], len(PROMPT), handle["address"], handle["transfer_id"])
    engine.add_request("c", PROMPT, GREEDY, output_token_ids=[handle["first"]], remote_kv=remote)
    tokens, error = [handle["first"]], None
    try:
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                error = error or out.error
    finally:
        connector.close()
    return tokens, engine, error


def test_handoff_matches_colocated_and_frees_the_producer(
    producer: Any, tiny_model_dir: Path
) -> None:
    p = producer()
    handle = p.next()
    assert handle["held"] and handle["transfer_id"].startswith("p.")
    tokens, engine, error = consume(tiny_model_dir, handle)
    assert error is None
    assert engine.transfers is not None
    assert engine.transfers.stats.blocks_loaded == 3  # the partial tail travels too
    assert engine.transfers.stats.blocks_recomputed == 0
    assert tokens == _colocated(tiny_model_dir, PROMPT)
    done = p.next(30)
    assert done["free_blocks"] == done["total_blocks"]
    assert done["p2p"]["lease_ends"] == {"pulled": 1} and done["p2p"]["blocks_held"] == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_abort_before_pull(producer: Any, tiny_model_dir: Path, policy: str) -> None:
    p = producer()
    handle = p.next()
    held_free = handle["free_blocks"]
    p.send("abort")
    done = p.next(30)
    assert done["free_blocks"] == done["total_blocks"] > held_free
    assert done["p2p"]["lease_ends"] == {"aborted": 1} and done["p2p"]["blocks_held"] == 0

    tokens, engine, error = consume(tiny_model_dir, handle, policy)
    assert engine.transfers is not None
    assert engine.transfers.stats.load_fallbacks == {"missing": 1}
    if policy == "fail":
        assert error is not None and "KV load failed (missing)" in error
    else:
        assert error is None and tokens == _colocated(tiny_model_dir, PROMPT)
        assert engine.transfers.stats.blocks_recomputed == 3


def test_lease_expiry_frees_the_producer(producer: Any) -> None:
    p = producer(p2p_lease_s=1.5)
    handle = p.next()
    assert handle["held"]
    done = p.next(30)  # nobody pulls
    assert done["free_blocks"] == done["total_blocks"]
    assert done["p2p"]["lease_ends"] == {"expired": 1} and done["p2p"]["blocks_held"] == 0


def test_fully_cached_prompt_still_releases_the_lease(producer: Any, tiny_model_dir: Path) -> None:
    """A consumer that needs none of the blocks still ends the producer's hold at once (a
    pull of no blocks) instead of leaving it to the lease time."""
    p = producer()
    handle = p.next()
    connector = P2PConnector(timeout_s=20.0)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64), connector)
    try:
        remote = RemoteKV([], 0, handle["address"], handle["transfer_id"])  # covers no tokens
        engine.add_request("c", PROMPT, GREEDY, remote_kv=remote)
        while engine.has_unfinished():
            engine.step()
    finally:
        connector.close()
    done = p.next(30)
    assert done["p2p"]["lease_ends"] == {"pulled": 1}
