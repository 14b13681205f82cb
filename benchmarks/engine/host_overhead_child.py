"""One measurement of ``benchmarks.engine.engine_host_overhead``, in a fresh process.

The driver runs this module once per case and variant; which ``engine`` package it imports
is the driver's choice of working directory (the baseline copy's directory comes first on
``sys.path`` under ``python -m``). It prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
# The clock of every per-step time: wall (perf_counter), or with --clock thread the main
# thread's CPU time, which leaves out time spent descheduled on a busy shared machine (with
# one torch thread the forward, the C kernel included, runs on the main thread too).
_now = time.perf_counter
PHASES = ("step", "forward", "host", "schedule", "prepare", "postprocess")
LLM_PHASES = ("loop", "step", "generate", "forward", "host", "postprocess")


def _model_dir(tmp: Path, tokenizer_dir: str | None) -> str:
    (tmp / "config.json").write_text(json.dumps(TINY_LLAMA))
    if tokenizer_dir:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            src = Path(tokenizer_dir) / name
            if src.exists():
                shutil.copy(src, tmp / name)
    return str(tmp)


def measure(
    batch: int, prompt_len: int, decode_steps: int, tokenizer_dir: str | None
) -> dict[str, Any]:
    """One engine, ``batch`` requests: prefill, then time ``decode_steps`` decode steps."""
    import torch

    from engine.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine
    from pdserve.bench.offline import random_prompts

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = EngineConfig(
            model=_model_dir(Path(tmp), tokenizer_dir),
            load_format="dummy",
            dtype="float32",
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            num_kv_blocks=1 + 256 * 80,
            seed=0,
            max_model_len=2048,
        )
        engine = LLMEngine(cfg)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, 1024, seed=0)):
        engine.add_request(f"r{i}", prompt, params)

    acc = {"forward": 0.0, "prepare": 0.0, "schedule": 0.0, "postprocess": 0.0}
    runner = engine.runner
    execute, prepare = runner.execute, runner.prepare
    schedule, postprocess = engine.scheduler.schedule, engine.post.process

    # Instance attributes shadow the methods; execute() calls self.prepare, so the
    # prepare timer sees the call made from inside execute.
    def timed_prepare(*a: Any) -> Any:
        t0 = _now()
        try:
            return prepare(*a)
        finally:
            acc["prepare"] += _now() - t0

    def timed_execute(*a: Any) -> Any:
        p0, t0 = acc["prepare"], _now()
        out = execute(*a)
        acc["forward"] += _now() - t0 - (acc["prepare"] - p0)
        return out

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any) -> Any:
            t0 = _now()
            try:
                return fn(*a)
            finally:
                acc[name] += _now() - t0

        return wrapper

    setattr(runner, "prepare", timed_prepare)  # noqa: B010 - shadow the bound method
    setattr(runner, "execute", timed_execute)  # noqa: B010
    setattr(engine.scheduler, "schedule", timed("schedule", schedule))  # noqa: B010
    setattr(engine.post, "process", timed("postprocess", postprocess))  # noqa: B010

    requests = list(engine.scheduler.requests.values())
    prefill_steps = 0
    while any(not r.output_token_ids for r in requests):
        engine.step()
        prefill_steps += 1
    for _ in range(3):  # warm-up decode steps, untimed
        engine.step()
    samples: dict[str, list[float]] = {k: [] for k in PHASES}
    for _ in range(decode_steps):
        before = dict(acc)
        t0 = _now()
        engine.step()
        step = _now() - t0
        delta = {k: acc[k] - before[k] for k in acc}
        samples["step"].append(step * 1e3)
        samples["host"].append((step - delta["forward"]) * 1e3)
        for k in ("forward", "schedule", "prepare", "postprocess"):
            samples[k].append(delta[k] * 1e3)
    if len(engine.scheduler.running) != batch:
        raise RuntimeError(
            f"expected {batch} running requests, got {len(engine.scheduler.running)}"
        )
    # Greedy tokens of the first requests: before/after must agree exactly.
    check = [r.output_token_ids[:16] for r in requests[:4]]
    return {
        "batch": batch,
        "prefill_steps": prefill_steps,
        "decode_steps": decode_steps,
        "tokenizer": engine.tokenizer is not None,
        "ms": {k: _stats(v) for k, v in samples.items()},
        "check_tokens": check,
    }


def measure_llm(
    batch: int, prompt_len: int, decode_steps: int, tokenizer_dir: str | None
) -> dict[str, Any]:
    """``batch`` requests through ``LLM.generate``: time the loop's decode iterations."""
    import torch

    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM
    from pdserve.bench.offline import random_prompts

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(
            _model_dir(Path(tmp), tokenizer_dir),
            load_format="dummy",
            dtype="float32",
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            num_kv_blocks=1 + 256 * 80,
            seed=0,
            max_model_len=2048,
        )
    engine = llm.engine
    acc = {"forward": 0.0, "prepare": 0.0, "postprocess": 0.0}
    runner = engine.runner
    execute, prepare, postprocess = runner.execute, runner.prepare, engine.post.process
    step_fn, schedule = engine.step, engine.scheduler.schedule
    # Per step: (start, end, forward s, postprocess s, every scheduled row a decode).
    marks: list[tuple[float, float, float, float, bool]] = []
    decode_only = [False]

    def timed_prepare(*a: Any) -> Any:
        t0 = _now()
        try:
            return prepare(*a)
        finally:
            acc["prepare"] += _now() - t0

    def timed_execute(*a: Any) -> Any:
        p0, t0 = acc["prepare"], _now()
        out = execute(*a)
        acc["forward"] += _now() - t0 - (acc["prepare"] - p0)
        return out

    def timed_postprocess(*a: Any) -> Any:
        t0 = _now()
        try:
            return postprocess(*a)
        finally:
            acc["postprocess"] += _now() - t0

    def spy_schedule() -> Any:
        out = schedule()
        decode_only[0] = len(out.scheduled) == batch and all(
            s.num_new_tokens == 1 for s in out.scheduled
        )
        return out

    def timed_step() -> Any:
        f0, p0, t0 = acc["forward"], acc["postprocess"], _now()
        decode_only[0] = False
        out = step_fn()
        t1 = _now()
        marks.append((t0, t1, acc["forward"] - f0, acc["postprocess"] - p0, decode_only[0]))
        return out

    setattr(runner, "prepare", timed_prepare)  # noqa: B010 - shadow the bound methods
    setattr(runner, "execute", timed_execute)  # noqa: B010
    setattr(engine.post, "process", timed_postprocess)  # noqa: B010
    setattr(engine.scheduler, "schedule", spy_schedule)  # noqa: B010
    setattr(engine, "step", timed_step)  # noqa: B010
    prompts = random_prompts(batch, prompt_len, 1024, seed=0)
    params = SamplingParams(max_tokens=decode_steps + 8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    samples: dict[str, list[float]] = {k: [] for k in LLM_PHASES}
    # A decode step's loop time runs to the next step's start; skip the first 3 (warm-up)
    # and the last one (no next step).
    decode = [i for i in range(len(marks) - 1) if marks[i][4]][3:]
    for i in decode:
        t0, t1, fwd, post, _ = marks[i]
        loop = marks[i + 1][0] - t0
        for k, v in (
            ("loop", loop),
            ("step", t1 - t0),
            ("generate", loop - (t1 - t0)),
            ("forward", fwd),
            ("host", loop - fwd),
            ("postprocess", post),
        ):
            samples[k].append(v * 1e3)
    if len(decode) < decode_steps // 2:
        raise RuntimeError(f"only {len(decode)} decode-only steps at batch {batch}")
    return {
        "batch": batch,
        "api": "LLM.generate",
        "decode_steps": len(decode),
        "tokenizer": engine.tokenizer is not None,
        "ms": {k: _stats(v) for k, v in samples.items()},
        "check_tokens": [o.token_ids[:16] for o in outs[:4]],
    }


def detok_micro(tokenizer_dir: str, n_tokens: int, tail: int) -> dict[str, Any]:
    """Detokenizer cost per token when the output is ``n_tokens`` long (mean of the last
    ``tail`` tokens), on a deterministic ordinary-token sequence."""
    import random

    from transformers import AutoTokenizer

    from engine.core.detokenizer import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(0)
    ids = [rng.randrange(100, tok.vocab_size) for _ in range(n_tokens)]
    det = IncrementalDetokenizer.start(tok, ["\x00never"], True, [])
    per_token: list[float] = []
    text = []
    for i, t in enumerate(ids):
        t0 = time.perf_counter()
        text.append(det.add([t], i == len(ids) - 1))
        per_token.append((time.perf_counter() - t0) * 1e3)
    full = tok.decode(ids, skip_special_tokens=True)
    return {
        "output_len": n_tokens,
        "ms_per_token_at_end": statistics.fmean(per_token[-tail:]),
        "ms_per_token_mean": statistics.fmean(per_token),
        "text_matches_full_decode": "".join(text) == full,
    }


def _stats(v: list[float]) -> dict[str, float]:
    s = sorted(v)
    return {"mean": statistics.fmean(v), "p50": statistics.median(v), "min": s[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description="one measurement of engine_host_overhead")
    ap.add_argument("child", help="a batch size, llm<batch> or detok")
    ap.add_argument("--prompt-len", type=int, required=True)
    ap.add_argument("--decode-steps", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--detok-len", type=int, required=True)
    ap.add_argument("--clock", choices=["wall", "thread"], required=True)
    ap.add_argument("--tokenizer-dir")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.clock == "thread":
        global _now
        _now = time.thread_time
    import engine

    result: dict[str, Any] = {"engine_file": engine.__file__}
    if args.child == "detok":
        result.update(detok_micro(args.tokenizer_dir, args.detok_len, 100))
    elif args.child.startswith("llm"):
        result.update(
            measure_llm(int(args.child[3:]), args.prompt_len, args.decode_steps, args.tokenizer_dir)
        )
    else:
        result.update(
            measure(int(args.child), args.prompt_len, args.decode_steps, args.tokenizer_dir)
        )
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
