"""Where a decode step's GPU time goes in our engine (the profile the peer report quotes).

    python -m benchmarks.peers.profile_decode --precision fp8 [--batch 128] [--out FILE]

Builds the offline ``LLM`` with the peer settings but CUDA graphs off (so the profiler sees
each kernel), runs one untimed batch, then profiles ``--batch`` prompts x 1024 tokens
generating ``--new`` tokens (default 33) and prints the kernels by total CUDA time. Prefill kernels are in the
table too; the decode ones are those called ~32 x layers times.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.peers.offline import CONFIGS, SETTINGS
from benchmarks.peers.workloads import random_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="fp8")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--new", type=int, default=33, help="tokens generated per prompt")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    kwargs = dict(SETTINGS, device="cuda", dtype="bfloat16", load_format="dummy", cuda_graphs=False)
    if args.precision == "fp8":
        kwargs.update(quantization="fp8", kv_cache_dtype="fp8")
    llm = LLM(str(CONFIGS / "llama-3.1-8b"), **kwargs)
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    llm.generate(random_prompts(args.batch, 1024, 128256, 1), params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(random_prompts(args.batch, 1024, 128256, 2), params)
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=30, max_name_column_width=70
    )
    print(table)
    if args.out:
        Path(args.out).write_text(table)


if __name__ == "__main__":
    main()
