"""Tune the split-K FP8 GEMM against cuBLASLt's row-wise ``torch._scaled_mm`` at decode row
counts, per Llama-3.1-8B projection; keep the kernel only where it measured faster.

    python -m benchmarks.gpu.fp8_gemm_tune --write \
        --json benchmarks/results/gpu/fp8_gemm_tune_h200.json

For each projection (N, K) and rows M: the median microseconds (CUDA events, 50 runs after
10 warm-ups, L2 not flushed: decode re-reads nothing but the weight, which is larger than
L2) of ``_scaled_mm`` row-wise and of every split-K tile config in the sweep, each result
checked against ``_scaled_mm`` first. ``--write`` stores the bucket table the engine reads
(engine/models/triton_fp8_gemm.py ``fp8_gemm_configs.json``): the winning config per
(shape, M) where it beat cuBLAS by ``--margin``, null elsewhere. ``--tiny`` runs one small
shape on the CPU under TRITON_INTERPRET=1 (a dry run of the script: nothing is timed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.peers.fp8_gemm_shapes import time_us  # the same CUDA-event timing

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (8, 16, 32, 64, 128, 256)
# (block_m, block_n, block_k, split_k, num_warps, num_stages). Each distinct config is one
# Triton compile (~1 s), so the sweep is sized to compile in about two minutes: 96 configs.
# Narrow N tiles (32) and 8 warps lost everywhere in a first, wider sweep on the H200; more
# than 8 K splits only adds reduction traffic at these K (4096, 14336).
SWEEP = {
    "block_m": (16, 32, 64),
    "block_n": (64, 128),
    "block_k": (128, 256),
    "split_k": (1, 2, 4, 8),
    "num_warps": (4,),
    "num_stages": (3, 4),
}


def configs(m: int, k: int) -> list[Any]:
    from engine.models.triton_fp8_gemm import Fp8GemmConfig

    out = []
    for values in itertools.product(*SWEEP.values()):
        cfg = Fp8GemmConfig(*values)
        if cfg.block_m > max(16, m) or k % (cfg.split_k * cfg.block_k):
            continue  # an M tile beyond the rows only wastes work; K must split evenly
        out.append(cfg)
    return out


def tune_shape(n: int, k: int, rows: tuple[int, ...], margin: float) -> list[dict[str, Any]]:
    import torch

    from engine.models.fp8 import quantize_rows
    from engine.models.triton_fp8_gemm import config_rows, fp8_gemm

    weight, w_scale = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    results = []
    for m in rows:
        xq, x_scale = quantize_rows(torch.randn(m, k, device="cuda"))

        def cublas(xq: Any = xq, x_scale: Any = x_scale) -> Any:
            return torch._scaled_mm(
                xq, weight.t(), scale_a=x_scale.unsqueeze(1), scale_b=w_scale.unsqueeze(0),
                out_dtype=torch.bfloat16,
            )  # fmt: skip

        ref = cublas().float()
        base_us = time_us(cublas)
        best: tuple[float, Any] | None = None
        for cfg in configs(m, k):
            try:
                out = fp8_gemm(xq, x_scale, weight, w_scale, cfg).float()
            except Exception as exc:  # noqa: BLE001 - a config the compiler refuses is skipped
                print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
                continue
            err = float((out - ref).abs().max() / ref.abs().max())
            if err > 2e-2:
                raise AssertionError(f"{cfg} at M={m}, N={n}, K={k}: error {err:.3e}")
            us = time_us(lambda c=cfg, a=xq, s=x_scale: fp8_gemm(a, s, weight, w_scale, c))
            if best is None or us < best[0]:
                best = (us, cfg)
        assert best is not None, f"no config ran for M={m}, N={n}, K={k}"
        wins = best[0] * (1 + margin) < base_us
        row = {
            "m": m, "cublas_us": round(base_us, 2), "triton_us": round(best[0], 2),
            "speedup": round(base_us / best[0], 3), "weight_GBps_triton": round(n * k / best[0] / 1e3, 1),
            "config": config_rows(best[1]), "kept": wins,
        }  # fmt: skip
        print(n, k, row, flush=True)
        results.append(row)
    return results


def tiny_dry_run() -> None:
    """The sweep's plumbing on the CPU (interpreter): two configs of one small shape."""
    import torch

    from engine.models.fp8 import _reference_mm, quantize_rows
    from engine.models.triton_fp8_gemm import Fp8GemmConfig, fp8_gemm

    x = torch.randn(8, 256)
    weight, w_scale = quantize_rows(torch.randn(64, 256) * 0.05)
    xq, x_scale = quantize_rows(x)
    ref = _reference_mm(x, weight, w_scale)
    for split in (1, 2):
        cfg = Fp8GemmConfig(16, 32, 128, split, 4, 1)
        out = fp8_gemm(xq, x_scale, weight, w_scale, cfg, out_dtype=torch.float32)
        print("tiny", split, float((out - ref).abs().max()))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument(
        "--margin", type=float, default=0.05, help="keep the kernel only this much faster"
    )
    ap.add_argument("--write", action="store_true", help="store the winners for the engine")
    ap.add_argument(
        "--json", type=Path, default=Path("benchmarks/results/gpu/fp8_gemm_tune_h200.json")
    )
    ap.add_argument("--tiny", action="store_true", help="CPU dry run under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        tiny_dry_run()
        return
    import torch

    from engine.models.triton_fp8_gemm import CONFIG_FILE, gpu_tables

    rows = tuple(int(r) for r in args.rows.split(","))
    out: dict[str, Any] = {
        "command": "python -m benchmarks.gpu.fp8_gemm_tune" + (" --write" if args.write else ""),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shapes": {},
    }
    # The table merges with the one on disk and is written after every shape, so a run cut
    # short keeps what it finished (and tuning one shape leaves the others' rows alone).
    # One table per GPU kind: tuning this kind never touches another kind's winners.
    tables = gpu_tables(json.loads(CONFIG_FILE.read_text())) if CONFIG_FILE.exists() else {}
    table: dict[str, Any] = tables.setdefault(out["gpu"], {"shapes": {}})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        found = tune_shape(n, k, rows, args.margin)
        out["shapes"][name] = {"n": n, "k": k, "rows": found}
        table["shapes"][f"{n},{k}"] = [[r["m"], r["config"] if r["kept"] else None] for r in found]
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        if args.write:
            table["written_by"] = out["command"]
            CONFIG_FILE.write_text(json.dumps({"gpus": tables}, indent=1) + "\n")
            print(f"wrote {CONFIG_FILE} ({name})", flush=True)


if __name__ == "__main__":
    main()
