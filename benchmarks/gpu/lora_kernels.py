"""The LoRA kernels alone (engine/lora/triton_lora.py) at Llama-3.1-8B's projections, beside
the base projection's GEMM: microseconds per call inside a CUDA graph of 20 calls (what a
graphed decode step sees), at ``--batch`` tokens over ``--adapters`` slots of rank
``--rank`` in bf16. Per projection: the base GEMM, LoRA (the zeroing of its shrink output,
shrink and expand), and LoRA's share; ``per_step_ms`` sums LoRA over the 32 layers (the
engine zeroes once per layer, so it slightly overstates). It says which kernel to look at
when ``benchmarks.gpu.lora_step`` misses its target.

    python -m benchmarks.gpu.lora_kernels --out lora_kernels_h100.json
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.gpu.fp8_fusions import _graphed_us
from benchmarks.record import recorded_command, write_report

# kind: (in features, sub-module output sizes), Llama-3.1-8B
PROJECTIONS = {
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}
LAYERS = 32


def projection_row(kind: str, tokens: int, slots: int, rank: int) -> dict[str, Any]:
    from engine.lora.plan import max_blocks, plan_blocks
    from engine.lora.triton_lora import lora_shrink_expand, target_programs

    fan_in, sizes = PROJECTIONS[kind]
    n, subs, dev, bf16 = sum(sizes), len(sizes), torch.device("cuda"), torch.bfloat16
    offsets = [sum(sizes[:i]) for i in range(subs)]
    x = torch.randn(tokens, fan_in, device=dev, dtype=bf16)
    w = torch.randn(n, fan_in, device=dev, dtype=bf16) / fan_in**0.5
    a = torch.randn(slots, subs * rank, fan_in, device=dev, dtype=bf16) / fan_in**0.5
    b = torch.randn(slots, n, rank, device=dev, dtype=bf16) * 0.01
    out = torch.zeros(tokens, n, device=dev, dtype=bf16)
    token_slots = (torch.arange(tokens) % slots).to(torch.int32).numpy()
    table, order = plan_blocks(token_slots, max_blocks(tokens, slots))
    table_d, order_d = torch.from_numpy(table).to(dev), torch.from_numpy(order).to(dev)
    programs = target_programs(dev)

    def lora() -> None:
        y = torch.zeros(tokens, subs * rank, device=dev, dtype=torch.float32)
        lora_shrink_expand(x, out, a, b, y, table_d, order_d, offsets, sizes, rank, programs)

    base_us = _graphed_us(lambda: torch.mm(x, w.T, out=out))
    lora_us = _graphed_us(lora)
    return {
        "kind": kind,
        "base_us": round(base_us, 2),
        "lora_us": round(lora_us, 2),
        "lora_over_base": round(lora_us / base_us, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", default="lora_kernels.json")
    a = ap.parse_args()
    rows = [projection_row(k, a.batch, a.adapters, a.rank) for k in PROJECTIONS]
    report = {
        "batch": a.batch,
        "adapters": a.adapters,
        "rank": a.rank,
        "rows": rows,
        "per_step_ms": {
            "base": round(LAYERS * sum(r["base_us"] for r in rows) / 1e3, 3),
            "lora": round(LAYERS * sum(r["lora_us"] for r in rows) / 1e3, 3),
        },
        "command": recorded_command("benchmarks.gpu.lora_kernels"),
    }
    write_report(report, a.out, "cuda")


if __name__ == "__main__":
    main()
