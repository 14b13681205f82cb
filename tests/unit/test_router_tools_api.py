"""Tool-calling, best_of and suffix fields at the router's HTTP edge, no engines: bad
combinations are 400 with the OpenAI body, valid ones reach the pools (503 here), and the
flags are checked at startup."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pdserve.procs import free_ports
from router.openai.admission import chat_text
from router.openai.protocol import ChatMessage
from router.settings import RouterSettings
from router.tokenizer import ModelShape, PromptProcessor
from router.tools.request import ToolDef, tool_guide
from tests.service_fixtures import child_env
from tests.unit.router_app_support import CHAT, COMP, MODEL, assert_error, build_app

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> Iterator[TestClient]:
    """A router without --enable-auto-tool-choice."""
    with TestClient(build_app(tiny_model_dir)) as c:
        yield c


@pytest.fixture(scope="module")
def auto(tiny_model_dir: Path) -> Iterator[TestClient]:
    app = build_app(tiny_model_dir, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with TestClient(app) as c:
        yield c


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": ASK, "tools": [TOOL]} | fields


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (chat(tool_choice={"type": "function", "function": {"name": "nope"}}), "not in tools"),
        (chat(tools=None, tool_choice="required"), "needs tools"),
        (chat(tool_choice="sometimes"), None),
        (chat(tools=[TOOL, TOOL], tool_choice="required"), "unique"),
        (chat(tools=[{"type": "function", "function": {"name": "a b"}}]), "tool name"),
        (chat(tools=[{"type": "retrieval"}]), None),
        (chat(tool_choice="required", response_format={"type": "json_object"}), "combined"),
        (chat(tool_choice=NAMED, guided_regex="a+"), "combined"),
        (
            chat(
                messages=[{"role": "assistant", "tool_calls": [{"id": "x", "function": {}}]}],
                tool_choice="none",
            ),
            None,
        ),
    ],
)
def test_bad_tool_fields_are_400(
    auto: TestClient, body: dict[str, Any], needle: str | None
) -> None:
    err = assert_error(auto.post(CHAT, json=body), 400)
    if needle:
        assert needle in err["message"], err


def test_auto_needs_the_server_flags(plain: TestClient) -> None:
    err = assert_error(plain.post(CHAT, json=chat()), 400, "tool_choice")
    assert "--enable-auto-tool-choice" in err["message"]
    assert (
        "--enable-auto-tool-choice"
        in assert_error(plain.post(CHAT, json=chat(tool_choice="auto")), 400)["message"]
    )


@pytest.mark.parametrize(
    "body",
    [
        chat(tool_choice="none"),
        chat(tool_choice="required", parallel_tool_calls=False),
        chat(tool_choice=NAMED),
        chat(
            messages=[
                *ASK,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "5 C"},
            ],
            tool_choice="none",
        ),
    ],
)
def test_valid_tool_requests_reach_the_pools(plain: TestClient, body: dict[str, Any]) -> None:
    assert_error(plain.post(CHAT, json=body), 503)


def test_auto_with_the_flags_reaches_the_pools(auto: TestClient) -> None:
    assert_error(auto.post(CHAT, json=chat()), 503)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"best_of": 1, "n": 2}, "at least n"),
        ({"best_of": 3, "stream": True}, "cannot be streamed"),
        ({"best_of": 99}, None),
        ({"suffix": "end"}, "suffix"),
        ({"prompt_logprobs": 1}, "echo"),
        ({"use_beam_search": True}, "beam search"),
    ],
)
def test_completion_fields_400(
    plain: TestClient, fields: dict[str, Any], needle: str | None
) -> None:
    body = {"model": MODEL, "prompt": "x"} | fields
    err = assert_error(plain.post(COMP, json=body), 400)
    if needle:
        assert needle in err["message"], err


@pytest.mark.parametrize("fields", [{"best_of": 3}, {"echo": True, "logprobs": 2}])
def test_valid_completion_fields_reach_the_pools(plain: TestClient, fields: dict[str, Any]) -> None:
    assert_error(plain.post(COMP, json={"model": MODEL, "prompt": "x"} | fields), 503)


def test_required_guide_lists_every_tool_name_first() -> None:
    req = SimpleNamespace(
        tools=[ToolDef.model_validate(TOOL)], tool_choice="required", parallel_tool_calls=False
    )
    guide = tool_guide(req)  # type: ignore[arg-type]
    assert guide is not None
    kind, value = guide
    assert kind == "json_schema"
    assert value.index('"name"') < value.index('"arguments"')
    assert '"maxItems": 1' in value and '"enum": ["get_weather"]' in value


def test_flags_are_checked_at_startup() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser"):
        RouterSettings(served_model_names=["m"], enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes"):
        RouterSettings(served_model_names=["m"], tool_call_parser="nope")


# A template that renders tools itself (shaped like Qwen2.5's): it gets tools= and the
# calls' arguments as objects, and no Hermes text is added.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }}:{{ c.function.arguments.city }}]"
    "{% endfor %}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}"
)


def test_templates_that_know_tools_get_them(tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer

    proc = PromptProcessor(
        Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")),
        chat_template=TOOL_TEMPLATE,
        special_tokens={},
        shape=ModelShape(2048, 1, 1, 1),
    )
    messages = [
        ChatMessage.model_validate(m)
        for m in [
            *ASK,
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "5 C"},
        ]
    ]
    text = chat_text(proc, messages, False, False, [ToolDef.model_validate(TOOL)])
    assert text == ("TOOLS:get_weather;<user>weather?<assistant>[get_weather:Oslo]<tool>5 C(c1)")


def test_pdserve_up_checks_the_tool_flags_before_starting() -> None:
    (port,) = free_ports(1)
    base = [sys.executable, "-m", "pdserve", "up", "--port", str(port)]
    env = child_env()
    done = subprocess.run(
        [*base, "--enable-auto-tool-choice"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "--enable-auto-tool-choice needs --tool-call-parser" in done.stdout + done.stderr
    done = subprocess.run(
        [*base, "--tool-call-parser", "nope"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "hermes" in done.stderr


def test_pdserve_up_passes_the_tool_flags_to_its_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.unit.test_launcher_gpus import flag, plan

    argv = ["--enable-auto-tool-choice", "--tool-call-parser", "mistral"]
    router = plan(tmp_path, argv, monkeypatch)["router"]
    assert "--enable-auto-tool-choice" in router.argv
    assert flag(router, "--tool-call-parser") == "mistral"
    plain = plan(tmp_path / "b", [], monkeypatch)["router"]
    assert "--enable-auto-tool-choice" not in plain.argv
    assert flag(plain, "--tool-call-parser") is None
