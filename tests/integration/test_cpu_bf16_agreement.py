"""bfloat16 on the CPU against float32 on SmolLM2: the greedy agreement that decides whether
``dtype="auto"`` may pick bf16 (docs/design.md §3 "CPU dtype"; the number is in
docs/engine.md). Real model, real prompts, the engine's own C decode kernel in both."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.attention.cpu_kernels import (
    BF16_AUTO_MIN_AGREEMENT,
    BF16_GREEDY_AGREEMENT,
    leading_agreement,
)
from engine.core.sampling_params import SamplingParams
from engine.llm import LLM

logger = logging.getLogger(__name__)

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at a temperature of",
    "import numpy as np\n\ndef mean(xs):",
    "The largest planet in the solar system is",
    "<|im_start|>user\nName a fruit that is yellow.<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, the first humans",
    "A haiku about the sea:\n",
    "SELECT name FROM users WHERE",
]
NEW_TOKENS = 32


def _greedy(model_dir: Path, dtype: str) -> list[list[int]]:
    with LLM(str(model_dir), dtype=dtype) as llm:
        assert llm.engine.config.torch_dtype_name == dtype
        prompts = [llm.tokenizer.encode(t) for t in TEXTS]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts, params)]


def test_bf16_greedy_agreement_with_float32(smollm2_dir: Path) -> None:
    """Mean fraction of leading greedy tokens (of 32) that bf16 shares with float32, over
    12 prompts. Bounded below by what docs/engine.md states (``BF16_GREEDY_AGREEMENT``,
    measured by this test), so a change that makes bf16 worse fails here."""
    fp32 = _greedy(smollm2_dir, "float32")
    bf16 = _greedy(smollm2_dir, "bfloat16")
    rate = leading_agreement(fp32, bf16)
    identical = sum(a == b for a, b in zip(fp32, bf16, strict=True))
    logger.warning(
        "bf16 vs float32 greedy agreement: %.3f of leading tokens; %d/%d outputs identical",
        rate,
        identical,
        len(TEXTS),
    )
    assert all(len(o) == NEW_TOKENS for o in fp32 + bf16)
    # The first token of every prompt is the clearest signal: one disagreement there is
    # an arithmetic error, not drift.
    assert sum(a[0] == b[0] for a, b in zip(fp32, bf16, strict=True)) >= len(TEXTS) - 1
    assert rate >= BF16_GREEDY_AGREEMENT - 0.05, (rate, BF16_GREEDY_AGREEMENT)


def test_leading_agreement_counts_up_to_first_difference() -> None:
    assert leading_agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5
    assert leading_agreement([[1, 2], [5, 6]], [[1, 2], [7, 6]]) == 0.5
    assert BF16_AUTO_MIN_AGREEMENT > 0.5
