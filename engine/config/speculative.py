"""Parse the ``speculative`` setting: ``"ngram:k=4"`` or ``"draft:model=PATH,k=4"``.

Options (comma separated ``key=value`` after the method):
- both: ``k`` — tokens drafted per step (1..16, default 4).
- ngram: ``n`` — longest suffix n-gram to look up (1..16, default 4); ``min_n`` — shortest
  (1..n, default 1). The proposer tries ``n`` down to ``min_n``.
- draft: ``model`` (required) — a local model directory the engine can load, sharing the
  target's tokenizer; ``num_blocks`` — the draft's own KV pool size (default: as many
  blocks as the target's pool).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_METHODS = ("ngram", "draft")
_KEYS = {"ngram": ("k", "n", "min_n"), "draft": ("k", "model", "num_blocks")}
MAX_K = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft"
    k: int = 4
    n: int = 4
    min_n: int = 1
    model: str | None = None
    num_blocks: int | None = None


def _int(key: str, value: str, lo: int, hi: int) -> int:
    try:
        out = int(value)
    except ValueError:
        raise ValueError(f"speculative: {key} must be an integer, got {value!r}") from None
    if not lo <= out <= hi:
        raise ValueError(f"speculative: {key} must be in [{lo}, {hi}], got {out}")
    return out


def parse_speculative(text: str) -> SpeculativeConfig:
    """Parse and validate; ValueError naming the bad part and the accepted forms."""
    usage = "expected 'ngram:k=4[,n=4,min_n=1]' or 'draft:model=PATH,k=4[,num_blocks=N]'"
    method, _, rest = text.strip().partition(":")
    if method not in _METHODS:
        raise ValueError(f"speculative: unknown method {method!r}; {usage}")
    opts: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not value:
            raise ValueError(f"speculative: {part!r} is not key=value; {usage}")
        if key not in _KEYS[method]:
            raise ValueError(
                f"speculative: unknown option {key!r} for {method}; allowed: {_KEYS[method]}"
            )
        if key in opts:
            raise ValueError(f"speculative: option {key!r} given twice")
        opts[key] = value
    k = _int("k", opts["k"], 1, MAX_K) if "k" in opts else 4
    if method == "ngram":
        n = _int("n", opts["n"], 1, 16) if "n" in opts else 4
        min_n = _int("min_n", opts["min_n"], 1, n) if "min_n" in opts else 1
        return SpeculativeConfig("ngram", k=k, n=n, min_n=min_n)
    model = opts.get("model")
    if not model:
        raise ValueError(f"speculative: draft needs model=PATH; {usage}")
    if not os.path.isdir(model):
        raise ValueError(f"speculative: draft model {model!r} is not a directory")
    num_blocks = (
        _int("num_blocks", opts["num_blocks"], 2, 1 << 30) if "num_blocks" in opts else None
    )
    return SpeculativeConfig("draft", k=k, model=model, num_blocks=num_blocks)
