"""Sampling with speculation draws from the target model's distribution.

On a tiny Llama with a 16-token vocabulary the exact distribution of a few output tokens
can be computed with transformers by enumerating every continuation, and thousands of
seeded samples are cheap. A draft model with a *different* distribution proposes tokens
sampled from its own q; the rejection rule must correct them to the target's p.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from tests.model_fixtures import make_tiny_llama

VOCAB = 16
PROMPT = [1, 5, 7, 9, 5, 7]
TEMPERATURE = 0.8
N_SAMPLES = 3000
# max_tokens 4 with k=2: token 1 comes from the prefill step, tokens 2 and 3 are the two
# drafts verified in the next step, token 4 is the bonus / corrected token.
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def v16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, draft): two random vocab-16 Llamas; initializer_range 0.2 makes their
    next-token distributions peaked enough to differ clearly (entropy ~2.2 of 2.77 nats)."""
    root = tmp_path_factory.mktemp("v16")
    target = make_tiny_llama(root / "target", seed=3, vocab_size=VOCAB, initializer_range=0.2)
    draft = make_tiny_llama(root / "draft", seed=4, vocab_size=VOCAB, initializer_range=0.2)
    return target, draft


def _exact_joint(model_dir: Path) -> torch.Tensor:
    """P(token 2, token 3) after PROMPT at TEMPERATURE, summed over token 1: [16, 16]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()

    def next_probs(seqs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return (model(seqs).logits[:, -1] / TEMPERATURE).softmax(-1)

    base = torch.tensor([PROMPT])
    p1 = next_probs(base)[0]  # [16]
    s1 = torch.cat([base.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], 1)
    p2 = next_probs(s1)  # [t1, t2]
    s2 = torch.cat([s1.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(VOCAB)[:, None]], 1)
    p3 = next_probs(s2).view(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)


def _sample(model_dir: Path, speculative: str | None) -> list[list[int]]:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), num_kv_blocks=1024, max_num_seqs=256, speculative=speculative
        )
    )
    for i in range(N_SAMPLES):
        params = SamplingParams(
            max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=i, ignore_eos=True
        )
        engine.add_request(f"s{i}", PROMPT, params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    if speculative is not None:
        stats = engine.stats().spec
        assert stats is not None and stats.num_draft_tokens >= N_SAMPLES  # every request drafted
    return [got[f"s{i}"] for i in range(N_SAMPLES)]


def _chi_square(samples: list[list[int]], probs: torch.Tensor) -> tuple[float, float]:
    """Pearson statistic of the (token 2, token 3) counts against ``probs``, cells with
    expected count < 5 pooled; returns (statistic, critical value at p = 0.001)."""
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for s in samples:
        counts[s[1], s[2]] += 1
    expected = probs.flatten() * len(samples)
    observed = counts.flatten()
    big = expected >= 5
    exp_cells = torch.cat([expected[big], expected[~big].sum()[None]])
    obs_cells = torch.cat([observed[big], observed[~big].sum()[None]])
    stat = float(((obs_cells - exp_cells) ** 2 / exp_cells).sum())
    df = len(exp_cells) - 1
    # Wilson-Hilferty approximation of the chi-square quantile; z = 3.09 for p = 0.001.
    z = 3.0902
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def test_draft_model_sampling_matches_target_distribution(v16: tuple[Path, Path]) -> None:
    """Tolerance: a chi-square test at significance 0.001. Seeds are fixed, so the result
    is deterministic (no flakiness); a correct sampler passes it with probability 0.999
    over seed choices, and the same test against the draft's distribution (what naive
    acceptance of drafts would produce) fails by a wide margin, so it has power."""
    target, draft = v16
    p = _exact_joint(target)
    q = _exact_joint(draft)
    assert float((p - q).abs().sum()) > 0.3, (
        "target and draft must differ for this test to mean anything"
    )

    plain = _sample(target, None)
    stat, crit = _chi_square(plain, p)
    assert stat < crit, f"the plain sampler itself does not match: {stat:.1f} >= {crit:.1f}"

    spec = _sample(target, f"draft:model={draft},k=2")
    stat, crit = _chi_square(spec, p)
    assert stat < crit, f"speculative sampling distorts the distribution: {stat:.1f} >= {crit:.1f}"
    against_draft, _ = _chi_square(spec, q)
    assert against_draft > 5 * crit, "test has no power: samples also fit the draft's distribution"


def test_ngram_seeded_sampling_identical(v16: tuple[Path, Path]) -> None:
    """Point-mass drafts are checked with the sampler's own seeded draw: with a seed the
    tokens are the same with and without speculation, penalties and logprobs included."""
    target, _ = v16
    prompts = [PROMPT * 3, [3, 4, 3, 4, 3, 4, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [7]]

    def run(speculative: str | None) -> tuple[list[list[int]], LLMEngine]:
        engine = LLMEngine(
            EngineConfig(model=str(target), num_kv_blocks=256, speculative=speculative)
        )
        for i in range(24):
            params = SamplingParams(
                max_tokens=24,
                temperature=[0.3, 0.8, 1.0][i % 3],
                top_p=0.9 if i % 4 == 0 else 1.0,
                seed=100 + i,
                ignore_eos=True,
                frequency_penalty=0.5 if i % 5 == 0 else 0.0,
                logprobs=1 if i % 6 == 0 else None,
            )
            engine.add_request(f"r{i}", prompts[i % len(prompts)], params)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        return [got[f"r{i}"] for i in range(24)], engine

    expected, _ = run(None)
    got, engine = run("ngram:k=4,n=3")
    assert got == expected
    stats = engine.stats().spec
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
