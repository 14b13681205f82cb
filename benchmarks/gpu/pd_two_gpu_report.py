"""Helpers of `benchmarks/gpu/pd_two_gpu.sh`: build the benchmark's model directory, and turn
its `pdserve bench serve` results into `pd_two_gpu.md` / `pd_two_gpu.json`.

    python -m benchmarks.gpu.pd_two_gpu_report model --config CONFIG.json --out DIR [--tiny]
    python -m benchmarks.gpu.pd_two_gpu_report report --work WORK --md OUT.md --json OUT.json ...

`model` writes ``config.json`` (``--tiny``: the same vocabulary and special ids, a 2-layer
width-64 body for CPU dry runs) and a synthetic word-level tokenizer that covers the whole
vocabulary: token ``i`` is the word ``t<i>`` (the config's bos/eos ids are special tokens).
Random-weight benchmarks need no real tokenizer, but the router tokenizes, the engine
detokenizes (bench serve times only non-empty text chunks) and bench serve sizes prompts
in tokens; with this tokenizer a prompt of N random words is exactly N random token ids
from the full 128k vocabulary, which a borrowed smaller tokenizer (SmolLM2's 49k) would
not give, and every generated id decodes to a non-empty word.

`report` reads ``WORK/<configuration>/bench*.json`` (bench serve's ``--result-json`` with
``--save-requests``, one file per rate) and ``WORK/<configuration>/status``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The dry-run body: a real Llama layer stack, small enough for a shared 2-core CPU.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "torch_dtype": "float32",
}
CONFIGS = {  # directory name -> label, in report order
    "pd-fs": "1P+1D, fs on /dev/shm",
    "pd-redis": "1P+1D, redis (loopback)",
    "colocated": "2x colocated",
}


def make_model(config_path: Path, out: Path, tiny: bool) -> Path:
    """Write ``out/config.json`` and the synthetic tokenizer; returns ``out``."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    if tiny:
        config.update(TINY)
    vocab_size = int(config["vocab_size"])
    names = [f"t{i}" for i in range(vocab_size)]
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    for key, text in special.items():
        token_id = config.get(key + "_id")
        if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise ValueError(f"{config_path}: {key}_id must be an id below vocab_size")
        names[token_id] = text
    tokenizer = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in special.values()])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    tokenizer.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(config.get("max_position_embeddings", 8192)),
        "clean_up_tokenization_spaces": False,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """K and V of every layer for one token."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads", heads))
    return int(config["num_hidden_layers"]) * 2 * kv_heads * head_dim * dtype_bytes


def _pct(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (as bench serve computes them); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _kv_per_request(requests: list[dict[str, Any]]) -> dict[str, float | None]:
    """p50/p99 (ms) of each request's KV save, load and save + load, from the router's
    per-request ``pdserve_timings``."""
    phases: dict[str, list[float]] = {"kv_save": [], "kv_load": [], "kv_total": []}
    for req in requests:
        timings = req.get("timings") or {}
        if not req.get("ok") or "kv_save" not in timings:
            continue
        save, load = float(timings["kv_save"]), float(timings.get("kv_load", 0.0))
        for key, value in (("kv_save", save), ("kv_load", load), ("kv_total", save + load)):
            phases[key].append(value * 1000.0)
    out: dict[str, float | None] = {"requests": float(len(phases["kv_total"]))}
    for key, values in phases.items():
        out[f"{key}_p50"], out[f"{key}_p99"] = _pct(values, 50), _pct(values, 99)
    return out


def _goodput_grid(run: dict[str, Any], slos_ms: list[float]) -> dict[str, float | None]:
    """Goodput (req/s) at each TPOT bound, from the per-request records: completed requests
    whose TPOT is within the bound, per second of the run (bench serve's definition)."""
    duration = float(run["summary"]["duration_s"])
    tpots = [
        r["tpot"] for r in run.get("requests", []) if r.get("ok") and r.get("tpot") is not None
    ]
    if not duration > 0 or "requests" not in run:
        return {f"{slo:g}": None for slo in slos_ms}
    return {f"{slo:g}": sum(t * 1000.0 <= slo for t in tpots) / duration for slo in slos_ms}


def _stat(summary: dict[str, Any], key: str, q: str) -> float | None:
    stats = summary.get(key)
    return None if stats is None else float(stats[q])


def collect(work: Path, slos_ms: list[float]) -> dict[str, Any]:
    """Every configuration's status and per-rate rows (summary numbers and KV timings)."""
    result: dict[str, Any] = {}
    for name in CONFIGS:
        status_file = work / name / "status"
        status = status_file.read_text().strip() if status_file.exists() else "not run"
        rows = []
        for bench_file in sorted((work / name).glob("bench*.json")):
            doc = json.loads(bench_file.read_text(encoding="utf-8"))
            for run in doc["runs"]:
                summary = run["summary"]
                row = {
                    "rate": run["request_rate"],
                    "completed": summary["completed"],
                    "failed": summary["failed"],
                    "errors": summary["errors"],
                    "duration_s": summary["duration_s"],
                    "request_throughput": summary["request_throughput"],
                    "output_throughput": summary["output_throughput"],
                    "goodput": summary["goodput"],
                    "good_requests": summary["good_requests"],
                }
                for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
                    for q in ("mean", "p50", "p99"):
                        row[f"{key[:-3]}_{q}"] = _stat(summary, key, q)
                row["kv"] = _kv_per_request(run.get("requests", []))
                row["goodput_at_tpot_ms"] = _goodput_grid(run, slos_ms)
                rows.append(row)
        rows.sort(key=lambda row: float(row["rate"]))
        result[name] = {"label": CONFIGS[name], "status": status, "rows": rows}
    return result


def _fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _latency_table(results: dict[str, Any], slo: str) -> list[str]:
    lines = [
        f"| configuration | rate (req/s) | done / failed | req/s | TTFT p50 | TTFT p99 | ITL p50 "
        f"| ITL p99 | TPOT p50 | TPOT p99 | E2E p99 | goodput ({slo}, req/s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results.values():
        for r in res["rows"]:
            lines.append(
                f"| {res['label']} | {r['rate']} | {r['completed']} / {r['failed']} "
                f"| {_fmt(r['request_throughput'], 2)} | {_fmt(r['ttft_p50'])} "
                f"| {_fmt(r['ttft_p99'])} | {_fmt(r['itl_p50'])} | {_fmt(r['itl_p99'])} "
                f"| {_fmt(r['tpot_p50'])} | {_fmt(r['tpot_p99'])} | {_fmt(r['e2e_p99'], 0)} "
                f"| {_fmt(r['goodput'], 2)} |"
            )
    return lines


def _kv_table(results: dict[str, Any], mib_per_request: float) -> list[str]:
    lines = [
        "| configuration | rate | requests | KV save p50 / p99 | KV load p50 / p99 "
        "| save + load p50 / p99 | KV GB / (save + load p50) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        if not name.startswith("pd-"):
            continue
        for r in res["rows"]:
            kv = r["kv"]
            total = kv["kv_total_p50"]
            rate = None if not total else mib_per_request * 1.048576e-3 / (total / 1000.0)
            lines.append(
                f"| {res['label']} | {r['rate']} | {int(kv['requests'] or 0)} "
                f"| {_fmt(kv['kv_save_p50'])} / {_fmt(kv['kv_save_p99'])} "
                f"| {_fmt(kv['kv_load_p50'])} / {_fmt(kv['kv_load_p99'])} "
                f"| {_fmt(total)} / {_fmt(kv['kv_total_p99'])} | {_fmt(rate, 2)} |"
            )
    return lines


def _goodput_table(results: dict[str, Any], slos_ms: list[float]) -> list[str]:
    heads = " | ".join(f"TPOT ≤ {slo:g} ms" for slo in slos_ms)
    lines = [f"| configuration | rate | {heads} |", "|---|---|" + "---|" * len(slos_ms)]
    for res in results.values():
        for r in res["rows"]:
            cells = " | ".join(_fmt(v, 2) for v in r["goodput_at_tpot_ms"].values())
            lines.append(f"| {res['label']} | {r['rate']} | {cells} |")
    return lines


def _ratio_lines(results: dict[str, Any]) -> list[str]:
    """Colocated ÷ P/D (fs) per rate: the comparison the benchmark is for."""
    pd = {r["rate"]: r for r in results["pd-fs"]["rows"]}
    lines = []
    for r in results["colocated"]["rows"]:
        other = pd.get(r["rate"])
        if other is None:
            continue
        parts = []
        for key, label in (
            ("itl_p99", "ITL p99"),
            ("ttft_p50", "TTFT p50"),
            ("tpot_p50", "TPOT p50"),
        ):
            a, b = r[key], other[key]
            parts.append(f"{label} {_fmt(a / b, 2) if a and b else '—'}x")
        lines.append(f"- {r['rate']} req/s: colocated ÷ P/D(fs): " + ", ".join(parts))
    return lines


def render(
    results: dict[str, Any], meta: dict[str, str], mib_per_request: float, slos_ms: list[float]
) -> str:
    """The markdown report (a header of facts, the tables, each configuration's status)."""
    slo = meta.get("slo", "")
    out = [f"# {meta.get('title', 'Two-GPU disaggregation benchmark')}", ""]
    out += [f"- {key}: {value}" for key, value in meta.items() if key not in ("title",)]
    out += ["", "## Status", ""]
    out += [f"- {res['label']}: {res['status']}" for res in results.values()]
    out += ["", "## Latency and goodput (ms unless stated)", "", *_latency_table(results, slo)]
    out += ["", "## Goodput (req/s) at other TPOT bounds, from the per-request records", ""]
    out += _goodput_table(results, slos_ms)
    out += ["", f"## KV transfer per request (ms; {mib_per_request:.0f} MiB of KV per prompt)"]
    out += ["", "From the router's per-request `pdserve_timings` (`kv_save` on the prefill"]
    out += ["instance after the first token, `kv_load` on the decode instance).", ""]
    out += [*_kv_table(results, mib_per_request), "", "## Colocated vs P/D (fs), same rates", ""]
    out += _ratio_lines(results) or ["- no rate ran in both configurations"]
    errors = [
        f"- {res['label']} at {r['rate']} req/s: {r['errors']}"
        for res in results.values()
        for r in res["rows"]
        if r["errors"]
    ]
    if errors:
        out += ["", "## Errors", "", *errors]
    return "\n".join(out) + "\n"


def _report(args: argparse.Namespace) -> int:
    work = Path(args.work)
    slos = [float(x) for x in args.tpot_grid.split(",") if x.strip()]
    results = collect(work, slos)
    config = json.loads((Path(args.model) / "config.json").read_text(encoding="utf-8"))
    mib = kv_bytes_per_token(config, args.kv_dtype_bytes) * args.input_len / 2**20
    meta = dict(item.split("=", 1) for item in args.meta)
    Path(args.md).write_text(render(results, meta, mib, slos), encoding="utf-8")
    doc = {"meta": meta, "kv_mib_per_request": mib, "configurations": results}
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    ran = any(res["rows"] for res in results.values())
    logger.info("wrote %s and %s", args.md, args.json)
    return 0 if ran else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    model = sub.add_parser("model", help="write the model directory")
    model.add_argument("--config", required=True)
    model.add_argument("--out", required=True)
    model.add_argument("--tiny", action="store_true")
    report = sub.add_parser("report", help="write the markdown and JSON report")
    report.add_argument("--work", required=True, help="folder with one subfolder per configuration")
    report.add_argument("--model", required=True, help="the model directory (for KV sizes)")
    report.add_argument("--input-len", type=int, required=True)
    report.add_argument("--kv-dtype-bytes", type=int, default=2)
    report.add_argument("--md", required=True)
    report.add_argument("--json", required=True)
    report.add_argument("--tpot-grid", default="15,25,50,100", help="TPOT bounds (ms)")
    report.add_argument("--meta", action="append", default=[], help="KEY=VALUE header line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if args.command == "model":
        make_model(Path(args.config), Path(args.out), args.tiny)
        return 0
    return _report(args)


if __name__ == "__main__":
    sys.exit(main())
