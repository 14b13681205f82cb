"""Speculative decoding must not change what the engine generates.

Greedy (and, for point-mass drafts, seeded sampled) outputs are token-identical with and
without speculation — under continuous batching, chunked prefill with a small budget,
prefix caching and forced preemption — and the prefix cache only ever holds blocks of
accepted tokens, with correct KV. The sampled-distribution test is in
``test_spec_distribution.py``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from common.block_hash import compute_block_hashes
from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from tests.model_fixtures import make_tiny_llama

MAX_NEW = 20


@pytest.fixture(scope="module")
def other_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A different random tiny Llama (same tokenizer): a draft that is often wrong."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_draft"), seed=5)


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Half repetitive (so the n-gram proposer finds matches), half random."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            unit = [rng.randrange(3, 500) for _ in range(rng.randrange(2, 9))]
            out.append((unit * 12)[: rng.randrange(12, 60)])
        else:
            out.append([rng.randrange(3, 49152) for _ in range(rng.randrange(1, 50))])
    return out


def _run(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[int]]:
    """Staggered arrivals; checks the KV bookkeeping invariants after every step."""
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        for _ in range(min(3, len(pending))):
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params[i])
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        _check_invariants(engine)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks, "blocks leaked"
    return [got[f"r{i}"] for i in range(len(prompts))]


def _check_invariants(engine: LLMEngine) -> None:
    bs = engine.config.block_size
    k = engine.spec.spec.k if engine.spec is not None else 0
    for request in engine.scheduler.running:
        held = engine.kv.num_blocks_of(request.request_id)
        assert request.num_computed_tokens < request.num_tokens
        assert held >= -(-request.num_computed_tokens // bs)
        # At most the drafts' worth of blocks beyond what the accepted tokens need.
        assert held <= -(-(request.num_tokens + k) // bs)


def _greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)] * n


@pytest.mark.parametrize(
    "label, overrides",
    [
        ("default", {}),
        ("chunked_small_budget", {"max_num_batched_tokens": 24}),
        ("no_prefix_cache", {"enable_prefix_caching": False}),
        ("tiny_pool_preemption", {"num_kv_blocks": 16, "max_num_batched_tokens": 64}),
        ("block_size_4", {"block_size": 4}),
    ],
)
def test_ngram_greedy_identical(tiny_model_dir: Path, label: str, overrides: dict) -> None:
    prompts = _prompts(12, seed=3)
    base_cfg = {"model": str(tiny_model_dir), "num_kv_blocks": 256} | overrides
    expected = _run(LLMEngine(EngineConfig(**base_cfg)), prompts, _greedy(len(prompts)))
    engine = LLMEngine(EngineConfig(**base_cfg, speculative="ngram:k=4,n=3"))
    got = _run(engine, prompts, _greedy(len(prompts)))
    assert got == expected, label
    stats = engine.stats().spec
    assert stats is not None and stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
    if label != "tiny_pool_preemption":  # decode steps there may drop drafts to fit the pool
        assert engine.num_steps < len(prompts) * MAX_NEW


@pytest.mark.parametrize("draft", ["self", "other"])
def test_draft_model_greedy_identical(
    tiny_model_dir: Path, other_tiny_dir: Path, draft: str
) -> None:
    """A draft identical to the target accepts everything (multi-token steps, bonus tokens);
    a different one is mostly rejected (rollback of its own KV each round)."""
    draft_dir = tiny_model_dir if draft == "self" else other_tiny_dir
    prompts = _prompts(8, seed=4)
    cfg = {"model": str(tiny_model_dir), "num_kv_blocks": 256, "max_num_batched_tokens": 40}
    expected = _run(LLMEngine(EngineConfig(**cfg)), prompts, _greedy(len(prompts)))
    engine = LLMEngine(EngineConfig(**cfg, speculative=f"draft:model={draft_dir},k=3"))
    assert _run(engine, prompts, _greedy(len(prompts))) == expected
    stats = engine.stats().spec
    assert stats is not None and stats.num_draft_tokens > 0
    if draft == "self":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.spec is not None and engine.spec.draft is not None
    draft_pool = engine.spec.draft.kv.pool
    assert draft_pool.num_free_blocks == draft_pool.num_usable_blocks, "draft KV leaked"


def test_prefix_cache_holds_only_accepted_tokens(tiny_model_dir: Path) -> None:
    """Every block in the prefix cache hashes to a block of some request's accepted tokens,
    and reusing those blocks later gives the same greedy output as computing afresh."""
    prompts = [p for p in _prompts(8, seed=9) if len(p) > 8]
    cfg = {"model": str(tiny_model_dir), "num_kv_blocks": 256, "block_size": 4}
    engine = LLMEngine(EngineConfig(**cfg, speculative="ngram:k=4,n=2"))
    outputs = _run(engine, prompts, _greedy(len(prompts)))
    assert engine.stats().spec is not None and engine.stats().spec.num_draft_tokens > 0
    accepted_hashes = set()
    for prompt, out in zip(prompts, outputs, strict=True):
        # The last token has no KV (never fed back), so its block was never registered.
        accepted_hashes.update(compute_block_hashes(prompt + out, 4))
    cached = set(engine.kv.pool.cached)
    assert cached, "output blocks should have been registered"
    assert cached <= accepted_hashes, "a cached block holds unverified draft tokens"

    follow_ups = [p + o for p, o in zip(prompts, outputs, strict=True)]
    hits_before = engine.kv.pool.prefix_hits
    got = _run(engine, follow_ups, _greedy(len(follow_ups)))
    assert engine.kv.pool.prefix_hits > hits_before
    fresh = LLMEngine(EngineConfig(**cfg, enable_prefix_caching=False))
    assert got == _run(fresh, follow_ups, _greedy(len(follow_ups)))


def test_max_tokens_and_eos_respected(tiny_model_dir: Path) -> None:
    """Drafts never push a request past max_tokens; a stop token inside the accepted drafts
    ends the request there (same as without speculation)."""
    prompts = _prompts(6, seed=12)
    cfg = {"model": str(tiny_model_dir), "num_kv_blocks": 256}
    base = _run(LLMEngine(EngineConfig(**cfg)), prompts, _greedy(len(prompts)))
    # Make a token the greedy run produces mid-sequence a stop token.
    stop_id = base[0][MAX_NEW // 2]
    params = [
        SamplingParams(max_tokens=7 + i, temperature=0.0, stop_token_ids=[stop_id])
        for i in range(6)
    ]
    expected = _run(LLMEngine(EngineConfig(**cfg)), prompts, params)
    engine = LLMEngine(EngineConfig(**cfg, speculative="ngram:k=4,n=2"))
    got = _run(engine, prompts, params)
    assert got == expected
    assert all(len(g) <= 7 + i for i, g in enumerate(got))


@pytest.mark.slow
def test_smollm2_greedy_identical(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = [
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
        'The report says "growth was strong". Quote the report: The report says "',
        "The capital of France is",
    ]
    prompts = [tok.encode(t) for t in texts]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    cfg = {"model": str(smollm2_dir), "num_kv_blocks": 64, "max_num_batched_tokens": 32}
    expected = _run(LLMEngine(EngineConfig(**cfg)), prompts, params)
    engine = LLMEngine(EngineConfig(**cfg, speculative="ngram:k=4"))
    assert _run(engine, prompts, params) == expected
    stats = engine.stats().spec
    assert stats is not None and stats.num_accepted_tokens > 0, stats
