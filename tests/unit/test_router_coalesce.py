"""The SSE writer's coalescing (router/openai/coalesce.py): a writer that keeps up gets
each delta alone; one that fell behind gets what piled up merged per choice, every token,
text piece and logprob in order; a finish, another choice or a choice's first delta (its
prompt logprobs) starts a new delta; an error comes after the deltas before it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from router.legs.trace import Delta, TokenLogprob
from router.openai.coalesce import coalesced

DEADLINE_S = 30.0


def _d(i: int, tok: int, finish: str | None = None, *, lp: bool = False) -> Delta:
    logprobs = [TokenLogprob(tok, -0.1, [])] if lp else None
    return Delta(i, [tok], f"<{tok}>", logprobs, finish)


async def _source(deltas: list[Delta | Exception]) -> AsyncIterator[Delta]:
    for d in deltas:
        if isinstance(d, Exception):
            raise d
        yield d


async def _drain(batches: AsyncIterator[list[Delta]]) -> list[list[Delta]]:
    return [batch async for batch in batches]


async def test_a_writer_that_keeps_up_gets_one_delta_per_batch() -> None:
    written = asyncio.Event()

    async def paced() -> AsyncIterator[Delta]:
        for tok in range(5):
            yield _d(0, tok, "length" if tok == 4 else None)
            await asyncio.wait_for(written.wait(), DEADLINE_S)  # the writer took it
            written.clear()

    got = []
    async with contextlib.aclosing(coalesced(paced())) as batches:
        async for batch in batches:
            got.append([d.token_ids for d in batch])
            written.set()
    assert got == [[[0]], [[1]], [[2]], [[3]], [[4]]]


async def test_a_writer_behind_gets_each_choice_merged_in_order() -> None:
    deltas: list[Delta | Exception] = [_d(0, 1, lp=True), _d(1, 10), _d(0, 2, lp=True)]
    deltas += [_d(1, 11), _d(0, 3, "length", lp=True), _d(1, 12, "stop")]
    gen = coalesced(_source(deltas))
    await asyncio.sleep(0.05)  # everything arrives before the first write
    got = await asyncio.wait_for(_drain(gen), DEADLINE_S)
    flat = [d for batch in got for d in batch]
    # Interleaved choices (n > 1) merge each into its own delta.
    assert [(d.index, d.token_ids) for d in flat] == [(0, [1, 2, 3]), (1, [10, 11, 12])]
    tokens = {i: [t for d in flat if d.index == i for t in d.token_ids] for i in (0, 1)}
    assert tokens == {0: [1, 2, 3], 1: [10, 11, 12]}
    assert "".join(d.text for d in flat if d.index == 0) == "<1><2><3>"
    zero = [d for d in flat if d.index == 0]
    assert [lp.token_id for d in zero for lp in d.logprobs or ()] == [1, 2, 3]
    assert [d.finish_reason for d in flat if d.finish_reason] == ["length", "stop"]


async def test_one_choice_behind_becomes_one_delta() -> None:
    gen = coalesced(_source([_d(0, t) for t in range(20)] + [_d(0, 20, "length")]))
    await asyncio.sleep(0.05)
    got = await asyncio.wait_for(_drain(gen), DEADLINE_S)
    assert [[d.token_ids for d in b] for b in got] == [[list(range(21))]]
    assert got[0][0].finish_reason == "length" and got[0][0].text.startswith("<0><1>")


async def test_finish_and_prompt_logprobs_start_a_new_delta() -> None:
    first = _d(0, 5)
    first.prompt_logprobs = [TokenLogprob(2, -1.0, [])]
    fresh = _d(0, 6)
    fresh.prompt_logprobs = [TokenLogprob(3, -1.0, [])]  # a resumed choice's first delta
    gen = coalesced(_source([_d(0, 1, "stop"), _d(0, 2), first, fresh, _d(0, 7)]))
    await asyncio.sleep(0.05)
    flat = [d for b in await asyncio.wait_for(_drain(gen), DEADLINE_S) for d in b]
    assert [d.token_ids for d in flat] == [[1], [2], [5], [6, 7]]
    assert [d.prompt_logprobs is not None for d in flat] == [False, False, True, True]


async def test_an_error_comes_after_the_deltas_before_it() -> None:
    gen = coalesced(_source([_d(0, 1), _d(0, 2), RuntimeError("decode lost")]))
    await asyncio.sleep(0.05)
    got: list[int] = []
    with pytest.raises(RuntimeError, match="decode lost"):
        async for batch in gen:
            got += [t for d in batch for t in d.token_ids]
    assert got == [1, 2]


async def test_closing_the_writer_cancels_the_source() -> None:
    closed = asyncio.Event()

    async def endless() -> AsyncIterator[Delta]:
        try:
            tok = 0
            while True:
                yield _d(0, tok)
                tok += 1
                await asyncio.sleep(0.001)
        finally:
            closed.set()

    async with contextlib.aclosing(coalesced(endless())) as batches:
        async for _batch in batches:
            break
    await asyncio.wait_for(closed.wait(), DEADLINE_S)
