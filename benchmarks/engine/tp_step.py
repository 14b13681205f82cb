"""Tensor parallelism: decode step time at N = 1 and N = 2, and what handing each step's
inputs to the worker ranks costs (rank 0's header writes + one broadcast, per step).

A dummy-weight model from a config directory (default: a 2-layer, hidden-256 Llama written
to a temporary directory; ``--model benchmarks/configs/llama-3.1-8b`` on GPUs). Per batch
size: ``--batch`` requests of ``--input-len`` random tokens are prefilled, then
``--decode-steps`` decode steps are timed (``LLMEngine.step`` wall time), and the
executor's broadcast statistics are read.

CPU (gloo):   python -m benchmarks.engine.tp_step
2 GPUs (NCCL): python3 -m benchmarks.engine.tp_step --device cuda \
                  --model benchmarks/configs/llama-3.1-8b --batch 1 8 64

Writes ``benchmarks/results/engine/tp_step[_<device>].json`` and prints a table (ratios matter on shared machines).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.record import result_path
from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

SMALL = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "eos_token_id": 2,
}


def measure(model: str, tp: int, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    cfg = EngineConfig(
        model=model,
        load_format="dummy",
        device=args.device,
        tensor_parallel_size=tp,
        max_num_seqs=max(batch, 1),
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.input_len + args.decode_steps + 8,
    )
    engine = LLMEngine(cfg)
    try:
        rng = random.Random(0)
        params = SamplingParams(max_tokens=args.decode_steps + 4, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            prompt = [rng.randrange(3, 8000) for _ in range(args.input_len)]
            engine.add_request(f"r{i}", prompt, params)
        while any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()
        ):
            engine.step()
        stats = getattr(engine.executor, "stats", None)
        before = (stats.steps, stats.seconds) if stats else (0, 0.0)
        times = []
        for _ in range(args.decode_steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        bcast_us = 0.0
        if stats is not None and stats.steps > before[0]:
            bcast_us = 1e6 * (stats.seconds - before[1]) / (stats.steps - before[0])
        return {
            "tp": tp,
            "batch": batch,
            "step_ms_median": 1e3 * statistics.median(times),
            "step_ms_mean": 1e3 * statistics.mean(times),
            "broadcast_us_mean": bcast_us,
        }
    finally:
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="config dir (dummy weights); default: small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = tmp
            (Path(tmp) / "config.json").write_text(json.dumps(SMALL))
        rows = [measure(model, tp, b, args) for b in args.batch for tp in args.tp]
    print(f"{'tp':>3} {'batch':>6} {'step ms':>9} {'bcast us':>9} {'bcast/step':>10}")
    for r in rows:
        share = r["broadcast_us_mean"] / (10 * r["step_ms_median"]) if r["tp"] > 1 else 0.0
        print(
            f"{r['tp']:>3} {r['batch']:>6} {r['step_ms_median']:>9.2f} "
            f"{r['broadcast_us_mean']:>9.1f} {share:>9.1f}%"
        )
    out = args.output_json or str(
        result_path("engine", f"tp_step{'' if args.device == 'cpu' else '_' + args.device}.json")
    )
    Path(out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
