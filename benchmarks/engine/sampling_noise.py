"""The sampled rows' exponential noise on the CPU: torch's ``exponential_`` against
``engine.sampling.sampler.exponential_noise`` (``-log`` of float64 uniforms), side by side
in one run (docs/design.md §3 "Sampling").

    python -m benchmarks.engine.sampling_noise

For each vocabulary size, one step's worth of rows (``--rows``) is drawn with a generator
seeded per row, as the sampler does; the two draws alternate for ``--repeats`` rounds and
the median of each is kept. Writes benchmarks/results/engine/sampling_noise.{json,md}.
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
from engine.sampling.sampler import exponential_noise

Draw = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def _torch_exponential(like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.empty_like(like).exponential_(generator=gen)


def _step_seconds(draw: Draw, probs: torch.Tensor) -> float:
    start = time.perf_counter()
    for row in range(probs.shape[0]):
        gen = torch.Generator()
        gen.manual_seed(row)
        draw(probs[row], gen)
    return time.perf_counter() - start


def measure(vocab: int, rows: int, repeats: int) -> dict[str, float]:
    probs = torch.rand(rows, vocab).softmax(-1)
    torch_s, ours_s = [], []
    for _ in range(repeats):  # alternate, so both see the same machine
        torch_s.append(_step_seconds(_torch_exponential, probs))
        ours_s.append(_step_seconds(exponential_noise, probs))
    t, o = statistics.median(torch_s), statistics.median(ours_s)
    return {"vocab": vocab, "rows": rows, "torch_exponential_ms_per_row": round(t / rows * 1e3, 4),
            "ours_ms_per_row": round(o / rows * 1e3, 4), "speedup": round(t / o, 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 49152, 151936])
    ap.add_argument("--rows", type=int, default=256)
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
             "| vocab | rows | torch exponential_ ms/row | ours ms/row | speedup |",
             "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['vocab']} | {r['rows']} | {r['torch_exponential_ms_per_row']} "
              f"| {r['ours_ms_per_row']} | {r['speedup']}× |" for r in rows]  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
