"""Attention-kernel microbenchmarks for gpu_bench.py: Triton paged attention vs torch.

Per shape: the Triton backend with its automatic tiles, a tile sweep (each variant checked
against the automatic one), the torch_ref backend, and dense unpaged SDPA (torch's own
flash/efficient kernels on contiguous K/V) as the speed reference. Also the K/V write.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.attention.base import AttentionMetadata

log = logging.getLogger("gpu_bench")


class Results:
    """Nested dict written to JSON after every ``put``."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def put(self, section: str, key: str, value: Any) -> None:
        self.data.setdefault(section, {})[key] = value
        log.info("%s/%s = %s", section, key, json.dumps(value)[:300])
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=1))


def bench_ms(fn: Callable[[], Any], dev: torch.device, rep_ms: int = 100) -> float:
    """Median milliseconds per call (CUDA events via do_bench; wall clock on the CPU)."""
    if dev.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---------------------------------------------------------------- kernels


def paged_problem(
    batch: int,
    ctx: int,
    q_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block: int,
    dev: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random bf16 cache with shuffled blocks; each request: ``ctx`` tokens, last ``q_len`` new."""
    per = -(-ctx // block)
    num_blocks = batch * per + 1
    cache = torch.randn(
        (2, num_blocks, block, kv_heads, head_dim), device=dev, dtype=torch.bfloat16
    )
    tables = (
        (torch.randperm(num_blocks - 1, device=dev)[: batch * per] + 1)
        .view(batch, per)
        .to(torch.int32)
    )
    pos = torch.arange(ctx - q_len, ctx, device=dev)
    slots = (tables[:, pos // block].long() * block + pos % block).reshape(-1)
    qsl = list(range(0, batch * q_len + 1, q_len))
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
        block_tables=tables,
        max_query_len=q_len,
        max_seq_len=ctx,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=[ctx] * batch,
    )
    q = torch.randn((batch * q_len, heads, head_dim), device=dev, dtype=torch.bfloat16)
    k = torch.randn((batch * q_len, kv_heads, head_dim), device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return q, k, v, cache, meta


def _sweep(decode: bool, group: int, tiny: bool) -> list[Any]:
    from engine.attention.triton_backend import LaunchConfig

    if tiny:
        return [LaunchConfig(1 if decode else 16 // group, 16, 16, 1, decode)]
    out = []
    if decode:
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    out.append(LaunchConfig(1, 16, bn, 0, True, warps, stages))
    else:
        for bm, warps in ((64, 4), (128, 4), (128, 8)):
            for bn in (32, 64, 128):
                for stages in (2, 3):
                    out.append(LaunchConfig(bm // group, bm, bn, 1, False, warps, stages))
    return out


def bench_attention_case(
    res: Results, name: str, shape: dict[str, int], dev: torch.device, tiny: bool, sweep_tiles: bool
) -> None:
    """One shape: auto config, the tile sweep (each checked against auto), torch_ref, dense SDPA."""
    import dataclasses

    import torch.nn.functional as F

    from engine.attention.torch_ref import TorchRefAttention
    from engine.attention.triton_backend import TritonAttention, choose_config, paged_attention

    b, ctx, ql, h, kvh, d = (
        shape[k] for k in ("batch", "ctx", "q_len", "heads", "kv_heads", "head_dim")
    )
    q, k, v, cache, meta = paged_problem(b, ctx, ql, h, kvh, d, shape.get("block", 16), dev)
    scale = d**-0.5
    sms = (
        torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else None
    )
    backend = TritonAttention()
    row: dict[str, Any] = dict(shape)
    row["triton_fwd_ms"] = bench_ms(lambda: backend.forward(q, k, v, cache, meta, scale), dev)
    auto = choose_config(
        max_query_len=ql,
        max_seq_len=ctx,
        num_reqs=b,
        num_tokens=b * ql,
        num_kv_heads=kvh,
        group=h // kvh,
        dtype=torch.bfloat16,
        num_sms=sms,
    )
    ref_out = paged_attention(q, cache, meta, scale, num_sms=sms, config=auto)
    row["auto_config"] = dataclasses.asdict(auto)
    row["triton_attn_ms"] = bench_ms(
        lambda: paged_attention(q, cache, meta, scale, num_sms=sms, config=auto), dev
    )
    sweep = []
    for cfg in _sweep(ql == 1, h // kvh, tiny) if sweep_tiles else []:
        if cfg.num_splits == 0:
            cfg = dataclasses.replace(cfg, num_splits=auto.num_splits)
        try:
            out = paged_attention(q, cache, meta, scale, num_sms=sms, config=cfg)
            err = float((out.float() - ref_out.float()).norm() / ref_out.float().norm())
            ms = bench_ms(
                lambda c=cfg: paged_attention(q, cache, meta, scale, num_sms=sms, config=c), dev
            )
            sweep.append({"cfg": dataclasses.asdict(cfg), "ms": round(ms, 4), "err_vs_auto": err})
        except Exception as exc:  # a tile shape the compiler rejects (e.g. shared memory)
            sweep.append({"cfg": dataclasses.asdict(cfg), "error": str(exc)[:200]})
    good = [s for s in sweep if "ms" in s and s["err_vs_auto"] < 2e-2]
    if good:
        row["best"] = min(good, key=lambda s: s["ms"])
    row["sweep"] = sweep
    if dev.type == "cuda":
        row["triton_graph_ms"] = graph_ms(
            lambda: paged_attention(q, cache, meta, scale, num_sms=sms, config=auto), dev
        )
    ref_backend = TorchRefAttention()
    row["torch_ref_fwd_ms"] = bench_ms(
        lambda: ref_backend.forward(q, k, v, cache, meta, scale), dev
    )
    # Dense, unpaged SDPA (torch's flash/efficient kernels) on contiguous K/V: a speed reference.
    qd = q.view(b, ql, h, d).transpose(1, 2)
    kd = torch.randn((b, kvh, ctx, d), device=dev, dtype=torch.bfloat16)
    vd = torch.randn_like(kd)
    causal = ql > 1
    row["sdpa_dense_ms"] = bench_ms(
        lambda: F.scaled_dot_product_attention(
            qd, kd, vd, is_causal=causal, scale=scale, enable_gqa=True
        ),
        dev,
    )
    kv_bytes = 2 * b * ctx * kvh * d * 2
    best_ms = min(
        row["triton_attn_ms"],
        row.get("triton_graph_ms", math.inf),
        row.get("best", {}).get("ms", math.inf),
    )
    row["triton_GBps"] = round(kv_bytes / (best_ms * 1e-3) / 1e9, 1)
    flops = 4 * b * h * d * (ql * ctx - (ql * (ql - 1)) / 2)
    row["triton_TFLOPs"] = round(flops / (best_ms * 1e-3) / 1e12, 2)
    res.put("kernels", name, row)


def kernel_shapes(tiny: bool) -> dict[str, dict[str, int]]:
    big = {"heads": 32, "kv_heads": 8, "head_dim": 128}  # Llama-3.1-8B
    small = {"heads": 32, "kv_heads": 8, "head_dim": 64}  # Llama-3.2-1B
    if tiny:
        return {
            "tiny_decode": {
                "batch": 2,
                "ctx": 40,
                "q_len": 1,
                "heads": 4,
                "kv_heads": 2,
                "head_dim": 64,
            },
            "tiny_prefill": {
                "batch": 1,
                "ctx": 40,
                "q_len": 40,
                "heads": 4,
                "kv_heads": 2,
                "head_dim": 64,
            },
        }
    return {
        "decode_8b_b1_ctx512": {"batch": 1, "ctx": 512, "q_len": 1, **big},
        "decode_8b_b1_ctx32k": {"batch": 1, "ctx": 32768, "q_len": 1, **big},
        "decode_8b_b64_ctx2k": {"batch": 64, "ctx": 2048, "q_len": 1, **big},
        "decode_8b_b256_ctx1536": {"batch": 256, "ctx": 1536, "q_len": 1, **big},
        "decode_1b_b256_ctx1536": {"batch": 256, "ctx": 1536, "q_len": 1, **small},
        "prefill_8b_1x2k": {"batch": 1, "ctx": 2048, "q_len": 2048, **big},
        "prefill_8b_8x2k": {"batch": 8, "ctx": 2048, "q_len": 2048, **big},
        "prefill_1b_4x2k": {"batch": 4, "ctx": 2048, "q_len": 2048, **small},
    }


def graph_ms(fn: Callable[[], Any], dev: torch.device, reps: int = 10) -> float:
    """Per-call GPU time of ``fn`` replayed from a CUDA graph (no launch overhead)."""
    fn()
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return bench_ms(g.replay, dev) / reps


def run_kernels(
    res: Results, dev: torch.device, tiny: bool, sweep: bool = True, only: str = ""
) -> None:
    from engine.attention.triton_backend import write_kv_cache

    for name, shape in kernel_shapes(tiny).items():
        if not name.startswith(only):
            continue
        bench_attention_case(res, name, shape, dev, tiny, sweep)
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    if only:
        return
    n = 64 if tiny else 16384
    q, k, v, cache, meta = paged_problem(1, n, n, 32, 8, 128, 16, dev)
    ms = bench_ms(lambda: write_kv_cache(k, v, cache, meta.slot_mapping), dev)
    moved = 2 * 2 * k.numel() * k.element_size()  # read K,V + write K,V
    res.put(
        "kernels", "write_kv_16k_tokens", {"ms": ms, "GBps": round(moved / (ms * 1e-3) / 1e9, 1)}
    )
