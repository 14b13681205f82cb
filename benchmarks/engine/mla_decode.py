"""MLA decode attention: the absorbed form (what a decode step runs, engine/models/mla.py)
against the expanded form (the context's latents up-projected to per-head keys and values
every step), one layer at DeepSeek-V2-Lite's sizes (16 heads, latent 512 + 64, nope 128,
v 128), attention only (the projections of q and the output are the same in both).

    python -m benchmarks.engine.mla_decode [--device cpu|cuda] [--dtype float32|bfloat16]

Writes benchmarks/results/engine/mla_decode.json (and .md)."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from benchmarks.record import recorded_command, result_path, write_report
from engine.distributed.tp_group import TPGroup
from engine.models.config import ModelArgs
from engine.models.deepseek_args import MLAArgs
from engine.models.mla import MLAttention, gather_latent
from engine.models.parallel import Shard
from engine.models.rope import RotaryEmbedding

BLOCK = 16


def _layer(device: str, dtype: torch.dtype) -> MLAttention:
    m = MLAArgs(None, 512, 128, 64, 128, 192**-0.5)
    args = ModelArgs(
        architecture="DeepseekV2ForCausalLM", vocab_size=10, hidden_size=2048,
        intermediate_size=1, num_layers=1, num_heads=16, num_kv_heads=1, head_dim=64,
        rms_norm_eps=1e-6, rope_theta=10000.0, mla=m,
    )  # fmt: skip
    with torch.device(device):
        layer = MLAttention(Shard(args), RotaryEmbedding(64, 8, 10000.0, {}), TPGroup.single())
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    return layer.to(dtype)


def _time(fn: Any, device: str, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _case(layer: MLAttention, ctx_len: int, batch: int, device: str, reps: int) -> dict[str, Any]:
    m, dtype = layer.m, layer.kv_b_proj.weight.dtype
    width = -(-ctx_len // BLOCK)
    cache = torch.randn(1, batch * width, BLOCK, 1, m.latent_dim, dtype=dtype, device=device)
    tables = torch.arange(batch * width, device=device, dtype=torch.int32).view(batch, width)
    q_nope = torch.randn(batch, 16, m.qk_nope_head_dim, dtype=dtype, device=device)
    q_pe = torch.randn(batch, 16, m.qk_rope_head_dim, dtype=dtype, device=device)
    lens = torch.full((batch,), ctx_len, dtype=torch.int32, device=device)
    from engine.attention.base import AttentionMetadata

    meta = AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, device=device), query_start_loc=lens,
        seq_lens=lens, block_tables=tables, max_query_len=1, max_seq_len=ctx_len,
        query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[ctx_len] * batch,
    )  # fmt: skip

    def absorbed() -> None:
        layer._decode_batch(q_nope, q_pe, cache, meta)

    def expanded() -> None:
        for i in range(batch):
            ctx = gather_latent(cache, tables[i], ctx_len)
            layer._expanded(q_nope[i : i + 1], q_pe[i : i + 1], ctx)

    with torch.inference_mode():
        a, e = _time(absorbed, device, reps), _time(expanded, device, reps)
    return {"context": ctx_len, "batch": batch, "absorbed_ms": round(a, 3),
            "expanded_ms": round(e, 3), "speedup": round(e / a, 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    layer = _layer(a.device, getattr(torch, a.dtype))
    rows = [_case(layer, n, b, a.device, a.reps) for n in (256, 1024, 4096) for b in (1, 8)]
    name = "mla_decode" + ("" if a.device == "cpu" else "_gpu")
    out = a.out or result_path("engine", f"{name}.json")
    report = {"command": recorded_command("benchmarks.engine.mla_decode"), "device": a.device,
              "dtype": a.dtype, "threads": torch.get_num_threads(),
              # A shared machine: its load says how far apart repeated runs may land.
              "load_average_1m": round(os.getloadavg()[0], 1), "rows": rows}  # fmt: skip
    write_report(report, out, a.device)
    lines = ["| context | batch | absorbed ms | expanded ms | expanded / absorbed |",
             "|---|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| {r['context']} | {r['batch']} | {r['absorbed_ms']} | {r['expanded_ms']} | "
        f"{r['speedup']} |"
        for r in rows
    ]
    md = (
        f"`{report['command']}` ({a.device}, {a.dtype}, {report['threads']} threads, "
        f"load average {report['load_average_1m']})\n\n"
    )
    result_path("engine", f"{name}.md").write_text(md + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
