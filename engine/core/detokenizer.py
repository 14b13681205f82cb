"""Incremental detokenization with stop strings (and loading a model's tokenizer).

Only a small window of recent tokens is decoded per call (O(1) per token, not O(length)):
``prefix_offset:read_offset`` are tokens whose text is already known (context, so decoders
that depend on the previous token see it), ``read_offset:`` the new ones. The new text is
``decode(ids[prefix_offset:])`` minus ``decode(ids[prefix_offset:read_offset])`` (the
latter cached from the previous call while the window grows, so usually one decode per
call); it is committed, and ``read_offset`` moves on, only when it does not end in an
incomplete UTF-8 character (decoded as U+FFFD) — until then it is shown to the stop logic
but not committed.

Two things are held back from the caller: an incomplete UTF-8 character, and the last
``max(len(stop)) - 1`` characters, which could be the start of a stop string split across
tokens. A found stop string ends the request and is not returned (with ``include_stop``, vLLM's
``include_stop_str_in_output``, the text ends with it). The streamed text equals
the full decode of the output ids (``tests/unit/test_engine_detokenizer.py`` checks this
against the real tokenizer, multi-byte characters and special tokens included).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.stop_strings import stop_end

# Tokens of context decoded before the new ones when a stream starts from ``initial_ids``.
_INITIAL_CONTEXT_TOKENS = 6
# The window (context + new ids) slides forward once it is this long. Longer windows cost a
# little more per decode; sliding costs one extra decode (of the new context).
_MAX_WINDOW = 4


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: Any
    stop: list[str]
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    include_stop: bool = False  # a found stop string ends the text instead of being cut
    emitted: int = 0  # characters of ``text`` already returned
    stopped: bool = False
    # The tail of the committed text (ids before ``read_offset``, after any initial ids'
    # text): what is not yet returned plus the ``max_stop_len`` characters before it, which
    # a stop string may still start in. Older text is dropped so no call costs O(length).
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    max_stop_len: int = 0
    # decode(token_ids[prefix_offset:read_offset]) when known (None: decode it next call).
    _prefix_text: str | None = None
    _decode_fn: Callable[[list[int]], str] | None = None

    def __post_init__(self) -> None:
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self._decode_fn = _decoder(self.tokenizer, self.skip_special_tokens)

    @classmethod
    def start(
        cls,
        tokenizer: Any,
        stop: list[str],
        skip_special: bool,
        initial_ids: list[int],
        *,
        include_stop: bool = False,
    ) -> IncrementalDetokenizer:
        """``initial_ids`` were generated (and shown) elsewhere: they give context only."""
        det = cls(tokenizer, stop, skip_special, list(initial_ids), include_stop)
        det.read_offset = len(det.token_ids)
        det.prefix_offset = max(0, det.read_offset - _INITIAL_CONTEXT_TOKENS)
        if det.max_stop_len > 1 and det.token_ids and tokenizer is not None:
            # A stop string may begin in the initial text and end in the new text: keep the
            # initial text's last max_stop_len - 1 characters as already returned, so the
            # stop search sees them. One full decode, once (a suffix of the ids can hold
            # fewer characters than that when it is mostly skipped special tokens).
            tail = det._decode(det.token_ids)[-(det.max_stop_len - 1) :]
            det.text, det.emitted = tail, len(tail)
        return det

    def _decode(self, ids: list[int]) -> str:
        assert self._decode_fn is not None
        return self._decode_fn(ids)

    def _new_text(self, finished: bool) -> str:
        """Text of the ids from ``read_offset`` on; commits it unless it ends mid-character."""
        window = self.token_ids[self.prefix_offset :]
        prefix_text = self._prefix_text
        if prefix_text is None:
            known = self.read_offset - self.prefix_offset
            prefix_text = self._prefix_text = self._decode(window[:known]) if known else ""
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. only skipped special tokens so far: nothing to show yet
        delta = new_text[len(prefix_text) :]
        if finished or not new_text.endswith("\ufffd"):
            self.text += delta
            if len(window) >= _MAX_WINDOW:
                # Slide: the context becomes the ids just committed (decoded next call).
                self.prefix_offset, self._prefix_text = self.read_offset, None
            else:
                # Keep the context and grow it: its text is exactly this decode, so the
                # next call needs one decode, not two.
                self._prefix_text = new_text
            self.read_offset = len(self.token_ids)
            return ""
        return delta  # ends in an incomplete character: shown to the stop search only

    def add(self, new_ids: list[int], finished: bool, *, stops: bool = True) -> str:
        """Append tokens; return the new text. Sets ``stopped`` when a stop string appears;
        ``stops=False`` (``min_tokens`` not reached): no search, nothing held back."""
        self.token_ids.extend(new_ids)
        if self.tokenizer is None:
            return ""
        delta = self._add(finished, stops and bool(self.stop))
        # ``emitted`` may reach into uncommitted text (the part before an incomplete
        # character); only committed text can be dropped.
        cut = min(self.emitted - self.max_stop_len, len(self.text))
        if cut > 0:
            self.text, self.emitted = self.text[cut:], self.emitted - cut
        return delta

    def _add(self, finished: bool, stops: bool) -> str:
        pending = self._new_text(finished)
        text = self.text + pending if pending else self.text
        if stops:
            search_from = max(0, self.emitted - self.max_stop_len + 1)
            found = stop_end(text, self.stop, search_from, self.include_stop)
            if found is not None:
                self.stopped = True
                end = max(found, self.emitted)
                delta, self.emitted = text[self.emitted : end], end
                return delta
        end = len(text)
        if not finished:
            if text.endswith("\ufffd"):
                end -= 1
            if stops:
                end = min(end, len(text) - self.max_stop_len + 1)
        if end <= self.emitted:
            return ""
        delta, self.emitted = text[self.emitted : end], end
        return delta


def load_tokenizer(model_dir: str) -> Any:
    """The model's HF tokenizer, or None for a bare config (dummy-weight benchmarks)."""
    if not any(
        os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _decoder(tokenizer: Any, skip_special: bool) -> Callable[[list[int]], str] | None:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=skip_special)``, made cheaper.

    The stock HF fast tokenizer's decode is its Rust backend's decode followed by an
    optional clean-up; with the clean-up off, calling the backend directly gives the same
    string for about a fifth of the per-call overhead (which dominates short windows).
    Anything else (a slow tokenizer, a subclass overriding decode, clean-up on) goes
    through ``tokenizer.decode``.
    """
    if tokenizer is None:
        return None
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        backend_decode = tokenizer.backend_tokenizer.decode

        def fast(ids: list[int]) -> str:
            return str(backend_decode(ids, skip_special_tokens=skip_special))

        return fast

    def generic(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=skip_special))

    return generic
