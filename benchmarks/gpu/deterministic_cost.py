"""What deterministic mode costs: decode and prefill rates with ``deterministic=True``
against the default, at batch 1 and at batch ``--batch`` (128).

For each mode an engine is built on dummy weights (the shape is what sets speed;
``benchmarks/configs/llama-3.1-8b`` by default) and measured after a warm-up run:

* ``decode_b1_tok_s``: one request decoding ``--steps`` tokens (median pure-decode step);
* ``decode_bN_tok_s``: ``--batch`` requests decoding together (median full pure-decode step);
* ``prefill_bN_tok_s``: the ``--batch`` prompts of ``--prompt-len`` tokens, prompt tokens
  per second of wall time from their arrival until every first token.

The report gives each rate per mode and the ratio deterministic / default (docs/running.md
"Deterministic mode" quotes it). It also checks, for the record, that the batch-1 request's
tokens reappear unchanged inside the batch in deterministic mode.

    python -m benchmarks.gpu.deterministic_cost --device cuda
    python -m benchmarks.gpu.deterministic_cost --device cpu --model-config TINY --batch 8 --steps 8 --out /tmp/d.json
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.lora_step import model_dir
from benchmarks.record import CONFIGS, recorded_command, result_path, write_report


def _prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 13 * j) % 1000 + 3 for j in range(n)]


def _run(engine: Any, batch: int, prompt_len: int, steps: int) -> dict[str, Any]:
    """Run ``batch`` requests; the median pure-decode step at full batch, the prefill wall
    time until every first token, and request 0's tokens."""
    from engine.core.sampling_params import SamplingParams

    # Chunked prefill spreads a large batch's prompts over several steps (128 x 256 tokens at
    # 8192 a step is four), so ask for enough tokens that ``steps`` full-batch decode steps
    # follow them.
    prefill_steps = -(-batch * prompt_len // engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=steps + prefill_steps + 1, temperature=0, ignore_eos=True)
    tag = time.monotonic_ns()
    for i in range(batch):
        engine.add_request(f"d{tag}-{i}", _prompt(i, prompt_len), params)
    sync = _syncer(engine)
    first_seen: set[str] = set()
    tokens0: list[int] = []
    step_s: list[float] = []
    t0 = time.perf_counter()
    prefill_s = 0.0
    while engine.has_unfinished():
        running = engine.scheduler.running
        full_decode = len(running) == batch and all(
            r.num_computed_tokens == r.num_tokens - 1 for r in running
        )
        t = time.perf_counter()
        outs = engine.step()
        sync()
        if full_decode:
            step_s.append(time.perf_counter() - t)
        for out in outs:
            if out.request_id == f"d{tag}-0":
                tokens0 += out.new_token_ids
            if out.new_token_ids and out.request_id not in first_seen:
                first_seen.add(out.request_id)
                if len(first_seen) == batch:
                    prefill_s = time.perf_counter() - t0
    step = statistics.median(step_s[2:] or step_s)
    return {"step_s": step, "prefill_s": prefill_s, "tokens0": tokens0}


def _syncer(engine: Any) -> Any:
    if not engine.config.device.startswith("cuda"):
        return lambda: None
    import torch

    return torch.cuda.synchronize


def measure(common: dict[str, Any], deterministic: bool, a: argparse.Namespace) -> dict[str, Any]:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(**common, deterministic=deterministic))
    try:
        _run(engine, a.batch, a.prompt_len, 4)  # warm-up: Triton compiles, CUDA graphs
        one = _run(engine, 1, a.prompt_len, a.steps)
        many = _run(engine, a.batch, a.prompt_len, a.steps)
    finally:
        engine.shutdown()
        # The engine holds reference cycles: collect it now, so the next mode's engine can
        # take the same GPU memory (0.9 of the card) in this process.
        del engine
        gc.collect()
        if a.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
    return {
        "decode_b1_tok_s": 1 / one["step_s"],
        "decode_bN_tok_s": a.batch / many["step_s"],
        "prefill_bN_tok_s": a.batch * a.prompt_len / many["prefill_s"],
        # The two runs ask for different lengths (their prefill takes a different number of
        # steps): compare the tokens both produced.
        "b1_tokens_equal_in_batch": one["tokens0"][: a.steps] == many["tokens0"][: a.steps],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-config", default=str(CONFIGS / "llama-3.1-8b"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default=str(result_path("gpu", "deterministic_cost_h200.json")))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mdir = model_dir(a.model_config, Path(tmp))
        common: dict[str, Any] = dict(
            model=str(mdir), load_format="dummy", device=a.device,
            max_num_seqs=max(a.batch, 8), max_model_len=a.prompt_len + a.steps + 16,
            max_num_batched_tokens=max(8192, a.prompt_len), enable_prefix_caching=False,
        )  # fmt: skip
        # A fixed KV pool, not a fraction of the GPU: both modes' engines are built in this
        # one process, and 8 GiB holds 128 x 304 tokens of the 8B shape with room to spare.
        common["kv_cache_memory"] = (1 << 30) if a.device == "cpu" else (8 << 30)
        modes = {name: measure(common, det, a) for name, det in (("default", False),
                                                                  ("deterministic", True))}  # fmt: skip
    rates = ("decode_b1_tok_s", "decode_bN_tok_s", "prefill_bN_tok_s")
    report: dict[str, Any] = {
        "device": a.device, "model_config": a.model_config, "batch": a.batch,
        "prompt_len": a.prompt_len, "steps": a.steps, "modes": modes,
        "deterministic_over_default": {
            r: modes["deterministic"][r] / modes["default"][r] for r in rates
        },
        "command": recorded_command("benchmarks.gpu.deterministic_cost"),
    }  # fmt: skip
    write_report(report, a.out, a.device)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
