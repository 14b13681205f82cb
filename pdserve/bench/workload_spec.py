"""What a `pdserve bench serve` workload is made of (docs/benchmarking.md): its spec, the
prompts it yields, the tokenizer view it needs and random text of a given token length.
The workload kinds (`pdserve/bench/workloads.py`, `workloads_chat.py`) build on these.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

KINDS = ("random", "sharegpt", "prefix", "chat", "jsonl")


class TextCodec(Protocol):
    """What workloads need from a tokenizer: encode, decode, and ids safe to sample."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def sample_pool(self) -> list[int]: ...


@dataclass(slots=True)
class Prompt:
    """One request's input: text, its token count, and the output length to ask for."""

    text: str
    prompt_len: int
    max_tokens: int
    group: int | None = None


@dataclass(slots=True, frozen=True)
class LengthRange:
    """An inclusive integer range; `low == high` is a fixed length."""

    low: int
    high: int

    @classmethod
    def parse(cls, spec: str | int, name: str = "length") -> LengthRange:
        """Parse `"128"`, `128` or `"64:256"` (also `"64-256"`); ValueError if malformed."""
        text = str(spec).strip().replace("-", ":")
        parts = text.split(":")
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"bad {name} {spec!r}: expected N or LOW:HIGH") from None
        if len(nums) not in (1, 2) or min(nums) < 1:
            raise ValueError(f"bad {name} {spec!r}: expected N or LOW:HIGH, all >= 1")
        low, high = nums[0], nums[-1]
        if low > high:
            raise ValueError(f"bad {name} {spec!r}: LOW > HIGH")
        return cls(low, high)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(slots=True)
class WorkloadSpec:
    """Everything that determines a workload; same spec + same tokenizer -> same prompts."""

    kind: str = "random"
    num_prompts: int = 100
    input_len: str = "256"
    output_len: str = "64"
    prefix_len: int = 256
    num_prefixes: int = 4
    num_turns: int = 4  # chat: turns per conversation
    path: str | None = None
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError on an unknown kind or inconsistent options."""
        if self.kind not in KINDS:
            raise ValueError(f"unknown workload {self.kind!r}; choose one of {KINDS}")
        if self.num_prompts < 1:
            raise ValueError(f"number of prompts must be >= 1, got {self.num_prompts}")
        LengthRange.parse(self.input_len, "input length")
        LengthRange.parse(self.output_len, "output length")
        if self.kind in ("prefix", "chat") and (self.prefix_len < 1 or self.num_prefixes < 1):
            raise ValueError(f"{self.kind} workload needs prefix_len >= 1 and num_prefixes >= 1")
        if self.kind == "chat" and self.num_turns < 1:
            raise ValueError(f"chat workload needs num_turns >= 1, got {self.num_turns}")
        if self.kind == "jsonl" and not self.path:
            raise ValueError("jsonl workload needs a path (--dataset-path)")


def random_text(codec: TextCodec, n: int, rng: random.Random) -> tuple[str, int]:
    """Text of about `n` tokens from random ids; returns (text, its actual token count)."""
    pool = codec.sample_pool()
    ids = [rng.choice(pool) for _ in range(n)]
    text = codec.decode(ids)
    # Decoding then encoding can merge or split tokens: nudge towards n a few times.
    for _ in range(8):
        got = codec.encode(text)
        if len(got) == n:
            return text, n
        ids = got[:n] if len(got) > n else got + [rng.choice(pool) for _ in range(n - len(got))]
        text = codec.decode(ids)
    return text, len(codec.encode(text))
