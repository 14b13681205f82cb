"""Two mixed-set profiles (profile_mixed.py) side by side, per output token.

    python -m benchmarks.peers.profile_compare OURS.json THEIRS.json [--md OUT.md]
    python -m benchmarks.peers.profile_compare --dir DIR [--md OUT.md]

``--dir`` pairs ``pdserve_<p>.json`` with ``vllm_<p>.json`` for each precision found there.
Every time is in microseconds per output token (both runs must have made the same tokens
for the rows to compare; the table says when they did not), the ratio is A / B (above 1.0
where A spends more), and the difference A - B ranks what makes A slower: the rows with the
largest positive difference are what still loses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.peers.profile_events import CATEGORIES, CATEGORY_LABELS


def _label(run: dict[str, Any]) -> str:
    return f"{run['engine']} {run['precision']}"


def rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, float, float, bool]]:
    """(row label, A's value, B's value, whether the row is a part of the wall time: the
    idle time and each category's kernel time) for the table; times per output token."""
    pa, pb = a["profile"], b["profile"]
    out = [
        ("output tok/s, unprofiled", a["out_tok_s"], b["out_tok_s"], False),
        ("wall us/token, profiled", _per_tok(pa, pa["wall_s"]), _per_tok(pb, pb["wall_s"]), False),
        ("device busy us/token", pa["busy_us_per_out_token"], pb["busy_us_per_out_token"], False),
        ("device idle us/token (host side)", pa["idle_us_per_out_token"], pb["idle_us_per_out_token"], True),
        ("device idle share", pa["idle_share"], pb["idle_share"], False),
        ("kernel time us/token (summed)", _per_tok(pa, pa["kernel_time_s"]), _per_tok(pb, pb["kernel_time_s"]), False),
        ("device events per token", pa["kernels_per_out_token"], pb["kernels_per_out_token"], False),
    ]  # fmt: skip
    for cat in CATEGORIES:
        ca, cb = pa["categories"][cat], pb["categories"][cat]
        out.append(
            (
                f"{CATEGORY_LABELS[cat]} us/token",
                ca["us_per_out_token"],
                cb["us_per_out_token"],
                True,
            )
        )
    return out


def _per_tok(p: dict[str, Any], seconds: float) -> float:
    return round(seconds * 1e6 / max(p["out_tokens"], 1), 3)


def _fmt(v: float) -> str:
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def table(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The markdown side-by-side table of two runs, and what loses most."""
    la, lb = _label(a), _label(b)
    lines = [f"### {la} vs {lb}", ""]
    for tag, run in (("A", a), ("B", b)):
        where = run.get("gpu", run.get("device", "?"))
        lines.append(f"{tag}: `{run.get('command', '?')}` ({where}, {run.get('started', '?')})  ")
    lines.append("")
    if a["out_tokens"] != b["out_tokens"]:
        lines += [f"Note: the runs made {a['out_tokens']} and {b['out_tokens']} tokens.", ""]
    lines += [f"| per output token | {la} | {lb} | A / B | A - B |", "|---|---:|---:|---:|---:|"]
    losses: list[tuple[float, str]] = []
    for name, va, vb, part in rows(a, b):
        ratio = f"{va / vb:.2f}" if vb else "-"
        lines.append(f"| {name} | {_fmt(va)} | {_fmt(vb)} | {ratio} | {_fmt(va - vb)} |")
        if part:
            losses.append((va - vb, name.removesuffix(" us/token")))
    worst = [f"{n} (+{d:.1f} us)" for d, n in sorted(losses, reverse=True) if d > 0][:4]
    lines += ["", f"Where {la} spends more per token: " + (", ".join(worst) or "nowhere"), ""]
    return "\n".join(lines)


def pairs_in(folder: Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    out = []
    for precision in ("bf16", "fp8"):
        a, b = folder / f"pdserve_{precision}.json", folder / f"vllm_{precision}.json"
        if a.exists() and b.exists():
            out.append((json.loads(a.read_text()), json.loads(b.read_text())))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("runs", nargs="*", help="two profile_mixed.py JSONs: A (ours) and B")
    ap.add_argument("--dir", default=None, help="pair pdserve_<p>.json with vllm_<p>.json")
    ap.add_argument("--md", default=None, help="also write the tables here")
    args = ap.parse_args(argv)
    if args.dir:
        pairs = pairs_in(Path(args.dir))
    elif len(args.runs) == 2:
        pairs = [tuple(json.loads(Path(p).read_text()) for p in args.runs)]  # type: ignore[list-item]
    else:
        ap.error("give two JSONs or --dir")
    if not pairs:
        ap.error(f"no pdserve_<p>.json + vllm_<p>.json pair in {args.dir}")
    text = "\n".join(table(a, b) for a, b in pairs)
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
