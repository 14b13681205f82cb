"""One step's sampling on the CPU, side by side in one run (docs/design.md §3 "Sampling"):

- ``race_torch``: the exponential race with torch's CPU ``exponential_`` (the draw before
  2026-12-04: one exponential per vocabulary entry of every sampled row);
- ``sampler``: today's ``Sampler``, the same race with ``exponential_noise`` (``-log`` of
  float64 uniforms).

    python -m benchmarks.engine.sampling_noise

For each vocabulary size, ``--rows`` sampled requests (temperature 1, seeded per row and
position, as the engine's) are sampled from random logits; the two alternate for
``--repeats`` rounds and the median of each is kept. Writes
benchmarks/results/engine/sampling_noise.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.record import recorded_command, result_path
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.sampling.sampler import Sampler, position_seed

Pick = Callable[[torch.Tensor, list[Request]], torch.Tensor]


def _race(noise: Callable[[torch.Tensor, torch.Generator], torch.Tensor]) -> Pick:
    def pick(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        scores = []
        for i, request in enumerate(requests):
            probs = Sampler.processed_logits(logits[i], request).softmax(-1)
            gen = torch.Generator()
            gen.manual_seed(position_seed(request.effective_seed, request.num_tokens))
            scores.append(probs / noise(probs, gen))
        return torch.stack(scores).argmax(-1)

    return pick


def _torch_exponential(like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.empty_like(like).exponential_(generator=gen)


def _sampler(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    return Sampler().launch(logits, requests).tokens


PICKS: dict[str, Pick] = {"race_torch": _race(_torch_exponential), "sampler": _sampler}


def measure(vocab: int, rows: int, repeats: int) -> dict[str, object]:
    logits = torch.randn(rows, vocab)
    params = SamplingParams(max_tokens=8, temperature=1.0)
    requests = [Request(f"r{i}", [1, 2, 3], params, effective_seed=i) for i in range(rows)]
    times: dict[str, list[float]] = {name: [] for name in PICKS}
    for _ in range(repeats):  # alternate, so all see the same machine
        for name, pick in PICKS.items():
            start = time.perf_counter()
            pick(logits, requests)
            times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"vocab": vocab, "rows": rows, "step_ms": {k: round(v, 2) for k, v in ms.items()},
            "sampler_vs_race_torch": round(ms["race_torch"] / ms["sampler"], 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 49152, 151936])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a service's own)")
    ap.add_argument("--out", default=str(result_path("engine", "sampling_noise.json")))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(v, args.rows, args.repeats) for v in args.vocab]
    report = {"benchmark": "sampling_noise", "command": recorded_command("benchmarks.engine.sampling_noise"),
              "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "torch": torch.__version__, "threads": args.threads}, "rows": rows}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"`{report['command']}` ({report['host']['platform']}, {args.threads} thread)\n",
             "| vocab | sampled rows | race, torch exponential_ ms | sampler, -log(u) ms "
             "| speedup |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        t = r["step_ms"]
        assert isinstance(t, dict)
        lines.append(f"| {r['vocab']} | {r['rows']} | {t['race_torch']} | {t['sampler']} "
                     f"| {r['sampler_vs_race_torch']}× |")  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
