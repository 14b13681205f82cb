"""How long loading a compiled grammar stops the engine process's other threads (issue 36).

The grammar helper (``engine/sampling/grammar_worker.py``) sends a compiled grammar back
as xgrammar's JSON; the engine's reader thread turns it into a ``CompiledGrammar``. While
it does, a ticker thread (standing for the step loop) sleeps 1 ms at a time and records
its worst gap. Two ways of carrying the grammar over the same pipe:

- ``message``: inside the JSON reply (what the helper sent before): ``json.loads`` of the
  whole reply holds the GIL;
- ``payload``: as raw bytes after a short reply (what it sends now).

    python -m benchmarks.engine.grammar_load_stall --choices 4000

writes ``benchmarks/results/engine/grammar_load_stall.json`` (and ``--md``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.record import recorded_command, result_path
from common.models import pull_model
from engine.sampling.grammar_worker import _frame, _read_frame, _read_payload, _write_all


class Ticker:
    """A thread that sleeps 1 ms at a time; ``worst`` is its longest gap (s)."""

    def __init__(self) -> None:
        self.worst, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.worst, last = max(self.worst, now - last), now

    def __enter__(self) -> Ticker:
        self._thread.start()
        time.sleep(0.1)
        self.worst = 0.0
        return self

    def __exit__(self, *_: object) -> None:
        time.sleep(0.05)
        self._stop.set()
        self._thread.join()


def _load(way: str, text: str, info: Any) -> dict[str, float]:
    import xgrammar as xgr

    frame = (
        _frame({"id": 1, "ok": True, "compiled": text})
        if way == "message"
        else _frame({"id": 1, "ok": True}, text.encode())
    )
    r, w = os.pipe()

    def write() -> None:
        _write_all(w, frame)
        os.close(w)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    with Ticker() as ticker:
        t0 = time.perf_counter()
        msg = _read_frame(r)
        assert msg is not None
        if way == "message":
            got = msg["compiled"]
        else:
            payload = _read_payload(r, int(msg["payload"]))
            assert payload is not None
            got = payload.decode()
        t1 = time.perf_counter()
        xgr.CompiledGrammar.deserialize_json(got, info)
        t2 = time.perf_counter()
    writer.join()
    os.close(r)
    return {"read_s": round(t1 - t0, 3), "deserialize_s": round(t2 - t1, 3),
            "worst_gap_ms": round(ticker.worst * 1000, 1)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--choices", type=int, default=4000, help="choices of 50 characters")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=result_path("engine", "grammar_load_stall.json"))
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    import xgrammar as xgr
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(pull_model("smollm2").path)
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    choices = [f"choice number {i} " + "x" * 40 for i in range(args.choices)]
    ebnf = "root ::= " + " | ".join(json.dumps(c) for c in choices)
    text = compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf)).serialize_json()
    rows = {way: [_load(way, text, info) for _ in range(args.rounds)] for way in ("message", "payload")}  # fmt: skip
    report = {
        "command": recorded_command("benchmarks.engine.grammar_load_stall"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "grammar_mb": round(len(text) / 1e6, 1),
        "rounds": rows,
        "worst_gap_ms_median": {
            way: sorted(r["worst_gap_ms"] for r in runs)[len(runs) // 2]
            for way, runs in rows.items()
        },
    }
    text_out = json.dumps(report, indent=2)
    print(text_out)
    args.out.write_text(text_out + "\n")
    if args.md:
        lines = ["| carried as | read s | deserialize s | worst gap of another thread ms |",
                 "|---|---|---|---|"]  # fmt: skip
        for way, runs in rows.items():
            for r in runs:
                lines.append(
                    f"| {way} | {r['read_s']} | {r['deserialize_s']} | {r['worst_gap_ms']} |"
                )
        args.md.write_text(
            f"{report['grammar_mb']} MB grammar; `{report['command']}`\n\n"
            + "\n".join(lines)
            + "\n"
        )


if __name__ == "__main__":
    main()
