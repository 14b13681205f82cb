"""Sweep the Triton GEMV's tiles (engine/models/triton_gemv.py) against cuBLAS at
Llama-3.1-8B's projections, batch 1 (and 2, 4 for qkv), to set ``gemv_config``'s table.

On the GPU machine, from the repo root (~350 compiles of ~0.15 s and ~850 timings of
~30 ms, so an estimated 2 minutes on an H200; each config is checked once against
``F.linear`` before it is timed):

    python -m benchmarks.gpu.gemv_sweep --json benchmarks/results/gpu/gemv_h200.json

On the CPU, as a smoke test of this script (tiny shapes, two configs, wall-clock times):

    TRITON_INTERPRET=1 python -m benchmarks.gpu.gemv_sweep --tiny --json /tmp/g.json

Times are ``triton.testing.do_bench`` medians, which flush L2 before every call: a decode
step streams 16 GB of weights, so no projection finds its weights in L2 (o_proj's 32 MiB
would fit in an H200's 50 MiB L2, and an unflushed loop would overstate it). GB/s counts
the weight bytes only (x and y are < 0.1% of the traffic).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.record import recorded_command
from engine.models.triton_gemv import GemvConfig, _launch, gemv, gemv_config

# name: (N, K) of Llama-3.1-8B's weights, and the row counts swept for each.
SHAPES_8B: dict[str, tuple[int, int]] = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
ROWS_8B = {"qkv": (1, 2, 4)}
TINY_SHAPES: dict[str, tuple[int, int]] = {"tiny_qkv": (48, 200), "tiny_o": (64, 128)}
TINY_ROWS = {"tiny_qkv": (1, 2)}
TINY_CONFIGS: list[GemvConfig] = [(16, 64, 4, 1), (8, 128, 2, 2)]

BLOCK_NS = (4, 8, 16, 32, 64)
BLOCK_KS = (128, 256, 512, 1024)
WARPS = (2, 4, 8)
STAGES = (1, 2, 3, 4)


def config_grid(n: int, k: int, m: int, dtype: torch.dtype, sms: int) -> list[GemvConfig]:
    """The sane part of BLOCK_NS x BLOCK_KS x WARPS x STAGES for one shape, plus the default.

    Dropped: grids of under ~one program per SM (no split-K, so the grid is all the
    parallelism) or over 64 per SM (tiny tiles, only launch overhead); tiles whose threads
    hold < 8 elements (one 16-byte load) or whose float32 accumulators, one set per row of
    x, pass 128 values a thread (spills); weight tiles outside 4-32 KiB; pipelines
    buffering more than 64 KiB of shared memory (occupancy falls to one program per SM).
    """
    rows = 1 << (m - 1).bit_length()
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    out = []
    for bn, bk, warps, stages in itertools.product(BLOCK_NS, BLOCK_KS, WARPS, STAGES):
        programs = -(-n // bn)
        per_thread = bn * bk // (32 * warps)
        tile = bn * bk * elem_bytes
        if (
            programs < 0.9 * sms
            or programs > 64 * sms
            or bk > max(128, 1 << (k - 1).bit_length())
            or per_thread < 8
            or per_thread * rows > 128
            or not 4096 <= tile <= 32768
            or (stages - 1) * tile > 65536
        ):
            continue
        out.append((bn, bk, warps, stages))
    default = gemv_config(n, k, dtype, m)
    return out if default in out else [default, *out]


def time_us(fn: Callable[[], Any], device: torch.device) -> float:
    """Median microseconds per call: do_bench (L2 flushed) on CUDA, wall clock on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return 1e3 * float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def max_rel_diff(y: torch.Tensor, want: torch.Tensor) -> float:
    y, want = y.float(), want.float()
    return float((y - want).abs().max() / want.abs().max().clamp_min(1e-30))


def sweep_shape(
    name: str,
    n: int,
    k: int,
    m: int,
    dtype: torch.dtype,
    device: torch.device,
    configs: list[GemvConfig],
) -> dict[str, Any]:
    """cuBLAS and every config at one shape; configs that fail to build or disagree with
    F.linear are recorded with the reason and not timed."""
    gen = torch.Generator(device=device).manual_seed(n * 31 + k + m)
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype)
    weight_gb = n * k * w.element_size() / 1e9
    want = F.linear(x, w)
    # cuBLAS may reduce split-K partials in bf16 (torch's default), so the bound is the
    # layer-ops tests' bf16 one; float32 is tight.
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    cublas_us = time_us(lambda: F.linear(x, w), device)
    results: list[dict[str, Any]] = []
    for cfg in configs:
        row: dict[str, Any] = {"config": list(cfg)}
        try:
            err = max_rel_diff(gemv(x, w, config=cfg), want)
        except Exception as exc:  # a config the compiler or the GPU refuses
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            results.append(row)
            continue
        row["max_rel_diff"] = err
        if not err <= tol:
            row["error"] = f"wrong result: max relative difference {err:.3e} > {tol:.1e}"
            results.append(row)
            continue
        # Timed as TritonOps.linear calls it: the launch without gemv()'s input checks.
        us = time_us(functools.partial(_launch, x, w, None, cfg), device)
        row.update(us=us, gbps=weight_gb / (us * 1e-6))
        results.append(row)
    timed = [r for r in results if "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    default = list(gemv_config(n, k, dtype, m))
    default_row = next((r for r in timed if r["config"] == default), None)
    return {
        "name": name,
        "m": m,
        "n": n,
        "k": k,
        "dtype": str(dtype).removeprefix("torch."),
        "weight_bytes": int(weight_gb * 1e9),
        "cublas_us": cublas_us,
        "cublas_gbps": weight_gb / (cublas_us * 1e-6),
        "best": best,
        "default": default_row,
        "speedup_vs_cublas": cublas_us / best["us"] if best else None,
        "configs_tried": len(results),
        "configs_failed": len(results) - len(timed),
        "results": results,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'shape':<9}{'M':>2} {'N x K':>14}  {'best (BN,BK,warps,stages)':<26}"
        f"{'us':>8}{'GB/s':>8}  {'default us':>10}  {'cuBLAS us':>9}{'GB/s':>8}  {'speedup':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        best, default = r["best"] or {}, r["default"] or {}
        speedup = f"{r['speedup_vs_cublas']:.2f}x" if best else "-"
        print(
            f"{r['name']:<9}{r['m']:>2} {r['n']:>7}x{r['k']:<6}  "
            f"{str(tuple(best.get('config', ()))):<26}{best.get('us', float('nan')):>8.2f}"
            f"{best.get('gbps', float('nan')):>8.0f}  {default.get('us', float('nan')):>10.2f}  "
            f"{r['cublas_us']:>9.2f}{r['cublas_gbps']:>8.0f}  {speedup:>7}"
        )
    print("speedup = cuBLAS us / best Triton us (> 1: the GEMV is faster); default = gemv_config")
    print("\n# _TUNED entries for engine/models/triton_gemv.py:")
    for r in rows:
        if r["best"]:
            size = 2 if r["dtype"] in ("bfloat16", "float16") else 4
            cfg = tuple(r["best"]["config"])
            print(
                f"    ({r['n']}, {r['k']}, {r['m']}, {size}): {cfg},  # {r['name']}: "
                f"{r['best']['us']:.2f} us vs cuBLAS {r['cublas_us']:.2f} us"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, help="write every result here")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, 2 configs (CPU smoke test)")
    ap.add_argument("--shapes", help="comma-separated subset of " + ",".join(SHAPES_8B))
    ap.add_argument("--only-m1", action="store_true", help="batch 1 only (skip qkv at 2, 4)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        device_name, sms = props.name, props.multi_processor_count
    else:
        device_name, sms = "cpu (Triton interpreter)", 132
    dtype = getattr(torch, args.dtype)
    shapes, rows_by_shape = (TINY_SHAPES, TINY_ROWS) if args.tiny else (SHAPES_8B, ROWS_8B)
    if args.shapes:
        unknown = set(args.shapes.split(",")) - set(shapes)
        if unknown:
            ap.error(f"unknown shapes {sorted(unknown)}; choose from {sorted(shapes)}")
        shapes = {s: shapes[s] for s in args.shapes.split(",")}
    print(f"device {device_name}, {sms} SMs, {args.dtype}")

    t0 = time.perf_counter()
    out: list[dict[str, Any]] = []
    for name, (n, k) in shapes.items():
        for m in (1,) if args.only_m1 else rows_by_shape.get(name, (1,)):
            configs = TINY_CONFIGS if args.tiny else config_grid(n, k, m, dtype, sms)
            t1 = time.perf_counter()
            row = sweep_shape(name, n, k, m, dtype, device, configs)
            out.append(row)
            print(
                f"  {name} M={m}: {len(configs)} configs ({row['configs_failed']} failed) "
                f"in {time.perf_counter() - t1:.1f} s",
                flush=True,
            )
    elapsed = time.perf_counter() - t0
    print(f"swept in {elapsed:.0f} s\n")
    print_table(out)
    if args.json:
        import triton

        meta = {
            "command": recorded_command("benchmarks.gpu.gemv_sweep"),
            "device": device_name,
            "sms": sms,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "dtype": args.dtype,
            "tiny": args.tiny,
            "elapsed_s": elapsed,
            "timing": "triton.testing.do_bench median, L2 flushed"
            if device.type == "cuda"
            else "wall clock median of 3 (interpreter)",
        }
        args.json.write_text(json.dumps({**meta, "shapes": out}, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
