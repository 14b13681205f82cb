"""`pdserve bench throughput|latency` (pdserve/bench/offline.py) on a tiny model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.bench.offline import StepStats, add_offline_parsers, percentile, random_prompts


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve bench")
    add_offline_parsers(parser.add_subparsers(dest="bench_command", required=True))
    return parser.parse_args(argv)


def test_random_prompts_deterministic_and_in_range() -> None:
    a = random_prompts(5, 32, 1000, seed=3, spread=4)
    assert a == random_prompts(5, 32, 1000, seed=3, spread=4)
    assert a != random_prompts(5, 32, 1000, seed=4, spread=4)
    assert all(28 <= len(p) <= 36 for p in a)
    assert all(100 <= t < 1000 for p in a for t in p)
    assert {len(p) for p in random_prompts(3, 8, 1000, seed=0)} == {8}
    with pytest.raises(ValueError, match="spread must be in"):
        random_prompts(1, 8, 1000, seed=0, spread=8)


def test_percentile_and_step_stats() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    s = StepStats.of([0.001, 0.002, 0.003])
    assert (s.count, s.mean_ms, s.p50_ms, s.max_ms) == (
        3,
        pytest.approx(2.0),
        pytest.approx(2.0),
        pytest.approx(3.0),
    )
    assert StepStats.of([]).count == 0


def test_throughput_command(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tput.json"
    args = _parse(
        ["throughput", "--model", str(tiny_model_dir), "--num-prompts", "5", "--input-len", "20",
         "--output-len", "6", "--max-num-batched-tokens", "32", "--kv-cache-memory", str(1 << 22),
         "--output-json", str(out)]
    )  # fmt: skip
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    r = report["result"]
    assert report["benchmark"] == "throughput"
    assert (r["num_requests"], r["input_tokens"], r["output_tokens"]) == (5, 100, 30)
    # 100 prompt tokens at 32 per step need >= 4 steps, then decode steps.
    assert r["steps"]["count"] >= 4 + 5
    assert r["output_tokens_per_s"] == pytest.approx(30 / r["elapsed_s"])
    assert r["total_tokens_per_s"] == pytest.approx(130 / r["elapsed_s"])
    assert r["steps"]["p50_ms"] <= r["steps"]["p99_ms"] <= r["steps"]["max_ms"]
    printed = capsys.readouterr().out
    assert "Output tokens/s" in printed and str(out) in printed


def test_latency_command(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "lat.json"
    args = _parse(
        ["latency", "--model", str(tiny_model_dir), "--batch-size", "3", "--input-len", "10",
         "--output-len", "4", "--num-iters", "2", "--num-warmup", "1",
         "--kv-cache-memory", str(1 << 22), "--output-json", str(out)]
    )  # fmt: skip
    assert args.func(args) == 0
    r = json.loads(out.read_text())["result"]
    assert r["iterations"] == 2 and len(r["latencies_s"]) == 2
    assert min(r["latencies_s"]) <= r["p50_s"] <= max(r["latencies_s"])
    assert "Mean latency" in capsys.readouterr().out


def test_bad_flags_are_rejected(tiny_model_dir: Path) -> None:
    with pytest.raises(SystemExit):
        _parse(["throughput", "--num-prompts", "0"])
    args = _parse(["throughput", "--model", "/definitely/not/here"])
    with pytest.raises(SystemExit, match="unknown model"):
        args.func(args)
    args = _parse(["latency", "--model", str(tiny_model_dir), "--num-warmup", "-1"])
    with pytest.raises(SystemExit, match="--num-warmup must be >= 0"):
        args.func(args)
