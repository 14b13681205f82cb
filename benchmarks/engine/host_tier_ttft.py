"""Time to first token of a prompt the device cache evicted: recomputed, or copied back
from the host KV tier (docs/design.md §3 "Host KV tier").

One engine with a host tier and a KV pool that holds one long prompt at a time. Each
round: prompt A cold (nothing cached), then B (pushes A out of the device, into the
host), then A again (its blocks come back from the host), then A once more (a device
hit); a second engine without the host tier measures A after B (recomputed). Medians
over the rounds, each round on new prompts.

    python -m benchmarks.engine.host_tier_ttft   # writes benchmarks/results/engine/host_tier_ttft.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.record import recorded_command, result_path
from common.models import resolve_model
from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, FIRST)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def _prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729) % 40000 for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--output-json", default=str(result_path("engine", "host_tier_ttft.json")))
    args = ap.parse_args()
    model = str(resolve_model(args.model))
    blocks = args.prompt_len // 16 + 8  # one prompt fits, two do not
    engines = {
        host: LLMEngine(
            EngineConfig(
                model=model,
                num_kv_blocks=blocks,
                kv_offloading_size=(1 << 30) if host else 0,
                max_num_batched_tokens=args.prompt_len + 16,
            )
        )
        for host in (True, False)
    }
    times: dict[str, list[float]] = {"cold": [], "host_hit": [], "device_hit": [], "recomputed": []}
    for r in range(args.rounds + 1):  # round 0 warms up
        a, b = _prompt(2 * r, args.prompt_len), _prompt(2 * r + 1, args.prompt_len)
        with_host, without = engines[True], engines[False]
        got = {"cold": _ttft(with_host, f"a{r}", a)}
        _ttft(with_host, f"b{r}", b)
        got["host_hit"] = _ttft(with_host, f"a{r}-again", a)
        got["device_hit"] = _ttft(with_host, f"a{r}-third", a)
        _ttft(without, f"a{r}", a)
        _ttft(without, f"b{r}", b)
        got["recomputed"] = _ttft(without, f"a{r}-again", a)
        if r:
            for key, value in got.items():
                times[key].append(value)
    tier = engines[True].host_tier
    assert tier is not None and tier.stats.hits > 0, "the host tier served nothing"
    result = {k: statistics.median(v) * 1000 for k, v in times.items()}
    print("| prompt A | TTFT ms (median) |\n|---|---|")
    for key, ms in result.items():
        print(f"| {key} | {ms:.1f} |")
    print(f"\nhost hit / recomputed = {result['host_hit'] / result['recomputed']:.3f}")
    record: dict[str, Any] = {
        "command": recorded_command("benchmarks.engine.host_tier_ttft"),
        "machine": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
        "ttft_ms": result,
        "host_hit_over_recomputed": result["host_hit"] / result["recomputed"],
        "host_tier": {"hits": tier.stats.hits, "offloaded": tier.stats.offloaded},
    }
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
