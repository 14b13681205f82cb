"""Greedy outputs of Phi-3, Gemma 2, Gemma 3, Mixtral, Qwen3-MoE, gpt-oss and a windowed Mistral
equal transformers' (float32, CPU, eager attention) over prompts longer than the 16-token
sliding window, under continuous batching with chunked prefill and prefix caching; the
windows are real (the same engine with the window removed from the config disagrees with
transformers), and Phi-3's decodes cross its longrope switch position."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.arch_fixtures import ARCHS, PHI3_ORIGINAL_MAX, load_reference, make_tiny_arch
from tests.integration.test_engine_parity import _run_staggered
from tests.model_fixtures import argmax_continuations

MAX_NEW = 10
WINDOWED = ("gemma2", "gemma3", "mistral_window", "gpt_oss")


def arch_prompts(seed: int) -> list[list[int]]:
    """Short and long prompts, two sharing a 40-token prefix (prefix-cache hits); the
    longest ends just before Phi-3's longrope switch, so its decodes cross it."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 49152) for _ in range(40)]
    lengths = (3, 20, 57, PHI3_ORIGINAL_MAX - 4)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]
    prompts += [prefix + [rng.randrange(3, 49152) for _ in range(n)] for n in (9, 30)]
    return prompts


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy tokens with its own KV cache (eager attention: the reference
    path for soft-capping and windows)."""
    return argmax_continuations(load_reference(model_dir), prompts, max_new)


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {a: make_tiny_arch(a, tmp_path_factory.mktemp(f"arch_{a}")) for a in ARCHS}


@pytest.fixture(scope="module")
def references(arch_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    prompts = arch_prompts(5)
    return {a: hf_greedy(d, prompts, MAX_NEW) for a, d in arch_dirs.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(arch_dirs, references, arch: str) -> None:
    """Small token budget (chunked prefill of the long prompts) and 8-token blocks, so
    windows start mid-block and chunks cross window edges."""
    engine = LLMEngine(
        EngineConfig(
            model=str(arch_dirs[arch]),
            num_kv_blocks=160,
            block_size=8,
            max_num_batched_tokens=48,
        )
    )
    got = _run_staggered(engine, arch_prompts(5), MAX_NEW)
    bad = [i for i, (g, e) in enumerate(zip(got, references[arch], strict=True)) if g != e]
    assert not bad, f"{arch}: prompts {bad} differ from transformers"
    assert engine.kv.pool.prefix_hits > 0


@pytest.mark.parametrize("arch", WINDOWED)
def test_window_is_real(arch_dirs, references, arch: str) -> None:
    """Without the window in the config the engine attends over everything and its tokens
    leave transformers' on the long prompts: the parity above depends on the window."""
    engine = LLMEngine(
        EngineConfig(
            model=str(arch_dirs[arch]),
            num_kv_blocks=160,
            block_size=8,
            hf_overrides={"sliding_window": None},
        )
    )
    got = _run_staggered(engine, arch_prompts(5), MAX_NEW)
    assert got != references[arch]
    assert got[0] == references[arch][0]  # the 3-token prompt never leaves the window


def test_window_blocks_are_released(arch_dirs) -> None:
    """Every Mistral layer is windowed: while a long request decodes, it holds only the
    blocks its window can reach (the rest return to the pool), its tokens still equal
    transformers', and a prompt sharing its prefix still hits the prefix cache."""
    rng = random.Random(9)
    prompt = [rng.randrange(3, 49152) for _ in range(100)]
    expected = hf_greedy(arch_dirs["mistral_window"], [prompt], 30)[0]
    engine = LLMEngine(
        EngineConfig(model=str(arch_dirs["mistral_window"]), num_kv_blocks=64, block_size=8)
    )
    from engine.core.sampling_params import SamplingParams

    engine.add_request("r", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    got: list[int] = []
    live: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            got.extend(out.new_token_ids)
        if engine.has_unfinished():
            live.append(engine.kv.num_live_blocks("r"))
    assert got == expected
    # Window 16 over 8-token blocks: at most 3 blocks straddle it, plus the one being filled.
    assert max(live[1:]) <= 4, live
    assert engine.kv.num_blocks_of("r") == 0
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks
