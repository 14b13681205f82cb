"""The transformers reference of the tiny gpt-oss runs the SwiGLU its config names.

transformers 5.17 (the GPU machines' image) builds ``GptOssExperts`` with the limit 7.0 and
alpha 1.702 written into it and ignores config.json's ``swiglu_limit``; later releases read
it. The tiny gpt-oss sets the limit to 0.5 so that its clamp is crossed, and the engine
honours the config, so under 5.17 the bf16 GPU test compared the engine with another model
and saw a top-1 agreement of 0.25 (float32 on the CPU against 5.17 gives the same 0.25).
Here, on any transformers: a reference built as 5.17 builds it disagrees with the engine,
and ``load_reference`` (what every parity test loads) gives it the config's constants and
then agrees token for token."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.arch_fixtures import (
    GPT_OSS_LIMIT,
    load_reference,
    make_tiny_arch,
    match_swiglu_to_config,
)

LAYERS = 3  # the tiny gpt-oss: sliding, full, sliding


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_arch("gpt_oss", tmp_path_factory.mktemp("gpt_oss_ref"))


@pytest.fixture(scope="module")
def sequences(model_dir: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt, the engine's greedy tokens) in float32 on the CPU; one prompt is longer
    than the 16-token window."""
    from engine.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    rng = random.Random(4)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (7, 40)]
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=32, block_size=16))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.shutdown()
    return [(p, tokens[f"r{i}"]) for i, p in enumerate(prompts)]


def _agreement(ref: torch.nn.Module, sequences: list[tuple[list[int], list[int]]]) -> float:
    """The fraction of the engine's tokens that are also the reference's argmax, teacher-
    forced on the engine's tokens."""
    same = total = 0
    with torch.inference_mode():
        for prompt, ours in sequences:
            logits = ref(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1]
            same += sum(int(a == b) for a, b in zip(logits.argmax(-1).tolist(), ours, strict=True))
            total += len(ours)
    return same / total


def test_reference_runs_the_configs_swiglu(model_dir: Path, sequences) -> None:  # type: ignore[no-untyped-def]
    ref = load_reference(model_dir)
    experts = [m for m in ref.modules() if type(m).__name__ == "GptOssExperts"]
    assert len(experts) == LAYERS
    assert all(m.limit == GPT_OSS_LIMIT and m.alpha == 1.702 for m in experts)
    assert _agreement(ref, sequences) == 1.0


def test_hard_coded_swiglu_is_another_model(model_dir: Path, sequences) -> None:  # type: ignore[no-untyped-def]
    """The reference as transformers 5.17 builds it (limit 7.0 whatever the config says)
    leaves the engine's tokens: the parity depends on the constant, so a reference that
    ignored it cannot pass; ``match_swiglu_to_config`` puts the config's back."""
    ref = load_reference(model_dir)
    for m in ref.modules():
        if type(m).__name__ == "GptOssExperts":
            m.limit, m.alpha = 7.0, 1.702
    hard_coded = _agreement(ref, sequences)
    print(f"agreement with the limit fixed at 7.0: {hard_coded:.3f}")
    assert hard_coded < 0.6
    assert match_swiglu_to_config(ref) == LAYERS
    assert _agreement(ref, sequences) == 1.0
