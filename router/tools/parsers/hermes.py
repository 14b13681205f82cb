"""``hermes``: calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
(Hermes 2 Pro, Qwen2.5/3, and the convention pdserve uses for templates without tools)."""

from __future__ import annotations

from router.tools.parsers.base import (
    CallPart,
    Parsed,
    ToolParser,
    call_from_object,
    held_tag_prefix,
)
from router.tools.parsers.json_scan import Malformed, skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> Parsed:
        out = Parsed()
        i = 0
        while True:
            j = text.find(OPEN, i)
            if j < 0:
                tail = text[i:]
                out.content += tail if final else tail[: len(tail) - held_tag_prefix(tail, OPEN)]
                return out
            out.content += text[i:j]
            body = skip_ws(text, j + len(OPEN))
            close = text.find(CLOSE, body)
            if close < 0:
                # An unfinished block: while streaming, show what is known of the call;
                # at the end, a complete object without its closing tag still counts.
                call = _call(text, body, final)
                if call is not None:
                    out.calls.append(call)
                elif final:
                    out.content += text[j:]
                return out
            call = _call(text[:close], body, final=True)
            if call is None:
                out.content += text[j : close + len(CLOSE)]
            else:
                out.calls.append(call)
            i = close + len(CLOSE)


def _call(text: str, start: int, final: bool) -> CallPart | None:
    """The call in ``text[start:]`` (nothing but whitespace may follow it when final)."""
    if start >= len(text):
        return None
    try:
        call, end = call_from_object(text, start, final)
    except Malformed:
        return None
    if final and (call is None or skip_ws(text, end) != len(text)):
        return None
    return call
