"""`pdserve bench throughput` and `pdserve bench latency`: the engine in-process, offline.

Like vLLM's `vllm bench throughput/latency`: a fixed, seeded set of random-token prompts
(the same flags give the same prompts on any machine), no HTTP in the way.

- throughput: submit every prompt at once and run ``LLMEngine.step()`` until all finish;
  report input/output/total tokens per second, requests per second and the wall time of
  each ``step()`` (mean, p50, p99).
- latency: run one batch of ``--batch-size`` prompts to completion, ``--num-warmup`` times
  untimed and then ``--num-iters`` times timed; report end-to-end batch latency.

Both print a table and write ``--output-json`` when given. Programmatic use (the CPU
benchmark in ``benchmarks/engine/engine_cpu.py`` does this): ``build_engine`` + ``run_throughput``.
Torch is imported only when a command runs, so registering the parsers stays light.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# Random prompt tokens avoid the low ids, where Llama-family vocabularies keep their
# special tokens (bos/eos/chat markers), so no prompt ends early or changes meaning.
_FIRST_ORDINARY_TOKEN = 100


@dataclass(slots=True)
class StepStats:
    """Wall time of ``LLMEngine.step()`` calls, in milliseconds."""

    count: int
    mean_ms: float
    p50_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> StepStats:
        if not seconds:
            return cls(0, 0.0, 0.0, 0.0, 0.0)
        ms = sorted(s * 1e3 for s in seconds)
        return cls(len(ms), statistics.fmean(ms), percentile(ms, 50), percentile(ms, 99), ms[-1])


@dataclass(slots=True)
class ThroughputResult:
    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    cpu_s: float  # process CPU time (all threads): less sensitive to a busy machine
    steps: StepStats
    output_lens: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Counts, times and the derived rates (per second of wall time)."""
        d = asdict(self)
        d.pop("output_lens")
        t = self.elapsed_s
        d.update(
            requests_per_s=self.num_requests / t,
            input_tokens_per_s=self.input_tokens / t,
            output_tokens_per_s=self.output_tokens / t,
            total_tokens_per_s=(self.input_tokens + self.output_tokens) / t,
        )
        return d


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` (0..100) of an ascending, non-empty list."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def random_prompts(
    num_prompts: int, input_len: int, vocab_size: int, seed: int, spread: int = 0
) -> list[list[int]]:
    """``num_prompts`` prompts of random ordinary token ids, lengths uniform in
    ``input_len ± spread``; deterministic in all arguments."""
    if num_prompts < 1 or input_len < 1:
        raise ValueError(f"num_prompts and input_len must be >= 1, got {num_prompts}, {input_len}")
    if not 0 <= spread < input_len:
        raise ValueError(f"spread must be in [0, input_len), got {spread}")
    if vocab_size <= _FIRST_ORDINARY_TOKEN:
        raise ValueError(f"vocab_size {vocab_size} is too small for random prompts")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        n = input_len + rng.randint(-spread, spread)
        prompts.append([rng.randrange(_FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(n)])
    return prompts


def build_engine(args: argparse.Namespace) -> LLMEngine:
    """An LLMEngine from the shared flags (``--model`` resolved via common.models), built
    the way the services build theirs (``EngineArgs.create_engine_config``)."""
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine

    values = {name: getattr(args, name) for name in (*ENGINE_SETTINGS, "device")}
    # No KV events: nothing here would read them (only a service's publisher drains them).
    return LLMEngine(EngineArgs(**values, no_kv_events=True).create_engine_config())


def _greedy_fixed_length(output_len: int) -> Any:
    from engine.core.sampling_params import SamplingParams

    # Greedy with ignore_eos: every request produces exactly output_len tokens.
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def run_batch(
    engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str
) -> ThroughputResult:
    """Submit every prompt, step until all finish; time the whole run and each step."""
    params = _greedy_fixed_length(output_len)
    out_lens = dict.fromkeys(range(len(prompts)), 0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    step_times: list[float] = []
    cpu_start = time.process_time()
    start = time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outputs = engine.step()
        step_times.append(time.perf_counter() - t0)
        for out in outputs:
            out_lens[int(out.request_id.rsplit("-", 1)[1])] += len(out.new_token_ids)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    lens = [out_lens[i] for i in range(len(prompts))]
    return ThroughputResult(
        len(prompts),
        sum(map(len, prompts)),
        sum(lens),
        elapsed,
        cpu,
        StepStats.of(step_times),
        lens,
    )


def warm_up(engine: LLMEngine, vocab_size: int) -> None:
    """A tiny untimed run so one-time costs (allocator, kernel selection) stay out."""
    run_batch(engine, random_prompts(2, 16, vocab_size, seed=12345), 4, tag="warmup")


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    engine = build_engine(args)
    vocab = engine.args.vocab_size
    prompts = random_prompts(
        args.num_prompts, args.input_len, vocab, args.seed, args.input_len_spread
    )
    warm_up(engine, vocab)
    result = run_batch(engine, prompts, args.output_len, tag="tput")
    return {"benchmark": "throughput", "config": _config_dict(args), "result": result.to_dict()}


def run_latency(args: argparse.Namespace) -> dict[str, Any]:
    engine = build_engine(args)
    vocab = engine.args.vocab_size
    prompts = random_prompts(args.batch_size, args.input_len, vocab, args.seed)
    for i in range(args.num_warmup):
        run_batch(engine, prompts, args.output_len, tag=f"warm{i}")
    # A repeated prompt would be served from the prefix cache after the first iteration;
    # that is not what a latency run measures, so forget cached blocks between iterations.
    latencies, step_times = [], []
    for i in range(args.num_iters):
        engine.reset_prefix_cache()
        r = run_batch(engine, prompts, args.output_len, tag=f"iter{i}")
        latencies.append(r.elapsed_s)
        step_times.append(r.steps.mean_ms)
    lat = sorted(latencies)
    result = {
        "iterations": len(lat),
        "mean_s": statistics.fmean(lat),
        "p50_s": percentile(lat, 50),
        "p90_s": percentile(lat, 90),
        "p99_s": percentile(lat, 99),
        "mean_step_ms": statistics.fmean(step_times),
        "latencies_s": latencies,
    }
    return {"benchmark": "latency", "config": _config_dict(args), "result": result}


def _config_dict(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if not callable(v) and k != "bench_command"}


def format_throughput(report: dict[str, Any]) -> str:
    r = report["result"]
    s = r["steps"]
    rows = [
        ("Requests", f"{r['num_requests']}"),
        ("Input / output tokens", f"{r['input_tokens']} / {r['output_tokens']}"),
        ("Elapsed (s)", f"{r['elapsed_s']:.2f}"),
        ("Process CPU time (s)", f"{r['cpu_s']:.2f}"),
        ("Requests/s", f"{r['requests_per_s']:.3f}"),
        ("Input tokens/s", f"{r['input_tokens_per_s']:.1f}"),
        ("Output tokens/s", f"{r['output_tokens_per_s']:.1f}"),
        ("Total tokens/s", f"{r['total_tokens_per_s']:.1f}"),
        ("Engine steps", f"{s['count']}"),
        (
            "Step mean / p50 / p99 (ms)",
            f"{s['mean_ms']:.1f} / {s['p50_ms']:.1f} / {s['p99_ms']:.1f}",
        ),
    ]
    return _table("Offline Throughput Benchmark", rows)


def format_latency(report: dict[str, Any]) -> str:
    r = report["result"]
    c = report["config"]
    rows = [
        (
            "Batch size / input / output",
            f"{c['batch_size']} / {c['input_len']} / {c['output_len']}",
        ),
        ("Iterations", f"{r['iterations']}"),
        ("Mean latency (s)", f"{r['mean_s']:.3f}"),
        ("p50 / p90 / p99 (s)", f"{r['p50_s']:.3f} / {r['p90_s']:.3f} / {r['p99_s']:.3f}"),
        ("Mean step (ms)", f"{r['mean_step_ms']:.1f}"),
    ]
    return _table("Offline Latency Benchmark", rows)


def _table(title: str, rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows) + 2
    lines = [f"{f' {title} ':=^{width + 16}}"]
    lines += [f"{k:<{width}}{v:>16}" for k, v in rows]
    lines.append("=" * (width + 16))
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


# The engine settings the offline benchmarks take, mirrored from the services' (engine/args.py:
# same flag, type, choices and default) but without env twins: a benchmark's result depends
# on its command line alone.
ENGINE_SETTINGS = (
    "model",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory",
    "no_prefix_caching",
    "dtype",
    "load_format",
    "seed",
)


def _add_engine_args(p: argparse.ArgumentParser, *, num_prompts: bool) -> None:
    from engine.args import EngineArgs

    for name in ENGINE_SETTINGS:
        EngineArgs.setting(name).add_plain(p)
    if num_prompts:
        p.add_argument("--num-prompts", type=_positive_int, default=64)
        p.add_argument(
            "--input-len-spread",
            type=int,
            default=0,
            help="prompt lengths uniform in input-len ± spread",
        )
    p.add_argument("--input-len", type=_positive_int, default=256)
    p.add_argument("--output-len", type=_positive_int, default=128)
    # Any torch device, where the services take cpu or cuda (one process, one GPU each).
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--output-json", help="write the result to this JSON file")


def add_offline_parsers(bench_subparsers: Any) -> None:
    """Register `throughput` and `latency` on the `bench` group's subparsers."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    tp = bench_subparsers.add_parser(
        "throughput",
        help="offline engine throughput (tokens/s, step latency)",
        description=__doc__,
        formatter_class=fmt,
    )
    _add_engine_args(tp, num_prompts=True)
    tp.set_defaults(func=throughput_command)
    lat = bench_subparsers.add_parser(
        "latency",
        help="offline end-to-end latency of one batch",
        description=__doc__,
        formatter_class=fmt,
    )
    _add_engine_args(lat, num_prompts=False)
    lat.add_argument("--batch-size", type=_positive_int, default=8)
    lat.add_argument("--num-iters", type=_positive_int, default=3)
    lat.add_argument("--num-warmup", type=int, default=1)
    lat.set_defaults(func=latency_command)


def _finish(report: dict[str, Any], table: str, output_json: str | None) -> int:
    print(table)
    if output_json:
        path = Path(output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    return 0


def throughput_command(args: argparse.Namespace) -> int:
    try:
        report = run_throughput(args)
    except ValueError as exc:
        raise SystemExit(f"pdserve bench throughput: error: {exc}") from None
    return _finish(report, format_throughput(report), args.output_json)


def latency_command(args: argparse.Namespace) -> int:
    if args.num_warmup < 0:
        raise SystemExit("pdserve bench latency: error: --num-warmup must be >= 0")
    try:
        report = run_latency(args)
    except ValueError as exc:
        raise SystemExit(f"pdserve bench latency: error: {exc}") from None
    return _finish(report, format_latency(report), args.output_json)
