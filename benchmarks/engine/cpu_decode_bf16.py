"""The C decode-attention kernel in float32 vs bfloat16 (engine/attention/cpu_decode.c),
and torch's float32 vs bf16 matmul, on this CPU: the two numbers behind the bf16 reading in
benchmarks/README.md (engine). Times are the calling thread's CPU time (one thread), so a
loaded shared machine does not count its descheduled time.

    python -m benchmarks.engine.cpu_decode_bf16  # writes benchmarks/results/engine/cpu_decode_bf16.json
"""

from __future__ import annotations

import json
import platform
import sys
import time

import torch

from benchmarks.record import recorded_command, result_path
from engine.attention.cpu_kernels import cpu_bf16_native, load_decode_kernel


def best_cpu_ms(fn: object, reps: int = 3, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(reps):
            fn()  # type: ignore[operator]
        best = min(best, (time.thread_time() - t0) / reps)
    return best * 1e3


def kernel_ms(batch: int, ctx: int) -> dict[str, float]:
    """SmolLM2's heads (9 query, 3 KV, dim 64), block 16, shuffled blocks."""
    kernel = load_decode_kernel()
    if kernel is None:
        raise RuntimeError("the C kernel did not build (is cc installed?)")
    hq, hkv, dim, bs = 9, 3, 64, 16
    per = -(-ctx // bs)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, batch * per + 1, bs, hkv, dim, generator=gen)
    tables = (torch.randperm(batch * per, generator=gen).view(batch, per) + 1).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, hq, dim, generator=gen)
    out: dict[str, float] = {}
    for dt in (torch.float32, torch.bfloat16):
        c, qq = cache.to(dt), q.to(dt)
        o = torch.empty_like(qq)
        out[str(dt).removeprefix("torch.")] = best_cpu_ms(
            lambda c=c, qq=qq, o=o: kernel(qq, c, tables, lens, dim**-0.5, o)
        )
    return out


def matmul_gflops() -> dict[str, float]:
    """[32, 576] x [576, 1536]: a SmolLM2 projection at batch 32."""
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        x, w = torch.randn(32, 576, dtype=dt), torch.randn(1536, 576, dtype=dt)
        ms = best_cpu_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w), reps=20)
        out[str(dt).removeprefix("torch.")] = 2 * 32 * 576 * 1536 / (ms * 1e-3) / 1e9
    return out


def main() -> int:
    torch.set_num_threads(1)
    report = {
        "command": recorded_command("benchmarks.engine.cpu_decode_bf16", []),
        "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.machine(),
        "cpu_bf16_native": cpu_bf16_native(),
        "kernel_ms": {f"b{b}_ctx{c}": kernel_ms(b, c) for b, c in ((64, 256), (64, 1024))},
        "matmul_gflops": matmul_gflops(),
    }
    lines = [
        "# C decode kernel and matmuls: float32 vs bfloat16 on this CPU",
        "",
        f"Command: `{report['command']}` · {report['time']} · {report['machine']} · native "
        f"bf16 (avx512_bf16/amx_bf16): {report['cpu_bf16_native']} · 1 thread, CPU time "
        "(best of 5 rounds)",
        "",
        "| decode attention (SmolLM2 heads) | float32 ms | bfloat16 ms |",
        "|---|---|---|",
    ]
    for case, r in report["kernel_ms"].items():  # type: ignore[attr-defined]
        lines.append(f"| {case} | {r['float32']:.2f} | {r['bfloat16']:.2f} |")
    mm = report["matmul_gflops"]
    lines += [
        "",
        f"torch `F.linear` [32, 576] × [576, 1536]: float32 {mm['float32']:.1f} GFLOP/s, "  # type: ignore[index]
        f"bfloat16 {mm['bfloat16']:.1f} GFLOP/s.",  # type: ignore[index]
        "",
    ]
    result_path("engine", "cpu_decode_bf16.json").write_text(json.dumps(report, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
