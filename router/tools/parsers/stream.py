"""One choice's tool-call state: the text so far → content and ``tool_calls`` deltas
(streaming) or the final message (non-streaming).

Both paths use the same parser on the same text, so a client that joins the streamed
fragments gets exactly the non-streamed answer whenever the model's output is well formed
(docs/design.md §3 "Tool calls"). Whitespace at the end of the content is held back while
streaming: it is dropped when calls follow, shown at the end otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.tools.parsers.base import Parsed, ToolParser


@dataclass(slots=True)
class _Sent:
    id: str
    name: str
    arguments: str


def without_end_marker(parser: ToolParser, text: str) -> str:
    """The finished text without the end-of-turn token that stopped it (kept in the text
    when the parser needs special tokens)."""
    for marker in parser.end_markers:
        if text.endswith(marker):
            return text[: -len(marker)]
    return text


def visible_content(parsed: Parsed, final: bool) -> str:
    if not final or parsed.calls:
        return parsed.content.rstrip()
    return parsed.content


class ToolCallStream:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.shown = ""  # content the client has
        self.sent: list[_Sent] = []

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """Content and ``delta.tool_calls`` entries that ``text`` (the choice's next piece)
        adds. What was already sent is never contradicted: should the finished text not
        parse as the calls it seemed to start (malformed output), the rest comes as content."""
        self.text += text
        whole = without_end_marker(self.parser, self.text) if finished else self.text
        parsed = self.parser.parse(whole, finished)
        content = visible_content(parsed, finished)
        new_content = ""
        if content.startswith(self.shown):
            new_content = content[len(self.shown) :]
            self.shown = content
        entries: list[dict[str, Any]] = []
        for index, call in enumerate(parsed.calls):
            if index < len(self.sent):
                sent = self.sent[index]
                if call.name != sent.name or not call.arguments.startswith(sent.arguments):
                    continue
                piece = call.arguments[len(sent.arguments) :]
                if piece:
                    sent.arguments = call.arguments
                    entries.append({"index": index, "function": {"arguments": piece}})
                continue
            if call.name is None or index != len(self.sent):
                break
            self.sent.append(_Sent(self.parser.new_id(), call.name, call.arguments))
            entries.append(
                {
                    "index": index,
                    "id": self.sent[-1].id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            )
        return new_content, entries

    @property
    def called(self) -> bool:
        return bool(self.sent)


def final_message(parser: ToolParser, text: str) -> dict[str, Any]:
    """The assistant message of a finished choice (non-streaming)."""
    parsed = parser.parse(without_end_marker(parser, text), True)
    content = visible_content(parsed, True)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if parsed.calls:
        message["content"] = content or None
        message["tool_calls"] = [
            {
                "id": parser.new_id(),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in parsed.calls
        ]
    return message
