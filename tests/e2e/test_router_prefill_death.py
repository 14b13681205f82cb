"""Requests racing the only prefill's death (issue 36): with one prefill and one decode over
``--connector p2p``, the prefill is SIGKILLed while streams are in flight — some before their
first token, some between their first token and the KV handle, some with the decode still
pulling the prompt's KV from the dead prefill. Every request still completes with the
undisturbed greedy text: the decode computes the prompt itself (docs/design.md §5).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.service_fixtures import ProcessStack, ServiceProcess

pytestmark = pytest.mark.timeout(600)
PROMPT = "Beyond the river, the old mill turned slowly while"
MAX_TOKENS = 24
REQUESTS = 15


@pytest.fixture()
def stack(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    procs = ProcessStack(tmp_path / "logs", tiny_model_dir)
    p2p = ("--connector", "p2p", "--p2p-timeout", "30")
    try:
        prefill = procs.service("prefill", connector_args=p2p)
        decode = procs.service("decode", connector_args=p2p)
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
                "--decode-first",
                "off",
            ],
        )
        yield prefill, router
    finally:
        procs.close()


async def _one(client: openai.AsyncOpenAI, prompt: str, first: set[str] | None = None) -> str:
    """One greedy stream's text; its prompt goes into ``first`` at its first chunk."""
    text = ""
    stream = await client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            if first is not None:
                first.add(prompt)
    return text


def test_requests_racing_prefill_death_complete(
    stack: tuple[ServiceProcess, ServiceProcess],
) -> None:
    prefill, router = stack
    prompts = [f"{i}. {PROMPT}" for i in range(REQUESTS)]

    async def run() -> tuple[list[str], list[str | BaseException]]:
        client = openai.AsyncOpenAI(
            base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=120
        )
        try:
            want = list(await asyncio.gather(*(_one(client, p) for p in prompts)))
            first: set[str] = set()
            tasks = [asyncio.create_task(_one(client, p, first)) for p in prompts]
            # Kill once a few streams have their first token: they are waiting for the KV
            # handle or their decode is pulling from the prefill; the rest are before it.
            while len(first) < 3 and not all(t.done() for t in tasks):
                await asyncio.sleep(0.002)
            prefill.signal(signal.SIGKILL)
            got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 300)
            return want, list(got)
        finally:
            await client.close()

    want, got = asyncio.run(run())
    errors = [r for r in got if isinstance(r, BaseException)]
    assert not errors, [repr(e) for e in errors[:3]]
    assert got == want
