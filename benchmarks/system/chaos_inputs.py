"""Input and supervision faults for ``benchmarks/system/chaos.py`` (issue 24, item 7), and the
unrelated stream whose worst stall each phase records.

- ``squat_decode``: SIGKILL ``decode-0`` and bind its gRPC port before the restart
  (``pdserve up`` must move it to new ports; the router follows the instances file);
- ``grpc_flood``: unauthenticated 40 MiB ``Decode`` messages to ``decode-0``, 8 at a time
  (refused UNAUTHENTICATED before they are read; its RSS must not grow);
- ``body_flood``: chat bodies just under the router's 4 MiB limit, 8 at once, with the
  most messages allowed (templated and tokenized off the event loop);
- ``abort_storm``: 500 streams opened and dropped right after their first chunk;
- ``grammar_bomb``: requests whose ``guided_choice`` has 20 000 long choices;
- issue #36's hostile clients (``chaos_hostile.py``): ``many_messages``,
  ``prefirst_storm``, ``deep_schema``, ``tokenize_flood``, ``remote_ref``.

The four request faults run in ``chaos_attack.py``, a child process at the lowest CPU
priority (the attacker stands for a client on another machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from typing import Any

import httpx

from benchmarks.system.chaos_attack import ATTACKS
from benchmarks.system.chaos_hostile import HOSTILE

INPUT_FAULTS = ("squat_decode", "grpc_flood", "body_flood", "abort_storm", "grammar_bomb", *HOSTILE)


class StallWatch:
    """Streams one long completion after another through the phase; ``worst_s`` is the
    longest gap between two chunks of one stream (the stall an unrelated client saw), and
    ``first_token_s`` each stream's time from its request to its first chunk."""

    def __init__(self, base: str, model: str) -> None:
        self.base, self.model = base, model
        self.worst_s = 0.0
        self.first_token_s: list[float] = []
        # The slowest first token's client-side seconds and the router's phase timings of
        # that request (``pdserve_timings``): where the wait was spent.
        self.slowest_first: dict[str, Any] = {}
        self.streams = 0
        self.failed = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> dict[str, Any]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        firsts = sorted(self.first_token_s)
        return {"worst_stall_s": round(self.worst_s, 3), "streams": self.streams,
                "failed": self.failed,
                "first_token_p50_s": round(firsts[len(firsts) // 2], 3) if firsts else None,
                "first_token_worst_s": round(firsts[-1], 3) if firsts else None,
                "slowest_first_token": self.slowest_first or None}  # fmt: skip

    async def _run(self) -> None:
        body = {"model": self.model, "prompt": "A long walk along the shore", "max_tokens": 64,
                "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}, "pdserve_timings": True}  # fmt: skip
        async with httpx.AsyncClient(timeout=120) as client:
            while True:
                try:
                    sent = time.monotonic()
                    first = None
                    async with client.stream("POST", f"{self.base}/v1/completions", json=body) as r:
                        last = None
                        async for line in r.aiter_lines():
                            now = time.monotonic()
                            if last is None:
                                first = now - sent
                                self.first_token_s.append(first)
                            else:
                                self.worst_s = max(self.worst_s, now - last)
                            last = now
                            if first is not None and '"pdserve_timings"' in line:
                                self._note_first(first, line)
                    self.streams += 1
                except httpx.HTTPError:
                    self.failed += 1
                    await asyncio.sleep(0.2)

    def _note_first(self, first_s: float, usage_line: str) -> None:
        if first_s < self.slowest_first.get("client_s", -1.0):
            return
        usage = json.loads(usage_line.removeprefix("data: ")).get("usage") or {}
        self.slowest_first = {"client_s": round(first_s, 3), "router": usage.get("pdserve_timings")}


def rss_mib(pid: int) -> float | None:
    try:
        for line in open(f"/proc/{pid}/status"):  # noqa: SIM115 - tiny read
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


async def inject_input(cluster: Any, fault: str, model: str, phase_end: float) -> dict[str, Any]:
    """Apply ``fault``; what it did (sizes, counts, codes) for the phase's record."""
    if fault == "squat_decode":
        return await _squat(cluster, phase_end)
    if fault == "grpc_flood":
        child = cluster.children()["decode-0"]
        pid = int(child["pid"])
        before = rss_mib(pid)
        done = await _attack(fault, address=child["address"])
        return {**done, "decode_rss_before_mib": before, "decode_rss_after_mib": rss_mib(pid)}
    if fault in ATTACKS:
        return await _attack(fault, base=cluster.base, model=model)
    raise ValueError(f"unknown input fault {fault!r}")


async def _attack(fault: str, timeout_s: float = 300.0, **where: str) -> dict[str, Any]:
    """Run one attack in a child process at the lowest CPU priority: the attacker stands
    for a client on another machine, so building 40 MiB messages or driving 500 streams
    must not take the two cores from the system under test (its own share of the work,
    receiving, parsing and refusing, stays); what it did, from its last output line."""
    proc = await asyncio.create_subprocess_exec(
        "nice", "-n", "19", sys.executable, "-m", "benchmarks.system.chaos_attack",
        fault, json.dumps(where),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return {"error": f"the attack did not end within {timeout_s:g} s"}
    lines = out.decode().strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"the attack exited {proc.returncode}"}
    return json.loads(lines[-1])  # type: ignore[no-any-return]


async def _squat(cluster: Any, phase_end: float) -> dict[str, Any]:
    child = cluster.children()["decode-0"]
    old = child["address"]
    os.kill(int(child["pid"]), signal.SIGKILL)
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + 10
    while True:
        try:
            holder.bind(("127.0.0.1", int(old.rsplit(":", 1)[1])))
            break
        except OSError:
            if time.monotonic() > deadline:
                holder.close()
                return {"squatted": False, "old": old}
            await asyncio.sleep(0.01)
    holder.listen()
    try:
        await asyncio.sleep(max(0.0, phase_end - time.monotonic() - 1))
    finally:
        holder.close()
    return {"squatted": True, "old": old, "new": cluster.children()["decode-0"].get("address")}
