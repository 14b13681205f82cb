"""Engine rows for ``benchmarks.gpu.attention_backends``: ``auto`` (Triton + FA4 per step shape)
vs ``triton`` alone, Llama-3.2-1B shape with dummy bf16 weights, CUDA graphs on.

Workloads (one engine per backend, ``max_num_batched_tokens`` 2048, each after an untimed
warm-up of the same shapes, so FA4's JIT compiles are not timed):
- ``batch1_decode``: one 512-token prompt, 128 greedy tokens; ms per output token;
- ``prefill_2k``: one 2048-token prompt, 1 token; TTFT;
- ``chunked_8x6k``: 8 prompts of 6144 tokens, 1 token each: every step after the first
  chunk is a 2048-token chunk over a longer cached context; total seconds;
- ``in1k_out256_x64``: 64 prompts of 1024 tokens, 256 tokens each; output tokens/s.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.record import CONFIGS

log = logging.getLogger("attention_backends")
CONFIG = CONFIGS / "llama-3.2-1b"
BACKENDS = ("triton", "auto")


def _engine(backend: str) -> Any:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(CONFIG),
            device="cuda",
            dtype="bfloat16",
            load_format="dummy",
            attention_backend=backend,
            max_model_len=8192,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            gpu_memory_utilization=0.85,
        )  # fmt: skip
    )


def _run(engine: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, float]:
    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    first: dict[str, float] = {}
    n_out = 0
    while engine.has_unfinished():
        for o in engine.step():
            n_out += len(o.new_token_ids)
            first.setdefault(o.request_id, time.perf_counter() - t0)
    total = time.perf_counter() - t0
    return {"total_s": total, "out_tokens": n_out, "ttft_s": min(first.values())}


def _workloads(rng: random.Random, scale: int) -> dict[str, tuple[list[list[int]], int]]:
    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(1000, 120000) for _ in range(length)] for _ in range(n)]

    return {
        "batch1_decode": (prompts(1, 512), 128 // scale),
        "prefill_2k": (prompts(1, 2048), 1),
        "chunked_8x6k": (prompts(max(1, 8 // scale), 6144), 1),
        "in1k_out256_x64": (prompts(64 // scale, 1024), 256 // scale),
    }


def run_e2e(save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every workload on every backend; ``save`` gets the results after each row."""
    out: dict[str, Any] = {"model": "llama-3.2-1b (dummy bf16)", "rows": {}}
    for backend in BACKENDS:
        engine = _engine(backend)
        out["rows"][backend] = {"backend_name": engine.runner.backend.name}
        for name, (prompts, new) in _workloads(random.Random(1), 8).items():
            _run(engine, prompts, new, f"warm-{name}")
        for name, (prompts, new) in _workloads(random.Random(2), 1).items():
            r = _run(engine, prompts, new, name)
            out["rows"][backend][name] = r
            log.info("e2e %s %s %s", backend, name, r)
            save(out)
        del engine
        # LLMEngine gc.freeze()s what it built; frozen objects are never collected, so
        # without unfreeze the next engine finds this one's KV cache still on the GPU.
        gc.unfreeze()
        gc.collect()
        torch.cuda.empty_cache()
    return out


def e2e_markdown(out: dict[str, Any]) -> str:
    rows = out["rows"]
    lines = [
        "| workload | metric | triton | auto | auto speedup |",
        "|---|---|---|---|---|",
    ]
    metrics = {
        "batch1_decode": ("ms/token", lambda r: 1e3 * r["total_s"] / r["out_tokens"]),
        "prefill_2k": ("TTFT ms", lambda r: 1e3 * r["ttft_s"]),
        "chunked_8x6k": ("total s", lambda r: r["total_s"]),
        "in1k_out256_x64": ("out tok/s", lambda r: r["out_tokens"] / r["total_s"]),
    }
    for name, (metric, f) in metrics.items():
        if name not in rows.get("triton", {}) or name not in rows.get("auto", {}):
            continue
        t, a = f(rows["triton"][name]), f(rows["auto"][name])
        ratio = a / t if metric == "out tok/s" else t / a
        lines.append(f"| {name} | {metric} | {t:.3f} | {a:.3f} | {ratio:.2f} |")
    return "\n".join(lines)
