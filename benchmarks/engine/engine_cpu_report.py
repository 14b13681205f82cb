"""The markdown report of ``benchmarks.engine.engine_cpu`` (and its greedy agreement)."""

from __future__ import annotations

import statistics
from typing import Any


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of leading greedy tokens on which the two implementations agree."""
    fracs = []
    for x, y in zip(a, b, strict=True):
        same = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        fracs.append(same / max(len(x), 1))
    return statistics.fmean(fracs) if fracs else 0.0


def render_markdown(report: dict[str, Any]) -> str:
    e, h, s = report["engine"], report["transformers"], report["scheduler"]
    ratio = report["ratio_output_tokens_per_s"]
    hf_all: dict[str, dict[str, Any]] = report.get("transformers_by_dtype") or {"float32": h}
    lines = [
        "# Engine CPU benchmark",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {report['machine']} · torch {report['torch']} · threads {report['threads']} · "
        f"model `{report['model']}` ({report['load_format']} weights), engine "
        f"{report.get('dtype', 'float32')} · run at {report['time']}",
        "",
        f"## Offline throughput: {e['num_requests']} prompts × ~{report['input_len']} tokens, "
        f"{report['output_len']} new tokens each (greedy, EOS ignored)",
        "",
        "| | elapsed s | process CPU s | req/s | input tok/s | output tok/s | total tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [(f"pdserve engine ({report.get('dtype', 'float32')})", e)]
    rows += [(f"transformers generate, one batch ({d})", r) for d, r in hf_all.items()]
    for name, r in rows:
        lines.append(
            f"| {name} | {r['elapsed_s']:.1f} | {r['cpu_s']:.1f} | {r['requests_per_s']:.3f} | {r['input_tokens_per_s']:.1f} | "
            f"{r['output_tokens_per_s']:.1f} | {r['total_tokens_per_s']:.1f} |"
        )
    st = e["steps"]
    target = "met" if ratio >= 2.0 else "NOT met"
    lines += [
        "",
        f"**Ratio (output tokens/s, engine ÷ transformers' fastest, {h.get('dtype', 'float32')}): "
        f"{ratio:.2f}×** (target ≥ 2×: {target}); by process CPU time: "
        f"{report['ratio_cpu_time']:.2f}×.",
        "",
        f"Engine steps: {st['count']}, step wall time mean {st['mean_ms']:.1f} ms, p50 {st['p50_ms']:.1f} ms, "
        f"p99 {st['p99_ms']:.1f} ms. transformers padded the batch to "
        f"{h['padded_input_tokens']} prompt tokens ({e['input_tokens']} real).",
        f"Greedy cross-check on {len(e['first_tokens'])} prompts × {report['check_tokens']} tokens: "
        f"{report['greedy_agreement'] * 100:.0f} % of leading tokens identical "
        f"(against transformers in {h.get('dtype', 'float32')}).",
        "",
        f"## Scheduler + KV manager per step, {s['running_requests']} running requests (no model)",
        "",
        "| phase (wall clock, or thread CPU time) | steps | mean ms | p50 ms | p99 ms | max ms |",
        "|---|---|---|---|---|---|",
    ]
    for phase in ("decode", "decode_cpu", "churn", "churn_cpu"):
        p = s[phase]
        lines.append(
            f"| {phase} | {p['steps']} | {p['mean_ms']:.3f} | {p['p50_ms']:.3f} | {p['p99_ms']:.3f} | {p['max_ms']:.3f} |"
        )

    def verdict(ms: float) -> str:
        return "met" if ms <= 1.0 else "NOT met"

    lines += [
        "",
        f"Target ≤ 1 ms per step: decode CPU-time mean {s['decode_cpu']['mean_ms']:.3f} ms "
        f"({verdict(s['decode_cpu']['mean_ms'])}), wall p50 {s['decode']['p50_ms']:.3f} ms "
        f"({verdict(s['decode']['p50_ms'])}), wall mean {s['decode']['mean_ms']:.3f} ms "
        f"({verdict(s['decode']['mean_ms'])}; the wall mean includes time descheduled on the shared CPU).",
        "",
    ]
    if e.get("batch1_ms_per_token"):
        lines += [
            f"## Batch-1 decode, {report['batch1_tokens']} tokens after a "
            f"~{report['input_len']}-token prompt",
            "",
            "| | ms per token |",
            "|---|---|",
            f"| pdserve engine ({report.get('dtype', 'float32')}) | "
            f"{e['batch1_ms_per_token']:.1f} |",
        ]
        lines += [
            f"| transformers ({d}) | {r['batch1_ms_per_token']:.1f} |"
            for d, r in hf_all.items()
            if r.get("batch1_ms_per_token")
        ]
        lines.append("")
    notes = report.get("notes")
    if notes:
        lines += ["## Notes", "", notes, ""]
    return "\n".join(lines)
