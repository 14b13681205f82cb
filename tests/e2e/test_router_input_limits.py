"""The router's HTTP input bounds with a real router process (docs/router.md "Input
limits"): a connection that never finishes its headers is closed, a body that trickles is
answered 408, too many chat messages are a 400 before templating, connections beyond
``--max-connections`` get 503, a request that outlives the header deadline is not cut, and
a request that could never fit the decode's KV pool is a 400 before any byte is streamed.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service_fixtures import ProcessStack, ServiceProcess

HEADER_S = 1.0
BODY_S = 1.0


@pytest.fixture(scope="module")
def router(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("input_limits")
    kv = root / "kv"
    kv.mkdir()
    procs = ProcessStack(root / "logs", tiny_model_dir)
    conn = ("--connector", "fs", "--kv-path", str(kv))
    try:
        prefill = procs.service("prefill", connector_args=conn)
        # 256 KiB of KV: 32 blocks of 16 tokens, 31 usable (the tiny model: 512 bytes per token).
        decode = procs.service(
            "decode", connector_args=conn, extra_args=("--kv-cache-memory", "256Ki")
        )
        yield procs.router(
            prefill=[prefill],
            decode=[decode],
            extra_args=[
                *("--served-model-name", "tiny", "--max-chat-messages", "8"),
                *("--header-read-timeout", str(HEADER_S), "--body-read-timeout", str(BODY_S)),
                *("--max-connections", "6"),
            ],
        )
    finally:
        procs.close()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes (or answers and closes) within ``seconds``."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    return True


def test_unfinished_headers_are_cut_off(router: ServiceProcess) -> None:
    with socket.create_connection(("127.0.0.1", router.port), timeout=5) as silent:
        assert _closed_within(silent, HEADER_S + 5), "a silent connection was held"
    with socket.create_connection(("127.0.0.1", router.port), timeout=5) as partial:
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert _closed_within(partial, HEADER_S + 5), "half-sent headers were held"


def test_trickled_body_gets_408(router: ServiceProcess) -> None:
    with socket.create_connection(("127.0.0.1", router.port), timeout=5) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model"'
        )
        conn.settimeout(BODY_S + 10)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = conn.recv(4096)
            assert chunk, "closed without an answer"
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_too_many_chat_messages_is_400(router: ServiceProcess) -> None:
    messages = [{"role": "user", "content": f"m{i}"} for i in range(9)]
    reply = httpx.post(
        f"{router.url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 2},
        timeout=30,
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "messages"
    assert "at most 8 messages" in reply.json()["error"]["message"]
    ok = httpx.post(
        f"{router.url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages[:8], "max_tokens": 2},
        timeout=30,
    )
    assert ok.status_code == 200, ok.text


def test_connections_beyond_the_cap_get_503(router: ServiceProcess) -> None:
    held = [socket.create_connection(("127.0.0.1", router.port), timeout=5) for _ in range(6)]
    try:
        time.sleep(0.2)
        reply = httpx.get(f"{router.url}/v1/models", timeout=10)
        assert reply.status_code == 503, reply.text
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.5)
    assert httpx.get(f"{router.url}/v1/models", timeout=10).status_code == 200


def test_a_long_stream_is_not_cut_by_the_header_deadline(router: ServiceProcess) -> None:
    started = time.monotonic()
    chunks = 0
    usage: dict = {}
    with httpx.stream(
        "POST",
        f"{router.url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        },
        timeout=60,
    ) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                usage = json.loads(line[len("data: ") :]).get("usage") or usage
            if time.monotonic() - started < HEADER_S * 2:
                time.sleep(0.01)  # a slow reader keeps the stream open past the deadline
    # A slow reader gets several tokens merged into one chunk (docs/design.md §3 "Output
    # streams"), so the whole stream is counted by its usage, not by its chunks.
    assert chunks > 1
    assert usage.get("completion_tokens") == 400, usage
    assert time.monotonic() - started > HEADER_S


def test_request_that_never_fits_the_kv_pool_is_400_before_streaming(
    router: ServiceProcess,
) -> None:
    """Disaggregated: before the check, the prefill's first token was streamed (200) and
    the decode instance then refused the request in-band."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as reply:
        reply.read()
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "max_tokens" and "the largest instance holds 31" in error["message"]
    body["max_tokens"] = 400  # 26 blocks with the prompt: fits
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        assert "data: [DONE]" in reply.read().decode()


def test_far_too_long_chat_is_refused_without_tokenizing(router: ServiceProcess) -> None:
    """3 MiB of text cannot fit the 2048-token context whatever the tokenizer does (no
    token stands for more than ``max_token_chars`` characters): 400 naming the bound,
    before templating and tokenizing would hold a worker thread for seconds."""
    messages = [{"role": "user", "content": "word " * 78_000} for _ in range(8)]
    reply = httpx.post(
        f"{router.url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 2},
        timeout=60,
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "messages" and "the prompt has at least" in error["message"]
