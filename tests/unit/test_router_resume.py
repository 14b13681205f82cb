"""After a failover the router derives a choice's text from token ids (``ResumedText``):
the client must get exactly the text it would have got, even when the lost instance was
holding characters back (a stop string that may be starting, half a UTF-8 character)."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.legs.resume_text import ResumedText
from router.tokenizer import PromptProcessor


@pytest.fixture(scope="module")
def proc(tiny_model_dir: Path) -> PromptProcessor:
    return PromptProcessor.from_model_dir(tiny_model_dir)


def replay(
    proc: PromptProcessor,
    ids: list[int],
    cut: int,
    emitted: str,
    stops: list[str],
    include_stop: bool = False,
) -> tuple[str, bool]:
    """Client text after resuming at token ``cut`` with ``emitted`` already shown."""
    resumed = ResumedText(proc, stops, True, emitted, list(ids[:cut]), include_stop)
    text, stopped = emitted, False
    for i in range(cut, len(ids)):
        delta, stopped = resumed.feed([ids[i]], finished=i == len(ids) - 1)
        text += delta
        if stopped:
            break
    return text, stopped


def test_held_back_text_is_not_lost(proc: PromptProcessor) -> None:
    full = "Hello world, this is a small test of resuming streams."
    ids = proc.encode(full)
    for cut in range(1, len(ids)):
        shown = proc.decode(ids[:cut])
        for held in range(0, min(3, len(shown)) + 1):  # the lost instance held back 0..3 chars
            text, stopped = replay(proc, ids, cut, shown[: len(shown) - held], [])
            assert text == full and not stopped


def test_stop_string_after_resume(proc: PromptProcessor) -> None:
    full = "one two three four five six"
    ids = proc.encode(full)
    cut = 3
    shown = proc.decode(ids[:cut])
    text, stopped = replay(proc, ids, cut, shown[:-2], ["four"])
    assert stopped and text == "one two three "
    # A stop string already underway in the held-back characters is honoured too.
    text, stopped = replay(
        proc, ids, cut, shown[:-2], [shown[-2:] + proc.decode(ids[cut : cut + 1])]
    )
    assert stopped and text == shown[:-2]
    # include_stop_str_in_output: the text ends with the stop string instead.
    text, stopped = replay(proc, ids, cut, shown[:-2], ["four"], True)
    assert stopped and text == "one two three four"


def test_split_utf8_character(proc: PromptProcessor) -> None:
    full = "smile 🙂 and 你好"
    ids = proc.encode(full)
    for cut in range(1, len(ids)):
        shown = proc.decode(ids[:cut])
        if shown.endswith("\ufffd"):
            shown = shown[:-1]  # what an incremental detokenizer holds back
        text, _ = replay(proc, ids, cut, shown, [])
        assert text == full, (cut, text)
    # The emoji really is split over several tokens with this tokenizer (else the test is moot).
    assert any(proc.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
