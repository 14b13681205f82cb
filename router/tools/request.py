"""The request side of tool calling on ``/v1/chat/completions`` (docs/design.md §3 "Tool
calls"): the ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` fields, what the chat
template receives, the guide that forces ``required`` and named calls, and the parser
that reads the answer.

- ``none``: tools are shown to the template, the answer is plain content.
- ``auto`` (the default with tools): the server's ``--tool-call-parser`` reads the answer;
  it needs ``--enable-auto-tool-choice`` (400 otherwise, as vLLM).
- ``required``: guided decoding forces ``[{"name": ..., "arguments": {...}}, ...]`` over
  the given tools (one item without ``parallel_tool_calls``), so names exist and
  arguments are instances of their schemas.
- a named function: guided decoding forces that function's arguments object.

Templates that do not use ``tools`` (SmolLM2's ChatML) get the tools in the system prompt
the Hermes way, calls in earlier assistant turns as ``<tool_call>`` blocks and tool
results as ``<tool_response>`` blocks, which the ``hermes`` parser reads back.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

from router.errors import bad_request
from router.tools.parsers import ToolParser, parser_class
from router.tools.parsers.forced import NamedParser, RequiredParser

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCallIn(_Strict):
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_arguments(cls, arguments: str) -> str:
        # As OpenAI: an earlier call's arguments are the JSON text the model produced.
        try:
            json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            raise ValueError("must be the function's arguments as a JSON string") from None
        return arguments


class ToolCallIn(_Strict):
    """A call in an earlier assistant message (what the client got back from us)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(Protocol):
    tools: list[ToolDef] | None
    tool_choice: ToolChoice | None
    parallel_tool_calls: bool | None


def choice_of(req: ToolFields) -> str:
    """``none``, ``auto``, ``required`` or ``named`` (no tools: ``none``)."""
    if isinstance(req.tool_choice, NamedToolChoice):
        return "named"
    if req.tool_choice is None:
        return "auto" if req.tools else "none"
    return req.tool_choice


def check_tools(req: ToolFields, guided: bool) -> None:
    """ValueError (a 400) for tool fields that cannot be served. ``guided``: the request
    carries another guide (``response_format``, ``guided_*``)."""
    names = [tool.function.name for tool in req.tools or []]
    for name in names:
        if not _NAME.match(name):
            raise ValueError(f"tool name {name!r} must be 1-64 letters, digits, '_', '-' or '.'")
    if len(set(names)) != len(names):
        raise ValueError("tool names must be unique")
    choice = choice_of(req)
    if choice in ("required", "named") and not names:
        raise ValueError(f"tool_choice {choice!r} needs tools")
    if choice == "named":
        assert isinstance(req.tool_choice, NamedToolChoice)
        if req.tool_choice.function.name not in names:
            raise ValueError(
                f"tool_choice names {req.tool_choice.function.name!r}, which is not in tools"
            )
    if choice in ("required", "named") and guided:
        raise ValueError(
            "tool_choice required or a named function cannot be combined with "
            "response_format or guided_* (both constrain the answer)"
        )


def _parameters(tool: ToolDef) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def tool_guide(req: ToolFields) -> tuple[str, str] | None:
    """The wire guide ``(kind, value)`` forcing ``required`` / named calls, else None."""
    choice = choice_of(req)
    tools = req.tools or []
    if choice == "named":
        assert isinstance(req.tool_choice, NamedToolChoice)
        tool = next(t for t in tools if t.function.name == req.tool_choice.function.name)
        return "json_schema", json.dumps(_parameters(tool))
    if choice != "required":
        return None
    # "name" before "arguments": the model commits to a function before its arguments,
    # and streaming can announce the call as soon as its name is complete.
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "arguments": _parameters(t),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return "json_schema", json.dumps(schema)


def parser_for(req: ToolFields, configured: str | None) -> ToolParser | None:
    """The parser for this request's answer (None: plain content). ``configured``: the
    server's ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on."""
    choice = choice_of(req)
    if choice == "named":
        assert isinstance(req.tool_choice, NamedToolChoice)
        return NamedParser(req.tool_choice.function.name)
    if choice == "required":
        return RequiredParser()
    if choice == "auto":
        if configured is None:
            raise ValueError(
                '"auto" tool choice (the default with tools) requires the server to run with '
                "--enable-auto-tool-choice and --tool-call-parser; or send tool_choice "
                '"none", "required" or a named function'
            )
        return parser_class(configured)()
    return None


class ServerToolFlags(Protocol):
    """The server's tool-calling flags (``RouterSettings`` has them; typed here so that
    tool calling sits below the router's settings)."""

    @property
    def enable_auto_tool_choice(self) -> bool: ...

    @property
    def tool_call_parser(self) -> str | None: ...


def request_parser(req: ToolFields, settings: ServerToolFlags) -> ToolParser | None:
    """:func:`parser_for` with the server's flags; a 400 for ``auto`` on a server without
    ``--enable-auto-tool-choice``."""
    configured = settings.tool_call_parser if settings.enable_auto_tool_choice else None
    try:
        return parser_for(req, configured)
    except ValueError as exc:
        raise bad_request(str(exc), "tool_choice") from exc


ToolList = Annotated[list[ToolDef], Field(max_length=128)]
