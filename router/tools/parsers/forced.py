"""Parsers for output that guided decoding forced into shape (``tool_choice`` ``required``
or a named function, router/tools/request.py): it can only fail to parse when it was cut
short (``max_tokens``), and then it comes back as content like any malformed output."""

from __future__ import annotations

import json

from router.tools.parsers.base import CallPart, Parsed, ToolParser, calls_in_array
from router.tools.parsers.json_scan import Malformed, skip_ws


class RequiredParser(ToolParser):
    """The answer is ``[{"name": ..., "arguments": {...}}, ...]``."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_ws(text, 0)
        if start >= len(text):
            return Parsed(content=text if final else "")
        try:
            calls, end = calls_in_array(text, start, final)
            if final and skip_ws(text, end) != len(text):
                raise Malformed("text after the list of calls")
        except Malformed:
            return Parsed(content=text) if final else Parsed()
        return Parsed(calls=calls)


class NamedParser(ToolParser):
    """The answer is the arguments object of the one named function."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        if not final:
            return Parsed(calls=[CallPart(self.function, text.strip())])
        try:
            ok = isinstance(json.loads(text), dict)
        except json.JSONDecodeError:
            ok = False
        if not ok:
            return Parsed(content=text)
        return Parsed(calls=[CallPart(self.function, text.strip(), complete=True)])
