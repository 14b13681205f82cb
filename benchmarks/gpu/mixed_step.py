"""One mixed prefill+decode step, eager against replayed from a mixed CUDA graph
(engine/executor/mixed_graphs.py), on the Llama-3.1-8B shape with dummy weights.

A step is ``decodes`` requests each decoding one token at ``--context`` tokens of context
(they share their context's blocks: only the reads matter) beside one prefill chunk of
``chunk`` new tokens. Both sides run the same model object with the fused Triton ops and
the Triton attention backend; the graph side includes its input copies into the static
buffers, and both compute the logits of each request's last row. Times are CUDA-event
medians of ``--iters`` steps after warm-up; ``rel_err`` is the graphed logits' relative
distance from the eager ones (bf16: up to ~1e-2 is the GEMMs' row-count dependence).

    python -m benchmarks.gpu.mixed_step --out benchmarks/results/gpu/mixed_step_h100.json
    python -m benchmarks.gpu.mixed_step --precision fp8 --iters 10 --out /tmp/m.json

A dry run of the script on the CPU (Triton's interpreter; graphs stand-ins that rerun the
step, so its times mean nothing): ``TRITON_INTERPRET=1 python -m benchmarks.gpu.mixed_step
--device cpu --config TINY --cases 8+8,3+30 --context 32 --iters 1 --out /tmp/m.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.record import CONFIGS, recorded_command, write_report

# (decodes, chunk): total tokens 128, 256, 501 (padded to 512), 512, 1024, 1032 (1088), 2048;
# at most 255 decodes, so a step holds max_num_seqs = 256 requests with its chunk.
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}  # fmt: skip
CASES = ((64, 64), (128, 128), (200, 301), (255, 257), (128, 896), (32, 1000), (255, 1793))
BLOCK = 16


def _step(decodes: int, chunk: int, context: int, vocab: int, dev: str) -> tuple[Any, ...]:
    """Inputs of one step: ``decodes`` one-token requests after ``context`` shared tokens,
    then one request's first ``chunk`` prompt tokens in blocks of its own."""
    from engine.attention.base import AttentionMetadata

    shared = list(range(1, context // BLOCK + 1))
    nxt = len(shared) + 1
    tables, slots, pos = [], [], []
    for _ in range(decodes):
        tables.append([*shared, nxt])
        slots.append(nxt * BLOCK + context % BLOCK)
        pos.append(context)
        nxt += 1
    own = list(range(nxt, nxt + -(-chunk // BLOCK)))
    tables.append(own)
    slots += [own[p // BLOCK] * BLOCK + p % BLOCK for p in range(chunk)]
    pos += list(range(chunk))
    width = max(len(t) for t in tables)
    bt = torch.zeros((len(tables), width), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    starts = list(range(decodes + 1)) + [decodes + chunk]
    seq_lens = [context + 1] * decodes + [chunk]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=bt.to(dev),
        max_query_len=chunk,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    ids = torch.randint(0, vocab, (decodes + chunk,), device=dev)
    last = torch.tensor([s - 1 for s in starts[1:]], device=dev)
    return ids, torch.tensor(pos, device=dev), meta, last, nxt + len(own)


def _time(fn: Any, iters: int) -> float:
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():  # the CPU dry run
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run_precision(
    precision: str, config: str, context: int, iters: int, cases: list[tuple[int, int]], dev: str
) -> list[dict]:
    from engine.attention.kv_quant import FP8_DTYPE
    from engine.attention.triton_backend import TritonAttention
    from engine.executor.mixed_graphs import EagerCapture, MixedGraphs, mixed_buckets
    from engine.models import ModelArgs, build_model
    from engine.models.fp8_loader import Fp8Scheme

    hf = TINY if config == "TINY" else json.loads((Path(config) / "config.json").read_text())
    args = ModelArgs.from_hf(hf)
    fp8 = precision == "fp8"
    max_len = 4096
    model = build_model(
        args, "", "dummy", TritonAttention(), max_len, torch.bfloat16, dev, 0,
        fused_ops=True, quantization=Fp8Scheme(from_checkpoint=False) if fp8 else None,
    )  # fmt: skip
    steps = [_step(d, c, context, args.vocab_size, dev) for d, c in cases]
    num_blocks = max(s[4] for s in steps)
    cache = torch.zeros(
        (args.num_layers, 2, num_blocks, BLOCK, args.num_kv_heads, args.head_dim),
        dtype=FP8_DTYPE if fp8 else torch.bfloat16,
        device=dev,
    )
    ladder = mixed_buckets(2048)
    wanted = sorted({next(t for t in ladder if t >= d + c) for d, c in cases})
    graphs = MixedGraphs(
        lambda ids, pos, meta: model(ids, pos, cache, meta),
        buckets=wanted, max_num_seqs=256, max_model_len=max_len,
        max_blocks_per_req=max_len // BLOCK, hidden_size=args.hidden_size,
        dtype=torch.bfloat16, device=torch.device(dev),
        make_capture=None if dev == "cuda" else EagerCapture,
    )  # fmt: skip
    with torch.inference_mode():
        graphs.capture()
        return [_measure(model, cache, graphs, step, precision, iters) for step in steps]


def _measure(
    model: Any, cache: torch.Tensor, graphs: Any, step: tuple[Any, ...], precision: str, iters: int
) -> dict:
    ids, pos, meta, last, _ = step
    decodes, chunk = meta.num_reqs - 1, ids.shape[0] - meta.num_reqs + 1

    def eager() -> torch.Tensor:
        return model.compute_logits(model(ids, pos, cache, meta)[last])

    def graphed() -> torch.Tensor:
        return model.compute_logits(graphs.run(ids, pos, meta)[last])

    ref, got = eager(), graphed()
    err = float((got - ref).norm() / ref.norm())
    e_ms, g_ms = _time(eager, iters), _time(graphed, iters)
    row = {
        "precision": precision, "decodes": decodes, "chunk": chunk, "tokens": decodes + chunk,
        "bucket": graphs.bucket_for(decodes + chunk, decodes + 1),
        "eager_ms": round(e_ms, 3), "graph_ms": round(g_ms, 3),
        "speedup": round(e_ms / g_ms, 3), "rel_err": err,
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| precision | decodes + chunk = tokens (bucket) | eager ms | graph ms | speedup | rel err |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['precision']} | {r['decodes']} + {r['chunk']} = {r['tokens']} ({r['bucket']}) "
            f"| {r['eager_ms']:.2f} | {r['graph_ms']:.2f} | {r['speedup']:.2f}x | {r['rel_err']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--precision", default="bf16,fp8", help="comma-separated: bf16, fp8")
    p.add_argument("--config", default=str(CONFIGS / "llama-3.1-8b"), help="or TINY")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    p.add_argument("--cases", default="", help="DECODES+CHUNK,... (default: CASES)")
    p.add_argument("--context", type=int, default=512, help="each decode's context tokens")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("mixed_step needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1)")
    cases = [tuple(map(int, c.split("+"))) for c in a.cases.split(",") if c] or list(CASES)
    rows: list[dict] = []
    for precision in a.precision.split(","):
        rows += run_precision(precision, a.config, a.context, a.iters, cases, a.device)  # type: ignore[arg-type]
        gc.collect()  # the model and its graphs are garbage now; free them for the next
        torch.cuda.empty_cache()
    md = table(rows)
    print(md)
    report = {
        "command": recorded_command("benchmarks.gpu.mixed_step"),
        "model": Path(a.config).name, "context": a.context, "iters": a.iters,
        "rows": rows, "table": md,
    }  # fmt: skip
    write_report(report, a.out, a.device)


if __name__ == "__main__":
    main()
