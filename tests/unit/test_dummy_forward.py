"""The made-up forward passes of engine/executor/dummy_forward.py on the CPU: which step
shapes the CUDA warm-up compiles, and that a dummy forward runs the real model into a
scratch cache of its own, leaving the engine's KV pool and its output untouched
(docs/design.md §"CUDA graphs", the eager steps' warm-up)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.executor.dummy_forward import dummy_forward, eager_warm_up_sizes
from engine.llm_engine import LLMEngine
from tests.engine_steps import outputs_until_done


def test_warm_up_sizes_cover_odd_counts_and_steps_past_the_graphs() -> None:
    # the defaults: budget 2048 = largest mixed graph, so only the small odd count
    assert eager_warm_up_sizes(2048, 4096, 2048) == [17]
    # a vLLM-sized budget: also the longest odd single-sequence step past the graphs
    assert eager_warm_up_sizes(8192, 4096, 2048) == [17, 4095]
    assert eager_warm_up_sizes(8192, 8191, 2048) == [17, 8191]
    # graphs off (graph_max 0): the longest step is eager too
    assert eager_warm_up_sizes(512, 4096, 0) == [17, 511]
    # a budget below 17 tokens warms nothing it could never run
    assert eager_warm_up_sizes(16, 4096, 0) == [15]
    sizes = eager_warm_up_sizes(8192, 4096, 2048)
    assert all(n % 16 for n in sizes), "every warm-up size must miss Triton's divisible-by-16"


def _generate(engine: LLMEngine, request_id: str, prompt: list[int]) -> list[int]:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=8, temperature=0.0))
    outputs = list(outputs_until_done(engine, deadline_s=120))
    assert all(out.error is None for out in outputs)
    return [t for out in outputs for t in out.new_token_ids]


def test_dummy_forward_leaves_the_kv_pool_and_outputs_alone(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32))
    prompt = list(range(300, 340))
    before = _generate(engine, "a", prompt)
    pool = engine.runner.kv_cache.clone()
    assert pool.abs().sum() > 0, "the request wrote KV"
    for n in eager_warm_up_sizes(64, 256, 0):  # [17, 63] on the CPU's torch path
        dummy_forward(engine.runner, n)
    assert torch.equal(engine.runner.kv_cache, pool)
    # the same prompt again (its cached blocks read back) gives the same greedy tokens
    assert _generate(engine, "b", prompt) == before
