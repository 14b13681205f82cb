"""Deterministic mode on the CPU (docs/design.md §3 "Deterministic mode"): a prompt alone
and the same prompt inside a batch of 64 other requests (other lengths, other output
lengths, so the batch around it changes every few steps) give the same tokens and
bit-identical logits at every step. The default mode is the control: there the batch
changes the logits' low bits (the matmul library picks another kernel for 1 row than for
64), which is what the mode exists to remove.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.deterministic_support import TARGET_OUT, run_target, workload
from tests.model_fixtures import make_tiny_llama

TARGET_LEN, BATCH = 29, 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Wider than the default tiny model so a row's dot products are long enough for the
    # summation order to show in the low bits.
    return make_tiny_llama(tmp_path_factory.mktemp("det"), seed=3, hidden_size=256,
                           intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=2)  # fmt: skip


def _engine(model_dir: Path, deterministic: bool) -> LLMEngine:
    # Prefix caching off and a budget that holds every prompt: the prompt is prefilled in
    # one piece either way (docs/design.md §3: on the CPU the guarantee is per chunking).
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            load_format="auto",
            deterministic=deterministic,
            enable_prefix_caching=False,
            max_num_batched_tokens=8192,
            max_num_seqs=128,
            kv_cache_memory=64 << 20,
        )
    )


@pytest.fixture(scope="module")
def results(model_dir: Path) -> dict[tuple[bool, str], tuple[list[int], list[torch.Tensor]]]:
    target, others = workload(BATCH, TARGET_LEN)
    out = {}
    for deterministic in (True, False):
        engine = _engine(model_dir, deterministic)
        out[(deterministic, "alone")] = run_target(engine, [], target, "alone")
        out[(deterministic, "batch")] = run_target(engine, others, target, "batch")
    return out


def test_alone_and_in_a_batch_of_64_are_bit_identical(results: dict) -> None:
    alone_tokens, alone_logits = results[(True, "alone")]
    batch_tokens, batch_logits = results[(True, "batch")]
    assert len(alone_tokens) == TARGET_OUT
    assert batch_tokens == alone_tokens
    assert len(alone_logits) == len(batch_logits) == TARGET_OUT
    for step, (a, b) in enumerate(zip(alone_logits, batch_logits, strict=True)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max().item():.3e}"


def test_default_mode_depends_on_the_batch(results: dict) -> None:
    """The control: without the mode the same two runs differ in the logits' bits (else the
    test above would show nothing)."""
    _, alone_logits = results[(False, "alone")]
    _, batch_logits = results[(False, "batch")]
    assert any(not torch.equal(a, b) for a, b in zip(alone_logits, batch_logits, strict=True))


def test_deterministic_mode_refuses_what_it_does_not_cover(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(model=str(model_dir), deterministic=True, speculative="ngram:k=2")
    with pytest.raises(ValueError, match="LoRA"):
        EngineConfig(model=str(model_dir), deterministic=True, enable_lora=True)
