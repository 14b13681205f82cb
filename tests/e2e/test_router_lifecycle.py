"""The router end to end, request lifecycle: concurrency, bad input, client disconnects,
API keys and limits, auto mode, metrics; the same kind of stack as test_router_e2e.py
(fixture ``stack`` in tests/e2e/conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.router_support import (
    FAULT_ATTEMPTS,
    PROMPT,
    Stack,
    metric,
    running_requests,
    wait_for,
)
from tests.e2e.router_support import complete_prompt as complete
from tests.service_fixtures import start_router


def _leave_until_cancelled(stack: Stack, leave: Callable[[], None]) -> None:
    """Run ``leave`` (a request the client drops mid-way) until the decode service counts
    its Decode call cancelled, then wait until it runs no request. An attempt whose Decode
    call ended ``ok`` came too late (on a loaded machine the decode can finish before the
    client leaves) and is made again, up to ``FAULT_ATTEMPTS`` times; a router that never
    cancels fails every one."""
    url = stack.decode.metrics_url

    def decode_calls(outcome: str) -> float:
        return metric(url, "pdserve_service_requests_total", rpc="Decode", outcome=outcome)

    for _attempt in range(FAULT_ATTEMPTS):
        cancelled, done = decode_calls("cancelled"), decode_calls("ok")
        leave()
        wait_for(
            lambda c=cancelled, d=done: decode_calls("cancelled") > c or decode_calls("ok") > d,  # type: ignore[misc]
            30,
            "the decode to end the stream",
        )
        if decode_calls("cancelled") > cancelled:
            break
    else:
        pytest.fail(f"the decode finished before the client left in {FAULT_ATTEMPTS} tries")
    wait_for(
        lambda: running_requests(stack.decode.address, "decode") == 0,
        30,
        "decode to free the request",
    )


def test_concurrent_streams(stack: Stack) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> int:
        stream = await client.completions.create(
            model="tiny",
            prompt=f"{i} {PROMPT}",
            max_tokens=8,
            temperature=0.7,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        tokens = 0
        async for chunk in stream:
            tokens += len(chunk.choices[0].text) > 0 if chunk.choices else 0
        return tokens

    async def main() -> list[int | BaseException]:
        client = openai.AsyncOpenAI(
            base_url=f"{stack.disagg.url}/v1", api_key="x", max_retries=0, timeout=120
        )
        try:
            return await asyncio.gather(
                *(one(client, i) for i in range(32)), return_exceptions=True
            )
        finally:
            await client.close()

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(isinstance(r, int) and r > 0 for r in results)


def test_bad_input_through_openai_client(stack: Stack) -> None:
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as exc:
        complete(client, max_tokens=0)
    assert exc.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        complete(client, model="gpt-4o")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])  # type: ignore[list-item]
    with pytest.raises(openai.BadRequestError, match="limit is 256"):
        complete(client, prompt="word " * 400)
    with pytest.raises(openai.BadRequestError):
        complete(client, temperature="warm")
    bad_json = httpx.post(
        f"{stack.disagg.url}/v1/completions",
        content=b"{nope",
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert (
        bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    )
    # Still healthy and serving.
    assert httpx.get(f"{stack.disagg.url}/health", timeout=10).status_code == 200
    assert complete(client, max_tokens=2).choices[0].text


def test_client_disconnect_aborts_decode(stack: Stack) -> None:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 1800,
        "ignore_eos": True,
        "stream": True,
    }

    def leave() -> None:
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{stack.disagg.url}/v1/completions", json=body) as resp,
        ):
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # leave mid-stream: closing the response drops the connection

    _leave_until_cancelled(stack, leave)
    assert metric(f"{stack.disagg.url}/metrics", "pdserve_requests_total", outcome="cancelled") >= 1


def test_router_metrics_after_traffic(stack: Stack) -> None:
    complete(stack.client(), max_tokens=4, stream=True)
    url = f"{stack.disagg.url}/metrics"
    assert metric(url, "pdserve_ttft_seconds_count") > 0
    assert metric(url, "pdserve_itl_seconds_count") > 0
    assert metric(url, "pdserve_e2e_seconds_count") > 0
    assert metric(url, "pdserve_requests_total", outcome="success") > 0
    assert metric(url, "pdserve_disagg_decisions_total", decision="remote_prefill") > 0
    assert metric(url, "pdserve_disagg_decisions_total", decision="local_prefill") == 0
    for phase in ("router_queue", "prefill_compute", "kv_save", "kv_load"):
        assert metric(url, "pdserve_phase_seconds_count", phase=phase) > 0, phase
    assert metric(url, "pdserve_kv_bytes_total", connector="fs", direction="save") > 0
    assert metric(url, "pdserve_kv_bytes_total", connector="fs", direction="load") > 0
    assert (
        metric(url, "pdserve_instance_healthy", pool="decode", instance=stack.decode.address) == 1.0
    )
    assert (
        metric(url, "pdserve_instance_healthy", pool="prefill", instance=stack.prefill.address)
        == 1.0
    )
    # Colocated mode never prefills remotely.
    complete(stack.client(stack.colocated), max_tokens=2)
    coloc = f"{stack.colocated.url}/metrics"
    assert metric(coloc, "pdserve_disagg_decisions_total", decision="local_prefill") > 0
    assert metric(coloc, "pdserve_disagg_decisions_total", decision="remote_prefill") == 0


def test_auto_mode_decides_per_request(stack: Stack) -> None:
    client = stack.client(stack.auto)
    texts = {
        complete(client, prompt=p, max_tokens=6).choices[0].text for p in [PROMPT, "word " * 200]
    }
    assert all(texts)
    url = f"{stack.auto.url}/metrics"
    decided = metric(url, "pdserve_disagg_decisions_total")
    assert decided == metric(url, "pdserve_requests_total", outcome="success") >= 2


def test_api_key_and_concurrency_limit(stack: Stack, tmp_path: Path) -> None:
    router = start_router(
        stack.model_dir,
        tmp_path / "logs",
        prefill=[stack.prefill],
        decode=[stack.decode],
        extra_args=[
            "--served-model-name",
            "tiny",
            "--api-key",
            "sesame",
            "--max-concurrent-requests",
            "1",
        ],
    )
    try:
        anonymous = openai.OpenAI(
            base_url=f"{router.url}/v1", api_key="wrong", max_retries=0, timeout=60
        )
        with pytest.raises(openai.AuthenticationError):
            complete(anonymous, max_tokens=2)
        client = openai.OpenAI(
            base_url=f"{router.url}/v1", api_key="sesame", max_retries=0, timeout=60
        )
        assert complete(client, max_tokens=2).choices[0].text
        long_stream = complete(
            client, max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(long_stream))  # the one allowed request is now in flight
        with pytest.raises(openai.RateLimitError):
            complete(client, max_tokens=2)
        long_stream.close()
        auth = {"Authorization": "Bearer sesame"}  # instance details need the key
        wait_for(
            lambda: (
                httpx.get(f"{router.url}/health", headers=auth, timeout=10).json()["decode"][
                    "instances"
                ][stack.decode.address]["inflight"]
                == 0
            ),
            30,
            "the slot to free",
        )
        assert complete(client, max_tokens=2).choices[0].text
    finally:
        router.stop()


def test_non_streaming_client_disconnect_aborts_decode(stack: Stack) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1800, "ignore_eos": True}

    def leave() -> None:
        # The client gives up after 1 s, usually long before 1800 tokens are done (an answer
        # in time is an attempt that did not land), dropping the connection.
        with contextlib.suppress(httpx.ReadTimeout):
            reply = httpx.post(
                f"{stack.disagg.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.0)
            )
            assert reply.status_code == 200, reply.text

    _leave_until_cancelled(stack, leave)


def _slow_reader(url: str, body: dict[str, object], stall: Callable[[], None]) -> list[dict]:  # type: ignore[type-arg]
    """POST ``body`` from a socket with a tiny receive buffer, read the response's first
    bytes, run ``stall`` (waits while nothing is read, so the router's writes back up),
    then read the rest; the SSE events' JSON bodies, in order."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connect: the window
        sock.settimeout(60)
        sock.connect((host, int(port)))
        sock.sendall(head + payload)
        data = sock.recv(1)
        stall()
        while chunk := sock.recv(65536):
            data += chunk
    status, _, rest = data.partition(b"\r\n")
    assert b" 200 " in status, data[:300]
    body_bytes, raw = b"", rest.partition(b"\r\n\r\n")[2]
    while raw:  # Transfer-Encoding: chunked
        size, _, raw = raw.partition(b"\r\n")
        n = int(size, 16)
        body_bytes, raw = body_bytes + raw[:n], raw[n + 2 :]
    events = [e.removeprefix(b"data: ") for e in body_bytes.split(b"\n\n") if e.strip()]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_a_reader_that_falls_behind_gets_every_token_in_merged_chunks(stack: Stack) -> None:
    """A client that stops reading while its long stream is generated: once the router's
    writes back up (the socket buffers hold a few hundred KiB; top-5 logprobs make each
    chunk ~0.5 KiB), the tokens that pile up come merged (router/openai/coalesce.py), all
    of them, in order, the same text as a client that reads as it goes; every chunk a valid
    OpenAI chunk whose usage (continuous_usage_stats) counts the tokens sent so far and
    whose logprobs cover its own tokens. Before merging, every token was its own chunk."""
    max_tokens = 1800
    body: dict[str, object] = {
        "model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "logprobs": 5,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip

    def until_generated() -> None:
        wait_for(
            lambda: running_requests(stack.decode.address, "decode") == 0,
            120,
            "the decode to finish the stream",
        )

    slow = _slow_reader(stack.colocated.url, body, until_generated)
    chunks = [c for c in slow if c["choices"]]
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    sizes = [b - a for a, b in zip([0, *counts], counts, strict=False)]
    assert min(sizes) >= 1 and sum(sizes) == max_tokens  # usage rises with every chunk
    assert slow[-1]["usage"]["completion_tokens"] == max_tokens
    assert len(chunks) < max_tokens and max(sizes) > 1, "the piled-up tokens come merged"
    for chunk, size in zip(chunks, sizes, strict=True):
        lps = chunk["choices"][0]["logprobs"]
        assert len(lps["tokens"]) == len(lps["top_logprobs"]) == size
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    with httpx.Client(base_url=stack.colocated.url, timeout=120) as client:
        whole = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
        fresh = client.post("/v1/completions", json=whole)
    fresh.raise_for_status()
    assert "".join(c["choices"][0]["text"] for c in chunks) == fresh.json()["choices"][0]["text"]
