"""FP8 GEMM choices at decode batch sizes, per Llama-3.1-8B projection (the peer report's
open FP8 question: which path streams FP8 weights at bandwidth at 16-256 rows).

    python -m benchmarks.peers.fp8_gemm_shapes [--json benchmarks/results/peers/fp8_gemm_shapes_h200.json]

For each projection (N, K) and rows M, median microseconds (CUDA events, 50 runs after 10
warm-ups) of: the bf16 ``mm``; ``torch._scaled_mm`` row-wise (our path: per-token x
per-channel scales); ``torch._scaled_mm`` tensor-wise (one scale each, vLLM's dynamic FP8
default); the tensor-wise one with A and B swapped (``W @ x.T``, so the large N is the
GEMM's M); plus the effective weight bandwidth of each (bytes of the weight / time).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 16, 32, 64, 128, 256)


def time_us(fn: Any) -> float:
    import torch

    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(50):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2]


def measure(m: int, k: int, w16: Any, wq: Any, w_scale_rows: Any, one: Any) -> dict[str, float]:
    import torch

    x16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq = x16.to(torch.float8_e4m3fn)
    x_scale_rows = torch.ones((m, 1), device="cuda")
    bf16 = torch.bfloat16
    res = {
        "bf16_mm": time_us(lambda: x16 @ w16.t()),
        "fp8_rowwise": time_us(
            lambda: torch._scaled_mm(
                xq, wq.t(), scale_a=x_scale_rows, scale_b=w_scale_rows, out_dtype=bf16
            )
        ),
        "fp8_tensorwise": time_us(
            lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=bf16)
        ),
    }
    if m % 16 == 0:
        res["fp8_tensorwise_swapped"] = time_us(
            lambda: torch._scaled_mm(wq, xq.t(), scale_a=one, scale_b=one, out_dtype=bf16)
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--json", default="benchmarks/results/peers/fp8_gemm_shapes_h200.json")
    args = ap.parse_args()
    import torch

    fp8 = torch.float8_e4m3fn
    out: dict[str, Any] = {
        "command": "python -m benchmarks.peers.fp8_gemm_shapes",
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(),
        "rows": {},
    }
    for name, (n, k) in SHAPES.items():
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq = w16.to(fp8)
        w_scale_rows = torch.full((1, n), 0.01, device="cuda")
        one = torch.ones((), device="cuda")
        for m in ROWS:
            res = measure(m, k, w16, wq, w_scale_rows, one)
            weight_bytes = {"bf16_mm": 2 * n * k}
            for key in list(res):
                gbs = weight_bytes.get(key, n * k) / (res[key] * 1e-6) / 1e9
                res[f"{key}_weight_GBps"] = round(gbs, 1)
                res[key] = round(res[key], 2)
            out["rows"][f"{name}_m{m}"] = res
            print(name, m, res, flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
