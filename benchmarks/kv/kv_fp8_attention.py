"""Decode attention over a bf16 vs an fp8 (e4m3) paged cache, Llama-3.1-8B shapes, one GPU.

    python -m benchmarks.kv.kv_fp8_attention

One ``paged_attention`` launch per call (32 q heads over 8 KV heads, head dim 128, 16-token
blocks), three warm-up calls, then the mean of 50 timed with CUDA events. Prints JSON.
Results: benchmarks/README.md (KV).
"""

from __future__ import annotations

import json


def main() -> None:
    import torch

    from engine.attention.kv_quant import FP8_DTYPE, quantize
    from engine.attention.triton_backend import paged_attention
    from engine.attention.triton_testing import PagedCase, make_case

    res = {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, ctx in ((64, 2048), (256, 1024)):
        case = make_case(
            [1] * batch, [ctx] * batch, num_heads=32, num_kv_heads=8, head_dim=128,
            block_size=16, dtype=torch.bfloat16, device="cuda", seed=0,
        )  # fmt: skip
        case.kv_cache.nan_to_num_(0.0)
        fp8 = quantize(case.kv_cache, FP8_DTYPE, 1.0)
        for name, cache in (("bf16", case.kv_cache), ("fp8", fp8)):

            def call(cache: torch.Tensor = cache, case: PagedCase = case) -> torch.Tensor:
                return paged_attention(case.query, cache, case.meta, case.scale, num_sms=sms)

            for _ in range(3):
                call()
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                call()
            end.record()
            torch.cuda.synchronize()
            res[f"decode_B{batch}_ctx{ctx}_{name}_ms"] = round(start.elapsed_time(end) / 50, 4)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
