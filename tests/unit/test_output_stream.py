"""Output streams (engine/output_stream.py, docs/design.md §3 "Output streams"): a consumer
that keeps up gets one delta per step; one that fell behind gets the queued deltas merged,
every token, text piece and logprob in order; errors and KV saves keep their own output.
The last test drives the real ``AsyncLLMEngine`` on the tiny model."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.core.outputs import KvSaveResult, RequestOutput, TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.output_stream import OutputStream

DEADLINE_S = 60.0


def _out(tok: int, *, finished: bool = False, lp: bool = True, cached: int = 0) -> RequestOutput:
    return RequestOutput(
        "r",
        [tok],
        f"<{tok}>",
        finished,
        finish_reason="length" if finished else None,
        logprobs=[TokenLogprob(tok, -0.5, [(tok, -0.5)])] if lp else None,
        num_prompt_tokens=7,
        num_cached_tokens=cached,
    )


async def test_a_consumer_that_keeps_up_gets_one_output_per_put() -> None:
    stream = OutputStream()
    got = []
    for tok in range(5):
        waiter = asyncio.create_task(stream.get())
        await asyncio.sleep(0)  # the consumer waits before the output comes
        stream.put(_out(tok, finished=tok == 4))
        got.append(await asyncio.wait_for(waiter, DEADLINE_S))
    assert [o.new_token_ids for o in got] == [[0], [1], [2], [3], [4]]  # type: ignore[union-attr]


async def test_a_consumer_behind_gets_the_queued_outputs_merged_in_order() -> None:
    stream = OutputStream()
    first = _out(0)
    first.prompt_logprobs = [TokenLogprob(3, -1.0)]
    for out in (first, _out(1), _out(2, cached=16), _out(3, finished=True, cached=16)):
        stream.put(out)
    merged = await stream.get()
    assert isinstance(merged, RequestOutput)
    assert merged.new_token_ids == [0, 1, 2, 3]
    assert merged.new_text == "<0><1><2><3>"
    assert [lp.token_id for lp in merged.logprobs or ()] == [0, 1, 2, 3]
    assert merged.prompt_logprobs is not None and merged.prompt_logprobs[0].token_id == 3
    assert merged.finished and merged.finish_reason == "length"
    assert merged.num_cached_tokens == 16 and merged.num_prompt_tokens == 7


async def test_errors_kv_saves_and_the_finish_are_not_merged_across() -> None:
    stream = OutputStream()
    failed = _out(2)
    failed.error = "kv load failed"
    saved = _out(4)
    saved.kv_saved = KvSaveResult(["k"], 16, 1, 0.0)
    boom = RuntimeError("engine died")
    for item in (_out(0), _out(1), failed, saved, _out(5, finished=True), _out(6), boom):
        stream.put(item)
    got = [await asyncio.wait_for(stream.get(), DEADLINE_S) for _ in range(6)]
    shapes = [g.new_token_ids if isinstance(g, RequestOutput) else g for g in got]
    assert shapes == [[0, 1], [2], [4], [5], [6], boom]


async def test_logprobs_stay_none_when_no_output_has_them() -> None:
    stream = OutputStream()
    stream.put(_out(0, lp=False))
    stream.put(_out(1, lp=False))
    merged = await stream.get()
    assert isinstance(merged, RequestOutput) and merged.logprobs is None
    assert merged.new_token_ids == [0, 1]


async def test_a_stalled_consumer_of_the_real_engine_gets_the_rest_in_one_output(
    tiny_model_dir: Path,
) -> None:
    """The consumer reads the first delta, then stalls until the engine has finished the
    request: the rest arrives as one output, equal token for token to a stream read as it
    goes (and to the offline engine's answer)."""
    config = EngineConfig(model=str(tiny_model_dir), kv_cache_memory=1 << 22)
    engine = AsyncLLMEngine(config)
    await engine.start()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    prompt = engine.tokenizer.encode("Once upon a time")
    try:

        async def stalled() -> list[RequestOutput]:
            outs: list[RequestOutput] = []
            async for out in engine.generate("stalled", prompt, params):
                outs.append(out)
                deadline = time.monotonic() + DEADLINE_S
                while len(outs) == 1 and engine.get_load().running:
                    assert time.monotonic() < deadline, "the engine did not finish"
                    await asyncio.sleep(0.01)
            return outs

        outs = await asyncio.wait_for(stalled(), DEADLINE_S)
        steady = await asyncio.wait_for(_collect(engine, "steady", prompt, params), DEADLINE_S)
    finally:
        await engine.shutdown(timeout=DEADLINE_S)
    # The first read may already hold a few merged tokens (the engine ran ahead of the
    # consumer's first await on a loaded machine); everything after it is one output.
    assert len(outs) == 2 and outs[1].finished and not outs[0].finished
    assert len(outs[0].new_token_ids) + len(outs[1].new_token_ids) == 24
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == [t for o in steady for t in o.new_token_ids]
    assert "".join(o.new_text for o in outs) == "".join(o.new_text for o in steady)
    assert [lp.token_id for o in outs for lp in o.logprobs or ()] == tokens
    from engine.llm import LLM

    ref = LLM(str(tiny_model_dir), kv_cache_memory=1 << 22).generate([prompt], params)[0]
    assert tokens == ref.token_ids


async def _collect(
    engine: AsyncLLMEngine, rid: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    return [out async for out in engine.generate(rid, prompt, params)]
