"""``benchmarks.gpu.lora_step`` measures whole-batch pure-decode steps under async
scheduling (the default on CUDA) with a prefill spread over several steps. Before the
fix no step qualified there (the token in flight counts as computed, and the first
requests finished during the others' prefill) and the run ended in
``StatisticsError: no median for empty data``."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu.lora_step import TINY, decode_step_ms, decode_step_times


def test_decode_steps_are_measured_under_async_scheduling(tmp_path: Path) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path), load_format="dummy", device="cpu", max_num_seqs=8,
            max_model_len=128, kv_cache_memory=1 << 26, async_scheduling=True,
            max_num_batched_tokens=128,
        )
    )  # fmt: skip
    try:
        assert engine.config.async_scheduling_on
        # 8 prompts of 64 tokens over a 128-token budget: four prefill steps.
        assert len(decode_step_times(engine, 8, 64, 4, [None])) == 4
        assert decode_step_ms(engine, 8, 64, 6, [None]) > 0
        assert not engine.has_unfinished()
    finally:
        engine.shutdown()
