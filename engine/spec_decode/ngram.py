"""N-gram (prompt lookup) proposer: find the context's last n tokens earlier in the context
and propose the tokens that followed them there. No model, no state, CPU only."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """``propose(tokens, max_k)`` tries suffix lengths ``n`` down to ``min_n``; the first
    length with a match wins. Among matches it prefers the most recent one that still has
    ``max_k`` tokens after it (recent text is the likeliest to repeat), else the earliest
    (the longest continuation)."""

    def __init__(self, n: int, min_n: int) -> None:
        self.n = n
        self.min_n = min_n

    def propose(self, tokens: list[int], max_k: int) -> list[int]:
        if max_k <= 0 or len(tokens) < 2:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        length = len(arr)
        for n in range(min(self.n, length - 1), self.min_n - 1, -1):
            # Windows over arr[:-1] start at i <= length-1-n: each has a token after it, and
            # the suffix itself (i = length-n) is excluded.
            windows = sliding_window_view(arr[:-1], n)
            starts = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if starts.size == 0:
                continue
            full = starts[starts + n + max_k <= length]
            i = int(full[-1]) if full.size else int(starts[0])
            return [int(t) for t in arr[i + n : i + n + max_k]]
        return []
