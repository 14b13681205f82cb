"""What KV events and the host KV tier cost the engine's step loop (docs/design.md §3
"KV events", "Host KV tier").

A tiny dummy Llama (2 layers, hidden 64: the forward is cheap, so the engine's Python
work dominates and any per-block cost shows) serves rounds of requests over a KV pool
too small to keep them, so blocks are registered and evicted all the time: the worst
case for the event log. Prompts share 8 prefixes and each round repeats the last one's
prompts, so the host tier has hits to serve. Three cases, interleaved round by round
(each first in turn; round 0 is a warm-up), median of the rest:

* ``off``: ``kv_events`` off, no host tier (the engine as before);
* ``events``: the event log on, a ``KvEventPublisher`` pumped after every step and one
  subscriber that takes every batch and builds its protobuf (what the service does, here
  on the same thread: the worst case for a CPU machine where both share the GIL);
* ``events+host``: the same with a 64 MiB host tier.

    python -m benchmarks.engine.kv_events_overhead   # writes benchmarks/results/engine/kv_events_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine.host_overhead_child import TINY_LLAMA
from benchmarks.record import recorded_command, result_path
from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.kv.events import KvEventPublisher, snapshot_held
from engine.llm_engine import LLMEngine
from service.kv_events_rpc import to_proto

CASES = ("off", "events", "events+host")


def _engine(model: str, case: str, blocks: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=model,
            load_format="dummy",
            num_kv_blocks=blocks,
            max_num_seqs=16,
            kv_events=case != "off",
            kv_offloading_size=(64 << 20) if case == "events+host" else 0,
        )
    )


def _prompts(round_no: int, n: int, length: int) -> list[list[int]]:
    """Round r repeats half of round r - 1's prompts (host-tier hits) and adds new ones."""
    out = []
    for i in range(n):
        key = (round_no - 1) * n + i if i < n // 2 and round_no else round_no * n + i
        prefix = [3 + (key % 8) * 101 + t % 97 for t in range(length // 2)]
        out.append(prefix + [3 + (key * 7919 + t * 31) % 1000 for t in range(length // 2)])
    return out


async def _round(
    engine: LLMEngine, publisher: KvEventPublisher | None, prompts: list[list[int]], max_tokens: int
) -> tuple[float, int]:
    sub = publisher.subscribe(asyncio.get_running_loop()) if publisher else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
    received = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        if publisher is not None and sub is not None:
            publisher.pump()
            while True:
                try:
                    batch = await sub.next(0)
                except TimeoutError:
                    break
                to_proto(batch.expand())
                received += 1
    seconds = time.perf_counter() - t0
    if sub is not None:
        sub.close()
    return seconds, received


async def _measure(args: argparse.Namespace, model: str) -> dict[str, Any]:
    engines = {case: _engine(model, case, args.blocks) for case in CASES}
    publishers = {
        case: KvEventPublisher(
            e.kv_events,
            lambda e=e: snapshot_held(e.kv, e.host_tier.parents() if e.host_tier else None),
            max_queue=1 << 20,
        )
        for case, e in engines.items()
        if e.kv_events is not None
    }
    times: dict[str, list[float]] = {case: [] for case in CASES}
    batches: dict[str, int] = dict.fromkeys(CASES, 0)
    for r in range(args.rounds):
        prompts = _prompts(r, args.num_prompts, args.prompt_len)
        for case in CASES:
            seconds, got = await _round(
                engines[case], publishers.get(case), prompts, args.max_tokens
            )
            times[case].append(seconds)
            batches[case] += got
    base = statistics.median(times["off"])
    result: dict[str, Any] = {}
    for case in CASES:
        e, pub = engines[case], publishers.get(case)
        result[case] = {
            "median_round_s": statistics.median(times[case]),
            "vs_off": statistics.median(times[case]) / base,
            "batches_received": batches[case],
            "events_published": pub.stats.events if pub else 0,
            "host_hits": e.host_tier.stats.hits if e.host_tier else 0,
            "host_offloaded": e.host_tier.stats.offloaded if e.host_tier else 0,
            "prefix_hit_rate": e.kv.pool.hit_rate(),
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=160, help="KV pool blocks (16 tokens each)")
    ap.add_argument("--output-json", default=str(result_path("engine", "kv_events_overhead.json")))
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY_LLAMA))
        result = asyncio.run(_measure(args, tmp))
    print("| case | median round (s) | vs off | batches | events | host hits | prefix hit rate |")
    print("|---|---|---|---|---|---|---|")
    for case, r in result.items():
        print(
            f"| {case} | {r['median_round_s']:.3f} | {r['vs_off']:.3f} | {r['batches_received']} "
            f"| {r['events_published']} | {r['host_hits']} | {r['prefix_hit_rate']:.3f} |"
        )
    record = {
        "command": recorded_command("benchmarks.engine.kv_events_overhead"),
        "machine": platform.platform(),
        "cpu_count": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
        "results": result,
    }
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
