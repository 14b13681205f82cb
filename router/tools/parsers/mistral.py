"""``mistral``: content, then ``[TOOL_CALLS]`` followed by a JSON list of
``{"name": ..., "arguments": {...}}`` (Mistral 7B v0.3, Nemo) or, with newer tokenizers,
``[TOOL_CALLS]name[ARGS]{...}`` once per call. Ids are 9 letters and digits, as
Mistral's templates require of the ids sent back in ``tool`` messages."""

from __future__ import annotations

import json
import secrets

from router.tools.parsers.base import (
    ALNUM,
    CallPart,
    Parsed,
    ToolParser,
    calls_in_array,
    held_tag_prefix,
)
from router.tools.parsers.json_scan import Malformed, skip_ws, value_end

TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False  # [TOOL_CALLS] is a special token
    end_markers = ("</s>",)

    def new_id(self) -> str:
        return "".join(secrets.choice(ALNUM) for _ in range(9))

    def parse(self, text: str, final: bool) -> Parsed:
        j = text.find(TAG)
        if j < 0:
            held = 0 if final else held_tag_prefix(text, TAG)
            return Parsed(content=text[: len(text) - held])
        content, start = text[:j], skip_ws(text, j + len(TAG))
        try:
            if text[start : start + 1] == "[":
                calls, end = calls_in_array(text, start, final)
                if final and skip_ws(text, end) != len(text):
                    raise Malformed("text after the list of calls")
            else:
                calls = _named_calls(text, j, final)
        except Malformed:
            return Parsed(content=text) if final else Parsed(content=content)
        if final and not calls:
            return Parsed(content=text)
        return Parsed(content=content, calls=calls)


def _named_calls(text: str, i: int, final: bool) -> list[CallPart]:
    """``[TOOL_CALLS]name[ARGS]{...}`` repeated, starting at the tag at ``text[i]``."""
    calls: list[CallPart] = []
    while i < len(text):
        if not text.startswith(TAG, i):
            raise Malformed(f"expected {TAG} at {i}")
        name_end = text.find(ARGS, i)
        if name_end < 0:
            if final:
                raise Malformed("a call without [ARGS]")
            return calls
        name = text[i + len(TAG) : name_end].strip()
        if not name:
            raise Malformed("a call without a name")
        start = skip_ws(text, name_end + len(ARGS))
        if start >= len(text):
            if final:
                raise Malformed("a call without arguments")
            calls.append(CallPart(name, ""))
            return calls
        if text[start] != "{":
            raise Malformed("arguments must be a JSON object")
        end = value_end(text, start)
        if end is None:
            if final:
                raise Malformed("unfinished arguments")
            calls.append(CallPart(name, text[start:]))
            return calls
        args = text[start:end]
        try:
            if not isinstance(json.loads(args), dict):
                raise Malformed("arguments must be a JSON object")
        except json.JSONDecodeError as exc:
            raise Malformed(f"arguments are not JSON: {exc.msg}") from None
        calls.append(CallPart(name, args, complete=True))
        i = skip_ws(text, end)
    return calls
