"""benchmarks/system/serving_overhead.py and serving_profile.py: the per-stream arithmetic,
the step and CPU figures, the profile summary, and a small real run (the in-process engine
and a real decode service over gRPC) whose JSON shape and token counts are checked, never
its speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.system.serving_overhead_paths import (
    StreamRecord,
    cpu_per_token,
    step_delta,
    summarize,
)
from benchmarks.system.serving_profile import parse, render

REPO = Path(__file__).resolve().parents[2]


def test_merged_messages_count_every_token_and_tpot_spans_them() -> None:
    merged, single = StreamRecord(), StreamRecord()
    for t, n in ((0.010, 1), (0.020, 3), (0.030, 0), (0.040, 4)):
        merged.add(t, n)  # an empty message is no message
    for i in range(8):
        single.add(0.010 + i * 0.004, 1)
    assert merged.total == 8 and len(merged.times) == 3
    assert merged.tpot() == pytest.approx(0.030 / 7)
    s = summarize([merged, single], wall=0.05, want=8)
    assert s["complete"] == 2 and s["tokens_per_message"] == pytest.approx(16 / 11)
    assert s["output_tok_s"] == pytest.approx(16 / 0.05)
    assert StreamRecord().tpot() is None


def test_step_and_cpu_figures() -> None:
    before = {"steps": 10, "wall_s": 1.0, "cpu_s": 0.5}
    after = {"steps": 20, "wall_s": 1.1, "cpu_s": 0.56}
    d = step_delta(before, after)
    assert d["step_wall_ms"] == pytest.approx(10.0) and d["step_cpu_ms"] == pytest.approx(6.0)
    assert d["step_wait_ms"] == pytest.approx(4.0)
    assert step_delta(after, after) == {"steps": 0}
    cpu = cpu_per_token({"service": 1.0}, {"service": 1.5, "router": 0.2, "other": 9.0}, 1000)
    assert cpu == {
        "cpu_us_per_token_router": pytest.approx(200.0),
        "cpu_us_per_token_service": pytest.approx(500.0),
    }


def test_profile_summary_splits_processes_threads_and_waiting() -> None:
    up = 'process 1:"python -m pdserve up --mode colocated"'
    dec = 'process 2:"python -m pdserve --log-level INFO decode --port 1"'
    lines = [
        f"{up};{dec};thread (7): engine-loop;_run (engine/async_engine.py:1);step (engine/llm_engine.py:2) 6",
        f"{up};{dec};thread (7): engine-loop;_run (engine/async_engine.py:1);wait (threading.py:331) 4",
        f"{up};{dec};thread (8): MainThread;run (asyncio/runners.py:1);_run (asyncio/events.py:80) 9",
    ]
    profiles = parse(lines)
    engine = profiles["decode/engine-loop"]
    assert (engine.samples, engine.waiting) == (10, 4)
    assert engine.leaf["step (engine/llm_engine.py)"] == 6
    assert profiles["decode/MainThread"].inclusive["run (asyncio/runners.py)"] == 9
    text = render(Path("p.txt"), profiles, top=5)
    assert "### decode/engine-loop: 10 samples, 40% waiting" in text


def test_a_small_real_run_writes_every_path_it_was_asked(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    argv = [sys.executable, "-m", "benchmarks.system.serving_overhead", "--streams", "3"]
    argv += ["--output-len", "5", "--paths", "async", "service", "--output-json", str(out)]
    argv += ["--kv-cache-memory", "16Mi", "--startup-timeout", "180"]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["trees"]["current"]
    assert set(rows) == {"engine/3", "async/3", "service/3"}  # the worker runs both engines
    for key in ("async/3", "service/3"):
        row = rows[key]
        assert row["complete"] == 3 and row["streams"] == 3, (key, row)
        assert 1.0 <= row["tokens_per_message"] <= 5.0
    # in-process: the step timings and the CPU; the service runs its engine in a process of
    # its own (the default), whose CPU is counted apart (role "engine") and whose steps are
    # not timed (a few tokens may cost the service itself less than one clock tick)
    assert rows["async/3"]["steps"] > 0 and rows["async/3"]["cpu_us_per_token_service"] > 0
    service = rows["service/3"]
    assert service["cpu_us_per_token_service"] + service["cpu_us_per_token_engine"] > 0
    assert "| service | 3 |" in proc.stdout
