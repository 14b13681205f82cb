"""FP8 (e4m3) KV cache vs the model-dtype cache on a real model: teacher-forced logits.

    python -m benchmarks.kv.kv_fp8_accuracy [--model smollm2] [--device cpu]
        [--dtype auto] [--new-tokens 32] [--v-scale 1.0] [--out PATH]

(default ``--out``: benchmarks/results/kv/kv_fp8_accuracy.json)

Each prompt is generated greedily with the model-dtype cache; then both engines read that
same token sequence (prompt prefilled in two chunks, the rest one decode step at a time,
so every logit comes from K/V read back out of the paged cache) and their logits are
compared: top-1 agreement, rms and max logit error against the logits' spread. Also
reported: how many free-running greedy continuations come out identical.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from benchmarks.record import recorded_command, result_path

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.\n",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
    "The three laws of motion are",
    "In 1492, Christopher Columbus",
    "A good breakfast should include",
    "To install the package, run",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument(
        "--v-scale", type=float, default=1.0, help="the fp8 cache's V scale (an experiment)"
    )
    ap.add_argument("--out", default=str(result_path("kv", "kv_fp8_accuracy.json")))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import torch

    from common.models import resolve_model
    from engine.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine
    from tests.unit.kv_fp8_support import compare, run_sequence

    model = resolve_model(args.model)

    def engine(kv: str) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=model, device=args.device, dtype=args.dtype, kv_cache_dtype=kv,
                num_kv_blocks=64,
            )
        )  # fmt: skip

    ref, fp8 = engine("auto"), engine("fp8")
    fp8.runner.backend.v_scale = args.v_scale  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    identical = 0
    for text in PROMPTS:
        prompt = ref.tokenizer.encode(text)
        outs = []
        for e in (ref, fp8):
            e.add_request("r", prompt, params)
            toks: list[int] = []
            while e.has_unfinished():
                for o in e.step():
                    toks += o.new_token_ids
            outs.append(toks)
        identical += outs[0] == outs[1]
        seq = prompt + outs[0][:-1]
        half = len(prompt) // 2 or 1
        chunks = [half, len(prompt) - half] if len(prompt) > 1 else [1]
        c = compare(run_sequence(ref.runner, seq, chunks), run_sequence(fp8.runner, seq, chunks))
        rows.append(
            {
                "prompt": text,
                "positions": c.positions,
                "top1_agree": c.top1_agree,
                "rms_err": round(c.rms_err, 5),
                "max_abs_err": round(c.max_abs_err, 5),
                "logit_std": round(c.logit_std, 4),
                "greedy_identical": outs[0] == outs[1],
            }
        )
    positions = sum(r["positions"] for r in rows)
    agree = sum(r["top1_agree"] for r in rows)
    summary = {
        "command": recorded_command("benchmarks.kv.kv_fp8_accuracy"),
        "model": args.model,
        "device": args.device,
        "model_dtype": ref.config.torch_dtype_name,
        "torch": torch.__version__,
        "new_tokens": args.new_tokens,
        "v_scale": args.v_scale,
        "top1_agreement": round(agree / positions, 4),
        "positions": positions,
        "rms_err_max": max(r["rms_err"] for r in rows),
        "max_abs_err": max(r["max_abs_err"] for r in rows),
        "logit_std_min": min(r["logit_std"] for r in rows),
        "greedy_identical": f"{identical}/{len(PROMPTS)}",
        "prompts": rows,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "prompts"}, indent=1))
    if args.out:  # "" to print only
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
