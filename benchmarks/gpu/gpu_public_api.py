"""The engine on one GPU through its public API, the way a user calls it: ``LLM(...)`` and
``LLM.generate(prompts, SamplingParams(...))``, nothing reached around (issue 18 item 5;
docs/design.md §3 "Offline LLM").

Rows (Llama-3.1-8B shape from benchmarks/configs, dummy weights, greedy, EOS ignored):

* ``decode_b1_ms_per_token``: one 512-token prompt; (t(1 + N tokens) − t(1 token)) / N,
  median of ``--repeats``: decode time per token with the prefill taken out.
* ``thr_1k_1k_out_tok_s``: 256 prompts × 1024 tokens in, 1024 out, one ``generate`` call:
  output tokens / wall seconds.
* ``decode_b128_tok_s``: 128 prompts × 1024 in; (t(1 + N) − t(1)) over 128 × N tokens:
  decode-only throughput at batch 128.

``--no-warmup`` builds the ``LLM`` without its warm-up pass (engine/llm_warmup.py) and
``--engine-defaults`` without the offline step budget, to show what each buys (the
issue's 9.7k vs 12.6k tok/s). ``--quantization fp8`` / ``--kv-cache-dtype fp8`` pass
through to ``LLM``. The JSON is written after every row, so a run cut short keeps what it
measured. On the GPU machine, from the repository root:

    python3 -m benchmarks.gpu.gpu_public_api --json benchmarks/results/gpu/gpu_public_api_h200.json
    python3 -m benchmarks.gpu.gpu_public_api --quantization fp8 --kv-cache-dtype fp8 \\
        --json benchmarks/results/gpu/gpu_public_api_h200_fp8.json

``--tiny`` runs the same code on the CPU with a 2-layer model (a dry run for the script).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.engine.host_overhead_child import TINY_LLAMA as TINY_CONFIG
from benchmarks.record import CONFIGS, recorded_command, result_path

log = logging.getLogger("gpu_public_api")


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo = min(1000, vocab // 2)
    return [[rng.randrange(lo, vocab) for _ in range(length)] for _ in range(n)]


def timed_generate(llm: Any, batch: list[list[int]], max_tokens: int) -> float:
    """Wall seconds of one public ``generate`` call (synchronised on CUDA at both ends)."""
    import torch

    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    cuda = torch.cuda.is_available() and llm.engine.config.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    lens = {len(o.token_ids) for o in outs}
    if lens != {max_tokens}:
        raise RuntimeError(f"expected {max_tokens} tokens per prompt, got lengths {lens}")
    return seconds


def decode_rate(
    llm: Any, batch_size: int, prompt_len: int, new: int, vocab: int, repeats: int, seed: int
) -> tuple[float, float]:
    """(ms per decode step, decode tok/s) at ``batch_size``: each repeat times 1 + ``new``
    tokens and 1 token on fresh prompts (no prefix hits) and takes the difference."""
    # One untimed pass of the same shapes first: a shape's first step pays its JIT compiles.
    timed_generate(llm, prompts(batch_size, prompt_len, vocab, seed - 1), 1 + new)
    diffs = []
    for i in range(repeats):
        long_batch = prompts(batch_size, prompt_len, vocab, seed + 2 * i)
        short_batch = prompts(batch_size, prompt_len, vocab, seed + 2 * i + 1)
        diffs.append(timed_generate(llm, long_batch, 1 + new) - timed_generate(llm, short_batch, 1))
    step_s = statistics.median(diffs) / new
    return step_s * 1e3, batch_size / step_s


def build(args: argparse.Namespace, model_dir: str) -> tuple[Any, float]:
    from engine.llm import LLM

    kwargs: dict[str, Any] = dict(
        device=args.device,
        dtype=args.dtype,
        load_format="dummy",
        max_model_len=args.max_model_len,
    )
    if args.quantization:
        kwargs["quantization"] = args.quantization
    if args.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    if args.engine_defaults:
        kwargs["max_num_batched_tokens"] = 2048  # EngineConfig's own default
    if args.tiny:
        kwargs.update(num_kv_blocks=1 + 16 * 160, max_num_seqs=256)
    t0 = time.perf_counter()
    llm = LLM(model_dir, warmup=not args.no_warmup, **kwargs)
    return llm, time.perf_counter() - t0


def run(args: argparse.Namespace, model_dir: str, out: dict[str, Any]) -> None:
    llm, build_s = build(args, model_dir)
    cfg = llm.engine.config
    vocab = llm.engine.args.vocab_size
    out["engine"] = {
        "build_s": round(build_s, 2),
        "warmup_s": round(llm.warmup_seconds, 2),
        "dtype": cfg.torch_dtype_name,
        "kv_cache_dtype": cfg.kv_cache_dtype_name,
        "quantization": cfg.quantization,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_num_seqs": cfg.max_num_seqs,
        "async_scheduling": cfg.async_scheduling_on,
        "cuda_graphs": cfg.cuda_graphs,
        "attention_backend": llm.engine.runner.backend.name,
    }
    rows: dict[str, Any] = out.setdefault("rows", {})
    n, b1_ctx = args.scale, 512 // args.shrink
    ms, _ = decode_rate(llm, 1, b1_ctx, 128 // args.shrink, vocab, args.repeats, 100)
    rows["decode_b1_ms_per_token"] = round(ms, 3)
    save(args, out)
    in_len, out_len = 1024 // args.shrink, 1024 // args.shrink
    batch = prompts(256 // n, in_len, vocab, 200)
    secs = timed_generate(llm, batch, out_len)
    rows["thr_1k_1k_out_tok_s"] = round(len(batch) * out_len / secs, 1)
    rows["thr_1k_1k_total_s"] = round(secs, 2)
    save(args, out)
    ms, tok_s = decode_rate(llm, 128 // n, in_len, 128 // args.shrink, vocab, args.repeats, 300)
    rows["decode_b128_ms_per_step"] = round(ms, 3)
    rows["decode_b128_tok_s"] = round(tok_s, 1)
    save(args, out)
    llm.shutdown()


def save(args: argparse.Namespace, out: dict[str, Any]) -> None:
    out["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    log.info("%s", json.dumps(out.get("rows", {})))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a directory under benchmarks/configs")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, help="e.g. fp8 (passed to LLM)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8 (passed to LLM)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-warmup", action="store_true", help="LLM(warmup=False)")
    ap.add_argument(
        "--engine-defaults",
        action="store_true",
        help="max_num_batched_tokens=2048 (the engine's default) instead of the offline one",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU dry run with a 2-layer model")
    ap.add_argument("--json", default=str(result_path("gpu", "gpu_public_api.json")))
    args = ap.parse_args(argv)
    # --tiny: 1/8 of the batch and 1/8 of the lengths, float32 on the CPU.
    args.scale, args.shrink = (8, 8) if args.tiny else (1, 1)
    out: dict[str, Any] = {
        "command": recorded_command("benchmarks.gpu.gpu_public_api", argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": platform.node(),
        "model": args.model,
    }
    if args.tiny:
        args.device, args.dtype = "cpu", "float32"
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(TINY_CONFIG))
            out["model"] = "tiny (2 layers, hidden 64)"
            run(args, tmp, out)
    else:
        import torch

        out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        run(args, str(CONFIGS / args.model), out)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
