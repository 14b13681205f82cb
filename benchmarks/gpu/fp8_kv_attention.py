"""The Triton paged attention over an e4m3 KV cache with its tiles converted to bf16 (the
default) against fp16 (``TritonAttention(f16_kv=True)``: one packed convert per two values,
the query pre-scaled), and over a bf16 cache for reference; Llama-3.1-8B's attention shape
(32 query heads over 8 KV heads, head_dim 128), CUDA-event medians. Each row also gives
both fp8 variants' relative error against the bf16 cache's output.

    python -m benchmarks.gpu.fp8_kv_attention --out benchmarks/results/gpu/fp8_kv_attention_h100.json
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.gpu.mixed_step import _time
from benchmarks.record import recorded_command, write_report

# name: (q_lens, cached)
SHAPES = {
    "decode b1 ctx512": ([1], [511]),
    "decode b32 ctx2048": ([1] * 32, [2047] * 32),
    "decode b128 ctx1024": ([1] * 128, [1023] * 128),
    "decode b256 ctx1024": ([1] * 256, [1023] * 256),
    "mixed 300-token chunk + 127 decodes ctx1024": ([300] + [1] * 127, [0] + [1023] * 127),
}


def row(name: str, q_lens: list[int], cached: list[int], iters: int) -> dict:
    from engine.attention.kv_quant import FP8_DTYPE, quantize
    from engine.attention.triton_backend import paged_attention, write_kv_cache
    from engine.attention.triton_testing import make_case, relative_error

    case = make_case(
        q_lens, cached, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        dtype=torch.bfloat16, device="cuda", seed=0,
    )  # fmt: skip
    bf16 = torch.nan_to_num(case.kv_cache)
    write_kv_cache(case.key, case.value, bf16, case.meta.slot_mapping)
    fp8 = torch.stack([quantize(bf16[0], FP8_DTYPE, 1.0), quantize(bf16[1], FP8_DTYPE, 1.0)])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q, meta, scale = case.query, case.meta, case.scale

    def run(cache: torch.Tensor, f16: bool) -> torch.Tensor:
        return paged_attention(q, cache, meta, scale, num_sms=sms, f16_kv=f16)

    ref = run(bf16, False)
    out = {"shape": name}
    for label, cache, f16 in (("bf16_cache", bf16, False), ("fp8_bf16_tiles", fp8, False),
                              ("fp8_f16_tiles", fp8, True)):  # fmt: skip
        out[f"{label}_us"] = round(_time(lambda c=cache, f=f16: run(c, f), iters) * 1e3, 1)
        if cache is fp8:
            out[f"{label}_rel_err"] = relative_error(run(cache, f16), ref.double())
    out["f16_tiles_speedup"] = round(out["fp8_bf16_tiles_us"] / out["fp8_f16_tiles_us"], 3)
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    rows = [row(name, q, c, a.iters) for name, (q, c) in SHAPES.items()]
    write_report(
        {"command": recorded_command("benchmarks.gpu.fp8_kv_attention"), "rows": rows},
        a.out,
        "cuda",
    )


if __name__ == "__main__":
    main()
