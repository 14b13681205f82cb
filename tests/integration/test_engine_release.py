"""``LLMEngine.shutdown()`` gives back the weights and the KV pool, even while something still
holds the engine (on CUDA a shut-down runner stayed reachable and kept 0.9 of the GPU, so
the next engine in the process ran out of memory; docs/engine.md)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine


def test_shutdown_releases_weights_and_kv_pool(tiny_model_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), device="cpu", kv_cache_memory=64 << 20)
    )
    engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, temperature=0))
    while engine.has_unfinished():
        engine.step()
    runner = engine.executor.runner  # type: ignore[attr-defined]
    model = weakref.ref(runner.model)
    kv = weakref.ref(runner.kv_cache)
    assert runner.kv_cache.numel() > 0
    engine.shutdown()
    engine.shutdown()  # idempotent
    gc.collect()
    # `engine` and `runner` are still referenced here, as a leak would keep them.
    assert model() is None, "the weights outlived shutdown()"
    assert kv() is None, "the KV pool outlived shutdown()"
    assert runner.kv_cache.numel() == 0
