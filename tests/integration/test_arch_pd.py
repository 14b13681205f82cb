"""Prefill/decode handoff for the new architectures: a producer engine prefills a prompt
longer than the sliding window and hands its KV over (``fs`` through files, ``p2p`` from
a producer process holding the blocks); the consumer's greedy tokens equal a colocated
engine's. Gemma 2 (windowed and global layers, soft-caps) and Qwen3-MoE (experts, q/k
norm) and gpt-oss (sinks, alternating windows, biased experts) cover the new layouts of
work per layer with the Llama KV layout; DeepSeek-V2/V3
hand over MLA latents (one plane, one "head" of latent + rope key: their own record kind
and fingerprint)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.arch_fixtures import make_tiny_arch
from tests.integration.test_engine_kv import (
    PROMPT,
    _colocated,
    _consume_in_process,
    _produce_in_process,
)
from tests.integration.test_p2p_engine import Producer, consume

pytestmark = pytest.mark.timeout(400)
PD_ARCHS = ("gemma2", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss")


@pytest.fixture(scope="module")
def pd_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {a: make_tiny_arch(a, tmp_path_factory.mktemp(f"pd_{a}")) for a in PD_ARCHS}


@pytest.mark.parametrize("arch", PD_ARCHS)
def test_fs_handoff_matches_colocated(pd_dirs: dict[str, Path], tmp_path: Path, arch: str) -> None:
    model = pd_dirs[arch]
    settings = {"connector": "fs", "kv_path": str(tmp_path / "kv")}
    first, keys = _produce_in_process(settings, model, PROMPT)
    assert len(keys) == 3
    tokens, engine, error = _consume_in_process(settings, model, PROMPT, first)
    assert error is None
    assert engine.transfers is not None and engine.transfers.stats.blocks_recomputed == 0
    assert engine.transfers.stats.blocks_loaded == 3
    assert tokens == _colocated(model, PROMPT)


@pytest.mark.parametrize("arch", PD_ARCHS)
def test_p2p_handoff_matches_colocated(pd_dirs: dict[str, Path], arch: str) -> None:
    model = pd_dirs[arch]
    producer = Producer(model, {})
    try:
        handle = producer.next()
        tokens, engine, error = consume(model, handle)
        assert error is None
        assert engine.transfers is not None and engine.transfers.stats.blocks_loaded == 3
        assert engine.transfers.stats.blocks_recomputed == 0
        assert tokens == _colocated(model, PROMPT)
    finally:
        producer.stop()
