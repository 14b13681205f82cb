"""The MoE models end to end on one GPU with dummy weights: Qwen3-30B-A3B in bf16 and
Mixtral-8x7B with FP8 weights (to fit one H200), beside the weight-streaming roofline.

    python -m benchmarks.gpu.moe_models --json benchmarks/results/gpu/moe_models_h200.json

Rows per model: ``b1``: GPU time of one graphed decode step at batch 1 (512-token
context) and ``roofline_ms``: the bytes one step must read (non-expert weights, the k
active experts of every layer, lm_head, the context's KV) at the measured copy bandwidth
(target: ``vs_roofline`` <= 1.25); ``b64``: the same step at batch 64 (with the expected
number of distinct experts per layer, ``E * (1 - (1 - k/E)**64)``, in the roofline);
``1k1k``: offline throughput of 64 prompts of 1024 tokens with 1024 new tokens each.
Engine construction and the step helpers are benchmarks/gpu/gpu_bench_engine.py's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.gpu_bench_engine import gpu_step_ms, make_engine, prompts, run_batch
from benchmarks.gpu.moe_layer import copy_bandwidth
from benchmarks.record import CONFIGS

MODELS = {"qwen3-30b-a3b": "", "mixtral-8x7b": "fp8"}


def step_bytes(name: str, fp8: bool, batch: int, ctx: int) -> float:
    """Bytes a decode step reads: weights it touches plus the batch's KV."""
    c = json.loads((CONFIGS / name / "config.json").read_text())
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    heads, kvh = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // heads
    experts = c.get("num_local_experts") or c["num_experts"]
    k = c["num_experts_per_tok"]
    inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    w = 1 if fp8 else 2
    attn = h * (heads * d + 2 * kvh * d) + heads * d * h
    active = experts * (1 - (1 - k / experts) ** batch)
    per_layer = attn * w + active * 3 * h * inter * w + experts * h * 2
    kv = batch * ctx * layers * 2 * kvh * d * 2
    return layers * per_layer + 2 * h * c["vocab_size"] + kv


def bench(name: str, opts: str, bandwidth: float) -> dict[str, Any]:
    engine = make_engine(name, "triton", True, opts)
    fp8 = "fp8" in opts
    row: dict[str, Any] = {"model": name, "weights": "fp8" if fp8 else "bf16"}
    for bs, ctx in ((1, 512), (64, 1024)):
        ms = gpu_step_ms(engine, bs, ctx)
        roof = step_bytes(name, fp8, bs, ctx) / bandwidth * 1e3
        row[f"b{bs}"] = {"step_ms": round(ms, 3), "roofline_ms": round(roof, 3),
                         "vs_roofline": round(ms / roof, 3)}  # fmt: skip
        print(json.dumps(row), flush=True)
    t0 = time.perf_counter()
    out = run_batch(engine, prompts(64, 1024, 1), 1024, "1k1k")
    row["1k1k"] = {"tok_s": round(out["out_tokens"] / out["total_s"], 1),
                   "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    engine.shutdown()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = []
    for name in args.models.split(","):
        rows.append(bench(name, MODELS[name], bandwidth))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"copy_gbs": bandwidth / 1e9, "rows": rows}, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
