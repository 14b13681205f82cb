"""Delta handoffs and local suffixes on a multi-turn chat (issue 38, docs/design.md §3 "Delta
handoffs", §5 "Local suffix"): what each turn's KV handoff moves when the decode instance
already holds the conversation so far, beside the full-transfer baseline (the same decode
with its prefix cache off, so every turn moves the whole prompt), and what changes when
the router lets that decode compute a short missing suffix itself (``local``: no prefill,
no transfer, ``--max-local-prefill-tokens``). ``full`` and ``delta`` run with the threshold
at 0 (every turn through the prefill).

For each mode it starts a prefill service, a decode service and a router (real processes,
``--connector fs`` or ``p2p``), then plays conversations of ``--turns`` turns through the
``openai`` client (chat API, greedy, ``pdserve_timings``): each turn resends the whole
conversation plus a new user message. Per turn it records the prompt's tokens, the tokens
new since the previous turn, the handoff (``kv_*`` of ``usage.pdserve_timings``: blocks
moved, found on the decode, bytes), where the prompt was computed (``prefill_path``,
``prompt_tokens_computed``) and TTFT, and checks the issue's bound: bytes moved <= the new
tokens' KV plus one block (plus the fs records' 64-byte headers).

    python -m benchmarks.system.multiturn_handoff            # the committed CPU run

Writes ``benchmarks/results/system/multiturn_handoff_cpu.json`` and ``.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.record import recorded_command, result_path
from pdserve.procs import free_ports

REPO = Path(__file__).resolve().parents[2]
HEADER = 64  # an fs record's header (kv_store/record.py)
TOPICS = ["gardening", "the history of Rome", "sorting algorithms", "sailing", "bread baking"]


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def _wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy within {timeout_s} s")


MODES = ("full", "delta", "local")


@contextmanager
def stack(args: argparse.Namespace, mode: str, logs: Path) -> Iterator[str]:
    """Prefill + decode + router; yields the router's base URL. ``full``: the decode's
    prefix cache is off (every turn's handoff moves the whole prompt); ``local``: the
    router's ``--max-local-prefill-tokens`` is ``args.max_local_prefill_tokens``, else 0."""
    p_port, p_metrics, d_port, d_metrics, r_port = free_ports(5)
    engine = ["--model", args.model, "--kv-cache-memory", args.kv_cache_memory]
    engine += ["--torch-threads", "1", "--max-num-seqs", "4", *args.connector_flags.split()]
    procs = []
    try:
        for role, port, metrics in (("prefill", p_port, p_metrics), ("decode", d_port, d_metrics)):
            argv = [sys.executable, "-m", "pdserve", role, "--host", "127.0.0.1"]
            argv += ["--port", str(port), "--metrics-port", str(metrics), *engine]
            if role == "decode" and mode == "full":
                argv.append("--no-prefix-caching")
            procs.append(_spawn(argv, logs / f"{role}.log"))
        argv = [sys.executable, "-m", "pdserve", "router", "--host", "127.0.0.1"]
        argv += ["--port", str(r_port), "--model", args.model, "--served-model-name", "m"]
        argv += ["--mode", "disaggregated", "--prefill-urls", f"127.0.0.1:{p_port}"]
        argv += ["--decode-urls", f"127.0.0.1:{d_port}", "--health-interval", "0.5"]
        local = args.max_local_prefill_tokens if mode == "local" else 0
        argv += ["--max-local-prefill-tokens", str(local)]
        procs.append(_spawn(argv, logs / "router.log"))
        _wait_http(f"http://127.0.0.1:{r_port}/health", args.startup_timeout)
        yield f"http://127.0.0.1:{r_port}"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def conversation(base: str, index: int, turns: int, max_tokens: int) -> list[dict[str, Any]]:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    topic = TOPICS[index % len(TOPICS)]
    messages: list[dict[str, str]] = [
        {"role": "system", "content": f"You are a patient tutor. Conversation {index}."}
    ]
    rows, previous = [], 0
    for turn in range(turns):
        messages.append(
            {"role": "user", "content": f"Turn {turn}: tell me one more thing about {topic}, "
             f"and connect it to what you said before in a sentence or two."}
        )  # fmt: skip
        out = client.chat.completions.create(
            model="m", messages=messages, max_tokens=max_tokens, temperature=0,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True, "pdserve_timings": True},
        )  # fmt: skip
        messages.append({"role": "assistant", "content": out.choices[0].message.content or ""})
        usage = out.usage.model_extra if out.usage is not None else {}
        prompt = out.usage.prompt_tokens if out.usage is not None else 0
        timings = usage["pdserve_timings"]
        rows.append(
            {
                "conversation": index,
                "turn": turn,
                "prompt_tokens": prompt,
                "new_tokens": prompt - previous,
                "ttft_s": usage["pdserve_timings"]["ttft"],
                "blocks_moved": usage["pdserve_timings"].get("kv_blocks_loaded", 0),
                "blocks_on_decode": usage["pdserve_timings"].get("kv_blocks_on_decode", 0),
                "bytes": usage["pdserve_timings"].get("kv_bytes_loaded", 0),
                "prefill_path": timings.get("prefill_path", ""),
                "tokens_computed": timings.get("prompt_tokens_computed", prompt),
            }
        )
        previous = prompt
    return rows


def kv_bytes_per_token(model: str, connector: str) -> int:
    """float32 K and V of every layer's KV heads for one token (the CPU cache's dtype)."""
    from common.models import resolve_model

    cfg = json.loads((Path(resolve_model(model)) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * heads * head_dim * 4


def bound_ok(row: dict[str, Any], per_token: int, fs: bool, block: int = 16) -> bool:
    """Bytes moved <= (new tokens + one block) of KV (+ a header per moved fs record)."""
    headers = HEADER * row["blocks_moved"] if fs else 0
    return bool(row["bytes"] <= (row["new_tokens"] + block) * per_token + headers)


def _warm_up(base: str, timeout_s: float = 120.0) -> None:
    """Until a request goes through a prefill instance (the router may answer before both
    pools are healthy; a request then would be computed on the decode)."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    deadline, attempt = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        # A new prompt each time, over a block long: one the decode holds whole (any prompt
        # without a full block) skips the prefill (decode_first).
        attempt += 1
        prompt = f"Warm up, attempt {attempt}: " + "the quick brown fox jumps " * 8
        out = client.completions.create(
            model="m", prompt=prompt, max_tokens=2,  # 1: the prefill answers alone
            extra_body={"pdserve_timings": True},
        )  # fmt: skip
        usage = out.usage.model_extra if out.usage is not None else {}
        if usage["pdserve_timings"].get("kv_blocks_loaded"):
            return
        time.sleep(1.0)
    raise RuntimeError("no request went through a prefill instance")


def run_mode(args: argparse.Namespace, mode: str, logs: Path) -> list[dict[str, Any]]:
    logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with stack(args, mode, logs) as base:
        _warm_up(base)
        for c in range(args.conversations):
            rows += conversation(base, c, args.turns, args.max_tokens)
    return rows


def per_turn(rows: list[dict[str, Any]], turns: int) -> list[dict[str, Any]]:
    out = []
    for t in range(turns):
        mine = [r for r in rows if r["turn"] == t]
        out.append(
            {
                "turn": t,
                "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in mine),
                "new_tokens": statistics.mean(r["new_tokens"] for r in mine),
                "blocks_moved": statistics.mean(r["blocks_moved"] for r in mine),
                "blocks_on_decode": statistics.mean(r["blocks_on_decode"] for r in mine),
                "bytes": statistics.mean(r["bytes"] for r in mine),
                "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in mine),
                "local_share": statistics.mean(r["prefill_path"] == "local" for r in mine),
                "tokens_computed": statistics.mean(r["tokens_computed"] for r in mine),
            }
        )
    return out


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# Delta handoffs and local suffixes on a multi-turn chat (CPU)",
        "",
        f"`{doc['command']}`",
        "",
        f"Model {doc['model']}, connector `{doc['connector']}`, {doc['conversations']} "
        f"conversations x {doc['turns']} turns, {doc['max_tokens']} tokens per answer; KV "
        f"{doc['kv_bytes_per_token']} B/token. Bound (bytes moved <= new tokens' KV + one "
        f"block) held on {doc['bound_ok']} of {doc['turns_total']} delta turns (turns 1..).",
        "",
        f"Turns 1..{doc['turns'] - 1}: mean bytes moved per turn {doc['full_mean_kib']:.0f} KiB "
        f"(full) / {doc['delta_mean_kib']:.0f} KiB (delta) / {doc['local_mean_kib']:.0f} KiB "
        f"(local, `--max-local-prefill-tokens {doc['max_local_prefill_tokens']}`); median TTFT "
        f"{doc['full_ttft_ms']:.0f} / {doc['delta_ttft_ms']:.0f} / {doc['local_ttft_ms']:.0f} "
        f"ms; local: {doc['local_turns']} of {doc['turns_total']} turns computed on the decode "
        f"without a prefill. Machine load average during the run: {doc['loadavg'][0]:.1f} (a "
        "shared 2-core VM).",
        "",
        "| turn | prompt tok | new tok | delta: blocks moved / on decode | KiB full / delta / "
        "local | TTFT ms full / delta / local | local: share on decode, tokens computed |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = zip(doc["full_per_turn"], doc["delta_per_turn"], doc["local_per_turn"], strict=True)
    for f, d, loc in rows:
        lines.append(
            f"| {d['turn']} | {d['prompt_tokens']:.0f} | {d['new_tokens']:.0f} | "
            f"{d['blocks_moved']:.1f} / {d['blocks_on_decode']:.1f} | "
            f"{f['bytes'] / 1024:.0f} / {d['bytes'] / 1024:.0f} / {loc['bytes'] / 1024:.0f} | "
            f"{f['ttft_ms']:.0f} / {d['ttft_ms']:.0f} / {loc['ttft_ms']:.0f} | "
            f"{loc['local_share']:.1f}, {loc['tokens_computed']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--connector-flags", default="--connector p2p")
    ap.add_argument("--kv-cache-memory", default="512Mi")
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-local-prefill-tokens", type=int, default=256)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=str(result_path("system", "multiturn_handoff_cpu.json")))
    args = ap.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="multiturn_handoff_"))  # the services' logs
    runs = {mode: run_mode(args, mode, logs / mode) for mode in MODES}
    full, delta, local = runs["full"], runs["delta"], runs["local"]
    connector = args.connector_flags.split()[1]
    per_token = kv_bytes_per_token(args.model, connector)
    checked = [r for r in delta if r["turn"] > 0]
    doc = {
        "command": recorded_command("benchmarks.system.multiturn_handoff", argv),
        "model": args.model,
        "connector": connector,
        "conversations": args.conversations,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "max_local_prefill_tokens": args.max_local_prefill_tokens,
        "kv_bytes_per_token": per_token,
        "turns_total": len(checked),
        "bound_ok": sum(bound_ok(r, per_token, connector == "fs") for r in checked),
        "loadavg": os.getloadavg(),
        "delta_mean_kib": statistics.mean(r["bytes"] for r in checked) / 1024,
        "full_mean_kib": statistics.mean(r["bytes"] for r in full if r["turn"] > 0) / 1024,
        "delta_ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in checked),
        "full_ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in full if r["turn"] > 0),
        "local_mean_kib": statistics.mean(r["bytes"] for r in local if r["turn"] > 0) / 1024,
        "local_ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in local if r["turn"] > 0),
        "local_turns": sum(r["prefill_path"] == "local" for r in local if r["turn"] > 0),
        "delta_per_turn": per_turn(delta, args.turns),
        "full_per_turn": per_turn(full, args.turns),
        "local_per_turn": per_turn(local, args.turns),
        "delta": delta,
        "full": full,
        "local": local,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    Path(args.out).with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return 0 if doc["bound_ok"] == doc["turns_total"] else 1


if __name__ == "__main__":
    sys.exit(main())
