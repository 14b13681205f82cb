"""``min_tokens`` (vLLM's): before it, EOS and ``stop_token_ids`` cannot be sampled and stop
strings do not end the request; from it on, everything stops as usual. The sampler on
hand-made logits, and the offline engine on the tiny model (sampled and greedy paths)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.llm import LLM
from engine.sampling.sampler import Sampler


def test_stop_tokens_are_masked_until_min_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 0.0]])  # token 2 (EOS) would win
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    request = Request("r", [1], params, eos_token_ids=frozenset({2}), effective_seed=0)
    assert Sampler()(logits, [request])[0].token_id == 1  # EOS and the stop id ruled out
    request.append_output_token(1)
    assert Sampler()(logits, [request])[0].token_id == 1
    request.append_output_token(1)
    assert Sampler()(logits, [request])[0].token_id == 2  # min_tokens reached
    ignoring = Request(
        "i",
        [1],
        SamplingParams(temperature=0.0, min_tokens=1, ignore_eos=True),
        eos_token_ids=frozenset({2}),
    )
    assert Sampler()(logits, [ignoring])[0].token_id == 2  # EOS is no stop: not masked


@pytest.mark.parametrize("bad", [-1, 9, 1.5])
def test_min_tokens_is_checked(bad: object) -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=8, min_tokens=bad)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), kv_cache_memory=1 << 22)


PROMPT = "The quick brown fox"


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_stop_token_ids_wait_for_min_tokens(llm: LLM, temperature: float) -> None:
    plain = SamplingParams(max_tokens=12, temperature=temperature, seed=3, ignore_eos=True)
    first = llm.generate([PROMPT], plain)[0].token_ids[0]
    stop_now = SamplingParams(
        max_tokens=12, temperature=temperature, seed=3, ignore_eos=True, stop_token_ids=[first]
    )
    assert llm.generate([PROMPT], stop_now)[0].token_ids == [first]  # ends at once
    waited = SamplingParams(
        max_tokens=12,
        temperature=temperature,
        seed=3,
        ignore_eos=True,
        stop_token_ids=[first],
        min_tokens=4,
    )
    out = llm.generate([PROMPT], waited)[0]
    assert len(out.token_ids) >= 4 and first not in out.token_ids[:4], out.token_ids


def test_stop_strings_wait_for_min_tokens(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ref = llm.generate([PROMPT], greedy)[0]
    stop = llm.tokenizer.decode(ref.token_ids[:1]).strip()
    assert stop, "the first token's text must be visible for this test to mean anything"
    early = llm.generate(
        [PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=[stop])
    )[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == 1
    late = llm.generate(
        [PROMPT],
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=[stop], min_tokens=3),
    )[0]
    # Stop strings are not masked: the text is greedy's own, and it starts with the stop.
    assert late.token_ids == ref.token_ids[: len(late.token_ids)]
    assert len(late.token_ids) >= 3 and stop in late.text, (late.token_ids, late.text)
