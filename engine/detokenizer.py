"""Incremental detokenization with stop strings.

Text is produced by decoding the output ids and emitting what is new since the last call.
Two things are held back: an incomplete UTF-8 character (decoded as U+FFFD at the end), and
the last ``max(len(stop)) - 1`` characters, which could be the start of a stop string split
across tokens. A found stop string ends the request and is not returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: Any
    stop: list[str]
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of the full text already returned
    stopped: bool = False

    @classmethod
    def start(
        cls, tokenizer: Any, stop: list[str], skip_special: bool, initial_ids: list[int]
    ) -> IncrementalDetokenizer:
        """``initial_ids`` were generated (and shown) elsewhere: they give context only."""
        det = cls(tokenizer, stop, skip_special, list(initial_ids))
        det.emitted = len(det._text())
        return det

    def _text(self) -> str:
        if self.tokenizer is None:
            return ""
        return str(
            self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        )

    def add(self, new_ids: list[int], finished: bool) -> str:
        """Append tokens; return the new text. Sets ``stopped`` when a stop string appears."""
        self.token_ids.extend(new_ids)
        if self.tokenizer is None:
            return ""
        text = self._text()
        if self.stop:
            search_from = max(0, self.emitted - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
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
                end = min(end, len(text) - max(len(s) for s in self.stop) + 1)
        if end <= self.emitted:
            return ""
        delta, self.emitted = text[self.emitted : end], end
        return delta
