"""Host (CPU) time per engine step, with the forward pass taken out.

On a GPU the engine's host work per step (scheduling, ``ModelRunner.prepare``, sampling,
``StepOutputs.process``, detokenization) runs serialised with the model's step, so every
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

    python -m benchmarks.engine.engine_host_overhead --baseline-engine /tmp/engine_before

writes ``benchmarks/results/engine/engine_host_overhead.json`` (the markdown report goes to
stdout, and to ``--output-md`` when given). Each measurement runs in a fresh process
(``benchmarks.engine.host_overhead_child``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.record import recorded_command, result_path

ROOT = Path(__file__).resolve().parents[2]

# Per-step phases as the child measures them (benchmarks.engine.host_overhead_child).
PHASES = ("step", "forward", "host", "schedule", "prepare", "postprocess")
LLM_PHASES = ("loop", "step", "generate", "forward", "host", "postprocess")


def _run_child(
    args: argparse.Namespace, what: str, engine_path: str | None, tok: str | None
) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.engine.host_overhead_child", what]
    cmd += ["--prompt-len", str(args.prompt_len), "--decode-steps", str(args.decode_steps)]
    cmd += ["--threads", str(args.threads), "--detok-len", str(args.detok_len)]
    cmd += ["--clock", args.clock]
    if tok:
        cmd += ["--tokenizer-dir", tok]
    # Under ``python -m`` the working directory is sys.path[0]: running in the baseline's
    # directory makes ``import engine`` find the baseline copy; the rest comes from ROOT.
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=engine_path or ROOT, env=env, check=False
    )
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
    ap.add_argument(
        "--output-json", default=str(result_path("engine", "engine_host_overhead.json"))
    )
    ap.add_argument("--output-md", default=None, help="also write the markdown report here")
    args = ap.parse_args()

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
        "command": recorded_command("benchmarks.engine.engine_host_overhead"),
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
    if args.output_md:
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
        f"Command: `{report['command']}` (from the repository root)",
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
