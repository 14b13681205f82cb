"""Pipeline parallelism on the CPU over gloo with real processes (docs/design.md §3
"Pipeline parallelism"): P = 2 (one layer per stage of the tiny Llama) and P = 2 × N = 2
give the same greedy tokens as P = 1 and as transformers (float32), with up to P batches
in flight and with them off; chunked prefill with preemption, prefix-cache hits, guided
decoding and speculative decoding (which runs one batch at a time) under P = 2; a killed
stage and a hung stage fail the engine within their deadline and leave no process; sizes
the model cannot split, and what PP does not run yet, are refused before any process
starts."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.executor.pp.executor import PipelineExecutor, PipelineParallelError
from engine.llm_engine import LLMEngine
from tests.integration.test_engine_parity import _hf_greedy, _run_staggered
from tests.integration.test_tensor_parallel import MAX_NEW, _prompts, _wait_gone
from tests.integration.test_tensor_parallel_features import (
    REGEX,
    SCHEMA,
    _guided,
    _speculate,
)


def _engine(model_dir: Path, pp: int, tp: int = 1, **overrides: Any) -> LLMEngine:
    config = {"num_kv_blocks": 128, "dtype": "float32"} | overrides
    return LLMEngine(
        EngineConfig(
            model=str(model_dir), pipeline_parallel_size=pp, tensor_parallel_size=tp, **config
        )
    )


def _workers(engine: LLMEngine) -> list[int]:
    assert isinstance(engine.executor, PipelineExecutor)
    return engine.executor.worker_pids


@pytest.fixture(scope="module")
def pp1(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    engine = _engine(tiny_model_dir, 1)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def pp2(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    engine = _engine(tiny_model_dir, 2)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def greedy(tiny_model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (half share a 40-token prefix) and transformers' greedy tokens."""
    prompts = _prompts(8, seed=5)
    return prompts, _hf_greedy(tiny_model_dir, prompts, MAX_NEW)


def test_pp2_greedy_matches_pp1_and_transformers_with_batches_in_flight(
    pp1: LLMEngine, pp2: LLMEngine, greedy: tuple[list[list[int]], list[list[int]]]
) -> None:
    prompts, expected = greedy
    assert pp2.runner.kv_cache.shape[0] == 1  # stage 0 holds its one layer's KV only
    assert pp1.runner.kv_cache.shape[0] == 2
    assert _run_staggered(pp1, prompts, MAX_NEW) == expected
    hits = pp2.kv.pool.prefix_hits
    assert _run_staggered(pp2, prompts, MAX_NEW) == expected
    assert pp2.batches is not None and pp2.batches.max_in_flight == 2, "stages must overlap"
    assert pp2.kv.pool.prefix_hits > hits, "shared prefixes should hit the prefix cache"
    assert pp2.kv.pool.num_free_blocks == pp2.kv.pool.num_usable_blocks, "blocks leaked"


def test_pp2_tp2_grid_and_one_batch_at_a_time_match_transformers(
    tiny_model_dir: Path, greedy: tuple[list[list[int]], list[list[int]]]
) -> None:
    prompts, expected = greedy
    grid = _engine(tiny_model_dir, 2, 2)
    try:
        assert len(_workers(grid)) == 3  # a 2 x 2 grid: rank 0 here, three workers
        assert grid.runner.kv_cache.shape[0] == 1 and grid.runner.kv_cache.shape[4] == 1
        assert _run_staggered(grid, prompts, MAX_NEW) == expected
    finally:
        grid.shutdown()
    serial = _engine(tiny_model_dir, 2, pipeline_inflight_batches=False)
    try:
        assert serial.batches is None
        assert _run_staggered(serial, prompts, MAX_NEW) == expected
    finally:
        serial.shutdown()


def test_pp2_chunked_prefill_and_preemption_match_pp1(tiny_model_dir: Path) -> None:
    """A small token budget chunks prompts (mixed with decodes); a small pool preempts,
    never a request whose batch is in flight."""
    prompts = _prompts(6, seed=9)
    knobs = {"max_num_batched_tokens": 24, "block_size": 8, "num_kv_blocks": 16}
    one = _run_staggered(_engine(tiny_model_dir, 1, **knobs), prompts, MAX_NEW)
    engine = _engine(tiny_model_dir, 2, **knobs)
    preempted: list[str] = []
    preempt = engine.scheduler._preempt

    def counting(request: Any, out: Any) -> int:
        assert engine.batches is not None
        assert request.request_id not in engine.batches.busy, "preempted in flight"
        preempted.append(request.request_id)
        return preempt(request, out)

    engine.scheduler._preempt = counting  # type: ignore[method-assign]
    try:
        two = _run_staggered(engine, prompts, MAX_NEW)
    finally:
        engine.shutdown()
    assert preempted, "a 16-block pool must preempt"
    assert two == one


def test_pp2_guided_decoding_matches_pp1(pp1: LLMEngine, pp2: LLMEngine) -> None:
    one, two = _guided(pp1), _guided(pp2)
    assert len(two) == 8
    for rid, (_, text) in two.items():
        if rid.startswith("json"):
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, text), (rid, text)
    assert two == one


def test_pp2_speculative_decoding_matches_pp1_one_batch_at_a_time(tiny_model_dir: Path) -> None:
    knobs = {"speculative": "ngram:k=4,n=3", "max_num_batched_tokens": 40, "num_kv_blocks": 256}
    one = _speculate(_engine(tiny_model_dir, 1, **knobs))
    engine = _engine(tiny_model_dir, 2, **knobs)
    try:
        assert engine.batches is None  # drafts need the newest token: no batch in flight
        two = _speculate(engine)
        stats = engine.stats().spec
        assert stats is not None and stats.num_accepted_tokens > 0, stats
    finally:
        engine.shutdown()
    assert two == one


def _long(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [8, 9], params)


@pytest.mark.timeout(120)  # the guard: a dead stage must fail the step, never hang it
def test_killed_stage_fails_the_engine_and_leaves_no_process(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, 2)
    pids = _workers(engine)
    try:
        _long(engine)
        engine.step()
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(PipelineParallelError, match=r"rank 1 \(pid \d+\) exited with signal"):
            while engine.has_unfinished():
                engine.step()
        assert _wait_gone(pids, 5) == []
        with pytest.raises(PipelineParallelError):  # and every later step, at once
            engine.step()
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)  # the guard: the step must end at its 2 s deadline
def test_hung_stage_fails_the_step_at_the_deadline(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, 2, 1, distributed_timeout=2.0)
    pids = _workers(engine)
    try:
        _long(engine)
        engine.step()
        os.kill(pids[0], signal.SIGSTOP)
        with pytest.raises(PipelineParallelError, match="pipeline-parallel step failed"):
            while engine.has_unfinished():
                engine.step()
    finally:
        engine.shutdown()  # kills the stopped worker
    assert _wait_gone(pids, 5) == []


def test_sizes_the_model_cannot_split_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        EngineConfig(model=str(tiny_model_dir), pipeline_parallel_size=3)
    with pytest.raises(ValueError, match=r"does not divide the model's 3 layers.*\[1, 3\]"):
        EngineConfig(
            model=str(tiny_model_dir),
            pipeline_parallel_size=2,
            hf_overrides={"num_hidden_layers": 3},
        )
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        EngineConfig(model=str(tiny_model_dir), pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="enable_lora with pipeline_parallel_size"):
        EngineConfig(model=str(tiny_model_dir), pipeline_parallel_size=2, enable_lora=True)
    from kv_store.block_connector import BlockStoreConnector
    from kv_store.fs_backend import FsBackend

    connector = BlockStoreConnector(FsBackend(str(tmp_path)), name="fs")
    # A connector with no worker per rank (no rank_spec, as LMCache's) cannot serve a grid.
    with pytest.raises(ValueError, match="or pipeline_parallel_size > 1 \\(no worker per rank"):
        LLMEngine(
            EngineConfig(model=str(tiny_model_dir), pipeline_parallel_size=2), connector=connector
        )


def test_more_gpus_than_visible_are_refused_before_any_process_starts(
    tiny_model_dir: Path,
) -> None:
    import torch

    from engine.llm import LLM

    tp = 1  # P = 2 stages of N ranks: more GPUs than visible, on any machine
    while 2 * tp <= torch.cuda.device_count():
        tp *= 2
    with pytest.raises(ValueError, match=f"pipeline_parallel_size x tensor_parallel_size {2 * tp}"):
        LLM(
            str(tiny_model_dir),
            device="cuda",
            pipeline_parallel_size=2,
            tensor_parallel_size=tp,
            hf_overrides={"num_attention_heads": max(4, tp), "num_key_value_heads": 1},
        )
