"""The chart with ``engine.pipelineParallelSize`` P > 1 (docs/kubernetes.md, "Pipeline
parallelism"): every prefill/decode replica is a pipeline group, one StatefulSet of P pods
(pod k runs stage k, its ordinal label) with a headless Service that gives stage 0 a stable
DNS name, which every pod of the group gets as its leader address; the pool's discovery
Service selects the leaders only; the stages of a pool may reach each other; the
autoscaler (which scales Deployments) is refused."""

from __future__ import annotations

from typing import Any

from tests.unit.helm_support import NS, RELEASE, ci, container, env_of, find, helm, kinds, render

POD_INDEX = "apps.kubernetes.io/pod-index"
GROUP = "pdserve.io/pipeline-group"


def _groups(objs: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    name = f"{RELEASE}-pdserve-{role}-"
    return sorted(
        (s for s in kinds(objs, "StatefulSet") if s["metadata"]["name"].startswith(name)),
        key=lambda s: s["metadata"]["name"],
    )


def test_each_replica_is_a_statefulset_of_p_pods_with_a_headless_service() -> None:
    objs = render(ci("pipeline-parallel"))
    assert not [d for d in kinds(objs, "Deployment") if "router" not in d["metadata"]["name"]]
    for role, replicas in (("prefill", 1), ("decode", 2)):
        groups = _groups(objs, role)
        assert [g["metadata"]["name"] for g in groups] == [
            f"{RELEASE}-pdserve-{role}-{i}" for i in range(replicas)
        ]
        for i, sts in enumerate(groups):
            name = sts["metadata"]["name"]
            spec = sts["spec"]
            assert spec["replicas"] == 2  # P pods: one per stage
            assert spec["podManagementPolicy"] == "Parallel"  # the leader waits for all
            assert spec["serviceName"] == name
            # The selector is the group's own: two groups never claim each other's pods.
            assert spec["selector"]["matchLabels"][GROUP] == str(i)
            pod_labels = spec["template"]["metadata"]["labels"]
            assert pod_labels[GROUP] == str(i)
            assert pod_labels["app.kubernetes.io/component"] == role

            svc = find(objs, "Service", name)
            assert svc["spec"]["clusterIP"] == "None"
            # Stages look the leader up before anyone is ready.
            assert svc["spec"]["publishNotReadyAddresses"] is True
            assert svc["spec"]["selector"] == spec["selector"]["matchLabels"]
            assert svc["spec"]["ports"][0]["port"] == 29500

            c = container(sts, role)
            env = env_of(c)
            assert env["PDSERVE_PIPELINE_LEADER"] == f"{name}-0.{name}.{NS}.svc:29500"
            stage = env["PDSERVE_PIPELINE_STAGE"]["fieldRef"]["fieldPath"]
            assert stage == f"metadata.labels['{POD_INDEX}']"
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports["pipeline"] == 29500
            assert (ports["p2p"], ports["p2p-1"]) == (5557, 5558)  # per TP rank, as before
            # Each pod (stage) holds N = 2 GPUs: its stage's tensor-parallel ranks.
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    data = find(objs, "ConfigMap", f"{RELEASE}-pdserve")["data"]
    assert data["PDSERVE_PIPELINE_PARALLEL_SIZE"] == "2"
    assert data["PDSERVE_TENSOR_PARALLEL_SIZE"] == "2"


def test_discovery_sees_the_leaders_only_and_stages_reach_each_other() -> None:
    objs = render(ci("pipeline-parallel"))
    for role in ("prefill", "decode"):
        svc = find(objs, "Service", f"{RELEASE}-pdserve-{role}")
        assert svc["spec"]["selector"][POD_INDEX] == "0"
        assert svc["spec"]["publishNotReadyAddresses"] is False
        policy = find(objs, "NetworkPolicy", f"{RELEASE}-pdserve-{role}")
        same_pool = [
            rule
            for rule in policy["spec"]["ingress"]
            for peer in rule.get("from", [])
            if peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
            == role
        ]
        assert same_pool and same_pool[0]["ports"] == [{"protocol": "TCP"}]
    # P = 1: Deployments, discovery of every pod, no same-pool rule.
    plain = render(ci("default"))
    for role in ("prefill", "decode"):
        find(plain, "Deployment", f"{RELEASE}-pdserve-{role}")
        assert (
            POD_INDEX not in find(plain, "Service", f"{RELEASE}-pdserve-{role}")["spec"]["selector"]
        )
        assert not _groups(plain, role)
        env = env_of(container(find(plain, "Deployment", f"{RELEASE}-pdserve-{role}")))
        assert "PDSERVE_PIPELINE_LEADER" not in env


def test_custom_port_and_bad_values_are_refused() -> None:
    objs = render(sets=("engine.pipelineParallelSize=3", "engine.pipelinePort=31000"))
    sts = find(objs, "StatefulSet", f"{RELEASE}-pdserve-decode-0")
    assert sts["spec"]["replicas"] == 3
    assert env_of(container(sts))["PDSERVE_PIPELINE_LEADER"].endswith(".svc:31000")
    chart = str(ci("default").parents[1])
    for bad, says in (
        ("engine.pipelineParallelSize=0", "pipelineParallelSize"),
        ("engine.pipelinePort=80", "pipelinePort"),
    ):
        proc = helm("template", RELEASE, chart, "--set", bad, check=False)
        assert proc.returncode != 0 and says in proc.stderr, (bad, proc.stderr)
    proc = helm(
        "template",
        RELEASE,
        chart,
        "--set",
        "engine.pipelineParallelSize=2",
        "--set",
        "autoscaler.enabled=true",
        check=False,
    )
    assert proc.returncode != 0 and "autoscaler.enabled needs" in proc.stderr, proc.stderr


def test_every_stage_in_one_pod_is_a_deployment_of_p_times_n_gpus() -> None:
    """``pipelinePodPerStage: false``: the single-node form, no groups."""
    objs = render(ci("pipeline-parallel"), sets=("engine.pipelinePodPerStage=false",))
    assert not _groups(objs, "prefill") and not _groups(objs, "decode")
    for role in ("prefill", "decode"):
        c = container(find(objs, "Deployment", f"{RELEASE}-pdserve-{role}"), role)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"  # P x N
        assert "PDSERVE_PIPELINE_LEADER" not in env_of(c)
        svc = find(objs, "Service", f"{RELEASE}-pdserve-{role}")
        assert POD_INDEX not in svc["spec"]["selector"]
