"""Router fault handling with real processes: health checks take instances out and put them
back, a decode instance killed mid-stream is failed over with exactly the expected tokens,
and a prefill instance killed under load is retried elsewhere.

Tests run in file order on one set of processes; each kills or pauses a different one.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.router_support import FAULT_ATTEMPTS, busy_decode, metric, wait_for
from tests.service_fixtures import ProcessStack, ServiceProcess

PROMPT = "In a quiet village by the sea, the old lighthouse keeper"


@dataclass
class Faults:
    prefill: list[ServiceProcess]
    decode: list[ServiceProcess]
    router: ServiceProcess  # health checks every 0.5 s
    slow_router: ServiceProcess  # health checks every 60 s, round-robin prefill
    rr_router: ServiceProcess  # health checks every 0.5 s, round-robin prefill


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Faults]:
    root = tmp_path_factory.mktemp("router_faults")
    kv = root / "kv"
    kv.mkdir()
    procs = ProcessStack(root / "logs", tiny_model_dir)
    conn = ("--connector", "fs", "--kv-path", str(kv))
    try:
        started = procs.together(
            *[lambda: procs.service("prefill", connector_args=conn)] * 2,
            *[lambda: procs.service("decode", connector_args=conn)] * 2,
        )
        prefill, decode = started[:2], started[2:]
        common = ["--served-model-name", "tiny", "--health-timeout", "0.5"]
        router, slow, rr = procs.together(
            lambda: procs.router(
                prefill=prefill, decode=decode, extra_args=[*common, "--health-interval", "0.5"]
            ),
            lambda: procs.router(
                prefill=prefill,
                decode=decode,
                extra_args=[*common, "--health-interval", "60", "--prefill-policy", "round_robin"],
            ),
            lambda: procs.router(
                prefill=prefill,
                decode=decode,
                extra_args=[*common, "--health-interval", "0.5", "--prefill-policy", "round_robin"],
            ),
        )
        yield Faults(prefill, decode, router, slow, rr)
    finally:
        for child in procs.children:
            child.signal(signal.SIGCONT)  # a paused child must be able to stop
        procs.close()


def client_for(router: ServiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=120)


def instance_healthy(router: ServiceProcess, pool: str, address: str) -> bool:
    body = httpx.get(f"{router.url}/health", timeout=10).json()
    return bool(body[pool]["instances"][address]["healthy"])


def test_health_checks_take_out_and_put_back(faults: Faults) -> None:
    paused = faults.decode[0]
    client = client_for(faults.router)
    assert instance_healthy(faults.router, "decode", paused.address)
    paused.signal(signal.SIGSTOP)
    try:
        wait_for(
            lambda: not instance_healthy(faults.router, "decode", paused.address),
            30,
            "the paused instance to be taken out",
        )
        url = f"{faults.router.url}/metrics"
        assert (
            metric(url, "pdserve_instance_healthy", pool="decode", instance=paused.address) == 0.0
        )
        # Traffic keeps flowing through the other decode instance.
        for i in range(3):
            out = client.completions.create(
                model="tiny", prompt=f"{i} {PROMPT}", max_tokens=4, temperature=0
            )
            assert out.choices[0].text
    finally:
        paused.signal(signal.SIGCONT)
    wait_for(
        lambda: instance_healthy(faults.router, "decode", paused.address),
        30,
        "the resumed instance to be put back",
    )


def _stream_collect(
    client: openai.OpenAI, kill_after: int | None, on_kill: object = None
) -> tuple[str, list[str]]:
    text, tokens = "", []
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=300,
        temperature=0.9,
        seed=7,
        logprobs=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for n, chunk in enumerate(stream):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.text
        tokens += choice.logprobs.tokens or [] if choice.logprobs else []
        if kill_after is not None and n == kill_after:
            on_kill()  # type: ignore[operator]
    return text, tokens


def test_decode_killed_mid_stream_fails_over_exactly(faults: Faults) -> None:
    client = client_for(faults.router)
    url = f"{faults.router.url}/metrics"
    expected_text, expected_tokens = _stream_collect(client, None)
    assert len(expected_tokens) == 300
    failovers = metric(url, "pdserve_decode_failovers_total")
    killed: list[ServiceProcess] = []

    def kill_the_busy_decode() -> None:
        busy = busy_decode(faults.decode)
        if busy is not None:  # None: the stream already finished there; streamed again
            busy.signal(signal.SIGKILL)
            busy.proc.wait(timeout=10)
            killed.append(busy)

    for _attempt in range(FAULT_ATTEMPTS):
        text, tokens = _stream_collect(client, kill_after=5, on_kill=kill_the_busy_decode)
        assert tokens == expected_tokens
        assert text == expected_text
        if killed:
            break
    assert killed, f"the stream ended before the kill in {FAULT_ATTEMPTS} tries"
    assert metric(url, "pdserve_decode_failovers_total") >= failovers + 1
    # The router keeps serving with the survivor.
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3).choices[0].text


def test_paused_prefill_calls_fail_over_while_it_is_paused(faults: Faults) -> None:
    """Prefill calls in flight on a paused (SIGSTOP) instance are cancelled when the health
    checks take it out and retried on the other one: every request completes, with the
    undisturbed output, while the instance is still paused (it is resumed only after; the
    prefill deadline, 60 s, is longer than the 45 s the test waits)."""
    router = faults.rr_router
    url = f"{router.url}/metrics"
    retries = metric(url, "pdserve_prefill_retries_total")
    victim = faults.prefill[1]
    prompts = [f"{i} paused: {PROMPT}" for i in range(8)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        out = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0
        )
        return out.choices[0].text

    async def load() -> list[str | BaseException]:
        client = openai.AsyncOpenAI(
            base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=120
        )
        victim.signal(signal.SIGSTOP)
        try:
            # Round robin: half of these go to the paused instance before it is taken out.
            tasks = [asyncio.create_task(one(client, p)) for p in prompts]
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 45)
        finally:
            victim.signal(signal.SIGCONT)
            await client.close()

    results = asyncio.run(load())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert metric(url, "pdserve_prefill_retries_total") >= retries + 1
    reference = client_for(faults.router)
    for prompt, text in zip(prompts, results, strict=True):
        want = reference.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0
        )
        assert text == want.choices[0].text, prompt
    wait_for(
        lambda: instance_healthy(router, "prefill", victim.address),
        30,
        "the resumed prefill instance to be put back",
    )


def test_prefill_killed_under_load_is_retried(faults: Faults) -> None:
    router = faults.slow_router
    url = f"{router.url}/metrics"
    retries = metric(url, "pdserve_prefill_retries_total")
    victim = faults.prefill[0]

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        out = await client.completions.create(
            model="tiny", prompt=f"{i}: {PROMPT}", max_tokens=6, temperature=0
        )
        return out.choices[0].text

    async def load() -> list[str | BaseException]:
        client = openai.AsyncOpenAI(
            base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=120
        )
        try:
            tasks = [asyncio.create_task(one(client, i)) for i in range(8)]
            await asyncio.sleep(0.05)
            victim.signal(signal.SIGKILL)  # mid-load
            tasks += [asyncio.create_task(one(client, i)) for i in range(8, 16)]
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await client.close()

    results = asyncio.run(load())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(isinstance(r, str) and r for r in results)
    # Round robin sends some requests to the dead instance; each one was retried.
    assert metric(url, "pdserve_prefill_retries_total") >= retries + 1
    assert not instance_healthy(router, "prefill", victim.address)
