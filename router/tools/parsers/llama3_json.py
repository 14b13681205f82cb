"""``llama3_json``: Llama 3.1/3.2's JSON tool calls, the whole answer being
``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), several
separated by ``;``. An answer that does not start that way is plain content."""

from __future__ import annotations

from router.tools.parsers.base import CallPart, Parsed, ToolParser, call_from_object
from router.tools.parsers.json_scan import Malformed, skip_ws

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    skip_special_tokens = False  # <|python_tag|> is a special token
    end_markers = ("<|eom_id|>", "<|eot_id|>", "<|end_of_text|>")

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if text.startswith(TAG, i):
            i = skip_ws(text, i + len(TAG))
        elif not final and TAG.startswith(text[i:]):
            return Parsed()  # empty, whitespace or a partial tag: nothing to show yet
        if i >= len(text):
            return Parsed(content=text if final else "")
        if text[i] != "{":
            return Parsed(content=text)
        try:
            calls = _calls(text, i, final)
        except Malformed:
            return Parsed(content=text) if final else Parsed()
        if final and not calls:
            return Parsed(content=text)
        return Parsed(calls=calls)


def _calls(text: str, i: int, final: bool) -> list[CallPart]:
    calls: list[CallPart] = []
    while True:
        call, end = call_from_object(text, i, final)
        if call is not None:
            calls.append(call)
        if not end:
            return calls
        i = skip_ws(text, end)
        if i >= len(text):
            return calls
        if text[i] != ";":
            raise Malformed(f"expected ';' between calls at {i}")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            if final:
                raise Malformed("a ';' without a call after it")
            return calls
