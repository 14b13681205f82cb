"""The router's HTTP surface with no engine instances: validation, error bodies, auth, limits.

The real app (``create_app``) runs in-process with empty pools, so every valid request must
be answered 503 with a clear message, and every bad one with the right 4xx and the OpenAI
error body — never FastAPI's 422.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.unit.router_app_support import CHAT, COMP, MODEL, assert_error, build_app


@pytest.mark.parametrize(
    ("url", "body"),
    [
        (COMP, {"model": MODEL, "prompt": "Hello"}),
        (COMP, {"model": MODEL, "prompt": [1, 2, 3], "stream": True}),
        (COMP, {"model": MODEL, "prompt": ["a", "b"], "n": 2}),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
        (
            CHAT,
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
    ],
)
def test_valid_request_with_empty_pools_is_503(
    client: TestClient, url: str, body: dict[str, Any]
) -> None:
    resp = client.post(url, json=body)
    err = assert_error(resp, 503)
    assert "no healthy decode instance" in err["message"]
    assert err["type"] == "service_unavailable_error"
    assert resp.headers["retry-after"] == "1"  # every 503 says when to retry


def test_unknown_model_and_adapter_endpoints_without_the_flag(client: TestClient) -> None:
    """No instance serves an adapter here: any other model is a 404; the runtime LoRA
    endpoints are off without --allow-runtime-lora-updating."""
    err = assert_error(client.post(COMP, json={"model": "sql-lora", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    body = {"lora_name": "a", "lora_path": "/x"}
    err = assert_error(client.post("/v1/load_lora_adapter", json=body), 404)
    assert "--allow-runtime-lora-updating" in err["message"]
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]


@pytest.mark.parametrize(
    ("url", "body", "param"),
    [
        (COMP, {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMP, {"model": MODEL, "prompt": "x", "max_tokens": -3}, "max_tokens"),
        (COMP, {"model": MODEL, "prompt": "x", "max_tokens": "5"}, "max_tokens"),
        (COMP, {"model": MODEL, "prompt": "x", "temperature": 2.5}, "temperature"),
        (COMP, {"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
        (COMP, {"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
        (COMP, {"model": MODEL, "prompt": "x", "top_k": -2}, "top_k"),
        (COMP, {"model": MODEL, "prompt": "x", "top_k": 2**31}, "top_k"),  # past int32
        (COMP, {"model": MODEL, "prompt": "x", "stop_token_ids": [2**32]}, "stop_token_ids.0"),
        (COMP, {"model": MODEL, "prompt": "x", "stop_token_ids": [49152]}, "stop_token_ids"),
        (COMP, {"model": MODEL, "prompt": "x", "n": 2**64}, "n"),
        (COMP, {"model": MODEL, "prompt": "x", "min_p": 1.5}, "min_p"),
        (COMP, {"model": MODEL, "prompt": "x", "n": 0}, "n"),
        (COMP, {"model": MODEL, "prompt": "x", "n": True}, "n"),
        (COMP, {"model": MODEL, "prompt": "x", "logprobs": 50}, "logprobs"),
        (COMP, {"model": MODEL, "prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        (COMP, {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        (COMP, {"model": MODEL, "prompt": "x", "stream": "yes"}, "stream"),
        (COMP, {"model": MODEL, "prompt": 5}, None),
        (COMP, {"model": MODEL, "prompt": []}, None),
        (COMP, {"model": MODEL}, "prompt"),
        (COMP, {"prompt": "x"}, "model"),
        (COMP, {"model": MODEL, "prompt": "x", "stop": ["a"] * 17}, None),
        (COMP, {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, None),
        (COMP, {"model": MODEL, "prompt": "x", "logit_bias": {"one": 5}}, None),
        (COMP, {"model": MODEL, "prompt": "x", "min_tokens": -1}, "min_tokens"),
        (COMP, {"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        (COMP, {"model": MODEL, "prompt": "x", "logit_bias": {"-1": 5}}, None),
        (COMP, {"model": MODEL, "prompt": "x", "logit_bias": {"1": 101}}, None),
        (COMP, {"model": MODEL, "prompt": "x", "logit_bias": {"1": "up"}}, "logit_bias.1"),
        (COMP, {"model": MODEL, "prompt": "x", "logit_bias": {"49152": 1}}, "logit_bias"),
        (
            CHAT,
            {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
            "messages.0.role",
        ),
        (CHAT, {"model": MODEL, "messages": []}, "messages"),
        (CHAT, {"model": MODEL, "messages": "hi"}, "messages"),
        (
            CHAT,
            {
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ],
            },
            None,
        ),
        (
            CHAT,
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            None,
        ),
        (
            CHAT,
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 0,
            },
            "max_completion_tokens",
        ),
        (
            CHAT,
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function"}],
            },
            None,
        ),
    ],
)
def test_bad_request_is_400_with_openai_body(
    client: TestClient, url: str, body: dict[str, Any], param: str | None
) -> None:
    err = assert_error(client.post(url, json=body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("url", "raw", "where"),
    [
        (COMP, rb'{"model": "tiny", "prompt": "a\ud800"}', "prompt"),
        (COMP, rb'{"model": "tiny", "prompt": ["ok", "\udfff"]}', "prompt[1]"),
        (COMP, rb'{"model": "t\ud800", "prompt": "x"}', "model"),
        (COMP, rb'{"model": "tiny", "prompt": "x", "guided_json": {"\ud800": 1}}', "guided_json"),
        (
            CHAT,
            rb'{"model": "tiny", "messages": [{"role": "user", "content": "\ud83d"}]}',
            "messages[0].content",
        ),
    ],
)
def test_lone_surrogate_is_400(client: TestClient, url: str, raw: bytes, where: str) -> None:
    resp = client.post(url, content=raw, headers={"content-type": "application/json"})
    err = assert_error(resp, 400)
    assert err["message"].startswith(f"{where}: contains a lone UTF-16 surrogate"), err


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        (b"", {}),
        (
            b'{"model": "tiny", "prompt": "x"}',
            {"content-type": "application/x-www-form-urlencoded"},
        ),
        (b"[1, 2]", {"content-type": "application/json"}),
    ],
)
def test_body_that_is_not_a_json_object_is_named(
    client: TestClient, content: bytes, headers: dict[str, str]
) -> None:
    err = assert_error(client.post(COMP, content=content, headers=headers), 400)
    assert "Content-Type: application/json" in err["message"], err


def test_malformed_json_is_400(client: TestClient) -> None:
    resp = client.post(
        COMP, content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"}
    )
    err = assert_error(resp, 400)
    assert "not valid JSON" in err["message"]


def test_unknown_model_is_404(client: TestClient) -> None:
    err = assert_error(client.post(COMP, json={"model": "gpt-9", "prompt": "x"}), 404, "model")
    assert err["code"] == "model_not_found"
    assert_error(client.get("/v1/models/gpt-9"), 404)


def test_prompt_over_limit_is_400_even_without_instances(client: TestClient) -> None:
    long_prompt = "hello " * 200  # far more than the 64-token limit
    err = assert_error(
        client.post(COMP, json={"model": MODEL, "prompt": long_prompt}), 400, "prompt"
    )
    assert "limit is 64" in err["message"]
    err = assert_error(
        client.post(COMP, json={"model": MODEL, "prompt": list(range(65))}), 400, "prompt"
    )
    messages = [{"role": "user", "content": long_prompt}]
    assert_error(client.post(CHAT, json={"model": MODEL, "messages": messages}), 400, "prompt")


def test_max_tokens_beyond_context_is_400(tiny_model_dir: Path) -> None:
    with TestClient(build_app(tiny_model_dir, max_model_len=32)) as c:
        err = assert_error(
            c.post(COMP, json={"model": MODEL, "prompt": "hello there", "max_tokens": 31}),
            400,
            "max_tokens",
        )
        assert "context of 32" in err["message"]


def test_body_over_limit_is_413(client: TestClient) -> None:
    big = {"model": MODEL, "prompt": "x" * 5000}
    assert_error(client.post(COMP, json=big), 413)

    def chunks() -> Iterator[bytes]:  # no content-length: chunked transfer encoding
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    assert_error(
        client.post(COMP, content=chunks(), headers={"content-type": "application/json"}), 413
    )


def test_chunked_body_under_limit_is_accepted(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", '
        yield b'"prompt": "hi"}'

    # Valid and small: reaches the pools (empty) → 503, proving the body was replayed intact.
    assert_error(
        client.post(COMP, content=chunks(), headers={"content-type": "application/json"}), 503
    )


def test_api_key(tiny_model_dir: Path) -> None:
    with TestClient(build_app(tiny_model_dir, api_keys=["k1", "k2"])) as c:
        body = {"model": MODEL, "prompt": "x"}
        err = assert_error(c.post(COMP, json=body), 401)
        assert err["type"] == "authentication_error"
        assert_error(c.post(COMP, json=body, headers={"Authorization": "Bearer nope"}), 401)
        assert_error(c.post(COMP, json=body, headers={"Authorization": "Basic k1"}), 401)
        assert_error(c.get("/v1/models"), 401)
        # Auth comes before parsing: garbage without a key is still 401.
        assert_error(
            c.post(COMP, content=b"{{{", headers={"content-type": "application/json"}), 401
        )
        assert_error(c.post(COMP, json=body, headers={"Authorization": "Bearer k2"}), 503)
        assert c.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
        # Everything but /health needs the key: metrics, the schema, the docs, unknown paths.
        for path in ("/metrics", "/openapi.json", "/docs", "/redoc", "/nothing"):
            assert_error(c.get(path), 401)
        ok = c.get("/metrics", headers={"Authorization": "Bearer k2"})
        assert ok.status_code == 200 and "pdserve_requests_total" in ok.text
        assert c.get("/openapi.json", headers={"Authorization": "Bearer k1"}).status_code == 200
        # Probes stay open, but learn no internal addresses without the key.
        health = c.get("/health")
        assert health.status_code == 503
        assert health.json() == {
            "status": "unavailable",
            "mode": "disaggregated",
            "prefill": {"healthy": 0, "total": 0},
            "decode": {"healthy": 0, "total": 0},
        }
        detailed = c.get("/health", headers={"Authorization": "Bearer k1"}).json()
        assert detailed["decode"] == {"healthy": 0, "total": 0, "instances": {}}


def test_public_metrics_leaves_only_metrics_open(tiny_model_dir: Path) -> None:
    with TestClient(build_app(tiny_model_dir, api_keys=["k"], public_metrics=True)) as c:
        assert c.get("/metrics").status_code == 200
        assert_error(c.get("/openapi.json"), 401)
        assert_error(c.get("/v1/models"), 401)


def test_version(client: TestClient) -> None:
    import importlib.metadata

    assert client.get("/version").json() == {"version": importlib.metadata.version("pdserve")}


def test_models_and_health(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    health = client.get("/health")
    assert health.status_code == 503
    assert health.json()["status"] == "unavailable"
    assert health.json()["decode"] == {"healthy": 0, "total": 0, "instances": {}}


def test_unknown_route_and_method_use_error_body(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get(COMP), 405)


def test_request_outcomes_are_counted(client: TestClient) -> None:
    client.post(COMP, json={"model": MODEL, "prompt": "x"})  # 503
    client.post(COMP, json={"model": "nope", "prompt": "x"})  # 404
    client.post(COMP, json={"model": MODEL, "prompt": list(range(100))})  # 400 (too long)
    text = client.get("/metrics").text
    assert 'pdserve_requests_total{outcome="unavailable"} 1.0' in text
    assert 'pdserve_requests_total{outcome="not_found"} 1.0' in text
    assert 'pdserve_requests_total{outcome="invalid"} 1.0' in text
    assert 'pdserve_requests_total{outcome="success"} 0.0' in text
