"""Whether the fused FP8 activation kernels pay (engine/models/triton_fp8_fused.py;
``EngineConfig.fp8_fused_quant``), on the Llama-3.1-8B shape with dummy weights.

* ``kernels``: RMSNorm(+residual) then the one-launch quantizer against the fused
  norm+quantize kernel (K = 4096), and SiLU·mul then the quantizer against the fused one
  (14336 columns), per call inside a CUDA graph of 20 calls (what a graphed step sees),
  at several row counts.
* ``steps``: the FP8 (weights + KV) model's graphed step with the fusions off and on:
  pure decode at batch 64/128/256 (decode graphs) and mixed steps of decodes plus a prefill
  chunk (mixed graphs), ``--context`` tokens of context per decode.

    python -m benchmarks.gpu.fp8_fusions --out benchmarks/results/gpu/fp8_fusions_h100.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.mixed_step import BLOCK, _step, _time
from benchmarks.record import CONFIGS, recorded_command, write_report

ROWS = (8, 32, 128, 256, 512, 2048)
DECODE_BATCHES = (64, 128, 256)
MIXED = ((128, 128), (255, 257), (128, 896))  # <= 256 requests a step (max_num_seqs)


def _graphed_us(fn: Any, calls: int = 20) -> float:
    """Microseconds per ``fn()`` replayed inside one CUDA graph of ``calls`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return _time(graph.replay, 20) * 1e3 / calls


def kernels() -> list[dict]:
    rows = []
    for m in ROWS:
        rows.append(_kernel_row(m))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _kernel_row(m: int) -> dict:
    from engine.models.fp8 import _MIN_SCALE, FP8_MAX
    from engine.models.triton_fp8_fused import rms_norm_fp8, silu_mul_fp8
    from engine.models.triton_fp8_quant import quantize_rows_triton
    from engine.models.triton_ops import TritonOps

    w = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(m, 4096, dtype=torch.bfloat16, device="cuda")
    res = torch.randn_like(x)
    gu = torch.randn(m, 2 * 14336, dtype=torch.bfloat16, device="cuda")

    def norm_unfused() -> None:
        h, _ = TritonOps.add_rms_norm(x, res, w, 1e-5)
        quantize_rows_triton(h, FP8_MAX, _MIN_SCALE)

    def silu_unfused() -> None:
        quantize_rows_triton(TritonOps.silu_mul(gu), FP8_MAX, _MIN_SCALE)

    return {
        "rows": m,
        "norm_unfused_us": round(_graphed_us(norm_unfused), 2),
        "norm_fused_us": round(_graphed_us(lambda: rms_norm_fp8(x, res, w, 1e-5)), 2),
        "silu_unfused_us": round(_graphed_us(silu_unfused), 2),
        "silu_fused_us": round(_graphed_us(lambda: silu_mul_fp8(gu)), 2),
    }


def _set_fusions(model: Any, on: bool) -> None:
    for layer in model.layers:
        layer.fp8_fused = on
        layer.mlp.fp8_fused = on


def _capture(model: Any, cache: torch.Tensor, max_len: int) -> tuple[Any, Any]:
    from engine.executor.cuda_graphs import DecodeGraphs
    from engine.executor.mixed_graphs import MixedGraphs, mixed_buckets

    decode = DecodeGraphs(
        lambda ids, pos, meta: model.compute_logits(model(ids, pos, cache, meta)),
        max_model_len=max_len, max_blocks_per_req=max_len // BLOCK,
        device=torch.device("cuda"), buckets=list(DECODE_BATCHES),
    )  # fmt: skip
    decode.capture()
    ladder = mixed_buckets(2048)
    mixed = MixedGraphs(
        lambda ids, pos, meta: model(ids, pos, cache, meta),
        buckets=sorted({next(t for t in ladder if t >= d + c) for d, c in MIXED}),
        max_num_seqs=256, max_model_len=max_len, max_blocks_per_req=max_len // BLOCK,
        hidden_size=model.args.hidden_size, dtype=torch.bfloat16, device=torch.device("cuda"),
    )  # fmt: skip
    mixed.capture()
    return decode, mixed


def _time_step(model: Any, decode: Any, mixed: Any, step: tuple, iters: int) -> float:
    ids, pos, meta, last, _ = step
    if meta.max_query_len == 1:
        return _time(lambda: decode.run(ids, pos, meta), iters)
    return _time(lambda: model.compute_logits(mixed.run(ids, pos, meta)[last]), iters)


def steps(config: Path, context: int, iters: int) -> list[dict]:
    from engine.attention.kv_quant import FP8_DTYPE
    from engine.attention.triton_backend import TritonAttention
    from engine.models import ModelArgs, build_model
    from engine.models.fp8_loader import Fp8Scheme

    args = ModelArgs.from_hf(json.loads((config / "config.json").read_text()))
    max_len = 4096
    model = build_model(
        args, "", "dummy", TritonAttention(), max_len, torch.bfloat16, "cuda", 0,
        fused_ops=True, quantization=Fp8Scheme(from_checkpoint=False),
    )  # fmt: skip
    cases = [(b, 0) for b in DECODE_BATCHES] + list(MIXED)
    built = [_step(d, c, context, args.vocab_size, "cuda") if c else None for d, c in cases]
    decode_inputs = {b: _step(b - 1, 1, context, args.vocab_size, "cuda") for b in DECODE_BATCHES}
    blocks = max(s[4] for s in [*filter(None, built), *decode_inputs.values()])
    cache = torch.zeros(
        (args.num_layers, 2, blocks, BLOCK, args.num_kv_heads, args.head_dim),
        dtype=FP8_DTYPE, device="cuda",
    )  # fmt: skip
    times: dict[tuple[int, int, bool], float] = {}
    with torch.inference_mode():
        for on in (False, True):
            _set_fusions(model, on)
            decode, mixed = _capture(model, cache, max_len)
            for (d, c), step in zip(cases, built, strict=True):
                times[(d, c, on)] = _time_step(
                    model, decode, mixed, step or decode_inputs[d], iters
                )
    rows = []
    for d, c in cases:
        off, on = times[(d, c, False)], times[(d, c, True)]
        rows.append(
            {
                "step": f"decode x{d}" if not c else f"{d} decodes + {c}-token chunk",
                "off_ms": round(off, 3),
                "on_ms": round(on, 3),
                "speedup": round(off / on, 3),
            }  # fmt: skip
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--config", default=str(CONFIGS / "llama-3.1-8b"))
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--skip-steps", action="store_true", help="the kernel rows only")
    a = p.parse_args()
    report: dict[str, Any] = {
        "command": recorded_command("benchmarks.gpu.fp8_fusions"),
        "kernels": kernels(),
    }
    if not a.skip_steps:
        report["steps"] = steps(Path(a.config), a.context, a.iters)
    write_report(report, a.out, "cuda")


if __name__ == "__main__":
    main()
