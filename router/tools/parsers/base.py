"""What every tool-call parser returns, and the pieces they share.

A parser turns the text a model generated into plain content plus tool calls. It is
called with the whole text so far after every streamed delta (``final`` False) and once
with the finished text (``final`` True). The contract that makes streaming work
(docs/design.md §3 "Tool calls"):

- not final: ``content`` and each call's ``name`` / ``arguments`` are *stable*, i.e. a
  prefix of what any longer text yields; calls only ever get appended. Text that might
  still turn into a call (a partial ``<tool_call>`` tag) is held back.
- final: every call is complete, its name non-empty and its arguments a JSON object;
  model output that does not parse as a call is returned as content instead.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import ClassVar

from router.tools.parsers.json_scan import Malformed, scan_object, skip_ws

_DECODER = json.JSONDecoder()


@dataclass(slots=True)
class CallPart:
    """One tool call as far as it is known: ``name`` None until its string is complete;
    ``arguments`` the raw JSON text of the arguments object read so far."""

    name: str | None
    arguments: str
    complete: bool = False


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[CallPart] = field(default_factory=list)


class ToolParser:
    """Base class: subclasses set ``name`` and implement ``parse``."""

    name: ClassVar[str] = ""
    # Whether the engine may drop special tokens from the text: parsers whose markers are
    # special tokens ([TOOL_CALLS], <|python_tag|>) need them kept.
    skip_special_tokens: ClassVar[bool] = True
    # With special tokens kept, the end-of-turn token that stopped the request is in the
    # text; it is not part of the answer (router/tools/parsers/stream.py removes it).
    end_markers: ClassVar[tuple[str, ...]] = ()

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)


def held_tag_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (text
    that may become the tag once more arrives, so it must not be shown as content yet)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def call_from_object(text: str, start: int, final: bool) -> tuple[CallPart | None, int]:
    """The call in the object ``{"name": ..., "arguments"|"parameters": {...}}`` at
    ``text[start]``, and the index after it (0 while unfinished).

    Returns ``(None, 0)`` while not even the name is known. Raises Malformed when the
    text cannot be such a call, or (``final``) when the finished object is not a valid one.
    """
    scan = scan_object(text, start)
    name = None
    raw_name = scan.values.get("name")
    if raw_name is not None and scan.open_key != "name":
        name = _DECODER.decode(raw_name)
        if not isinstance(name, str) or not name:
            raise Malformed("the call's name is not a non-empty string")
    key = "arguments" if "arguments" in scan.values else "parameters"
    raw_args = scan.values.get(key)
    if not scan.complete:
        if final:
            raise Malformed("unfinished call")
        if name is None:
            return None, 0
        # A string-encoded arguments value is only shown once complete (its escapes).
        partial = raw_args if raw_args is not None and raw_args.startswith("{") else ""
        return CallPart(name, partial), 0
    if name is None:
        raise Malformed("the call has no name")
    args = "{}" if raw_args is None else raw_args
    if args.startswith('"'):
        args = _DECODER.decode(args)  # arguments given as a JSON string of the object
    try:
        if not isinstance(json.loads(args), dict):
            raise Malformed("the call's arguments are not a JSON object")
    except json.JSONDecodeError as exc:
        raise Malformed(f"the call's arguments are not JSON: {exc.msg}") from None
    return CallPart(name, args, complete=True), scan.end


def calls_in_array(text: str, start: int, final: bool) -> tuple[list[CallPart], int]:
    """The calls of a JSON array of call objects starting at ``text[start]`` (``[``), and
    the index after the array (0 while unfinished). Raises Malformed as
    :func:`call_from_object` does."""
    if text[start : start + 1] != "[":
        raise Malformed("expected '['")
    calls: list[CallPart] = []
    i = skip_ws(text, start + 1)
    if text[i : i + 1] == "]":
        if final:
            raise Malformed("an empty list of calls")
        return calls, i + 1
    while i < len(text):
        call, end = call_from_object(text, i, final)
        if call is not None:
            calls.append(call)
        if not end:
            return calls, 0
        i = skip_ws(text, end)
        if i >= len(text):
            break
        if text[i] == "]":
            return calls, i + 1
        if text[i] != ",":
            raise Malformed(f"expected ',' or ']' at {i}")
        i = skip_ws(text, i + 1)
    if final:
        raise Malformed("unfinished list of calls")
    return calls, 0


ALNUM = string.ascii_letters + string.digits
