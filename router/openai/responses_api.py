"""``POST /v1/responses`` (OpenAI's Responses API), stateless: the request is read into the
chat-completions request it means and runs down the same pipeline (router/openai/handlers.py);
router/openai/responses_format.py shapes the answer. docs/router.md "Responses API" says what is
covered.

Nothing is stored: ``previous_response_id`` and ``conversation`` are a 400 (the client
sends the whole conversation in ``input``), ``store`` is accepted and has no effect.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import ConfigDict, Field, ValidationError

from router.errors import bad_request, validation_message
from router.openai.protocol import MAX_N, ChatCompletionRequest, TextCheckedRequest

# Input content parts that carry text; any other (input_image, input_file, ...) is a 400.
TEXT_PARTS = ("input_text", "output_text", "text")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequest(TextCheckedRequest):
    """The fields of a Responses request this server reads; other fields are ignored as
    on the other endpoints, the ones that need stored state are refused."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    truncation: Literal["disabled"] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    # vLLM extensions that the other endpoints take too.
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1

    def chat_request(self) -> ChatCompletionRequest:
        """The chat-completions request this one means (APIError 400 when it cannot be)."""
        if self.previous_response_id is not None or self.conversation is not None:
            field = "previous_response_id" if self.previous_response_id else "conversation"
            raise bad_request(
                f"{field} is not supported: this server stores no responses; send the whole "
                "conversation in input",
                field,
            )
        if not self.input:
            raise bad_request("input must be a non-empty string or list of items", "input")
        if self.n != 1:
            raise bad_request("the Responses API has one output; use n with chat completions", "n")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": _messages(self.instructions, self.input),
            "stream": self.stream,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "user": self.user,
            "seed": self.seed,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": _response_format(self.text),
        }
        if self.tools:
            body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        body = {key: value for key, value in body.items() if value is not None}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            message, param = validation_message(RequestValidationError(exc.errors()))
            raise bad_request(message, param) from None


def _messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of ``instructions`` and ``input``: consecutive ``function_call`` items
    become one assistant turn with several tool calls, as a chat client sends them."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            call = {
                "id": _text(item, "call_id", i),
                "type": "function",
                "function": {
                    "name": _text(item, "name", i),
                    "arguments": _text(item, "arguments", i),
                },  # fmt: skip
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _parts_text(output, i) if isinstance(output, list) else None
            if output is None:
                raise bad_request(f"input[{i}].output must be a string", f"input.{i}.output")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", i), "content": output})  # fmt: skip
        elif kind == "reasoning":
            continue  # a reasoning model's earlier turn: nothing a chat template can take
        else:
            raise bad_request(
                f"input[{i}] of type {kind!r} is not supported; send message, function_call "
                "or function_call_output items",
                f"input.{i}.type",
            )
    return messages


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise bad_request(
            f"input[{i}].role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}",
            f"input.{i}.role",
        )
    content = item.get("content")
    if isinstance(content, list):
        content = _parts_text(content, i)
    if not isinstance(content, str):
        raise bad_request(
            f"input[{i}].content must be a string or a list of text parts", f"input.{i}.content"
        )
    return {"role": role, "content": content}


def _parts_text(parts: list[Any], i: int) -> str:
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"input[{i}] has a content part of type {kind!r}: the served models are "
                "text-only, send input_text parts",
                f"input.{i}.content",
            )
        texts.append(part["text"])
    return "".join(texts)


def _text(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"input[{i}].{key} must be a non-empty string", f"input.{i}.{key}")
    return value


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool (nested under ``function``)."""
    if tool.get("type") != "function":
        raise bad_request(
            f"tools[{i}] of type {tool.get('type')!r} is not supported: only function tools "
            "(built-in tools such as web_search need OpenAI's servers)",
            f"tools.{i}.type",
        )
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}  # fmt: skip
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
        "tool_choice",
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (the schema sits one level up here)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        spec = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}  # fmt: skip
        return {"type": "json_schema", "json_schema": spec}
    return fmt
