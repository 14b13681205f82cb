"""The hostile-client phases of issue #36 for ``chaos.py`` (run by ``chaos_attack.py`` in
its low-priority child, like the other request faults). The payloads are the issue's:

- ``many_messages``: 20 chat bodies at once of about 3 MiB, each 20 000 short messages
  (over ``--max-chat-messages``: refused for the count before the body is validated);
- ``prefirst_storm``: 300 streams opened within 1.5 s and dropped before their first
  token (each client waits at most 1.5 s from its start);
- ``deep_schema``: 4 requests with a 20 KB ``response_format`` JSON schema of objects
  nested 300 deep (under the size limit; the router refuses its nesting depth before
  validating the body, so no engine compiles it);
- ``tokenize_flood``: 8 ``/tokenize`` calls of a 3 MiB prompt (capped at the context);
- ``remote_ref``: schemas whose ``$ref`` is an ``http://`` or ``file://`` URL (400).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx


def _codes(replies: list[Any]) -> list[str]:
    return sorted(
        {str(r.status_code) if isinstance(r, httpx.Response) else type(r).__name__ for r in replies}
    )


async def _many_messages(base: str, model: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": "w " * 60} for _ in range(20_000)]
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 1}).encode()
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(timeout=120) as client:
        replies = await asyncio.gather(
            *(
                client.post(f"{base}/v1/chat/completions", content=body, headers=headers)
                for _ in range(20)
            ),  # fmt: skip
            return_exceptions=True,
        )
    return {"bodies": 20, "body_mib": round(len(body) / 2**20, 2), "codes": _codes(replies)}


async def _prefirst_storm(base: str, model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": "Abort me " * 40, "max_tokens": 64, "stream": True}
    limits = httpx.Limits(max_connections=400)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def drop(i: int) -> str:
            await asyncio.sleep(i * 1.5 / 300)  # opened over 1.5 s
            try:
                async with asyncio.timeout(1.5):
                    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                        return str(r.status_code)  # a first token came in time
            except TimeoutError:
                return "dropped"

        results = await asyncio.gather(*(drop(i) for i in range(300)), return_exceptions=True)
    seen = sorted({r if isinstance(r, str) else type(r).__name__ for r in results})
    return {"streams": 300, "results": seen, "seconds": round(time.monotonic() - t0, 1)}


def deep_schema(depth: int = 300) -> dict[str, Any]:
    """Objects nested ``depth`` deep (about 20 KB of JSON at 300)."""
    schema: dict[str, Any] = {"type": "string"}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema}, "required": [f"k{i}"]}
    return schema


async def _deep_schema(base: str, model: str) -> dict[str, Any]:
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema()}}
    body = {"model": model, "messages": [{"role": "user", "content": "Fill it"}],
            "max_tokens": 8, "response_format": fmt}  # fmt: skip
    async with httpx.AsyncClient(timeout=300) as client:
        t0 = time.monotonic()
        replies = await asyncio.gather(
            *(client.post(f"{base}/v1/chat/completions", json=body) for _ in range(4)),
            return_exceptions=True,
        )
    return {"requests": 4, "schema_bytes": len(json.dumps(deep_schema())),
            "codes": _codes(replies), "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip


async def _tokenize_flood(base: str, model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": "hello " * (1 << 19)}  # 3 MiB
    async with httpx.AsyncClient(timeout=120) as client:
        replies = await asyncio.gather(
            *(client.post(f"{base}/tokenize", json=body) for _ in range(8)),
            return_exceptions=True,
        )
    return {"requests": 8, "prompt_mib": 3, "codes": _codes(replies)}


async def _remote_ref(base: str, model: str) -> dict[str, Any]:
    refs = ["http://127.0.0.1:9/schema.json", "file:///etc/passwd"]
    async with httpx.AsyncClient(timeout=60) as client:
        replies = [
            await client.post(f"{base}/v1/completions", json={
                "model": model, "prompt": "x", "max_tokens": 4,
                "guided_json": {"type": "object", "properties": {"a": {"$ref": ref}}}})
            for ref in refs
        ]  # fmt: skip
    return {"refs": refs, "codes": _codes(replies)}


HOSTILE: dict[str, Callable[[str, str], Awaitable[dict[str, Any]]]] = {
    "many_messages": _many_messages,
    "prefirst_storm": _prefirst_storm,
    "deep_schema": _deep_schema,
    "tokenize_flood": _tokenize_flood,
    "remote_ref": _remote_ref,
}
