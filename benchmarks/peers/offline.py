"""One engine, one precision, every offline row of the peer comparison (README.md here).

    python -m benchmarks.peers.offline --engine pdserve --precision bf16
    python -m benchmarks.peers.offline --engine vllm --precision fp8

Both engines get the same settings (``SETTINGS``): the Llama-3.1-8B shape from
benchmarks/configs with dummy weights, ``max_model_len`` 4096, ``max_num_seqs`` 256,
``max_num_batched_tokens`` 8192, 0.9 of the GPU, prefix caching off, CUDA graphs on (each
engine's default). ``--precision fp8`` is FP8 (e4m3) weights quantized at load with
dynamic activation scales, plus an FP8 (e4m3) KV cache, on both (vLLM:
``quantization="fp8"``, ``kv_cache_dtype="fp8"``; ours the same names).

Rows (greedy, EOS ignored, so every request makes exactly the tokens asked for):
* ``decode_b1_ms_per_token``: one 512-token prompt; (t(1 + 128) - t(1)) / 128, median of
  ``--repeats``, after one untimed pass of the same shapes;
* ``decode_b128_tok_s``: 128 prompts x 1024 in, the same difference over 128 x 128 tokens;
* ``thr_1k_1k_out_tok_s``: 256 prompts x 1024 in / 1024 out, one ``generate`` call;
* ``prefill_2k_ttft_ms``: one 2048-token prompt, 1 output token, median of ``--repeats``;
* ``mixed_1000_out_tok_s`` (and ``_total_tok_s``): the seeded ShareGPT-like set of
  workloads.py, one ``generate`` call.
The JSON is written after every row, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.peers.workloads import mixed_set, random_prompts

log = logging.getLogger("peers.offline")
REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "benchmarks" / "configs"
RESULTS = REPO / "benchmarks" / "results" / "peers"
SETTINGS: dict[str, Any] = {
    "max_model_len": 4096,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "gpu_memory_utilization": 0.9,
    "enable_prefix_caching": False,
}
# Generate(prompts, max_tokens per prompt) -> wall seconds; raises unless every request made
# exactly its tokens.
Generate = Callable[[list[list[int]], list[int]], float]


def _check_lengths(got: list[int], want: list[int]) -> None:
    if got != want:
        bad = sum(g != w for g, w in zip(got, want, strict=True))
        raise RuntimeError(f"{bad} of {len(want)} requests made another number of tokens")


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_pdserve(
    model_dir: str, precision: str, device: str, overrides: dict[str, Any] | None = None
) -> tuple[Generate, dict[str, Any]]:
    """``overrides``: more ``EngineConfig`` fields (``--pdserve-set``: A/B runs of one
    setting, e.g. ``mixed_cuda_graphs=false``)."""
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    kwargs: dict[str, Any] = dict(SETTINGS, device=device, dtype="bfloat16", load_format="dummy")
    if precision == "fp8":
        kwargs.update(quantization="fp8", kv_cache_dtype="fp8")
    kwargs.update(overrides or {})
    if device == "cpu":
        kwargs.update(dtype="float32", num_kv_blocks=1 + 16 * 200)
        kwargs.pop("gpu_memory_utilization")
    llm = LLM(model_dir, **kwargs)

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> float:
        params = [
            SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens
        ]
        _sync()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        _sync()
        seconds = time.perf_counter() - t0
        _check_lengths([len(o.token_ids) for o in outs], max_tokens)
        return seconds

    cfg = llm.engine.config
    described = {
        "version": _version("pdserve"),
        "dtype": cfg.torch_dtype_name,
        "kv_cache_dtype": cfg.kv_cache_dtype_name,
        "quantization": cfg.quantization,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_num_seqs": cfg.max_num_seqs,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "async_scheduling": cfg.async_scheduling_on,
        "cuda_graphs": cfg.cuda_graphs,
        "mixed_cuda_graphs": cfg.mixed_cuda_graphs,
        "fp8_fused_quant": cfg.fp8_fused_quant,
        "fp8_scales": cfg.fp8_scales,
        "overrides": overrides or {},
        "attention_backend": llm.engine.runner.backend.name,
        "warmup_s": round(llm.warmup_seconds, 2),
    }
    return generate, described


def build_vllm(model_dir: str, precision: str, device: str) -> tuple[Generate, dict[str, Any]]:
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    kwargs: dict[str, Any] = dict(
        SETTINGS, dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True, seed=0
    )
    if precision == "fp8":
        kwargs.update(quantization="fp8", kv_cache_dtype="fp8")
    llm = LLM(model=model_dir, **kwargs)

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> float:
        params = [
            SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, detokenize=False)
            for m in max_tokens
        ]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        _sync()
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        _sync()
        seconds = time.perf_counter() - t0
        _check_lengths([len(o.outputs[0].token_ids) for o in outs], max_tokens)
        return seconds

    described: dict[str, Any] = {"version": _version("vllm")}
    try:  # what the engine resolved, where this vLLM exposes it
        vcfg = llm.llm_engine.vllm_config
        described.update(
            compilation=str(vcfg.compilation_config.mode),
            cudagraph_mode=str(vcfg.compilation_config.cudagraph_mode),
            async_scheduling=getattr(vcfg.scheduler_config, "async_scheduling", None),
            max_num_batched_tokens=vcfg.scheduler_config.max_num_batched_tokens,
            max_num_seqs=vcfg.scheduler_config.max_num_seqs,
            kv_cache_dtype=vcfg.cache_config.cache_dtype,
            quantization=vcfg.model_config.quantization,
        )
    except AttributeError as exc:
        described["config_error"] = repr(exc)
    described["env"] = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    return generate, described


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def decode_rate(
    generate: Generate, batch: int, ctx: int, new: int, vocab: int, repeats: int, seed: int
) -> tuple[float, float]:
    """(ms per decode step, decode tok/s) at ``batch``: t(1 + new) - t(1) on fresh prompts."""
    generate(random_prompts(batch, ctx, vocab, seed - 1), [1 + new] * batch)  # shapes' first use
    diffs = []
    for i in range(repeats):
        long = generate(random_prompts(batch, ctx, vocab, seed + 2 * i), [1 + new] * batch)
        short = generate(random_prompts(batch, ctx, vocab, seed + 2 * i + 1), [1] * batch)
        diffs.append(long - short)
    step_s = statistics.median(diffs) / new
    return step_s * 1e3, batch / step_s


def run_rows(
    generate: Generate,
    vocab: int,
    repeats: int,
    shrink: int,
    out: dict[str, Any],
    save: Callable[[], None],
) -> None:
    rows: dict[str, Any] = out.setdefault("rows", {})
    ms, _ = decode_rate(generate, 1, 512 // shrink, 128 // shrink, vocab, repeats, 100)
    rows["decode_b1_ms_per_token"] = round(ms, 3)
    save()
    ms, tok_s = decode_rate(
        generate, 128 // shrink, 1024 // shrink, 128 // shrink, vocab, max(2, repeats - 1), 300
    )
    rows["decode_b128_ms_per_step"], rows["decode_b128_tok_s"] = round(ms, 3), round(tok_s, 1)
    save()
    n, length = 256 // shrink, 1024 // shrink
    secs = generate(random_prompts(n, length, vocab, 200), [length] * n)
    rows["thr_1k_1k_out_tok_s"], rows["thr_1k_1k_s"] = round(n * length / secs, 1), round(secs, 2)
    save()
    ctx = 2048 // shrink
    generate(random_prompts(1, ctx, vocab, 399), [1])
    ttfts = [generate(random_prompts(1, ctx, vocab, 400 + i), [1]) for i in range(max(3, repeats))]
    rows["prefill_2k_ttft_ms"] = round(statistics.median(ttfts) * 1e3, 2)
    save()
    reqs = mixed_set(1000 // shrink, vocab, seed=0)
    secs = generate([r.prompt for r in reqs], [r.max_tokens for r in reqs])
    out_tokens = sum(r.max_tokens for r in reqs)
    in_tokens = sum(len(r.prompt) for r in reqs)
    rows["mixed_1000_out_tok_s"] = round(out_tokens / secs, 1)
    rows["mixed_1000_total_tok_s"] = round((out_tokens + in_tokens) / secs, 1)
    rows["mixed_1000_s"] = round(secs, 2)
    save()


def _json_or_str(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--engine", choices=("pdserve", "vllm"), required=True)
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--model", default="llama-3.1-8b", help="a directory under benchmarks/configs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--tiny", action="store_true", help="CPU dry run: llama-3.2-1b-like tiny model, 1/16 sizes"
    )
    ap.add_argument(
        "--json", default=None, help="default: benchmarks/results/peers/<engine>_<precision>.json"
    )
    ap.add_argument(
        "--pdserve-set", action="append", default=[], metavar="FIELD=VALUE",
        help="an EngineConfig field for our engine only (JSON value: true, 2048; repeatable)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    path = Path(args.json or RESULTS / f"{args.engine}_{args.precision}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "command": shlex.join(
            ["python", "-m", "benchmarks.peers.offline", *(argv or sys.argv[1:])]
        ),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": platform.node(),
        "engine": args.engine,
        "precision": args.precision,
        "model": args.model,
        "settings": SETTINGS,
    }

    def save() -> None:
        out["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        path.write_text(json.dumps(out, indent=1) + "\n")
        log.info("%s", json.dumps(out.get("rows", {})))

    device, shrink = ("cpu", 16) if args.tiny else ("cuda", 1)
    model_dir = str(CONFIGS / ("tiny-llama" if args.tiny else args.model))
    if not args.tiny:
        import torch

        out["gpu"] = torch.cuda.get_device_name()
        out["torch"] = torch.__version__
    build = build_vllm if args.engine == "vllm" else build_pdserve
    t0 = time.perf_counter()
    if args.pdserve_set and args.engine == "pdserve":
        overrides = {k: _json_or_str(v) for k, v in (s.split("=", 1) for s in args.pdserve_set)}
        generate, described = build_pdserve(model_dir, args.precision, device, overrides)
    else:
        generate, described = build(model_dir, args.precision, device)
    out["build_s"] = round(time.perf_counter() - t0, 1)
    out["engine_config"] = described
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    save()
    run_rows(generate, vocab, args.repeats, shrink, out, save)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
