"""An agent loop with the openai client's tool calling against `pdserve up` (SmolLM2,
disaggregated, ``--enable-auto-tool-choice --tool-call-parser hermes``): the client's
pydantic tools and ``parse`` read typed arguments, the loop runs the tools and sends their
results back as ``tool`` messages until the model answers in prose."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from pdserve.procs import free_ports
from tests.integration.up_support import READY_TIMEOUT_S, SMALL, UpProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """The local time in a timezone."""

    timezone: Literal["UTC", "CET", "PST"]


def run_tool(name: str, args: BaseModel) -> dict[str, Any]:
    if isinstance(args, GetWeather):
        return {"city": args.city, "temperature": 18, "unit": args.unit, "sky": "clear"}
    assert isinstance(args, GetTime), name
    return {"timezone": args.timezone, "time": "14:05"}


def test_agent_loop_against_pdserve_up(tmp_path: Path, smollm2_dir: Path) -> None:
    import openai

    (port,) = free_ports(1)
    up = UpProcess(
        tmp_path,
        *("--model", "smollm2", "--port", str(port)),
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
        *SMALL,
    )
    try:
        up.wait_for("pdserve is ready", READY_TIMEOUT_S)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0
        )
        tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
        messages: list[Any] = [
            {"role": "user", "content": "What is the weather in Paris, and what should I wear?"}
        ]
        models: dict[str, type[BaseModel]] = {"GetWeather": GetWeather, "GetTime": GetTime}
        calls_run = 0
        for turn in range(4):
            # The first turn must call a tool (``parse`` validates the arguments into the
            # pydantic models); afterwards the model decides (auto) and may answer in prose,
            # which ``parse`` refuses when cut by max_tokens, so ``create`` reads those.
            if turn == 0:
                reply: Any = client.chat.completions.parse(
                    model="smollm2",
                    messages=messages,
                    tools=tools,
                    tool_choice="required",
                    # A 135M model repeats a call forever when it may add more.
                    parallel_tool_calls=False,
                    temperature=0,
                    max_tokens=48,
                )
            else:
                reply = client.chat.completions.create(
                    model="smollm2", messages=messages, tools=tools, temperature=0, max_tokens=32
                )
            message = reply.choices[0].message
            messages.append(message)
            if not message.tool_calls:
                break
            assert reply.choices[0].finish_reason == "tool_calls"
            for call in message.tool_calls:
                assert call.type == "function"
                args = getattr(call.function, "parsed_arguments", None) or models[
                    call.function.name
                ].model_validate_json(call.function.arguments)
                assert isinstance(args, GetWeather | GetTime)
                result = run_tool(call.function.name, args)
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}
                )
                calls_run += 1
        assert calls_run >= 1
        assert messages[-1].content, "the loop should end with an answer in prose"
        assert messages[-1].tool_calls in (None, [])
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=90) == 0, up.output()
    finally:
        up.kill_tree()
