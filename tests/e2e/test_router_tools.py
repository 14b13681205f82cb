"""Tool calling, best_of and continuous usage through the router end to end: real SmolLM2
prefill + decode processes (fs connector), one router per mode (disaggregated, colocated,
auto) run with ``--enable-auto-tool-choice --tool-call-parser hermes``, and the official
``openai`` client. SmolLM2's template does not render tools, so these also cover the
Hermes system-prompt convention (router/tools/template.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.router_support import openai_client
from tests.service_fixtures import ProcessStack, ServiceProcess

pytestmark = pytest.mark.slow
MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["timezone"],
        },
    },
}
TOOLS: list[Any] = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@dataclass
class Stack:
    routers: dict[str, ServiceProcess]

    def client(self, mode: str = "disaggregated") -> openai.OpenAI:
        return openai_client(self.routers[mode].url)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("router_tools")
    kv = root / "kv"
    kv.mkdir()
    procs = ProcessStack(root / "logs", smollm2_dir)
    conn = ("--connector", "fs", "--kv-path", str(kv))
    common = ["--served-model-name", MODEL, "--enable-auto-tool-choice"]
    common += ["--tool-call-parser", "hermes", "--health-interval", "0.5"]
    try:
        prefill = procs.service("prefill", connector_args=conn)
        decode = procs.service("decode", connector_args=conn)
        routers = {
            mode: procs.router(
                prefill=[prefill] if mode != "colocated" else [],
                decode=[decode],
                mode=mode,
                extra_args=common,
            )
            for mode in ("disaggregated", "colocated", "auto")
        }
        yield Stack(routers)
    finally:
        procs.close()


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    args: dict[str, Any] = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 64}
    return client.chat.completions.create(**(args | kwargs))


def assert_valid_calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    """Every call names a given tool and its arguments validate against its schema."""
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.parametrize("mode", ["disaggregated", "colocated", "auto"])
def test_required_call_validates_against_the_schema(stack: Stack, mode: str) -> None:
    out = chat(stack.client(mode), tools=TOOLS, tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert assert_valid_calls(choice.message)


def test_required_without_parallel_calls_is_one_call(stack: Stack) -> None:
    out = chat(stack.client(), tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(assert_valid_calls(out.choices[0].message)) == 1


def test_named_function(stack: Stack) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    out = chat(stack.client(), tools=TOOLS, tool_choice=named)
    calls = assert_valid_calls(out.choices[0].message)
    assert [name for name, _ in calls] == ["get_time"]
    assert out.choices[0].finish_reason == "tool_calls"


def reassemble(stream: Any) -> tuple[str | None, dict[int, dict[str, Any]], str | None, int]:
    """What a client builds from the chunks: content, calls by index, the finish reason,
    and how many argument fragments arrived."""
    content: str | None = None
    calls: dict[int, dict[str, Any]] = {}
    finish, fragments = None, 0
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for part in choice.delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            if part.id:
                assert call["id"] is None, "a call's id comes once"
                call["id"] = part.id
                call["name"] = part.function.name
            if part.function and part.function.arguments:
                call["arguments"] += part.function.arguments
                fragments += 1
    return content, calls, finish, fragments


@pytest.mark.parametrize(
    ("mode", "choice"),
    [
        ("disaggregated", "required"),
        ("colocated", {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_streamed_tool_calls_reassemble_to_the_whole_answer(
    stack: Stack, mode: str, choice: Any
) -> None:
    client = stack.client(mode)
    whole = chat(client, tools=TOOLS, tool_choice=choice, seed=7)
    content, calls, finish, fragments = reassemble(
        chat(client, tools=TOOLS, tool_choice=choice, seed=7, stream=True)
    )
    expected = [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert all(call["id"] for call in calls.values())
    assert content is None and finish == "tool_calls"
    assert fragments > len(calls), "arguments should arrive in several fragments"


def test_multi_turn_with_a_tool_message(stack: Stack) -> None:
    client = stack.client()
    first = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18}'},
    ]
    second = chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=24)
    assert second.choices[0].message.content
    assert not second.choices[0].message.tool_calls
    # The earlier call and the tool's answer are in the prompt, Hermes style.
    url = stack.routers["disaggregated"].url
    ids = httpx.post(f"{url}/tokenize", json={"messages": history}, timeout=30).json()["tokens"]
    prompt = httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": ' in prompt
    assert '<tool_response>\n{"temperature_c": 18}\n</tool_response>' in prompt
    assert "<tools>" not in prompt  # /tokenize got no tools


def test_auto_choice_parses_or_returns_content(stack: Stack) -> None:
    # A 135M model may or may not call a tool; whichever it does must be well formed.
    for prompt in ("What is the weather in Paris?", "Say hello."):
        messages = [{"role": "user", "content": prompt}]
        out = chat(stack.client(), messages=messages, tools=TOOLS, max_tokens=24)
        message = out.choices[0].message
        if message.tool_calls:
            assert_valid_calls(message)
            assert out.choices[0].finish_reason in ("tool_calls", "length")
        else:
            assert message.content is not None


def test_best_of_keeps_the_highest_cumulative_logprob(stack: Stack) -> None:
    client = stack.client()
    common: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8}
    common |= {"temperature": 1.0, "seed": 11}
    every = client.completions.create(n=3, logprobs=0, **common)
    sums = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(best_of=3, **common)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == every.choices[sums.index(max(sums))].text
    two = client.completions.create(best_of=3, n=2, logprobs=0, **common)
    ranked = sorted(range(3), key=lambda i: -sums[i])[:2]
    assert [c.text for c in two.choices] == [every.choices[i].text for i in ranked]
    assert [c.index for c in two.choices] == [0, 1]


def test_continuous_usage_stats(stack: Stack) -> None:
    options: Any = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's key
    stream = stack.client().chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, stream=True, stream_options=options
    )
    chunks: list[Any] = list(stream)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] >= 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == counts[-1]
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)


def test_echo_with_logprobs_equals_the_offline_prompt_logprobs(
    stack: Stack, smollm2_dir: Path
) -> None:
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    prompt = "The capital of France is Paris, and the capital of Italy is"
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, logprobs=2)
    offline = LLM(str(smollm2_dir), num_kv_blocks=64).generate([prompt], params)[0]
    assert offline.prompt_logprobs is not None and offline.logprobs is not None
    expected = [None] + [lp.logprob for lp in offline.prompt_logprobs]
    expected += [lp.logprob for lp in offline.logprobs]
    # Disaggregated: the prompt's logprobs come from the prefill; colocated: the decode's.
    for mode in ("disaggregated", "colocated"):
        out = stack.client(mode).completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2
        )
        choice = out.choices[0]
        assert choice.text == prompt + offline.text
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        got = choice.logprobs.token_logprobs
        assert len(got) == len(expected), mode
        assert got[0] is None and choice.logprobs.top_logprobs[0] is None  # type: ignore[index]
        assert all(
            abs(a - b) < 1e-3
            for a, b in zip(got[1:], expected[1:], strict=True)  # type: ignore[operator]
        ), (mode, got, expected)
        assert "".join(choice.logprobs.tokens or []) == choice.text
        assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset or [])
    # Streamed (disaggregated): the first chunk carries the echo and the prompt's logprobs.
    stream = stack.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2, stream=True
    )
    joined: list[float | None] = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            joined += chunk.choices[0].logprobs.token_logprobs or []
    assert joined[0] is None and len(joined) == len(expected)
    assert all(abs(a - b) < 1e-3 for a, b in zip(joined[1:], expected[1:], strict=True))  # type: ignore[operator]
