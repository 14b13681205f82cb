"""vLLM's ``/tokenize`` and ``/detokenize`` on the router (router/openai/tokenize_api.py): the
served model's tokenizer and chat template, no engine; OpenAI error bodies on bad input."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from router.tokenizer import PromptProcessor
from tests.unit.router_app_support import MODEL, assert_error, build_app


@pytest.fixture
def client(tiny_model_dir: Path) -> Iterator[TestClient]:
    with TestClient(build_app(tiny_model_dir)) as c:
        yield c


@pytest.fixture
def processor(tiny_model_dir: Path) -> PromptProcessor:
    return PromptProcessor.from_model_dir(tiny_model_dir)


def test_tokenize_a_prompt_and_back(client: TestClient, processor: PromptProcessor) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    reply = client.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert reply["tokens"] == processor.encode(text)
    assert reply["count"] == len(reply["tokens"]) > 5
    assert reply["max_model_len"] == processor.shape.max_model_len
    assert "token_strs" not in reply
    plain = client.post(
        "/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}
    ).json()
    assert plain["tokens"] == processor.encode(text, add_special_tokens=False)
    assert "".join(plain["token_strs"]) == text
    back = client.post("/detokenize", json={"model": MODEL, "tokens": plain["tokens"]}).json()
    assert back == {"prompt": text}


def test_tokenize_messages_through_the_chat_template(
    client: TestClient, processor: PromptProcessor
) -> None:
    """The same tokens a chat completion would prefill (the template, no extra BOS)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    reply = client.post("/tokenize", json={"messages": messages}).json()
    assert reply["tokens"] == processor.encode_chat(messages)
    bare = client.post(
        "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()
    assert bare["tokens"] == processor.encode_chat(messages, add_generation_prompt=False)
    assert bare["count"] < reply["count"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, None),
        ("/tokenize", {"model": MODEL}, 400, None),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, None),
        ("/detokenize", {"tokens": "12"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
    ],
)
def test_bad_input_is_a_clear_4xx(
    client: TestClient, path: str, body: dict[str, object], status: int, param: str | None
) -> None:
    assert_error(client.post(path, json=body), status, param)


def test_a_lone_surrogate_is_refused(client: TestClient) -> None:
    raw = b'{"prompt": "ok \\udfff"}'
    assert_error(
        client.post("/tokenize", content=raw, headers={"content-type": "application/json"}), 400
    )


def test_the_api_key_covers_them(tiny_model_dir: Path) -> None:
    with TestClient(build_app(tiny_model_dir, api_keys=["k1"])) as c:
        assert_error(c.post("/tokenize", json={"prompt": "x"}), 401)
        assert_error(c.post("/detokenize", json={"tokens": [1]}), 401)
        key = {"Authorization": "Bearer k1"}
        assert c.post("/detokenize", json={"tokens": [1]}, headers=key).status_code == 200
