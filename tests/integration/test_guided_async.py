"""Guided and speculative requests through AsyncLLMEngine, the interface services drive:
a bad guide surfaces as ValueError from ``generate`` (the servicers map it to
INVALID_ARGUMENT), a good one streams to a "stop" that obeys it."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.core.guided_spec import GuidedSpec
from engine.core.sampling_params import SamplingParams


async def test_async_engine_guided_and_speculative(tiny_model_dir: Path) -> None:
    engine = AsyncLLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, speculative="ngram:k=3")
    )
    await engine.start()
    try:
        with pytest.raises(ValueError, match="invalid guided regex"):
            async for _ in engine.generate(
                "bad", [1, 2, 3], SamplingParams(guided=GuidedSpec("regex", "(x"))
            ):
                pass

        async def collect(rid: str, params: SamplingParams) -> tuple[str, str | None]:
            text, reason = "", None
            async for out in engine.generate(rid, [1, 2, 3, 1, 2, 3, 1, 2], params):
                text += out.new_text
                reason = out.finish_reason
            return text, reason

        guided = SamplingParams(max_tokens=40, seed=3, guided=GuidedSpec("regex", r"[a-c]{2,6}!"))
        free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        (gtext, greason), (_, freason) = await asyncio.wait_for(
            asyncio.gather(collect("g", guided), collect("f", free)), timeout=120
        )
        assert greason == "stop" and re.fullmatch(r"[a-c]{2,6}!", gtext), gtext
        assert freason == "length"
    finally:
        await engine.shutdown()
