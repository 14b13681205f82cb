"""Prompt logprobs in the engine (engine/sampling/prompt_logprobs.py) on the tiny random Llama:
each equals the logprob the model gives that token when it is the next one to generate
(teacher forcing, one request per prefix), across chunked prefill, a prefix-cache hit and
a batch; requests without them are untouched."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from engine.core.sampling_params import SamplingParams
from engine.llm import LLM

PROMPT = "The quick brown fox jumps over the lazy dog because it was"


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    # An 8-token step budget: the prompt is prefilled in several chunks.
    return LLM(str(tiny_model_dir), max_num_batched_tokens=8, num_kv_blocks=64)


def teacher_forced(llm: LLM, ids: list[int]) -> list[float]:
    """logprob of ids[i] after ids[:i], for i >= 1, one generation per prefix."""
    out = []
    for i in range(1, len(ids)):
        bias_free = SamplingParams(max_tokens=1, temperature=0, logprobs=0, ignore_eos=True)
        # The chosen token's logprob is reported for whatever is sampled; force ids[i]
        # with a large bias: logprobs stay the raw model's (engine/sampler.py).
        bias_free.logit_bias = {ids[i]: 100.0}
        res = llm.generate([{"prompt_token_ids": ids[:i]}], bias_free)[0]
        assert res.token_ids[-1] == ids[i]
        assert res.logprobs is not None
        out.append(res.logprobs[0].logprob)
    return out


def test_prompt_logprobs_equal_teacher_forcing(llm: LLM) -> None:
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    first = llm.generate([PROMPT], params)[0]
    ids = first.prompt_token_ids
    assert len(ids) > 8  # several chunks
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(ids) - 1
    assert [lp.token_id for lp in first.prompt_logprobs] == ids[1:]
    expected = teacher_forced(llm, ids)
    got = [lp.logprob for lp in first.prompt_logprobs]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got, expected, strict=True))
    for lp in first.prompt_logprobs:
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[-1][1] >= -math.inf
        assert lp.top[0][1] >= lp.logprob - 1e-6
    # The same prompt again: its blocks are cached now, yet every position is reported
    # (such a request skips the prefix cache), and the answer is the same.
    again = llm.generate([PROMPT], params)[0]
    assert again.prompt_logprobs == first.prompt_logprobs and again.text == first.text


def test_batch_mixes_with_requests_without_them(llm: LLM) -> None:
    plain = SamplingParams(max_tokens=4, temperature=0)
    alone = llm.generate([PROMPT + " late"], plain)[0]
    with_lp = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)
    both = llm.generate([PROMPT + " late", "A short one"], [plain, with_lp])
    assert both[0].prompt_logprobs is None and both[0].text == alone.text
    assert both[1].prompt_logprobs is not None
    assert len(both[1].prompt_logprobs) == len(both[1].prompt_token_ids) - 1
    assert all(lp.top == [] for lp in both[1].prompt_logprobs)


def test_range_is_checked() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
