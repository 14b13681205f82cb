"""CPU benchmark of the engine, in one run: our engine vs `transformers.generate`, and the
scheduler + KV-manager cost per step.

1. Offline throughput: the same seeded random-token prompts (64 × ~256 tokens) through our
   engine (continuous batching, all submitted at once) and through HF `generate` as one
   left-padded batch of the same 64; greedy, exactly 128 new tokens each (EOS ignored),
   the same number of torch threads for both. The engine runs in ``--dtype``;
   transformers in each of ``--hf-dtypes`` and the ratio is against the fastest of them
   (its best CPU configuration). Target: ≥ 2× transformers.
   Batch-1 decode (``--batch1-tokens``): ms per generated token at one request, both sides,
   as (time for 1 + N tokens − time for 1 token) / N.
2. Scheduling: `Scheduler.schedule()` plus the engine's per-step bookkeeping (computed
   counters, appending the sampled token, stop checks, freeing) with 256 running requests,
   no model. Target: ≤ 1 ms per step.

    python -m benchmarks.engine.engine_cpu     # writes benchmarks/results/engine/engine_cpu.json
    python -m benchmarks.engine.engine_cpu --dtype bfloat16 --num-prompts 32 \
        --output-json benchmarks/results/engine/engine_cpu_bf16.json

The markdown report goes to stdout (and to ``--output-md`` when given); the JSON to
``--output-json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine.engine_cpu_report import agreement, render_markdown
from benchmarks.record import recorded_command, result_path
from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from pdserve.bench.offline import StepStats, random_prompts, run_batch

logger = logging.getLogger("engine_cpu")


def engine_throughput(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from engine.llm_engine import LLMEngine

    longest = max(map(len, prompts)) + args.output_len
    config = EngineConfig(
        model=args.model_dir,
        load_format=args.load_format,
        dtype=args.dtype,
        max_num_seqs=max(256, len(prompts)),
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=1 + len(prompts) * -(-longest // 16) + 16,
        seed=args.seed,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - t0
    run_batch(engine, random_prompts(2, 16, engine.args.vocab_size, seed=99), 4, tag="warmup")
    result = run_batch(engine, prompts, args.output_len, tag="bench")
    if set(result.output_lens) != {args.output_len}:
        raise RuntimeError(f"engine output lengths {set(result.output_lens)} != {args.output_len}")
    d = result.to_dict()
    d["load_s"] = load_s
    d["first_tokens"] = _first_outputs(engine, prompts, args)
    if args.batch1_tokens:
        d["batch1_ms_per_token"] = _engine_batch1(engine, prompts[0], args.batch1_tokens)
    return d


def _engine_batch1(engine: Any, prompt: list[int], n: int) -> float:
    """ms per decode token at batch 1: (t(1 + n tokens) - t(1 token)) / n, best of 2."""

    def once(tokens: int, tag: str) -> float:
        engine.reset_prefix_cache()  # both runs prefill the prompt in full
        return run_batch(engine, [prompt], tokens, tag=tag).elapsed_s

    best = min(once(1 + n, f"b1-long{i}") - once(1, f"b1-short{i}") for i in range(2))
    return best / n * 1e3


def _first_outputs(
    engine: Any, prompts: list[list[int]], args: argparse.Namespace
) -> list[list[int]]:
    """Greedy tokens of the first prompts, to cross-check that both sides did the same work."""
    from engine.core.sampling_params import SamplingParams as SP

    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts[: args.check_prompts]):
        engine.add_request(
            f"check-{i}", p, SP(max_tokens=args.check_tokens, temperature=0.0, ignore_eos=True)
        )
        outs[f"check-{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].extend(out.new_token_ids)
    return [outs[f"check-{i}"] for i in range(len(outs))]


def hf_throughput(
    args: argparse.Namespace, prompts: list[list[int]], dtype_name: str = "float32"
) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, dtype_name)
    t0 = time.perf_counter()
    if args.load_format == "dummy":
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(args.model_dir), dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype)
    model.eval()
    load_s = time.perf_counter() - t0
    pad = model.generation_config.pad_token_id
    pad = int(pad if pad is not None else 0)

    def generate(batch: list[list[int]], new_tokens: int) -> torch.Tensor:
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding, as decoder-only batching needs
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=pad,
            )
        return out[:, width:]

    generate(random_prompts(2, 16, model.config.vocab_size, seed=99), 4)  # warm-up, untimed
    cpu0, t0 = time.process_time(), time.perf_counter()
    out = generate(prompts, args.output_len)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if out.shape != (len(prompts), args.output_len):
        raise RuntimeError(f"transformers produced {tuple(out.shape)} new tokens")
    n_in, n_out = sum(map(len, prompts)), out.numel()
    first = [generate([p], args.check_tokens)[0].tolist() for p in prompts[: args.check_prompts]]
    batch1 = None
    if args.batch1_tokens:
        n = args.batch1_tokens

        def timed(tokens: int) -> float:
            t = time.perf_counter()
            generate(prompts[:1], tokens)
            return time.perf_counter() - t

        batch1 = min(timed(1 + n) - timed(1) for _ in range(2)) / n * 1e3
    return {
        "dtype": dtype_name,
        "batch1_ms_per_token": batch1,
        "num_requests": len(prompts),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "padded_input_tokens": len(prompts) * max(map(len, prompts)),
        "elapsed_s": elapsed,
        "cpu_s": cpu,
        "requests_per_s": len(prompts) / elapsed,
        "input_tokens_per_s": n_in / elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "load_s": load_s,
        "first_tokens": first,
    }


def scheduler_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Drive Scheduler + KVCacheManager with no model: each step schedules, then does what
    StepOutputs.process (engine/step/outputs.py) does besides sampling (advance counters,
    append a token, stop, free). Phase "decode": all requests running. Phase "churn": a finished request is
    replaced at once by a new ~input_len prompt (prefix lookups, chunked prefill, frees)."""
    n = args.sched_requests
    config = EngineConfig(
        model=args.model_dir,
        load_format="dummy",
        max_num_seqs=n,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    per_req = -(-(args.input_len + 64 + args.sched_steps * 2) // 16)
    kv = KVCacheManager(1 + n * per_req * 2, 16, enable_caching=True)
    sched = Scheduler(config, kv)
    rng = random.Random(args.seed)
    # Prompts are made up front so that drawing random numbers is not what gets timed.
    prompts = iter(
        random_prompts(4 * n + args.sched_steps * 8, args.input_len, 49000, args.seed, 16)
    )
    counter = iter(range(10**9))

    def add(max_tokens: int) -> None:
        sched.add_request(
            Request(f"r{next(counter)}", next(prompts), SamplingParams(max_tokens=max_tokens))
        )

    def step() -> int:
        out = sched.schedule()
        finished = 0
        for s in out.scheduled:
            r = s.request
            r.num_computed_tokens += s.num_new_tokens
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token(100 + r.num_tokens % 48000)  # the "sampled" token
                if len(r.output_token_ids) >= r.params.max_tokens:
                    sched.finish(r, RequestStatus.FINISHED_LENGTH)
                    finished += 1
        return finished

    for _ in range(n):
        add(10**6)
    while len(sched.waiting) or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in sched.running
    ):
        step()  # prefill everyone (untimed)
    assert len(sched.running) == n
    decode = _timed_steps(step, args.sched_steps, lambda _: None)
    # Churn: give the running requests staggered remaining lengths, refill on finish.
    for r in sched.running:
        r.params.max_tokens = len(r.output_token_ids) + rng.randint(1, 48)

    def refill(finished: int) -> None:
        for _ in range(finished):
            add(rng.randint(16, 64))

    churn = _timed_steps(step, args.sched_steps, refill)
    return {
        "running_requests": n,
        "decode": _ms_stats(decode[0]),
        "decode_cpu": _ms_stats(decode[1]),
        "churn": _ms_stats(churn[0]),
        "churn_cpu": _ms_stats(churn[1]),
        "prefix_hit_rate": kv.pool.hit_rate(),
    }


def _timed_steps(step: Any, count: int, after: Any) -> tuple[list[float], list[float]]:
    """Wall and thread-CPU seconds of ``count`` calls of ``step`` (+ ``after(result)``).
    CPU time leaves out the time this thread sat descheduled on a busy machine."""
    wall, cpu = [], []
    for _ in range(count):
        c0, t0 = time.thread_time(), time.perf_counter()
        after(step())
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return wall, cpu


def _ms_stats(seconds: list[float]) -> dict[str, float]:
    s = StepStats.of(seconds)
    return {
        "steps": s.count,
        "mean_ms": s.mean_ms,
        "p50_ms": s.p50_ms,
        "p99_ms": s.p99_ms,
        "max_ms": s.max_ms,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="known model name or local HF directory")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument(
        "--input-len-spread", type=int, default=16, help="lengths uniform in input-len ± spread"
    )
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2, help="torch threads for both sides")
    p.add_argument("--sched-requests", type=int, default=256)
    p.add_argument("--sched-steps", type=int, default=300)
    p.add_argument("--check-prompts", type=int, default=4)
    p.add_argument("--check-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="engine dtype"
    )
    p.add_argument(
        "--hf-dtypes",
        default="float32,bfloat16",
        help="transformers dtypes to run; the ratio is against the fastest",
    )
    p.add_argument("--batch1-tokens", type=int, default=64, help="batch-1 decode tokens (0: skip)")
    p.add_argument("--skip-hf", action="store_true", help="engine and scheduler only (profiling)")
    p.add_argument(
        "--output-json", default=str(result_path("engine", "engine_cpu.json")), help="the result"
    )
    p.add_argument("--output-md", default=None, help="also write the markdown report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    from common.models import resolve_model

    torch.set_num_threads(args.threads)
    args.model_dir = resolve_model(args.model)
    vocab = int(
        EngineConfig(model=args.model_dir, load_format=args.load_format).hf_config()["vocab_size"]
    )  # type: ignore[call-overload]
    prompts = random_prompts(
        args.num_prompts, args.input_len, vocab, args.seed, args.input_len_spread
    )
    report: dict[str, Any] = {
        "command": recorded_command("benchmarks.engine.engine_cpu", argv),
        "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {platform.processor() or ''} ({torch.get_num_threads()} torch threads)".strip(),
        "torch": torch.__version__,
        "threads": args.threads,
        "model": args.model,
        "load_format": args.load_format,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "check_tokens": args.check_tokens,
        "dtype": args.dtype,
        "batch1_tokens": args.batch1_tokens,
    }
    print("scheduler + KV manager ...", flush=True)
    report["scheduler"] = scheduler_cost(args)
    print(json.dumps(report["scheduler"], indent=1), flush=True)
    print("engine ...", flush=True)
    report["engine"] = engine_throughput(args, prompts)
    print(f"engine: {report['engine']['output_tokens_per_s']:.1f} out tok/s", flush=True)
    if args.skip_hf:
        print(json.dumps(report["engine"]["steps"]))
        return 0
    by_dtype: dict[str, dict[str, Any]] = {}
    for dtype_name in filter(None, args.hf_dtypes.split(",")):
        print(f"transformers ({dtype_name}) ...", flush=True)
        by_dtype[dtype_name] = hf_throughput(args, prompts, dtype_name)
        print(
            f"transformers {dtype_name}: {by_dtype[dtype_name]['output_tokens_per_s']:.1f} "
            "out tok/s",
            flush=True,
        )
    report["transformers_by_dtype"] = by_dtype
    # Its best CPU configuration: the fastest dtype by output tokens/s.
    report["transformers"] = max(by_dtype.values(), key=lambda r: r["output_tokens_per_s"])
    report["ratio_output_tokens_per_s"] = (
        report["engine"]["output_tokens_per_s"] / report["transformers"]["output_tokens_per_s"]
    )
    report["ratio_cpu_time"] = report["transformers"]["cpu_s"] / report["engine"]["cpu_s"]
    report["greedy_agreement"] = agreement(
        report["engine"]["first_tokens"], report["transformers"]["first_tokens"]
    )
    md = render_markdown(report)
    print(md)
    Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.output_md:
        Path(args.output_md).write_text(md, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
