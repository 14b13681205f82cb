"""Incremental detokenization with the real SmolLM2 tokenizer: stop strings split across
tokens, held-back partial UTF-8, and stop strings ending a request inside the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.core.detokenizer import IncrementalDetokenizer

# Registers the smollm2_dir / tiny_model_dir fixtures for this module.


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def _stream(
    tok: Any, ids: list[int], stop: list[str]
) -> tuple[list[str], IncrementalDetokenizer, int]:
    """Feed ids one by one; returns the deltas, the detokenizer and how many ids it took."""
    det = IncrementalDetokenizer.start(tok, stop, True, [])
    deltas = []
    for n, i in enumerate(ids, 1):
        deltas.append(det.add([i], finished=n == len(ids)))
        if det.stopped:
            return deltas, det, n
    return deltas, det, len(ids)


def test_plain_stream_reassembles_text(tokenizer: Any) -> None:
    text = "Hello world, this is a test."
    deltas, det, _ = _stream(tokenizer, tokenizer.encode(text, add_special_tokens=False), [])
    assert "".join(deltas) == text
    assert deltas[:2] == ["Hello", " world"]  # no stop strings: nothing held back
    assert not det.stopped


def test_stop_string_split_across_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)
    # "lo wor" spans the tokens "Hello" and " world".
    deltas, det, used = _stream(tokenizer, ids, ["lo wor"])
    assert det.stopped
    assert used == 2  # stopped on the token that completed the stop string
    assert "".join(deltas) == "Hel"
    assert all("lo" not in d for d in deltas)


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)
    det = IncrementalDetokenizer.start(tokenizer, ["world peace"], True, [])
    first = det.add(ids[:1], finished=False)
    # Up to len(stop) - 1 trailing characters stay back until they cannot start the stop.
    assert "Hello".startswith(first) and len(first) <= len("Hello")
    rest = [det.add([i], finished=k == len(ids) - 2) for k, i in enumerate(ids[1:])]
    assert first + "".join(rest) == "Hello world, this is a test."
    assert not det.stopped


def test_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)
    deltas, det, _ = _stream(tokenizer, ids, ["test", "is a", ", th"])
    assert det.stopped and "".join(deltas) == "Hello world"


@pytest.mark.parametrize(("stops", "want"), [(["lo wor"], "Hello wor"), (["is a", ", th"], "Hello world, th")])  # fmt: skip
def test_include_stop_ends_the_text_with_it(tokenizer: Any, stops: list[str], want: str) -> None:
    """vLLM's include_stop_str_in_output: the earliest stop string stays, split across
    tokens or not; nothing after it is returned."""
    ids = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)
    det = IncrementalDetokenizer.start(tokenizer, stops, True, [], include_stop=True)
    deltas = []
    for n, i in enumerate(ids, 1):
        deltas.append(det.add([i], finished=n == len(ids)))
        if det.stopped:
            break
    assert det.stopped
    assert "".join(deltas) == want


@pytest.mark.parametrize("text", ["🙂 ok", "x 🦙 y", "日本語のテキスト"])
def test_incomplete_utf8_is_held_back(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, _, _ = _stream(tokenizer, ids, [])
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == text
    assert "" in deltas  # some token ended mid-character and produced nothing yet


def test_initial_ids_give_context_only(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world, this", add_special_tokens=False)
    det = IncrementalDetokenizer.start(tokenizer, [], True, ids[:2])
    assert det.add(ids[2:], finished=True) == ", this"


def test_engine_stops_on_a_string_it_generated(tiny_model_dir: Path) -> None:
    """Generate freely, pick a stop string straddling two generated tokens, run again:
    the request ends with reason "stop" and returns exactly the text before the string."""
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), kv_cache_memory=1 << 24)
    prompt = "The quick brown fox"
    free = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[
        0
    ]
    tok = llm.tokenizer
    pieces = [tok.decode(free.token_ids[:n]) for n in range(len(free.token_ids) + 1)]
    # The stop string: last 2 chars of the text after token 5 plus the first 2 after it.
    cut = len(pieces[5])
    assert len(pieces[5]) >= 2 and len(pieces[6]) >= cut + 2, pieces[:8]
    stop = free.text[cut - 2 : cut + 2]
    first_at = free.text.find(stop)
    stopped = llm.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:first_at]
    assert stop not in stopped.text
    assert len(stopped.token_ids) < len(free.token_ids)
