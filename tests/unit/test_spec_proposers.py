"""The n-gram (prompt lookup) proposer and the rejection rule, on explicit inputs."""

from __future__ import annotations

import torch

from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.verify import rejection_step


def test_ngram_finds_the_continuation() -> None:
    prop = NgramProposer(n=3, min_n=1)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert prop.propose(tokens, 3) == [8, 9, 1]
    assert prop.propose(tokens, 1) == [8]
    assert prop.propose(tokens, 0) == []


def test_ngram_falls_back_to_shorter_suffixes_and_gives_up() -> None:
    prop = NgramProposer(n=3, min_n=2)
    assert prop.propose([1, 2, 3, 9, 2, 3], 2) == [9, 2]  # "2 3" matched, "9 2 3" not
    assert prop.propose([1, 2, 3, 4, 5, 6], 2) == []  # nothing repeats
    assert NgramProposer(n=3, min_n=1).propose([4, 1, 2, 4], 2) == [1, 2]
    assert prop.propose([7], 4) == []


def test_ngram_prefers_recent_match_with_full_continuation() -> None:
    prop = NgramProposer(n=2, min_n=2)
    # "1 2" occurs at 0 (followed by 3 3) and at 4 (followed by 4 4 ...): the recent one wins.
    tokens = [1, 2, 3, 3, 1, 2, 4, 4, 4, 1, 2]
    assert prop.propose(tokens, 3) == [4, 4, 4]
    assert prop.propose(tokens, 5) == [4, 4, 4, 1, 2]
    # Only the earliest match has 6 tokens after it.
    assert prop.propose(tokens, 6) == [3, 3, 1, 2, 4, 4]


def _empirical(p: torch.Tensor, q: torch.Tensor, n: int) -> torch.Tensor:
    counts = torch.zeros_like(p)
    for i in range(n):
        gen = torch.Generator().manual_seed(10_000 + i)
        draft = int(torch.multinomial(q, 1, generator=gen))
        _, token = rejection_step(p, q, draft, seed=i, pos=3)
        counts[token] += 1
    return counts


def test_rejection_rule_reproduces_the_target_distribution() -> None:
    """Drafts from q, corrected by the rule, must be distributed as p (chi-square)."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3])
    n = 4000
    counts = _empirical(p, q, n)
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 4 degrees of freedom: P(chi2 > 18.47) = 0.001. Seeds are fixed, so this is
    # deterministic; a wrong rule (e.g. always accepting: q itself) gives chi2 > 1000.
    assert chi2 < 18.47, (chi2, counts)
    wrong = q * n
    assert float(((counts - wrong) ** 2 / wrong).sum()) > 100


def test_rejection_rule_point_mass_and_equal_distributions() -> None:
    p = torch.tensor([0.0, 1.0, 0.0])
    assert rejection_step(p, p.clone(), 1, seed=1, pos=0) == (True, 1)
    point = torch.tensor([1.0, 0.0, 0.0])
    accepted, token = rejection_step(p, point, 0, seed=1, pos=0)
    assert (accepted, token) == (False, 1)  # p(draft) = 0: always rejected, residual = p
