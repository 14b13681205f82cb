"""Async scheduling (engine/step/async_scheduling.py) gives exactly the outputs of synchronous
steps: greedy and seeded sampling with logprobs, stop strings and max_tokens ending
requests mid-pipeline, EOS, aborts while a step is in flight, arrivals that force a
synchronous step, preemption under a small KV pool, and requests the pipeline must not
defer (penalties). Each test also checks that steps really were launched ahead, so a
pipeline that silently never engages fails."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine


def _engine(model_dir: Path, async_on: bool, **overrides: Any) -> LLMEngine:
    cfg: dict[str, Any] = {
        "model": str(model_dir),
        "load_format": "auto",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "async_scheduling": async_on,
    }
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


Event = tuple[int, str, Any]  # (step index, kind, payload)


def _drive(
    engine: LLMEngine,
    requests: list[tuple[str, list[int], SamplingParams]],
    *,
    arrivals: dict[int, list[int]] | None = None,
    aborts: dict[int, list[str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Add requests (all at once, or at the step indices of ``arrivals``), abort at the
    step indices of ``aborts``, step until done; per request: tokens, text, finish
    reason, logprobs."""
    arrivals = arrivals if arrivals is not None else {0: list(range(len(requests)))}
    aborts = aborts or {}
    got: dict[str, dict[str, Any]] = {
        rid: {"tokens": [], "text": "", "finish": None, "logprobs": []} for rid, _, _ in requests
    }
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i in arrivals.get(step, []):
            rid, prompt, params = requests[i]
            engine.add_request(rid, prompt, params)
        for rid in aborts.get(step, []):
            engine.abort_request(rid)
        outs: list[RequestOutput] = engine.step()
        for out in outs:
            g = got[out.request_id]
            g["tokens"] += out.new_token_ids
            g["text"] += out.new_text
            g["logprobs"] += [(lp.token_id, round(lp.logprob, 4)) for lp in out.logprobs or []]
            if out.finished:
                assert g["finish"] is None, f"{out.request_id} finished twice"
                g["finish"] = out.finish_reason
        step += 1
        assert step < 2000, "engine did not finish"
    return got


def _both(
    model_dir: Path, requests: list[tuple[str, list[int], SamplingParams]], **kw: Any
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], LLMEngine]:
    engine_kw = kw.pop("engine", {})
    sync = _drive(_engine(model_dir, False, **engine_kw), requests, **kw)
    eng = _engine(model_dir, True, **engine_kw)
    ahead = _drive(eng, requests, **kw)
    return sync, ahead, eng


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


def test_greedy_and_lengths_match_sync(model: Path) -> None:
    """Different max_tokens end requests at different steps while later steps are in flight."""
    reqs = [
        (f"g{i}", p, SamplingParams(max_tokens=1 + 3 * i, temperature=0.0, ignore_eos=True))
        for i, p in enumerate(_prompts(6, 1))
    ]
    sync, ahead, eng = _both(model, reqs)
    assert ahead == sync
    assert [len(ahead[f"g{i}"]["tokens"]) for i in range(6)] == [1 + 3 * i for i in range(6)]
    assert eng.pipeline is not None and eng.pipeline.num_launched_ahead >= 10
    assert (
        not eng.scheduler.running and eng.kv.pool.num_free_blocks == eng.kv.pool.num_usable_blocks
    )


def test_seeded_sampling_with_logprobs_matches_sync(model: Path) -> None:
    reqs = [
        (
            f"s{i}",
            p,
            SamplingParams(
                max_tokens=12,
                temperature=0.9,
                top_p=0.95,
                seed=100 + i,
                logprobs=2,
                ignore_eos=True,
            ),
        )
        for i, p in enumerate(_prompts(4, 2))
    ]
    sync, ahead, eng = _both(model, reqs)
    assert ahead == sync
    assert all(len(v["logprobs"]) == 12 for v in ahead.values())
    assert eng.pipeline is not None and eng.pipeline.num_launched_ahead >= 8


def test_stop_strings_and_eos_end_mid_pipeline(model: Path) -> None:
    """Stop conditions the host only sees after the next step was launched."""
    sync_probe = _drive(
        _engine(model, False),
        [("probe", _prompts(1, 3)[0], SamplingParams(max_tokens=20, temperature=0.0))],
    )
    text = sync_probe["probe"]["text"]
    assert len(text) >= 4, text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    reqs = [
        ("eos", _prompts(1, 3)[0], SamplingParams(max_tokens=20, temperature=0.0)),
        (
            "stop",
            _prompts(1, 3)[0],
            SamplingParams(max_tokens=20, temperature=0.0, stop=[stop]),
        ),
        ("long", _prompts(1, 4)[0], SamplingParams(max_tokens=25, temperature=0.0)),
    ]
    sync, ahead, eng = _both(model, reqs)
    assert ahead == sync
    assert ahead["stop"]["finish"] == "stop" and stop not in ahead["stop"]["text"]
    assert len(ahead["stop"]["tokens"]) < 20
    assert eng.pipeline is not None and eng.pipeline.num_launched_ahead > 0


def test_abort_and_arrivals_while_in_flight(model: Path) -> None:
    """An abort mid-pipeline ends only that request; an arrival forces a synchronous step
    (admission) and the pipeline picks up again after it."""
    prompts = _prompts(4, 5)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    reqs = [(f"a{i}", p, params) for i, p in enumerate(prompts)]
    kw: dict[str, Any] = {"arrivals": {0: [0, 1], 6: [2], 9: [3]}, "aborts": {4: ["a1"]}}
    sync, ahead, eng = _both(model, reqs, **kw)
    assert ahead["a1"]["finish"] == "abort" and sync["a1"]["finish"] == "abort"
    for rid in ("a0", "a2", "a3"):
        assert ahead[rid] == sync[rid]
        assert len(ahead[rid]["tokens"]) == 16
    assert eng.pipeline is not None and eng.pipeline.num_launched_ahead >= 10
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_usable_blocks


def test_preemption_under_a_small_pool(model: Path) -> None:
    """When the ahead step cannot get a block the engine falls back to a synchronous step,
    which preempts; outputs stay those of synchronous steps."""
    reqs = [
        (f"p{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        for i, p in enumerate(_prompts(5, 6))
    ]
    cfg = {"num_kv_blocks": 24, "block_size": 4}
    sync = _drive(_engine(model, False, **cfg), reqs)
    eng = _engine(model, True, **cfg)
    preempted: set[str] = set()
    for rid, prompt, params in reqs:
        eng.add_request(rid, prompt, params)
    ahead: dict[str, list[int]] = {rid: [] for rid, _, _ in reqs}
    for _ in range(2000):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            ahead[out.request_id] += out.new_token_ids
        preempted |= {r.request_id for r in eng.scheduler.requests.values() if r.num_preemptions}
    assert preempted, "a 24-block pool with these requests must preempt"
    assert ahead == {rid: v["tokens"] for rid, v in sync.items()}
    assert all(len(v) == 40 for v in ahead.values())
    assert eng.pipeline is not None and eng.pipeline.num_launched_ahead > 0


def test_penalties_are_not_deferred(model: Path) -> None:
    """Penalties need the newest token on the host: those steps stay synchronous."""
    reqs = [
        ("pen", _prompts(1, 7)[0], SamplingParams(max_tokens=10, repetition_penalty=1.3)),
    ]
    sync, ahead, eng = _both(model, reqs)
    assert ahead == sync
    assert eng.pipeline is not None and eng.pipeline.num_launched_ahead == 0


def test_default_is_on_for_cuda_only(model: Path) -> None:
    assert EngineConfig(model=str(model)).async_scheduling_on is False
    assert EngineConfig(model=str(model), async_scheduling=True).async_scheduling_on is True
    on_gpu = EngineConfig(model=str(model), device="cuda")
    assert on_gpu.async_scheduling_on is True
    spec = EngineConfig(model=str(model), device="cuda", speculative="ngram:k=3")
    assert spec.async_scheduling_on is False
