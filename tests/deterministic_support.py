"""Shared by the deterministic-mode tests (CPU: tests/integration/test_deterministic.py,
GPU: tests/gpu/test_deterministic_gpu.py): run one target request alone or among others
and keep its tokens and the raw logits of each of its steps."""

from __future__ import annotations

import random
from typing import Any

import torch

from engine.core.sampling_params import SamplingParams

TARGET_OUT = 12


def run_target(engine: Any, others: list[tuple[list[int], int]], target: list[int],
         tag: str) -> tuple[list[int], list[torch.Tensor]]:  # fmt: skip
    """The target's greedy tokens and the raw logits of each of its steps, run among
    ``others`` (prompt, max_tokens), the target in the middle of the arrivals."""
    seen: list[torch.Tensor] = []

    def capture(_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(logits.detach().clone())
        return logits

    params = SamplingParams(max_tokens=TARGET_OUT, temperature=0.0, ignore_eos=True)
    half = len(others) // 2
    for i, (prompt, n) in enumerate(others[:half]):
        engine.add_request(f"{tag}-a{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    engine.add_request(f"{tag}-target", target, params)
    engine.scheduler.requests[f"{tag}-target"].logits_processors.append(capture)
    for i, (prompt, n) in enumerate(others[half:]):
        engine.add_request(f"{tag}-b{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    tokens: list[int] = []
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.request_id == f"{tag}-target":
                tokens += out.new_token_ids
    assert not engine.has_unfinished(), "the engine did not finish"
    return tokens, seen


def workload(batch: int, target_len: int) -> tuple[list[int], list[tuple[list[int], int]]]:
    """A target prompt of ``target_len`` random ids and ``batch - 1`` others (prompt, max_tokens)."""
    rng = random.Random(11)
    target = [rng.randrange(100, 40000) for _ in range(target_len)]
    others = [
        ([rng.randrange(100, 40000) for _ in range(rng.randint(3, 60))], rng.randint(1, 20))
        for _ in range(batch - 1)
    ]
    return target, others
