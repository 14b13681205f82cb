"""An fp8 KV cache over the p2p connector (gloo on the CPU): the decode engine pulls the
prefill's e4m3 blocks — half the bytes of bfloat16, a quarter of float32 — and continues
exactly as a colocated fp8 engine; a float32-KV decode instance never reads them (the pair's
layouts differ: the pull is refused and the prompt recomputed, so its output is the
float32 engine's own). docs/design.md §3 "KV cache dtype".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core.request import RemoteKV
from engine.llm_engine import LLMEngine
from kv_store.p2p import P2PConnector, P2PStats
from tests.integration.test_engine_kv import GREEDY, PROMPT, _colocated
from tests.integration.test_p2p_engine import producer  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(300)


def _consume(model: Path, handle: dict[str, Any], kv: str) -> tuple[list[int], LLMEngine]:
    connector = P2PConnector(timeout_s=20.0)
    engine = LLMEngine(
        EngineConfig(model=str(model), num_kv_blocks=64, kv_cache_dtype=kv), connector
    )
    remote = RemoteKV([], len(PROMPT), handle["address"], handle["transfer_id"])
    engine.add_request("c", PROMPT, GREEDY, output_token_ids=[handle["first"]], remote_kv=remote)
    tokens = [handle["first"]]
    try:
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
                tokens += out.new_token_ids
    finally:
        connector.close()
    return tokens, engine


def _colocated_fp8(model: Path) -> list[int]:
    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=128, kv_cache_dtype="fp8"))
    engine.add_request("x", PROMPT, GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_fp8_pull_matches_colocated_fp8(producer: Any, tiny_model_dir: Path) -> None:  # noqa: F811
    p = producer(kv_cache_dtype="fp8")
    handle = p.next()
    tokens, engine = _consume(tiny_model_dir, handle, "fp8")
    assert engine.transfers is not None
    assert engine.transfers.stats.blocks_loaded == 3
    assert engine.transfers.stats.blocks_recomputed == 0
    # One byte per element: 2 layers x (K, V) x 3 blocks x 16 tokens x 2 KV heads x 16.
    stats = engine.stats().transport  # the p2p figures, handed on by the engine
    assert isinstance(stats, P2PStats) and stats.bytes_received == 2 * 2 * 3 * 16 * 2 * 16
    assert tokens == _colocated_fp8(tiny_model_dir)
    done = p.next(30)
    assert done["p2p"]["lease_ends"] == {"pulled": 1}


def test_float32_decode_never_reads_fp8_blocks(producer: Any, tiny_model_dir: Path) -> None:  # noqa: F811
    p = producer(kv_cache_dtype="fp8")
    handle = p.next()
    tokens, engine = _consume(tiny_model_dir, handle, "auto")
    assert engine.transfers is not None
    assert engine.transfers.stats.blocks_loaded == 0
    assert engine.transfers.stats.blocks_recomputed == 3
    assert tokens == _colocated(tiny_model_dir, PROMPT)
