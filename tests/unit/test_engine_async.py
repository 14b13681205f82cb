"""AsyncLLMEngine on a tiny model: streaming deltas, abort, bad input, cancellation (each
with and without async scheduling)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams

DEADLINE_S = 60.0


@pytest.fixture(params=[False, True], ids=["sync", "async_scheduling"])
async def engine(
    tiny_model_dir: Path, request: pytest.FixtureRequest
) -> AsyncIterator[AsyncLLMEngine]:
    """Each test runs with synchronous steps and with async scheduling (the GPU default;
    engine/step/async_scheduling.py), which the step loop must drive the same way."""
    config = EngineConfig(
        model=str(tiny_model_dir), kv_cache_memory=1 << 22, async_scheduling=request.param
    )
    eng = AsyncLLMEngine(config)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.shutdown(timeout=DEADLINE_S)


async def _collect(
    eng: AsyncLLMEngine, rid: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        return [out async for out in eng.generate(rid, prompt, params)]

    return await asyncio.wait_for(run(), DEADLINE_S)


async def _wait_until(pred: object, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_generate_streams_deltas_matching_offline(
    engine: AsyncLLMEngine, tiny_model_dir: Path
) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt = engine.tokenizer.encode("Once upon a time")
    outs = await _collect(engine, "s1", prompt, params)
    # One delta per step, unless this consumer fell behind (a loaded machine): then the
    # queued deltas come merged (test_output_stream.py), never lost or reordered.
    assert 1 <= len(outs) <= 8 and all(o.new_token_ids for o in outs)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length"
    assert all(o.logprobs is not None and len(o.logprobs) == len(o.new_token_ids) for o in outs)
    assert all(len(lp.top) == 2 for o in outs for lp in o.logprobs or ())
    assert outs[0].num_prompt_tokens == len(prompt)
    tokens = [t for o in outs for t in o.new_token_ids]
    text = "".join(o.new_text for o in outs)
    # The same request through the synchronous engine gives the same tokens and text.
    from engine.llm import LLM

    ref = LLM(str(tiny_model_dir), kv_cache_memory=1 << 22).generate([prompt], params)[0]
    assert tokens == ref.token_ids and text == ref.text
    load = engine.get_load()
    assert load.running == 0 and load.free_blocks == load.total_blocks
    pipeline = engine.engine.pipeline
    assert pipeline is None or pipeline.num_launched_ahead >= 5  # async: steps went ahead


async def test_concurrent_requests_all_complete(engine: AsyncLLMEngine) -> None:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 5, 1)]
    results = await asyncio.gather(
        *(_collect(engine, f"c{i}", [100 + i, 200, 300 + i], p) for i, p in enumerate(params))
    )
    assert [sum(len(o.new_token_ids) for o in r) for r in results] == [3, 9, 5, 1]


async def test_abort_frees_blocks_and_ends_stream(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    received: list[RequestOutput] = []

    async def consume() -> None:
        async for out in engine.generate("long", list(range(100, 140)), params):
            received.append(out)

    task = asyncio.create_task(consume())
    await _wait_until(lambda: len(received) >= 2, "first tokens")
    assert engine.get_load().running == 1
    assert engine.get_load().free_blocks < engine.get_load().total_blocks
    assert await engine.abort("long")
    await asyncio.wait_for(task, DEADLINE_S)
    assert received[-1].finished and received[-1].finish_reason == "abort"
    assert len(received) < 1000
    await _wait_until(
        lambda: (
            engine.get_load().free_blocks == engine.get_load().total_blocks
            and engine.get_load().running == 0
        ),
        "blocks freed after abort",
    )
    assert not await engine.abort("never-existed")


async def test_cancelled_consumer_aborts_request(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    seen = 0

    async def consume() -> None:
        nonlocal seen
        async for _ in engine.generate("cancel-me", list(range(100, 120)), params):
            seen += 1

    task = asyncio.create_task(consume())
    await _wait_until(lambda: seen >= 2, "first tokens")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, DEADLINE_S)
    await _wait_until(
        lambda: (
            engine.get_load().running == 0
            and engine.get_load().free_blocks == engine.get_load().total_blocks
        ),
        "the engine to abort the cancelled request",
    )
    assert "cancel-me" not in engine.engine.scheduler.requests


@pytest.mark.parametrize(
    ("prompt", "pattern"),
    [([], r"prompt must contain at least one token"), ([1, 10**9], r"token ids must be in")],
)
async def test_bad_input_raises_value_error(
    engine: AsyncLLMEngine, prompt: list[int], pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        await _collect(engine, "bad", prompt, SamplingParams())
    # The engine keeps serving after a rejected request.
    outs = await _collect(
        engine, "good", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    )
    assert outs[-1].finished


async def test_duplicate_live_request_id(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    gen = engine.generate("dup", [5, 6, 7], params)
    first = await asyncio.wait_for(gen.__anext__(), DEADLINE_S)
    assert not first.finished
    with pytest.raises(ValueError, match=r"request_id 'dup' is already in use"):
        await _collect(engine, "dup", [5, 6], SamplingParams())
    await gen.aclose()  # leaving early aborts
    await _wait_until(lambda: engine.get_load().running == 0, "dup aborted")


async def test_reused_id_after_abort_gets_only_its_own_output(engine: AsyncLLMEngine) -> None:
    """The aborted request's last output is made when the abort is read, in the same pass
    as the new request with its id: it carries the old generation and reaches no stream
    (engine/engine_loop.py)."""
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for _ in range(3):
        gen = engine.generate("same", list(range(30, 60)), long)
        await asyncio.wait_for(gen.__anext__(), DEADLINE_S)
        await gen.aclose()  # the abort, then at once a new request under the same id
        outs = await _collect(
            engine, "same", [9, 8, 7], SamplingParams(max_tokens=4, ignore_eos=True)
        )
        assert [o.finish_reason for o in outs][-1] == "length", "the abort's output arrived"
        assert sum(len(o.new_token_ids) for o in outs) == 4


async def test_generate_before_start_and_after_shutdown(tiny_model_dir: Path) -> None:
    eng = AsyncLLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=1 << 22))
    with pytest.raises(EngineDeadError):
        await _collect(eng, "x", [1, 2], SamplingParams())
    await eng.start()
    await eng.shutdown(timeout=DEADLINE_S)
    with pytest.raises(EngineDeadError):
        await _collect(eng, "y", [1, 2], SamplingParams())
