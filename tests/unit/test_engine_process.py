"""The engine core in a process of its own (``ProcessEngineClient``, engine/engine_process.py;
docs/design.md §3 "Engine thread or engine process"), on the tiny model: the same tokens as
the engine thread, abort and a reused id, bad input, a failed start, KV events with their
snapshot, stats and LoRA calls across the pipe, and the engine process dying."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.client import GenerateRequest
from engine.config import EngineConfig
from engine.core.kv_events import STORED
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.engine_loop import EngineDeadError
from engine.process_client import ProcessEngineClient

DEADLINE_S = 120.0
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)


def _config(model_dir: Path, **kw: object) -> EngineConfig:
    return EngineConfig(model=str(model_dir), kv_cache_memory=1 << 22, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def client(tiny_model_dir: Path) -> AsyncIterator[ProcessEngineClient]:
    eng = ProcessEngineClient(_config(tiny_model_dir, kv_events=True))
    await asyncio.wait_for(eng.start(), DEADLINE_S)
    try:
        yield eng
    finally:
        await eng.shutdown()


async def _collect(
    eng: object, rid: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        request = GenerateRequest(rid, prompt, params)
        return [out async for out in eng.submit(request)]  # type: ignore[attr-defined]

    return await asyncio.wait_for(run(), DEADLINE_S)


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


async def test_same_tokens_as_the_engine_thread(
    client: ProcessEngineClient, tiny_model_dir: Path
) -> None:
    prompts = [list(range(100 + 7 * i, 140 + 9 * i)) for i in range(4)]
    # with logprobs (the whole RequestOutput crosses the pipe) and without (a plain delta,
    # packed as a tuple: engine_process.portable_item)
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    params = [GREEDY if i % 2 else plain for i in range(len(prompts))]
    got = await asyncio.gather(
        *(_collect(client, f"p{i}", p, params[i]) for i, p in enumerate(prompts))
    )
    thread = AsyncLLMEngine(_config(tiny_model_dir))
    await thread.start()
    try:
        want = await asyncio.gather(
            *(_collect(thread, f"t{i}", p, params[i]) for i, p in enumerate(prompts))
        )
    finally:
        await thread.shutdown()
    assert [_tokens(o) for o in got] == [_tokens(o) for o in want]
    assert ["".join(x.new_text for x in o) for o in got] == [
        "".join(x.new_text for x in o) for o in want
    ]
    assert all(len(_tokens(o)) == 8 and o[-1].finished for o in got)
    assert all(o[-1].finish_reason == "length" for o in got)
    assert [o[0].num_prompt_tokens for o in got] == [len(p) for p in prompts]
    assert [bool(o[0].logprobs) for o in got] == [bool(i % 2) for i in range(len(prompts))]
    assert client.model_fingerprint == thread.model_fingerprint
    assert client.max_model_len == thread.max_model_len
    load = client.get_load()
    deadline = time.monotonic() + DEADLINE_S
    while load.running and time.monotonic() < deadline:  # the idle load follows the last step
        await asyncio.sleep(0.02)
        load = client.get_load()
    assert load.running == 0 and load.waiting == 0 and load.total_blocks > 0


async def test_bad_input_is_a_value_error_and_the_engine_keeps_serving(
    client: ProcessEngineClient,
) -> None:
    too_long = list(range(client.max_model_len + 5))
    with pytest.raises(ValueError):
        await _collect(client, "bad", too_long, GREEDY)
    outs = await _collect(client, "good", [5, 6, 7], GREEDY)
    assert len(_tokens(outs)) == 8
    with pytest.raises(ValueError, match="already in use"):
        gen = client.submit(GenerateRequest("dup", [1, 2], SamplingParams(max_tokens=200)))
        first = await gen.__anext__()
        assert first.new_token_ids
        await client.submit(GenerateRequest("dup", [1, 2], GREEDY)).__anext__()
    await gen.aclose()  # leaving early aborts it


async def test_abort_then_reuse_the_id_gets_only_the_new_requests_tokens(
    client: ProcessEngineClient,
) -> None:
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    gen = client.submit(GenerateRequest("same", list(range(30, 60)), long))
    await asyncio.wait_for(gen.__anext__(), DEADLINE_S)
    await gen.aclose()  # abort while it still runs: outputs may still be on their way
    outs = await _collect(client, "same", [9, 8, 7], GREEDY)
    assert len(_tokens(outs)) == 8, "an output of the aborted request reached the new one"
    assert outs[-1].finished and outs[0].num_prompt_tokens == 3


async def test_kv_events_snapshot_then_live_batches(client: ProcessEngineClient) -> None:
    publisher = client.kv_events
    assert publisher is not None
    await _collect(client, "warm", list(range(200, 264)), GREEDY)  # blocks held before
    sub = publisher.subscribe(asyncio.get_running_loop())
    snapshot = (await sub.next(DEADLINE_S)).expand()
    assert snapshot.snapshot and any(e.kind == STORED for e in snapshot.events)
    held = {h for e in snapshot.events for h in e.block_hashes}
    await _collect(client, "more", list(range(400, 464)), GREEDY)
    live = await sub.next(DEADLINE_S)
    assert not live.snapshot and live.seq == snapshot.seq + 1
    assert any(e.kind == STORED and not set(e.block_hashes) & held for e in live.events)
    sub.close()


async def test_stats_from_a_thread_and_lora_off(client: ProcessEngineClient) -> None:
    await _collect(client, "s", list(range(10, 50)), GREEDY)  # full blocks: KV events
    deadline = time.monotonic() + DEADLINE_S
    while True:  # the last step's events follow its outputs, at the next command pass
        stats = await asyncio.to_thread(client.stats)
        assert stats.kv_events is not None
        if stats.kv_events.batches >= 1 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    assert stats.kv_events.batches >= 1 and stats.kv_events.events >= 1
    assert stats.load.total_blocks > 0 and stats.guided_compiles == {"compiled": 0, "shared": 0}
    assert client.lora_view() is None
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        await asyncio.wait_for(client.load_lora_adapter("a", "/nonexistent"), DEADLINE_S)


async def test_a_failed_start_says_why(tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": "wide"}')
    eng = ProcessEngineClient(EngineConfig(model=str(broken), load_format="dummy"))
    with pytest.raises(Exception) as info:  # raised in the engine process, carried here
        await asyncio.wait_for(eng.start(), DEADLINE_S)
    assert not isinstance(info.value, TimeoutError), "the start waited out its deadline"
    assert str(info.value), "the error says why"
    assert eng._process is not None and not eng._process.is_alive()  # noqa: SLF001
    with pytest.raises(EngineDeadError):
        await _collect(eng, "x", [1], GREEDY)


async def test_the_engine_process_dying_fails_its_requests_for_good(
    client: ProcessEngineClient,
) -> None:
    long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    gen = client.submit(GenerateRequest("doomed", [1, 2, 3], long))
    await asyncio.wait_for(gen.__anext__(), DEADLINE_S)
    os.kill(client._process.pid, signal.SIGKILL)  # noqa: SLF001 - the fault under test
    with pytest.raises(EngineDeadError, match="stopped"):
        async with asyncio.timeout(DEADLINE_S):
            async for _ in gen:
                pass
    assert client.fatal_error is not None
    with pytest.raises(EngineDeadError):
        await _collect(client, "after", [1], GREEDY)
    done = threading.Event()
    fut = client._call("stats")  # noqa: SLF001 - a call after the end fails at once
    fut.add_done_callback(lambda _f: done.set())
    assert done.wait(5) and isinstance(fut.exception(), EngineDeadError)


async def test_a_connector_lives_in_the_engine_process_and_its_counters_cross(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The fs connector is built in the engine process from its settings; a prompt saved
    there shows in ``stats()`` read across the pipe (its counters' lock stays behind)."""
    from kv_store.args import KVStoreSettings

    store = KVStoreSettings(connector="fs", kv_path=str(tmp_path / "kv"))
    eng = ProcessEngineClient(_config(tiny_model_dir), store)
    await asyncio.wait_for(eng.start(), DEADLINE_S)
    try:
        assert eng.connector_name == "fs"
        request = GenerateRequest("save", list(range(100, 164)), GREEDY, save_kv=True)
        outs = await asyncio.wait_for(_drain(eng.submit(request)), DEADLINE_S)
        saved = [o.kv_saved for o in outs if o.kv_saved is not None]
        assert saved and saved[-1].block_keys, "the prompt's blocks were saved"
        stats = await asyncio.to_thread(eng.stats)
        assert stats.connector_name == "fs" and stats.connector is not None
        assert stats.connector.blocks_saved == len(saved[-1].block_keys)
        stats.connector.record_lookup()  # a working copy, with a lock of its own
    finally:
        await eng.shutdown()


async def _drain(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in stream]
