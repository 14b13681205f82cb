"""The engine as KV producer and consumer through each real connector.

A producer engine (its own process) prefills and saves; a consumer engine (another
process) loads and continues; its greedy tokens must equal a single colocated engine's.
Faults (corrupt record, deleted block, store down) must recompute and still be exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core.request import RemoteKV
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from kv_store.factory import KVStoreSettings, build_connector

PROMPT = list(range(300, 345))  # 45 tokens: 2 full blocks + a partial tail
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
WORKER = "tests.integration.kv_engine_worker"


def _settings(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, str]:
    if backend == "fs":
        return {"connector": "fs", "kv_path": str(tmp_path / "kv")}
    if backend == "redis":
        return {"connector": "redis", "redis_url": request.getfixturevalue("redis_server")}
    return {"connector": "lmcache", "lmcache_url": request.getfixturevalue("lmcache_server")}


def _worker(*args: str) -> dict:
    env = os.environ | {"PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", WORKER, *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _colocated(model: Path, prompt: list[int]) -> list[int]:
    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=128))
    engine.add_request("x", prompt, GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def _consume_in_process(
    connector_settings: dict, model: Path, prompt: list[int], first: int, policy: str = "recompute"
) -> tuple[list[int], LLMEngine, str | None]:
    engine = LLMEngine(
        EngineConfig(model=str(model), num_kv_blocks=128, kv_load_failure=policy),
        build_connector(KVStoreSettings(**connector_settings)),
    )
    engine.add_request(
        "c", prompt, GREEDY, output_token_ids=[first], remote_kv=RemoteKV([], len(prompt))
    )
    tokens, error = [first], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            error = error or out.error
    return tokens, engine, error


@pytest.mark.parametrize("backend", ["fs", "redis", "lmcache"])
def test_cross_process_handoff_is_exact(
    backend: str, tiny_model_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    settings = json.dumps(_settings(backend, tmp_path, request))
    prompt = PROMPT if backend != "lmcache" else [t + len(str(tmp_path)) for t in PROMPT]
    produced = _worker("produce", str(tiny_model_dir), settings, json.dumps(prompt))
    assert len(produced["keys"]) == 3  # the partial tail block is stored too
    consumed = _worker(
        "consume", str(tiny_model_dir), settings, json.dumps(prompt), str(produced["first"])
    )
    assert consumed["loaded"] == 3 and consumed["recomputed"] == 0
    assert consumed["tokens"] == _colocated(tiny_model_dir, prompt)


def _produce_in_process(settings: dict, model: Path, prompt: list[int]) -> tuple[int, list[str]]:
    engine = LLMEngine(
        EngineConfig(model=str(model), num_kv_blocks=128),
        build_connector(KVStoreSettings(**settings)),
    )
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0), save_kv=True)
    first, keys = -1, []
    while engine.has_unfinished():
        for out in engine.step():
            first = out.new_token_ids[0] if out.new_token_ids else first
            keys = out.kv_saved.block_keys if out.kv_saved else keys
    return first, keys


def _fs_path(kv_dir: Path, key: str) -> Path:
    matches = [p for p in kv_dir.rglob("*") if p.is_file() and key.rsplit("/", 1)[-1] in p.name]
    assert matches, f"no file for {key} under {kv_dir}"
    return matches[0]


def test_corrupt_record_is_detected_and_recomputed(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = {"connector": "fs", "kv_path": str(tmp_path / "kv")}
    first, keys = _produce_in_process(settings, tiny_model_dir, PROMPT)
    victim = _fs_path(tmp_path / "kv", keys[1])
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    tokens, engine, _ = _consume_in_process(settings, tiny_model_dir, PROMPT, first)
    assert tokens == _colocated(tiny_model_dir, PROMPT)
    assert engine.transfers is not None
    assert engine.transfers.stats.blocks_loaded == 1  # block 0 intact, stops at the bad one
    assert engine.transfers.stats.load_fallbacks["checksum"] == 1


def test_deleted_block_is_recomputed(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = {"connector": "fs", "kv_path": str(tmp_path / "kv")}
    first, keys = _produce_in_process(settings, tiny_model_dir, PROMPT)
    _fs_path(tmp_path / "kv", keys[0]).unlink()
    tokens, engine, _ = _consume_in_process(settings, tiny_model_dir, PROMPT, first)
    assert tokens == _colocated(tiny_model_dir, PROMPT)
    assert engine.transfers is not None
    assert engine.transfers.stats.blocks_loaded == 0
    assert engine.transfers.stats.load_fallbacks["missing"] == 1


def test_fail_policy_fails_the_request(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = {"connector": "fs", "kv_path": str(tmp_path / "kv")}
    tokens, engine, error = _consume_in_process(settings, tiny_model_dir, PROMPT, 7, policy="fail")
    assert error is not None and "KV load failed" in error
    assert tokens == [7]
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks


def test_redis_down_still_finishes(tiny_model_dir: Path, redis_proc, redis_server: str) -> None:
    settings = {"connector": "redis", "redis_url": redis_server}
    first, _ = _produce_in_process(settings, tiny_model_dir, PROMPT)
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128),
        build_connector(KVStoreSettings(**settings)),
    )
    redis_proc.stop()
    engine.add_request(
        "c", PROMPT, GREEDY, output_token_ids=[first], remote_kv=RemoteKV([], len(PROMPT))
    )
    tokens = [first]
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    assert tokens == _colocated(tiny_model_dir, PROMPT)
    assert engine.transfers is not None
    assert engine.transfers.stats.load_fallbacks["unreachable"] == 1


def test_local_prefix_hit_loads_only_the_rest(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = {"connector": "fs", "kv_path": str(tmp_path / "kv")}
    first, _ = _produce_in_process(settings, tiny_model_dir, PROMPT)
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128),
        build_connector(KVStoreSettings(**settings)),
    )
    # Warm the consumer's own prefix cache with the first 2 full blocks of the prompt.
    engine.add_request("warm", PROMPT[:33], SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    engine.add_request(
        "c", PROMPT, GREEDY, output_token_ids=[first], remote_kv=RemoteKV([], len(PROMPT))
    )
    tokens = [first]
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    assert engine.transfers is not None
    assert engine.transfers.stats.blocks_loaded == 1  # only the partial tail came from the store
    assert tokens == _colocated(tiny_model_dir, PROMPT)
