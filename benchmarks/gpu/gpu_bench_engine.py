"""The engine side of ``benchmarks.gpu.gpu_bench``: model arithmetic (parameters, decode
bytes, prefill FLOPs), engines with dummy weights of a config under ``benchmarks/configs``,
a batch stepped to completion, and one graphed decode step timed on the GPU alone."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu.gpu_bench_kernels import bench_ms
from benchmarks.record import CONFIGS

log = logging.getLogger("gpu_bench")


def model_numbers(name: str) -> dict[str, float]:
    """Parameter counts, decode bytes and prefill FLOPs of a Llama config (bf16)."""
    c = json.loads((CONFIGS / name / "config.json").read_text())
    h, inter, layers, heads = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        c["num_attention_heads"],
    )
    kvh, vocab = c["num_key_value_heads"], c["vocab_size"]
    d = c.get("head_dim") or h // heads
    per_layer = h * (heads * d + 2 * kvh * d) + heads * d * h + 3 * h * inter + 2 * h
    tied = c.get("tie_word_embeddings", False)
    return {
        "params": layers * per_layer + h * vocab * (1 if tied else 2) + h,
        "decode_weight_bytes": 2 * (layers * per_layer + h * vocab + h),  # lm_head read whole
        "kv_bytes_per_token": layers * 2 * kvh * d * 2,
        "layer_matmul_params": layers * (per_layer - 2 * h),
        "attn_flop_coef": layers * 4 * heads * d,  # x n(n+1)/2 for a causal prefill of n
        "lm_head_flops": 2 * h * vocab,
    }


def prefill_flops(nums: dict[str, float], n: int) -> float:
    return (
        2 * n * nums["layer_matmul_params"]
        + nums["attn_flop_coef"] * n * (n + 1) / 2
        + nums["lm_head_flops"]
    )


def token_range(vocab: int) -> tuple[int, int]:
    """``[lo, hi)`` of a benchmark's random token ids: 1000 to 120000 (what the Llama-3 rows
    were measured with), clipped to the model's vocabulary. Mixtral's has 32,000 ids: past
    it the embedding's gather reads out of bounds, a device-side assert on the GPU."""
    hi = min(120_000, vocab)
    return min(1000, hi // 2), hi


def prompts(n: int, length: int, seed: int, vocab: int = 120_000) -> list[list[int]]:
    """``n`` random prompts in ``token_range(vocab)`` (pass the model's ``vocab_size``;
    the default is for the Llama-3 configs, whose vocabularies are larger)."""
    lo, hi = token_range(vocab)
    rng = random.Random(seed)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def make_engine(model: str, backend: str, graphs: bool, opts: str = "") -> Any:
    """``opts``: comma-separated variant flags: ``unfused`` (EngineConfig.fused_ops off),
    ``sync`` (async scheduling off), ``cublas`` (every projection through cuBLAS, no GEMV),
    ``fp8`` (FP8 weights quantized at load, docs/quantization.md)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.models.triton_ops import TritonOps

    flags = set(filter(None, opts.split(",")))
    TritonOps.use_gemv = "cublas" not in flags  # read while the graphs are captured
    cfg = EngineConfig(
        model=str(CONFIGS / model),
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        attention_backend=backend,
        max_model_len=4096,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.9,
        cuda_graphs=graphs,
        fused_ops="unfused" not in flags,
        async_scheduling=False if "sync" in flags else None,
        quantization="fp8" if "fp8" in flags else None,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    log.info(
        "engine %s/%s ready (build incl. graph capture %.1f s)",
        model,
        backend,
        time.perf_counter() - t0,
    )
    return engine


def run_batch(engine: Any, batch: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    """Add every prompt at once, step until done; wall time, output tokens, per-step times."""
    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(f"{tag}-{i}", p, params)
    first: dict[str, float] = {}
    steps: list[float] = []
    n_out = 0
    while engine.has_unfinished():
        ts = time.perf_counter()
        outs = engine.step()
        te = time.perf_counter()
        steps.append(te - ts)
        for o in outs:
            n_out += len(o.new_token_ids)
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = te - t0
    return {
        "total_s": time.perf_counter() - t0,
        "out_tokens": n_out,
        "steps": steps,
        "ttft": sorted(first.values()),
    }


def fit_context(engine: Any, bs: int, ctx: int) -> int:
    """The longest context up to ``ctx`` for which ``bs`` requests have distinct KV blocks
    in the engine's pool (block 0 is never handed out); 0 if not even one block each."""
    runner = engine.runner
    per = min(-(-ctx // runner.block_size), (runner.num_blocks - 1) // bs)
    return min(ctx, per * runner.block_size)


def decode_step_inputs(engine: Any, bs: int, ctx: int) -> tuple[Any, Any, Any]:
    """Inputs of one decode step: ``bs`` requests of ``ctx`` tokens on distinct random
    blocks, with token ids inside the model's vocabulary (``token_range``)."""
    from engine.attention.base import AttentionMetadata

    runner = engine.runner
    blk, dev = runner.block_size, runner.device
    per = -(-ctx // blk)
    if fit_context(engine, bs, ctx) < ctx:
        raise ValueError(
            f"{bs} requests of {ctx} tokens need {bs * per} KV blocks; the pool has "
            f"{runner.num_blocks - 1} (the longest context that fits at this batch: "
            f"{fit_context(engine, bs, ctx)} tokens)"
        )
    ids = (torch.randperm(runner.num_blocks - 1, device=dev)[: bs * per] + 1).view(bs, per)
    last = ctx - 1
    meta = AttentionMetadata(
        slot_mapping=ids[:, last // blk].long() * blk + last % blk,
        query_start_loc=torch.arange(bs + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((bs,), ctx, dtype=torch.int32, device=dev),
        block_tables=ids.to(torch.int32),
        max_query_len=1,
        max_seq_len=ctx,
        query_start_loc_cpu=list(range(bs + 1)),
        seq_lens_cpu=[ctx] * bs,
    )
    tokens = torch.randint(*token_range(engine.args.vocab_size), (bs,), device=dev)
    pos = torch.full((bs,), last, device=dev)
    return tokens, pos, meta


def decode_step(engine: Any, bs: int, ctx: int) -> Callable[[], Any]:
    """One decode step (``bs`` requests, ``ctx`` tokens each) as a callable: the captured
    graph's replay when the engine has decode graphs, else the model run eagerly (the CPU)."""
    tokens, pos, meta = decode_step_inputs(engine, bs, ctx)
    runner = engine.runner
    if runner.graphs is not None:
        graphs = runner.graphs
        return lambda: graphs.run(tokens, pos, meta)
    model = runner.model

    def eager() -> Any:
        with torch.inference_mode():
            return model.compute_logits(model(tokens, pos, runner.kv_cache, meta))

    return eager


def gpu_step_ms(engine: Any, bs: int, ctx: int) -> float:
    """GPU time of one graphed decode step (``bs`` requests, ``ctx`` tokens each), no host work."""
    return bench_ms(decode_step(engine, bs, ctx), engine.runner.device, rep_ms=300)
