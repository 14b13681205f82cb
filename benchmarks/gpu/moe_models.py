"""The MoE models end to end on one GPU with dummy weights, beside the weight-streaming
roofline: of Qwen3-30B-A3B (bf16, 61 GB), Mixtral-8x7B (FP8, 47 GB; bf16, 93 GB) and
gpt-oss-20b (bf16, 42 GB), the ones whose weights fit the GPU present (an 80 GB card takes
all but Mixtral in bf16; an H200 all four). Loading is layer by layer
(engine/models/loading.py), so a model loads where its served size fits.

    python -m benchmarks.gpu.moe_models --json benchmarks/results/gpu/moe_models_h100.json
    python -m benchmarks.gpu.moe_models --list   # the picks for this GPU, no run

Rows per model: ``b1``: GPU time of one graphed decode step at batch 1 (512-token
context) and ``roofline_ms``: the bytes one step must read (non-expert weights, the k
active experts of every layer, lm_head, the context's KV) at the measured copy bandwidth
(target: ``vs_roofline`` <= 1.25); ``b64``: the same step at batch 64 (with the expected
number of distinct experts per layer, ``E * (1 - (1 - k/E)**64)``, in the roofline);
``1k1k``: offline throughput of 64 prompts of 1024 tokens with 1024 new tokens each.
Token ids are drawn inside each model's vocabulary (Mixtral's is 32,000 ids).
Engine construction and the step helpers are benchmarks/gpu/gpu_bench_engine.py's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.gpu_bench_engine import (
    fit_context,
    gpu_step_ms,
    make_engine,
    prompts,
    run_batch,
)
from benchmarks.gpu.moe_layer import copy_bandwidth
from benchmarks.record import CONFIGS, recorded_command

# (config directory, engine opts) in the order they run.
MODELS = (
    ("qwen3-30b-a3b", ""),
    ("mixtral-8x7b", "fp8"),
    ("gpt-oss-20b", ""),
    ("mixtral-8x7b", ""),
)
# The decode-step rows: (batch, context); a context the KV pool cannot hold is shortened
# to what fits (said in the output and recorded as the row's ``ctx``).
STEPS = ((1, 512), (64, 1024))
# What a model needs beyond its weights: a KV pool worth benchmarking, activations, the
# CUDA context and the decode graphs.
HEADROOM_BYTES = 8 << 30


def weight_bytes(name: str, fp8: bool) -> int:
    """The served weights' bytes: decoder projections and experts at 1 byte with FP8, 2 in
    bf16; embedding, head and norms at 2 (the model built on the meta device, counted)."""
    from engine.attention.torch_ref import TorchRefAttention
    from engine.models.config import ModelArgs
    from engine.models.llama import LlamaForCausalLM

    args = ModelArgs.from_hf(json.loads((CONFIGS / name / "config.json").read_text()))
    with torch.device("meta"):
        model = LlamaForCausalLM(args, TorchRefAttention(cpu_kernels=False), 16)
    total = 0
    for pname, p in model.named_parameters():
        quantized = fp8 and pname.startswith("layers.") and p.dim() >= 2
        total += p.numel() * (1 if quantized else 2)
    return total


def fitting(models: list[tuple[str, str]], gpu_bytes: int) -> list[tuple[str, str, int]]:
    """``(name, opts, weight bytes)`` of the models whose weights plus headroom fit."""
    out = []
    for name, opts in models:
        need = weight_bytes(name, "fp8" in opts)
        if need + HEADROOM_BYTES <= gpu_bytes:
            out.append((name, opts, need))
    return out


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


def bench(
    name: str, opts: str, bandwidth: float, n_prompts: int, new_tokens: int
) -> dict[str, Any]:
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = make_engine(name, "triton", True, opts)
    fp8 = "fp8" in opts
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    row: dict[str, Any] = {
        "model": name, "weights": "fp8" if fp8 else "bf16",
        "gpu": torch.cuda.get_device_name(), "load_s": round(time.perf_counter() - t0, 1),
        "weights_gb": round(weights / 1e9, 2),
        "engine_peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
    }  # fmt: skip
    for bs, want in STEPS:
        ctx = fit_context(engine, bs, want)
        if ctx < want:  # the KV pool left beside the weights is smaller than the row asks
            print(f"{name}: b{bs} at {ctx}-token context: {want} x {bs} does not fit the "
                  f"KV pool ({engine.runner.num_blocks - 1} blocks)", flush=True)  # fmt: skip
        if ctx == 0:
            continue
        ms = gpu_step_ms(engine, bs, ctx)
        roof = step_bytes(name, fp8, bs, ctx) / bandwidth * 1e3
        row[f"b{bs}"] = {"ctx": ctx, "step_ms": round(ms, 3), "roofline_ms": round(roof, 3),
                         "vs_roofline": round(ms / roof, 3)}  # fmt: skip
        print(json.dumps(row), flush=True)
    t0 = time.perf_counter()
    batch = prompts(n_prompts, 1024, 1, vocab=engine.args.vocab_size)
    out = run_batch(engine, batch, new_tokens, "1k1k")
    row["1k1k"] = {"prompts": n_prompts, "new_tokens": new_tokens,
                   "tok_s": round(out["out_tokens"] / out["total_s"], 1),
                   "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    engine.shutdown()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="", help="name[:fp8],... (default: every model that fits)")
    p.add_argument("--prompts", type=int, default=64, help="1k/1k: number of prompts")
    p.add_argument("--new-tokens", type=int, default=1024, help="1k/1k: tokens per prompt")
    p.add_argument("--list", action="store_true", help="print the picks, run nothing")
    p.add_argument("--gpu-gb", type=float, default=None, help="--list for this GPU size")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    asked = [tuple((m.split(":") + [""])[:2]) for m in args.models.split(",") if m]
    if args.gpu_gb is not None:
        gpu_bytes = int(args.gpu_gb * 1e9)
    else:
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    picks = fitting(list(asked) or list(MODELS), gpu_bytes)  # type: ignore[arg-type]
    for name, opts, need in picks:
        print(f"fits in {gpu_bytes / 1e9:.0f} GB: {name} {opts or 'bf16'} ({need / 1e9:.1f} GB)")
    if args.list:
        return
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = []
    for name, opts, _ in picks:
        rows.append(bench(name, opts, bandwidth, args.prompts, args.new_tokens))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            out = {
                "command": recorded_command("benchmarks.gpu.moe_models"),
                "gpu": torch.cuda.get_device_name(), "copy_gbs": bandwidth / 1e9, "rows": rows,
            }  # fmt: skip
            args.json.write_text(json.dumps(out, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
