"""Request fields of the OpenAI and vLLM APIs against the router app with empty pools
(tests/unit/router_app_support.py): nulls, content parts, chat-template variables, prompt
truncation. A valid body gets 503 (no instance), a bad one a 400 naming what is wrong."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.unit.router_app_support import CHAT, COMP, MODEL, assert_error, build_app


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "x"}}, "text"])
def test_non_text_content_part_is_named(client: TestClient, part: object) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    err = assert_error(client.post(CHAT, json={"model": MODEL, "messages": messages}), 400)
    assert "content part of type" in err["message"], err
    assert "text-only" in err["message"], err


def test_null_fields_mean_the_default(client: TestClient) -> None:
    """OpenAI's schema makes these nullable; a client that sends every field sends nulls.
    With no instances the valid body gets 503, an invalid one would be 400."""
    nulls = {"n": None, "stream": None, "echo": None, "ignore_eos": None, "logprobs": None,
             "temperature": None, "stop": None, "seed": None, "max_tokens": None}  # fmt: skip
    resp = client.post(COMP, json={"model": MODEL, "prompt": "x"} | nulls)
    assert resp.status_code == 503, resp.text
    chat = {"n": None, "logprobs": None, "stream": None, "tools": None, "tool_choice": None,
            "response_format": None, "max_completion_tokens": None}  # fmt: skip
    messages = [{"role": "user", "content": "x"}]
    resp = client.post(CHAT, json={"model": MODEL, "messages": messages} | chat)
    assert resp.status_code == 503, resp.text
    err = assert_error(client.post(COMP, json={"model": None, "prompt": "x"}), 400, "model")
    assert "required" in err["message"].lower(), err


def test_chat_template_kwargs_reach_the_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    """vLLM's ``chat_template_kwargs`` (Qwen3's ``enable_thinking``) are template variables;
    the router's own (``messages``, ``add_generation_prompt``) cannot be overridden."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}"
    )
    body = {"messages": [{"role": "user", "content": "hello"}], "return_token_strs": True}
    with TestClient(build_app(model_dir)) as client:
        plain = client.post("/tokenize", json=body).json()
        off = client.post(
            "/tokenize",
            json=body | {"chat_template_kwargs": {"enable_thinking": False, "messages": []}},
        ).json()
    assert "no_think" not in "".join(plain["token_strs"])
    assert "".join(off["token_strs"]) == "".join(plain["token_strs"]) + " /no_think"


@pytest.mark.parametrize("keep", [0, -2])
def test_bad_truncate_prompt_tokens_is_400(client: TestClient, keep: int) -> None:
    resp = client.post(COMP, json={"model": MODEL, "prompt": "x", "truncate_prompt_tokens": keep})
    assert_error(resp, 400)
