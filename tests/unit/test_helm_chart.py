"""The Helm chart, rendered by the real ``helm`` binary and checked by the real
``kubernetes-validate`` schemas (Kubernetes 1.35, strict: unknown fields fail), then
inspected object by object."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from autoscaler.config import build_parser, env_name

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "pdserve"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
KUBE_VERSION = "1.35.0"
RELEASE = "rel"
NS = "serving"


def helm_binary() -> str:
    local = REPO / ".tools" / "bin" / "helm"
    if local.exists():
        return str(local)
    found = shutil.which("helm")
    if found is None:
        pytest.fail("the helm binary is missing: run `make tools` (installs .tools/bin/helm)")
    return found


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def render_text(*values: Path, sets: tuple[str, ...] = ()) -> str:
    args = ["template", RELEASE, str(CHART), "--namespace", NS, "--kube-version", KUBE_VERSION]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    return helm(*args).stdout


def render(*values: Path, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render_text(*values, sets=sets)) if d]


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in objs:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(
        f"{kind}/{name} not rendered; have {[(o['kind'], o['metadata']['name']) for o in objs]}"
    )


def kinds(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def container(workload: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def ci(name: str) -> Path:
    return CHART / "ci" / f"{name}-values.yaml"


def pod_templates(objs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for o in objs:
        if o["kind"] in {"Deployment", "StatefulSet", "Job"}:
            yield o["spec"]["template"]


def kubernetes_validate(text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "rendered.yaml"
    path.write_text(text)
    tool = [sys.executable, "-m", "kubernetes_validate"]
    if shutil.which("kubernetes-validate"):
        tool = [str(shutil.which("kubernetes-validate"))]
    return subprocess.run(
        [*tool, "--strict", "-k", KUBE_VERSION, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ci_values_cover_the_required_scenarios() -> None:
    assert {p.name for p in CI_VALUES} >= {
        "default-values.yaml",
        "redis-values.yaml",
        "lmcache-values.yaml",
        "fs-pvc-values.yaml",
        "autoscaler-values.yaml",
    }


@pytest.mark.parametrize(
    "values", [None, *CI_VALUES], ids=lambda v: "chart-defaults" if v is None else v.stem
)
def test_helm_lint_strict(values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION]
    if values is not None:
        args += ["-f", str(values)]
    proc = helm(*args, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda v: v.stem)
def test_rendered_objects_pass_strict_schema_validation(values: Path, tmp_path: Path) -> None:
    proc = kubernetes_validate(render_text(values), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ERROR" not in proc.stdout
    assert proc.stdout.count("passed for resource") >= 15


def test_schema_validation_would_catch_a_bad_field(tmp_path: Path) -> None:
    # Negative control: the validator really rejects an unknown field in our objects.
    text = render_text(ci("default")).replace(
        "terminationGracePeriodSeconds:", "terminationGracePeriodSecs:", 1
    )
    proc = kubernetes_validate(text, tmp_path)
    assert proc.returncode != 0 and "terminationGracePeriodSecs" in proc.stdout + proc.stderr


def test_engines_request_gpus_and_the_router_does_not() -> None:
    objs = render(ci("default"))
    for role in ("prefill", "decode"):
        c = container(find(objs, "Deployment", f"{RELEASE}-pdserve-{role}"), role)
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert c["command"] == ["pdserve", role]
    router = container(find(objs, "Deployment", f"{RELEASE}-pdserve-router"), "router")
    assert "nvidia.com/gpu" not in json.dumps(router["resources"])
    objs = render(
        ci("fs-pvc"),
        sets=(
            "prefill.resources.limits.nvidia\\.com/gpu=2",
            "prefill.resources.requests.nvidia\\.com/gpu=2",
        ),
    )
    c = container(find(objs, "Deployment", f"{RELEASE}-pdserve-prefill"))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_probes_and_graceful_termination() -> None:
    objs = render(ci("default"))
    for role in ("prefill", "decode"):
        dep = find(objs, "Deployment", f"{RELEASE}-pdserve-{role}")
        c = container(dep, role)
        assert c["startupProbe"]["grpc"] == {"port": 50051}
        assert c["readinessProbe"]["grpc"] == {"port": 50051}
        assert (
            c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 600
        )  # model load
        # Liveness must not fail while draining (the service reports NOT_SERVING then).
        assert "tcpSocket" in c["livenessProbe"] and "grpc" not in c["livenessProbe"]
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        # preStop sleep, then SIGTERM and the service's drain, must end before SIGKILL.
        assert pre_stop + float(env_of(c)["PDSERVE_DRAIN_GRACE"]) < grace
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
            "grpc": 50051,
            "metrics": 9090,
        }
    router = container(find(objs, "Deployment", f"{RELEASE}-pdserve-router"))
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert router["startupProbe"]["httpGet"]["path"] == "/health"


def test_standard_labels_and_matching_selectors() -> None:
    objs = render(ci("lmcache"), sets=("commonLabels.team=ml",))
    for obj in objs:
        labels = obj["metadata"]["labels"]
        for key in (
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/component",
            "app.kubernetes.io/managed-by",
            "app.kubernetes.io/version",
            "helm.sh/chart",
        ):
            assert key in labels, f"{obj['kind']}/{obj['metadata']['name']} lacks {key}"
        assert labels["team"] == "ml"
    workloads = {
        o["metadata"]["name"]: o for o in objs if o["kind"] in {"Deployment", "StatefulSet"}
    }
    for obj in kinds(objs, "Service"):
        selector = obj["spec"]["selector"]
        matched = [
            w
            for w in workloads.values()
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matched) == 1, (
            f"Service {obj['metadata']['name']} selects {len(matched)} workloads"
        )
    for name, w in workloads.items():
        sel = w["spec"]["selector"]["matchLabels"]
        assert sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        assert set(sel) == {
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/component",
        }, name
    for pdb in kinds(objs, "PodDisruptionBudget"):
        target = workloads[pdb["metadata"]["name"]]
        assert pdb["spec"]["selector"]["matchLabels"] == target["spec"]["selector"]["matchLabels"]


def _selectors(objs: list[dict[str, Any]]) -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    for o in objs:
        key = (o["kind"], o["metadata"]["name"])
        if o["kind"] in {"Deployment", "StatefulSet", "PodDisruptionBudget", "Service"}:
            out[key] = o["spec"]["selector"]
    return out


def test_selectors_are_stable_across_upgrades() -> None:
    before = _selectors(render(ci("default")))
    after = _selectors(
        render(
            ci("autoscaler"),
            sets=(
                "image.tag=9.9.9",
                "commonLabels.tier=gold",
                "router.replicas=5",
                "prefill.podAnnotations.x=y",
            ),
        )
    )
    shared = set(before) & set(after)
    assert {
        ("Deployment", f"{RELEASE}-pdserve-{c}") for c in ("router", "prefill", "decode")
    } <= shared
    for key in shared:
        assert before[key] == after[key], f"selector of {key} changed"


def test_rbac_is_least_privilege() -> None:
    objs = render(ci("autoscaler"))
    router_role = find(objs, "Role", f"{RELEASE}-pdserve-router")
    assert router_role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    scaler_role = find(objs, "Role", f"{RELEASE}-pdserve-autoscaler")
    targets = [f"{RELEASE}-pdserve-prefill", f"{RELEASE}-pdserve-decode"]
    assert scaler_role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments"],
            "resourceNames": targets,
            "verbs": ["get"],
        },
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": targets,
            "verbs": ["get", "patch"],
        },
    ]
    assert not kinds(objs, "ClusterRole") and not kinds(objs, "ClusterRoleBinding")
    for component in ("router", "autoscaler"):
        binding = find(objs, "RoleBinding", f"{RELEASE}-pdserve-{component}")
        pod = find(objs, "Deployment", f"{RELEASE}-pdserve-{component}")["spec"]["template"]["spec"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": NS}
        ]
        assert binding["roleRef"]["name"] == f"{RELEASE}-pdserve-{component}"
        assert pod["automountServiceAccountToken"] is True
    for role in ("prefill", "decode"):
        pod = find(objs, "Deployment", f"{RELEASE}-pdserve-{role}")["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
    # DNS discovery and rbac.create=false: no Role at all, no token in the router.
    objs = render(ci("redis"))
    assert not kinds(objs, "Role") and not kinds(objs, "RoleBinding")
    assert (
        find(objs, "Deployment", f"{RELEASE}-pdserve-router")["spec"]["template"]["spec"][
            "automountServiceAccountToken"
        ]
        is False
    )


def test_router_discovers_the_headless_engine_services() -> None:
    objs = render(ci("default"))
    env = env_of(container(find(objs, "Deployment", f"{RELEASE}-pdserve-router")))
    assert env["PDSERVE_DISCOVERY"] == "k8s"
    assert env["PDSERVE_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    for role in ("prefill", "decode"):
        svc = find(objs, "Service", env[f"PDSERVE_{role.upper()}_SERVICE"])
        assert (
            svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
        )
        assert {"name": "grpc", "port": int(env["PDSERVE_SERVICE_PORT"])}.items() <= svc["spec"][
            "ports"
        ][0].items()


def test_connectors() -> None:
    def config(objs: list[dict[str, Any]]) -> dict[str, str]:
        return find(objs, "ConfigMap", f"{RELEASE}-pdserve")["data"]

    objs = render(ci("default"))  # in-chart Redis
    sts = find(objs, "StatefulSet", f"{RELEASE}-pdserve-redis")
    assert config(objs)["PDSERVE_REDIS_URL"] == f"redis://{RELEASE}-pdserve-redis:6379/0"
    assert "--maxmemory-policy" in container(sts)["command"]
    objs = render(ci("redis"))  # external Redis
    assert (
        not kinds(objs, "StatefulSet")
        and config(objs)["PDSERVE_REDIS_URL"] == "redis://kv-redis.storage.svc:6379/1"
    )
    objs = render(ci("lmcache"))
    lm = find(objs, "Deployment", f"{RELEASE}-pdserve-lmcache")
    assert container(lm)["command"] == ["lmcache_server", "0.0.0.0", "65432"]
    assert config(objs)["PDSERVE_LMCACHE_URL"] == f"lm://{RELEASE}-pdserve-lmcache:65432"
    assert config(objs)["LMCACHE_TRACK_USAGE"] == "false"
    objs = render(ci("fs-pvc"))
    pvc = find(objs, "PersistentVolumeClaim", f"{RELEASE}-pdserve-kv")
    assert (
        pvc["spec"]["accessModes"] == ["ReadWriteMany"]
        and pvc["spec"]["storageClassName"] == "nfs-client"
    )
    assert (
        config(objs)["PDSERVE_KV_PATH"] == "/kv" and config(objs)["PDSERVE_KV_CAPACITY"] == "150Gi"
    )
    for role in ("prefill", "decode"):
        dep = find(objs, "Deployment", f"{RELEASE}-pdserve-{role}")
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        assert volumes["kv"]["persistentVolumeClaim"]["claimName"] == f"{RELEASE}-pdserve-kv"
        assert {"name": "kv", "mountPath": "/kv"} in container(dep)["volumeMounts"]
    objs = render(ci("autoscaler"))  # existing claim: none created
    assert not kinds(objs, "PersistentVolumeClaim")
    dep = find(objs, "Deployment", f"{RELEASE}-pdserve-decode")
    assert {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}["kv"][
        "persistentVolumeClaim"
    ]["claimName"] == "shared-kv"


def test_model_sources() -> None:
    objs = render(ci("lmcache"))  # Hugging Face download with a token
    prefill = find(objs, "Deployment", f"{RELEASE}-pdserve-prefill")["spec"]["template"]["spec"]
    init = prefill["initContainers"][0]
    assert init["command"][:3] == ["hf", "download", "meta-llama/Llama-3.2-1B-Instruct"]
    assert env_of(init)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert "--include" not in init["command"]
    router_init = find(objs, "Deployment", f"{RELEASE}-pdserve-router")["spec"]["template"]["spec"][
        "initContainers"
    ][0]
    assert "--include" in router_init["command"]  # the router only fetches tokenizer files
    assert (
        find(objs, "ConfigMap", f"{RELEASE}-pdserve")["data"]["PDSERVE_MODEL"]
        == "/models/llama-3.2-1b"
    )
    objs = render(ci("default"))
    init = find(objs, "Deployment", f"{RELEASE}-pdserve-decode")["spec"]["template"]["spec"][
        "initContainers"
    ][0]
    assert init["command"] == ["pdserve", "models", "pull", "smollm2", "--cache-dir", "/models"]
    objs = render(ci("fs-pvc"))
    spec = find(objs, "Deployment", f"{RELEASE}-pdserve-prefill")["spec"]["template"]["spec"]
    assert "initContainers" not in spec
    assert {v["name"]: v for v in spec["volumes"]}["model"]["persistentVolumeClaim"] == {
        "claimName": "models",
        "readOnly": True,
    }
    objs = render(ci("autoscaler"))
    spec = find(objs, "Deployment", f"{RELEASE}-pdserve-decode")["spec"]["template"]["spec"]
    assert {v["name"]: v for v in spec["volumes"]}["model"]["hostPath"] == {
        "path": "/mnt/models",
        "type": "Directory",
    }
    proc = helm("template", RELEASE, str(CHART), "--set", "model.source=pvc", check=False)
    assert proc.returncode != 0 and "model.pvc.claimName is required" in proc.stderr


def _component_envs() -> dict[str, set[str]]:
    """PDSERVE_* env twins of every flag of `pdserve router|prefill|decode` (the real CLI)."""
    import argparse

    from pdserve.cli import build_parser
    from pdserve.settings import env_name as pdserve_env

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    top = {
        pdserve_env(a.option_strings[0])
        for a in parser._actions
        if a.option_strings and a.option_strings[0] != "-h"
    }
    out = {}
    for name in ("router", "prefill", "decode"):
        actions = sub.choices[name]._actions
        out[name] = top | {
            pdserve_env(a.option_strings[0])
            for a in actions
            if a.option_strings[0:1] and a.option_strings[0].startswith("--")
        }
    return out


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda v: v.stem)
def test_env_vars_are_flags_the_components_know(values: Path) -> None:
    known = _component_envs()
    objs = render(values)
    shared = {
        k for k in find(objs, "ConfigMap", f"{RELEASE}-pdserve")["data"] if k.startswith("PDSERVE_")
    }
    assert shared <= known["prefill"] | known["router"], shared - known["prefill"] - known["router"]
    for role in ("router", "prefill", "decode"):
        env = {
            k
            for k in env_of(container(find(objs, "Deployment", f"{RELEASE}-pdserve-{role}")))
            if k.startswith("PDSERVE_")
        }
        assert env <= known[role], f"{role}: {env - known[role]}"


def test_pdserve_tune_output_installs(tmp_path: Path) -> None:
    from pdserve.tune_grid import GridPoint, helm_values

    snippet = helm_values(
        GridPoint(
            mode="disaggregated", prefill=2, decode=5, max_num_seqs=128, max_num_batched_tokens=4096
        )
    )
    path = tmp_path / "tune-values.yaml"
    path.write_text(snippet)
    objs = render(path)
    for role, replicas in (("prefill", 2), ("decode", 5)):
        dep = find(objs, "Deployment", f"{RELEASE}-pdserve-{role}")
        assert dep["spec"]["replicas"] == replicas
        env = env_of(container(dep))
        assert (
            env["PDSERVE_MAX_NUM_SEQS"] == "128" and env["PDSERVE_MAX_NUM_BATCHED_TOKENS"] == "4096"
        )


def test_bad_values_are_rejected_with_a_clear_error() -> None:
    for sets, message in [
        ("connector.type=s3", "connector/type"),
        ("router.discovery=consul", "router/discovery"),
        ("decode.kvLoadFailure=ignore", "kvLoadFailure"),
        ("prefill.typo=1", "typo"),
        (
            "autoscaler.enabled=true,autoscaler.prefill.minReplicas=9",
            "minReplicas (9) must not exceed",
        ),
    ]:
        proc = helm("template", RELEASE, str(CHART), "--set", sets, check=False)
        assert proc.returncode != 0 and message in proc.stderr, (sets, proc.stderr)


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


def test_pods_run_unprivileged() -> None:
    for tpl in pod_templates(render(ci("lmcache"))):
        spec = tpl["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
