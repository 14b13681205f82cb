"""The fused MoE layer on the GPU (dummy weights): its FLOP/s against a dense GEMM at the
same token count, its batch-1 time against the weight-streaming roofline, and the tile
sweep that writes ``engine/models/moe_configs.json``.

Run on the H200 from the repo root:

    python -m benchmarks.gpu.moe_layer --tune --json benchmarks/results/gpu/moe_layer_h200.json

Rows per (shape, weight dtype, tokens):
- ``moe_ms``: router softmax/top-k + the fused experts (two grouped-GEMM launches), the
  median of CUDA-event timings;
- ``moe_tflops``: ``6 * tokens * top_k * hidden * inter`` (the experts' multiply-adds)
  over ``moe_ms``; ``dense_tflops``: the same FLOPs as two cuBLAS GEMMs of ``tokens *
  top_k`` rows through one expert-sized weight pair; ``ratio`` = moe / dense (target
  >= 0.70 at >= 256 tokens);
- at batch 1, ``roofline_ms``: the bytes of the k active experts' weights at the measured
  copy bandwidth (bytes read + written of a 1 GiB device copy), and ``vs_roofline`` (target
  <= 1.25).
``--tune`` sweeps tile configs per (shape, tokens) and saves the fastest as data; the
engine reads the file by shape key (engine/models/triton_moe.py). ``--tiny`` runs small
shapes on the CPU under TRITON_INTERPRET=1 (a dry run of the script itself).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.record import recorded_command

# (hidden, moe intermediate, experts, top_k)
SHAPES = {
    "qwen3_30b_a3b": (2048, 768, 128, 8),
    "mixtral_8x7b": (4096, 14336, 8, 2),
    "gpt_oss_20b": (2880, 2880, 32, 4),
}
TINY_SHAPES = {"tiny": (64, 32, 8, 2)}
TOKENS = (1, 8, 64, 256, 1024, 4096)


def _time_ms(fn: Any, device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    if device.type != "cuda":
        import time

        t = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(t)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 1 GiB device copy, counting bytes read + written."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device, 10)
    return 2 * n / (ms / 1e3)


def _weights(shape: tuple[int, int, int, int], fp8: bool, device: torch.device) -> tuple:
    from engine.models.fp8 import quantize_rows

    hidden, inter, n_exp, _ = shape
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    w13 = (torch.randn(n_exp, 2 * inter, hidden, device=device) * 0.02).to(dt)
    w2 = (torch.randn(n_exp, hidden, inter, device=device) * 0.02).to(dt)
    if not fp8:
        return w13, w2, None, None
    q13, s13 = quantize_rows(w13.reshape(-1, hidden))
    q2, s2 = quantize_rows(w2.reshape(-1, inter))
    return q13.view(w13.shape), q2.view(w2.shape), s13.view(n_exp, -1), s2.view(n_exp, -1)


def measure(
    name: str,
    shape: tuple[int, int, int, int],
    fp8: bool,
    tokens: int,
    device: torch.device,
    bandwidth: float | None,
    config: dict[str, int] | None = None,
    weights: tuple | None = None,
    iters: int = 20,
    dense: bool = True,
) -> dict[str, Any]:
    from engine.models.moe import route
    from engine.models.triton_moe import fused_experts

    hidden, inter, n_exp, top_k = shape
    w13, w2, s13, s2 = weights or _weights(shape, fp8, device)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, device=device).to(dt)
    router = torch.randn(n_exp, hidden, device=device).to(dt) * 0.02

    def moe() -> torch.Tensor:
        w, e = route(x @ router.T, top_k, True, dt)
        return fused_experts(x, w13, w2, w, e, s13, s2, config=config)

    ms = _time_ms(moe, device, iters)
    if not dense:
        return {"moe_ms": ms}
    rows = tokens * top_k
    a = torch.randn(rows, hidden, device=device).to(dt)
    b1 = torch.randn(2 * inter, hidden, device=device).to(dt)
    b2 = torch.randn(hidden, inter, device=device).to(dt)
    act = torch.randn(rows, inter, device=device).to(dt)
    dense_ms = _time_ms(lambda: (a @ b1.T, act @ b2.T), device, iters)
    flops = 6 * rows * hidden * inter
    row: dict[str, Any] = {
        "shape": name, "weights": "fp8" if fp8 else "bf16", "tokens": tokens,
        "moe_ms": round(ms, 4), "dense_ms": round(dense_ms, 4),
        "moe_tflops": round(flops / ms / 1e9, 2), "dense_tflops": round(flops / dense_ms / 1e9, 2),
        "ratio": round(dense_ms / ms, 3), "config": config,
    }  # fmt: skip
    if tokens == 1 and bandwidth:
        elem = 1 if fp8 else 2
        active = top_k * 3 * hidden * inter * elem + n_exp * hidden * 2
        roof = active / bandwidth * 1e3
        row |= {"roofline_ms": round(roof, 4), "vs_roofline": round(ms / roof, 3)}
    return row


# The tile sweep: the full one, and ``--quick`` (8 configs, a fraction of the compiles).
SWEEP = ((16, 32, 64, 128), (64, 128), (64, 128), (4, 8), (3,))
QUICK_SWEEP = ((16, 64), (64, 128), (64, 128), (4,), (3,))
TINY_SWEEP = ((16,), (16, 32), (32,), (4,), (1,))


def tune(
    name: str,
    shape: tuple,
    fp8: bool,
    tokens: int,
    device: torch.device,
    weights: tuple,
    sweep: tuple = SWEEP,
) -> dict[str, int]:
    """The fastest tile config for this shape and token count, by measurement."""
    best: tuple[float, dict[str, int]] | None = None
    for bm, bn, bk, warps, stages in itertools.product(*sweep):
        cfg = {
            "BLOCK_M": bm,
            "BLOCK_N": bn,
            "BLOCK_K": bk,
            "num_warps": warps,
            "num_stages": stages,
        }
        if bm > 16 and tokens * shape[3] < bm:
            continue  # a tile taller than all the rows
        try:
            iters = 8 if device.type == "cuda" else 1
            ms = measure(name, shape, fp8, tokens, device, None, cfg, weights, iters, False)[
                "moe_ms"
            ]
        except Exception:  # noqa: BLE001 - out of shared memory etc.: not a candidate
            continue
        if best is None or ms < best[0]:
            best = (ms, cfg)
    assert best is not None
    return best[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--tune", action="store_true", help="sweep tiles, save the best as data")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="--tune over 8 tile configs only")
    p.add_argument(
        "--config-out", type=Path, default=None,
        help="where --tune writes the table (default engine/models/moe_configs.json)",
    )  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="CPU dry run (TRITON_INTERPRET=1)")
    args = p.parse_args()
    from engine.models.triton_moe import CONFIG_FILE, shape_key

    # One table for every GPU kind: its keys start with the device name, and a run adds
    # its GPU's entries to what the file holds.
    config_out = args.config_out or CONFIG_FILE
    if args.tiny and args.tune and args.config_out is None:
        raise SystemExit("--tiny --tune needs --config-out (the engine's table is for GPUs)")
    sweep = TINY_SWEEP if args.tiny else QUICK_SWEEP if args.quick else SWEEP

    device = torch.device("cpu" if args.tiny else "cuda")
    shapes = TINY_SHAPES if args.tiny else {s: SHAPES[s] for s in args.shapes.split(",")}
    tokens = (1, 8) if args.tiny else tuple(int(t) for t in args.tokens.split(","))
    bandwidth = None if args.tiny else copy_bandwidth(device)
    table = json.loads(config_out.read_text()) if config_out.exists() else {}
    rows = []
    for name, shape in shapes.items():
        for fp8 in (False, True):
            weights = _weights(shape, fp8, device)
            gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            dtype = weights[0].dtype
            for t in tokens:
                cfg = None
                if args.tune:
                    cfg = tune(name, shape, fp8, t, device, weights, sweep)
                    key = shape_key(shape[2], 2 * shape[1], shape[0], dtype, gpu)
                    table.setdefault(key, {})[str(t * shape[3])] = cfg
                row = measure(name, shape, fp8, t, device, bandwidth, cfg, weights)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:
                    out = {
                        "command": recorded_command("benchmarks.gpu.moe_layer"), "gpu": gpu,
                        "copy_bandwidth_gbs": bandwidth and bandwidth / 1e9, "rows": rows,
                    }  # fmt: skip
                    args.json.write_text(json.dumps(out, indent=1))
            del weights
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.tune:
        config_out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"tuned tiles written to {config_out}")


if __name__ == "__main__":
    main()
