"""The chart's hardening: read-only root filesystems with an emptyDir for every path a
process writes, ingress NetworkPolicies built from the selector labels, the in-chart Redis
behind a password that only ever travels in Secrets, and store keys namespaced per
release. Rendered by the real ``helm`` binary; helpers live in ``helm_support``."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from tests.unit.helm_support import (
    CHART,
    CI_VALUES,
    KUBE_VERSION,
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
)

P = f"{RELEASE}-pdserve"


def _selector(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": component,
    }


def _policies(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o["spec"] for o in kinds(objs, "NetworkPolicy")}


# --- read-only root filesystem ------------------------------------------------------


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda v: v.stem)
def test_every_container_has_a_read_only_root_and_no_privileges(values: Path) -> None:
    # The autoscaler scales Deployments: pipeline groups (StatefulSets) refuse it.
    pipeline = values.stem.startswith("pipeline")
    objs = render(values, sets=() if pipeline else ("autoscaler.enabled=true",))
    seen = 0
    for tpl in pod_templates(objs):
        spec = tpl["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            seen += 1
    assert seen >= 5


@pytest.mark.parametrize("values", ["default", "lmcache", "p2p", "autoscaler"])
def test_every_written_path_is_an_emptydir(values: str) -> None:
    """With a read-only root, whatever a process writes must be a volume: /tmp (HOME,
    Triton/torch/HF caches) everywhere, /dev/shm in the engines, the model download
    volume in the init containers, /data in Redis."""
    objs = render(ci(values), sets=("autoscaler.enabled=true",))
    for tpl in pod_templates(objs):
        spec = tpl["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"] + spec.get("initContainers", []):
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            writable = "/data" if c["name"] == "redis" else "/tmp"
            assert writable in mounts, (c["name"], sorted(mounts))
            assert "emptyDir" in volumes[mounts[writable]["name"]], c["name"]
            env = env_of(c)
            if "HOME" in env:
                assert env["HOME"] == "/tmp", c["name"]
            if c["name"] in ("prefill", "decode"):
                assert "emptyDir" in volumes[mounts["/dev/shm"]["name"]]
            if c["name"] == "fetch-model":  # writes the weights
                model = mounts[tpl["spec"]["containers"][0]["volumeMounts"][0]["mountPath"]]
                assert not model.get("readOnly") and "emptyDir" in volumes[model["name"]]


# --- NetworkPolicies ----------------------------------------------------------------


def test_network_policies_by_default() -> None:
    objs = render(ci("default"))
    pols = _policies(objs)
    assert set(pols) == {f"{P}-router", f"{P}-prefill", f"{P}-decode", f"{P}-redis"}
    for name, spec in pols.items():
        assert spec["policyTypes"] == ["Ingress"], name  # egress stays open
        # Each policy selects exactly its workload's pods (the Deployment's selector).
        component = name.removeprefix(f"{P}-")
        kind = "StatefulSet" if component == "redis" else "Deployment"
        workload = find(objs, kind, name)
        assert spec["podSelector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]
        assert spec["podSelector"]["matchLabels"] == _selector(component)
    # Router: its HTTP port, from anywhere.
    assert pols[f"{P}-router"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    router_ports = container(find(objs, "Deployment", f"{P}-router"))["ports"]
    assert "http" in {p["name"] for p in router_ports}
    # Engines: gRPC only from the router, metrics only from the monitoring namespace.
    for role in ("prefill", "decode"):
        rules = pols[f"{P}-{role}"]["ingress"]
        assert rules == [
            {
                "from": [{"podSelector": {"matchLabels": _selector("router")}}],
                "ports": [{"port": "grpc", "protocol": "TCP"}],
            },
            {
                "from": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
                        }
                    }
                ],
                "ports": [{"port": "metrics", "protocol": "TCP"}],
            },
        ]
        names = {p["name"] for p in container(find(objs, "Deployment", f"{P}-{role}"))["ports"]}
        assert {"grpc", "metrics"} <= names  # the named ports the policy refers to
    # Redis: only the engine pods (the router never touches the store).
    assert pols[f"{P}-redis"]["ingress"] == [
        {
            "from": [
                {"podSelector": {"matchLabels": _selector("prefill")}},
                {"podSelector": {"matchLabels": _selector("decode")}},
            ],
            "ports": [{"port": "redis", "protocol": "TCP"}],
        }
    ]


def test_p2p_engine_pools_reach_each_other_on_any_tcp_port() -> None:
    pols = _policies(render(ci("p2p")))
    for role, peer in (("prefill", "decode"), ("decode", "prefill")):
        rules = pols[f"{P}-{role}"]["ingress"]
        # The p2p control port plus NCCL's bootstrap/data ports: all TCP, from the peer pool.
        assert {
            "from": [{"podSelector": {"matchLabels": _selector(peer)}}],
            "ports": [{"protocol": "TCP"}],
        } in rules
        grpc = next(r for r in rules if r["ports"] == [{"port": "grpc", "protocol": "TCP"}])
        assert grpc["from"] == [{"podSelector": {"matchLabels": _selector("router")}}]
    assert f"{P}-redis" in pols  # the store beside p2p is fenced too
    # Store connectors: no engine-to-engine rule at all.
    for role in ("prefill", "decode"):
        assert all(
            r["ports"] != [{"protocol": "TCP"}]
            for r in _policies(render(ci("default")))[f"{P}-{role}"]["ingress"]
        )


def test_store_policies_follow_the_store_in_use() -> None:
    pols = _policies(render(ci("lmcache")))
    assert f"{P}-redis" not in pols
    assert pols[f"{P}-lmcache"]["ingress"][0]["ports"] == [{"port": "lm", "protocol": "TCP"}]
    assert pols[f"{P}-lmcache"]["podSelector"]["matchLabels"] == _selector("lmcache")
    # External stores and fs: nothing in-chart to fence.
    for values in ("redis", "fs-pvc"):
        pols = _policies(render(ci(values)))
        assert not {f"{P}-redis", f"{P}-lmcache"} & set(pols), values
    assert not kinds(render(ci("default"), sets=("networkPolicy.enabled=false",)), "NetworkPolicy")


def test_network_policy_peers_are_configurable() -> None:
    objs = render(ci("security"))
    pols = _policies(objs)
    router = pols[f"{P}-router"]["ingress"]
    peers = router[0]["from"]
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}
    } in peers
    # Restricting clients must not cut off the autoscaler or `helm test` ...
    assert {"podSelector": {"matchLabels": _selector("autoscaler")}} in peers
    assert {"podSelector": {"matchLabels": _selector("test")}} in peers
    test_job = kinds(objs, "Job")[0]["spec"]["template"]["metadata"]["labels"]
    assert _selector("test").items() <= test_job.items()
    # ... nor Prometheus scraping the router's /metrics.
    monitoring = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    assert {"from": [monitoring], "ports": [{"port": "http", "protocol": "TCP"}]} in router
    for role in ("prefill", "decode"):
        assert {"from": [monitoring], "ports": [{"port": "metrics", "protocol": "TCP"}]} in pols[
            f"{P}-{role}"
        ]["ingress"]
    assert pols[f"{P}-autoscaler"]["ingress"] == [
        {"from": [monitoring], "ports": [{"port": "metrics", "protocol": "TCP"}]}
    ]
    # No metrics peers: the engines take gRPC from the router and nothing else.
    pols = _policies(render(ci("default"), sets=("networkPolicy.metricsFrom=null",)))
    assert len(pols[f"{P}-decode"]["ingress"]) == 1


# --- Redis password -----------------------------------------------------------------


def _secret_ref(name: str, key: str) -> dict[str, Any]:
    return {"secretKeyRef": {"name": name, "key": key}}


def test_in_chart_redis_requires_a_generated_password() -> None:
    objs = render(ci("default"))
    secret = find(objs, "Secret", f"{P}-redis-auth")
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    assert len(password) >= 32 and password.isalnum()  # URL-safe: goes into redis://:PW@
    sts = find(objs, "StatefulSet", f"{P}-redis")
    c = container(sts, "redis")
    cmd = c["command"]
    assert cmd[cmd.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert cmd[cmd.index("--protected-mode") + 1] == "yes"
    env = env_of(c)
    ref = _secret_ref(f"{P}-redis-auth", "redis-password")
    assert env["REDIS_PASSWORD"] == ref and env["REDISCLI_AUTH"] == ref
    # $(VAR) expands only from variables defined earlier in the list.
    assert [e["name"] for e in c["env"]].index("REDIS_PASSWORD") == 0
    # The readiness probe authenticates (REDISCLI_AUTH); redis-cli exits 0 on NOAUTH, so
    # the probe looks for PONG.
    probe = " ".join(c["readinessProbe"]["exec"]["command"])
    assert "redis-cli ping" in probe and "PONG" in probe and password not in probe
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]


def test_engines_build_the_redis_url_from_the_secret() -> None:
    objs = render(ci("security"))
    assert not [s for s in kinds(objs, "Secret")]  # an existing Secret: none created
    ref = _secret_ref("pdserve-redis", "password")
    assert env_of(container(find(objs, "StatefulSet", f"{P}-redis")))["REDIS_PASSWORD"] == ref
    for role in ("prefill", "decode"):
        c = container(find(objs, "Deployment", f"{P}-{role}"), role)
        env = env_of(c)
        assert env["REDIS_PASSWORD"] == ref
        assert env["PDSERVE_REDIS_URL"] == f"redis://:$(REDIS_PASSWORD)@{P}-redis:6379/0"
        order = [e["name"] for e in c["env"]]
        assert order.index("REDIS_PASSWORD") < order.index("PDSERVE_REDIS_URL")
    router = env_of(container(find(objs, "Deployment", f"{P}-router"), "router"))
    assert "REDIS_PASSWORD" not in router and "PDSERVE_REDIS_URL" not in router


def test_the_expanded_url_authenticates_with_redis_py() -> None:
    """What Kubernetes hands the engines after $(REDIS_PASSWORD) expansion is a URL that
    redis-py (kv_store/redis_backend.py: ``Redis.from_url``) reads the password from."""
    objs = render(ci("default"))
    password = base64.b64decode(
        find(objs, "Secret", f"{P}-redis-auth")["data"]["redis-password"]
    ).decode()
    env = env_of(container(find(objs, "Deployment", f"{P}-decode"), "decode"))
    url = env["PDSERVE_REDIS_URL"].replace("$(REDIS_PASSWORD)", password)
    kwargs = redis.ConnectionPool.from_url(url).connection_kwargs
    assert kwargs["password"] == password and kwargs["host"] == f"{P}-redis"
    assert kwargs["port"] == 6379 and kwargs["db"] == 0 and kwargs.get("username") is None


def test_external_redis_url_with_a_password_comes_from_a_secret() -> None:
    objs = render(
        ci("default"), sets=("connector.redis.urlSecret.name=ext-redis", "kvKeyPrefix=x/")
    )
    assert not [o for o in objs if "redis" in o["metadata"]["name"] and o["kind"] != "ConfigMap"]
    assert "PDSERVE_REDIS_URL" not in find(objs, "ConfigMap", P)["data"]
    for role in ("prefill", "decode"):
        env = env_of(container(find(objs, "Deployment", f"{P}-{role}")))
        assert env["PDSERVE_REDIS_URL"] == _secret_ref("ext-redis", "redis-url")
        assert "REDIS_PASSWORD" not in env


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda v: v.stem)
def test_no_password_in_any_configmap(values: Path) -> None:
    objs = render(values)
    secrets = [
        base64.b64decode(v).decode() for s in kinds(objs, "Secret") for v in s["data"].values()
    ]
    for cm in kinds(objs, "ConfigMap"):
        text = json.dumps(cm["data"])
        for secret in secrets:
            assert secret not in text, cm["metadata"]["name"]
        for key, value in cm["data"].items():
            if key == "PDSERVE_REDIS_URL":
                assert "@" not in value, value  # no userinfo in a ConfigMap URL
            assert "REDIS_PASSWORD" not in value


def test_generated_password_is_looked_up_for_stability() -> None:
    """``helm template`` cannot reach a cluster, so the template must use ``lookup`` to keep
    an installed Secret's password on upgrade (checked in the template's text)."""
    text = (CHART / "templates" / "redis.yaml").read_text()
    assert 'lookup "v1" "Secret"' in text and "randAlphaNum" in text


# --- key namespace ------------------------------------------------------------------


def test_store_keys_are_namespaced_per_release() -> None:
    def prefix(release: str, *sets: str) -> str:
        args = ["template", release, str(CHART), "--namespace", NS, "--kube-version", KUBE_VERSION]
        for s in sets:
            args += ["--set", s]
        docs = [d for d in yaml.safe_load_all(helm(*args).stdout) if d]
        cm = next(d for d in docs if d["kind"] == "ConfigMap" and "PDSERVE_MODEL" in d["data"])
        return cm["data"]["PDSERVE_KV_KEY_PREFIX"]

    assert prefix("alpha") == "alpha/" and prefix("beta") == "beta/"
    # Two releases sharing one store: neither prefix is a prefix of the other's keys.
    assert not "beta/".startswith("alpha/") and not "alpha/".startswith("beta/")
    assert prefix("alpha", "kvKeyPrefix=shared/") == prefix("beta", "kvKeyPrefix=shared/")
    assert find(render(ci("security")), "ConfigMap", P)["data"]["PDSERVE_KV_KEY_PREFIX"] == (
        "team-a/"
    )
    for values in ("fs-pvc", "p2p"):  # every store connector gets it
        assert find(render(ci(values)), "ConfigMap", P)["data"]["PDSERVE_KV_KEY_PREFIX"] == (
            f"{RELEASE}/"
        )
