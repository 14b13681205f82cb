"""``POST /v1/responses`` end to end: real prefill + decode processes, the routers of the
shared stack (tests/e2e/conftest.py), the official ``openai`` client's ``responses`` API.
A Responses request means a chat request: greedy, it must give the chat answer's text."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.router_support import Stack, metric

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}
ASK = "What is the weather in Paris?"


def _chat_text(stack: Stack, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    out = stack.client().chat.completions.create(
        model="tiny", messages=messages, temperature=0, **kwargs
    )
    return out.choices[0].message.content or ""


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_text_answer_is_the_chat_answer(stack: Stack, mode: str) -> None:
    client = stack.client(getattr(stack, mode))
    out = client.responses.create(
        model="tiny", instructions="Answer briefly.", input=ASK, max_output_tokens=12,
        temperature=0,
    )  # fmt: skip
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}]
    assert out.output_text == _chat_text(stack, messages, max_tokens=12)
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.output[0].type == "message" and out.output[0].role == "assistant"
    assert out.usage is not None and out.usage.output_tokens <= 12
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    # 12 tokens of a random model: cut at the limit unless it stopped on its own.
    assert out.status in ("completed", "incomplete")
    if out.status == "incomplete":
        assert out.incomplete_details is not None
        assert out.incomplete_details.reason == "max_output_tokens"


def test_stream_events_add_up_to_the_answer(stack: Stack) -> None:
    client = stack.client()
    whole = client.responses.create(model="tiny", input=ASK, max_output_tokens=16, temperature=0)
    kinds: list[str] = []
    text = ""
    sequence: list[int] = []
    for event in client.responses.create(
        model="tiny", input=ASK, max_output_tokens=16, temperature=0, stream=True
    ):
        kinds.append(event.type)
        sequence.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            final = event.response
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert sequence == list(range(len(sequence)))
    assert text == whole.output_text == final.output_text
    # The client's stream helper rebuilds the same response from the events.
    with client.responses.stream(
        model="tiny", input=ASK, max_output_tokens=16, temperature=0
    ) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_function_call_and_its_output_round_trip(stack: Stack) -> None:
    client = stack.client()
    out = client.responses.create(
        model="tiny", input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=80,
        parallel_tool_calls=False, temperature=0,
    )  # fmt: skip
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls, out.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id
    assert set(json.loads(call.arguments)) == {"city"}
    # The call and its result sent back as input items mean the chat turns with tool_calls.
    items: list[Any] = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]  # fmt: skip
    after = client.responses.create(
        model="tiny", input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=10,
        temperature=0,
    )  # fmt: skip
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    messages: list[Any] = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id,
         "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]  # fmt: skip
    want = _chat_text(stack, messages, tools=[chat_tool], tool_choice="none", max_tokens=10)
    assert after.output_text == want


def test_streamed_function_call(stack: Stack) -> None:
    events = list(
        stack.client().responses.create(
            model="tiny",
            input=ASK,
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=80,
            parallel_tool_calls=False,
            temperature=0,
            stream=True,
        )  # fmt: skip
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == args
    assert set(json.loads(args)) == {"city"}
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[-1].type == "function_call"


def test_json_schema_text_format(stack: Stack) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    out = stack.client().responses.create(
        model="tiny", input="Is it ok?", max_output_tokens=24, temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )  # fmt: skip
    assert set(json.loads(out.output_text)) == {"ok"}


@pytest.mark.parametrize(
    ("body", "status", "match"),
    [
        ({"previous_response_id": "resp_1"}, 400, "stores no responses"),
        ({"tools": [{"type": "web_search"}]}, 400, "only function tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "text-only",
        ),  # fmt: skip
        ({"input": [{"type": "computer_call"}]}, 400, "'computer_call' is not supported"),
        ({"input": []}, 400, "non-empty"),
        ({"temperature": 5}, 400, "temperature"),
        ({"tool_choice": {"type": "mcp"}}, 400, "tool_choice"),
        ({"model": "gpt-9"}, 404, "does not exist"),
    ],
)
def test_bad_requests_are_openai_errors(
    stack: Stack, body: dict[str, Any], status: int, match: str
) -> None:
    url = f"{stack.disagg.url}/v1/responses"
    invalid = metric(f"{stack.disagg.url}/metrics", "pdserve_requests_total", outcome="invalid")
    reply = httpx.post(url, json={"model": "tiny", "input": "hi", "max_output_tokens": 4} | body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert match in error["message"], error
    if status == 400:
        after = metric(f"{stack.disagg.url}/metrics", "pdserve_requests_total", outcome="invalid")
        assert after == invalid + 1


def test_openai_client_error_type(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError, match="stores no responses"):
        stack.client().responses.create(model="tiny", input="hi", previous_response_id="resp_1")


def test_null_fields_mean_the_default(stack: Stack) -> None:
    body = {"model": "tiny", "input": ASK, "max_output_tokens": 4, "temperature": 0,
            "stream": None, "instructions": None, "tools": None, "text": None}  # fmt: skip
    reply = httpx.post(f"{stack.disagg.url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["object"] == "response"
