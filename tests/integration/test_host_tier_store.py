"""The host KV tier composed with a store connector (docs/design.md §3 "Host KV tier"):
device → host → store. A consumer engine (fs connector, a pool too small to keep what it
loaded, a host tier) takes a prompt's KV from the store, loses it from the device, and
then finds it in host memory: the store is asked only for what neither tier holds, and
the greedy text equals a colocated engine's every time."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core.request import RemoteKV
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from kv_store.factory import KVStoreSettings, build_connector
from tests.engine_steps import outputs_until_done

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
HEAD = list(range(300, 364))  # 4 full blocks
LONG = HEAD + list(range(900, 950))  # the head, 3 more full blocks and a partial tail
DRIVE_DEADLINE_S = 60.0


def _drive(engine: LLMEngine, rid: str) -> tuple[list[int], str | None]:
    """Step ``engine`` until it has nothing left (tests/engine_steps.py: a deadline in
    seconds, as a KV save or load in flight makes steps that return nothing)."""
    tokens: list[int] = []
    error = None
    for out in outputs_until_done(engine, DRIVE_DEADLINE_S):
        if out.request_id == rid:
            tokens += out.new_token_ids
            error = error or out.error
    return tokens, error


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LLMEngine]:
    store = {"connector": "fs", "kv_path": str(tmp_path_factory.mktemp("kv"))}
    model = str(tiny_model_dir)
    return {
        "producer": LLMEngine(
            EngineConfig(model=model, num_kv_blocks=64), build_connector(KVStoreSettings(**store))
        ),
        # 15 usable blocks; the host tier holds 64 (tiny model: 8 KiB per 16-token block).
        "consumer": LLMEngine(
            EngineConfig(
                model=model, num_kv_blocks=16, kv_offloading_size=64 * 8192, kv_events=True
            ),
            build_connector(KVStoreSettings(**store)),
        ),
        "colocated": LLMEngine(EngineConfig(model=model, num_kv_blocks=64)),
    }


def _colocated(engines: dict[str, LLMEngine], prompt: list[int], rid: str) -> list[int]:
    engine = engines["colocated"]
    engine.reset_prefix_cache()
    engine.add_request(rid, prompt, GREEDY)
    return _drive(engine, rid)[0]


def _prefill(engines: dict[str, LLMEngine], prompt: list[int], rid: str) -> int:
    producer = engines["producer"]
    producer.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), save_kv=True)
    tokens, error = _drive(producer, rid)
    assert error is None and len(tokens) == 1
    return tokens[0]


def _decode(engines: dict[str, LLMEngine], prompt: list[int], first: int, rid: str) -> list[int]:
    consumer = engines["consumer"]
    consumer.add_request(
        rid, prompt, GREEDY, output_token_ids=[first], remote_kv=RemoteKV([], len(prompt))
    )
    tokens, error = _drive(consumer, rid)
    assert error is None
    return [first, *tokens]


def _flush_device(engines: dict[str, LLMEngine], seed: int) -> None:
    """Run other prompts on the consumer until none of its earlier blocks is on the device."""
    consumer = engines["consumer"]
    for i in range(3):  # 21 blocks: more than the pool's 15
        prompt = [2000 + seed * 100 + i * 37 + j for j in range(100)]  # 6 blocks + tail
        consumer.add_request(f"flush-{seed}-{i}", prompt, GREEDY)
        _drive(consumer, f"flush-{seed}-{i}")


def test_device_then_host_then_store(engines: dict[str, LLMEngine]) -> None:
    consumer = engines["consumer"]
    assert consumer.transfers is not None and consumer.host_tier is not None
    transfers, host = consumer.transfers.stats, consumer.host_tier.stats

    # 1. From the store: nothing local yet.
    first = _prefill(engines, HEAD, "p-head")
    loaded = transfers.blocks_loaded
    assert _decode(engines, HEAD, first, "d-head") == _colocated(engines, HEAD, "c-head")
    assert transfers.blocks_loaded - loaded == 4

    # 2. From the host: the device lost it, the host kept it; the store is not asked.
    _flush_device(engines, 1)
    assert not any(consumer.kv.pool.get_cached_block(h) for h in _hashes(HEAD))
    hits, loaded = host.hits, transfers.blocks_loaded
    assert _decode(engines, HEAD, first, "d-head-2") == _colocated(engines, HEAD, "c-head")
    assert transfers.blocks_loaded == loaded
    assert host.hits - hits == 4

    # 3. Both: the head from the host, the rest of a longer prompt from the store.
    _flush_device(engines, 2)
    first_long = _prefill(engines, LONG, "p-long")
    hits, loaded = host.hits, transfers.blocks_loaded
    assert _decode(engines, LONG, first_long, "d-long") == _colocated(engines, LONG, "c-long")
    assert host.hits - hits == 4
    assert transfers.blocks_loaded - loaded == 4  # 3 full blocks and the partial tail


def _hashes(prompt: list[int]) -> list[bytes]:
    from common.block_hash import compute_block_hashes

    return compute_block_hashes(prompt, BS)
