"""The chart's core services (router, prefill, decode, KV connectors, model sources),
rendered by the real ``helm`` binary and inspected object by object."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.helm_support import (
    CHART,
    CI_VALUES,
    NS,
    RELEASE,
    ci,
    container,
    env_of,
    find,
    helm,
    kinds,
    pod_templates,
    render,
    workload,
)


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
    assert "PDSERVE_REDIS_URL" not in config(objs)  # password inside: env, from a Secret
    for role in ("prefill", "decode"):
        env = env_of(container(find(objs, "Deployment", f"{RELEASE}-pdserve-{role}")))
        assert (
            env["PDSERVE_REDIS_URL"] == f"redis://:$(REDIS_PASSWORD)@{RELEASE}-pdserve-redis:6379/0"
        )
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

    from common.flags import env_name as pdserve_env
    from pdserve.cli import build_parser

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
        env = {k for k in env_of(container(workload(objs, role))) if k.startswith("PDSERVE_")}
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


def test_pods_run_unprivileged() -> None:
    for tpl in pod_templates(render(ci("lmcache"))):
        spec = tpl["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_router_metrics_stay_scrapable_unless_asked() -> None:
    """With an API key the router guards /metrics, which the autoscaler and a
    ServiceMonitor scrape without one: the chart leaves it open unless told otherwise."""
    objs = render(ci("default"), sets=("router.apiKey.existingSecret=keys",))
    env = env_of(container(find(objs, "Deployment", f"{RELEASE}-pdserve-router"), "router"))
    assert env["PDSERVE_API_KEY"] == {"secretKeyRef": {"name": "keys", "key": "api-key"}}
    assert env["PDSERVE_PUBLIC_METRICS"] == "true"
    sets = ("router.apiKey.existingSecret=keys", "router.apiKey.publicMetrics=false")
    objs = render(ci("default"), sets=sets)
    env = env_of(container(find(objs, "Deployment", f"{RELEASE}-pdserve-router"), "router"))
    assert "PDSERVE_PUBLIC_METRICS" not in env


def test_control_plane_token_reaches_engines_and_router_from_a_secret() -> None:
    objs = render(ci("default"), sets=("grpcToken.existingSecret=cp",))
    ref = {"secretKeyRef": {"name": "cp", "key": "grpc-token"}}
    for role in ("prefill", "decode", "router"):
        c = container(find(objs, "Deployment", f"{RELEASE}-pdserve-{role}"), role)
        assert env_of(c)["PDSERVE_GRPC_TOKEN"] == ref, role
    for role in ("prefill", "decode", "router"):  # off by default
        c = container(find(render(ci("default")), "Deployment", f"{RELEASE}-pdserve-{role}"), role)
        assert "PDSERVE_GRPC_TOKEN" not in env_of(c), role


def test_kv_secret_reaches_the_engines_only_from_a_secret() -> None:
    objs = render(ci("default"), sets=("kvSecret.existingSecret=kvs",))
    ref = {"secretKeyRef": {"name": "kvs", "key": "kv-secret"}}
    for role in ("prefill", "decode"):
        c = container(find(objs, "Deployment", f"{RELEASE}-pdserve-{role}"), role)
        assert env_of(c)["PDSERVE_KV_SECRET"] == ref, role
    router = container(find(objs, "Deployment", f"{RELEASE}-pdserve-router"), "router")
    assert "PDSERVE_KV_SECRET" not in env_of(router)  # the router never touches records
    for role in ("prefill", "decode"):  # off by default
        c = container(find(render(ci("default")), "Deployment", f"{RELEASE}-pdserve-{role}"), role)
        assert "PDSERVE_KV_SECRET" not in env_of(c), role
