"""A tolerant scanner for one JSON object that may still be arriving token by token.

Tool-call parsers need, from a possibly unfinished text such as
``{"name": "get_weather", "arguments": {"city": "Par``, the keys read so far and the raw
text of each value: a complete value, or the unfinished tail of the last one. Only the
structure is checked here (strings, nesting, separators); a complete call is validated
with ``json.loads`` by the caller. Raw value text is what streaming sends as argument
fragments, so what a client has received is always a prefix of the final arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WHITESPACE = " \t\r\n"
_DECODER = json.JSONDecoder()


class Malformed(ValueError):
    """The text cannot be the start of the expected JSON (not merely unfinished)."""


@dataclass(slots=True)
class ObjectScan:
    """What the scan read: ``values`` maps each key to its raw value text (the last one
    possibly unfinished, see ``open_key``); ``end`` is the index just after the closing
    brace when ``complete``."""

    values: dict[str, str] = field(default_factory=dict)
    open_key: str | None = None  # the key whose value is still arriving
    complete: bool = False
    end: int = 0


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, start: int) -> int | None:
    """Index just after the JSON value starting at ``start``; None while it is unfinished.
    Raises Malformed for a character no JSON value can start with."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in "{[":
        return _container_end(text, start)
    if first in "-0123456789tfn":
        i = start
        while i < len(text) and text[i] not in ",}] \t\r\n":
            i += 1
        return i if i < len(text) else None  # a number may still grow
    raise Malformed(f"unexpected {first!r} at {start}")


def _string_end(text: str, start: int) -> int | None:
    i = start + 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == '"':
            return i + 1
        i += 1
    return None


def _container_end(text: str, start: int) -> int | None:
    closers = {"{": "}", "[": "]"}
    stack = [closers[text[start]]]
    i = start + 1
    while i < len(text):
        ch = text[i]
        if ch == '"':
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if ch in closers:
            stack.append(closers[ch])
        elif ch in "}]":
            if ch != stack.pop():
                raise Malformed(f"mismatched {ch!r} at {i}")
            if not stack:
                return i + 1
        i += 1
    return None


def scan_object(text: str, start: int = 0) -> ObjectScan:
    """Scan the object starting at ``text[start]`` (which must be ``{``)."""
    out = ObjectScan()
    if text[start : start + 1] != "{":
        raise Malformed("expected '{'")
    i = skip_ws(text, start + 1)
    if text[i : i + 1] == "}":
        out.complete, out.end = True, i + 1
        return out
    while i < len(text):
        if text[i] != '"':
            raise Malformed(f"expected a key at {i}")
        key_end = _string_end(text, i)
        if key_end is None:
            return out
        key = _DECODER.decode(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return out
        if text[i] != ":":
            raise Malformed(f"expected ':' at {i}")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return out
        end = value_end(text, i)
        if end is None:
            out.values[key], out.open_key = text[i:], key
            return out
        out.values[key] = text[i:end]
        i = skip_ws(text, end)
        if i >= len(text):
            return out
        if text[i] == "}":
            out.complete, out.end = True, i + 1
            return out
        if text[i] != ",":
            raise Malformed(f"expected ',' or '}}' at {i}")
        i = skip_ws(text, i + 1)
    return out
