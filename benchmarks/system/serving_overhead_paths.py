"""The paths ``benchmarks.system.serving_overhead`` drives N concurrent fixed-length streams
through, and what it records of each stream.

- ``engine`` / ``async``: a bare ``LLMEngine`` stepped in a loop, and ``AsyncLLMEngine`` with
  one asyncio consumer per request, in a worker process set up like a service's (1 torch
  thread); this module run with ``--engine-worker`` is that worker (one JSON line out).
- ``service``: a real ``python -m service decode`` process, N ``Decode`` streams over gRPC.
- ``router``: ``pdserve up --mode colocated``, N streamed completions over HTTP (SSE).

Each stream is recorded as (arrival time, tokens) per message, so that several tokens
merged into one message still count as tokens, at the time they arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# Re-exported for serving_overhead (the readings it takes around each path).
from benchmarks.system.process_cpu import cpu_by_role as cpu_by_role
from benchmarks.system.process_cpu import cpu_per_token as cpu_per_token
from benchmarks.system.process_cpu import process_tree as process_tree

REPO = Path(__file__).resolve().parents[2]
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(slots=True)
class StreamRecord:
    """One request's messages: seconds since the batch started, and tokens in each."""

    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def add(self, t: float, n: int) -> None:
        if n:
            self.times.append(t)
            self.tokens.append(n)

    @property
    def total(self) -> int:
        return sum(self.tokens)

    def tpot(self) -> float | None:
        """(last − first message) / (tokens after the first message's)."""
        after_first = self.total - (self.tokens[0] if self.tokens else 0)
        if after_first < 1:
            return None
        return (self.times[-1] - self.times[0]) / after_first


def prompts_for(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(n)]


def summarize(records: list[StreamRecord], wall: float, want: int) -> dict[str, Any]:
    """The batch's per-token time (median TPOT), decode tok/s (streams / that time), output
    tok/s over the wall time, and how many tokens rode in each message."""
    tpots = sorted(t for t in (r.tpot() for r in records) if t is not None)
    complete = sum(r.total == want for r in records)
    messages = sum(len(r.tokens) for r in records)
    tokens = sum(r.total for r in records)
    p50 = tpots[len(tpots) // 2] if tpots else float("nan")
    p90 = tpots[min(len(tpots) - 1, int(len(tpots) * 0.9))] if tpots else float("nan")
    return {
        "streams": len(records),
        "complete": complete,
        "tpot_p50_ms": p50 * 1e3,
        "tpot_p90_ms": p90 * 1e3,
        "decode_tok_s": len(records) / p50 if tpots else 0.0,
        "output_tok_s": tokens / wall if wall else 0.0,
        "wall_s": wall,
        "tokens_per_message": tokens / messages if messages else 0.0,
    }


# -- CPU time per token (robust to a busy machine, unlike wall times) ----------------------
# -- the engine worker (in-process baselines) ---------------------------------------------
def _engine_sync(engine: Any, prompts: list[list[int]], output_len: int, tag: str) -> Any:
    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    recs = {f"{tag}-{i}": StreamRecord() for i in range(len(prompts))}
    start = time.perf_counter()
    for (rid, _), prompt in zip(recs.items(), prompts, strict=True):
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            recs[out.request_id].add(time.perf_counter() - start, len(out.new_token_ids))
    return list(recs.values()), time.perf_counter() - start


async def _engine_async(engine: Any, prompts: list[list[int]], output_len: int, tag: str) -> Any:
    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()

    async def one(i: int, prompt: list[int]) -> StreamRecord:
        rec = StreamRecord()
        async for out in engine.generate(f"{tag}-{i}", prompt, params):
            rec.add(time.perf_counter() - start, len(out.new_token_ids))
        return rec

    recs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return list(recs), time.perf_counter() - start


async def _worker(model_dir: str, spec: dict[str, Any]) -> dict[str, Any]:
    from engine.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=model_dir, kv_cache_memory=spec["kv_bytes"], max_num_seqs=spec["max_num_seqs"]
    )
    n, out_len = spec["streams"], spec["output_len"]
    prompts = prompts_for(n, spec["prompt_len"], spec["vocab"], spec["seed"])
    result: dict[str, Any] = {}
    sync = LLMEngine(config)
    totals = time_steps(sync)
    _engine_sync(sync, prompts, 4, "warm")
    before, cpu = dict(totals), time.process_time()
    recs, wall = _engine_sync(sync, prompts, out_len, "run")
    cpu = (time.process_time() - cpu) / (n * out_len) * 1e6
    result["engine"] = summarize(recs, wall, out_len) | step_delta(before, totals)
    result["engine"]["cpu_us_per_token_service"] = cpu
    sync.shutdown()
    engine = AsyncLLMEngine(config)
    totals = time_steps(engine.engine)
    await engine.start()
    try:
        await _engine_async(engine, prompts, 4, "warm")
        before, cpu = dict(totals), time.process_time()
        recs, wall = await _engine_async(engine, prompts, out_len, "run")
        cpu = (time.process_time() - cpu) / (n * out_len) * 1e6
        result["async"] = summarize(recs, wall, out_len) | step_delta(before, totals)
        result["async"]["cpu_us_per_token_service"] = cpu
    finally:
        await engine.shutdown()
    return result


def run_engine_worker(tree: Path, model_dir: Path, spec: dict[str, Any], timeout: float) -> Any:
    """The in-process baselines in a fresh worker importing ``tree``; their summaries."""
    env = dict(os.environ, **ENGINE_ENV, PYTHONPATH=str(tree))
    argv = [sys.executable, "-m", "benchmarks.system.serving_overhead_paths", "--engine-worker"]
    proc = subprocess.run(
        [*argv, str(model_dir), json.dumps(spec)], cwd=tree, env=env, capture_output=True,
        text=True, timeout=timeout, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"engine worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- a real service process over gRPC ------------------------------------------------------
class ServiceProc:
    """``python -m service decode`` importing ``tree``; ready once ``GetLoad`` answers."""

    def __init__(self, tree: Path, argv: list[str], port: int, log: Path) -> None:
        self.tree, self.argv, self.port, self.log = tree, argv, port, log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float) -> ServiceProc:
        env = dict(os.environ, **ENGINE_ENV, PYTHONPATH=str(self.tree))
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv, cwd=self.tree, env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        asyncio.run(self._wait_ready(timeout))
        return self

    async def _wait_ready(self, timeout: float) -> None:
        import grpc.aio

        from pdserve_api.v1 import pdserve_pb2 as pb
        from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                break
            async with grpc.aio.insecure_channel(self.address) as ch:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await pb_grpc.DecodeServiceStub(ch).GetLoad(pb.GetLoadRequest(), timeout=2)
                    return
            await asyncio.sleep(0.5)
        self.stop()
        raise RuntimeError(f"service did not start:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


async def grpc_batch(
    address: str, prompts: list[list[int]], output_len: int, timeout: float
) -> tuple[list[StreamRecord], float]:
    """N concurrent ``Decode`` streams on one channel (as the router holds one per instance)."""
    import grpc.aio

    from pdserve_api.v1 import pdserve_pb2 as pb
    from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc

    params = pb.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        start = time.perf_counter()

        async def one(prompt: list[int]) -> StreamRecord:
            rec = StreamRecord()
            call = stub.Decode(pb.DecodeRequest(prompt_token_ids=prompt, params=params))
            async for chunk in call:
                rec.add(time.perf_counter() - start, len(chunk.token_ids))
            return rec

        recs = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout)
        return list(recs), time.perf_counter() - start


# -- the router over HTTP --------------------------------------------------------------------
async def http_batch(
    url: str, model: str, prompts: list[list[int]], output_len: int, timeout: float
) -> tuple[list[StreamRecord], float]:
    """N concurrent streamed completions. A chunk's tokens are the growth of its
    ``continuous_usage_stats`` count, so that a chunk carrying several tokens counts them all."""
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()

        async def one(prompt: list[int]) -> StreamRecord:
            body = {
                "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }  # fmt: skip
            rec, seen = StreamRecord(), 0
            async with client.stream("POST", url, json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line.endswith("[DONE]"):
                        continue
                    obj = json.loads(line[5:])
                    if obj.get("choices") and obj.get("usage"):
                        done = obj["usage"]["completion_tokens"]
                        rec.add(time.perf_counter() - start, done - seen)
                        seen = done
            return rec

        recs = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout)
        return list(recs), time.perf_counter() - start


# -- step timing inside a service process ------------------------------------------------
def time_steps(owner: Any) -> dict[str, float]:
    """Wrap ``owner.step`` (a class or an engine) to add up steps, their wall time and the
    calling thread's CPU time in them; returns the running totals."""
    totals = {"steps": 0, "wall_s": 0.0, "cpu_s": 0.0}
    step = owner.step

    def timed(*args: Any) -> Any:
        w, c = time.perf_counter(), time.thread_time()
        try:
            return step(*args)
        finally:
            totals["steps"] += 1
            totals["wall_s"] += time.perf_counter() - w
            totals["cpu_s"] += time.thread_time() - c

    owner.step = timed
    return totals


def step_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-step wall and CPU ms between two readings of ``time_steps`` totals."""
    steps = after["steps"] - before["steps"]
    if steps <= 0:
        return {"steps": 0}
    wall = (after["wall_s"] - before["wall_s"]) / steps
    cpu = (after["cpu_s"] - before["cpu_s"]) / steps
    return {"steps": steps, "step_wall_ms": wall * 1e3, "step_cpu_ms": cpu * 1e3,
            "step_wait_ms": (wall - cpu) * 1e3}  # fmt: skip


def _timed_service(stats_file: str, argv: list[str]) -> int:
    """Run ``python -m service`` with ``LLMEngine.step`` timed (wall and the engine thread's
    CPU time; their gap is time the thread was runnable but not running: waiting for the
    GIL, or for a core on a busy machine), written to ``stats_file`` every 0.2 s."""
    import threading

    from engine.llm_engine import LLMEngine
    from service.roles import main

    totals = time_steps(LLMEngine)

    def dump() -> None:
        while True:
            time.sleep(0.2)
            tmp = stats_file + ".tmp"
            Path(tmp).write_text(json.dumps(totals))
            os.replace(tmp, stats_file)

    threading.Thread(target=dump, daemon=True).start()
    sys.argv = ["service", *argv]
    return int(main() or 0)


def read_step_stats(path: Path) -> dict[str, float]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {"steps": 0, "wall_s": 0.0, "cpu_s": 0.0}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--timed-service"]:
        sys.exit(_timed_service(sys.argv[2], sys.argv[3:]))
    if sys.argv[1:2] != ["--engine-worker"]:
        sys.exit(
            "usage: python -m benchmarks.system.serving_overhead_paths --engine-worker DIR SPEC"
        )
    import torch

    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    print(json.dumps(asyncio.run(_worker(sys.argv[2], json.loads(sys.argv[3])))))
