"""The host KV tier with the paged cache on the GPU (docs/design.md §3 "Host KV tier"):
evicted blocks go to pinned host memory and come back, with CUDA graphs and async
scheduling on (the CUDA defaults), and the greedy text equals a cold run's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]

BS = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _run(engine: LLMEngine, rid: str, prompt: list[int]) -> list[int]:
    engine.add_request(rid, prompt, GREEDY)
    tokens: list[int] = []
    for _ in range(10_000):
        if not engine.has_unfinished():
            return tokens
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
    raise AssertionError(f"{rid} did not finish")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_evicted_prompt_comes_back_from_pinned_host_memory(
    tmp_path: Path, kv_cache_dtype: str
) -> None:
    from tests.gpu.test_kv_fp8_gpu import _save_random_llama

    model = _save_random_llama(tmp_path / "small", 5)  # 4 layers, head_dim 64, vocab 1000

    def engine(host_bytes: int) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=str(model),
                device="cuda",
                dtype="bfloat16",
                kv_cache_dtype=kv_cache_dtype,
                num_kv_blocks=24,  # 23 usable: one 200-token prompt pushes another out
                kv_offloading_size=host_bytes,
                kv_events=True,
            )
        )

    warm_engine = engine(64 << 20)
    assert warm_engine.host_tier is not None
    first = [3 + (i * 7) % 990 for i in range(200)]
    cold = _run(warm_engine, "a", first)
    for seed in range(3):
        _run(warm_engine, f"f{seed}", [3 + (seed * 331 + i * 13) % 990 for i in range(200)])
    assert warm_engine.host_tier.stats.offloaded >= 12
    hits = warm_engine.host_tier.stats.hits
    assert _run(warm_engine, "a2", first) == cold
    assert warm_engine.host_tier.stats.hits - hits == 12  # every full block of the prompt
    assert _run(engine(0), "ref", first) == cold
