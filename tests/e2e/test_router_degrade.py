"""Degrade, never drop (docs/design.md §5): with one prefill and one decode instance, losing
either one loses no request. With the decode paused or killed mid-stream the stream goes on
on the prefill instance (which serves whole requests through its DecodeService); with the
prefill killed under load, in-flight and new requests are prefilled on the decode instance.
Every output is the undisturbed greedy one.

Tests run in file order on one set of processes; each restores what it broke.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.router_support import FAULT_ATTEMPTS, busy_decode, metric, wait_for
from tests.service_fixtures import ProcessStack, ServiceProcess

PROMPT = "On the far side of the mountain, the travellers found"
FALLBACK = "pdserve_router_pool_fallback_total"
PAUSED_TOKENS = 480


@dataclass
class Degrade:
    prefill: ServiceProcess
    decode: ServiceProcess
    router: ServiceProcess

    @property
    def metrics(self) -> str:
        return f"{self.router.url}/metrics"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.router.url}/v1", api_key="x", max_retries=0, timeout=120
        )

    def healthy(self, pool: str, child: ServiceProcess) -> bool:
        body = httpx.get(f"{self.router.url}/health", timeout=10).json()
        return bool(body[pool]["instances"][child.address]["healthy"])


@pytest.fixture(scope="module")
def degrade(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Degrade]:
    root = tmp_path_factory.mktemp("router_degrade")
    kv = root / "kv"
    kv.mkdir()
    procs = ProcessStack(root / "logs", tiny_model_dir)
    conn = ("--connector", "fs", "--kv-path", str(kv))
    try:
        prefill = procs.service("prefill", connector_args=conn)
        decode = procs.service("decode", connector_args=conn)
        router = procs.router(
            prefill=[prefill],
            decode=[decode],
            extra_args=[
                "--served-model-name",
                "tiny",
                "--health-interval",
                "0.5",
                "--health-timeout",
                "0.5",
            ],
        )
        yield Degrade(prefill, decode, router)
    finally:
        for child in procs.children:
            child.signal(signal.SIGCONT)  # a paused child must be able to stop
        procs.close()


def _stream(
    client: openai.OpenAI,
    on_token: Callable[[int], None] | None = None,
    max_tokens: int = 60,
) -> list[str]:
    """The tokens of one greedy stream; ``on_token(n)`` after the n-th chunk."""
    tokens: list[str] = []
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for n, chunk in enumerate(stream):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens or []
        if on_token is not None:
            on_token(n)
    return tokens


def test_paused_only_decode_stream_continues_on_prefill(degrade: Degrade) -> None:
    # Long enough that the decode is usually still generating when the pause lands; an
    # attempt where it was not is checked for its output and tried again (busy_decode).
    client = degrade.client()
    expected = _stream(client, max_tokens=PAUSED_TOKENS)
    assert len(expected) == PAUSED_TOKENS
    before = metric(degrade.metrics, FALLBACK, reason="no_decode")
    paused: list[bool] = []

    def pause(n: int) -> None:
        if n == 5 and not paused and busy_decode([degrade.decode]) is not None:
            degrade.decode.signal(signal.SIGSTOP)
            paused.append(True)

    try:
        for _attempt in range(FAULT_ATTEMPTS):
            assert _stream(client, pause, max_tokens=PAUSED_TOKENS) == expected
            if paused:
                break
        assert paused, f"the decode finished before the 5th chunk in {FAULT_ATTEMPTS} tries"
        resumed = metric(degrade.metrics, FALLBACK, reason="no_decode")
        assert resumed >= before + 1, "the paused stream did not continue on the prefill"
        # While it is still paused, a new request is served whole by the prefill instance.
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].text
        assert not degrade.healthy("decode", degrade.decode)
    finally:
        degrade.decode.signal(signal.SIGCONT)
    assert metric(degrade.metrics, FALLBACK, reason="no_decode") >= resumed + 1
    wait_for(lambda: degrade.healthy("decode", degrade.decode), 30, "the decode to be back")


def test_killed_only_decode_stream_continues_on_prefill(degrade: Degrade) -> None:
    client = degrade.client()
    expected = _stream(client)
    killed: list[bool] = []

    def kill(n: int) -> None:
        if n == 5:
            degrade.decode.signal(signal.SIGKILL)
            degrade.decode.proc.wait(timeout=10)
            killed.append(True)

    try:
        assert _stream(client, kill) == expected
        assert killed
    finally:
        degrade.decode.restart()
    wait_for(lambda: degrade.healthy("decode", degrade.decode), 30, "the restarted decode")


def test_killed_only_prefill_loses_no_request(degrade: Degrade) -> None:
    """The prefill is killed under load: calls in flight on it fail and are prefilled on
    the decode instance; requests after that go straight there (no healthy prefill)."""
    prompts = [f"{i}: {PROMPT}" for i in range(12)]
    reference = degrade.client()
    want = [
        reference.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    url = degrade.metrics
    failed = metric(url, FALLBACK, reason="prefill_failed")
    missing = metric(url, FALLBACK, reason="no_prefill")

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        out = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0
        )
        return out.choices[0].text

    async def load() -> list[str | BaseException]:
        client = openai.AsyncOpenAI(
            base_url=f"{degrade.router.url}/v1", api_key="x", max_retries=0, timeout=120
        )
        try:
            tasks = [asyncio.create_task(one(client, p)) for p in prompts[:6]]
            await asyncio.sleep(0.05)
            degrade.prefill.signal(signal.SIGKILL)  # mid-load
            tasks += [asyncio.create_task(one(client, p)) for p in prompts[6:]]
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 90)
        finally:
            await client.close()

    try:
        results = asyncio.run(load())
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        assert results == want
        # Requests in flight at the kill fell back as "prefill_failed", or as "no_prefill"
        # when the router saw the connection drop before they were sent (load decides).
        during = metric(url, FALLBACK, reason="prefill_failed") + metric(
            url, FALLBACK, reason="no_prefill"
        )
        assert during >= failed + missing + 1
        # With the prefill known dead, new requests go to the decode pool directly.
        wait_for(lambda: not degrade.healthy("prefill", degrade.prefill), 30, "prefill out")
        missing = metric(url, FALLBACK, reason="no_prefill")
        assert (
            reference.completions.create(
                model="tiny", prompt=prompts[0], max_tokens=6, temperature=0
            )
            .choices[0]
            .text
            == want[0]
        )
        assert metric(url, FALLBACK, reason="no_prefill") >= missing + 1
    finally:
        degrade.prefill.restart()
    wait_for(lambda: degrade.healthy("prefill", degrade.prefill), 30, "the restarted prefill")
