"""Text of a choice after its decode instance was lost: computed by the router itself.

Normally the decode service streams text deltas. Its incremental detokenizer holds back an
incomplete UTF-8 character and the last ``max(len(stop)) - 1`` characters (a stop string may
be starting). When the instance dies, that held-back text dies with it, and the instance
that resumes starts counting after the text of the tokens it was handed — so the client
would miss those characters. From the first failover on, the router therefore derives the
choice's text from the token ids with the same rules, starting from exactly what the client
has already received.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.stop_strings import stop_end
from router.tokenizer import PromptProcessor

_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class ResumedText:
    """Incremental detokenizer seeded with the client's text (``emitted``) and all tokens."""

    processor: PromptProcessor
    stops: list[str]
    skip_special_tokens: bool
    emitted: str
    token_ids: list[int] = field(default_factory=list)
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the text ends with it

    def feed(self, new_ids: list[int], finished: bool) -> tuple[str, bool]:
        """Append tokens; return (new text for the client, whether a stop string was hit)."""
        self.token_ids.extend(new_ids)
        full = self.processor.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        # Continue after what the client has. (If it saw a replacement character for a
        # character that has since completed, that position is not sent again.)
        start = len(self.emitted)
        found = stop_end(full, self.stops, start, self.include_stop)
        if found is not None:
            return self._emit(full, start, found), True
        end = len(full)
        if not finished:
            if full.endswith(_REPLACEMENT):
                end -= 1
            if self.stops:
                end = min(end, len(full) - max(len(s) for s in self.stops) + 1)
        return self._emit(full, start, end), False

    def _emit(self, full: str, start: int, end: int) -> str:
        if end <= start:
            return ""
        delta = full[start:end]
        self.emitted = full[:end]
        return delta
