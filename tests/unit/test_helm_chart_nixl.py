"""The chart with ``connector.type: nixl``: the lease knobs and the store beside it come from
``connector.p2p`` as for p2p, the UCX environment from ``connector.nixl.ucxEnv``; no p2p
port or host (NIXL's metadata rides in the handles); the engine pools may reach each
other's TCP (UCX connection setup); the two-node example renders and validates."""

from __future__ import annotations

from tests.unit.helm_support import RELEASE, ci, container, env_of, find, kinds, render


def _config(objs: list) -> dict:
    return find(objs, "ConfigMap", f"{RELEASE}-pdserve")["data"]


def test_nixl_two_nodes_with_a_store() -> None:
    objs = render(ci("nixl"))
    data = _config(objs)
    assert data["PDSERVE_CONNECTOR"] == "nixl" and data["PDSERVE_KV_STORE"] == "redis"
    assert (data["PDSERVE_P2P_LEASE_SECONDS"], data["PDSERVE_P2P_TIMEOUT"]) == ("20", "5")
    assert data["UCX_TLS"] == "rc,cuda_copy,cuda_ipc" and data["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert "PDSERVE_P2P_PORT" not in data
    assert find(objs, "StatefulSet", f"{RELEASE}-pdserve-redis")
    for role in ("prefill", "decode"):
        deployment = find(objs, "Deployment", f"{RELEASE}-pdserve-{role}")
        assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"pdserve.io/pool": role}
        pod = container(deployment)
        assert "PDSERVE_P2P_HOST" not in env_of(pod)
        assert "p2p" not in {p["name"] for p in pod["ports"]}
        assert pod["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1


def test_nixl_alone_opens_the_engine_pools_to_each_other() -> None:
    objs = render(sets=("connector.type=nixl", "networkPolicy.enabled=true"))
    data = _config(objs)
    assert data["PDSERVE_KV_STORE"] == "none"
    assert not [s for s in kinds(objs, "StatefulSet") if "redis" in s["metadata"]["name"]]
    policy = find(objs, "NetworkPolicy", f"{RELEASE}-pdserve-decode")
    peers = [
        rule for rule in policy["spec"]["ingress"]
        if rule.get("ports") == [{"protocol": "TCP"}]
    ]  # fmt: skip
    assert peers, policy
