"""The pure half of `pdserve tune`: grid, resumable results file, best choice, Helm values."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve.bench.metrics import Slo
from pdserve.tune_grid import (
    GridPoint,
    ResultsFile,
    bench_fingerprint,
    best_row,
    build_grid,
    helm_values,
    parse_ratios,
    point_row,
    splits,
)
from pdserve.tune_report import render


def test_grid_two_instances() -> None:
    grid = build_grid(2, ["colocated", "disaggregated"])
    assert grid == [GridPoint("colocated", 0, 2), GridPoint("disaggregated", 1, 1)]
    assert grid[0].up_args() == ["--mode", "colocated", "--prefill", "0", "--decode", "2"]


def test_grid_product_of_knobs() -> None:
    grid = build_grid(4, ["disaggregated", "auto"], None, [8, 32], [512])
    shapes = {(p.mode, p.prefill, p.decode) for p in grid}
    assert shapes == {(m, p, 4 - p) for m in ("disaggregated", "auto") for p in (1, 2, 3)}
    assert len(grid) == 2 * 3 * 2
    assert {p.max_num_seqs for p in grid} == {8, 32}
    assert len({p.key for p in grid}) == len(grid)
    assert grid[0].up_args()[-4:] == ["--max-num-seqs", "8", "--max-num-batched-tokens", "512"]


def test_ratios() -> None:
    assert parse_ratios("1:1, 1:3") == [(1, 1), (1, 3)]
    assert splits(8, [(1, 1), (1, 3)]) == [(4, 4), (2, 6)]
    assert splits(3, None) == [(1, 2), (2, 1)]
    with pytest.raises(ValueError, match="does not split"):
        splits(3, [(1, 1)])
    for bad in ("1", "a:b", "0:1", "1:0"):
        with pytest.raises(ValueError, match="bad ratio"):
            parse_ratios(bad)


def test_grid_errors() -> None:
    with pytest.raises(ValueError, match="unknown mode"):
        build_grid(2, ["split"])
    with pytest.raises(ValueError, match="empty grid"):
        build_grid(1, ["disaggregated"])
    with pytest.raises(ValueError, match="instances"):
        build_grid(0, ["colocated"])
    assert build_grid(1, ["colocated"]) == [GridPoint("colocated", 0, 1)]


def summary(goodput: float, rps: float) -> dict[str, object]:
    stats = {"mean": 1.0, "p50": 1.0, "p90": 2.0, "p99": 3.0, "count": 4}
    return {
        "goodput": goodput,
        "request_throughput": rps,
        "output_throughput": rps * 10,
        "failed": 0,
        "ttft_ms": stats,
        "itl_ms": stats,
        "tpot_ms": stats,
        "e2e_ms": stats,
    }


def test_results_file_resume(tmp_path: Path) -> None:
    path = tmp_path / "out" / "results.jsonl"
    a, b = GridPoint("colocated", 0, 2), GridPoint("disaggregated", 1, 1)
    results = ResultsFile(path, "fp1")
    results.append(point_row(a, 1.0, "ok", summary=summary(0.5, 0.9)))
    results.append(point_row(b, 1.0, "launch_failed", error="boom"))
    ResultsFile(path, "other-workload").append(point_row(b, 2.0, "ok", summary=summary(9, 9)))
    with path.open("a") as fh:
        fh.write('{"key": "torn')  # a tune killed mid-write
    done = results.load()
    assert set(done) == {(a.key, 1.0)}  # failed and foreign lines are not "finished"
    assert results.load_latest()[(b.key, 1.0)]["status"] == "launch_failed"
    # a retry that succeeds supersedes the failure
    with path.open("a") as fh:
        fh.write("\n")
    results.append(point_row(b, 1.0, "ok", summary=summary(0.7, 0.8)))
    assert set(results.load()) == {(a.key, 1.0), (b.key, 1.0)}
    lines = [json.loads(x) for x in path.read_text().splitlines()[:2]]
    assert all(x["fingerprint"] == "fp1" for x in lines)


def test_fingerprint_depends_on_settings() -> None:
    base = {"workload": {"input_len": "64"}, "slo": {"e2e_ms": 500}}
    assert bench_fingerprint(base) == bench_fingerprint(dict(reversed(list(base.items()))))
    assert bench_fingerprint(base) != bench_fingerprint({**base, "slo": {"e2e_ms": 400}})


def test_best_row_by_goodput_then_throughput() -> None:
    a, b = GridPoint("colocated", 0, 2), GridPoint("disaggregated", 1, 1)
    rows = [
        point_row(a, 1.0, "ok", summary=summary(0.8, 1.0)),
        point_row(b, 1.0, "ok", summary=summary(0.8, 1.2)),
        point_row(b, 2.0, "ok", summary=summary(0.3, 1.9)),
        point_row(a, 2.0, "launch_failed", error="x"),
    ]
    assert best_row(rows) is rows[1]
    assert best_row(rows[3:]) is None


def test_helm_values_keys() -> None:
    values = yaml.safe_load(helm_values(GridPoint("disaggregated", 1, 3, 16, 1024)))
    assert values == {
        "prefill": {"replicas": 1},
        "decode": {"replicas": 3},
        "router": {"mode": "disaggregated"},
        "engine": {"maxNumSeqs": 16, "maxNumBatchedTokens": 1024},
    }
    # engine knobs left at their defaults: no `engine:` key (a null would wipe the chart's)
    values = yaml.safe_load(helm_values(GridPoint("colocated", 0, 2)))
    assert values == {
        "prefill": {"replicas": 0},
        "decode": {"replicas": 2},
        "router": {"mode": "colocated"},
    }


def test_report_lists_best_and_failures() -> None:
    a, b = GridPoint("colocated", 0, 2), GridPoint("disaggregated", 1, 1, 8)
    rows = [
        point_row(a, 1.0, "ok", summary=summary(0.4, 1.0)),
        point_row(b, 1.0, "ok", summary=summary(0.9, 1.0)),
        point_row(a, 4.0, "launch_failed", error="pdserve up exited\nmore"),
    ]
    report = render(rows, Slo(e2e_ms=500), "pdserve tune ...")
    assert report.best is rows[1]
    assert "| **1P+1D disagg seqs=8** | 1 | 0.900 |" in report.text
    assert "2x colocated @ 4 req/s: launch_failed: pdserve up exited" in report.text
    assert "E2E <= 500 ms" in report.text
    assert "maxNumSeqs: 8" in report.text


def _helm() -> str:
    root = Path(__file__).resolve().parents[2]
    local = root / ".tools" / "bin" / "helm"
    found = str(local) if local.exists() else shutil.which("helm")
    if not found:
        raise RuntimeError("helm not found: run `make tools` (installs .tools/bin/helm)")
    return found


@pytest.mark.parametrize(
    "point",
    [GridPoint("colocated", 0, 2), GridPoint("disaggregated", 1, 3, 16, 1024)],
    ids=["colocated", "disaggregated"],
)
def test_helm_values_deploy_the_configuration(point: GridPoint, tmp_path: Path) -> None:
    chart = Path(__file__).resolve().parents[2] / "helm" / "pdserve"
    values = tmp_path / "values-best.yaml"
    values.write_text(helm_values(point))
    rendered = subprocess.run(
        [_helm(), "template", "t", str(chart), "-f", str(values)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    deployments = {
        doc["metadata"]["name"]: doc
        for doc in yaml.safe_load_all(rendered)
        if doc and doc.get("kind") == "Deployment"
    }

    def env(name: str) -> dict[str, str]:
        containers = deployments[name]["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e.get("value") for c in containers for e in c.get("env", [])}

    assert deployments["t-pdserve-prefill"]["spec"]["replicas"] == point.prefill
    assert deployments["t-pdserve-decode"]["spec"]["replicas"] == point.decode
    assert env("t-pdserve-router")["PDSERVE_MODE"] == point.mode
    if point.max_num_seqs is not None:
        assert env("t-pdserve-decode")["PDSERVE_MAX_NUM_SEQS"] == str(point.max_num_seqs)
        assert env("t-pdserve-decode")["PDSERVE_MAX_NUM_BATCHED_TOKENS"] == str(
            point.max_num_batched_tokens
        )


def test_grid_per_pool_tensor_parallel_splits() -> None:
    grid = build_grid(3, ["colocated", "disaggregated"], None, prefill_tp=[1, 2], decode_tp=[1, 2])
    colocated = [p for p in grid if p.mode == "colocated"]
    # Colocated has no prefill pool: only the decode's sizes.
    assert {(p.prefill_tp, p.decode_tp) for p in colocated} == {(1, 1), (1, 2)}
    disagg = {(p.prefill, p.decode, p.prefill_tp, p.decode_tp) for p in grid} - {
        (0, 3, 1, 1),
        (0, 3, 1, 2),
    }
    assert disagg == {(p, 3 - p, a, b) for p in (1, 2) for a in (1, 2) for b in (1, 2)}
    assert len({p.key for p in grid}) == len(grid)
    split = GridPoint("disaggregated", 1, 2, prefill_tp=2, decode_tp=1)
    assert split.devices == 4
    assert split.key.endswith(":tp=2/1") and split.label == "1P+2D disagg tp=P2/D1"
    assert split.up_args()[-4:] == [
        "--prefill-tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1"
    ]  # fmt: skip
    # TP 1 on both pools keeps the key (and flags) of a grid without splits: results resume.
    assert GridPoint("disaggregated", 1, 2).key == "disaggregated:p1:d2:seqs=default:tokens=default"
    assert "--decode-tensor-parallel-size" not in GridPoint("disaggregated", 1, 2).up_args()
    solo = GridPoint("colocated", 0, 2, decode_tp=2)
    assert solo.up_args()[-2:] == ["--decode-tensor-parallel-size", "2"] and solo.devices == 4
    values = yaml.safe_load(helm_values(split))
    assert values["prefill"] == {"replicas": 1, "tensorParallelSize": 2}
    assert values["decode"] == {"replicas": 2, "tensorParallelSize": 1}


def test_grid_device_budget_drops_what_does_not_fit() -> None:
    grid = build_grid(
        2, ["disaggregated"], None, prefill_tp=[1, 2], decode_tp=[1, 2], device_budget=3
    )
    assert {(p.prefill_tp, p.decode_tp) for p in grid} == {(1, 1), (1, 2), (2, 1)}
    assert all(p.devices <= 3 for p in grid)
    with pytest.raises(ValueError, match="more than the 2 GPUs"):
        build_grid(2, ["disaggregated"], None, prefill_tp=[2], decode_tp=[2], device_budget=2)
    with pytest.raises(ValueError, match=">= 1"):
        build_grid(2, ["disaggregated"], None, prefill_tp=[0])


def test_tp_sizes_checked_against_the_model(tiny_model_dir: Path) -> None:
    """The tiny Llama has 4 heads and 2 KV heads: TP 3 cannot split it and is dropped;
    a pool with no valid size is an error naming its flag."""
    from pdserve.tune import valid_tp_sizes

    flag = "--decode-tensor-parallel-sizes"
    assert valid_tp_sizes(str(tiny_model_dir), flag, [1, 2, 3]) == [1, 2]
    with pytest.raises(ValueError, match=flag):
        valid_tp_sizes(str(tiny_model_dir), flag, [3])


def test_tune_flags_make_the_split_grid(tiny_model_dir: Path) -> None:
    from pdserve.cli import build_parser
    from pdserve.tune import plan_from_args

    argv = ["tune", "--model", str(tiny_model_dir), "--instances", "2", "--gpu-budget", "3"]
    argv += ["--modes", "disaggregated", "--prefill-tensor-parallel-sizes", "1,3"]
    argv += ["--decode-tensor-parallel-sizes", "1,2", "--goodput", "e2e:1000", "--out", "x"]
    plan = plan_from_args(build_parser().parse_args(argv))
    assert [(p.prefill_tp, p.decode_tp) for p in plan.grid] == [(1, 1), (1, 2)]
    with pytest.raises(ValueError, match="exactly one"):
        plan_from_args(build_parser().parse_args(argv[:7] + ["--goodput", "e2e:1", "--out", "x"]))


def test_visible_gpus_bound_the_splits_on_cuda() -> None:
    from pdserve.tune import visible_gpus

    assert visible_gpus(["--gpus", "4"], {"CUDA_VISIBLE_DEVICES": "0,1"}) == 4
    assert visible_gpus(["--gpu-ids", "2,3,5"], {}) == 3
    assert visible_gpus([], {"CUDA_VISIBLE_DEVICES": "0,1"}) == 2
    assert visible_gpus([], {}) is None
