"""The windowed detokenizer against a full-decode reference, with the real SmolLM2 tokenizer.

The reference is the straightforward algorithm (decode every output id on every token and
emit what is new, same hold-back and stop rules). The windowed detokenizer must return the
same deltas call by call — so the same streamed text, equal to the full decode — on random
ids over the whole vocabulary (partial UTF-8 bytes and special tokens included), on real
multilingual / emoji text, with and without stop strings, skip_special_tokens on and off,
and when started from already generated ids. It must also decode O(1) tokens per call.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from engine.core.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, this is a test.",
    "Emoji: 🙂🦙👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 mixed with text.",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Ünïcödé àccents — “quotes” … and ½ ∑ ∞ ≠ symbols.",
    "def f(x):\n    return x ** 2  # code\n\n\ttabs\r\n",
    "<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n你好!<|im_end|>",
    "   leading spaces, trailing   ",
]


@dataclass
class Reference:
    """The full-decode algorithm: O(length) per token, obviously right."""

    tokenizer: Any
    stop: list[str]
    skip: bool
    ids: list[int] = field(default_factory=list)
    emitted: int = 0
    stopped: bool = False

    def text(self) -> str:
        return str(self.tokenizer.decode(self.ids, skip_special_tokens=self.skip))

    def add(self, new: list[int], finished: bool) -> str:
        self.ids += new
        text = self.text()
        longest = max((len(s) for s in self.stop), default=0)
        if self.stop:
            hits = [
                i for s in self.stop if (i := text.find(s, max(0, self.emitted - longest + 1))) >= 0
            ]
            if hits:
                self.stopped = True
                end = max(min(hits), self.emitted)
                delta, self.emitted = text[self.emitted : end], end
                return delta
        end = len(text)
        if not finished:
            if text.endswith("\ufffd"):
                end -= 1
            if self.stop:
                end = min(end, len(text) - longest + 1)
        if end <= self.emitted:
            return ""
        delta, self.emitted = text[self.emitted : end], end
        return delta


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def _compare(tok: Any, ids: list[int], stop: list[str], skip: bool, initial: int = 0) -> str:
    """Feed ``ids[initial:]`` one by one to both; assert identical deltas; return the text."""
    det = IncrementalDetokenizer.start(tok, stop, skip, ids[:initial])
    ref = Reference(tok, stop, skip, list(ids[:initial]))
    ref.emitted = len(ref.text())
    got, want = [], []
    rest = ids[initial:]
    for n, t in enumerate(rest, 1):
        got.append(det.add([t], finished=n == len(rest)))
        want.append(ref.add([t], finished=n == len(rest)))
        assert det.stopped == ref.stopped, (ids, n)
        if ref.stopped:
            break
    assert got == want, (ids, stop, skip, initial)
    return "".join(got)


def _random_ids(rng: random.Random, vocab: int, specials: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.1:
            out.append(rng.choice(specials))
        elif r < 0.4:
            out.append(rng.randrange(0, 512))  # the byte tokens: lots of partial UTF-8
        else:
            out.append(rng.randrange(0, vocab))
    return out


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_full_decode(tokenizer: Any, skip: bool) -> None:
    rng = random.Random(1234 + skip)
    specials = list(tokenizer.all_special_ids)
    for _ in range(150):
        ids = _random_ids(rng, len(tokenizer), specials, rng.randrange(1, 48))
        text = _compare(tokenizer, ids, [], skip)
        assert text == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_real_text_matches_full_decode(tokenizer: Any, text: str, skip: bool) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    streamed = _compare(tokenizer, ids, [], skip)
    assert streamed == tokenizer.decode(ids, skip_special_tokens=skip)
    if skip is False:
        assert streamed == text  # byte-level BPE round-trips exactly


@pytest.mark.parametrize("skip", [True, False])
def test_stop_strings_match_reference(tokenizer: Any, skip: bool) -> None:
    rng = random.Random(7)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids, skip_special_tokens=skip)
        for _ in range(12):
            a = rng.randrange(0, max(1, len(full) - 1))
            stop = [full[a : a + rng.randrange(1, 6)], "never-there"]
            streamed = _compare(tokenizer, ids, stop, skip)
            assert stop[0] not in streamed
            assert streamed == full[: full.find(stop[0])]


def test_stop_strings_on_random_ids(tokenizer: Any) -> None:
    rng = random.Random(99)
    specials = list(tokenizer.all_special_ids)
    for _ in range(60):
        ids = _random_ids(rng, len(tokenizer), specials, rng.randrange(2, 40))
        full = tokenizer.decode(ids, skip_special_tokens=True)
        if len(full) < 3:
            continue
        a = rng.randrange(0, len(full) - 2)
        _compare(tokenizer, ids, [full[a : a + 3], "\ufffd\ufffd"], True)


@pytest.mark.parametrize("skip", [True, False])
def test_initial_ids_match_reference(tokenizer: Any, skip: bool) -> None:
    rng = random.Random(5)
    specials = list(tokenizer.all_special_ids)
    cases = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    cases += [_random_ids(rng, len(tokenizer), specials, 30) for _ in range(40)]
    for ids in cases:
        for initial in {1, 2, len(ids) // 2, len(ids) - 1}:
            if 0 < initial < len(ids):
                _compare(tokenizer, ids, [], skip, initial)
                _compare(tokenizer, ids, ["e", "🙂"], skip, initial)


class _CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call was given."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.lengths: list[int] = []

    def decode(self, ids: list[int], **kw: Any) -> str:
        self.lengths.append(len(ids))
        return str(self.tok.decode(ids, **kw))


def test_each_call_decodes_a_short_window(tokenizer: Any) -> None:
    text = " ".join(TEXTS) * 8
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 500
    counting = _CountingTokenizer(tokenizer)
    det = IncrementalDetokenizer.start(counting, ["stop-never"], True, [])
    out = [det.add([t], finished=n == len(ids)) for n, t in enumerate(ids, 1)]
    assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True)
    # Longest window: a multi-codepoint emoji (ZWJ family) spans many byte tokens.
    assert max(counting.lengths) <= 32, max(counting.lengths)
    assert sum(counting.lengths) < 8 * len(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_backend_decode_shortcut_equals_tokenizer_decode(tokenizer: Any, skip: bool) -> None:
    from engine.core.detokenizer import _decoder

    fast = _decoder(tokenizer, skip)
    generic = _decoder(_CountingTokenizer(tokenizer), skip)
    assert fast is not None and generic is not None
    assert fast.__name__ == "fast" and generic.__name__ == "generic"  # SmolLM2 takes the shortcut
    rng = random.Random(3)
    specials = list(tokenizer.all_special_ids)
    for _ in range(300):
        ids = _random_ids(rng, len(tokenizer), specials, rng.randrange(0, 20))
        want = tokenizer.decode(ids, skip_special_tokens=skip)
        assert fast(ids) == want and generic(ids) == want


@pytest.mark.parametrize("skip", [True, False])
def test_stop_string_spanning_initial_ids_is_found(tokenizer: Any, skip: bool) -> None:
    """A stop string that begins in the initial ids' text and ends in the new text stops
    the stream (as the full-decode reference does): the initial text's tail is searched."""
    ids = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)
    initial = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("world"))
    assert tokenizer.decode(ids[initial : initial + 1]).startswith(",")
    for stop in (["d,", "never-there"], ["world, th"], ["ld, this is"]):
        det = IncrementalDetokenizer.start(tokenizer, stop, skip, ids[:initial])
        assert det.add(ids[initial : initial + 3], finished=False) == ""
        assert det.stopped, stop
        _compare(tokenizer, ids, stop, skip, initial)
    # Random initial splits and multi-character stops, against the reference.
    rng = random.Random(11)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids, skip_special_tokens=skip)
        for _ in range(8):
            a = rng.randrange(0, max(1, len(full) - 1))
            stop = [full[a : a + rng.randrange(2, 8)], "zz-never"]
            _compare(tokenizer, ids, stop, skip, rng.randrange(1, len(ids)))
