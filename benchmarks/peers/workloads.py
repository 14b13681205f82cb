"""The workloads both engines run in the peer comparison (benchmarks/peers/README.md).

Everything here is plain Python with fixed seeds, so vLLM's process and ours build the very
same token ids and lengths. Prompts are random token ids drawn from ``[1000, vocab)`` (no
special tokens, no shared prefixes); outputs ignore EOS so every request produces exactly
the tokens asked for.

The mixed offline set approximates ShareGPT's shape (the prompt/output lengths that
vLLM's own throughput benchmark draws from that dataset): both lengths are log-normal,
prompt median 160 tokens (sigma 0.9: mean ~240, p99 ~1300), output median 140 tokens
(sigma 0.8: mean ~190, p99 ~900), clipped to [4, 2048] and [4, 1024]. Seed 0, 1,000
requests: 246,771 prompt and 194,136 output tokens (asserted by the unit test, so a change
to the generator shows).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_RANGE = 160, 0.9, (4, 2048)
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_RANGE = 140, 0.8, (4, 1024)


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo = min(1000, vocab // 2)
    return [[rng.randrange(lo, vocab) for _ in range(length)] for _ in range(n)]


def _lognormal_length(
    rng: random.Random, median: int, sigma: float, bounds: tuple[int, int]
) -> int:
    value = int(round(math.exp(rng.gauss(math.log(median), sigma))))
    return max(bounds[0], min(bounds[1], value))


def mixed_set(n: int, vocab: int, seed: int = 0) -> list[Request]:
    """``n`` requests of ShareGPT-like prompt and output lengths (module docstring)."""
    rng = random.Random(seed)
    lo = min(1000, vocab // 2)
    out = []
    for _ in range(n):
        p_len = _lognormal_length(rng, PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_RANGE)
        o_len = _lognormal_length(rng, OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_RANGE)
        out.append(Request([rng.randrange(lo, vocab) for _ in range(p_len)], o_len))
    return out
