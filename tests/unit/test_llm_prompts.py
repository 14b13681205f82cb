"""``LLM.generate`` takes the prompt forms vLLM users pass — text, token ids, and the
``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` dicts, alone or in a list — with the same
outputs for the same tokens; anything else is a ``ValueError`` before a request starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.core.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Any:
    from engine.llm import LLM

    return LLM(str(tiny_model_dir), max_model_len=64, kv_cache_memory=1 << 22)


def test_every_prompt_form_gives_the_same_tokens(llm: Any) -> None:
    text = "The capital of France is"
    ids = list(llm.tokenizer.encode(text, add_special_tokens=True))
    forms: list[Any] = [text, ids, {"prompt": text}, {"prompt_token_ids": ids}]
    outs = [llm.generate(form, GREEDY)[0].token_ids for form in forms]
    assert all(out == outs[0] for out in outs), outs
    mixed = llm.generate([{"prompt": text}, ids, {"prompt_token_ids": ids}], GREEDY)
    assert [o.token_ids for o in mixed] == [outs[0]] * 3


@pytest.mark.parametrize(
    "bad",
    [
        {"prompt": "a", "prompt_token_ids": [1]},
        {"text": "a"},
        {},
        {"prompt_token_ids": ["a", "b"]},
        [1.5, 2.0],
        [[1, 2], {"prompt": 3}],
        42,
    ],
)
def test_anything_else_is_a_value_error_before_any_request(llm: Any, bad: Any) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(bad, GREEDY)
    assert not llm.engine.has_unfinished()
