"""Per-shape attention kernel times: FlashAttention-4 vs our Triton kernel on one paged cache.

Reproduces the table behind ``SHAPE_TABLE`` in engine/attention/flash_attn.py (the 8B head
shape: 32 query heads, 8 KV heads, dim 128, bf16, 16-token pages): batch-1 decode, batch-64
and batch-256 decode, one 2k prefill, chunked prefill 4 x 512 queries over a 2k context, and
a longer chunk (2k queries over 8k). Each shape: both kernels on the same cache and
metadata, their outputs compared, median of CUDA-event timings (triton.testing.do_bench).
``--e2e`` adds engine rows (``attention_backends_e2e``): ``auto`` vs ``triton``.

    python3 -m benchmarks.gpu.attention_backends --out benchmarks/results/gpu/attention_backends_h200.json

Needs a CUDA GPU and the flash-attn-4 package (benchmarks/gpu/fa4_wheels.sh).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from benchmarks.gpu.gpu_bench_kernels import bench_ms, paged_problem
from benchmarks.record import recorded_command, result_path
from engine.attention.flash_attn import flash_attn_paged, step_shape
from engine.attention.triton_backend import paged_attention, write_kv_cache

log = logging.getLogger("attention_backends")

# name: (batch, context per request, new query tokens per request)
SHAPES = {
    "decode_b1_ctx512": (1, 512, 1),
    "decode_b64_ctx2k": (64, 2048, 1),
    "decode_b256_ctx1536": (256, 1536, 1),
    "prefill_b1_2k": (1, 2048, 2048),
    "chunked_4x512_over_2k": (4, 2048, 512),
    "chunked_1x2k_over_8k": (1, 8192, 2048),
}
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def measure(name: str, rep_ms: int) -> dict[str, object]:
    batch, ctx, q_len = SHAPES[name]
    dev = torch.device("cuda")
    q, k, v, cache, meta = paged_problem(batch, ctx, q_len, HEADS, KV_HEADS, HEAD_DIM, BLOCK, dev)
    write_kv_cache(k, v, cache, meta.slot_mapping)
    scale = HEAD_DIM**-0.5
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def tri() -> torch.Tensor:
        return paged_attention(q, cache, meta, scale, num_sms=sms)

    def fa4() -> torch.Tensor:
        return flash_attn_paged(q, cache, meta, scale)

    a, b = tri().float(), fa4().float()  # the first FA4 call JIT-compiles (seconds)
    rel = float((a - b).norm() / a.norm())
    row: dict[str, object] = {
        "batch": batch,
        "context": ctx,
        "query_len": q_len,
        "step_shape": step_shape(meta),
        "rel_diff": rel,
        "triton_ms": bench_ms(tri, dev, rep_ms),
        "fa4_ms": bench_ms(fa4, dev, rep_ms),
    }
    row["fa4_speedup"] = float(row["triton_ms"]) / float(row["fa4_ms"])  # type: ignore[arg-type]
    log.info("%s %s", name, json.dumps(row))
    return row


def markdown(rows: dict[str, dict[str, object]]) -> str:
    lines = [
        "| shape | batch | context | queries/req | Triton ms | FA4 ms | Triton/FA4 | rel diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['batch']} | {r['context']} | {r['query_len']} | "
            f"{r['triton_ms']:.3f} | {r['fa4_ms']:.3f} | {r['fa4_speedup']:.2f} | "
            f"{r['rel_diff']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out",
        type=Path,
        default=result_path("gpu", "attention_backends.json"),
        help="JSON results file",
    )
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench time per kernel")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shape names")
    ap.add_argument("--e2e", action="store_true", help="also the engine rows, auto vs triton")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import flash_attn.cute  # noqa: F401  (a clear ImportError without the package)

    rows = {name: measure(name, args.rep_ms) for name in args.shapes.split(",")}
    result = {
        "command": recorded_command("benchmarks.gpu.attention_backends"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flash_attn_4": _version("flash-attn-4"),
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(markdown(rows))
    if args.e2e:
        from benchmarks.gpu.attention_backends_e2e import e2e_markdown, run_e2e

        def save(e2e: dict[str, object]) -> None:
            result["e2e"] = e2e
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))

        print(e2e_markdown(run_e2e(save)))


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    main()
