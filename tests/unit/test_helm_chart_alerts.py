"""The chart's alert rules (``metrics.prometheusRule``) are valid Prometheus rules and fire
when they should: the rendered PrometheusRule's groups go through the real ``promtool``
(``check rules``, then ``test rules`` with series an operator would see)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.helm_support import NS, RELEASE, find, render

RULE_NAME = f"{RELEASE}-pdserve-alerts"
ALERTS = {
    "PdserveHighErrorRate",
    "PdserveTTFTOverSLO",
    "PdserveKVTransferFailures",
    "PdservePoolWithoutHealthyInstance",
}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is missing: run `make tools` (apt package prometheus)")
    return found


def rules_file(tmp_path: Path, *sets: str) -> Path:
    objs = render(sets=("metrics.prometheusRule.enabled=true", *sets))
    rule = find(objs, "PrometheusRule", RULE_NAME)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def run_promtool(*args: str) -> str:
    proc = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"promtool {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_no_rule_unless_enabled() -> None:
    assert not [o for o in render() if o["kind"] == "PrometheusRule"]


def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    path = rules_file(tmp_path)
    names = {r["alert"] for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]}
    assert names == ALERTS
    assert "SUCCESS: 4 rules found" in run_promtool("check", "rules", str(path))


def series(name: str, labels: dict[str, str], values: str) -> dict[str, Any]:
    text = ",".join(f'{k}="{v}"' for k, v in {"namespace": NS, **labels}.items())
    return {"series": f"{name}{{{text}}}", "values": values}


def test_rules_fire_on_the_series_they_watch(tmp_path: Path) -> None:
    """Ten minutes of a release whose decode pool went down at minute 1, a tenth of whose
    requests fail, whose TTFT sits in the 5 s bucket and whose KV loads fall back: every
    alert fires at minute 14 (their ``for`` set to 2m); the error alert stays silent for a
    healthy release."""
    path = rules_file(
        tmp_path, "metrics.prometheusRule.for=2m", "metrics.prometheusRule.poolDownFor=1m"
    )
    buckets = [
        series("pdserve_ttft_seconds_bucket", {"le": le}, v)
        for le, v in (("1", "0+0x15"), ("2.5", "0+0x15"), ("5", "0+10x15"), ("+Inf", "0+10x15"))
    ]
    tests = {
        "rule_files": [str(path)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    series("pdserve_requests_total", {"outcome": "success"}, "0+90x15"),
                    series("pdserve_requests_total", {"outcome": "error"}, "0+10x15"),
                    series(
                        "pdserve_instance_healthy", {"pool": "decode", "instance": "a"}, "1 0x15"
                    ),
                    series(
                        "pdserve_instance_healthy", {"pool": "prefill", "instance": "b"}, "1x15"
                    ),
                    series("pdserve_kv_load_fallbacks_total", {"reason": "recompute"}, "0+5x15"),
                    series(
                        "pdserve_disagg_decisions_total", {"decision": "remote_prefill"}, "0+20x15"
                    ),
                    *buckets,
                ],
                "alert_rule_test": [
                    {"eval_time": "14m", "alertname": name, "exp_alerts": expected(name)}
                    for name in sorted(ALERTS)
                ],
            },
            {
                "interval": "1m",
                "input_series": [
                    series("pdserve_requests_total", {"outcome": "success"}, "0+100x15"),
                    series("pdserve_requests_total", {"outcome": "error"}, "0+0x15"),
                ],
                "alert_rule_test": [
                    {"eval_time": "14m", "alertname": "PdserveHighErrorRate", "exp_alerts": []}
                ],
            },
        ],
    }
    test_path = tmp_path / "rules_test.yaml"
    test_path.write_text(yaml.safe_dump(tests))
    assert "SUCCESS" in run_promtool("test", "rules", str(test_path))


def expected(name: str) -> list[dict[str, Any]]:
    severity = (
        "critical"
        if name in ("PdserveHighErrorRate", "PdservePoolWithoutHealthyInstance")
        else "warning"
    )
    labels = {"severity": severity}
    if name == "PdservePoolWithoutHealthyInstance":
        labels["pool"] = "decode"
    annotations = {
        "PdserveHighErrorRate": "More than 5% of pdserve requests fail (error, unavailable or timeout).",
        "PdserveTTFTOverSLO": "TTFT p99 is 4.975s, over the 2s SLO.",
        "PdserveKVTransferFailures": "Prompt KV handoffs fail (recomputed instead of loaded); see pdserve_kv_load_fallbacks_total by reason.",
        "PdservePoolWithoutHealthyInstance": "No healthy instance in the decode pool (the router degrades to the other pool).",
    }
    return [{"exp_labels": labels, "exp_annotations": {"summary": annotations[name]}}]
