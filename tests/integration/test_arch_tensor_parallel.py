"""Tensor parallelism (N = 2, gloo worker processes on the CPU) over the new
architectures gives transformers' greedy tokens, as N = 1 does: Phi-3's fused tensors
split before sharding, Gemma's windowed/global layers and soft-caps, and the MoE experts
sharded Megatron-style (each rank a slice of every expert, one all-reduce), and gpt-oss's
per-head sinks, stacked experts and row-parallel biases (added by rank 0 alone)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.arch_fixtures import make_tiny_arch
from tests.integration.test_arch_parity import arch_prompts, hf_greedy
from tests.integration.test_engine_parity import _run_staggered

MAX_NEW = 6
TP_ARCHS = ("phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "gpt_oss")


@pytest.mark.parametrize("arch", TP_ARCHS)
def test_tp2_matches_transformers(tmp_path: Path, arch: str) -> None:
    model_dir = make_tiny_arch(arch, tmp_path / arch)
    prompts = arch_prompts(6)[1:4]  # 20, 57 and 124 tokens: all longer than the window
    expected = hf_greedy(model_dir, prompts, MAX_NEW)
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), tensor_parallel_size=2, num_kv_blocks=96, block_size=8)
    )
    try:
        got = _run_staggered(engine, prompts, MAX_NEW)
    finally:
        engine.shutdown()
    assert got == expected
