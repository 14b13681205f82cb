"""Host (CPU) time per engine step, with the forward pass taken out.

On a GPU the engine's host work per step (scheduling, ``ModelRunner.prepare``, sampling,
``_postprocess``, detokenization) runs serialised with the model's step, so every
millisecond of it adds to TPOT. This benchmark isolates that host time on the CPU: a tiny
dummy Llama (2 layers, hidden 64) makes the forward cheap, N requests of 1000 random
prompt tokens are prefilled, and then ``--decode-steps`` decode steps are timed. Per step:

* ``step``: wall time of ``LLMEngine.step()``;
* ``forward``: time inside ``runner.execute`` minus the time inside ``runner.prepare``;
* ``host`` = ``step - forward`` (what this benchmark is about), and its parts
  ``schedule``, ``prepare`` and ``postprocess`` (sampling, token bookkeeping, detokenizer).

``--public-api`` adds cases (``llm256`` …) that run the same batch through the public
``LLM.generate`` instead of calling ``LLMEngine.step()`` directly, and time each decode
iteration of its loop: ``loop`` is the wall time from one ``step()`` call to the next
(so it includes what ``generate`` does with the step's outputs), ``generate`` = loop − step,
and ``host`` = loop − forward there.

With ``--tokenizer-dir`` the dummy model dir also gets that model's tokenizer, so the
detokenizer does real work (dummy weights over a 1024-token vocabulary emit ordinary ids).
A separate micro-benchmark times the detokenizer per token at output length 1000.

``--baseline-engine DIR`` runs the same measurement, interleaved in fresh subprocesses, on a
copy of the ``engine`` package found under DIR (e.g. a snapshot taken before a change), so
before and after are measured side by side on the same (noisy, shared) machine:

    .venv/bin/python benchmarks/engine_host_overhead.py --baseline-engine /tmp/engine_before

writes ``engine_host_overhead.md`` and ``.json`` next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

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
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
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
    schedule, postprocess = engine.scheduler.schedule, engine._postprocess

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
    setattr(engine, "_postprocess", timed("postprocess", postprocess))  # noqa: B010

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

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
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
    execute, prepare, postprocess = runner.execute, runner.prepare, engine._postprocess
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
    setattr(engine, "_postprocess", timed_postprocess)  # noqa: B010
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

    from engine.detokenizer import IncrementalDetokenizer

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


def _child(args: argparse.Namespace) -> None:
    if args.engine_path:
        sys.path.insert(0, args.engine_path)
    sys.path.insert(1 if args.engine_path else 0, str(ROOT))
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


def _run_child(
    args: argparse.Namespace, what: str, engine_path: str | None, tok: str | None
) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", what]
    cmd += ["--prompt-len", str(args.prompt_len), "--decode-steps", str(args.decode_steps)]
    cmd += ["--threads", str(args.threads), "--detok-len", str(args.detok_len)]
    cmd += ["--clock", args.clock]
    if engine_path:
        cmd += ["--engine-path", engine_path]
    if tok:
        cmd += ["--tokenizer-dir", tok]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return dict(json.loads(lines[-1][len("RESULT ") :]))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--decode-steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs per variant")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each run")
    ap.add_argument(
        "--tokenizer-dir",
        help="tokenizer for the +tokenizer runs (default: ~/.cache/pdserve/models/smollm2)",
    )
    ap.add_argument("--detok-len", type=int, default=1000)
    ap.add_argument(
        "--public-api",
        action="store_true",
        help="also time the LLM.generate loop (cases llm<batch>)",
    )
    ap.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: per-step times in main-thread CPU time (for a loaded machine)",
    )
    ap.add_argument("--skip-engine", action="store_true", help="only the --public-api cases")
    ap.add_argument("--baseline-engine", help="dir holding a copy of the engine package to compare")
    ap.add_argument("--output-json", default=str(HERE / "engine_host_overhead.json"))
    ap.add_argument("--output-md", default=str(HERE / "engine_host_overhead.md"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--engine-path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return

    tok_dir = args.tokenizer_dir or str(Path.home() / ".cache/pdserve/models/smollm2")
    tok = tok_dir if os.path.exists(tok_dir) else None
    variants: dict[str, str | None] = {"current": None}
    if args.baseline_engine:
        variants = {"baseline": str(Path(args.baseline_engine).resolve()), "current": None}
    cases: list[tuple[str, str | None]] = []
    if not args.skip_engine:
        cases += [(str(b), None) for b in args.batch_sizes]
        if tok:
            cases += [(str(b), tok) for b in args.batch_sizes] + [("detok", tok)]
    if args.public_api:
        cases += [(f"llm{b}", None) for b in args.batch_sizes]
        if tok:
            cases += [(f"llm{b}", tok) for b in args.batch_sizes]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for what, case_tok in cases:
        key = (what if what == "detok" or what.startswith("llm") else f"batch{what}") + (
            "+tokenizer" if case_tok and what != "detok" else ""
        )
        runs[key] = {v: [] for v in variants}
        for _ in range(args.repeats if what != "detok" else 1):
            for variant, path in variants.items():  # interleaved: same machine state
                r = _run_child(args, what, path, case_tok)
                runs[key][variant].append(r)
                print(key, variant, _brief(r), flush=True)
    report = {
        "command": shlex.join(
            [".venv/bin/python", "benchmarks/engine_host_overhead.py"] + sys.argv[1:]
        ),
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "threads": args.threads,
        "clock": args.clock,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "runs": runs,
    }
    Path(args.output_json).write_text(json.dumps(report, indent=1) + "\n")
    md = _markdown(report, list(variants))
    Path(args.output_md).write_text(md)
    print(md)


def _brief(r: dict[str, Any]) -> str:
    if "ms" not in r:
        return f"{r['ms_per_token_at_end']:.3f} ms/token at {r['output_len']}"
    return " ".join(f"{k}={r['ms'][k]['p50']:.2f}" for k in _phases(r))


def _phases(r: dict[str, Any]) -> tuple[str, ...]:
    return LLM_PHASES if r.get("api") == "LLM.generate" else PHASES


def _best(rs: list[dict[str, Any]], phase: str) -> float:
    """Median over the repeats of each run's per-step p50 (robust to a noisy neighbour)."""
    return statistics.median(r["ms"][phase]["p50"] for r in rs)


def _markdown(report: dict[str, Any], variants: list[str]) -> str:
    out = [
        "# Engine host overhead per step",
        "",
        f"Command: `{report['command']}` (from the repository root; writes this file and "
        "`engine_host_overhead.json`)",
        "",
        f"Run {report['started']} – {report['finished']} on {report['machine']}, "
        f"{report['cpu_count']} CPUs (shared), {report['threads']} torch thread(s), "
        f"load average at end {report['load_average'][0]:.2f}. Tiny dummy Llama (2 layers, "
        f"hidden 64, vocab 1024), prompts of {report['prompt_len']} random tokens, greedy, "
        f"{report['decode_steps']} timed decode steps, clock: "
        f"{'main-thread CPU time' if report.get('clock') == 'thread' else 'wall'}. "
        "Each cell: median over "
        "interleaved runs of the per-step p50, in ms. `host` = step − forward.",
        "",
    ]
    ratios = []
    for group, phases in (("batch", PHASES), ("llm", LLM_PHASES)):
        keys = [k for k in report["runs"] if k.startswith(group)]
        if not keys:
            continue
        if group == "llm":
            out += [
                "",
                "Through the public `LLM.generate` loop (`loop` = one step() call to the next, "
                "`generate` = loop − step: the loop's own work on the outputs; `host` = "
                "loop − forward):",
                "",
            ]
        out += ["| case | variant | " + " | ".join(phases) + " |"]
        out += ["|" + "---|" * (len(phases) + 2)]
        for key in keys:
            by_variant = report["runs"][key]
            for v in variants:
                cells = " | ".join(f"{_best(by_variant[v], p):.2f}" for p in phases)
                out.append(f"| {key} | {v} | {cells} |")
            if "baseline" not in by_variant:
                continue
            b, c = _best(by_variant["baseline"], "host"), _best(by_variant["current"], "host")
            same = all(
                x["check_tokens"] == y["check_tokens"]
                for x, y in zip(by_variant["baseline"], by_variant["current"], strict=True)
            )
            ratios.append(
                f"- {key}: host {b:.2f} → {c:.2f} ms/step (**{b / c:.2f}× less**); "
                f"greedy tokens identical: {same}"
            )
    if ratios:
        out += ["", "Before → after (host ms/step, p50):", "", *ratios]
    detok = report["runs"].get("detok")
    if detok:
        out += [
            "",
            "Detokenizer alone (SmolLM2 tokenizer), per token at output length "
            f"{detok[variants[0]][0]['output_len']}:",
            "",
        ]
        for v in variants:
            r = detok[v][0]
            out.append(
                f"- {v}: {r['ms_per_token_at_end']:.3f} ms/token over the last 100 tokens, "
                f"{r['ms_per_token_mean']:.3f} ms/token overall; streamed text equals the full "
                f"decode: {r['text_matches_full_decode']}"
            )
    out += [
        "",
        "Notes:",
        "",
        "- `baseline` is the `engine` package as it was before the host-overhead change "
        "(copied to the `--baseline-engine` directory), `current` the working tree; each run "
        "is a fresh subprocess and the two alternate, so both see the same machine load. "
        "To recreate a baseline from a commit: `mkdir -p /tmp/engine_before && git archive "
        "<commit> engine | tar -x -C /tmp/engine_before`.",
        "- Compare `host` only: the baseline copy also predates other concurrent changes to "
        "`engine/models` and `engine/attention`, so its `forward` (and `step`) differ for "
        "reasons unrelated to host overhead.",
        "- `postprocess` includes the sampler's `argmax` over `[batch, 1024]` logits on the CPU "
        "(≈0.6 ms at batch 256 with one thread); on a GPU that is device work.",
        "- `+tokenizer` runs give the dummy model SmolLM2's tokenizer, so every token is "
        "detokenized; outputs there are ~50 tokens long, far from where the old "
        "whole-output decode hurt most (see the detokenizer line at 1000 tokens).",
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
