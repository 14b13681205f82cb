"""The chart's optional parts: the autoscaler (and the ServiceMonitors it brings) and the
Grafana dashboard, rendered by the real ``helm`` binary."""

from __future__ import annotations

import json
import re

from autoscaler.config import build_parser, env_name
from tests.unit.helm_support import RELEASE, ci, container, env_of, find, kinds, render


def test_autoscaler_owns_replicas_and_speaks_its_env_contract() -> None:
    objs = render(ci("autoscaler"))
    for role in ("prefill", "decode"):
        assert "replicas" not in find(objs, "Deployment", f"{RELEASE}-pdserve-{role}")["spec"]
    dep = find(objs, "Deployment", f"{RELEASE}-pdserve-autoscaler")
    c = container(dep)
    assert c["command"] == ["python", "-m", "autoscaler"] and dep["spec"]["replicas"] == 1
    env = env_of(c)
    known = {
        env_name(a.option_strings[0])
        for a in build_parser({})._actions
        if a.option_strings and a.option_strings[0].startswith("--")
    }
    assert set(env) <= known, f"unknown autoscaler env: {set(env) - known}"
    assert env["PDSERVE_AUTOSCALER_PREFILL_DEPLOYMENT"] == f"{RELEASE}-pdserve-prefill"
    assert (
        env["PDSERVE_AUTOSCALER_TTFT_P90_TARGET"] == "0.5"
        and env["PDSERVE_AUTOSCALER_DECODE_MIN"] == "2"
    )
    headless = env["PDSERVE_AUTOSCALER_METRICS_DNS"].split(".")[0]
    assert find(objs, "Service", headless)["spec"]["clusterIP"] == "None"
    assert {sm["metadata"]["name"] for sm in kinds(objs, "ServiceMonitor")} == {
        f"{RELEASE}-pdserve-{c}" for c in ("router", "prefill", "decode", "autoscaler")
    }
    assert not [o for o in render(ci("default")) if "autoscaler" in o["metadata"]["name"]]
    assert (
        "replicas"
        in find(render(ci("default")), "Deployment", f"{RELEASE}-pdserve-prefill")["spec"]
    )


def test_dashboard_queries_only_contract_metrics() -> None:
    objs = render(ci("default"))
    cm = find(objs, "ConfigMap", f"{RELEASE}-pdserve-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["pdserve.json"])
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    names = {m for e in exprs for m in re.findall(r"\b(pdserve_[a-z_]+?)(?:_bucket)?\{", e)}
    contract = {
        "pdserve_ttft_seconds",
        "pdserve_itl_seconds",
        "pdserve_tpot_seconds",
        "pdserve_e2e_seconds",
        "pdserve_phase_seconds",
        "pdserve_requests_total",
        "pdserve_kv_bytes_total",
        "pdserve_kv_load_fallbacks_total",
        "pdserve_disagg_decisions_total",
        "pdserve_instance_waiting",
        "pdserve_instance_running",
        "pdserve_instance_kv_usage",
        "pdserve_engine_prefix_hit_rate",
        "pdserve_autoscaler_current_replicas",
        "pdserve_autoscaler_desired_replicas",
        "pdserve_autoscaler_pressure",
    }
    assert names and names <= contract, names - contract
    assert {"pdserve_ttft_seconds", "pdserve_itl_seconds"} <= names
