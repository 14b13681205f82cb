"""GPU benchmark: ceilings, attention kernels, and the engine end to end vs transformers.

Run on the GPU machine from the repo root (one H200 here; see docs/gpu.md):

    python3 -m benchmarks.gpu.gpu_bench --sections ceilings,kernels,e2e,hf \\
        --json benchmarks/results/gpu/gpu_h200.json

Sections:
- ceilings: device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate on
  random data; every other number is read against these.
- kernels: paged attention (Triton) vs the torch_ref backend and dense SDPA (gpu_bench_kernels).
- e2e: the engine with dummy bf16 weights of the Llama-3.1-8B / Llama-3.2-1B shapes: batch-1
  decode at a 512-token context, 2k-token prefill TTFT, offline 1024-in/1024-out throughput
  with 256 sequences; per variant (torch_ref vs triton attention, eager vs CUDA graphs).
- hf: ``transformers.generate`` on the same card, same prompts, as the baseline.

Results go to JSON after every measurement, so a run cut short still reports what it did.
``--tiny`` shrinks the ceilings and kernel shapes (CPU dry run under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.gpu_bench_engine import (
    gpu_step_ms,
    make_engine,
    model_numbers,
    prefill_flops,
    prompts,
    run_batch,
)
from benchmarks.gpu.gpu_bench_kernels import Results, bench_ms, run_kernels
from benchmarks.gpu.gpu_bench_report import render_markdown, summarize
from benchmarks.record import CONFIGS, recorded_command, result_path

log = logging.getLogger("gpu_bench")
MODELS = ("llama-3.1-8b", "llama-3.2-1b")


def measure_ceilings(res: Results, dev: torch.device, tiny: bool) -> None:
    n = (1 << 20) if tiny else (1 << 30)  # 2 GiB of bf16 per buffer on the GPU
    a = torch.randn(n, device=dev, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a), dev)
    bw = 2 * a.numel() * a.element_size() / (ms * 1e-3) / 1e9
    m = 256 if tiny else 8192
    x = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    ms_mm = bench_ms(lambda: x @ y, dev)
    tflops = 2 * m**3 / (ms_mm * 1e-3) / 1e12
    res.put(
        "ceilings", "measured", {"copy_GBps": round(bw, 1), "bf16_matmul_TFLOPs": round(tflops, 1)}
    )


def bench_engine(
    res: Results,
    model: str,
    backend: str,
    graphs: bool,
    rows: list[str],
    deadline: float,
    opts: str = "",
) -> None:
    """One engine variant: the rows asked for, each skipped if the run's deadline has passed."""
    variant = f"{model}/{backend}/{'graphs' if graphs else 'eager'}" + "".join(
        f"/{f}" for f in opts.split(",") if f
    )
    nums = model_numbers(model)
    engine = make_engine(model, backend, graphs, opts)
    row: dict[str, Any] = {}
    try:
        if "gpu_step" in rows:
            engine.runner.kv_cache.normal_()  # time on random KV, not zeros
            row["gpu_step_b1_ctx512_ms"] = round(gpu_step_ms(engine, 1, 512), 3)
            row["gpu_step_b256_ctx1536_ms"] = round(gpu_step_ms(engine, 256, 1536), 3)
            res.put("e2e", variant, row)
        if "decode_b1" in rows and time.monotonic() < deadline:
            run_batch(engine, prompts(1, 512, 1), 16, "warm")
            r = run_batch(engine, prompts(1, 512, 2), 128, "b1")
            ms = statistics.median(r["steps"][1:]) * 1e3
            row["decode_b1_ctx512_ms_per_token"] = round(ms, 3)
            res.put("e2e", variant, row)
        if "prefill_2k" in rows and time.monotonic() < deadline:
            run_batch(engine, prompts(1, 2048, 3), 1, "warm2k")
            ttfts = [
                run_batch(engine, prompts(1, 2048, 10 + i), 1, f"p2k{i}")["ttft"][0]
                for i in range(3)
            ]
            t = statistics.median(ttfts)
            row["prefill_2k_ttft_ms"] = round(t * 1e3, 2)
            row["prefill_2k_TFLOPs"] = round(prefill_flops(nums, 2048) / t / 1e12, 1)
            res.put("e2e", variant, row)
        for name, n_out in (("thr_1k_16", 16), ("thr_1k_1k", 1024)):
            if name in rows and time.monotonic() < deadline:
                run_batch(engine, prompts(16, 1024, 4), 8, f"warm{name}")
                r = run_batch(engine, prompts(256, 1024, 5), n_out, name)
                row[f"{name}_out_tok_s"] = round(r["out_tokens"] / r["total_s"], 1)
                row[f"{name}_total_s"] = round(r["total_s"], 2)
                row[f"{name}_median_step_ms"] = round(statistics.median(r["steps"]) * 1e3, 2)
                res.put("e2e", variant, row)
    finally:
        del engine
        # LLMEngine gc.freeze()s what it built (short GC pauses in the step loop); frozen
        # objects are never collected, so unfreeze first or the next engine finds the
        # GPU still full of this one.
        gc.unfreeze()
        gc.collect()
        torch.cuda.empty_cache()


def bench_hf(res: Results, model: str, deadline: float) -> None:
    """transformers.generate (eager, its default dynamic cache), greedy, same prompt shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(CONFIGS / model)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf.eval()

    def gen(batch: list[list[int]], new: int) -> float:
        ids = torch.tensor(batch, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    row: dict[str, Any] = {}
    key = f"{model}/transformers"
    gen(prompts(1, 512, 1), 64)  # warm up at full length
    t1, t65 = gen(prompts(1, 512, 2), 1), gen(prompts(1, 512, 2), 65)
    row["decode_b1_ctx512_ms_per_token"] = round((t65 - t1) / 64 * 1e3, 3)
    gen(prompts(1, 2048, 3), 1)
    t = statistics.median(gen(prompts(1, 2048, 10 + i), 1) for i in range(3))
    row["prefill_2k_ttft_ms"] = round(t * 1e3, 2)
    row["prefill_2k_TFLOPs"] = round(prefill_flops(model_numbers(model), 2048) / t / 1e12, 1)
    res.put("hf", key, row)
    if time.monotonic() < deadline:
        gen(prompts(64, 1024, 4), 4)
        t = gen(prompts(64, 1024, 5), 128)
        row["thr_b64_1k_128_out_tok_s"] = round(64 * 128 / t, 1)
        res.put("hf", key, row)


PlanRow = tuple[str, str, bool, list[str], str]  # model, backend, graphs, rows, make_engine opts


def e2e_plan(plan: str) -> list[PlanRow]:
    """``full``: headline variants of both models, then the before-rows (eager, torch_ref).
    ``quick``: graphed GPU step times + batch-1 decode. ``fused``: the fused element-wise
    kernels' before/after (graphed Triton engine with and without them) + transformers.
    ``async``: the 8B engine as it is, then without async scheduling, then without the
    Triton GEMV (each the engine as it is minus that one change). ``vs_hf``: 8B offline
    throughput and transformers only."""
    full = ["decode_b1", "prefill_2k", "thr_1k_1k", "thr_1k_16"]
    big, small = MODELS
    if plan == "quick":
        return [(m, "triton", True, ["gpu_step", "decode_b1"], "") for m in MODELS]
    if plan == "async":
        return [
            (big, "triton", True, ["gpu_step", *full], ""),
            (big, "triton", True, ["decode_b1", "thr_1k_1k", "thr_1k_16"], "sync"),
            (big, "triton", True, ["gpu_step", "decode_b1"], "cublas"),
            (small, "triton", True, ["gpu_step", "decode_b1", "thr_1k_1k"], ""),
        ]
    if plan == "fp8":  # 8B batch-1 decode, bf16 weights then FP8 weights
        return [(big, "triton", True, ["gpu_step", "decode_b1"], o) for o in ("", "fp8")]
    if plan == "vs_hf":  # the 10x comparison alone: 8B throughput and transformers
        return [(big, "triton", True, ["thr_1k_1k", "thr_1k_16"], ""), (big, "hf", False, [], "")]
    if plan == "fused":
        return [
            (big, "triton", True, ["gpu_step", *full], ""),
            (big, "hf", False, [], ""),
            (big, "triton", True, ["gpu_step", "decode_b1", "thr_1k_1k"], "unfused"),
            (small, "triton", True, ["gpu_step", "decode_b1", "thr_1k_1k"], ""),
            (small, "triton", True, ["gpu_step", "decode_b1"], "unfused"),
        ]
    if plan != "full":
        raise ValueError(f"--plan must be full, quick, fused, async, fp8 or vs_hf, got {plan!r}")
    rows: list[PlanRow] = []
    for model in MODELS:
        rows += [(model, "triton", True, full, ""), (model, "hf", False, [], "")]
    for model in MODELS:
        rows += [
            (model, "triton", False, ["decode_b1", "thr_1k_16", "thr_1k_1k"], ""),
            (model, "torch_ref", False, ["decode_b1", "prefill_2k", "thr_1k_16"], ""),
        ]
    return rows


def run_e2e(
    res: Results, sections: list[str], deadline: float, plan: str = "full", quant: str = ""
) -> None:
    """``quant``: "fp8" adds the ``fp8`` flag to every engine row (``--quantization``)."""
    for model in MODELS:
        res.put("models", model, model_numbers(model))
    for model, backend, graphs, rows, opts in e2e_plan(plan):
        if quant and backend != "hf" and quant not in opts.split(","):
            opts = ",".join(filter(None, (opts, quant)))
        key = f"{model}/{backend}/{graphs}/{opts or 'default'}"
        if time.monotonic() >= deadline:
            res.put("skipped", key, "run budget spent")
        elif backend == "hf" and "hf" in sections:
            _guarded(res, f"{model}/transformers", bench_hf, res, model, deadline)
        elif backend != "hf" and "e2e" in sections:
            _guarded(res, key, bench_engine, res, model, backend, graphs, rows, deadline, opts)


def _guarded(res: Results, key: str, fn: Any, *args: Any) -> None:
    """Run one benchmark; a failure is recorded in the results and the run goes on."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - report every failure, keep measuring the rest
        log.exception("%s failed", key)
        res.put("errors", key, f"{type(exc).__name__}: {exc}"[:1000])
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", default="ceilings,kernels")
    p.add_argument("--json", type=Path, default=result_path("gpu", "gpu_bench.json"))
    p.add_argument("--md", type=Path, default=None, help="also write the markdown report here")
    p.add_argument("--merge", type=Path, default=None, help="earlier JSON kept under 'earlier'")
    p.add_argument("--kernels", default="", help="kernels: only shapes whose name starts with this")
    p.add_argument("--no-sweep", action="store_true", help="kernels: skip the tile sweep")
    p.add_argument("--tiny", action="store_true")
    p.add_argument(
        "--plan",
        default="full",
        choices=["full", "quick", "fused", "async", "fp8", "vs_hf"],
        help="e2e variants (see e2e_plan): full, quick (GPU step + batch-1 only), fused / "
        "async (before/after rows), fp8 (8B batch-1, bf16 vs FP8 weights)",
    )
    p.add_argument(
        "--quantization",
        choices=["fp8"],
        default=None,
        help="every engine row with FP8 weights quantized at load",
    )
    p.add_argument(
        "--gemv-sweep", type=Path, default=None, help="gemv_sweep.py JSON to use as the GEMV table"
    )
    p.add_argument("--budget-s", type=float, default=540.0, help="start nothing new after this")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    deadline = time.monotonic() + args.budget_s
    if args.gemv_sweep is not None:
        from engine.models.triton_gemv import load_sweep

        load_sweep(str(args.gemv_sweep))
    res = Results(args.json)
    if args.merge is not None:
        res.data["earlier"] = json.loads(args.merge.read_text())
    res.put("env", "device", torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    res.put("env", "torch", torch.__version__)
    res.put("env", "command", recorded_command("benchmarks.gpu.gpu_bench", argv))
    sections = args.sections.split(",")
    if "ceilings" in sections:
        measure_ceilings(res, dev, args.tiny)
    if "kernels" in sections:
        run_kernels(res, dev, args.tiny, sweep=not args.no_sweep, only=args.kernels)
    if "e2e" in sections or "hf" in sections:
        run_e2e(res, sections, deadline, plan=args.plan, quant=args.quantization or "")
    if args.md is not None:
        args.md.write_text(render_markdown(res.data))
    print(summarize(res.data))


if __name__ == "__main__":
    main()
