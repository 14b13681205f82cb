"""System overhead: what the P/D path adds over calling the engine in-process.

    .venv/bin/python benchmarks/system_overhead.py      # ~2-3 min; writes system_overhead.md/.json here

With a tiny random Llama (compute is negligible, so what remains is our overhead), in one
run: the same seeded 64-token prompts, greedy, 32 output tokens, EOS ignored, one request at
a time, streamed and timed, through
1. ``AsyncLLMEngine`` driven in-process (the baseline) and a bare ``LLMEngine`` stepped in a
   loop (the floor), both in a worker process set up like a service's (own session, 1 torch
   thread), timed inside it;
2. ``pdserve up --prefill 1 --decode 1`` (fs connector), with a streaming HTTP client;
3. ``pdserve up --mode colocated --prefill 0 --decode 1`` (the router without a prefill hop).
Each prompt goes through every path back to back, the order rotating, so that all paths see
the same load on a shared machine. Then, through each router, a closed-loop sweep of
concurrent streams (short outputs) for the best completed requests/s with zero errors.
TTFT = call → first token-bearing output; ITL = gap between successive token-bearing
outputs; TPOT = per request (last − first) / (n − 1). ``--quick`` is a smoke run for tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import queue
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdserve.bench.metrics import itls_from_chunk_times, percentile, stats_ms  # noqa: E402
from pdserve.bench.offline import random_prompts  # noqa: E402
from pdserve.settings import memory_size  # noqa: E402

logger = logging.getLogger("system_overhead")
HERE = Path(__file__).resolve().parent
READY = "pdserve is ready"
VOCAB = 49152  # the tiny model uses SmolLM2's tokenizer


class RequestFailed(RuntimeError):
    """A request through the router did not complete as expected (message says why)."""


@dataclass(slots=True)
class Stream:
    """One streamed request as its client saw it (times in seconds from the call)."""

    token_times: list[float]
    tokens: int
    text: str
    timings: dict[str, float] | None = None


# -- pure helpers: summaries, overhead arithmetic, the report ---------------------------------
BURST_GAP_S = 0.0002  # gaps shorter than this: tokens that arrived in one burst


def latency_summary(streams: list[Stream]) -> dict[str, Any]:
    """Latency statistics (ms) of ``streams``: ``ttft_ms``; ``itl_ms`` over every gap;
    ``first_gap_ms`` (token 1 → 2: in P/D the prefill → decode hand-off); ``steady_itl_ms``
    (the gaps after it); ``tpot_ms``, each request's mean gap (last − first) / (n − 1), which
    bursty delivery cannot hide; ``e2e_ms`` (call → last token); and ``burst_fraction``, the
    share of gaps under 0.2 ms. ValueError on no streams or a stream without tokens."""
    if not streams or any(not s.token_times for s in streams):
        raise ValueError("every stream needs at least one token")
    gaps = [itls_from_chunk_times(s.token_times) for s in streams]
    every = [g for gs in gaps for g in gs]

    def stats(values: list[float]) -> dict[str, Any] | None:
        st = stats_ms(values)
        return None if st is None else asdict(st)

    return {
        "requests": len(streams),
        "tokens": sum(s.tokens for s in streams),
        "ttft_ms": stats([s.token_times[0] for s in streams]),
        "itl_ms": stats(every),
        "first_gap_ms": stats([gs[0] for gs in gaps if gs]),
        "steady_itl_ms": stats([g for gs in gaps for g in gs[1:]]),
        "tpot_ms": stats([sum(gs) / len(gs) for gs in gaps if gs]),
        "e2e_ms": stats([s.token_times[-1] for s in streams]),
        "burst_fraction": sum(g < BURST_GAP_S for g in every) / len(every) if every else 0.0,
    }


def overhead(
    base: dict[str, Any], other: dict[str, Any], ttft_target_ms: float, itl_target_ms: float
) -> dict[str, Any]:
    """``other`` minus ``base`` (two ``latency_summary`` results): ``added_{m}_{q}_ms`` and
    ``{m}_{q}_ratio`` (other / base) for m in ttft, itl, tpot, e2e and q in p50, p99. The
    TTFT target holds when the added TTFT p50 is within it; the ITL target when both the
    added ITL p50 and the added TPOT p50 are (a bursty stream has a near-zero median gap
    but not a smaller mean one)."""
    out: dict[str, Any] = {}
    for name in ("ttft", "itl", "tpot", "e2e"):
        for q in ("p50", "p99"):
            b, o = base[f"{name}_ms"][q], other[f"{name}_ms"][q]
            out[f"added_{name}_{q}_ms"] = o - b
            out[f"{name}_{q}_ratio"] = o / b if b > 0 else None
    out["ttft_target_met"] = out["added_ttft_p50_ms"] <= ttft_target_ms
    out["itl_target_met"] = max(out["added_itl_p50_ms"], out["added_tpot_p50_ms"]) <= itl_target_ms
    return out


def paired_added(base: list[Stream], other: list[Stream]) -> dict[str, float]:
    """Median over requests of (other − base) for the same prompt, in ms: TTFT, TPOT, e2e.
    Pairs requests that ran back to back, so it is less exposed to load drift than a
    difference of medians. ValueError when the lists differ in length or are empty."""
    if not base or len(base) != len(other):
        raise ValueError(f"need equally many streams, got {len(base)} and {len(other)}")

    def tpot(s: Stream) -> float:
        n = len(s.token_times)
        return (s.token_times[-1] - s.token_times[0]) / (n - 1) if n > 1 else 0.0

    metrics = {"ttft": lambda s: s.token_times[0], "tpot": tpot, "e2e": lambda s: s.token_times[-1]}
    return {
        name: percentile([f(o) - f(b) for b, o in zip(base, other, strict=True)], 50) * 1e3
        for name, f in metrics.items()
    }


def phase_medians(streams: list[Stream]) -> dict[str, float]:
    """Median (ms) of each router phase timing, plus ``outside_router`` = client TTFT minus
    the router's own TTFT (HTTP, SSE framing, the client). Empty without timings."""
    timed = [s for s in streams if s.timings]
    if not timed:
        return {}
    keys = list(dict.fromkeys(k for s in timed for k in s.timings or {}))  # router's order
    out = {k: percentile([(s.timings or {}).get(k, 0.0) for s in timed], 50) * 1e3 for k in keys}
    outside = [s.token_times[0] - t["ttft"] for s in timed if "ttft" in (t := s.timings or {})]
    if outside:
        out["outside_router"] = percentile(outside, 50) * 1e3
    return out


def _f(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _p(summary: dict[str, Any], key: str, q: str) -> float | None:
    stats = summary.get(key)
    return None if stats is None else float(stats[q])


LOW_LOAD_COLUMNS = (
    ("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"), ("ITL p50", "itl_ms", "p50"),
    ("ITL p99", "itl_ms", "p99"), ("token 1→2 p50", "first_gap_ms", "p50"),
    ("TPOT p50", "tpot_ms", "p50"), ("e2e p50", "e2e_ms", "p50"),
)  # fmt: skip
ADDED_ROWS = (
    ("added TTFT p50 (target ≤ {ttft:g})", "added_ttft_p50_ms", ""), ("TTFT p50 ratio", "ttft_p50_ratio", "×"),
    ("added ITL p50 (target ≤ {itl:g})", "added_itl_p50_ms", ""), ("ITL p50 ratio", "itl_p50_ratio", "×"),
    ("added TPOT p50", "added_tpot_p50_ms", ""), ("TPOT p50 ratio", "tpot_p50_ratio", "×"),
    ("added TTFT p99", "added_ttft_p99_ms", ""), ("added ITL p99", "added_itl_p99_ms", ""),
    ("added e2e p50", "added_e2e_p50_ms", ""),
)  # fmt: skip


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def render_markdown(result: dict[str, Any]) -> str:
    """The report as markdown tables (a hand-written reading may be appended to the file)."""
    host, work, systems = result["host"], result["workload"], result["systems"]
    load = "/".join(
        f"{host[k][0]:.1f}" for k in ("loadavg_start", "loadavg_systems_ready", "loadavg_end")
    )
    lines = [
        "# System overhead: the P/D path vs the engine in-process",
        "",
        f"Tiny random Llama (2 layers, hidden 64); {work['requests']} requests one at a time "
        f"after {work['warmup']} warm-ups; {work['prompt_len']}-token random prompts, "
        f"{work['output_len']} output tokens, greedy, EOS ignored, streamed; 1 torch thread per "
        "engine process. In-process = `AsyncLLMEngine` driven directly (the baseline); "
        '"engine alone" = a bare `LLMEngine` stepped in a loop (the floor); both run in a '
        "worker process set up like a service's and are timed inside it. Each "
        "prompt goes through every path back to back (order rotating), so all paths share the "
        "same load. TPOT = per request (last − first token) / (n − 1). Times in ms.",
        "",
        f"Host: {host['cpu_count']} cores shared with other engineers' test runs; 1-min load "
        f"average {load} (start / systems ready / end). Whole run: {result['wall_s']:.0f} s.",
        "",
        "    " + result["command"],
        "",
        "## Low load",
        "",
        _row(["path", *(c[0] for c in LOW_LOAD_COLUMNS), "gaps < 0.2 ms"]),
        "|---|" + "---:|" * (len(LOW_LOAD_COLUMNS) + 1),
    ]
    rows = [
        ("engine alone, sync steps", result["engine_sync"]),
        ("in-process", result["inprocess"]),
    ]
    rows += [(m, s["low_load"]) for m, s in systems.items()]
    for name, summ in rows:
        cells = [_f(_p(summ, key, q)) for _, key, q in LOW_LOAD_COLUMNS]
        lines.append(_row([name, *cells, f"{summ['burst_fraction']:.0%}"]))
    t = result["targets"]
    fmt = {"ttft": t["added_ttft_p50_ms"], "itl": t["added_itl_p50_ms"]}
    lines += ["", "## Added over in-process", "", _row(["", *systems])]
    lines.append("|---|" + "---:|" * len(systems))
    for label, key, unit in ADDED_ROWS:
        cells = [_f(s["overhead"][key]) + unit for s in systems.values()]
        lines.append(_row([label.format(**fmt), *cells]))
    for name in ("ttft", "tpot", "e2e"):
        cells = [_f(s["paired_added_ms"][name]) for s in systems.values()]
        lines.append(
            _row([f"added {name.upper() if name != 'e2e' else name}, median of pairs", *cells])
        )
    verdict = {True: "met", False: "missed"}
    for label, key in (
        ("TTFT target", "ttft_target_met"),
        ("ITL target (ITL and TPOT)", "itl_target_met"),
    ):
        lines.append(_row([label, *(verdict[s["overhead"][key]] for s in systems.values())]))
    same = [
        f"{s['outputs_equal_to_inprocess']}/{s['low_load']['requests']}" for s in systems.values()
    ]
    lines.append(_row(["greedy text = in-process", *same]))
    lines += _phase_table(systems) + _sweep_table(systems, work)
    return "\n".join(lines) + "\n"


def _phase_table(systems: dict[str, Any]) -> list[str]:
    phases = list(dict.fromkeys(k for s in systems.values() for k in s["phases_ms"]))
    if not phases:
        return []
    out = ["", "## The router's own timings (`pdserve_timings`, medians, ms)", ""]
    out += [_row(["phase", *systems]), "|---|" + "---:|" * len(systems)]
    for ph in phases:
        out.append(_row([ph, *(_f(s["phases_ms"].get(ph)) for s in systems.values())]))
    return out


def _sweep_table(systems: dict[str, Any], work: dict[str, Any]) -> list[str]:
    out = ["", f"## Requests/s, closed loop ({work['sweep_output_len']} output tokens each)", ""]
    out += [_row(["path", "streams", "requests", "errors", "req/s", "output tok/s", "TTFT p50"])]
    out += ["|---|" + "---:|" * 6]
    for mode, s in systems.items():
        for lv in s["sweep"]:
            cells = [lv["concurrency"], lv["requests"], sum(lv["errors"].values())]
            cells += [_f(lv["req_per_s"], 1), _f(lv["output_tok_per_s"], 0), _f(lv["ttft_p50_ms"])]
            out.append(_row([mode, *map(str, cells)]))
    out.append("")
    for mode, s in systems.items():
        best = _f(s["max_sustained_req_s"], 1)
        out.append(f"- {mode}: best {best} req/s with zero errors; `{s['command']}` was ready "
                   f"after {s['startup_s']:.0f} s")  # fmt: skip
    return out


# -- in-process baseline -----------------------------------------------------------------
def engine_config(model_dir: Path, kv_cache_memory: str) -> Any:
    """The services' engine settings for the tiny model (defaults plus the KV budget)."""
    from engine.config import EngineConfig

    kv_bytes = memory_size(kv_cache_memory)
    if kv_bytes is None:
        raise ValueError("--kv-cache-memory must be a size such as 64M")
    return EngineConfig(model=str(model_dir), kv_cache_memory=kv_bytes)


def stream_sync(engine: Any, request_id: str, prompt: list[int], max_tokens: int) -> Stream:
    """The floor: the request on a bare ``LLMEngine`` stepped in this thread (no asyncio, no
    engine thread, no hand-offs); blocks the event loop, which is idle meanwhile."""
    from engine.sampling_params import SamplingParams

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
    from engine.sampling_params import SamplingParams

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
        self.argv = [sys.executable, str(Path(__file__).resolve()), "--engine-worker"]
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
    """One streamed request; RequestFailed unless it ends in usage + ``[DONE]`` with one
    chunk per generated token and exactly ``max_tokens`` tokens."""
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
            if obj.get("choices"):  # every decode step is one chunk, even with empty text
                times.append(time.perf_counter() - start)
                parts.append(obj["choices"][0].get("text") or "")
            if isinstance(obj.get("usage"), dict):
                usage = obj["usage"]
    if not done or usage is None:
        raise RequestFailed("stream ended without its usage chunk and [DONE]")
    tokens = usage.get("completion_tokens")
    if tokens != body["max_tokens"] or tokens != len(times):
        raise RequestFailed(
            f"{tokens} tokens in usage, {len(times)} chunks, wanted {body['max_tokens']}"
        )
    return Stream(times, tokens, "".join(parts), usage.get("pdserve_timings"))


async def interleaved(
    worker: EngineWorker,
    client: httpx.AsyncClient,
    urls: dict[str, str],
    model: str,
    prompts: list[list[int]],
    args: Any,
) -> tuple[dict[str, list[Stream]], dict[str, list[float]]]:
    """Each prompt once through every path, one request at a time, the paths' order rotating
    per prompt, so that all paths see the same (shifting) load on this shared machine; after
    each router request, one ``GET /v1/models`` round trip (seconds; the HTTP floor). The
    first ``args.warmup`` prompts are not kept. Any failed request aborts the run."""
    paths = ["engine-sync", "in-process", *urls]
    streams: dict[str, list[Stream]] = {p: [] for p in paths}
    floors: dict[str, list[float]] = {p: [] for p in urls}
    for i, prompt in enumerate(prompts):
        for path in paths[i % len(paths) :] + paths[: i % len(paths)]:
            if path in ("engine-sync", "in-process"):
                s = await worker.run(path, f"{path}-{i}", prompt, args.output_len)
            else:
                body = request_body(model, prompt, args.output_len)
                s = await stream_http(client, urls[path], body, args.request_timeout)
                start = time.perf_counter()
                (await client.get(urls[path].replace("/completions", "/models"))).raise_for_status()
                floors[path].append(time.perf_counter() - start)
            streams[path].append(s)
    keep = args.warmup
    return {p: v[keep:] for p, v in streams.items()}, {p: v[keep:] for p, v in floors.items()}


async def closed_loop(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompts: list[list[int]],
    concurrency: int,
    args: Any,
) -> dict[str, Any]:
    """``concurrency`` streams, each sending its next request when the last one ends, until
    ``len(prompts)`` were sent; completed req/s over the wall time of the whole batch."""
    todo = list(reversed(prompts))
    ttfts: list[float] = []
    errors: dict[str, int] = {}

    async def worker() -> None:
        while todo:
            body = request_body(model, todo.pop(), args.sweep_output_len)
            try:
                ttfts.append(
                    (await stream_http(client, url, body, args.request_timeout)).token_times[0]
                )
            except (RequestFailed, httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:
                kind = type(exc).__name__
                errors[kind] = errors.get(kind, 0) + 1
                logger.warning("request failed at concurrency %d: %s %s", concurrency, kind, exc)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "completed": len(ttfts),
        "errors": errors,
        "wall_s": wall,
        "req_per_s": len(ttfts) / wall,
        "output_tok_per_s": len(ttfts) * args.sweep_output_len / wall,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3 if ttfts else None,
    }


# -- pdserve up as a subprocess ------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PdserveUp:
    """``pdserve up`` in its own process group: started on enter (returns once it printed
    ``pdserve is ready``, or raises within ``timeout_s``), SIGTERM to the group on exit."""

    def __init__(self, argv: list[str], timeout_s: float) -> None:
        self.argv, self.timeout_s = argv, timeout_s
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.proc: subprocess.Popen[str] | None = None
        self.startup_s = 0.0

    @property
    def port(self) -> int:
        return int(self.argv[self.argv.index("--port") + 1])

    def __enter__(self) -> PdserveUp:
        start = time.perf_counter()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=env, start_new_session=True, cwd=REPO,
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


async def measure(
    model_dir: Path,
    ups: dict[str, PdserveUp],
    prompts: list[list[int]],
    sweep_prompts: list[list[int]],
    args: Any,
) -> tuple[dict[str, list[Stream]], dict[str, list[float]], dict[str, list[dict[str, Any]]]]:
    """The interleaved low-load series (streams, HTTP floors), then each system's sweep."""
    urls = {m: f"http://127.0.0.1:{up.port}/v1/completions" for m, up in ups.items()}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    with EngineWorker(model_dir, args.kv_cache_memory, args.startup_timeout) as worker:
        async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
            streams, floors = await interleaved(worker, client, urls, str(model_dir), prompts, args)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        sweeps: dict[str, list[dict[str, Any]]] = {m: [] for m in urls}
        for mode, url in urls.items():
            for c in args.concurrency:
                batch = sweep_prompts[: max(args.sweep_requests_per_stream * c, args.sweep_min)]
                sweeps[mode].append(await closed_loop(client, url, str(model_dir), batch, c, args))
                logger.info("%s, %d streams: %.1f req/s", mode, c, sweeps[mode][-1]["req_per_s"])
    return streams, floors, sweeps


def system_result(
    up: PdserveUp,
    streams: list[Stream],
    base: list[Stream],
    floor: list[float],
    sweep: list[dict[str, Any]],
    model_dir: Path,
) -> dict[str, Any]:
    """One system's entry in the JSON: low-load summary, overhead, phases, sweep."""
    base_summary, low = latency_summary(base), latency_summary(streams)
    clean = [s["req_per_s"] for s in sweep if not s["errors"] and s["completed"] == s["requests"]]
    return {
        "command": shlex.join(["pdserve", *up.argv[3:]]).replace(str(model_dir), "TINY_LLAMA_DIR"),
        "startup_s": up.startup_s,
        "low_load": low,
        "overhead": overhead(base_summary, low, TARGET_TTFT_MS, TARGET_ITL_MS),
        "paired_added_ms": paired_added(base, streams),
        "phases_ms": phase_medians(streams) | {"http_get_models": percentile(floor, 50) * 1e3},
        "outputs_equal_to_inprocess": sum(
            a.text == b.text for a, b in zip(base, streams, strict=True)
        ),
        "sweep": sweep,
        "max_sustained_req_s": max(clean) if clean else None,
    }


# -- main ------------------------------------------------------------------------------------
# What `pdserve up` gives each engine process; the in-process engines get the same.
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def build_model(out_dir: Path) -> Path:
    """The tiny Llama, built in a child process: this one then holds no transformers model
    objects, like the services' processes."""
    code = (
        "import sys; from tests.model_fixtures import make_tiny_llama; make_tiny_llama(sys.argv[1])"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run(
        [sys.executable, "-c", code, str(out_dir)], cwd=REPO, env=env, check=True,
        capture_output=True, timeout=300,
    )  # fmt: skip
    return out_dir


async def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start, loadavg_start = time.perf_counter(), os.getloadavg()
    prompts = random_prompts(args.warmup + args.requests, args.prompt_len, VOCAB, seed=args.seed)
    sweep_n = max(args.sweep_requests_per_stream * max(args.concurrency), args.sweep_min)
    sweep_prompts = random_prompts(sweep_n, args.prompt_len, VOCAB, seed=args.seed + 1)
    with tempfile.TemporaryDirectory(prefix="system-overhead-") as tmp, ExitStack() as stack:
        model_dir = build_model(Path(tmp) / "tiny-llama")
        ups = {
            m: stack.enter_context(
                PdserveUp(up_argv(m, model_dir, free_port(), args), args.startup_timeout)
            )
            for m in args.modes
        }
        loadavg_ready = os.getloadavg()
        streams, floors, sweeps = await measure(model_dir, ups, prompts, sweep_prompts, args)
        base = streams["in-process"]
        systems = {
            m: system_result(up, streams[m], base, floors[m], sweeps[m], model_dir)
            for m, up in ups.items()
        }
    return {
        "benchmark": "system_overhead",
        "command": shlex.join([".venv/bin/python", "benchmarks/system_overhead.py", *sys.argv[1:]]),
        "host": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "loadavg_start": loadavg_start,
            "loadavg_systems_ready": loadavg_ready,
            "loadavg_end": os.getloadavg(),
        },
        "workload": {k: getattr(args, k) for k in WORKLOAD_KEYS},
        "targets": {"added_ttft_p50_ms": TARGET_TTFT_MS, "added_itl_p50_ms": TARGET_ITL_MS},
        "inprocess": latency_summary(base),
        "engine_sync": latency_summary(streams["engine-sync"]),
        "systems": systems,
        "wall_s": time.perf_counter() - t_start,
    }


TARGET_TTFT_MS, TARGET_ITL_MS = 5.0, 1.0
WORKLOAD_KEYS = (
    "requests", "warmup", "prompt_len", "output_len", "concurrency", "sweep_output_len",
    "sweep_requests_per_stream", "sweep_min", "kv_cache_memory", "seed",
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke run: a few requests (tests)")
    p.add_argument("--requests", type=int, default=100, help="low-load requests per system")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured requests first")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--sweep-output-len", type=int, default=8, help="tokens per sweep request")
    p.add_argument("--sweep-requests-per-stream", type=int, default=6)
    p.add_argument("--sweep-min", type=int, default=40, help="at least this many per level")
    p.add_argument("--modes", nargs="+", default=["disaggregated", "colocated"],
                   choices=["disaggregated", "colocated"])  # fmt: skip
    p.add_argument("--kv-cache-memory", default="64M", help="KV cache per engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=240.0)
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--output-json", type=Path, default=HERE / "system_overhead.json")
    p.add_argument("--output-md", type=Path, default=HERE / "system_overhead.md")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.warmup, args.output_len = 4, 1, 6
        args.concurrency, args.sweep_requests_per_stream, args.sweep_min = [1, 2], 2, 4
    if args.requests < 1 or args.output_len < 2 or args.prompt_len < 1 or args.warmup < 0:
        p.error("need --requests >= 1, --output-len >= 2, --prompt-len >= 1, --warmup >= 0")
    try:
        if memory_size(args.kv_cache_memory) is None:
            raise argparse.ArgumentTypeError("a size is required")
    except argparse.ArgumentTypeError as exc:
        p.error(f"--kv-cache-memory: {exc}")
    if min(args.concurrency) < 1 or args.sweep_output_len < 1:
        p.error("--concurrency values and --sweep-output-len must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    args = parse_args(argv)
    result = asyncio.run(run(args))
    args.output_json.write_text(json.dumps(result, indent=2) + "\n")
    md = render_markdown(result)
    args.output_md.write_text(md)
    print(md)  # CLI output: the report
    return 0


def _worker_entry(model_dir: str, kv_cache_memory: str) -> int:
    logging.basicConfig(level=logging.WARNING)  # stderr; stdout carries the protocol
    import torch

    torch.set_num_threads(1)  # what `pdserve up --torch-threads 1` gives each service
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    asyncio.run(worker_main(model_dir, kv_cache_memory))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--engine-worker"]:
        sys.exit(_worker_entry(*sys.argv[2:4]))
    sys.exit(main())
