"""The load of ``benchmarks.system.chaos``: streamed greedy completions through the official
``openai`` client, each classified against its undisturbed output (``chaos_report.Outcome``)."""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import openai

from benchmarks.system.chaos_report import Outcome

MODEL = ["tiny-llama"]  # what the router serves: pdserve up names the model by its path


async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, hang_up: int = 0) -> str:
    """The streamed completion's text; with ``hang_up`` > 0, close the stream after that
    many chunks (a client disconnect) and return what came."""
    stream = await client.completions.create(
        model=MODEL[0], prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    parts: list[str] = []
    async for chunk in stream:
        parts.extend(c.text for c in chunk.choices)
        if hang_up and len(parts) >= hang_up:
            await stream.close()
            break
    return "".join(parts)


async def load(base: str, prompts: list[str], expected: list[str], args: argparse.Namespace,
               hang_up: bool) -> list[Outcome]:  # fmt: skip
    """``--concurrency`` streams for ``--phase-seconds``; with ``hang_up`` the even ones
    disconnect after 1-8 chunks."""
    client = openai.AsyncOpenAI(
        base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=args.request_timeout
    )
    outcomes: list[Outcome] = []
    end = time.monotonic() + args.phase_seconds

    async def worker(w: int) -> None:
        i = w
        while time.monotonic() < end:
            p, i = i % len(prompts), i + args.concurrency
            cut = 1 + i % 8 if hang_up and w % 2 == 0 else 0
            t0 = time.monotonic()
            o = Outcome(False, False, 0.0, started=t0, cancelled=bool(cut))
            try:
                # The client's own timeout should fire first; this guard keeps a benchmark
                # whose client misbehaves from hanging too (counted as hung as well).
                text = await asyncio.wait_for(
                    one(client, prompts[p], args.max_tokens, cut), args.request_timeout + 30
                )
                o.ok, o.identical = True, cut > 0 or text == expected[p]
            except (openai.APITimeoutError, TimeoutError):
                o.error, o.hung = "timeout", True
            except openai.APIStatusError as e:
                o.error = f"HTTP {e.status_code}"
            except (openai.APIError, httpx.HTTPError) as e:
                o.error = f"{type(e).__name__}: {str(e)[:80]}"
            o.ended = time.monotonic()
            o.latency_s = o.ended - t0
            outcomes.append(o)

    await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
    await client.close()
    return outcomes
