"""Request bodies under element limits, large ones decoded off the event loop
(router/openai/body_parse.py; issue #36): the router's loop does no unbounded work for one body.

The counts (messages, prompts), the nesting depth and the number of JSON objects and arrays
are refused before any model is built: a body with too many messages whose every message
is also invalid is answered with the count, not with a validation error. A body above the
inline size is decoded and validated on a worker thread, not on the event loop's.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, model_validator
from starlette.requests import Request

from router.openai.body_parse import BodyLimits, parse_body
from tests.unit.router_app_support import CHAT, COMP, MODEL, assert_error, build_app


@pytest.fixture(scope="module")
def limited(tiny_model_dir: Path) -> Iterator[TestClient]:
    app = build_app(
        tiny_model_dir, max_chat_messages=8, max_batch_prompts=4, max_body_bytes=8 << 20
    )
    with TestClient(app) as c:
        yield c


def test_too_many_messages_are_refused_before_validation(limited: TestClient) -> None:
    # Every message is invalid too (an unknown role): had the model been built first, the
    # answer would name messages.0.role.
    body = {"model": MODEL, "messages": [{"role": "nobody", "content": "x"}] * 9}
    err = assert_error(limited.post(CHAT, json=body), 400, "messages")
    assert "at most 8 messages" in err["message"], err
    assert err["code"] == "request_too_complex"


def test_too_many_prompts_and_tokenize_messages_are_refused(limited: TestClient) -> None:
    body = {"model": MODEL, "prompt": ["a", "b", "c", "d", 7], "max_tokens": -5}
    err = assert_error(limited.post(COMP, json=body), 400, "prompt")
    assert "at most 4 prompts" in err["message"], err
    msgs = {"messages": [{"role": "user", "content": "hi"}] * 9}
    assert_error(limited.post("/tokenize", json=msgs), 400, "messages")


@pytest.mark.parametrize("depth", [100, 200_000], ids=["deep", "very-deep"])
def test_deep_nesting_is_refused(limited: TestClient, depth: int) -> None:
    nested = "[" * depth + "]" * depth
    raw = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], '
    raw += f'"chat_template_kwargs": {{"k": {nested}}}}}'
    resp = limited.post(CHAT, content=raw, headers={"content-type": "application/json"})
    err = assert_error(resp, 400)
    assert "nests deeper than" in err["message"], err


def test_too_many_json_containers_are_refused(limited: TestClient) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"k": [[] for _ in range(100_001)]},
    }
    err = assert_error(limited.post(CHAT, json=body), 400)
    assert "JSON objects and arrays" in err["message"], err


def test_a_valid_body_still_gets_through(limited: TestClient) -> None:
    # Empty pools: a valid request is answered 503 (only after the body was accepted).
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 8}
    assert limited.post(CHAT, json=body).status_code == 503
    assert_error(limited.post(CHAT, content=b"{", headers={"content-type": "application/json"}), 400)  # fmt: skip


class _Seen(BaseModel):
    """A model that writes down the thread its validation ran on."""

    text: str

    @model_validator(mode="before")
    @classmethod
    def _where(cls, data: Any) -> Any:
        _THREADS.append(threading.get_ident())
        return data


_THREADS: list[int] = []


def _request(raw: bytes) -> Request:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/x",
        "headers": [(b"content-type", b"application/json")],
    }
    return Request(scope, receive)


def test_a_large_body_is_validated_off_the_event_loop() -> None:
    limits = BodyLimits(inline_bytes=1024)

    async def main() -> tuple[int, list[str]]:
        loop_thread = threading.get_ident()
        gate = asyncio.Semaphore(1)
        small = await parse_body(_request(json.dumps({"text": "s"}).encode()), _Seen, limits, gate)
        big = await parse_body(_request(json.dumps({"text": "b" * 4096}).encode()), _Seen, limits, gate)  # fmt: skip
        return loop_thread, [small.text, big.text[:1]]

    _THREADS.clear()
    loop_thread, texts = asyncio.run(main())
    assert texts == ["s", "b"]
    assert _THREADS[0] == loop_thread, "a small body is decoded inline"
    assert _THREADS[1] != loop_thread, "a large body was validated on the event loop's thread"


def test_tokenize_is_capped_at_the_context(limited: TestClient) -> None:
    context = limited.post("/tokenize", json={"prompt": "hi"}).json()["max_model_len"]
    over = "hello " * (context + 10)  # a token per word at least: over the context
    err = assert_error(limited.post("/tokenize", json={"prompt": over}), 400, "prompt")
    assert f"the limit is {context}" in err["message"], err
    far = "hello " * 200_000  # refused before tokenizing (counted from its length)
    assert "at least" in assert_error(limited.post("/tokenize", json={"prompt": far}), 400)["message"]  # fmt: skip
