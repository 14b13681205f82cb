"""benchmarks/system/system_overhead.py: its arithmetic and report, and a real ``--quick`` run.

The smoke run starts two real ``pdserve up`` systems (disaggregated with the fs connector,
and colocated) on the tiny model, drives them with the HTTP client beside the in-process
engine, and checks the JSON's shape and sanity, never its speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.system.system_overhead import parse_args
from benchmarks.system.system_overhead_report import (
    Stream,
    latency_summary,
    overhead,
    paired_added,
    phase_medians,
    render_markdown,
)

REPO = Path(__file__).resolve().parents[2]


def _stream(times_ms: list[float], timings: dict[str, float | str] | None = None) -> Stream:
    return Stream([t / 1e3 for t in times_ms], len(times_ms), "x" * len(times_ms), timings)


def _summary(**p50s: float) -> dict[str, Any]:
    """A latency_summary-shaped dict with the given p50s (p99 = 2 × p50)."""
    return {f"{k}_ms": {"p50": v, "p99": 2 * v} for k, v in p50s.items()}


def test_latency_summary_percentiles_gaps_and_bursts() -> None:
    fast = _stream([10.0, 12.0, 14.0, 16.0])  # gaps 2, 2, 2
    bursty = _stream([20.0, 30.0, 30.1, 40.0])  # gaps 10, 0.1, 9.9
    s = latency_summary([fast, bursty])
    assert (s["requests"], s["tokens"]) == (2, 8)
    assert s["ttft_ms"]["p50"] == pytest.approx(15.0)
    assert s["ttft_ms"]["count"] == 2
    assert s["itl_ms"]["p50"] == pytest.approx(2.0)  # of 0.1, 2, 2, 2, 9.9, 10
    assert s["itl_ms"]["count"] == 6
    assert s["first_gap_ms"]["p50"] == pytest.approx(6.0)  # of 2 and 10
    assert s["steady_itl_ms"]["p50"] == pytest.approx(2.0)  # of 0.1, 2, 2, 9.9
    assert s["tpot_ms"]["p50"] == pytest.approx((2.0 + 20.0 / 3) / 2)
    assert s["e2e_ms"]["p50"] == pytest.approx(28.0)
    assert s["burst_fraction"] == pytest.approx(1 / 6)
    one_token = latency_summary([_stream([5.0])])
    assert one_token["itl_ms"] is None and one_token["tpot_ms"] is None
    with pytest.raises(ValueError, match="at least one token"):
        latency_summary([])
    with pytest.raises(ValueError, match="at least one token"):
        latency_summary([fast, _stream([])])


def test_overhead_arithmetic_and_targets() -> None:
    base = _summary(ttft=4.0, itl=2.0, tpot=2.0, e2e=70.0)
    o = overhead(base, _summary(ttft=8.5, itl=2.5, tpot=2.9, e2e=100.0), 5.0, 1.0)
    assert o["added_ttft_p50_ms"] == pytest.approx(4.5)
    assert o["added_ttft_p99_ms"] == pytest.approx(9.0)
    assert o["ttft_p50_ratio"] == pytest.approx(8.5 / 4.0)
    assert o["added_itl_p50_ms"] == pytest.approx(0.5)
    assert o["added_e2e_p50_ms"] == pytest.approx(30.0)
    assert o["ttft_target_met"] and o["itl_target_met"]
    # A bursty stream: its median gap is ~0 but its per-request mean gap grew by 3 ms.
    bursty = overhead(base, _summary(ttft=9.5, itl=0.01, tpot=5.0, e2e=160.0), 5.0, 1.0)
    assert bursty["added_itl_p50_ms"] < 0
    assert not bursty["itl_target_met"] and not bursty["ttft_target_met"]
    zero = overhead(_summary(ttft=0.0, itl=1.0, tpot=1.0, e2e=1.0), base, 5.0, 1.0)
    assert zero["ttft_p50_ratio"] is None


def test_paired_added_is_the_median_of_per_request_differences() -> None:
    base = [_stream([5.0, 7.0, 9.0]), _stream([6.0, 8.0, 10.0]), _stream([50.0, 52.0, 54.0])]
    other = [_stream([9.0, 12.0, 15.0]), _stream([8.0, 11.0, 14.0]), _stream([52.0, 54.0, 56.0])]
    added = paired_added(base, other)
    assert added["ttft"] == pytest.approx(2.0)  # of 4, 2, 2
    assert added["tpot"] == pytest.approx(1.0)  # of 1, 1, 0
    assert added["e2e"] == pytest.approx(4.0)  # of 6, 4, 2
    with pytest.raises(ValueError, match="equally many"):
        paired_added(base, other[:2])


def test_phase_medians_and_time_outside_the_router() -> None:
    a = _stream([10.0, 12.0], {"router_queue": 0.001, "ttft": 0.006})
    b = _stream([14.0, 16.0], {"router_queue": 0.003, "ttft": 0.008, "prefill_path": "local"})
    phases = phase_medians([a, b, _stream([1.0])])  # the untimed stream is ignored
    assert list(phases) == ["router_queue", "ttft", "outside_router"]
    assert phases["router_queue"] == pytest.approx(2.0)
    assert phases["ttft"] == pytest.approx(7.0)
    assert phases["outside_router"] == pytest.approx(5.0)  # of 4 and 6
    assert phase_medians([_stream([1.0, 2.0])]) == {}


def _result() -> dict[str, Any]:
    base = [_stream([5.0, 7.0, 9.0]), _stream([6.0, 8.0, 10.0])]
    slow = [
        _stream([12.0, 15.5, 19.0], {"ttft": 0.009}),
        _stream([13.0, 16.5, 20.0], {"ttft": 0.01}),
    ]
    low = latency_summary(slow)
    system = {
        "command": "pdserve up --model TINY_LLAMA_DIR",
        "startup_s": 12.0,
        "low_load": low,
        "overhead": overhead(latency_summary(base), low, 5.0, 1.0),
        "paired_added_ms": paired_added(base, slow),
        "phases_ms": phase_medians(slow),
        "outputs_equal_to_inprocess": 2,
        "sweep": [
            {"concurrency": 4, "requests": 8, "completed": 8, "errors": {}, "wall_s": 0.5,
             "req_per_s": 16.0, "output_tok_per_s": 128.0, "ttft_p50_ms": 21.5},
            {"concurrency": 8, "requests": 8, "completed": 7, "errors": {"RequestFailed": 1},
             "wall_s": 0.5, "req_per_s": 14.0, "output_tok_per_s": 112.0, "ttft_p50_ms": None},
        ],
        "max_sustained_req_s": 16.0,
    }  # fmt: skip
    return {
        "command": "python -m benchmarks.system.system_overhead --quick",
        "host": {
            "cpu_count": 2,
            "loadavg_start": [7.5, 7, 7],
            "loadavg_systems_ready": [8.25, 8, 8],
            "loadavg_end": [9.0, 9, 9],
        },  # fmt: skip
        "workload": {
            "requests": 2,
            "warmup": 1,
            "prompt_len": 64,
            "output_len": 3,
            "sweep_output_len": 8,
        },  # fmt: skip
        "targets": {"added_ttft_p50_ms": 5.0, "added_itl_p50_ms": 1.0},
        "inprocess": latency_summary(base),
        "engine_sync": latency_summary(base[:1]),
        "systems": {"disaggregated": system},
        "wall_s": 42.0,
    }


def test_render_markdown_tables_and_verdicts() -> None:
    md = render_markdown(_result())
    assert md.startswith("# System overhead")
    assert "    python -m benchmarks.system.system_overhead --quick" in md
    assert "load average 7.5/8.2/9.0" in md and "Whole run: 42 s" in md
    assert "| in-process | 5.50 |" in md  # TTFT p50 of 5 and 6 ms
    assert "| engine alone, sync steps | 5.00 |" in md
    assert "| disaggregated | 12.50 |" in md
    assert "| added TTFT p50 (target ≤ 5) | 7.00 |" in md
    assert "| TTFT p50 ratio | 2.27× |" in md
    assert "| added TTFT, median of pairs | 7.00 |" in md
    assert "| TTFT target | missed |" in md
    assert "| ITL target (ITL and TPOT) | missed |" in md  # TPOT 3.5 ms vs 2 ms in-process
    assert "| greedy text = in-process | 2/2 |" in md
    assert "| outside_router | 3.00 |" in md  # 12 − 9 and 13 − 10
    assert "| disaggregated | 4 | 8 | 0 | 16.0 | 128 | 21.50 |" in md
    assert "| disaggregated | 8 | 8 | 1 | 14.0 | 112 | – |" in md
    assert "best 16.0 req/s with zero errors" in md


def test_parse_args_quick_and_bad_input() -> None:
    quick = parse_args(["--quick"])
    assert (quick.requests, quick.output_len, quick.concurrency) == (4, 6, [1, 2])
    full = parse_args([])
    assert (full.requests, full.prompt_len, full.output_len) == (100, 64, 32)
    assert full.concurrency == [1, 4, 16, 32]
    for bad in (["--requests", "0"], ["--concurrency", "0"], ["--kv-cache-memory", "auto"],
                ["--kv-cache-memory", "lots"], ["--modes", "auto"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_quick_run_end_to_end(tmp_path: Path) -> None:
    out_json, out_md = tmp_path / "so.json", tmp_path / "so.md"
    argv = [sys.executable, "-m", "benchmarks.system.system_overhead", "--quick"]
    argv += ["--output-json", str(out_json), "--output-md", str(out_md)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out_json.read_text())
    work = result["workload"]
    n, out_len = work["requests"], work["output_len"]
    assert len(result["host"]["loadavg_end"]) == 3 and result["host"]["cpu_count"] >= 1
    summaries = [result["engine_sync"], result["inprocess"]]
    summaries += [s["low_load"] for s in result["systems"].values()]
    assert set(result["systems"]) == {"disaggregated", "colocated"}
    for summ in summaries:
        assert (summ["requests"], summ["tokens"]) == (n, n * out_len)
        assert summ["ttft_ms"]["count"] == n
        # A gap per chunk, and a chunk may carry merged steps (a busy 2-core machine merges
        # a few in process and through the router): at most one gap per token after the first.
        assert 0 < summ["itl_ms"]["count"] <= n * (out_len - 1)
        assert 0 < summ["ttft_ms"]["p50"] <= summ["ttft_ms"]["p99"] < 60_000
        assert 0 <= summ["itl_ms"]["p50"] <= summ["itl_ms"]["p99"]
        assert summ["ttft_ms"]["p50"] < summ["e2e_ms"]["p50"]
    for mode, s in result["systems"].items():
        assert s["outputs_equal_to_inprocess"] == n, f"{mode}: greedy text differs from in-process"
        assert s["startup_s"] > 0 and "pdserve up" in s["command"] and mode in s["command"]
        assert s["phases_ms"]["ttft"] > 0 and s["phases_ms"]["http_get_models"] > 0
        o = s["overhead"]
        assert o["added_ttft_p50_ms"] == pytest.approx(
            s["low_load"]["ttft_ms"]["p50"] - result["inprocess"]["ttft_ms"]["p50"]
        )
        assert [lv["concurrency"] for lv in s["sweep"]] == work["concurrency"]
        for lv in s["sweep"]:
            assert lv["errors"] == {} and lv["completed"] == lv["requests"] > 0
            assert lv["req_per_s"] > 0 and lv["ttft_p50_ms"] > 0
        assert s["max_sustained_req_s"] == max(lv["req_per_s"] for lv in s["sweep"])
    # The prefill hop really happened in one system and not in the other.
    assert result["systems"]["disaggregated"]["phases_ms"]["prefill_compute"] > 0
    assert result["systems"]["colocated"]["phases_ms"]["prefill_compute"] == 0
    md = out_md.read_text()
    assert "## Added over in-process" in md and "--quick" in md


def test_failed_starts_raise_with_the_reason(tmp_path: Path) -> None:
    """A system or engine worker that cannot start ends the run with an error, not a hang."""
    from benchmarks.system.system_overhead_paths import EngineWorker, PdserveUp
    from pdserve.procs import free_ports

    argv = [sys.executable, "-m", "pdserve", "up", "--model", str(tmp_path / "missing")]
    with pytest.raises(RuntimeError, match="did not become ready") as info:
        PdserveUp([*argv, "--port", str(free_ports(1)[0])], timeout_s=120).__enter__()
    assert "pdserve up failed" in str(info.value) and "missing" in str(info.value)
    with pytest.raises(RuntimeError, match="engine worker exited early"):
        EngineWorker(tmp_path / "missing", "64M", timeout_s=120).__enter__()
