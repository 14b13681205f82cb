"""`pdserve tune` end to end: a two-point grid (2 colocated vs 1 prefill + 1 decode) over
real `pdserve up` runs with the tiny model, killed after its first point and resumed."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(900)


def tune_argv(model: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "pdserve", "tune", "--model", str(model), "--instances", "2",
            "--modes", "colocated,disaggregated", "--request-rates", "4", "--num-prompts", "6",
            "--input-len", "24", "--output-len", "4", "--num-warmups", "1",
            "--goodput", "e2e:600000", "--startup-timeout", "300", "--request-timeout", "60",
            "--out", str(out), "--no-progress"]  # fmt: skip


def result_lines(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_two_point_tune_killed_and_resumed(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tune"
    results = out / "results.jsonl"
    log1 = (tmp_path / "run1.log").open("wb")
    first = subprocess.Popen(tune_argv(tiny_model_dir, out), stdout=log1, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not result_lines(results) and first.poll() is None:
            assert time.monotonic() < deadline, "first grid point never finished"
            time.sleep(0.5)
        # Kill the tune after its first point: it must stop the `pdserve up` it runs.
        first.send_signal(signal.SIGTERM)
        first.wait(120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        log1.close()
    run1 = (tmp_path / "run1.log").read_text()
    ports = [int(p) for p in re.findall(r"pdserve up .*?--port (\d+)", run1)]
    assert ports, run1
    assert not any(port_open(p) for p in ports), "a pdserve up outlived the killed tune"
    done_first = result_lines(results)
    assert len(done_first) >= 1 and done_first[0]["status"] == "ok"

    second = subprocess.run(
        tune_argv(tiny_model_dir, out), capture_output=True, text=True, timeout=600, check=False
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert "2x colocated: already done, skipped" in second.stderr
    rows = result_lines(results)
    assert [(r["key"], r["status"]) for r in rows if r["status"] == "ok"] == [
        ("colocated:p0:d2:seqs=default:tokens=default", "ok"),
        ("disaggregated:p1:d1:seqs=default:tokens=default", "ok"),
    ]
    for row in rows:
        summary = row["summary"]
        assert isinstance(summary, dict)
        assert summary["completed"] == 6 and summary["failed"] == 0
        assert summary["good_requests"] == 6
    report = (out / "report.md").read_text()
    for label in ("2x colocated", "1P+1D disagg"):  # the best one is in bold
        assert re.search(rf"\| (\*\*)?{re.escape(label)}(\*\*)? \| 4 \|", report), report
    assert "Best:" in report
    values = yaml.safe_load((out / "values-best.yaml").read_text())
    assert set(values) == {"prefill", "decode", "router"}
    assert values["router"]["mode"] in ("colocated", "disaggregated")
    assert (out / "tune.png").read_bytes().startswith(b"\x89PNG")
    assert "Helm values" in second.stdout


def test_tune_runs_a_per_pool_tensor_parallel_split(tiny_model_dir: Path, tmp_path: Path) -> None:
    """One point: a prefill of TP 1 and a decode of TP 2 (gloo ranks on the CPU; the
    decode re-cuts the prefill's KV heads), benched like any other; TP 3 cannot split the
    tiny model's 4 heads and is left out of the grid."""
    out = tmp_path / "tune"
    argv = [sys.executable, "-m", "pdserve", "tune", "--model", str(tiny_model_dir),
            "--instances", "2", "--modes", "disaggregated", "--decode-tensor-parallel-sizes",
            "2,3", "--request-rates", "4", "--num-prompts", "4", "--input-len", "24",
            "--output-len", "4", "--num-warmups", "1", "--goodput", "e2e:600000",
            "--startup-timeout", "300", "--request-timeout", "60", "--out", str(out),
            "--no-progress"]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "--decode-tensor-parallel-sizes: 3 skipped" in run.stderr
    rows = result_lines(out / "results.jsonl")
    assert [(r["key"], r["status"]) for r in rows] == [
        ("disaggregated:p1:d1:seqs=default:tokens=default:tp=1/2", "ok")
    ]
    summary = rows[0]["summary"]
    assert isinstance(summary, dict) and summary["completed"] == 4 and summary["failed"] == 0
    assert "1P+1D disagg tp=P1/D2" in (out / "report.md").read_text()
    values = yaml.safe_load((out / "values-best.yaml").read_text())
    assert values["decode"] == {"replicas": 1, "tensorParallelSize": 2}
    assert values["prefill"] == {"replicas": 1, "tensorParallelSize": 1}
