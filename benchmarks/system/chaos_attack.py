"""The attacker side of chaos's input faults (``chaos_inputs.py``), run as its own process
at the lowest CPU priority (the attacker stands for a client on another machine):

    python -m benchmarks.system.chaos_attack grpc_flood '{"address": "127.0.0.1:50052"}'
    python -m benchmarks.system.chaos_attack abort_storm '{"base": "http://127.0.0.1:8000", "model": "tiny"}'

prints what it did as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from benchmarks.system.chaos_hostile import HOSTILE


def _grpc_flood(address: str) -> dict[str, Any]:
    """32 unauthenticated 40 MiB ``Decode`` messages, 8 at a time (refused from their
    metadata, before they are read)."""
    import grpc

    from pdserve_api.v1 import pdserve_pb2, pdserve_pb2_grpc

    big = pdserve_pb2.DecodeRequest(request_id="flood", prompt_token_ids=[1],
                                    params=pdserve_pb2.SamplingParams(stop=["x" * (40 << 20)]))  # fmt: skip

    def send(_: int) -> str:
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as ch:
            try:
                for _chunk in pdserve_pb2_grpc.DecodeServiceStub(ch).Decode(big, timeout=60):
                    pass
            except grpc.RpcError as exc:
                return str(exc.code().name)
        return "OK"

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(send, range(32)))
    return {"messages": len(codes), "message_mib": 40, "codes": sorted(set(codes))}


async def _body_flood(base: str, model: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": "word " * 780} for _ in range(1000)]  # ~3.9 MiB
    body = {"model": model, "messages": messages, "max_tokens": 1}
    async with httpx.AsyncClient(timeout=120) as client:
        replies = await asyncio.gather(
            *(client.post(f"{base}/v1/chat/completions", json=body) for _ in range(8)),
            return_exceptions=True,
        )
    codes = sorted({r.status_code if isinstance(r, httpx.Response) else type(r).__name__ for r in replies})  # fmt: skip
    return {"bodies": 8, "messages_each": 1000, "codes": codes}


async def _abort_storm(base: str, model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": "Abort me", "max_tokens": 64, "stream": True,
            "ignore_eos": True}  # fmt: skip
    limits = httpx.Limits(max_connections=600)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def drop() -> int:
            async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    break  # hang up after the first chunk
                return r.status_code

        results = await asyncio.gather(*(drop() for _ in range(500)), return_exceptions=True)
    codes = sorted({r if isinstance(r, int) else type(r).__name__ for r in results}, key=str)
    return {"streams": 500, "codes": codes}


async def _grammar_bomb(base: str, model: str) -> dict[str, Any]:
    choices = [f"choice number {i} " + "z" * 40 for i in range(20_000)]
    body = {"model": model, "prompt": "Pick one:", "max_tokens": 4, "guided_choice": choices}
    async with httpx.AsyncClient(timeout=300) as client:
        t0 = time.monotonic()
        replies = await asyncio.gather(
            *(client.post(f"{base}/v1/completions", json=body) for _ in range(4)),
            return_exceptions=True,
        )
    codes = sorted({r.status_code if isinstance(r, httpx.Response) else type(r).__name__ for r in replies}, key=str)  # fmt: skip
    return {"requests": 4, "choices": len(choices), "codes": codes,
            "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip


ATTACKS = ("grpc_flood", "body_flood", "abort_storm", "grammar_bomb", *HOSTILE)


def main(argv: list[str]) -> int:
    fault, where = argv[0], json.loads(argv[1])
    if fault == "grpc_flood":
        done = _grpc_flood(where["address"])
    elif fault == "body_flood":
        done = asyncio.run(_body_flood(where["base"], where["model"]))
    elif fault == "abort_storm":
        done = asyncio.run(_abort_storm(where["base"], where["model"]))
    elif fault == "grammar_bomb":
        done = asyncio.run(_grammar_bomb(where["base"], where["model"]))
    elif fault in HOSTILE:
        done = asyncio.run(HOSTILE[fault](where["base"], where["model"]))
    else:
        print(f"unknown attack {fault!r}; one of {', '.join(ATTACKS)}", file=sys.stderr)
        return 2
    print(json.dumps(done))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
