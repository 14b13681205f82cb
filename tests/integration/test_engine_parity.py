"""Greedy outputs of our engine must be token-identical to Hugging Face transformers
(float32, CPU): under continuous batching with staggered arrivals, with prefix caching on
and off, with chunked prefill under a small token budget, under forced preemption, and
for every supported architecture."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from tests.model_fixtures import argmax_continuations

MAX_NEW = 12


def _prompts(n: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 49152) for _ in range(shared_prefix)]
    return [
        prefix + [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 70))] for _ in range(n)
    ]


def _hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy continuation (``argmax_continuations``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return argmax_continuations(model, prompts, max_new)


def _run_staggered(engine: LLMEngine, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Add prompts a few at a time between steps (continuous batching), collect tokens."""
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        for _ in range(min(3, len(pending))):
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    return [got[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = _prompts(24, seed=7) + _prompts(6, seed=8, shared_prefix=40)
    return prompts, _hf_greedy(tiny_model_dir, prompts, MAX_NEW)


@pytest.mark.parametrize(
    "label, overrides",
    [
        ("default", {}),
        ("no_prefix_cache", {"enable_prefix_caching": False}),
        ("chunked_small_budget", {"max_num_batched_tokens": 24}),
        ("tiny_pool_preemption", {"num_kv_blocks": 14, "max_num_batched_tokens": 64}),
        ("priority_policy", {"scheduling_policy": "priority", "block_size": 8}),
    ],
)
def test_greedy_matches_transformers(
    tiny_model_dir: Path, reference, label: str, overrides: dict
) -> None:
    prompts, expected = reference
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), **({"num_kv_blocks": 256} | overrides))
    )
    got = _run_staggered(engine, prompts, MAX_NEW)
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not mismatches, f"{label}: prompts {mismatches} differ from transformers"
    if label == "tiny_pool_preemption":
        # The pool is too small for the whole batch, so recompute preemption must have run.
        assert engine.scheduler.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks
    if label == "default":
        assert engine.kv.pool.prefix_hits > 0, "shared prefixes should hit the prefix cache"


def test_preemption_actually_happens(tiny_model_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=10, max_num_batched_tokens=64)
    )
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    requests = []
    for i, p in enumerate(_prompts(6, seed=3)):
        engine.add_request(f"p{i}", p[:30], params)
    while engine.has_unfinished():
        engine.step()
        requests.extend(r for r in engine.scheduler.requests.values() if r.num_preemptions)
    assert requests, "a 10-block pool with 6 long requests must preempt"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "llama3_rope_scaling"])
def test_architectures_match_transformers(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    prompts = _prompts(4, seed=11)
    prompts.append(
        [random.Random(1).randrange(3, 49152) for _ in range(300)]
    )  # past 256 for llama3 scaling
    expected = _hf_greedy(model_dir, prompts, 8)
    got = _run_staggered(
        LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=128)), prompts, 8
    )
    assert got == expected


def test_tied_embeddings_llama(tmp_path: Path) -> None:
    from tests.model_fixtures import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    prompts = _prompts(3, seed=5)
    assert _run_staggered(LLMEngine(EngineConfig(model=str(model_dir))), prompts, 8) == _hf_greedy(
        model_dir, prompts, 8
    )


@pytest.mark.slow
def test_smollm2_real_prompts_match_transformers(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "The three primary colors are",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    ]
    prompts = [tok.encode(t) for t in texts]
    expected = _hf_greedy(smollm2_dir, prompts, 64)
    llm = LLM(str(smollm2_dir))
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert outs[0].text.startswith(" Paris")
