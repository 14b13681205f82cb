"""What the chat template receives for a conversation with tools (docs/design.md §3
"Tool calls").

A template that uses ``tools`` gets them as transformers passes them (``tools=[{"type":
"function", "function": {...}}]``) and the messages as they came, with each call's
``arguments`` parsed into an object, as templates (Qwen, Llama 3.1, Hermes) expect.

A template that does not (SmolLM2's ChatML) gets the Hermes convention written into the
messages: the tools in the system prompt, earlier calls as ``<tool_call>`` blocks in the
assistant's content and tool results as ``<tool_response>`` blocks, so that the model sees
the same format the ``hermes`` parser reads back.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS_PROMPT = (
    "You can call functions to help with the user's request. The functions you may call "
    "are listed inside <tools></tools>, one JSON signature per line:\n<tools>\n{tools}\n"
    "</tools>\nTo call one, answer with a JSON object holding the function's name and its "
    "arguments inside <tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n'
    "</tool_call>\nFill in arguments from the conversation; do not invent values."
)


def call_arguments(arguments: str) -> Any:
    """A call's arguments as the template sees them: the object when the string is JSON."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def template_inputs(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, knows_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` for the template: unchanged when it knows tools, else with the
    Hermes convention written into the messages (and no ``tools`` argument)."""
    if knows_tools:
        return messages, tools
    out = [_hermes_message(m) for m in messages]
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = TOOLS_PROMPT.format(tools=listing)
        if out and out[0]["role"] in ("system", "developer"):
            first = dict(out[0])
            first["content"] = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
            out[0] = first
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _hermes_message(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message["role"] == "assistant" and calls:
        blocks = [
            "<tool_call>\n"
            + json.dumps(
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                ensure_ascii=False,
            )
            + "\n</tool_call>"
            for c in calls
        ]
        content = "\n".join([message["content"], *blocks] if message["content"] else blocks)
        return {"role": "assistant", "content": content}
    if message["role"] == "tool":
        return {
            "role": "tool",
            "content": f"<tool_response>\n{message['content']}\n</tool_response>",
        }
    return message
