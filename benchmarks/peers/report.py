"""The peer table: ours / vLLM per row and precision, from the four offline.py JSONs.

    python -m benchmarks.peers.report   # reads and writes benchmarks/results/peers/

Every ratio is a speed ratio, above 1.0 where pdserve is faster: rates are ours / vLLM,
times (ms/token, TTFT) are vLLM / ours. Writes peers_h200.json and peers_h200.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.peers.offline import RESULTS

# row key -> (label, higher is better)
ROWS = {
    "decode_b1_ms_per_token": ("batch-1 decode, ms/token (512 ctx)", False),
    "decode_b128_tok_s": ("batch-128 decode-only, tok/s (1k ctx)", True),
    "thr_1k_1k_out_tok_s": ("256 x 1k in / 1k out, output tok/s", True),
    "prefill_2k_ttft_ms": ("2k-token prefill TTFT, ms", False),
    "mixed_1000_out_tok_s": ("mixed 1,000 (ShareGPT-like), output tok/s", True),
}


def speed_ratio(ours: float, theirs: float, higher_is_better: bool) -> float:
    return ours / theirs if higher_is_better else theirs / ours


def build(results: Path) -> dict[str, Any]:
    table: dict[str, Any] = {"rows": {}, "runs": {}}
    for precision in ("bf16", "fp8"):
        runs = {
            e: json.loads((results / f"{e}_{precision}.json").read_text())
            for e in ("pdserve", "vllm")
        }
        table["runs"][precision] = {
            e: {
                "command": r["command"],
                "started": r["started"],
                "engine_config": r["engine_config"],
            }
            for e, r in runs.items()
        }
        for key, (_, higher) in ROWS.items():
            ours, theirs = runs["pdserve"]["rows"][key], runs["vllm"]["rows"][key]
            table["rows"].setdefault(key, {})[precision] = {
                "pdserve": ours,
                "vllm": theirs,
                "ours_over_vllm": round(speed_ratio(ours, theirs, higher), 3),
            }
    for key in ("decode_b128_tok_s", "thr_1k_1k_out_tok_s", "decode_b1_ms_per_token"):
        bf16, fp8 = (table["rows"][key][p]["pdserve"] for p in ("bf16", "fp8"))
        table.setdefault("fp8_over_bf16_pdserve", {})[key] = round(
            speed_ratio(fp8, bf16, ROWS[key][1]), 3
        )
    return table


def markdown(table: dict[str, Any]) -> str:
    lines = [
        "| row | bf16 pdserve | bf16 vLLM | bf16 ours/vLLM | fp8 pdserve | fp8 vLLM | fp8 ours/vLLM |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, (label, _) in ROWS.items():
        b, f = table["rows"][key]["bf16"], table["rows"][key]["fp8"]
        lines.append(
            f"| {label} | {b['pdserve']} | {b['vllm']} | **{b['ours_over_vllm']:.2f}x** "
            f"| {f['pdserve']} | {f['vllm']} | **{f['ours_over_vllm']:.2f}x** |"
        )
    lines.append("")
    lines.append("Ratios are speed ratios (above 1.0: pdserve faster). Commands:")
    for precision, runs in table["runs"].items():
        for engine, run in runs.items():
            lines.append(f"- {engine} {precision} ({run['started']}): `{run['command']}`")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args()
    results = Path(args.results)
    table = build(results)
    (results / "peers_h200.json").write_text(json.dumps(table, indent=1) + "\n")
    (results / "peers_h200.md").write_text(markdown(table))
    print(markdown(table))


if __name__ == "__main__":
    main()
