"""``best_of`` on /v1/completions: ``best_of`` candidates are sampled per prompt (each a
choice with its own seed) and the ``n`` with the highest cumulative logprob are returned,
best first, as vLLM does. Ranking needs every token's logprob, so the candidates are
generated with logprobs on (router/openai/protocol.py ``completion_params``); they are left out
of the answer unless the client asked for them. Not streamable (the best are known only
at the end): a 400. ``usage.completion_tokens`` counts every candidate's tokens: they
were all generated."""

from __future__ import annotations

from collections.abc import Sequence

from router.legs.trace import TokenLogprob


def cumulative_logprob(logprobs: Sequence[TokenLogprob]) -> float:
    return sum(item.logprob for item in logprobs)


def best_indices(logprobs: Sequence[Sequence[TokenLogprob]], group: int, keep: int) -> list[int]:
    """Indices of the kept choices: from each run of ``group`` consecutive choices (the
    candidates of one prompt), the ``keep`` best by cumulative logprob, best first (ties
    keep the lower index)."""
    kept: list[int] = []
    for start in range(0, len(logprobs), group):
        members = range(start, min(start + group, len(logprobs)))
        ranked = sorted(members, key=lambda i: (-cumulative_logprob(logprobs[i]), i))
        kept.extend(ranked[:keep])
    return kept
