"""The paths a benchmark request takes in ``benchmarks.system.system_overhead``: the in-process
engines in a worker process set up like a service's (``EngineWorker``; this module run with
``--engine-worker`` is that worker), the streaming HTTP client through a router, and
``pdserve up`` as a subprocess (``PdserveUp``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from benchmarks.system.system_overhead_report import Stream
from common.flags import memory_size

REPO = Path(__file__).resolve().parents[2]

READY = "pdserve is ready"
# What `pdserve up` gives each engine process; the in-process engines get the same.
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def build_model(out_dir: Path, vocab: int | None = None) -> Path:
    """The tests' tiny random Llama (``tests.model_fixtures.make_tiny_llama``: SmolLM2's
    vocabulary unless ``vocab``), built in a child process: the benchmark's process then
    holds no transformers model objects, like the services' processes."""
    overrides = {} if vocab is None else {"vocab_size": vocab}
    code = (
        "import json, sys; from tests.model_fixtures import make_tiny_llama; "
        "make_tiny_llama(sys.argv[1], **json.loads(sys.argv[2]))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run(
        [sys.executable, "-c", code, str(out_dir), json.dumps(overrides)], cwd=REPO, env=env,
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return out_dir


class RequestFailed(RuntimeError):
    """A request through the router did not complete as expected (message says why)."""


# -- in-process baseline -----------------------------------------------------------------
def engine_config(model_dir: Path, kv_cache_memory: str) -> Any:
    """The services' engine settings for the tiny model (defaults plus the KV budget)."""
    from engine.config import EngineConfig

    kv_bytes = memory_size(kv_cache_memory)
    if kv_bytes is None:
        raise ValueError("--kv-cache-memory must be a size such as 64Mi")
    return EngineConfig(model=str(model_dir), kv_cache_memory=kv_bytes)


def stream_sync(engine: Any, request_id: str, prompt: list[int], max_tokens: int) -> Stream:
    """The floor: the request on a bare ``LLMEngine`` stepped in this thread (no asyncio, no
    engine thread, no hand-offs); blocks the event loop, which is idle meanwhile."""
    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    times: list[float] = []
    parts: list[str] = []
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                times.append(time.perf_counter() - start)
                tokens += len(out.new_token_ids)
            parts.append(out.new_text)
    return Stream(times, tokens, "".join(parts))


async def stream_inprocess(
    engine: Any, request_id: str, prompt: list[int], max_tokens: int
) -> Stream:
    """One greedy request straight through ``engine.generate``, timed like the HTTP client."""
    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    times: list[float] = []
    parts: list[str] = []
    tokens = 0
    async for out in engine.generate(request_id, prompt, params):
        if out.new_token_ids:
            times.append(time.perf_counter() - start)
            tokens += len(out.new_token_ids)
        parts.append(out.new_text)
    return Stream(times, tokens, "".join(parts))


async def worker_main(model_dir: str, kv_cache_memory: str) -> None:
    """``--engine-worker``: hold both engines and serve requests from stdin, one JSON line
    each (``[path, request_id, prompt, max_tokens]``), answering ``RESULT <stream json>``."""
    from engine.async_engine import AsyncLLMEngine
    from engine.llm_engine import LLMEngine

    config = engine_config(Path(model_dir), kv_cache_memory)
    sync_engine, engine = LLMEngine(config), AsyncLLMEngine(config)
    await engine.start()
    print("READY", flush=True)  # the protocol with EngineWorker, not a report
    try:
        while line := await asyncio.to_thread(sys.stdin.readline):
            path, rid, prompt, max_tokens = json.loads(line)
            if path == "engine-sync":
                stream = stream_sync(sync_engine, rid, prompt, max_tokens)
            else:
                stream = await stream_inprocess(engine, rid, prompt, max_tokens)
            print("RESULT " + json.dumps(asdict(stream)), flush=True)
    finally:
        await engine.shutdown()


class EngineWorker:
    """The in-process engines in a child process of their own, set up like a service's
    (own session, 1 torch thread, the launcher's thread variables), so that the client's
    work never shares their process. Times are taken inside the child; the pipe is outside
    every measured interval."""

    def __init__(self, model_dir: Path, kv_cache_memory: str, timeout_s: float) -> None:
        self.argv = [sys.executable, "-m", "benchmarks.system.system_overhead_paths"]
        self.argv += ["--engine-worker"]
        self.argv += [str(model_dir), kv_cache_memory]
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()

    def __enter__(self) -> EngineWorker:
        env = os.environ | ENGINE_ENV | {"PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            cwd=REPO, start_new_session=True,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self._expect("READY", self.timeout_s)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # EOF: the worker exited

    def _expect(self, prefix: str, timeout_s: float) -> str:
        """The next stdout line starting with ``prefix`` (RuntimeError on exit or timeout)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError("the engine worker exited early (its stderr is above)")
            if line.startswith(prefix):
                return line[len(prefix) :]
        raise RuntimeError(f"engine worker: no {prefix!r} line within {timeout_s:.0f} s")

    async def run(self, path: str, request_id: str, prompt: list[int], max_tokens: int) -> Stream:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([path, request_id, prompt, max_tokens]) + "\n")
        self.proc.stdin.flush()
        return Stream(**json.loads(await asyncio.to_thread(self._expect, "RESULT ", 60.0)))

    def __exit__(self, *_: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # EOF: the worker shuts its engine down and exits
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


# -- the HTTP client -----------------------------------------------------------------------
def request_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Streamed greedy completion of token ids with usage and the router's phase timings."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "pdserve_timings": True,
    }


async def stream_http(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout_s: float
) -> Stream:
    """One streamed request; RequestFailed unless it ends in usage + ``[DONE]`` with exactly
    ``max_tokens`` tokens in at most that many chunks (a loaded server merges the tokens
    of a stream that fell behind into one chunk: docs/design.md §3 "Output streams")."""
    return await asyncio.wait_for(_stream_http(client, url, body), timeout_s)


async def _stream_http(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Stream:
    start = time.perf_counter()
    times: list[float] = []
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    done = False
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RequestFailed(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            obj = json.loads(payload)
            if "error" in obj:
                raise RequestFailed(f"error event: {obj['error']}")
            if obj.get("choices"):  # one chunk per step (or merged steps), even with empty text
                times.append(time.perf_counter() - start)
                parts.append(obj["choices"][0].get("text") or "")
            if isinstance(obj.get("usage"), dict):
                usage = obj["usage"]
    if not done or usage is None:
        raise RequestFailed("stream ended without its usage chunk and [DONE]")
    tokens = usage.get("completion_tokens")
    if tokens != body["max_tokens"] or not 1 <= len(times) <= tokens:
        raise RequestFailed(
            f"{tokens} tokens in usage, {len(times)} chunks, wanted {body['max_tokens']}"
        )
    return Stream(times, tokens, "".join(parts), usage.get("pdserve_timings"))


# -- pdserve up as a subprocess ------------------------------------------------------------
class PdserveUp:
    """``pdserve up`` in its own process group: started on enter (returns once it printed
    ``pdserve is ready``, or raises within ``timeout_s``), SIGTERM to the group on exit."""

    def __init__(
        self,
        argv: list[str],
        timeout_s: float,
        env: dict[str, str] | None = None,
        cwd: Path = REPO,
    ) -> None:
        """``env``: added to this process's environment; ``cwd``: where it runs."""
        self.argv, self.timeout_s, self.env, self.cwd = argv, timeout_s, env or {}, cwd
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.proc: subprocess.Popen[str] | None = None
        self.startup_s = 0.0

    @property
    def port(self) -> int:
        return int(self.argv[self.argv.index("--port") + 1])

    def __enter__(self) -> PdserveUp:
        start = time.perf_counter()
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=env, start_new_session=True, cwd=self.cwd,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                tail = "\n".join(self.lines[-30:])
                raise RuntimeError(f"pdserve up did not become ready:\n{tail}")
        self.startup_s = time.perf_counter() - start
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:  # keeps draining the pipe after "ready"
            self.lines.append(line.rstrip())
            if READY in line:
                self.ready.set()

    def __exit__(self, *_: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # the launcher stops its children
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def up_argv(mode: str, model_dir: Path, port: int, args: Any) -> list[str]:
    prefill = "1" if mode == "disaggregated" else "0"
    return [
        *[sys.executable, "-m", "pdserve", "up", "--model", str(model_dir), "--mode", mode],
        *["--prefill", prefill, "--decode", "1", "--port", str(port), "--torch-threads", "1"],
        *["--kv-cache-memory", args.kv_cache_memory, "--shutdown-grace", "10"],
    ]


def _worker_entry(model_dir: str, kv_cache_memory: str) -> int:
    logging.basicConfig(level=logging.WARNING)  # stderr; stdout carries the protocol
    import torch

    torch.set_num_threads(1)  # what `pdserve up --torch-threads 1` gives each service
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    asyncio.run(worker_main(model_dir, kv_cache_memory))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["--engine-worker"]:
        sys.exit(
            "usage: python -m benchmarks.system.system_overhead_paths --engine-worker "
            "MODEL_DIR KV_CACHE_MEMORY"
        )
    sys.exit(_worker_entry(*sys.argv[2:4]))
