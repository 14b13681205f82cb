"""Inputs OpenAI refuses are refused here too (issue #36): a ``tool`` message without
``tool_call_id``, an earlier assistant call whose ``arguments`` are not JSON, and a JSON
schema ``$ref`` that is not local (``http://``, ``file://``: a grammar compiler would
fetch or read it). The in-process app with empty pools: a valid request is a 503."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.unit.router_app_support import CHAT, MODEL, assert_error, build_app

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[TestClient]:
    with TestClient(build_app(tiny_model_dir)) as c:
        yield c


def _chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}


def test_a_tool_message_needs_its_call_id(client: TestClient) -> None:
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "42"},
    ]
    err = assert_error(client.post(CHAT, json=_chat(turns)), 400)
    assert "tool_call_id" in err["message"], err
    turns[2]["tool_call_id"] = "call_1"
    assert client.post(CHAT, json=_chat(turns)).status_code == 503


def test_earlier_call_arguments_must_be_json(client: TestClient) -> None:
    bad = {**CALL, "function": {"name": "f", "arguments": "{not json"}}
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [bad]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    err = assert_error(client.post(CHAT, json=_chat(turns)), 400)
    assert "arguments" in (err["param"] or "") and "JSON" in err["message"], err


@pytest.mark.parametrize(
    "ref", ["http://127.0.0.1:9/schema.json", "file:///etc/passwd", "other.json#/x"]
)
def test_a_schema_ref_must_be_local(client: TestClient, ref: str) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}}
    user = [{"role": "user", "content": "hi"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    err = assert_error(client.post(CHAT, json=_chat(user, response_format=fmt)), 400)
    assert "$ref" in err["message"], err
    assert_error(client.post(CHAT, json=_chat(user, guided_json=schema)), 400)
    local = {"$defs": {"n": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/n"}}}
    assert client.post(CHAT, json=_chat(user, guided_json=local)).status_code == 503
