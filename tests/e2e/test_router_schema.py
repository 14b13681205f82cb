"""Property-based fuzzing of the router's OpenAPI schema with schemathesis: whatever the
generated request (valid or not), the router over live services never answers 5xx. Plus the
input the schema cannot express (lone UTF-16 surrogates, integers past the 32/64-bit wire
ranges, token ids outside the vocabulary): 400 with the OpenAI body, and the keep-alive
connection still serves the next request.

The router runs with a 64-token context so valid generated requests stay small on the tiny
model; a few dozen examples per operation keep the run short.
"""

from __future__ import annotations

import json
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.service_fixtures import ProcessStack, ServiceProcess

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def fuzz_router(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("router_schema")
    kv = root / "kv"
    kv.mkdir()
    procs = ProcessStack(root / "logs", tiny_model_dir)
    conn = ("--connector", "fs", "--kv-path", str(kv))
    try:
        prefill, decode = procs.together(
            lambda: procs.service("prefill", connector_args=conn),
            lambda: procs.service("decode", connector_args=conn),
        )
        yield procs.router(
            prefill=[prefill],
            decode=[decode],
            extra_args=[
                "--served-model-name",
                "tiny",
                "--max-model-len",
                "64",
                "--request-timeout",
                "60",
            ],
        )
    finally:
        procs.close()


def _check(case: schemathesis.Case, base_url: str, seen: Counter[tuple[str, int]]) -> None:
    response = case.call(base_url=base_url, timeout=60)
    seen[(case.path, response.status_code)] += 1
    assert response.status_code < 500, (
        f"{case.method} {case.path} body={case.body!r} → {response.status_code}: {response.text[:500]}"
    )
    if response.status_code >= 400 and case.path.startswith("/v1"):
        error = response.json()["error"]
        assert error["message"] and error["type"], error


_GUIDE_FIELDS = (
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_json",
    "response_format",
)


def test_no_server_errors(fuzz_router: ServiceProcess) -> None:
    # Driven through hypothesis directly (schemathesis' pytest plugin predates pytest 9).
    schema = schemathesis.openapi.from_url(f"{fuzz_router.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
    }
    seen: Counter[tuple[str, int]] = Counter()
    for operation in operations:

        @settings(
            max_examples=60,
            deadline=None,
            database=None,
            derandomize=True,  # the same cases every run
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(), served=st.booleans())
        def run(case: schemathesis.Case, served: bool) -> None:
            # Random model names would stop almost every case at the 404; name the served
            # model in half of them so the rest of the pipeline gets fuzzed too.
            if served and isinstance(case.body, dict):
                case.body["model"] = "tiny"
                # Random guides (random regexes, several at once) are refused with 400 before
                # the engines; drop them here so served cases reach generation.
                for field in _GUIDE_FIELDS:
                    case.body.pop(field, None)
            _check(case, fuzz_router.url, seen)

        run()
    # The fuzzing must have reached the engines, not only the validators.
    ok = {path for (path, status), _ in seen.items() if status == 200}
    assert {"/v1/completions", "/v1/chat/completions"} <= ok, seen


def test_router_healthy_after_fuzzing(fuzz_router: ServiceProcess) -> None:
    assert httpx.get(f"{fuzz_router.url}/health", timeout=10).status_code == 200
    reply = httpx.post(
        f"{fuzz_router.url}/v1/completions",
        json={"model": "tiny", "prompt": "hello", "max_tokens": 3},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text


# -- Input the schema cannot express: lone surrogates, integers past the wire's ranges ------

_SAMPLING_INTS = ("max_tokens", "seed", "top_k", "n", "logprobs")
# Lone surrogates (category Cs) mixed with ordinary text: json.dumps writes them as
# "\ud800"-style escapes, which is how such a body arrives over HTTP.
_TEXT = st.text(st.characters(categories=["Cs", "Ll", "Nd", "Zs"]), min_size=1, max_size=12)
_INTS = st.one_of(
    st.integers(-5, 70), st.sampled_from([2**31 - 1, 2**31, 2**32, 2**63, 2**64, -(2**63) - 1])
)


def _post_raw(sock: socket.socket, path: str, body: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 request on an open keep-alive socket; (status, body) of the answer."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection; got {data!r}"
        data += chunk
    header, _, rest = data.partition(b"\r\n\r\n")
    lines = header.decode("latin-1").split("\r\n")
    assert "connection: close" not in header.decode("latin-1").lower(), header
    length = next(int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        rest += chunk
    return int(lines[0].split()[1]), rest[:length]


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        (COMP, rb'{"model": "tiny", "prompt": "hi \ud800"}'),
        (CHAT, rb'{"model": "tiny", "messages": [{"role": "user", "content": "\udfff"}]}'),
        (
            CHAT,
            rb'{"model": "tiny", "messages": [{"role": "user", "content": "a", "name": "\ud83d"}]}',
        ),
        (COMP, rb'{"model": "tiny", "prompt": "hi", "stop": ["\ud800"]}'),
        (COMP, rb'{"model": "tiny", "prompt": "hi", "user": "\udc00"}'),
        (COMP, rb'{"model": "tiny", "prompt": "hi", "top_k": 2147483648}'),
        (COMP, rb'{"model": "tiny", "prompt": "hi", "max_tokens": 18446744073709551616}'),
        (COMP, rb'{"model": "tiny", "prompt": "hi", "n": 4294967296}'),
        (COMP, rb'{"model": "tiny", "prompt": "hi", "logprobs": 9223372036854775808}'),
        (COMP, rb'{"model": "tiny", "prompt": "hi", "stop_token_ids": [4294967296]}'),
        (COMP, rb'{"model": "tiny", "prompt": "hi", "stop_token_ids": [49152]}'),
        (COMP, rb'{"model": "tiny", "prompt": [18446744073709551616]}'),
        (COMP, rb'{"model": "tiny", "prompt": "hi", "temperature": NaN}'),
    ],
)
def test_bad_input_is_400_and_the_connection_carries_on(
    fuzz_router: ServiceProcess, path: str, raw: bytes
) -> None:
    with socket.create_connection(("127.0.0.1", fuzz_router.port), timeout=60) as sock:
        status, body = _post_raw(sock, path, raw)
        assert status == 400, body
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["message"], error
        # The same keep-alive connection serves the next request.
        ok = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}).encode()
        status, body = _post_raw(sock, COMP, ok)
        assert status == 200, body


def test_openai_client_gets_bad_request_errors(fuzz_router: ServiceProcess) -> None:
    client = openai.OpenAI(base_url=f"{fuzz_router.url}/v1", api_key="x", max_retries=0, timeout=60)
    # (The client itself cannot send a lone surrogate: it encodes JSON as UTF-8 first.)
    bad: list[dict[str, Any]] = [
        {"prompt": "hi", "extra_body": {"top_k": 2**31}},
        {"prompt": "hi", "extra_body": {"stop_token_ids": [10**6]}},
        {"prompt": "hi", "max_tokens": 2**64},
    ]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", **kwargs)
        assert info.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], n=2**32
        )
    # A seed past 64 bits is reduced into the engine's range, not refused.
    reply = client.completions.create(model="tiny", prompt="hi", max_tokens=2, seed=2**70)
    assert reply.choices[0].text is not None


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(
    prompt=_TEXT,
    stop=st.lists(_TEXT, max_size=2),
    ints=st.dictionaries(st.sampled_from(_SAMPLING_INTS), _INTS),
    stop_ids=st.lists(_INTS, max_size=2),
)
def test_surrogates_and_wide_integers_never_5xx(
    fuzz_router: ServiceProcess,
    prompt: str,
    stop: list[str],
    ints: dict[str, int],
    stop_ids: list[int],
) -> None:
    body = {"model": "tiny", "prompt": prompt, "stop": stop, "stop_token_ids": stop_ids, **ints}
    body.setdefault("max_tokens", 2)
    reply = httpx.post(
        f"{fuzz_router.url}{COMP}",
        content=json.dumps(body).encode(),  # ensure_ascii: surrogates travel as \\udXXX
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert reply.status_code < 500, f"{body!r} → {reply.status_code}: {reply.text[:300]}"
    if reply.status_code >= 400:
        assert reply.json()["error"]["message"], reply.text
